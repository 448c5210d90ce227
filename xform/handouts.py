"""The output storages replays handed out of the graph pool, and moving them out of a replay's way.

A replay hands its outputs out where the graph wrote them, in the pool, without a copy. Another
replay may then write that memory (its own outputs again, or another graph's intermediates). So
every storage handed out is remembered here through a weak reference, with its address range, and
before a replay writes a range, the handouts still alive in it are *moved out*: their bytes are
copied into a fresh ordinary allocation and the storage is pointed at it
(`UntypedStorage._swap_data_ptr_`), so the caller's tensors and every view of them keep their
values and never see the overwrite. A handout that died (the common case: logits read, then
dropped; saved activations released by the backward) costs nothing.

A handout is *owned* when it is the storage the recording itself allocated (a recording's first
replay hands those out): the allocator knows its block is in use, so a recording made while it is
alive never places anything there. Later handouts are unowned views of the same addresses, which
the allocator believes free: before a recording, those still alive are moved out.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

Ranges = Sequence[tuple[int, int]]  # sorted, disjoint [start, end) address ranges


@dataclass
class _Handout:
    ref: StorageWeakRef
    start: int
    end: int
    owned: bool


def _overlaps(ranges: Ranges, starts: list[int], start: int, end: int) -> bool:
    """Whether [start, end) meets one of `ranges` (whose starts are `starts`)."""
    i = bisect.bisect_right(starts, start) - 1
    if i >= 0 and ranges[i][1] > start:
        return True
    return i + 1 < len(ranges) and ranges[i + 1][0] < end


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` sorted, with overlapping and touching ones joined, empty ones dropped."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class Handouts:
    """The storages handed out of graph pools that may still be alive (one registry per process)."""

    def __init__(self) -> None:
        self._live: list[_Handout] = []
        self._lock = threading.Lock()
        self.moved_bytes = 0  # bytes copied to move handouts out of a replay's way, for the report

    def add(self, storage: torch.UntypedStorage, *, owned: bool) -> None:
        start = storage.data_ptr()
        with self._lock:
            self._live.append(_Handout(StorageWeakRef(storage), start, start + storage.nbytes(), owned))

    def alive(self) -> list[tuple[int, int, bool]]:
        """(start, end, owned) of every handout still alive."""
        with self._lock:
            self._live = [h for h in self._live if not h.ref.expired()]
            return [(h.start, h.end, h.owned) for h in self._live]

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in a live handout that the allocator protects (owned)."""
        address = t.untyped_storage().data_ptr()
        return any(start <= address < end and owned for start, end, owned in self.alive())

    def move_out(self, ranges: Ranges | None = None, *, unowned_only: bool = False) -> int:
        """Move every live handout meeting `ranges` (all of them when None) into fresh memory;
        returns the bytes moved."""
        starts = [r[0] for r in ranges] if ranges is not None else []
        with self._lock:
            keep, moving = [], []
            for h in self._live:
                storage = None if h.ref.expired() else torch.UntypedStorage._new_with_weak_ptr(h.ref.cdata)
                if storage is None:
                    continue
                hit = ranges is None or _overlaps(ranges, starts, h.start, h.end)
                (moving if hit and not (unowned_only and h.owned) else keep).append((h, storage))
            self._live = [h for h, _ in keep]
        if not moving:
            return 0
        sources = [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s) for _, s in moving]
        fresh = [torch.empty_like(s) for s in sources]
        torch._foreach_copy_(fresh, sources)
        for (_, storage), new in zip(moving, fresh):
            storage._swap_data_ptr_(new.untyped_storage())  # `new` now holds the pool address, and goes
        moved = sum(s.numel() for s in sources)
        self.moved_bytes += moved
        return moved


handouts = Handouts()
