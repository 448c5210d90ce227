"""`Distribute`: a single-device model runs data-parallel, sharded (FSDP-style) or tensor-parallel under torchrun.

`Distribute(strategy="ddp"|"fsdp"|"tp"|"fsdp+tp", mesh=None, tp_size=None)`, spec
`distribute:<strategy>`. The user launches with `torchrun`; xform initializes the process group if
needed (NCCL on CUDA, gloo on CPU) and uses the world group unless given a 1-D DeviceMesh or a
ProcessGroup as `mesh` (for `fsdp+tp`: a 2-D DeviceMesh, data-parallel dim first).

What it changes, per graph (all in `transform_graph`, since tensor parallelism must read the
graph to know how to cut each weight):
- `ddp`: parameters stay as they are (replicated); each parameter the graph reads goes through
  an identity whose backward all-reduces (averages) its gradient. In the AOT backward graph the
  all-reduces are merged into buckets of about 25 MB (`bucket_all_reduces`).
- `fsdp` (Inductor reorders the all-gathers for compute/communication overlap): each floating
  parameter is replaced by a `ShardedParameter` holding this rank's 1/N of it (dim 0, padded to a
  multiple of N): the module holds the shard, so an optimizer created after the first call steps
  shards, and the guard on it expects the shard's shape. The graph all-gathers each shard where it
  is read; the all-gather's backward reduce-scatters (averages) the gradient.
- `tp`: the graph's column/row-parallel Linear pairs are found by following shardings through it
  (`tp_plan`: attention's qkv -> out projection, the MLP's up/gate -> down) and cut
  Megatron-style (`tp_rewrite`): every rank runs the same batch on its 1/N of the heads and
  of the hidden features, with one all-reduce per pair forward (and one backward). Linears it
  cannot pair stay replicated, and the report says why for each.
- `fsdp+tp`: on a (data-parallel, tensor-parallel) mesh, `tp` over the second dim, then `fsdp` of
  every (already cut) parameter over the first.
`state_dict()` gives full tensors (gathered, so every rank must call it) and `load_state_dict`
takes them back, each rank keeping its cut. Single process (WORLD_SIZE 1, no process group):
nothing changes, and the report says so.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from xform.captured import CapturedGraph, GraphParameter
from xform.fx_rewrite import example_value
from xform.registry import register_transform
from xform.report import TransformRecord, format_bytes
from xform.transforms.distribute.sharding import ShardedParameter, ShardSpec, cut_parameter, gather_cut
from xform.transforms.distribute.tp_plan import plan_tensor_parallel
from xform.transforms.distribute.tp_rewrite import apply_plan, linear_refusal, reduce_gradient
from xform.transform import Transform, option_error

STRATEGIES = ("ddp", "fsdp", "tp", "fsdp+tp")
BUCKET_BYTES = 25 * 2**20
SINGLE_PROCESS = "single process (WORLD_SIZE 1, no process group): nothing to distribute"


@register_transform
class Distribute(Transform):
    """Data-parallel, FSDP-style and tensor-parallel distribution through torch.distributed
    (`distribute:<strategy>`)."""

    name = "distribute"
    must_follow = {
        "quantize": "it shards the weights quantize made (Float8Linear keeps a plain weight to shard)",
        "cast": "it shards the weights cast made",
    }

    def __init__(self, strategy: str = "fsdp", *, mesh: Any = None, tp_size: int | None = None) -> None:
        if strategy not in STRATEGIES:
            raise option_error(self.name, "strategy", strategy, ", ".join(STRATEGIES))
        if tp_size is not None and (strategy != "fsdp+tp" or not isinstance(tp_size, int) or tp_size < 2):
            raise option_error(self.name, "tp_size", tp_size, "an int >= 2, with strategy 'fsdp+tp' only")
        self.strategy = strategy
        self.mesh = mesh
        self.tp_size = tp_size
        self._groups_given = _groups_of(mesh, strategy, self.name)
        if "tp" in strategy:
            # an instance attribute: only tensor parallelism cares, since it changes the head count
            self.must_precede = {"flex-attention": "tensor parallelism cuts attention by heads, and the block "
                                                   "masks flex-attention builds must be for the local heads"}

    @classmethod
    def from_spec(cls, argument: str | None) -> Distribute:
        return cls(argument or "fsdp")

    def inductor_config(self) -> dict[str, Any]:
        # let Inductor issue each all-gather early (the next layer's while this one computes) and
        # sink the waits: the overlap FSDP gets from prefetching
        return {"reorder_for_compute_comm_overlap": True} if "fsdp" in self.strategy else {}

    def _groups(self, device: torch.device) -> tuple[Any, Any] | None:
        """(data-parallel group, tensor-parallel group), either None where the strategy has none;
        the default process group is initialized under torchrun. None when running alone."""
        if self._groups_given is not None:
            return self._groups_given
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
                return None
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if dist.get_world_size() == 1:
            return None
        world = dist.group.WORLD
        if self.strategy == "fsdp+tp":
            self._groups_given = _default_mesh_groups(device, self.tp_size, self.name)
            return self._groups_given
        return (None, world) if self.strategy == "tp" else (world, None)

    def transform_graph(self, graph: CapturedGraph, record: TransformRecord) -> None:
        params = [p for p in graph.parameters if p.tensor.is_floating_point()]
        groups = self._groups(params[0].tensor.device if params else torch.device("cpu"))
        if groups is None:
            record.note(SINGLE_PROCESS)
            return
        data, tensor = groups
        if tensor is not None:
            _tensor_parallel(graph, tensor, record, by=self.name)
        if self.strategy == "ddp":
            record.note(f"{len(params)} parameters replicated over {dist.get_world_size(data)} ranks; "
                        f"gradients averaged")
            for param in params:
                if param.tensor.requires_grad:
                    _route_through(graph, param, reduce_gradient, ("avg", data.group_name))
        elif data is not None:
            _fully_shard(graph, data, record, by=self.name)

    def transform_aot_graph(self, gm: fx.GraphModule, kind: str, record: TransformRecord) -> None:
        if kind == "backward" and self.strategy == "ddp":
            buckets = bucket_all_reduces(gm, BUCKET_BYTES)
            if buckets:
                record.changed("nodes", f"{buckets} gradient buckets", "all-reduces merged, ~25 MB each")


def _tensor_parallel(graph: CapturedGraph, group: Any, record: TransformRecord, *, by: str) -> None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = plan_tensor_parallel(graph.gm.graph, world, lambda n: linear_refusal(graph, n),
                                lambda n: linear_refusal(graph, n))
    for fqn, detail in apply_plan(graph, plan, group.group_name, rank, by=by):
        record.changed("parameter", fqn, detail)
    for linear, reason in plan.refused.items():
        record.skipped(graph.calling_module_path(linear) or linear.name, f"stays replicated: {reason}")
    if not plan.columns:
        record.note(f"tensor parallelism over {world} ranks found no column/row-parallel Linear pair to cut")


def _fully_shard(graph: CapturedGraph, group: Any, record: TransformRecord, *, by: str) -> None:
    """FSDP: every floating parameter cut by rows over `group`, gathered where the graph reads it."""
    world = dist.get_world_size(group)
    cut_here = {c.source for c in graph.guards.changes if c.changed_by == by}  # by tensor parallelism, just now
    for param in graph.parameters:
        if not param.tensor.is_floating_point():
            continue
        reason = _shard_refusal(param)
        if reason is not None:
            record.skipped(param.fqn, reason)
            continue
        if isinstance(param.tensor, ShardedParameter) and param.source not in cut_here:
            continue  # a retrace of a model sharded before: its graph already gathers it
        before_bytes, reader_value = param.tensor.nbytes, param.node.meta["example_value"]
        spec = ShardSpec(0, param.tensor.shape[0], group.group_name, world, dist.get_rank(group), 1, "avg")
        new = cut_parameter(graph, param, spec, by=by)
        _route_through(graph, param, gather_cut, dataclasses.astuple(spec), value=reader_value)
        record.changed("parameter", param.fqn, f"{tuple(new.shape)} shard of {spec.size} rows, "
                                               f"{format_bytes(before_bytes)} -> {format_bytes(new.nbytes)}")


def _groups_of(mesh: Any, strategy: str, transform: str) -> tuple[Any, Any] | None:
    """The (data-parallel, tensor-parallel) groups a `mesh` option names; None: the defaults, resolved later."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None:
        return None
    if strategy == "fsdp+tp":
        if isinstance(mesh, DeviceMesh) and mesh.ndim == 2:
            return mesh.get_group(0), mesh.get_group(1)
        raise option_error(transform, "mesh", mesh, "None (a (world / tp_size, tp_size) mesh is built) or a 2-D "
                                                    "DeviceMesh (data-parallel dim, tensor-parallel dim)")
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 1:
        mesh = mesh.get_group()
    if not isinstance(mesh, dist.ProcessGroup):
        raise option_error(transform, "mesh", mesh, "None (the world group), a 1-D DeviceMesh or a ProcessGroup")
    return (None, mesh) if strategy == "tp" else (mesh, None)


def _default_mesh_groups(device: torch.device, tp_size: int | None, transform: str) -> tuple[Any, Any]:
    """The (data-parallel, tensor-parallel) groups of the default `fsdp+tp` mesh: tensor parallelism
    within a node (LOCAL_WORLD_SIZE ranks, when there are several nodes; else tp_size or 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    tp = tp_size or (local if local < world else 2)
    if world % tp or world == tp:
        raise ValueError(f"xform: transform '{transform}': strategy 'fsdp+tp' needs the {world} ranks to be several "
                         f"groups of tp_size={tp} ranks; pass tp_size= dividing {world} (smaller than it), or use "
                         f"strategy 'tp' or 'fsdp'")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh.get_group(0), mesh.get_group(1)


def _shard_refusal(param: GraphParameter) -> str | None:
    if param.owner is None:
        return "it is not a module parameter (passed as an argument): there is no module to hold its shard"
    if type(param.tensor) not in (nn.Parameter, ShardedParameter):
        return (f"it is a {type(param.tensor).__name__} (another transform changed it); distribute shards plain "
                f"parameters: put distribute before transforms that replace weights by tensor subclasses")
    if param.tensor.dim() == 0:
        return "it is a scalar"
    return None


def _route_through(graph: CapturedGraph, param: GraphParameter, fn: Any, extra: tuple[Any, ...], *,
                   value: Any = None) -> None:
    """Make every reader of the parameter's placeholder read `fn(placeholder, *extra)` instead;
    `value`: what that gives the readers (default: what they were traced with)."""
    g = graph.gm.graph
    node = param.node
    users = list(node.users)
    if not users:
        return
    with g.inserting_after(node):
        routed = g.call_function(fn, (node, *extra))
    routed.meta["example_value"] = value if value is not None else param.traced_value
    for user in users:
        user.replace_input_with(node, routed)


def bucket_all_reduces(gm: fx.GraphModule, bucket_bytes: int) -> int:
    """Merge the backward graph's gradient all-reduces into flat buckets: one all-reduce per bucket
    of about `bucket_bytes` (fewer, larger collectives). Returns the number of buckets made."""
    ops = torch.ops._c10d_functional
    reduces = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.all_reduce.default]
    waits = {n: next((u for u in n.users if u.target is ops.wait_tensor.default), None) for n in reduces}
    groups: dict[tuple, list[fx.Node]] = {}
    for node in reduces:
        if waits[node] is not None:
            groups.setdefault(tuple(node.args[1:]), []).append(node)
    made = 0
    g = gm.graph
    for key, nodes in groups.items():
        bucket: list[fx.Node] = []
        size = 0
        for node in nodes + [None]:
            value = example_value(node.args[0]) if node is not None else None
            nbytes = value.numel() * value.element_size() if value is not None else 0
            if node is None or (bucket and size + nbytes > bucket_bytes):
                if len(bucket) > 1:
                    _merge_bucket(g, bucket, waits, key)
                    made += 1
                bucket, size = [], 0
            if node is not None:
                bucket.append(node)
                size += nbytes
    if made:
        g.eliminate_dead_code()
        g.lint()
        gm.recompile()
    return made


def _merge_bucket(g: fx.Graph, bucket: list[fx.Node], waits: dict, key: tuple) -> None:
    ops = torch.ops._c10d_functional
    aten = torch.ops.aten
    last = max(bucket, key=lambda n: list(g.nodes).index(n))
    shapes = [tuple(example_value(n.args[0]).shape) for n in bucket]
    with g.inserting_before(last.next):  # keeps successive inserts in order (inserting_after would reverse them)
        flats = [g.call_function(aten.view.default, (n.args[0], [-1])) for n in bucket]
        cat = g.call_function(aten.cat.default, (flats,))
        reduced = g.call_function(ops.all_reduce.default, (cat, *key))
        waited = g.call_function(ops.wait_tensor.default, (reduced,))
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        pieces = g.call_function(aten.split_with_sizes.default, (waited, sizes))
        replacements = []
        for i, (node, shape) in enumerate(zip(bucket, shapes)):
            piece = g.call_function(operator.getitem, (pieces, i))
            replacements.append((node, g.call_function(aten.view.default, (piece, list(shape)))))
    for node, replacement in replacements:
        waits[node].replace_all_uses_with(replacement)
