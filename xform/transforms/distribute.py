"""`Distribute`: a single-device model runs data-parallel or sharded (FSDP-style) under torchrun.

`Distribute(strategy="ddp"|"fsdp"|"tp"|"fsdp+tp", mesh=None)`, spec `distribute:<strategy>`. The
user launches with `torchrun`; xform initializes the process group if needed (NCCL on CUDA, gloo
on CPU) and uses the world group unless given a 1-D DeviceMesh or a ProcessGroup as `mesh`.

What it changes, per graph:
- `ddp`: parameters stay as they are (replicated); each parameter the graph reads goes through
  an identity whose backward all-reduces (averages) its gradient. In the AOT backward graph the
  all-reduces are merged into buckets of about 25 MB (`bucket_all_reduces`).
- `fsdp` (Inductor reorders the all-gathers for compute/communication overlap): each floating parameter is replaced by a `ShardedParameter` holding this rank's 1/N of
  it (dim 0, padded to a multiple of N): the module holds the shard, so an optimizer created after
  the first call steps shards, and the guard on it expects the shard's shape. The graph
  all-gathers each shard where it is read; the all-gather's backward reduce-scatters (averages)
  the gradient. `state_dict()` gives full tensors (gathered, so every rank must call it) and
  `load_state_dict` takes them back.
`ShardedParameter` keeps the eager meaning: any computation with it sees the full tensor (it
gathers), while in-place updates (an optimizer) and metadata see the local shard. That is what
lets a recompile retrace the sharded model.

Single process (WORLD_SIZE 1, no process group): nothing changes, and the report says so.
Tensor parallelism (`tp`, `fsdp+tp`) is not built yet and says so.
"""

from __future__ import annotations

import operator
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from xform.captured import CapturedGraph, GraphParameter
from xform.fx_rewrite import example_value
from xform.registry import TransformNotAvailable, register_transform
from xform.report import TransformRecord
from xform.transform import Transform, option_error

STRATEGIES = ("ddp", "fsdp", "tp", "fsdp+tp")
BUCKET_BYTES = 25 * 2**20


def _world(group: Any) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


# -- collectives with the gradients data parallelism needs --------------------------------------------

class _GatherShards(torch.autograd.Function):
    """All-gather dim-0 shards into the full tensor; backward: reduce-scatter the mean gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, rows: int, group_name: str) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        ctx.group_name, ctx.padded = group_name, None
        full = funcol.all_gather_tensor(shard.contiguous(), 0, group_name)
        if full.shape[0] != rows:
            ctx.padded = full.shape[0]
            full = full[:rows]
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import torch.distributed._functional_collectives as funcol

        if ctx.padded is not None:
            grad = torch.cat([grad, grad.new_zeros(ctx.padded - grad.shape[0], *grad.shape[1:])])
        return funcol.reduce_scatter_tensor(grad.contiguous(), "avg", 0, ctx.group_name), None, None


class _AverageGradient(torch.autograd.Function):
    """Identity; backward: all-reduce (average) the gradient across ranks."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(grad.contiguous(), "avg", ctx.group_name), None


def gather_full(shard: torch.Tensor, rows: int, group_name: str) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return _GatherShards.apply(shard, rows, group_name)


def average_gradient(param: torch.Tensor, group_name: str) -> torch.Tensor:
    return _AverageGradient.apply(param, group_name)


# -- the sharded parameter ----------------------------------------------------------------------------

_LOCAL_METHODS = {
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "data_ptr", "element_size",
    "untyped_storage", "storage", "type", "get_device", "to", "cpu", "cuda", "float", "half", "bfloat16", "double",
    "detach", "clone", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "contiguous",
    "requires_grad_", "retain_grad", "register_hook", "backward", "tolist", "item", "numpy",
}
_ARITHMETIC_DUNDERS = {
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__matmul__", "__rmatmul__", "__neg__", "__pow__", "__rpow__", "__getitem__", "__mod__", "__floordiv__",
}
_KEEPS_TYPE = {"detach", "clone", "to", "cpu", "cuda", "float", "half", "bfloat16", "double", "contiguous"}


def _is_local(func: Any) -> bool:
    """Whether `func` acts on the shard itself (metadata, in-place updates, copies) rather than
    computing with the parameter's value (which needs the full tensor)."""
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True  # aten ops: what compiled graphs run, on the tensors exactly as given
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # attributes: shape, grad, data, requires_grad, ...
        return True
    if name.startswith("__") and name.endswith("__"):
        return name not in _ARITHMETIC_DUNDERS
    return (name.startswith("_") or name.endswith("_") or name.endswith("_like") or name.startswith("is_")
            or name in _LOCAL_METHODS)


class ShardedParameter(torch.Tensor):
    """This rank's dim-0 shard of a parameter; computations with it see the full tensor.

    Attributes `full_rows` (the unsharded dim 0) and `group_name` say how to gather it.
    """

    full_rows: int
    group_name: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_local(func):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            if getattr(func, "__name__", "") in _KEEPS_TYPE and isinstance(out, torch.Tensor):
                return _mark(torch.Tensor._make_subclass(cls, out, out.requires_grad), args[0])
            return out
        full = torch.utils._pytree.tree_map(
            lambda a: gather_full(a, a.full_rows, a.group_name) if isinstance(a, ShardedParameter) else a,
            (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*full[0], **full[1])


def _mark(shard: ShardedParameter, like: ShardedParameter) -> ShardedParameter:
    shard.full_rows, shard.group_name = like.full_rows, like.group_name
    return shard


def shard_parameter(param: torch.Tensor, world: int, rank: int, group_name: str) -> nn.Parameter:
    rows = param.shape[0]
    per_rank = -(-rows // world)
    padded = param.detach()
    if per_rank * world != rows:
        padded = torch.cat([padded, padded.new_zeros(per_rank * world - rows, *padded.shape[1:])])
    local = padded[rank * per_rank:(rank + 1) * per_rank].clone()
    shard = torch.Tensor._make_subclass(ShardedParameter, local, param.requires_grad)
    shard.full_rows, shard.group_name = rows, group_name
    return nn.Parameter(shard, requires_grad=param.requires_grad)


# -- state dict: full tensors out, full tensors in ------------------------------------------------------

def _full_state_dict_hook(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    for name, param in module.named_parameters(recurse=False):
        if isinstance(param, ShardedParameter):
            group = _group_by_name(param.group_name)
            with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
                shard = param.detach().contiguous()
                full = shard.new_empty(shard.shape[0] * dist.get_world_size(group), *shard.shape[1:])
                dist.all_gather_into_tensor(full, shard, group=group)
            state[prefix + name] = full[:param.full_rows]


def _shard_on_load_hook(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        if isinstance(param, ShardedParameter) and key in state and state[key].shape[0] == param.full_rows:
            world, rank = _world(_group_by_name(param.group_name))
            state[key] = shard_parameter(state[key], world, rank, param.group_name).detach()


def _group_by_name(name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


# -- the transform ------------------------------------------------------------------------------------

@register_transform
class Distribute(Transform):
    """Data-parallel / FSDP-style sharding through torch.distributed (`distribute:<strategy>`)."""

    name = "distribute"
    must_follow = {
        "quantize": "it shards the weights quantize made (Float8Linear keeps a plain weight to shard)",
        "cast": "it shards the weights cast made",
    }

    def __init__(self, strategy: str = "fsdp", *, mesh: Any = None) -> None:
        if strategy not in STRATEGIES:
            raise option_error(self.name, "strategy", strategy, ", ".join(STRATEGIES))
        if strategy in ("tp", "fsdp+tp"):
            raise TransformNotAvailable(
                f"xform: transform 'distribute': strategy {strategy!r} (tensor parallelism) is not available yet "
                f"(issue #3); 'ddp' and 'fsdp' are")
        self.strategy = strategy
        self.mesh = mesh
        self.group = _group_of(mesh, self.name)

    @classmethod
    def from_spec(cls, argument: str | None) -> Distribute:
        return cls(argument or "fsdp")

    def inductor_config(self) -> dict[str, Any]:
        # let Inductor issue each all-gather early (the next layer's while this one computes) and
        # sink the waits: the overlap FSDP gets from prefetching
        return {"reorder_for_compute_comm_overlap": True} if self.strategy == "fsdp" else {}

    def _process_group(self, device: torch.device) -> Any | None:
        """The group to distribute over, initializing the default one under torchrun; None alone."""
        if self.group is not None:
            return self.group
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
                return None
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return dist.group.WORLD if dist.get_world_size() > 1 else None

    def transform_parameters(self, graph: CapturedGraph, record: TransformRecord) -> None:
        params = [p for p in graph.parameters if p.tensor.is_floating_point()]
        device = params[0].tensor.device if params else torch.device("cpu")
        group = self._process_group(device)
        if group is None:
            record.note("single process (WORLD_SIZE 1, no process group): nothing to distribute")
            return
        world, rank = _world(group)
        if self.strategy == "ddp":
            record.note(f"{len(params)} parameters replicated over {world} ranks; gradients averaged")
            return
        for param in params:
            reason = _shard_refusal(param)
            if reason is not None:
                record.skipped(param.fqn, reason)
                continue
            if isinstance(param.tensor, ShardedParameter):
                continue
            before = param.tensor.nbytes
            new = shard_parameter(param.tensor, world, rank, group.group_name)
            graph.replace_parameter(param, new, by=self.name, placement=f"Shard(0) of {world}")
            _install_state_dict_hooks(graph, param.owner)
            record.changed("parameter", param.fqn, f"{tuple(param.node.meta['example_value'].shape)} shard of "
                                                   f"{param.tensor.full_rows} rows, {before} -> {new.nbytes} bytes")

    def transform_graph(self, graph: CapturedGraph, record: TransformRecord) -> None:
        group = self.group if self.group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        if group is None or dist.get_world_size(group) == 1:
            return
        sharded_here = {c.source for c in graph.guards.changes if c.changed_by == self.name}
        for param in graph.parameters:
            if self.strategy == "fsdp" and param.source in sharded_here:  # a retrace already gathers them
                _route_through(graph, param, gather_full, (param.tensor.full_rows, param.tensor.group_name))
            elif self.strategy == "ddp" and param.tensor.requires_grad:
                _route_through(graph, param, average_gradient, (group.group_name,))

    def transform_aot_graph(self, gm: fx.GraphModule, kind: str, record: TransformRecord) -> None:
        if kind == "backward" and self.strategy == "ddp":
            buckets = bucket_all_reduces(gm, BUCKET_BYTES)
            if buckets:
                record.changed("nodes", f"{buckets} gradient buckets", "all-reduces merged, ~25 MB each")


def _group_of(mesh: Any, transform: str) -> Any:
    """The process group a `mesh` option names (None: the default world group, resolved later)."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None or isinstance(mesh, dist.ProcessGroup):
        return mesh
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 1:
        return mesh.get_group()
    raise option_error(transform, "mesh", mesh, "None (the world group), a 1-D DeviceMesh or a ProcessGroup")


def _shard_refusal(param: GraphParameter) -> str | None:
    if param.owner is None:
        return "it is not a module parameter (passed as an argument): there is no module to hold its shard"
    if type(param.tensor) not in (nn.Parameter, ShardedParameter):
        return (f"it is a {type(param.tensor).__name__} (another transform changed it); distribute shards plain "
                f"parameters: put distribute before transforms that replace weights by tensor subclasses")
    if param.tensor.dim() == 0:
        return "it is a scalar"
    return None


def _install_state_dict_hooks(graph: CapturedGraph, module: nn.Module) -> None:
    if getattr(module, "_xform_sharded", False):
        return
    handles = [module._register_state_dict_hook(_full_state_dict_hook),
               module._register_load_state_dict_pre_hook(_shard_on_load_hook, with_module=True)]
    object.__setattr__(module, "_xform_sharded", True)

    def undo() -> None:
        for handle in handles:
            handle.remove()
        object.__setattr__(module, "_xform_sharded", False)

    graph.on_undo(undo)


def _route_through(graph: CapturedGraph, param: GraphParameter, fn: Any, extra: tuple[Any, ...]) -> None:
    """Make every reader of the parameter's placeholder read `fn(placeholder, *extra)` instead."""
    g = graph.gm.graph
    node = param.node
    users = list(node.users)
    if not users:
        return
    with g.inserting_after(node):
        routed = g.call_function(fn, (node, *extra))
    routed.meta["example_value"] = param.traced_value  # what the readers were traced with: the full tensor
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
