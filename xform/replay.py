"""Record a compiled region function as CUDA graphs and replay them, safely, from one memory pool.

Memory: every graph xform records on a device shares one pool, and no pool memory stays live
between replays: each graph ends by copying its outputs into buffers it owns outside the pool
(the copy is part of the recorded graph, so it costs no launch). A replay may therefore use any
of the pool's memory for its intermediates, the pool is as large as the largest graph needs, not
the sum over graphs, and graphs may replay in any order.

Inputs: parameters, buffers and outputs of other recorded graphs have stable addresses and are
recorded in place; the other inputs are copied into the graph's own input buffers before each
replay (one `_foreach_copy_`). A replay first checks its signature: the addresses of the in-place
inputs and the sizes, strides and dtypes of the copied ones. A new signature records a new graph.

Outputs are never overwritten while someone holds them: a graph's outputs are handed out as
aliases of its output buffers, and before a replay the graph checks (by the buffers' storage use
counts) that nobody holds the previous ones; if someone does, another recording of the same
signature (with buffers of its own) replays instead, up to `max_graphs` per signature, after which
the call runs the compiled function uncaptured. One compiled function may serve many signatures
(Dynamo compiles a layer's code once for all the layers, each with its own parameters), up to
`max_signatures`. A recording that fails leaves the region uncaptured for good;
the report says why. Each step still completes.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from xform.faults import strict
from xform.log import logger


class GraphRecorder(Protocol):
    """How graphs are recorded on a device.

    `record(run, inputs, copied)` records `run(inputs)` and returns the replay, which takes the
    call's arguments: a CUDA graph ignores them (it reads the recorded addresses, where the
    in-place inputs are and the copied ones were copied to); a simulation may read them.
    `copied` holds the positions of `inputs` that are the recording's own input buffers.
    """

    device_type: str

    def record(self, run: Callable[[list[Any]], None], inputs: list[Any], copied: set[int]) -> Callable[[list[Any]], None]: ...


class CudaGraphRecorder:
    """`torch.cuda.CUDAGraph`s recorded on a side stream into one pool shared by every graph."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream()
        # the allocator frees a pool when its last graph goes; an empty graph held here keeps it
        # for the graphs recorded later (as CUDA Graph Trees do)
        self._keeper = self._empty_graph()

    def _empty_graph(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                pass
        return graph

    def _recover(self) -> None:
        """After a failed capture, which can leave the allocator routing to the pool and the RNG
        generators in capture mode: end a clean (empty) capture, which puts the generators back,
        and record into a fresh pool from now on (graphs already recorded keep theirs)."""
        torch.cuda.synchronize()
        self._pool = torch.cuda.graph_pool_handle()
        self._keeper = self._empty_graph()


_recorder: CudaGraphRecorder | None = None
_lock = threading.Lock()


def shared_recorder() -> GraphRecorder:
    """The process's CUDA graph recorder (and with it the one pool), made on first use."""
    global _recorder
    with _lock:
        if _recorder is None:
            _recorder = CudaGraphRecorder()
        return _recorder


@dataclass
class ReplayStats:
    """What happened to one region function at run time."""

    name: str
    recordings: int = 0
    replays: int = 0
    uncaptured_calls: int = 0  # after the warm-up: calls run without a graph (all recordings held, or failed)
    fallback: str | None = None  # why the region runs uncaptured for good
    events: list[str] = field(default_factory=list)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


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


def _view(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, t.shape, t.stride(), t.storage_offset())


def _view_of(storage: torch.UntypedStorage, view: tuple[Any, ...]) -> torch.Tensor:
    dtype, size, stride, offset = view
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _ptrs_equal(args: list[Any], ptrs: list[int | None], idxs: list[int]) -> bool:
    return all(args[i].data_ptr() == ptrs[i] for i in idxs)


# the C++ check CUDA Graph Trees use (built with CUDA only); the same test in Python elsewhere
_addresses_match = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", _ptrs_equal)


class _Recording:
    """One recorded graph: the signature it was recorded for, its input and output buffers, its replay."""

    def __init__(self, ptrs: list[int | None], metas: dict[int, tuple[Any, ...]], copy_idxs: list[int],
                 buffers: list[torch.Tensor], outputs: list[torch.Tensor | None],
                 replay: Callable[[list[Any]], None]) -> None:
        self.ptrs = ptrs  # per input: the address recorded in place, or None
        self.metas = metas  # input index -> size, stride, dtype, device it was recorded with
        self.copy_idxs = copy_idxs
        self.buffers = buffers
        self.outputs = outputs  # output buffers (None where the output is an alias or a constant)
        self.replay = replay
        cdatas = [t.untyped_storage()._cdata for t in outputs if t is not None]
        self._storages = [(c, torch._C._storage_Use_Count(c)) for c in cdatas]
        for t in outputs:
            if t is not None:
                _recorded_outputs[_storage_key(t)] = self

    def matches(self, args: list[Any], in_place_idxs: list[int]) -> bool:
        """Whether `args` have this recording's signature: same in-place addresses, same metadata."""
        return (_addresses_match(args, self.ptrs, in_place_idxs)
                and all((_meta(a) if isinstance(a := args[i], torch.Tensor) else a) == meta
                        for i, meta in self.metas.items()))

    def outputs_free(self) -> bool:
        """No one but this recording holds its output buffers (so a replay overwrites nothing in use)."""
        return all(torch._C._storage_Use_Count(c) <= base for c, base in self._storages)


# storage address of an output buffer -> its recording, so that a graph reading another's output
# (a backward reading the forward's saved tensors) can read it in place
_recorded_outputs: weakref.WeakValueDictionary[int, _Recording] = weakref.WeakValueDictionary()


def is_recorded_output(t: torch.Tensor) -> bool:
    return _storage_key(t) in _recorded_outputs


class GraphedFunction:
    """A compiled region function (boxed: called with a list of inputs) run as recorded graphs."""

    def __init__(self, compiled: Callable[[list[Any]], Sequence[Any]], name: str, recorder: GraphRecorder,
                 module_state: Callable[[int, torch.Tensor], bool], *, warmup: int = 1, max_graphs: int = 3,
                 max_signatures: int = 64, on_event: Callable[[str], None] | None = None) -> None:
        self.compiled = compiled
        self._boxed_call = True  # an instance attribute: wrappers (functools.wraps) copy only those
        self.stats = ReplayStats(name)
        self._recorder = recorder
        self._module_state = module_state
        self._module_state_idxs: set[int] = set()
        self._warmup = warmup
        self._max_graphs = max_graphs  # recordings per signature: for callers that hold outputs
        self._max_signatures = max_signatures  # one per set of in-place addresses (a layer's parameters)
        self._on_event = on_event
        self._specs: list[_OutputSpec] = []
        self._group_bytes: list[tuple[int, torch.device]] = []
        self._in_place_idxs: list[int] = []
        self._recordings: list[_Recording] = []

    def __call__(self, args: list[Any]) -> list[Any]:
        if self.stats.fallback is not None or self._warmup > 0:
            return self._uncaptured(args, learn=self._warmup > 0)
        recording = next((r for r in self._recordings if r.outputs_free() and r.matches(args, self._in_place_idxs)),
                         None)
        if recording is None:  # the slow path: count this signature's recordings, all busy
            same = [r for r in self._recordings if r.matches(args, self._in_place_idxs)]
            full = len(same) >= self._max_graphs or len(self._recordings) >= self._max_signatures
            if full:
                self.stats.uncaptured_calls += 1
                if self.stats.uncaptured_calls == 1:
                    self._event(f"all {len(same)} recordings of this signature had their outputs still held "
                                f"(max_graphs={self._max_graphs}), or {len(self._recordings)} signatures were "
                                f"recorded (parameters that move, a graph shared by many layers: at most "
                                f"{self._max_signatures}); such calls run uncaptured")
                return self._call(args)
            recording = self._record(args)
            if recording is None:
                return self._call(args)
        self._feed(recording, args)
        recording.replay(args)
        self.stats.replays += 1
        return self._outputs(recording, args)

    # --- running ---------------------------------------------------------------------------

    def _call(self, args: list[Any]) -> list[Any]:
        return list(self.compiled(list(args)))

    def _uncaptured(self, args: list[Any], learn: bool) -> list[Any]:
        outputs = self._call(args)
        if learn:
            self._warmup -= 1
            self._learn(args, outputs)
        else:
            self.stats.uncaptured_calls += 1
        return outputs

    def _learn(self, args: list[Any], outputs: list[Any]) -> None:
        """From an uncaptured call: which inputs stay in place, what each output is."""
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        # module state: its sizes and strides are guarded by Dynamo, so only its address is checked
        self._module_state_idxs = {i for i, a in tensors if self._module_state(i, a)}
        self._in_place_idxs = sorted(self._module_state_idxs | {i for i, a in tensors if is_recorded_output(a)})
        inputs = {_storage_key(a): i for i, a in tensors}
        groups: dict[int, int] = {}  # storage address -> index of its output buffer
        self._specs, self._group_bytes = [], []
        for out in outputs:
            if not isinstance(out, torch.Tensor):
                self._specs.append(_OutputSpec(constant=out))
                continue
            if out.device.type != self._recorder.device_type:
                return self._give_up(f"an output is on {out.device.type}, not {self._recorder.device_type}")
            key = _storage_key(out)
            if key in inputs:
                self._specs.append(_OutputSpec(alias_of=inputs[key], view=_view(out)))
                continue
            if key not in groups:  # outputs that are views of one tensor share one buffer, as they did
                groups[key] = len(self._group_bytes)
                self._group_bytes.append((out.untyped_storage().nbytes(), out.device))
            self._specs.append(_OutputSpec(group=groups[key], view=_view(out)))

    def _feed(self, recording: _Recording, args: list[Any]) -> None:
        if recording.copy_idxs:
            torch._foreach_copy_(recording.buffers, [args[i] for i in recording.copy_idxs])

    def _outputs(self, recording: _Recording, args: list[Any]) -> list[Any]:
        results = []
        for spec, base in zip(self._specs, recording.outputs):
            if base is not None:
                results.append(base.detach())  # a fresh alias: holding it marks the buffer as in use
            elif spec.alias_of is not None:
                results.append(_view_of(args[spec.alias_of].untyped_storage(), spec.view))
            else:
                results.append(spec.constant)
        args.clear()
        return results

    # --- recording -------------------------------------------------------------------------

    def _record(self, args: list[Any]) -> _Recording | None:
        copy_idxs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in self._in_place_idxs]
        buffers = [torch.empty_strided(args[i].shape, args[i].stride(), dtype=args[i].dtype, device=args[i].device)
                   for i in copy_idxs]
        storages = [torch.empty(n, dtype=torch.uint8, device=d).untyped_storage() for n, d in self._group_bytes]
        outputs = [_view_of(storages[s.group], s.view) if s.group is not None else None for s in self._specs]
        static_args = list(args)
        for i, buffer in zip(copy_idxs, buffers):
            static_args[i] = buffer
        mismatch: list[str] = []

        def run(inputs: list[Any]) -> None:
            produced = self.compiled(list(inputs))
            sources: dict[int, torch.UntypedStorage] = {}
            for index, (spec, out) in enumerate(zip(self._specs, produced)):
                if spec.group is None:
                    continue
                source = sources.setdefault(spec.group, out.untyped_storage())
                if _view(out) != spec.view or _storage_key(out) != source.data_ptr():
                    mismatch.append(f"output {index} is {_view(out)}, was {spec.view}")
                    return
            for group, source in sources.items():
                _bytes_of(storages[group]).copy_(_bytes_of(source))

        try:
            replay = self._recorder.record(run, static_args, set(copy_idxs))
        except Exception as error:
            if strict():
                raise
            self._give_up(f"recording failed: {type(error).__name__}: {str(error).strip().splitlines()[0]}")
            return None
        if mismatch:
            self._give_up(f"the recorded run differed from the warm-up: {mismatch[0]}")
            return None
        in_place = set(self._in_place_idxs)
        ptrs = [a.data_ptr() if i in in_place else None for i, a in enumerate(args)]
        # numbers are recorded as constants: a different value needs a recording of its own
        metas = {i: _meta(a) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)
                 if i not in self._module_state_idxs}
        recording = _Recording(ptrs, metas, copy_idxs, buffers, outputs, replay)
        self._recordings.append(recording)
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
