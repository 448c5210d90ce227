"""Record a compiled region function as CUDA graphs and replay them, safely, from one memory pool.

Memory: every graph xform records on a device shares one pool, and no pool memory is live between
replays: the pool is as large as the largest graph needs, not the sum over graphs, and graphs may
replay in any order. A launch hands its outputs out in fresh ordinary allocations, the caller's own
tensors, which no later replay overwrites, so one recording per signature serves callers that hold
outputs (a backward's gradients, a list of logits). Two ways to launch:

- moved pointers (where the check below passes): before each launch the graph's arguments that
  point into its copied inputs and its outputs are rewritten (`xform.graph_pointers`) to the
  caller's inputs where they are and to freshly allocated output storages. Nothing is copied
  either way, and the pool holds only the graphs' intermediates: a backward reads the forward's
  saved tensors where the forward wrote them, as CUDA Graph Trees do, without keeping them in a
  pool. The spans that move are known from the allocator's history during the capture; an
  output whose memory the capture also gave, in part, to another allocation grows its span over
  it (a little), or, when that would cost much, is copied out as below. Only regions that write
  none of their inputs in place take part, since the check replays the graph twice; the check
  fills the pool's input buffers and the fresh outputs with values no run gives and compares
  with a copying replay, so a pointer the scan cannot see (in device memory, an encoded
  descriptor) keeps the recording copying, with the reason in the report.
- copying (otherwise): the inputs other than module state are copied into the pool, and the
  outputs out of it after the replay (one `_foreach_copy_` each way); each output is written
  twice, and the pool also holds the largest graph's outputs and copied inputs.

Inputs: parameters and buffers have stable addresses and are read in place; the other inputs are
moved to or copied in. A replay first checks its signature: the addresses of the in-place inputs and the
sizes, strides and dtypes of the others (and the values of numbers). A new signature records
a new graph: one compiled function may serve many signatures (Dynamo compiles a layer's code once
for all the layers, each with its own parameters), up to `max_signatures`, beyond which calls run
the compiled function uncaptured. A recording that fails leaves the region uncaptured for good;
the report says why. Each step still completes.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from xform.faults import strict
from xform.graph_pointers import (DriverError, DriverGraph, Pointer, Span, find_pointers, moved_values, overlapping,
                                  widened)
from xform.log import logger


@dataclass
class Recorded:
    """A recorded graph. `replay()` runs it; `inputs` are where the copied inputs must be written
    before it (in the order of `copied`), `outputs` what the recorded run returned, each tensor
    where a replay leaves it. Both lie in pool memory that other graphs reuse: written right before
    the replay, read right after it."""

    replay: Callable[[], None]
    inputs: list[torch.Tensor]
    outputs: list[Any]
    # where the graph's pointers into the copied inputs and the outputs can move per launch, and
    # which span each output storage (by its recorded address) is; None with why_fixed when not
    pointers: MovablePointers | None = None
    output_spans: dict[int, int] = field(default_factory=dict)
    why_fixed: str | None = None


class MovablePointers:
    """The words of a recorded graph that point into its copied inputs (spans 0..k-1, in the order
    of `copied`) and its outputs (the other spans); `launch(starts)` moves span i to starts[i] and
    replays. Only the nodes whose words changed since the last launch are rewritten (the caching
    allocator tends to hand the same addresses out step after step)."""

    def __init__(self, graph: DriverGraph, spans: list[Span], replay: Callable[[], None]) -> None:
        self.spans = spans
        self._graph, self._replay = graph, replay
        self._by_span: list[list[Pointer]] = [[] for _ in spans]
        for pointer in find_pointers(graph.words(), spans):
            self._by_span[pointer.span].append(pointer)
        self._starts = [span.start for span in spans]
        self.last_rewritten = 0  # nodes the last move rewrote

    def sizes(self) -> list[int]:
        return [span.end - span.start for span in self.spans]

    def move(self, starts: Sequence[int]) -> None:
        changed = [i for i, start in enumerate(starts) if start != self._starts[i]]
        self.last_rewritten = 0
        if changed:
            values = moved_values([p for i in changed for p in self._by_span[i]], starts, self.spans)
            self._graph.set(values)
            self.last_rewritten = len(values)
            for i in changed:
                self._starts[i] = starts[i]

    def reset(self) -> None:
        """Point the graph back at the pool, where it was recorded."""
        self._starts = [-1] * len(self.spans)
        self.move([span.start for span in self.spans])

    def launch(self, starts: Sequence[int]) -> None:
        self.move(starts)
        self._replay()


class GraphRecorder(Protocol):
    """How graphs are recorded on a device: `record(run, inputs, copied, movable)` records
    `run(inputs)` with the inputs at positions `copied` replaced by buffers of the recorder's pool;
    with `movable`, it also finds the graph's pointers into those buffers and into its outputs
    (`Recorded.pointers`), so that launches can read and write the caller's tensors instead."""

    device_type: str

    def record(self, run: Callable[[list[Any]], list[Any]], inputs: list[Any], copied: list[int],
               movable: bool = False) -> Recorded: ...


def _view(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, t.shape, t.stride(), t.storage_offset())


def _view_of(storage: torch.UntypedStorage, view: tuple[Any, ...]) -> torch.Tensor:
    dtype, size, stride, offset = view
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """`t` over a storage that does not keep its memory allocated (as CUDA Graph Trees hold their
    outputs): a recording keeps the address, and other graphs may use the memory in between."""
    storage = t.untyped_storage()
    return _view_of(torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes()),
                    _view(t))


class CudaGraphRecorder:
    """`torch.cuda.CUDAGraph`s recorded on a side stream into one pool shared by every graph."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream()
        # the allocator frees a pool when its last graph goes; an empty graph held here keeps it
        # for the graphs recorded later (as CUDA Graph Trees do), and keeps the memory behind the
        # recordings' addresses reserved
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

    def record(self, run: Callable[[list[Any]], list[Any]], inputs: list[Any], copied: list[int],
               movable: bool = False) -> Recorded:
        graph = torch.cuda.CUDAGraph(keep_graph=movable)
        static = list(inputs)
        traced = _AllocationTrace() if movable else None
        try:
            with traced or contextlib.nullcontext():
                with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                    for i in copied:  # allocated in the pool, alive until the capture ends; no work recorded
                        static[i] = torch.empty_strided(inputs[i].shape, inputs[i].stride(), dtype=inputs[i].dtype,
                                                        device=inputs[i].device)
                    outputs = run(static)
        except Exception:
            self._recover()
            raise
        if movable:
            graph.instantiate()
        recorded = Recorded(graph.replay, [_unowned(static[i]) for i in copied],
                            [_unowned(o) if isinstance(o, torch.Tensor) else o for o in outputs])
        if traced is not None:
            self._find_pointers(graph, recorded, [static[i] for i in copied], outputs, traced)
        # the owning tensors go with this frame: their pool memory is free for the next recordings
        return recorded

    @staticmethod
    def _find_pointers(graph: torch.cuda.CUDAGraph, recorded: Recorded, static: list[torch.Tensor],
                       outputs: list[Any], traced: _AllocationTrace) -> None:
        """Fill `recorded.pointers`: the spans of the copied inputs (alive through the capture)
        and of the output storages allocated during it, each grown over the other allocations of
        the capture that overlap it in part (memory the allocator split differently would move
        wrongly otherwise); an output whose span would grow by much more stays in the pool and
        is copied out."""
        if traced.allocations is None:
            recorded.why_fixed = traced.why_not
            return
        spans = [Span(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in static]
        blocks = {a.start: a for a in traced.allocations}
        for out in outputs:
            if not isinstance(out, torch.Tensor) or (start := out.untyped_storage().data_ptr()) in recorded.output_spans:
                continue
            if start not in blocks or any(start == span.start for span in spans):
                continue  # not allocated by the graph (module state, a constant): it does not move
            nbytes = out.untyped_storage().nbytes()
            span = widened(traced.allocations, Span(start, max(blocks[start].end, start + nbytes)),
                           slack=max(nbytes // 4, 1 << 20))
            if span is None or overlapping(spans, span) or any(span.start <= s.start < span.end for s in spans):
                continue  # this output is copied out of the pool after each launch
            recorded.output_spans[start] = len(spans)
            spans.append(span)
        try:
            driver_graph = DriverGraph(graph.raw_cuda_graph(), graph.raw_cuda_graph_exec())
        except (DriverError, OSError, AttributeError) as error:
            recorded.why_fixed = f"its nodes could not be read: {error}"
            return
        recorded.pointers = MovablePointers(driver_graph, spans, graph.replay)


class _AllocationTrace:
    """The caching allocator's allocations while a graph is recorded (its memory history), as
    spans; None, with the reason, when the user records the history already (xform leaves it)."""

    def __init__(self) -> None:
        self.allocations: list[Span] | None = None
        self.why_not: str | None = None
        self._mine = False

    def __enter__(self) -> _AllocationTrace:
        if torch._C._cuda_isHistoryEnabled():
            self.why_not = "the allocator's memory history is being recorded (by you), which xform would have to reset"
        else:
            torch.cuda.memory._record_memory_history("all", context=None, stacks="python", clear_history=True)
            self._mine = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._mine:
            return
        try:
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            self.allocations = [Span(e["addr"], e["addr"] + e["size"]) for e in trace if e["action"] == "alloc"]
        finally:
            torch.cuda.memory._record_memory_history(None)


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
    uncaptured_calls: int = 0  # after the warm-up: calls run without a graph (too many signatures, or failed)
    fallback: str | None = None  # why the region runs uncaptured for good
    direct: int = 0  # recordings launched with their pointers moved (no copies)
    direct_refused: str | None = None  # why a recording copies instead, the first time one does
    outputs_copied: int = 0  # output storages of those recordings still copied out of the pool
    nodes_rewritten: int = 0  # graph nodes whose pointers were rewritten before a launch, over all replays
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


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _is_whole(t: torch.Tensor) -> bool:
    """Whether `t` is all of its storage, densely: a copy made by `empty_like` has its layout."""
    return (t.storage_offset() == 0 and torch.empty_like(t, device="meta").stride() == t.stride()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def _ptrs_equal(args: list[Any], ptrs: list[int | None], idxs: list[int]) -> bool:
    return all(args[i].data_ptr() == ptrs[i] for i in idxs)


# the C++ check CUDA Graph Trees use (built with CUDA only); the same test in Python elsewhere
_addresses_match = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", _ptrs_equal)


class _Recording:
    """One recorded graph, the signature it was recorded for, and how a replay hands out outputs.

    Copying (the default): per output storage, the output itself when it is the whole storage (the
    copy is the output), else the storage's bytes (the outputs are views of the copy, as they were
    of the original). Direct (`direct`, once checked): the graph's pointers move to the caller's
    inputs and to fresh output storages, nothing is copied either way."""

    def __init__(self, ptrs: list[int | None], metas: dict[int, Any], copy_idxs: list[int], recorded: Recorded,
                 specs: list[_OutputSpec], groups: int) -> None:
        self.ptrs = ptrs  # per input: the address recorded in place, or None
        self.metas = metas  # input index -> size, stride, dtype, device it was recorded with (or its value)
        self.copy_idxs = copy_idxs
        self.recorded = recorded
        first = {s.group: out for s, out in zip(specs, recorded.outputs) if s.group is not None}
        shared = {g for g in first if sum(s.group == g for s in specs) > 1}
        self.whole = [g not in shared and _is_whole(first[g]) for g in range(groups)]
        self.sources = [first[g] if self.whole[g] else _bytes_of(first[g].untyped_storage()) for g in range(groups)]
        # per output storage, the span it moves with (None: copied out), and where in it it starts
        self.group_spans = [recorded.output_spans.get(first[g].untyped_storage().data_ptr()) for g in range(groups)]
        spans = recorded.pointers.spans if recorded.pointers is not None else []
        self.group_offsets = [0 if span is None else first[g].untyped_storage().data_ptr() - spans[span].start
                              for g, span in enumerate(self.group_spans)]
        self.direct = False

    def why_not_direct(self) -> str | None:
        """Why this recording's pointers cannot move, or None when they can (still to be checked)."""
        if self.recorded.pointers is None:
            return self.recorded.why_fixed or "the recorder cannot move a graph's pointers"
        return None

    def output(self, spec: _OutputSpec, storage: torch.Tensor) -> torch.Tensor:
        """Output `spec` from what a launch returned for its storage: that tensor itself when
        copied out whole, else a view of the storage's bytes (which may start inside a larger
        moved span)."""
        assert spec.group is not None
        if self.whole[spec.group] and not (self.direct and self.group_spans[spec.group] is not None):
            return storage
        dtype, size, stride, offset = spec.view
        return _view_of(storage.untyped_storage(), (dtype, size, stride, offset + storage.storage_offset() // dtype.itemsize))

    def matches(self, args: list[Any], in_place_idxs: list[int]) -> bool:
        """Whether `args` have this recording's signature: same in-place addresses, same metadata."""
        return (_addresses_match(args, self.ptrs, in_place_idxs)
                and all((_meta(a) if isinstance(a := args[i], torch.Tensor) else a) == meta
                        for i, meta in self.metas.items()))

    def run(self, args: list[Any]) -> list[torch.Tensor]:
        return self.launch_direct(args) if self.direct else self.run_copying(args)

    def copy_in_and_replay(self, args: list[Any]) -> None:
        if self.copy_idxs:
            torch._foreach_copy_(self.recorded.inputs, [args[i] for i in self.copy_idxs])
        self.recorded.replay()

    def run_copying(self, args: list[Any]) -> list[torch.Tensor]:
        """Copy in, replay, copy out: the output storages as fresh allocations outside the pool."""
        self.copy_in_and_replay(args)
        fresh = [torch.empty_like(source) for source in self.sources]
        if fresh:
            torch._foreach_copy_(fresh, self.sources)
        return fresh

    def launch_direct(self, args: list[Any], fill: int | None = None) -> list[torch.Tensor]:
        """Launch with the graph reading the caller's inputs where they are (an input off the
        16-byte alignment the kernels were compiled for is copied first) and writing fresh output
        storages (filled with byte `fill` first, for the check)."""
        pointers = self.recorded.pointers
        assert pointers is not None
        sizes = pointers.sizes()
        starts = [span.start for span in pointers.spans]
        held = []
        for j, i in enumerate(self.copy_idxs):
            given = args[i]
            if given.data_ptr() % 16:
                given = torch.empty_strided(given.shape, given.stride(), dtype=given.dtype, device=given.device)
                held.append(given.copy_(args[i]))
            starts[j] = given.data_ptr()
        fresh = []
        for source, span, offset in zip(self.sources, self.group_spans, self.group_offsets):
            if span is None:  # stays in the pool: copied out after the launch
                fresh.append(torch.empty_like(source))
                continue
            out = torch.empty(sizes[span], dtype=torch.uint8, device=source.device)
            starts[span] = out.data_ptr()
            fresh.append((out if fill is None else out.fill_(fill))[offset:])
        pointers.launch(starts)
        copied = [g for g, span in enumerate(self.group_spans) if span is None]
        if copied:
            torch._foreach_copy_([fresh[g] for g in copied], [self.sources[g] for g in copied])
        return fresh

    def poison_inputs(self) -> None:
        """Fill the pool's input buffers with values no real input has, for the check: floats
        with 0x7F bytes (about 3e38), others with zeros (still valid indices)."""
        for t in self.recorded.inputs:
            _bytes_of(t.untyped_storage()).fill_(0x7F) if t.is_floating_point() else t.zero_()
        # and all that moves of the pool: a read the move missed would find the copying replay's
        # correct values there, which later replays of other graphs overwrite
        pointers = self.recorded.pointers
        for span in pointers.spans[len(self.recorded.inputs):] if pointers is not None else ():
            storage = torch._C._construct_storage_from_data_pointer(span.start, self.sources[0].device,
                                                                     span.end - span.start)
            _bytes_of(storage).fill_(0x7F)


def _checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the sum and the sum of squares of its values in float64 (in chunks, to bound
    the temporary memory), on the device: [n, 2]."""
    sums = []
    for t in tensors:
        total = torch.zeros(2, dtype=torch.float64, device=t.device)
        for chunk in t.reshape(-1).split(1 << 22):
            c = chunk.to(torch.float64)
            total += torch.stack([c.sum(), (c * c).sum()])
        sums.append(total)
    return torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.float64)


def _agree(reference: torch.Tensor, got: torch.Tensor, counts: list[int]) -> bool:
    """Whether two replays' checksums agree up to reduction order: a pointer the move missed shows
    as the fill values (or what reading them gives) and fails by many orders of magnitude."""
    if reference.numel() == 0:
        return True
    reference, got = reference.cpu(), got.cpu()
    if not (torch.isfinite(reference).all() and torch.isfinite(got).all()):
        return False
    n = torch.tensor(counts, dtype=torch.float64)
    scale = (reference[:, 1] * n).sqrt()
    return bool(((reference[:, 0] - got[:, 0]).abs() <= 1e-3 * scale + 1e-30).all()
                and ((reference[:, 1] - got[:, 1]).abs() <= 1e-3 * reference[:, 1] + 1e-30).all())


class GraphedFunction:
    """A compiled region function (boxed: called with a list of inputs) run as recorded graphs."""

    def __init__(self, compiled: Callable[[list[Any]], Sequence[Any]], name: str, recorder: GraphRecorder,
                 module_state: Callable[[int, torch.Tensor], bool], *, warmup: int = 1, max_signatures: int = 64,
                 movable: bool = False, on_event: Callable[[str], None] | None = None) -> None:
        self.compiled = compiled
        self._boxed_call = True  # an instance attribute: wrappers (functools.wraps) copy only those
        self.stats = ReplayStats(name)
        self._recorder = recorder
        self._module_state = module_state
        self._warmup = warmup
        self._max_signatures = max_signatures  # one per set of in-place addresses (a layer's parameters)
        self._on_event = on_event
        self._movable = movable  # the function writes none of its inputs: a check may replay it twice
        self._specs: list[_OutputSpec] = []
        self._groups = 0
        self._in_place_idxs: list[int] = []
        self._recordings: list[_Recording] = []
        self._last = -1  # index of the recording that matched last

    def __call__(self, args: list[Any]) -> list[Any]:
        if self.stats.fallback is not None or self._warmup > 0:
            return self._uncaptured(args, learn=self._warmup > 0)
        recording = self._find(args)
        if recording is None:
            if len(self._recordings) >= self._max_signatures:
                return self._beyond_signatures(args)
            recording = self._record(args)
            if recording is None:
                return self._call(args)
        fresh = recording.run(args)
        self.stats.replays += 1
        if recording.direct:
            self.stats.nodes_rewritten += recording.recorded.pointers.last_rewritten
        return self._outputs(recording, fresh, args)

    # --- running ---------------------------------------------------------------------------

    def _find(self, args: list[Any]) -> _Recording | None:
        """The recording of `args`' signature, tried from the one after the last match: the layers
        sharing a compiled graph call it in order, so the first one tried is the one."""
        count = len(self._recordings)
        for k in range(1, count + 1):
            index = (self._last + k) % count
            if self._recordings[index].matches(args, self._in_place_idxs):
                self._last = index
                return self._recordings[index]
        return None

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

    def _beyond_signatures(self, args: list[Any]) -> list[Any]:
        self.stats.uncaptured_calls += 1
        if self.stats.uncaptured_calls == 1:
            self._event(f"{len(self._recordings)} signatures were recorded (parameters that move, a graph shared "
                        f"by many layers: at most max_signatures={self._max_signatures}); calls with a new one "
                        f"run uncaptured")
        return self._call(args)

    def _learn(self, args: list[Any], outputs: list[Any]) -> None:
        """From an uncaptured call: which inputs stay in place, what each output is."""
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        # module state: its sizes and strides are guarded by Dynamo, so only its address is checked
        self._in_place_idxs = [i for i, a in tensors if self._module_state(i, a)]
        inputs = {_storage_key(a): i for i, a in tensors}
        groups: dict[int, int] = {}  # storage address -> index of its output storage
        self._specs = []
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
            # outputs that are views of one tensor share one storage, as they did
            self._specs.append(_OutputSpec(group=groups.setdefault(key, len(groups)), view=_view(out)))
        self._groups = len(groups)

    def _outputs(self, recording: _Recording, fresh: list[torch.Tensor], args: list[Any]) -> list[Any]:
        results = []
        for spec in self._specs:
            if spec.group is not None:
                results.append(recording.output(spec, fresh[spec.group]))
            elif spec.alias_of is not None:
                results.append(_view_of(args[spec.alias_of].untyped_storage(), spec.view))
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
            if spec.group is not None and (_view(out) != spec.view
                                           or sources.setdefault(spec.group, _storage_key(out)) != _storage_key(out)):
                found.append(f"output {index} is {_view(out)}, was {spec.view}")
        return found

    def _record(self, args: list[Any]) -> _Recording | None:
        in_place = set(self._in_place_idxs)
        copy_idxs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in in_place]
        mismatch: list[str] = []

        def run(inputs: list[Any]) -> list[Any]:
            produced = list(self.compiled(list(inputs)))
            mismatch.extend(self._differences(produced))
            return produced

        try:
            recorded = self._recorder.record(run, list(args), copy_idxs, self._movable)
        except Exception as error:
            if strict():
                raise
            self._give_up(f"recording failed: {type(error).__name__}: {str(error).strip().splitlines()[0]}")
            return None
        if mismatch:
            self._give_up(f"the recorded run differed from the warm-up: {mismatch[0]}")
            return None
        ptrs = [a.data_ptr() if i in in_place else None for i, a in enumerate(args)]
        # numbers are recorded as constants: a different value needs a recording of its own
        metas = {i: _meta(a) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args) if i not in in_place}
        recording = _Recording(ptrs, metas, copy_idxs, recorded, self._specs, self._groups)
        if self._movable and not self._check_direct(recording, args):
            return None
        self._recordings.append(recording)
        self._last = len(self._recordings) - 1
        self.stats.recordings += 1
        return recording

    def _check_direct(self, recording: _Recording, args: list[Any]) -> bool:
        """Launch with moved pointers only once a check replay agrees with a copying one: the
        check fills the pool's input buffers and the fresh outputs with values no real run gives,
        so a pointer the scan missed (one kept in device memory, an encoded descriptor) shows."""
        why = recording.why_not_direct()
        if why is None:
            groups = [(k, spec) for k, spec in enumerate(self._specs) if spec.group is not None]
            counts = [recording.recorded.outputs[k].numel() for k, _ in groups]
            recording.copy_in_and_replay(args)
            reference = _checksums([recording.recorded.outputs[k] for k, _ in groups])
            recording.poison_inputs()
            try:
                fresh = recording.launch_direct(args, fill=0x7F)
            except DriverError as error:
                why = f"moving its pointers failed: {error}"
            else:
                recording.direct = True  # as a moved launch hands its outputs out
                got = _checksums([recording.output(spec, fresh[spec.group]) for _, spec in groups])
                agree = [_agree(reference[i:i + 1], got[i:i + 1], counts[i:i + 1]) for i in range(len(groups))]
                if all(agree):
                    self.stats.direct += 1
                    self.stats.outputs_copied += recording.group_spans.count(None)
                    return True
                recording.direct = False
                bad = [k for (k, _), ok in zip(groups, agree) if not ok]
                why = (f"a replay with its pointers moved did not agree with one copying (outputs {bad[:6]} of "
                       f"{len(self._specs)}, e.g. {tuple(recording.recorded.outputs[bad[0]].shape)})")
            try:
                recording.recorded.pointers.reset()
            except DriverError as error:
                self._give_up(f"{why}, and moving its pointers back failed: {error}")
                return False
        if self.stats.direct_refused is None:
            self.stats.direct_refused = why
            self._event(f"copies its inputs and outputs (its pointers are not moved per launch): {why}")
        return True

    def _give_up(self, reason: str) -> None:
        self.stats.fallback = reason
        self._recordings.clear()
        self._event(f"runs uncaptured from now on: {reason}")

    def _event(self, text: str) -> None:
        self.stats.events.append(text)
        logger.warning("xform cudagraphs: %s %s", self.stats.name, text)
        if self._on_event is not None:
            self._on_event(f"{self.stats.name}: {text}")
