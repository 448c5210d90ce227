"""The output storages replays handed out of the graph pool, and moving them out of a replay's way.

A replay hands its outputs out where the graph wrote them, in the pool, without a copy. Another
replay may then write that memory (its own outputs again, or another graph's intermediates). So
every storage handed out is remembered here through a weak reference, with its address range, and
before a replay writes a range, the handouts still alive in it are *moved out*: their bytes are
copied into a fresh ordinary allocation and the storage is pointed at it, so the caller's tensors
and every view of them keep their values and never see the overwrite. A handout that died (the
common case: logits read, then dropped; saved activations released by the backward) costs nothing.

A handout is *owned* when the allocator owns its block (a recording's first replay hands out the
recording's own allocations, a warm-up its own): a recording made while it is alive never places
anything there, and `resize_` moves it. Later handouts are unowned views of the same addresses,
which the allocator believes free: before a recording, those still alive are moved out, which
needs `UntypedStorage._swap_data_ptr_` (torch >= 2.13). Without it an unowned handout in the way
is *stuck*: the caller runs that call uncaptured, and the handout's producer copies its outputs
out from then on (`on_stuck`), as every replay did before outputs were handed out in place.

A handout registered with a `stale` message, owned or not, is not moved but *invalidated* where it
is in the way (`CudaGraphs(stale_outputs="error")`, CUDA Graph Trees' contract): its storage gives
up the memory (an owned block goes back to the allocator), and any later read of it raises that
message. Nothing is copied; the caller must clone what it keeps across calls. An input of the call
being made is still moved: the call reads it.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from xform._torch import memory, versions

Ranges = Sequence[tuple[int, int]]  # sorted, disjoint [start, end) address ranges


@dataclass
class _Handout:
    ref: StorageWeakRef
    start: int
    end: int
    owned: bool
    on_stuck: Callable[[], None] | None  # told when it is in the way and cannot be moved
    stale: str | None  # when set, invalidated where it is in the way, reads raising this message


@dataclass
class Cleared:
    """What `Handouts.move_out` did: bytes moved, the `on_stuck` of each handout that was in the way
    but could not be moved (then the caller must not write there), handouts invalidated."""

    moved: int = 0
    stuck: list[Callable[[], None] | None] = field(default_factory=list)
    invalidated: int = 0


def movable(storage: torch.UntypedStorage) -> bool:
    """Whether `storage` can be moved to fresh memory with its tensors following: any storage with
    `_swap_data_ptr_` (torch >= 2.13), else one the allocator owns (which `resize_` reallocates)."""
    return versions.STORAGE_SWAPS_DATA_PTR or storage.resizable()


def _move(storage: torch.UntypedStorage) -> None:
    if versions.STORAGE_SWAPS_DATA_PTR:
        fresh = torch.empty(storage.nbytes(), dtype=torch.uint8, device=storage.device).untyped_storage()
        fresh.copy_(storage)
        memory.swap_data_ptr(storage, fresh)  # `fresh` now holds the pool address, and goes
    else:
        storage.resize_(storage.nbytes())  # a fresh block, the bytes copied, the pool block freed


def _overlaps(ranges: Ranges, starts: list[int], start: int, end: int) -> bool:
    """Whether [start, end) meets one of `ranges` (whose starts are `starts`)."""
    i = bisect.bisect_right(starts, start) - 1
    if i >= 0 and ranges[i][1] > start:
        return True
    return i + 1 < len(ranges) and ranges[i + 1][0] < end


def meets(ranges: Ranges, start: int, end: int) -> bool:
    """Whether [start, end) meets one of `ranges`."""
    return _overlaps(ranges, [r[0] for r in ranges], start, end)


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` sorted, with overlapping and touching ones joined, empty ones dropped."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def subtract_ranges(ranges: Ranges, holes: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` without the address ranges `holes`."""
    left = list(ranges)
    for hole_start, hole_end in holes:
        cut: list[tuple[int, int]] = []
        for start, end in left:
            if end <= hole_start or start >= hole_end:
                cut.append((start, end))
                continue
            cut += [r for r in ((start, hole_start), (hole_end, end)) if r[1] > r[0]]
        left = cut
    return left


class Handouts:
    """The storages handed out of graph pools that may still be alive (one registry per process)."""

    def __init__(self) -> None:
        self._live: list[_Handout] = []
        self._lock = threading.Lock()

    def add(self, storage: torch.UntypedStorage, *, owned: bool, on_stuck: Callable[[], None] | None = None,
            stale: str | None = None) -> None:
        start = storage.data_ptr()
        with self._lock:
            self._live.append(_Handout(StorageWeakRef(storage), start, start + storage.nbytes(), owned, on_stuck,
                                       stale))

    def alive(self) -> list[tuple[int, int, bool]]:
        """(start, end, owned) of every handout still alive."""
        with self._lock:
            self._live = [h for h in self._live if not h.ref.expired()]
            return [(h.start, h.end, h.owned) for h in self._live]

    def owned(self) -> list[_Handout]:
        """The live handouts the allocator protects: a recording made now cannot place anything
        where those that outlive it lie."""
        with self._lock:
            self._live = [h for h in self._live if not h.ref.expired()]
            return [h for h in self._live if h.owned]

    def held(self, values: Sequence[Any]) -> set[int]:
        """The positions of the tensors among `values` that lie in a live handout the allocator
        protects (owned)."""
        owned = self.owned()
        return {i for i, t in enumerate(values) if isinstance(t, torch.Tensor)
                and any(h.start <= t.untyped_storage().data_ptr() < h.end for h in owned)}

    def move_out(self, ranges: Ranges | None = None, *, unowned_only: bool = False,
                 reading: Sequence[Any] = ()) -> Cleared:
        """Clear every live handout meeting `ranges` (all of them when None) out of the way: move it
        into fresh memory, or invalidate it if it was registered `stale` and is not among the
        tensors `reading` (the inputs of the call about to write). A handout that is in the way
        but cannot be moved (not `movable`) is reported `stuck`."""
        if not self._live:  # nothing handed out alive: the common case between replays
            return Cleared()
        starts = [r[0] for r in ranges] if ranges is not None else []
        with self._lock:
            self._live = [h for h in self._live if not h.ref.expired()]
            hits = [h for h in self._live if not (unowned_only and h.owned)
                    and (ranges is None or _overlaps(ranges, starts, h.start, h.end))]
        if not hits:
            return Cleared()
        # the storages the call reads, looked up only for a stale handout in the way
        read = {memory.storage_id(t.untyped_storage()) for t in reading if isinstance(t, torch.Tensor)} \
            if any(h.stale is not None for h in hits) else set()
        cleared, gone = Cleared(), set()
        for h in hits:
            storage = memory.storage_of(h.ref)
            if storage is None:  # died since
                gone.add(id(h))
            elif h.stale is not None and memory.storage_id(storage) not in read:
                memory.invalidate(storage, h.stale)
                cleared.invalidated += 1
                gone.add(id(h))
            elif movable(storage):
                _move(storage)
                cleared.moved += storage.nbytes()
                gone.add(id(h))
            else:
                cleared.stuck.append(h.on_stuck)
        with self._lock:
            self._live = [h for h in self._live if id(h) not in gone]
        return cleared


handouts = Handouts()
