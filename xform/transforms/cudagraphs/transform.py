"""`CudaGraphs`: record the capture-safe regions of each graph as CUDA graphs, and explain the rest.

`mode="reduce-overhead"` records a whole graph or nothing, and keeps private memory per recorded
path. This transform finds, per Dynamo graph, the ops a CUDA graph cannot record
(`capture_safety`), partitions the rest into maximal regions (`regions`), compiles
each region with the handoff and records its forward and backward (`replay`: one shared
pool; outputs handed out in place and moved out only when a later replay would write over them
while they are alive, `pool_outputs`).
Ops that break a region run as compiled, between the replays; the report names each with the
user's line, the reason and the fix.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from xform._torch.dispatch import FakeTensor, is_traceable_wrapper_subclass
from xform._torch.dynamo import UNTRACEABLE, has_static_address
from xform.captured import CapturedGraph
from xform.registry import register_transform
from xform.report import TransformRecord
from xform.transform import Transform, option_error
from xform.transforms.cudagraphs.capture_safety import find_breaks, graph_level_reason, host_numbers
from xform.transforms.cudagraphs.recorder import GraphRecorder, shared_recorder
from xform.transforms.cudagraphs.regions import SAFE, RegionPlan, plan_regions
from xform.transforms.cudagraphs.replay import GraphedFunction

NO_GPU = ("no CUDA device here (torch.cuda.is_available() is False): CUDA graphs need an NVIDIA GPU, so the "
          "graph runs as compiled, without them")

OPTIONS = ("min_region_ops", "max_signatures", "warmup", "stale_outputs")
STALE_OUTPUTS = ("copy", "error")
REMOVED = {"max_graphs": "an output still alive where a later replay writes is moved out of its way, so one "
                         "recording per signature serves callers that hold outputs"}


def available_recorder() -> GraphRecorder | None:
    """The recorder for this process's GPU, or None without one."""
    return shared_recorder() if torch.cuda.is_available() else None


def _untraceable_reason(error: BaseException, runs: str = "it runs without CUDA graphs") -> str:
    """Why a graph or region AOTAutograd could not trace (an `UNTRACEABLE` error) is not recorded."""
    return (f"AOTAutograd cannot trace it ({type(error).__name__}: {error}): an op in it, or in its backward, reads "
            f"a tensor's values on the host or takes a shape from them (a Mixture-of-Experts' grouped matmul, say), "
            f"where Dynamo would break the graph; {runs}. Fix: call that op outside the compiled code "
            f"(torch.compiler.disable on the function calling it)")


Layout = tuple[int, tuple[int, ...], tuple[int, ...]]


def _layout(t: torch.Tensor) -> Layout:
    return t.data_ptr(), tuple(t.shape), t.stride()


def _layouts_of(tensors: Sequence[torch.Tensor]) -> set[Layout]:
    """Address, size and stride of tensors and, for wrapper subclasses (float8 weights), of their
    inner tensors: what identifies a parameter or buffer (a view of one, at another offset or size,
    is an ordinary input)."""
    found: set[Layout] = set()
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            found |= _layouts_of([getattr(t, n) for n in names])
        elif t.device.type != "meta" and not isinstance(t, FakeTensor):  # fakes (explain) have no address
            found.add(_layout(t))
    return found


def _module_state(modules: Sequence[nn.Module]) -> set[Layout]:
    return _layouts_of([t for m in modules for t in (*m.parameters(), *m.buffers())])


class _LazyRegion(nn.Module):
    """A region of a split graph, compiled with the inputs of its first call (the previous region's
    real outputs, so that strides Inductor chose upstream are the ones compiled for). One that
    AOTAutograd cannot trace runs as written, uncaptured, and the report says why: found only now,
    after Dynamo's compile, it can no longer be a graph break of Dynamo's."""

    def __init__(self, gm: fx.GraphModule, compile: Callable[[list[Any]], Callable[..., Any]], name: str,
                 record: TransformRecord) -> None:
        super().__init__()
        output = next(n for n in gm.graph.nodes if n.op == "output")
        self._single = not isinstance(output.args[0], (tuple, list))
        if self._single:  # AOTAutograd compiles graphs that return tuples
            output.args = ((output.args[0],),)
            gm.recompile()
        self.gm, self._compile, self.region_name, self._record = gm, compile, name, record
        self._compiled: Callable[..., Any] | None = None

    def forward(self, *args: Any) -> Any:
        if self._compiled is None:
            self._compiled = self._compiled_or_as_written(list(args))
        results = self._compiled(*args)
        return results[0] if self._single else results

    def _compiled_or_as_written(self, args: list[Any]) -> Callable[..., Any]:
        try:
            return self._compile(args)
        except UNTRACEABLE as error:
            self._record.changes = [c for c in self._record.changes if c.target != self.region_name]
            self._record.skipped(self.region_name, _untraceable_reason(
                error, "found when it first ran, after Dynamo's compile, it runs as written: neither compiled nor "
                       "recorded"))
            return self.gm.forward
        except Exception as error:
            raise RuntimeError(f"xform: transform 'cudagraphs': compiling {self.region_name} failed: "
                               f"{type(error).__name__}: {error}") from error


@register_transform
class CudaGraphs(Transform):
    """Record the capture-safe regions of each graph as CUDA graphs (one shared memory pool)."""

    name = "cudagraphs"

    def __init__(self, *, min_region_ops: int = 2, max_signatures: int = 64, warmup: int = 1,
                 stale_outputs: str = "copy", **unknown: Any) -> None:
        if unknown:  # a ValueError, as for bad values, rather than Python's TypeError
            option, value = next(iter(unknown.items()))
            why = f" ({option} was removed: {REMOVED[option]})" if option in REMOVED else ""
            raise option_error(self.name, option, value, f"only the options {', '.join(OPTIONS)}{why}")
        for option, value in (("min_region_ops", min_region_ops), ("max_signatures", max_signatures),
                              ("warmup", warmup)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise option_error(self.name, option, value, "an int >= 1")
        if stale_outputs not in STALE_OUTPUTS:
            raise option_error(self.name, "stale_outputs", stale_outputs,
                               "'copy' (an output still alive where a later replay writes is copied out of the way) "
                               "or 'error' (it is invalidated, and reading it raises, as mode='reduce-overhead' does)")
        self.min_region_ops = min_region_ops
        self.max_signatures = max_signatures
        self.warmup = warmup
        self.stale_outputs = stale_outputs
        self.functions: list[GraphedFunction] = []  # every recorded region function, with its ReplayStats

    def required_inductor_config(self) -> dict[str, Any]:
        return {"triton.cudagraphs": False}  # xform records the graphs; Inductor must not as well

    def compile_graph(self, graph: CapturedGraph, compile: Callable[..., Callable[..., Any]],
                      record: TransformRecord) -> Callable[..., Any] | None:
        recorder = available_recorder()
        if recorder is None:
            record.skipped("graph", NO_GPU)
            return None
        whole = graph_level_reason(graph.gm, recorder.device_type)
        if whole is not None:
            record.skipped("graph", whole)
            return None
        breaks = find_breaks(graph.gm, recorder.device_type)
        for node_break in breaks.values():
            record.skipped(f"{node_break.op} (node {node_break.node})" + (f" at {node_break.source}" if node_break.source
                                                                           else ""),
                           f"{node_break.reason}. Fix: {node_break.fix}")
        plan = plan_regions(graph.gm, set(breaks) | host_numbers(graph.gm), self.min_region_ops)
        for index, region in enumerate(plan.regions):
            if region.why_plain:
                record.skipped(f"region {index} ({region.op_count} ops)", region.why_plain)
        if not plan.graphed:
            return None
        wrap = self._wrapper(recorder, _module_state(graph.root_modules()), record)
        if len(plan.regions) == 1:
            try:
                compiled = compile(graph.gm, graph.example_inputs, wrap_inner=wrap)
            except UNTRACEABLE as error:  # compiled by the handoff alone, as without this transform
                record.skipped("graph", _untraceable_reason(error))
                return None
            record.changed("region", "region 0", f"the whole graph, {plan.regions[0].op_count} ops")
            return compiled
        return self._split(graph, plan, compile, wrap, record)

    def _wrapper(self, recorder: GraphRecorder, module_state: set[Layout],
                 record: TransformRecord) -> Callable[[Callable[..., Any], str, Sequence[int], Sequence[int]], GraphedFunction]:
        def wrap(compiled: Callable[..., Any], kind: str, static_input_idxs: Sequence[int],
                 written: Sequence[int]) -> GraphedFunction:
            # Inductor counts a backward's saved tensors as static (CUDA Graph Trees keep the
            # forward's outputs in place); here those the forward's replay left in the pool are
            # read in place (`GraphedFunction` finds them), and any others copied in
            static = set(static_input_idxs) if kind != "backward" else set()

            def is_module_state(index: int, t: torch.Tensor) -> bool:
                return (index in static or isinstance(t, nn.Parameter) or has_static_address(t)
                        or _layout(t) in module_state)

            function = GraphedFunction(compiled, f"{kind} {len(self.functions)}", recorder, is_module_state,
                                       written=written, warmup=self.warmup, max_signatures=self.max_signatures,
                                       stale_outputs=self.stale_outputs, on_event=record.note)
            self.functions.append(function)
            return function

        return wrap

    def _split(self, graph: CapturedGraph, plan: RegionPlan, compile: Callable[..., Callable[..., Any]],
               wrap: Callable[..., GraphedFunction], record: TransformRecord) -> Callable[..., Any]:
        """The graph as one call per region: graphed regions recorded, small safe ones compiled
        plainly, the ops of those holding breaks inline between them."""
        # regions holding breaks (host reads, CPU ops) stay inline and run as written: Inductor
        # cannot always take them alone (an .item() outside Dynamo's shape environment)
        fused = [i for i, r in enumerate(plan.regions) if r.kind == SAFE or r.why_plain]
        split = fuse_by_partitions(graph.gm, [dict.fromkeys(plan.regions[i].nodes) for i in fused], prefix="xform_region_")
        # fuse_by_partitions names partition p "xform_region_p" and orders by data alone; put every
        # region in the plan's order, which also keeps in-place writes and reads in order
        calls = {fused[int(n.target.rpartition("_")[2])]: n for n in split.graph.nodes if n.op == "call_module"}
        by_name = {n.name: n for n in split.graph.nodes}  # the split graph is a copy: find inline ops by name
        last = next(n for n in reversed(split.graph.nodes) if n.op == "placeholder")
        for index, region in enumerate(plan.regions):
            call = calls.get(index)
            nodes = [by_name[n.name] for n in region.nodes] if call is None else [call, *[u for u in call.users if u.target is operator.getitem]]
            for node in nodes:
                last.append(node)
                last = node
        split.graph.lint()
        for index, call in calls.items():
            region, sub = plan.regions[index], getattr(split, call.target)
            label = f"region {index} ({region.op_count} ops, {region.kind})"
            wrap_inner = wrap if region.kind == SAFE else None
            if region.kind == SAFE:
                record.changed("region", label)

            def compile_region(args: list[Any], sub: fx.GraphModule = sub, wrap_inner: Any = wrap_inner) -> Any:
                return compile(sub, args, wrap_inner=wrap_inner)

            setattr(split, call.target, _LazyRegion(sub, compile_region, label, record))
        split.recompile()
        return split.forward
