"""Parameters held as this rank's shard: how a tensor is cut, gathered back, and kept meaningful in eager.

A `ShardSpec` says how one dimension of a tensor is split over a process group: the dimension is
seen as `outer` blocks, and each block is cut into N equal chunks, rank r keeping chunk r of every
block. `outer == 1` is the plain contiguous split (FSDP's dim 0, a Megatron row-parallel weight's
columns); `outer == 3` is how a fused qkv weight is column-sharded by heads (each rank keeps its
heads of q, of k and of v). A parameter may be cut more than once (tensor- then data-parallel):
`ShardedParameter.shards` lists the cuts, first applied first.

`ShardedParameter` keeps the eager meaning of a sharded parameter: any computation with it sees
the full tensor (it gathers), while in-place updates (an optimizer), copies and metadata see the
local shard. That is what lets a recompile retrace the sharded model, and lets user code that
reads a weight outside the compiled graph get the right values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from xform._torch.dispatch import DisableTorchFunctionSubclass, is_op_overload, make_subclass
from xform._torch.modules import add_state_dict_hooks
from xform._torch.pytree import tree_map
from xform.captured import CapturedGraph, GraphParameter


@dataclass(frozen=True)
class ShardSpec:
    """One cut of a tensor over a process group (see the module docstring)."""

    dim: int
    size: int  # the dimension's size before this cut
    group_name: str
    world: int  # the group's size and this rank's place in it: known when cutting, and read while tracing
    rank: int  # (a retrace must not call into the process group, which Dynamo cannot trace)
    outer: int = 1
    # how the gathered tensor's gradient goes back to the shard: "avg" when ranks see different data
    # (reduce-scatter the mean, FSDP), "slice" when every rank computes the same full gradient (TP)
    gradient: str = "avg"


def _blocked(tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """`tensor` (full or padded along spec.dim) viewed as (..., outer, world, chunk, ...)."""
    shape = list(tensor.shape)
    chunk = shape[spec.dim] // (spec.outer * spec.world)
    return tensor.reshape(*shape[:spec.dim], spec.outer, spec.world, chunk, *shape[spec.dim + 1:])


def _padded_size(spec: ShardSpec) -> int:
    """The cut dimension's size rounded up so that every rank's chunk is the same (only outer == 1 pads)."""
    per_rank = -(-spec.size // (spec.outer * spec.world))
    return per_rank * spec.outer * spec.world


def local_part(full: torch.Tensor, spec: ShardSpec, rank: int | None = None) -> torch.Tensor:
    """Rank `rank`'s (default: this rank's) chunk of every block of `full` along `spec.dim`
    (zero-padded if it does not divide)."""
    size = _padded_size(spec)
    if size != full.shape[spec.dim]:
        pad = list(full.shape)
        pad[spec.dim] = size - full.shape[spec.dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=spec.dim)
    blocked = _blocked(full, spec).select(spec.dim + 1, spec.rank if rank is None else rank)
    shape = list(full.shape)
    shape[spec.dim] = size // spec.world
    return blocked.reshape(shape)


def _all_gather(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's `local`, as `local_part` cut it."""
    from xform._torch.distributed import funcol

    moved = local.movedim(spec.dim, 0).contiguous()
    gathered = funcol.all_gather_tensor(moved, 0, spec.group_name)  # (world * chunk * outer, ...) rank-major
    chunk = moved.shape[0] // spec.outer
    blocks = gathered.reshape(spec.world, spec.outer, chunk, *moved.shape[1:]).transpose(0, 1)
    full = blocks.reshape(spec.world * moved.shape[0], *moved.shape[1:]).movedim(0, spec.dim)
    return full.narrow(spec.dim, 0, spec.size) if full.shape[spec.dim] != spec.size else full


class _Gather(torch.autograd.Function):
    """All-gather a cut tensor; backward: reduce-scatter the mean gradient, or keep this rank's slice."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        ctx.spec = spec
        return _all_gather(local, spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from xform._torch.distributed import funcol

        spec = ctx.spec
        if spec.gradient == "slice":
            return local_part(grad, spec).contiguous(), None
        rank_major = torch.cat([local_part(grad, spec, r).movedim(spec.dim, 0) for r in range(spec.world)])
        reduced = funcol.reduce_scatter_tensor(rank_major.contiguous(), "avg", 0, spec.group_name)
        return reduced.movedim(0, spec.dim), None


def gather(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full tensor that `local` is this rank's cut of (differentiable)."""
    with DisableTorchFunctionSubclass():
        return _Gather.apply(local, spec)


def gather_cut(local: torch.Tensor, dim: int, size: int, group_name: str, world: int, rank: int, outer: int,
               gradient: str) -> torch.Tensor:
    """`gather` for FX graphs, which take constants as call arguments but not dataclasses."""
    return gather(local, ShardSpec(dim, size, group_name, world, rank, outer, gradient))


def gather_all(local: torch.Tensor, shards: tuple[ShardSpec, ...]) -> torch.Tensor:
    """Undo every cut of `shards`, last first."""
    for spec in reversed(shards):
        local = gather(local, spec)
    return local


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


def is_local(func: Any) -> bool:
    """Whether `func` acts on the shard itself (metadata, in-place updates, copies) rather than
    computing with the parameter's value (which needs the full tensor)."""
    if is_op_overload(func):
        return True  # aten ops: what compiled graphs run, on the tensors exactly as given
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # attributes: shape, grad, data, requires_grad, ...
        return True
    # slices, not str.startswith/endswith: Dynamo traces this on a retrace and cannot trace those
    if name[:2] == "__" and name[-2:] == "__":
        return name not in _ARITHMETIC_DUNDERS
    return (name[:1] == "_" or name[-1:] == "_" or name[-5:] == "_like" or name[:3] == "is_"
            or name in _LOCAL_METHODS)


class ShardedParameter(torch.Tensor):
    """This rank's cut of a parameter (`shards`: how it was cut); computations with it see the full tensor."""

    shards: tuple[ShardSpec, ...]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # a call writing into `out=` is a compiled kernel's (Inductor's extern_kernels.addmm(bias, ...,
        # out=buf)): it computes with the tensors exactly as given, like an aten op
        if is_local(func) or "out" in kwargs:
            with DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            if getattr(func, "__name__", "") not in _KEEPS_TYPE or not isinstance(out, torch.Tensor):
                return out
            # a no-op copy (`bias.to(bias.dtype)`) is the parameter itself: given back as `args[0]`,
            # since while Dynamo traces this `out` is the same tensor without its subclass
            return args[0] if out is args[0] else _as_sharded(out, args[0].shards)
        full = tree_map(
            lambda a: gather_all(a, a.shards) if isinstance(a, ShardedParameter) else a, (args, kwargs))
        with DisableTorchFunctionSubclass():
            return func(*full[0], **full[1])

    @property
    def full_shape(self) -> torch.Size:
        shape = list(self.shape)
        for spec in reversed(self.shards):
            shape[spec.dim] = spec.size
        return torch.Size(shape)


def _as_sharded(local: torch.Tensor, shards: tuple[ShardSpec, ...]) -> ShardedParameter:
    """`local` as a ShardedParameter cut as `shards` say. A copy that autograd made (`weight.to(bf16)`
    in a forward) keeps its place in the graph, or the parameter would get no gradient through it:
    `as_subclass` aliases it. A leaf (a detach, a fresh cut) is rewrapped by `_make_subclass`
    instead, which makes no view (Dynamo would guard a view's `_base` too) but detaches."""
    if not local.is_leaf:
        shard = local.as_subclass(ShardedParameter)
    else:
        shard = make_subclass(ShardedParameter, local, local.requires_grad)
    shard.shards = shards
    return shard


def shards_of(tensor: torch.Tensor) -> tuple[ShardSpec, ...]:
    return tensor.shards if isinstance(tensor, ShardedParameter) else ()


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The full (unsharded) value of a parameter, without autograd."""
    with torch.no_grad(), DisableTorchFunctionSubclass():
        return gather_all(tensor.detach(), shards_of(tensor)).clone()  # clone: waits for the collectives


def cut(param: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
    """`param` (a full tensor, or one already cut) cut once more by `spec`, as a ShardedParameter."""
    with DisableTorchFunctionSubclass(), torch.no_grad():
        local = local_part(param.detach(), spec).clone()
    shard = _as_sharded(local, shards_of(param) + (spec,))
    return nn.Parameter(shard, requires_grad=param.requires_grad)


def cut_parameter(graph: CapturedGraph, param: GraphParameter, spec: ShardSpec, *, by: str) -> nn.Parameter:
    """Make the model hold `param` cut by `spec` (the graph and its guards expecting the cut), with
    state-dict hooks on its module that give and take the full tensor. Returns the new parameter."""
    new = cut(param.tensor, spec)
    blocks = f", {spec.outer} blocks" if spec.outer > 1 else ""
    graph.replace_parameter(param, new, by=by, placement=f"Shard({spec.dim}) of {spec.world}{blocks}")
    undo = install_state_dict_hooks(param.owner)
    if undo is not None:
        graph.on_undo(undo)
    return new


def recut(full: torch.Tensor, shards: tuple[ShardSpec, ...]) -> torch.Tensor:
    """`full` cut as `shards` say (to load a full state-dict entry into a sharded parameter)."""
    with DisableTorchFunctionSubclass(), torch.no_grad():
        for spec in shards:
            full = local_part(full, spec)
        return full.clone()


# -- state dict: full tensors out, full tensors in ------------------------------------------------------

def _full_state_dict_hook(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    for name, param in module.named_parameters(recurse=False):
        if isinstance(param, ShardedParameter):
            state[prefix + name] = full_value(param)


def _shard_on_load_hook(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        if isinstance(param, ShardedParameter) and key in state and state[key].shape == param.full_shape:
            state[key] = recut(state[key], param.shards)


def install_state_dict_hooks(module: nn.Module) -> Any:
    """Make `module.state_dict()` give its sharded parameters in full and `load_state_dict` take full
    tensors back (each rank keeping its cut). Returns an undo function (None if already installed)."""
    if getattr(module, "_xform_sharded", False):
        return None
    handles = add_state_dict_hooks(module, _full_state_dict_hook, _shard_on_load_hook)
    object.__setattr__(module, "_xform_sharded", True)

    def undo() -> None:
        for handle in handles:
            handle.remove()
        object.__setattr__(module, "_xform_sharded", False)

    return undo
