"""Replay a compiled region function's recorded CUDA graphs, safely, from one memory pool.

Memory: every graph xform records on a device shares one pool, and a replay hands its outputs out
where the graph wrote them, in the pool, with no copy (as CUDA Graph Trees do). A recording keeps
addresses in the pool, not allocations: the pool is as large as the largest graph needs, not the
sum over graphs, and graphs may replay in any order. What keeps a handed-out output from being
overwritten by a later replay is `pool_outputs`: each recording knows the pool ranges it may
write (the pool memory that was free while it was recorded), and before it replays, the outputs
still alive in those ranges are moved out into ordinary memory (copied once, the caller's tensors
repointed). Outputs that die before the next replay (logits read and dropped, activations the
backward releases) are never copied; one recording per signature still serves callers that hold
outputs (a list of logits, accumulated gradients), at the price of one copy each. With
`stale_outputs="error"` the live outputs in the way are invalidated instead, as CUDA Graph Trees
do: nothing is copied, and reading one raises an error that says to clone it.

Inputs: parameters and buffers have stable addresses and are read in place, and so are outputs of an
earlier recording that are alive in the pool when this one records (a forward's saved activations,
read by its backward; a layer's output, read by the next layer's graph): the allocator keeps those
blocks out of this recording's ranges. So is any other input found where the layer's first call
found it (a buffer the caller fills again, a gradient the allocator places alike each step): no
static copy of it in the pool, no copy per replay. Once one is found elsewhere, the next recording
copies the inputs in, and those it writes (an output buffer, a cache the caller allocated) are
copied back into the caller's tensors after each replay. A replay first checks its signature: the
addresses of the in-place inputs and the sizes, strides and dtypes of the copied ones and of the
other inputs read in place (and the values of numbers). A new signature records a new graph: one
compiled function may serve many signatures (Dynamo compiles a layer's code once for all the layers,
each with its own parameters), up to `max_signatures`, beyond which calls run the compiled function
uncaptured. A recording that fails leaves the region uncaptured for good; the report says why. Each
step still completes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from xform._torch import dispatch, inductor, memory
from xform.faults import strict
from xform.log import logger
from xform.transforms.cudagraphs.pool_outputs import Handouts, Ranges, handouts, meets, subtract_ranges
from xform.transforms.cudagraphs.recorder import GraphRecorder, Recorded, unowned, unowned_view, view_of, view_spec


@dataclass
class ReplayStats:
    """What happened to one region function at run time."""

    name: str
    recordings: int = 0
    replays: int = 0
    uncaptured_calls: int = 0  # after the warm-up: calls run without a graph (too many signatures, or failed)
    fallback: str | None = None  # why the region runs uncaptured for good
    moved_bytes: int = 0  # outputs still alive where a replay writes, copied out of its way
    copied_in_bytes: int = 0  # inputs copied into the pool before replays (not module state, in the pool or steady)
    copied_back_bytes: int = 0  # of those, the ones the graph writes, copied back into the caller's tensors after
    stuck: int = 0  # live outputs in the way that could not be moved (torch < 2.13): calls run uncaptured
    invalidated: int = 0  # live outputs in the way invalidated (stale_outputs="error"): reading one raises
    events: list[str] = field(default_factory=list)


def stale_message(name: str) -> str:
    """The error reading an output of region function `name` raises once a later replay has
    written over it (`stale_outputs="error"`)."""
    return (f"xform cudagraphs: this tensor is an output of the CUDA graph of {name}, and a later replay "
            f"wrote over its memory (CudaGraphs(stale_outputs='error'), as mode='reduce-overhead' does). "
            f"Clone it before the next call to the compiled code (out = out.clone()) if you keep it, or "
            f"use CudaGraphs(stale_outputs='copy'), the default, which copies an output still alive out of "
            f"the way")


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _InputStorages:
    """The storages of a call's tensor inputs, known by identity, not address: an input the region
    consumes is freed during the call, and its memory may then hold one of the outputs."""

    def __init__(self, args: list[Any]) -> None:
        self._refs: dict[int, tuple[int, StorageWeakRef]] = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                storage = a.untyped_storage()
                self._refs.setdefault(memory.storage_id(storage), (i, StorageWeakRef(storage)))

    def index_of(self, t: torch.Tensor) -> int | None:
        """The input whose storage `t` is a view of, or None."""
        entry = self._refs.get(memory.storage_id(t.untyped_storage()))
        return entry[0] if entry is not None and not entry[1].expired() else None


@dataclass
class _OutputSpec:
    """What one output of the region function is: a view into output storage `group`, a view of
    input `alias_of`, or a constant."""

    group: int | None = None
    alias_of: int | None = None
    view: tuple[Any, ...] = ()  # dtype, size, stride, storage offset
    constant: Any = None


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.stride(), t.dtype, t.device)


def _hand_over(args: list[Any], consumable: Sequence[int]) -> list[Any]:
    """The inputs in a list of their own, for the region to take over (and free what it consumes),
    while `args` keeps stand-ins, to run the call again should the graph not replay: at positions
    `consumable`, inputs in the pool that the region may free, unowned views of their memory (which
    nothing allocates from before the region has run); elsewhere the inputs themselves."""
    handed = list(args)
    for i in consumable:
        args[i] = unowned_view(args[i])
    return handed


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Recording:
    """One recorded graph, the signature it was recorded for, and its output storages: owned for
    the first replay (the recording's own allocations), unowned views of their addresses after, or
    copies once a handout could not be moved out of another replay's way (`copy_from_now_on`)."""

    def __init__(self, ptrs: list[int | None], metas: dict[int, Any], in_place_idxs: list[int], copy_idxs: list[int],
                 written: set[int], consumed: list[int], recorded: Recorded, writes: Ranges,
                 specs: list[_OutputSpec], groups: int, stale: str | None) -> None:
        self.ptrs = ptrs  # per input: the address recorded in place, or None
        self.metas = metas  # input index -> size, stride, dtype, device it was recorded with (or its value)
        self.in_place_idxs = in_place_idxs
        self.copy_idxs = copy_idxs
        # inputs the graph writes that are copied in: their copies are copied back into them after a replay
        self.copy_back = [(k, i) for k, i in enumerate(copy_idxs) if i in written]
        self.consumed = consumed  # in-place inputs the recording freed: the graph may write over them
        self.replay, self.inputs, self.writes = recorded.replay, recorded.inputs, writes
        self.copied_bytes = sum(t.nbytes for t in self.inputs)
        first = {s.group: out for s, out in zip(specs, recorded.outputs) if s.group is not None}
        self._owned: list[torch.UntypedStorage] | None = [first[g].untyped_storage() for g in range(groups)]
        self._storages = [unowned(storage) for storage in self._owned]  # address, size, device of each
        self._copies: list[torch.Tensor] | None = None  # the output storages' bytes, once copying
        self._stale = stale  # the error a handout invalidated in a replay's way raises, or None: moved

    def matches(self, args: list[Any]) -> bool:
        """Whether `args` have this recording's signature: same in-place addresses, same metadata."""
        return (memory.data_ptrs_equal(args, self.ptrs, self.in_place_idxs)
                and all((_meta(a) if isinstance(a := args[i], torch.Tensor) else a) == meta
                        for i, meta in self.metas.items()))

    def copy_from_now_on(self) -> None:
        self._copies = [_bytes(s) for s in self._storages]

    def run(self, args: list[Any], registry: Handouts, stats: ReplayStats) -> list[torch.UntypedStorage]:
        """Copy in, replay (the caller moved live outputs out of the way); the output storages."""
        stats.replays += 1
        if self.copy_idxs:
            dispatch.foreach_copy_(self.inputs, [args[i] for i in self.copy_idxs])
            stats.copied_in_bytes += self.copied_bytes
        self.replay()
        if self.copy_back:
            dispatch.foreach_copy_([args[i] for _, i in self.copy_back], [self.inputs[k] for k, _ in self.copy_back])
            stats.copied_back_bytes += sum(self.inputs[k].nbytes for k, _ in self.copy_back)
        if self._owned is not None:  # the first replay: the recording's own allocations
            storages, self._owned = self._owned, None
            for storage in storages:
                registry.add(storage, owned=True, stale=self._stale)
            return storages
        if self._copies is not None:
            # one memcpy per storage: `_foreach_copy_` of bytes ran as a one-block kernel, 6.9 us a
            # step for a decoder's logits at batch 1 on the H100, where the memcpy takes 1.2 us
            fresh = [torch.empty_like(source).copy_(source) for source in self._copies]
            return [f.untyped_storage() for f in fresh]
        storages = [unowned(s) for s in self._storages]
        for storage in storages:
            registry.add(storage, owned=False, on_stuck=self.copy_from_now_on, stale=self._stale)
        return storages


class GraphedFunction:
    """A compiled region function (boxed: called with a list of inputs) run as recorded graphs."""

    def __init__(self, compiled: Callable[[list[Any]], Sequence[Any]], name: str, recorder: GraphRecorder,
                 module_state: Callable[[int, torch.Tensor], bool], *, written: Sequence[int] = (), warmup: int = 1,
                 max_signatures: int = 64,
                 stale_outputs: str = "copy", on_event: Callable[[str], None] | None = None) -> None:
        self.compiled = compiled
        inductor.mark_boxed(self)
        self.stats = ReplayStats(name)
        self._recorder = recorder
        self._module_state = module_state
        # inputs the compiled function writes (AOTAutograd keeps a write into an input in its graph):
        # read and written in place while found where they were first seen, as the other inputs are;
        # once one moves, copied in and, after each replay, copied back into the caller's tensor
        self._written = set(written)
        self._warmup = warmup
        self._max_signatures = max_signatures  # one per set of in-place addresses (a layer's parameters)
        self._on_event = on_event
        self._stale = stale_message(name) if stale_outputs == "error" else None
        self._handouts = handouts
        self._specs: list[_OutputSpec] = []
        self._groups = 0
        self._aliased: set[int] = set()  # inputs that outputs are views of
        self._in_place_idxs: list[int] = []  # module state, learned in the warm-up
        # per set of module-state addresses seen so far (a layer): the addresses its first call found
        # the other tensor inputs at, of those not seen elsewhere since (`_steady_inputs`)
        self._seen: dict[tuple[int, ...], dict[int, int]] = {}
        self._recordings: list[_Recording] = []
        self._last = -1  # index of the recording that matched last

    def __call__(self, args: list[Any]) -> list[Any]:
        """Run the region on `args`, which it takes over (empties), as Inductor's compiled functions
        do: inputs the region consumes (a backward's saved activations) are then freed as it goes,
        in its warm-up and its recording as in a plain run, and the pool needs no room for them."""
        if self.stats.fallback is not None:
            self.stats.uncaptured_calls += 1
            return self._call(args)
        if self._warmup > 0:
            self._warmup -= 1
            inputs = self._learn_inputs(args)
            outputs = self._warm_up(args)
            self._learn_outputs(outputs, inputs)
            return outputs
        recording = self._find(args)
        if recording is None:
            if len(self._recordings) >= self._max_signatures:
                return self._beyond_signatures(args)
            if self._first_sighting(args):
                return self._warm_up(args)
            recording = self._record(args)
            if recording is None:
                self.stats.uncaptured_calls += 1
                return self._call(args)
        elif recording.consumed:  # not held while the live handouts are looked at: the graph may overwrite them
            _hand_over(args, recording.consumed)
        # of the inputs, only those copied in can be live handouts the call reads (those read in
        # place were left out of the recording's ranges, the consumed ones are stand-ins by now)
        if not self._clear(recording.writes, [args[i] for i in recording.copy_idxs]):
            self.stats.uncaptured_calls += 1
            return self._call(args)
        storages = recording.run(args, self._handouts, self.stats)
        return self._outputs(storages, args)

    # --- running ---------------------------------------------------------------------------

    def _find(self, args: list[Any]) -> _Recording | None:
        """The recording of `args`' signature, tried from the one after the last match: the layers
        sharing a compiled graph call it in order, so the first one tried is the one."""
        count = len(self._recordings)
        for k in range(1, count + 1):
            index = (self._last + k) % count
            if self._recordings[index].matches(args):
                self._last = index
                return self._recordings[index]
        return None

    def _state_key(self, args: list[Any]) -> tuple[int, ...]:
        return tuple(args[i].data_ptr() for i in self._in_place_idxs)

    def _first_sighting(self, args: list[Any]) -> bool:
        """Whether no call has had these module-state addresses yet (a layer's first call), which
        then runs uncaptured, as a warm-up of its own: its inputs are the previous layer's warm-up
        outputs, ordinary memory, where from its second call on they are outputs in the pool that
        its recording reads in place instead of copying them in."""
        key = self._state_key(args)
        if key in self._seen:
            return False
        self._seen[key] = self._other_addresses(args)
        if len(self._seen) > 4 * self._max_signatures:  # an input written in place that moves every call
            del self._seen[next(iter(self._seen))]  # the oldest address seen
        return True

    def _other_addresses(self, args: list[Any]) -> dict[int, int]:
        in_place = set(self._in_place_idxs)
        return {i: a.data_ptr() for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in in_place}

    def _steady_inputs(self, args: list[Any]) -> set[int]:
        """The inputs, neither module state nor in the pool, found where this layer's first call found
        them (a buffer the caller fills again, a gradient the allocator places alike each step): read in
        place, like module state, not copied in. Once one is found elsewhere, they are all copied in
        from then on: a layer records at most once more for inputs that move."""
        steady = self._seen.get(self._state_key(args), {})
        if any(args[i].data_ptr() != ptr for i, ptr in steady.items()):
            steady.clear()
        return set(steady)

    def _clear(self, ranges: Ranges | None, reading: list[Any], *, unowned_only: bool = False) -> bool:
        """Clear the live outputs meeting `ranges` (all, or the unowned ones) out of the way of a
        call that reads `reading`; False when one cannot be moved (torch < 2.13), after its producer was told
        to copy from now on."""
        cleared = self._handouts.move_out(ranges, unowned_only=unowned_only, reading=reading)
        self.stats.moved_bytes += cleared.moved
        self.stats.invalidated += cleared.invalidated
        stuck = cleared.stuck
        for switch in stuck:
            if switch is not None:
                switch()
        if stuck and not self.stats.stuck:
            self._event(f"an output still alive where this call would write could not be moved out of the way "
                        f"(torch {torch.__version__} has no UntypedStorage._swap_data_ptr_, torch >= 2.13): the "
                        f"call ran uncaptured, and the graph that made that output copies its outputs out from now on")
        self.stats.stuck += len(stuck)
        return not stuck

    def _call(self, args: list[Any]) -> list[Any]:
        return list(self.compiled(args))

    def _warm_up(self, args: list[Any]) -> list[Any]:
        """A call before the recording, uncaptured, allocating in the pool. The allocator must see
        every output alive there, so the unowned ones are moved out first; what this call hands
        out it owns, and a replay recorded earlier may write there, so it is tracked too."""
        if not self._clear(None, args, unowned_only=True):
            return self._call(args)
        inputs = _InputStorages(args)
        outputs = self._recorder.warm_up(self._call, args)
        fresh = {_storage_key(o): o.untyped_storage() for o in outputs
                 if isinstance(o, torch.Tensor) and inputs.index_of(o) is None}
        for storage in fresh.values():
            self._handouts.add(storage, owned=True, stale=self._stale)
        return outputs

    def _beyond_signatures(self, args: list[Any]) -> list[Any]:
        self.stats.uncaptured_calls += 1
        if self.stats.uncaptured_calls == 1:
            self._event(f"{len(self._recordings)} signatures were recorded (parameters that move, a graph shared "
                        f"by many layers: at most max_signatures={self._max_signatures}); calls with a new one "
                        f"run uncaptured")
        return self._call(args)

    def _learn_inputs(self, args: list[Any]) -> _InputStorages:
        """Before the first call: which inputs stay in place; the inputs' storages."""
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        # module state: its sizes and strides are guarded by Dynamo, so only its address is checked
        self._in_place_idxs = [i for i, a in tensors if self._module_state(i, a)]
        self._seen[self._state_key(args)] = self._other_addresses(args)
        return _InputStorages(args)

    def _learn_outputs(self, outputs: list[Any], inputs: _InputStorages) -> None:
        """After the first call: what each output is."""
        groups: dict[int, int] = {}  # storage address -> index of its output storage
        self._specs = []
        for out in outputs:
            if not isinstance(out, torch.Tensor):
                self._specs.append(_OutputSpec(constant=out))
                continue
            if out.device.type != self._recorder.device_type:
                return self._give_up(f"an output is on {out.device.type}, not {self._recorder.device_type}")
            alias_of = inputs.index_of(out)
            if alias_of is not None:
                self._specs.append(_OutputSpec(alias_of=alias_of, view=view_spec(out)))
                continue
            # outputs that are views of one tensor share one storage, as they did
            self._specs.append(_OutputSpec(group=groups.setdefault(_storage_key(out), len(groups)), view=view_spec(out)))
        self._groups = len(groups)
        self._aliased = {spec.alias_of for spec in self._specs if spec.alias_of is not None}

    def _outputs(self, storages: list[torch.UntypedStorage], args: list[Any]) -> list[Any]:
        results = []
        for spec in self._specs:
            if spec.group is not None:
                results.append(view_of(storages[spec.group], spec.view))
            elif spec.alias_of is not None:
                results.append(view_of(args[spec.alias_of].untyped_storage(), spec.view))
            else:
                results.append(spec.constant)
        args.clear()
        return results

    # --- recording -------------------------------------------------------------------------

    def _differences(self, produced: Sequence[Any]) -> list[str]:
        """How the recorded run's outputs differ from the warm-up's (views, shared storages)."""
        sources: dict[int, int] = {}
        found = []
        for index, (spec, out) in enumerate(zip(self._specs, produced)):
            if spec.group is not None and (view_spec(out) != spec.view
                                           or sources.setdefault(spec.group, _storage_key(out)) != _storage_key(out)):
                found.append(f"output {index} is {view_spec(out)}, was {spec.view}")
        return found

    def _record(self, args: list[Any]) -> _Recording | None:
        """Record a graph for `args`' signature. `args` is left holding stand-ins (`_hand_over`),
        which a failed recording runs uncaptured."""
        # the allocator must see every output alive in the pool, or the capture may place its own
        # memory there: the unowned ones (handed out by later replays) are moved out first, the
        # owned ones stay where they are and are read in place (a forward's saved activations)
        if not self._clear(None, args, unowned_only=True):
            return None
        held = self._handouts.held(args)
        steady = self._steady_inputs(args) - held
        in_place = set(self._in_place_idxs) | held | steady
        copy_idxs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in in_place]
        ptrs = [a.data_ptr() if i in in_place else None for i, a in enumerate(args)]
        # numbers are recorded as constants: a different value needs a recording of its own; the
        # steady inputs' sizes are checked as the copied ones' are (Dynamo guards module state's)
        metas = {i: _meta(a) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)
                 if i not in in_place or i in steady}
        consumable = sorted(held - self._aliased)
        before = self._handouts.owned()
        mismatch: list[str] = []

        def run(inputs: list[Any]) -> list[Any]:
            produced = list(self.compiled(inputs))
            mismatch.extend(self._differences(produced))
            return produced

        try:
            recorded = self._recorder.record(run, _hand_over(args, consumable), copy_idxs,
                                             kept=[i for i in copy_idxs if i in self._written])
        except Exception as error:
            if strict():
                raise
            self._give_up(f"recording failed: {type(error).__name__}: {str(error).strip().splitlines()[0]}")
            return None
        if mismatch:
            self._give_up(f"the recorded run differed from the warm-up: {mismatch[0]}")
            return None
        # what outlived the recording was never the graph's to write; what it freed (inputs it
        # consumed) it may have written over
        writes = subtract_ranges(recorded.writes, [(h.start, h.end) for h in before if not h.ref.expired()])
        consumed = [i for i in consumable if meets(writes, ptrs[i], ptrs[i] + 1)]
        recording = _Recording(ptrs, metas, sorted(in_place), copy_idxs, self._written, consumed, recorded, writes,
                               self._specs, self._groups, self._stale)
        self._recordings.append(recording)
        self._last = len(self._recordings) - 1
        self.stats.recordings += 1
        return recording

    def _give_up(self, reason: str) -> None:
        self.stats.fallback = reason
        self._recordings.clear()
        self._event(f"runs uncaptured from now on: {reason}")

    def _event(self, text: str) -> None:
        self.stats.events.append(text)
        logger.warning("xform cudagraphs: %s %s", self.stats.name, text)
        if self._on_event is not None:
            self._on_event(f"{self.stats.name}: {text}")
