"""Find the Megatron-style column/row-parallel Linear pairs of a Dynamo graph, by following shardings.

Every Linear whose weight may be cut starts as a *column* candidate: its output features would be
sharded over the N ranks. That sharding is followed forward through the ops the activation goes
through (pointwise ops, views, transposes, unbind, attention over heads, matmuls over batch dims,
softmax and norms over other dims) until it reaches a Linear that reads the sharded features as its
input: a *row* Linear, whose partial outputs are summed over the ranks (one all-reduce), after
which everything is replicated again. If a sharded activation reaches anything else (the graph's
output, an op that mixes the sharded dimension, a chunk along it), every column Linear it came from
stays replicated, with the reason, and the analysis runs again without them until nothing changes.
So what is sharded is always correct, and what is not is explained.

A sharding is a dimension and a layout: the dimension is seen as `outer` blocks, each cut into N
chunks (see `xform.sharding`). A fused qkv projection viewed as (batch, seq, 3, heads, head_dim)
is cut by heads: the sharding moves to the heads dimension, and the qkv weight's rows are cut as 3
blocks. A column Linear's layout stays open until the first view that splits its features decides
it (the first sub-dimension that N divides: the heads, not q/k/v when N does not divide 3).

The analysis is pure: it reads the graph and says what to change (`TensorParallelPlan`); the
rewrite is `xform.tp_rewrite`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import fx

from xform.fx_rewrite import example_value
from xform.linear_layers import computes_linear, linear_operands

Slot = tuple[str, Any]  # ("arg", index) or ("kwarg", name): where an operand sits in a node's call


@dataclass(frozen=True)
class Sharded:
    """An activation sharded along `dim` (layout `outer`; None while its column Linears' layout is open)."""

    dim: int
    outer: int | None
    origins: frozenset[fx.Node]  # the column Linears it comes from


@dataclass
class TensorParallelPlan:
    """What to change in the graph; layouts are `outer` values along the cut dimension."""

    world: int
    columns: dict[fx.Node, int] = field(default_factory=dict)  # linear -> layout of its output features
    rows: dict[fx.Node, int] = field(default_factory=dict)  # linear -> layout of its input features
    sharded: dict[fx.Node, Any] = field(default_factory=dict)  # node -> Sharded (or a tuple of them)
    size_args: dict[fx.Node, list[Slot]] = field(default_factory=dict)  # view/expand sizes to divide by N
    narrow: dict[tuple[fx.Node, Slot], tuple[int, int]] = field(default_factory=dict)  # replicated operand -> (dim, outer)
    sum_gradient: dict[fx.Node, list[tuple[fx.Node, Slot]]] = field(default_factory=dict)  # replicated value -> readers
    refused: dict[fx.Node, str] = field(default_factory=dict)  # linear -> why it stays replicated


class _Poison(Exception):
    def __init__(self, origins: Iterable[fx.Node], reason: str) -> None:
        super().__init__(reason)
        self.origins, self.reason = frozenset(origins), reason


def _name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _describe(node: fx.Node) -> str:
    return f"node '{node.name}' ({_name(node)})"


def _shape(node: Any) -> tuple[int, ...] | None:
    value = example_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def operand(node: fx.Node, slot: Slot) -> Any:
    """The value at `slot` of a node's call (None where the call leaves it out)."""
    kind, key = slot
    if kind == "arg":
        return node.args[key] if key < len(node.args) else None
    return node.kwargs.get(key)


def _tensor_slots(node: fx.Node) -> list[Slot]:
    slots: list[Slot] = [("arg", i) for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
    return slots + [("kwarg", k) for k, a in node.kwargs.items() if isinstance(a, fx.Node)]


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[range, range]]:
    """Pair up the dims of a view: runs of `src` dims and `dst` dims with the same number of elements."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        first_src, first_dst, left, right = i, j, 1, 1
        if i < len(src):
            left, i = src[i], i + 1
        if j < len(dst):
            right, j = dst[j], j + 1
        while left != right:
            if left < right and i < len(src):
                left, i = left * src[i], i + 1
            elif right < left and j < len(dst):
                right, j = right * dst[j], j + 1
            else:
                break  # not a valid view of src; the caller finds no group for the sharded dim
        groups.append((range(first_src, i), range(first_dst, j)))
    return groups


_POINTWISE = {
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "tanh", "sigmoid", "exp", "rsqrt", "sqrt", "abs", "erf",
    "gelu", "silu", "relu", "leaky_relu", "softplus", "mish", "dropout", "where", "clamp", "cos", "sin",
    "reciprocal", "square", "masked_fill", "contiguous", "clone", "float", "half", "bfloat16", "double",
}
_CASTS = {"to", "type_as", "type"}  # only their first operand is data
_REDUCTIONS = {"sum", "mean", "amax", "amin"}


class _Propagation:
    """One forward pass of shardings over the graph, for a given set of column candidates."""

    def __init__(self, graph: fx.Graph, candidates: set[fx.Node], row_ok: Callable[[fx.Node], str | None],
                 world: int, choices: dict[fx.Node, int]) -> None:
        self.graph, self.candidates, self.row_ok, self.world = graph, candidates, row_ok, world
        self.plan = TensorParallelPlan(world)
        self.layout: dict[fx.Node, int] = {}  # column linear -> decided layout
        self.choices = choices  # view splitting open features -> which of its candidate sub-dims to cut
        self.options: dict[fx.Node, int] = {}  # such a view -> how many candidate sub-dims it has
        self.decided_by: dict[fx.Node, fx.Node] = {}  # column linear -> the view that chose its layout

    # -- layouts ---------------------------------------------------------------------------------
    def fix(self, state: Sharded, outer: int, at: fx.Node) -> Sharded:
        """Decide the open layout of `state`'s column Linears (or check the decided one). Only for an
        open state, whose dimension is still its Linears' output features."""
        for origin in state.origins:
            decided = self.layout.setdefault(origin, outer)
            if decided != outer:
                raise _Poison(state.origins, f"{_describe(at)} needs the features of '{origin.name}' cut in "
                                             f"{outer} blocks, another reader in {decided}")
        return Sharded(state.dim, outer, state.origins)

    def concrete(self, state: Sharded, at: fx.Node) -> Sharded:
        if state.outer is not None:
            return state
        decided = {self.layout[o] for o in state.origins if o in self.layout}
        return self.fix(state, decided.pop() if len(decided) == 1 else 1, at)

    def check_divides(self, state: Sharded, size: int, at: fx.Node) -> None:
        outer = state.outer or 1
        if size % (outer * self.world):
            raise _Poison(state.origins, f"{_describe(at)}: its sharded dimension ({size}"
                                         f"{f' in {outer} blocks' if outer > 1 else ''}) does not divide by "
                                         f"{self.world} ranks")

    # -- the walk --------------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.graph.nodes:
            ins = {slot: self.plan.sharded[a] for slot in _tensor_slots(node)
                   if (a := operand(node, slot)) in self.plan.sharded}
            if node.op == "output":
                if _flat_nodes(node.args) & self.plan.sharded.keys():
                    origins = frozenset().union(*(_origins(self.plan.sharded[n]) for n in
                                                  _flat_nodes(node.args) & self.plan.sharded.keys()))
                    raise _Poison(origins, "its sharded output reaches the graph's output")
                continue
            nested = _flat_nodes((node.args, node.kwargs)) & self.plan.sharded.keys()
            if not ins and nested and node.target not in (torch.cat, torch.stack):
                state = self.plan.sharded[next(iter(nested))]
                raise _Poison(_origins(state), f"{_describe(node)} reads a sharded activation inside a "
                                               f"container, which tensor parallelism does not follow")
            if computes_linear(node):
                self.linear(node, ins)
            elif ins or (nested and node.target in (torch.cat, torch.stack)):
                out = self.op(node, ins)
                if out is not None:
                    self.plan.sharded[node] = out

    def linear(self, node: fx.Node, ins: dict[Slot, Any]) -> None:
        x, weight, bias = linear_operands(node)
        state = self.plan.sharded.get(x)
        if any(self.plan.sharded.get(w) is not None for w in (weight, bias)):
            raise _Poison(_origins(self.plan.sharded.get(weight) or self.plan.sharded[bias]),
                          f"{_describe(node)} uses a sharded activation as its weight")
        if state is None:
            if node in self.candidates:
                self.plan.sharded[node] = Sharded(len(_shape(node)) - 1, None, frozenset({node}))
                if example_value(x).requires_grad:  # Megatron's f: each rank's input gradient is partial
                    slot = ("arg", 0) if node.args and node.args[0] is x else ("kwarg", "input")
                    self.plan.sum_gradient.setdefault(x, []).append((node, slot))
            return
        ndim = len(_shape(x))
        if state.dim != ndim - 1:
            raise _Poison(state.origins, f"{_describe(node)} reads a sharded activation along a dimension that "
                                         f"is not its input features")
        refusal = self.row_ok(node)
        if refusal is not None:
            raise _Poison(state.origins, f"it feeds '{node.name}', which would be row-parallel but {refusal}")
        state = self.concrete(state, node)
        self.check_divides(state, _shape(x)[-1], node)
        self.plan.rows[node] = state.outer

    def op(self, node: fx.Node, ins: dict[Slot, Any]) -> Any:
        name = _name(node)
        rule = _RULES.get(name)
        if rule is None and (name in _POINTWISE or name in _CASTS or node.target in _OPERATORS):
            rule = _pointwise
        if rule is None:
            raise _Poison(frozenset().union(*(_origins(s) for s in ins.values())),
                          f"{_describe(node)} is not an op tensor parallelism can carry a sharded activation "
                          f"through")
        return rule(self, node, ins)

    # -- helpers for rules -----------------------------------------------------------------------
    def replicated_operand(self, node: fx.Node, slot: Slot, out: Sharded, out_ndim: int) -> Sharded:
        """A replicated operand of an op whose result is sharded as `out`: cut it too if it is full-size
        along the sharded dim; sum its gradient over the ranks if it has one. Returns `out`, with its
        layout decided if the cut needed one."""
        value = operand(node, slot)
        shape = _shape(value)
        if shape is None:
            return out
        at = out.dim - (out_ndim - len(shape))
        if at >= 0 and shape[at] != 1:
            out = self.concrete(out, node)
            self.check_divides(out, shape[at], node)
            self.plan.narrow[(node, slot)] = (at, out.outer)
        if example_value(value).requires_grad:
            self.plan.sum_gradient.setdefault(value, []).append((node, slot))
        return out

    def merge(self, states: Iterable[Sharded], node: fx.Node) -> Sharded:
        states = list(states)
        dims = {s.dim for s in states}
        origins = frozenset().union(*(s.origins for s in states))
        if len(dims) > 1:
            raise _Poison(origins, f"{_describe(node)} combines activations sharded along different dimensions")
        outers = {s.outer for s in states} - {None}
        if len(outers) > 1:
            raise _Poison(origins, f"{_describe(node)} combines activations sharded with different layouts")
        if not outers:
            return Sharded(dims.pop(), None, origins)
        outer = outers.pop()
        for state in states:
            if state.outer is None:
                self.fix(state, outer, node)
        return Sharded(dims.pop(), outer, origins)

    def size_arg(self, node: fx.Node, slot: Slot, state: Sharded) -> None:
        value = operand(node, slot)
        if isinstance(value, fx.Node):
            raise _Poison(state.origins, f"{_describe(node)} gives the sharded dimension's size as a traced value")
        if value != -1:
            self.plan.size_args.setdefault(node, []).append(slot)


_OPERATORS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow}


def _origins(state: Any) -> frozenset[fx.Node]:
    if isinstance(state, tuple):
        return frozenset().union(*(s.origins for s in state if s is not None))
    return state.origins


def _flat_nodes(tree: Any) -> set[fx.Node]:
    return {a for a in torch.utils._pytree.tree_leaves(tree) if isinstance(a, fx.Node)}


def _single(ins: dict[Slot, Any], node: fx.Node) -> Sharded:
    """The one sharded tensor operand of a node that takes one (its data: arg 0)."""
    state = ins.get(("arg", 0))
    if not isinstance(state, Sharded) or len(ins) > 1:
        raise _Poison(frozenset().union(*(_origins(s) for s in ins.values())),
                      f"{_describe(node)} reads a sharded activation other than as its input")
    return state


# -- rules: (propagation, node, sharded operands) -> the node's sharding -------------------------------

def _pointwise(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    data_slots = [("arg", 0)] if _name(node) in _CASTS else _tensor_slots(node)
    if any(slot not in data_slots for slot in ins):
        _single(ins, node)  # a cast whose dtype comes from a sharded tensor: refused there
    out_ndim = len(_shape(node))
    aligned = [Sharded(s.dim + out_ndim - len(_shape(operand(node, slot))), s.outer, s.origins)
               for slot, s in ins.items()]
    out = p.merge(aligned, node)
    for slot in data_slots:
        if slot not in ins:
            out = p.replicated_operand(node, slot, out, out_ndim)
    return out


def _view(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    state = _single(ins, node)
    src, dst = _shape(operand(node, ("arg", 0))), _shape(node)
    group = next((g for g in view_groups(src, dst) if state.dim in g[0]), None)
    if group is None or not group[1]:
        raise _Poison(state.origins, f"{_describe(node)} reshapes the sharded dimension away")
    ins_dims, out_dims = group
    out_sizes = [dst[d] for d in out_dims]
    open_layout = state.outer is None and not any(o in p.layout for o in state.origins)
    if open_layout and len(ins_dims) == 1 and len(out_dims) == 1:
        out = Sharded(out_dims[0], None, state.origins)  # the features themselves, still open
    elif open_layout and len(ins_dims) == 1:  # the features split: cut a sub-dim N divides (first: the outermost)
        options = [t for t, size in enumerate(out_sizes) if size % p.world == 0]
        if not options:
            raise _Poison(state.origins, f"{_describe(node)} splits the sharded features into {tuple(out_sizes)}, "
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
            raise _Poison(state.origins, f"{_describe(node)} reshapes the sharded dimension in a way that mixes "
                                         f"ranks' chunks")
    _view_size_args(p, node, out, len(dst))
    return out


def _view_size_args(p: _Propagation, node: fx.Node, out: Sharded, ndim: int) -> None:
    if _name(node) == "flatten":
        return
    sizes = node.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        _nested_size(p, node, out, ndim)
        return
    if len(sizes) == ndim:
        p.size_arg(node, ("arg", 1 + out.dim), out)
        return
    raise _Poison(out.origins, f"{_describe(node)}: cannot tell which of its size arguments is the sharded one")


def _nested_size(p: _Propagation, node: fx.Node, out: Sharded, ndim: int) -> None:
    sizes = node.args[1]
    if len(sizes) != ndim:
        raise _Poison(out.origins, f"{_describe(node)}: cannot tell which of its size arguments is the sharded one")
    if isinstance(sizes[out.dim], fx.Node):
        raise _Poison(out.origins, f"{_describe(node)} gives the sharded dimension's size as a traced value")
    if sizes[out.dim] != -1:
        p.plan.size_args.setdefault(node, []).append(("nested", out.dim))


def _transpose(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    state = _single(ins, node)
    ndim = len(_shape(node))
    name = _name(node)
    if name == "t":
        order = list(range(ndim))[::-1]
    elif name in ("transpose", "swapaxes"):
        a, b = (_dim(d, ndim) for d in node.args[1:3])
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
    else:  # permute
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        order = [_dim(d, ndim) for d in dims]
    return Sharded(order.index(state.dim), state.outer, state.origins)


def _unsqueeze(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    state = _single(ins, node)
    at = _dim(node.args[1], len(_shape(node)))
    return Sharded(state.dim + (at <= state.dim), state.outer, state.origins)


def _expand(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    state = _single(ins, node)
    ndim = len(_shape(node))
    out = Sharded(state.dim + ndim - len(_shape(node.args[0])), state.outer, state.origins)
    _view_size_args(p, node, out, ndim)
    return out


def _getitem(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Any:
    state = ins[("arg", 0)]
    index = node.args[1]
    if isinstance(state, tuple):  # an element of unbind/split's result
        return state[index]
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) for i in index) or ... in index and index.count(...) > 1:
        raise _Poison(state.origins, f"{_describe(node)} indexes with a tensor or an unknown layout")
    ndim = len(_shape(node.args[0]))
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
                raise _Poison(state.origins, f"{_describe(node)} indexes the sharded dimension")
            return Sharded(dim_out, state.outer, state.origins)
        dim_in += 1
        dim_out += not isinstance(i, int)
    return Sharded(dim_out + state.dim - dim_in, state.outer, state.origins)


def _split(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> tuple[Sharded, ...]:
    state = _single(ins, node)
    ndim = len(_shape(node.args[0]))
    name = _name(node)
    dim_at = 1 if name == "unbind" else 2
    dim = _dim(node.kwargs.get("dim", node.args[dim_at] if len(node.args) > dim_at else 0), ndim)
    if dim == state.dim:
        raise _Poison(state.origins, f"{_describe(node)} splits along the sharded dimension (a fused projection "
                                     f"split by q/k/v or gate/up?); split it by heads instead, or use separate Linears")
    pieces = len(example_value(node))
    moved = state.dim - (name == "unbind" and dim < state.dim)
    return tuple(Sharded(moved, state.outer, state.origins) for _ in range(pieces))


def _cat(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    tensors = node.args[0]
    states = [p.plan.sharded.get(t) for t in tensors]
    origins = frozenset().union(*(s.origins for s in states if s is not None))
    ndim = len(_shape(node))
    dim = _dim(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0), ndim)
    if None in states or _name(node) == "stack":
        raise _Poison(origins, f"{_describe(node)} joins sharded and replicated activations")
    out = p.merge(states, node)
    if dim == out.dim:
        raise _Poison(origins, f"{_describe(node)} concatenates along the sharded dimension")
    return out


def _attention(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    names = ("query", "key", "value", "attn_mask")
    slots = {name: ("arg", i) if i < len(node.args) else ("kwarg", name) for i, name in enumerate(names)}
    qkv = [ins.get(slots[n]) for n in names[:3]]
    origins = frozenset().union(*(s.origins for s in qkv if s is not None))
    ndim = len(_shape(node))
    heads = ndim - 3
    if any(s is None or s.dim != heads for s in qkv):
        raise _Poison(origins, f"{_describe(node)}: attention needs query, key and value all sharded by heads")
    gqa = _shape(operand(node, slots["query"]))[heads] != _shape(operand(node, slots["key"]))[heads]
    out = p.merge([p.concrete(s, node) if gqa else s for s in qkv], node)
    if gqa and out.outer != 1:
        raise _Poison(origins, f"{_describe(node)}: grouped-query attention needs whole heads per rank")
    if slots["attn_mask"] in ins:
        mask = ins[slots["attn_mask"]]
        mask_ndim = len(_shape(operand(node, slots["attn_mask"])))
        out = p.merge([out, Sharded(mask.dim + ndim - mask_ndim, mask.outer, mask.origins)], node)
    elif operand(node, slots["attn_mask"]) is not None:
        out = p.replicated_operand(node, slots["attn_mask"], out, ndim)
    return out


def _matmul(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    ndim = len(_shape(node))
    aligned = []
    for slot, state in ins.items():
        rank = len(_shape(operand(node, slot)))
        if state.dim >= rank - 2:
            raise _Poison(state.origins, f"{_describe(node)} multiplies along the sharded dimension")
        aligned.append(Sharded(state.dim + ndim - rank, state.outer, state.origins))
    out = p.merge(aligned, node)
    for slot in _tensor_slots(node):
        if slot not in ins:
            out = p.replicated_operand(node, slot, out, ndim)
    return out


def _along_other_dim(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    """softmax/log_softmax and sum/mean/amax over dims that are not the sharded one."""
    state = _single(ins, node)
    ndim = len(_shape(node.args[0]))
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dim is None:
        raise _Poison(state.origins, f"{_describe(node)} reduces over every dimension, the sharded one too")
    dims = {_dim(d, ndim) for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    if state.dim in dims:
        raise _Poison(state.origins, f"{_describe(node)} reduces over the sharded dimension")
    keep = _name(node) in ("softmax", "log_softmax") or node.kwargs.get("keepdim", len(node.args) > 2 and node.args[2])
    return Sharded(state.dim - (0 if keep else sum(d < state.dim for d in dims)), state.outer, state.origins)


def _norm(p: _Propagation, node: fx.Node, ins: dict[Slot, Any]) -> Sharded:
    """layer_norm / rms_norm over trailing dims that are not the sharded one (a per-head q/k norm)."""
    state = _single(ins, node)
    ndim = len(_shape(node))
    normalized = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
    if state.dim >= ndim - len(normalized):
        raise _Poison(state.origins, f"{_describe(node)} normalizes over the sharded dimension")
    out = state
    for slot in _tensor_slots(node)[1:]:
        out = p.replicated_operand(node, slot, out, ndim)
    return out


_RULES: dict[str, Callable[[_Propagation, fx.Node, dict[Slot, Any]], Any]] = {
    "view": _view, "reshape": _view, "flatten": _view,
    "transpose": _transpose, "swapaxes": _transpose, "permute": _transpose, "t": _transpose,
    "unsqueeze": _unsqueeze, "expand": _expand, "getitem": _getitem,
    "unbind": _split, "split": _split, "chunk": _split, "cat": _cat, "stack": _cat, "concat": _cat,
    "scaled_dot_product_attention": _attention,
    "matmul": _matmul, "bmm": _matmul,
    "softmax": _along_other_dim, "log_softmax": _along_other_dim, **{r: _along_other_dim for r in _REDUCTIONS},
    "layer_norm": _norm, "rms_norm": _norm,
}


def plan_tensor_parallel(graph: fx.Graph, world: int, column_ok: Callable[[fx.Node], str | None],
                         row_ok: Callable[[fx.Node], str | None]) -> TensorParallelPlan:
    """Which Linears of `graph` to shard over `world` ranks, and how (see the module docstring).

    `column_ok(linear)` / `row_ok(linear)` say why a linear node's weight cannot be cut as a column /
    row Linear (None: it can).
    """
    refused: dict[fx.Node, str] = {}
    candidates = set()
    for node in graph.nodes:
        if computes_linear(node):
            reason = column_ok(node)
            if reason is None:
                candidates.add(node)
            else:
                refused[node] = reason
    choices: dict[fx.Node, int] = {}
    first_failure: dict[fx.Node, str] = {}  # view -> why its preferred cut failed: the reason worth reporting
    while True:
        walk = _Propagation(graph, candidates, row_ok, world, choices)
        try:
            walk.run()
            for column in candidates & walk.plan.sharded.keys():
                features, outer = _shape(column)[-1], walk.layout.get(column, 1)
                if features % (outer * world):
                    raise _Poison({column}, f"its {features} output features{f' in {outer} blocks' if outer > 1 else ''}"
                                            f" do not divide by {world} ranks")
        except _Poison as poison:
            view = _view_with_another_choice(walk, poison.origins)
            if view is not None:  # cut another sub-dim of the split features (heads rather than k/v) first
                first_failure.setdefault(view, poison.reason)
                choices[view] = choices.get(view, 0) + 1
                continue
            for origin in poison.origins:
                refused[origin] = first_failure.get(walk.decided_by.get(origin), poison.reason)
            candidates -= poison.origins
            continue
        plan = walk.plan
        plan.columns = {n: walk.layout.get(n, 1) for n in candidates if n in plan.sharded}
        plan.refused = {n: r for n, r in refused.items() if n not in plan.rows}
        return plan


def _view_with_another_choice(walk: _Propagation, origins: frozenset[fx.Node]) -> fx.Node | None:
    """The view that chose the layout of some of `origins` and has a candidate sub-dim left to try."""
    for origin in origins:
        view = walk.decided_by.get(origin)
        if view is not None and walk.choices.get(view, 0) + 1 < walk.options[view]:
            return view
    return None
