"""How a sharded activation goes through each op: one rule per op kind, from the node and its
sharded operands to the node's sharding, or a `Poison` saying why it cannot go through.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Callable

from torch import fx

from xform.fx_rewrite import example_value
from xform.transforms.distribute.tp_shardings import (Poison, Sharded, Slot, describe, op_kind, operand, positive_dim,
                                                      shape_of, single_sharded, tensor_slots, view_groups)

if TYPE_CHECKING:
    from xform.transforms.distribute.tp_plan import Propagation

_POINTWISE = {
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "tanh", "sigmoid", "exp", "rsqrt", "sqrt", "abs", "erf",
    "gelu", "silu", "relu", "leaky_relu", "softplus", "mish", "dropout", "where", "clamp", "cos", "sin",
    "reciprocal", "square", "masked_fill", "contiguous", "clone", "float", "half", "bfloat16", "double",
}
_CASTS = {"to", "type_as", "type"}  # only their first operand is data
_REDUCTIONS = {"sum", "mean", "amax", "amin"}
_OPERATORS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow}


def _pointwise(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    data_slots = [("arg", 0)] if op_kind(node) in _CASTS else tensor_slots(node)
    if any(slot not in data_slots for slot in ins):
        single_sharded(ins, node)  # a cast whose dtype comes from a sharded tensor: refused there
    out_ndim = len(shape_of(node))
    aligned = [Sharded(s.dim + out_ndim - len(shape_of(operand(node, slot))), s.outer, s.origins)
               for slot, s in ins.items()]
    out = p.merge(aligned, node)
    for slot in data_slots:
        if slot not in ins:
            out = p.replicated_operand(node, slot, out, out_ndim)
    return out


def _view(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    state = single_sharded(ins, node)
    src, dst = shape_of(operand(node, ("arg", 0))), shape_of(node)
    group = next((g for g in view_groups(src, dst) if state.dim in g[0]), None)
    if group is None or not group[1]:
        raise Poison(state.origins, f"{describe(node)} reshapes the sharded dimension away")
    ins_dims, out_dims = group
    out_sizes = [dst[d] for d in out_dims]
    open_layout = state.outer is None and not any(o in p.layout for o in state.origins)
    if open_layout and len(ins_dims) == 1 and len(out_dims) == 1:
        out = Sharded(out_dims[0], None, state.origins)  # the features themselves, still open
    elif open_layout and len(ins_dims) == 1:  # the features split: cut a sub-dim N divides (first: the outermost)
        options = [t for t, size in enumerate(out_sizes) if size % p.world == 0]
        if not options:
            raise Poison(state.origins, f"{describe(node)} splits the sharded features into {tuple(out_sizes)}, "
                                         f"none of which divides by {p.world} ranks")
        t = options[p.choices.get(node, 0)]
        p.options[node] = len(options)
        p.decided_by.update(dict.fromkeys(state.origins, node))
        p.fix(state, math.prod(out_sizes[:t]), node)
        out = Sharded(out_dims[t], 1, state.origins)
    else:
        state = p.concrete(state, node)
        blocks = math.prod(src[d] for d in ins_dims if d < state.dim) * state.outer
        block = math.prod(src[d] for d in ins_dims) // blocks
        out = None
        for t, d in enumerate(out_dims):
            before, after = math.prod(out_sizes[:t]), math.prod(out_sizes[t + 1:])
            if blocks % before == 0 and block % after == 0 and (block // after) % p.world == 0:
                out = Sharded(d, blocks // before, state.origins)
                break
        if out is None:
            raise Poison(state.origins, f"{describe(node)} reshapes the sharded dimension in a way that mixes "
                                         f"ranks' chunks")
    _view_size_args(p, node, out, len(dst))
    return out


def _view_size_args(p: Propagation, node: fx.Node, out: Sharded, ndim: int) -> None:
    if op_kind(node) == "flatten":
        return
    sizes = node.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        _nested_size(p, node, out, ndim)
        return
    if len(sizes) == ndim:
        p.size_arg(node, ("arg", 1 + out.dim), out)
        return
    raise Poison(out.origins, f"{describe(node)}: cannot tell which of its size arguments is the sharded one")


def _nested_size(p: Propagation, node: fx.Node, out: Sharded, ndim: int) -> None:
    sizes = node.args[1]
    if len(sizes) != ndim:
        raise Poison(out.origins, f"{describe(node)}: cannot tell which of its size arguments is the sharded one")
    if isinstance(sizes[out.dim], fx.Node):
        raise Poison(out.origins, f"{describe(node)} gives the sharded dimension's size as a traced value")
    if sizes[out.dim] != -1:
        p.plan.size_args.setdefault(node, []).append(("nested", out.dim))


def _transpose(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    state = single_sharded(ins, node)
    ndim = len(shape_of(node))
    name = op_kind(node)
    if name == "t":
        order = list(range(ndim))[::-1]
    elif name in ("transpose", "swapaxes"):
        a, b = (positive_dim(d, ndim) for d in node.args[1:3])
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
    else:  # permute
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        order = [positive_dim(d, ndim) for d in dims]
    return Sharded(order.index(state.dim), state.outer, state.origins)


def _unsqueeze(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    state = single_sharded(ins, node)
    at = positive_dim(node.args[1], len(shape_of(node)))
    return Sharded(state.dim + (at <= state.dim), state.outer, state.origins)


def _expand(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    state = single_sharded(ins, node)
    ndim = len(shape_of(node))
    out = Sharded(state.dim + ndim - len(shape_of(node.args[0])), state.outer, state.origins)
    _view_size_args(p, node, out, ndim)
    return out


def _getitem(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Any:
    state = ins[("arg", 0)]
    index = node.args[1]
    if isinstance(state, tuple):  # an element of unbind/split's result
        return state[index]
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) for i in index) or ... in index and index.count(...) > 1:
        raise Poison(state.origins, f"{describe(node)} indexes with a tensor or an unknown layout")
    ndim = len(shape_of(node.args[0]))
    if ... in index:
        at = index.index(...)
        index = index[:at] + (slice(None),) * (ndim - len(index) + 1 + sum(i is None for i in index)) + index[at + 1:]
    dim_in, dim_out = 0, 0
    for i in index:
        if i is None:
            dim_out += 1
            continue
        if dim_in == state.dim:
            if i != slice(None):
                raise Poison(state.origins, f"{describe(node)} indexes the sharded dimension")
            return Sharded(dim_out, state.outer, state.origins)
        dim_in += 1
        dim_out += not isinstance(i, int)
    return Sharded(dim_out + state.dim - dim_in, state.outer, state.origins)


def _split(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> tuple[Sharded, ...]:
    state = single_sharded(ins, node)
    ndim = len(shape_of(node.args[0]))
    name = op_kind(node)
    dim_at = 1 if name == "unbind" else 2
    dim = positive_dim(node.kwargs.get("dim", node.args[dim_at] if len(node.args) > dim_at else 0), ndim)
    if dim == state.dim:
        raise Poison(state.origins, f"{describe(node)} splits along the sharded dimension (a fused projection "
                                     f"split by q/k/v or gate/up?); split it by heads instead, or use separate Linears")
    pieces = len(example_value(node))
    moved = state.dim - (name == "unbind" and dim < state.dim)
    return tuple(Sharded(moved, state.outer, state.origins) for _ in range(pieces))


def _cat(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    tensors = node.args[0]
    states = [p.plan.sharded.get(t) for t in tensors]
    origins = frozenset().union(*(s.origins for s in states if s is not None))
    ndim = len(shape_of(node))
    dim = positive_dim(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0), ndim)
    if None in states or op_kind(node) == "stack":
        raise Poison(origins, f"{describe(node)} joins sharded and replicated activations")
    out = p.merge(states, node)
    if dim == out.dim:
        raise Poison(origins, f"{describe(node)} concatenates along the sharded dimension")
    return out


def _attention(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    names = ("query", "key", "value", "attn_mask")
    slots = {name: ("arg", i) if i < len(node.args) else ("kwarg", name) for i, name in enumerate(names)}
    qkv = [ins.get(slots[n]) for n in names[:3]]
    origins = frozenset().union(*(s.origins for s in qkv if s is not None))
    ndim = len(shape_of(node))
    heads = ndim - 3
    if any(s is None or s.dim != heads for s in qkv):
        raise Poison(origins, f"{describe(node)}: attention needs query, key and value all sharded by heads")
    gqa = shape_of(operand(node, slots["query"]))[heads] != shape_of(operand(node, slots["key"]))[heads]
    out = p.merge([p.concrete(s, node) if gqa else s for s in qkv], node)
    if gqa and out.outer != 1:
        raise Poison(origins, f"{describe(node)}: grouped-query attention needs whole heads per rank")
    if slots["attn_mask"] in ins:
        mask = ins[slots["attn_mask"]]
        mask_ndim = len(shape_of(operand(node, slots["attn_mask"])))
        out = p.merge([out, Sharded(mask.dim + ndim - mask_ndim, mask.outer, mask.origins)], node)
    elif operand(node, slots["attn_mask"]) is not None:
        out = p.replicated_operand(node, slots["attn_mask"], out, ndim)
    return out


def _matmul(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    ndim = len(shape_of(node))
    aligned = []
    for slot, state in ins.items():
        rank = len(shape_of(operand(node, slot)))
        if state.dim >= rank - 2:
            raise Poison(state.origins, f"{describe(node)} multiplies along the sharded dimension")
        aligned.append(Sharded(state.dim + ndim - rank, state.outer, state.origins))
    out = p.merge(aligned, node)
    for slot in tensor_slots(node):
        if slot not in ins:
            out = p.replicated_operand(node, slot, out, ndim)
    return out


def _along_other_dim(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    """softmax/log_softmax and sum/mean/amax over dims that are not the sharded one."""
    state = single_sharded(ins, node)
    ndim = len(shape_of(node.args[0]))
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dim is None:
        raise Poison(state.origins, f"{describe(node)} reduces over every dimension, the sharded one too")
    dims = {positive_dim(d, ndim) for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    if state.dim in dims:
        raise Poison(state.origins, f"{describe(node)} reduces over the sharded dimension")
    keep = op_kind(node) in ("softmax", "log_softmax") or node.kwargs.get("keepdim", len(node.args) > 2 and node.args[2])
    return Sharded(state.dim - (0 if keep else sum(d < state.dim for d in dims)), state.outer, state.origins)


def _norm(p: Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    """layer_norm / rms_norm over trailing dims that are not the sharded one (a per-head q/k norm)."""
    state = single_sharded(ins, node)
    ndim = len(shape_of(node))
    normalized = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
    if state.dim >= ndim - len(normalized):
        raise Poison(state.origins, f"{describe(node)} normalizes over the sharded dimension")
    out = state
    for slot in tensor_slots(node)[1:]:
        out = p.replicated_operand(node, slot, out, ndim)
    return out


_RULES: dict[str, Callable[[Propagation, fx.Node, dict[Slot, Any]], Any]] = {
    "view": _view, "reshape": _view, "flatten": _view,
    "transpose": _transpose, "swapaxes": _transpose, "permute": _transpose, "t": _transpose,
    "unsqueeze": _unsqueeze, "expand": _expand, "getitem": _getitem,
    "unbind": _split, "split": _split, "chunk": _split, "cat": _cat, "stack": _cat, "concat": _cat,
    "scaled_dot_product_attention": _attention,
    "matmul": _matmul, "bmm": _matmul,
    "softmax": _along_other_dim, "log_softmax": _along_other_dim, **{r: _along_other_dim for r in _REDUCTIONS},
    "layer_norm": _norm, "rms_norm": _norm,
}


def rule_for(node: fx.Node) -> Callable[[Propagation, fx.Node, dict[Slot, Any]], Any] | None:
    """The rule that carries a sharding through `node`'s op, or None where no rule can."""
    name = op_kind(node)
    rule = _RULES.get(name)
    if rule is None and (name in _POINTWISE or name in _CASTS or node.target in _OPERATORS):
        rule = _pointwise
    return rule
