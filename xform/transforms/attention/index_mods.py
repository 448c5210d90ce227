"""Turn the part of an FX graph that computes an attention mask or bias into a function of the
position `(b, h, q, kv)`: the `mask_mod` / `score_mod` that flex_attention takes.

Masks are written as dense tensors built from `arange`s (`q_pos[:, None] >= kv_pos[None, :]`),
`tril` of ones, per-token ids (`ids[:, :, None] == ids[:, None, :]`), per-head slopes
(`slopes[:, None, None] * (kv - q)`), or handed in whole. Every op in such a subgraph is elementwise
after broadcasting; so each dimension of each tensor in it can be labelled with the attention
position it runs over (b, h, q or kv), and the whole subgraph re-evaluated at one position by
replacing each `arange` with that position's index and each data tensor by its element there.
The result never materializes the dense [B, H, Q, KV] mask.

An op that is not elementwise (a cumsum making document ids, a reduction, a matmul) is not looked
into: its output becomes a tensor the mods read at the positions its dims run over. When even
that fails (dims reshaped together, a mask of rank > 4), the mask is read whole
(`dense_program`), which is always correct.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from xform._torch.pytree import tree_map
from xform.fx_rewrite import example_value

POSITIONS = ("b", "h", "q", "kv")

_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne,
    operator.and_, operator.or_, operator.xor, operator.invert, operator.neg, operator.abs,
    torch.where, torch.abs, torch.minimum, torch.maximum, torch.logical_and, torch.logical_or, torch.logical_not,
    torch.logical_xor, torch.bitwise_and, torch.bitwise_or, torch.bitwise_not, torch.eq, torch.ne, torch.ge,
    torch.gt, torch.le, torch.lt, torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.clamp,
    torch.masked_fill, torch.exp, torch.log, torch.sqrt, torch.sign,
}
_ELEMENTWISE_METHODS = {
    "to", "float", "half", "bfloat16", "int", "long", "bool", "type_as", "masked_fill", "abs", "neg", "logical_not",
    "logical_and", "logical_or", "eq", "ne", "ge", "gt", "le", "lt", "add", "sub", "mul", "div", "clamp", "exp",
    "sign", "sqrt", "log", "__and__", "__or__", "__invert__", "__xor__", "__eq__", "__ne__", "__ge__", "__gt__",
    "__le__", "__lt__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__neg__", "__abs__", "__mod__", "__floordiv__",
}
_SHAPE_METHODS = {"view", "reshape", "unsqueeze", "expand", "expand_as", "contiguous", "clone", "detach"}
_SHAPE_FUNCTIONS = {torch.unsqueeze, torch.reshape, operator.getitem}
_TRIANGLES = {"tril": operator.le, "triu": operator.ge}  # keep (kv - q) <= d / >= d


class NotElementwise(Exception):
    """The subgraph holds something the index substitution cannot express."""


Labels = tuple  # one of POSITIONS (or None for a broadcast dim) per dim of a tensor


@dataclass(frozen=True)
class Ref:
    """An argument that is the value of an earlier step."""

    step: int


@dataclass(frozen=True)
class Step:
    """One value of the program. kind: "buffer" (read tensor `payload` at `labels`), "index"
    (position `labels[0]`, as arange(start, _, step) would give it), "fill" (a constant),
    "view" (its input unchanged), "triangle" (tril/triu of its input), "call" (an elementwise op)."""

    kind: str
    labels: Labels
    payload: Any = None  # per kind: buffer number, (start, step), value, input Ref, (op, Ref, diagonal), (fn, args, kwargs)


@dataclass
class IndexProgram:
    """A mask or bias as a function of the attention position.

    `evaluate(b, h, q, kv, *buffers)` gives its value there. `buffer_nodes` are the graph tensors it
    reads, passed at run time. A node may be read at several positions (`pos[:, None] >= pos[None, :]`
    reads one arange as q and as kv), so a step is a node *as read at* some positions. The steps
    hold no graph nodes: the program outlives the graph it was read from.
    """

    steps: list[Step]  # in evaluation order, ending with the mask/bias itself
    buffer_nodes: list[fx.Node] = field(default_factory=list)

    @property
    def positions_used(self) -> set[str]:
        return {label for step in self.steps for label in step.labels if label}

    @property
    def is_static(self) -> bool:
        """Whether it depends on positions only (no tensor it reads can change between calls)."""
        return not self.buffer_nodes

    def buffer_reads(self) -> list[tuple[int, Labels]]:
        return [(step.payload, step.labels) for step in self.steps if step.kind == "buffer"]

    def reads_ids(self) -> bool:
        """Whether it reads one tensor once at q and once at kv (per-token ids: a document mask),
        rather than at (q, kv) together (a dense mask)."""
        reads: dict[int, list[set[str]]] = {}
        for number, labels in self.buffer_reads():
            reads.setdefault(number, []).append(set(labels))
        return any(any("q" in r and "kv" not in r for r in rs) and any("kv" in r and "q" not in r for r in rs)
                   for rs in reads.values())

    def evaluate(self, b: Any, h: Any, q: Any, kv: Any, *buffers: torch.Tensor) -> torch.Tensor:
        index = {"b": b, "h": h, "q": q, "kv": kv}
        values: list[Any] = []
        resolve = lambda a: values[a.step] if isinstance(a, Ref) else a  # noqa: E731
        for step in self.steps:
            if step.kind == "buffer":
                picks = tuple(index[label] if label else 0 for label in step.labels)
                # a 0-dim tensor is read whole: flex's index mode refuses an empty index
                value = buffers[step.payload][picks] if picks else buffers[step.payload]
            elif step.kind == "index":
                start, stride = step.payload
                value = index[step.labels[0]] * stride + start
            elif step.kind == "fill":
                value = torch.tensor(step.payload[0], dtype=step.payload[1])
            elif step.kind == "view":
                value = resolve(step.payload)
            elif step.kind == "triangle":
                keep_when, source, diagonal = step.payload
                x = resolve(source)
                value = torch.where(keep_when(index["kv"] - index["q"], diagonal), x, torch.zeros_like(x))
            else:
                fn, args, kwargs = step.payload
                value = fn(*tree_map(resolve, args), **tree_map(resolve, kwargs))
            values.append(value)
        return values[-1]


@dataclass(frozen=True)
class Method:
    """A call of tensor method `name` on its first argument (named, so that programs compare equal
    and `block_bounds` knows the op)."""

    name: str

    def __call__(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(tensor, self.name)(*args, **kwargs)


def causal_program() -> IndexProgram:
    """`q >= kv` as a program."""
    return IndexProgram([Step("index", ("q",), (0, 1)), Step("index", ("kv",), (0, 1)),
                         Step("call", (), (operator.ge, (Ref(0), Ref(1)), {}))])


def index_program(target: fx.Node) -> IndexProgram:
    """The IndexProgram computing `target` (a mask or bias broadcast to [B, H, Q, KV]).

    Raises NotElementwise when the subgraph cannot be re-evaluated position by position.
    """
    shape = tuple(example_value(target).shape)
    if len(shape) > 4:
        raise NotElementwise(f"a mask of rank {len(shape)} (flex_attention masks have at most 4 dims)")
    steps: list[Step] = []
    buffers: list[fx.Node] = []
    step_of: dict[tuple[fx.Node, Labels], int] = {}

    def visit(node: fx.Node, labels: Labels) -> Ref:  # post-order: inputs before their user
        if (node, labels) not in step_of:
            steps.append(_step(node, labels, visit, buffers))
            step_of[(node, labels)] = len(steps) - 1
        return Ref(step_of[(node, labels)])

    visit(target, _right_aligned(shape))
    return IndexProgram(steps, buffers)


def _step(node: fx.Node, labels: Labels, visit: Any, buffers: list[fx.Node]) -> Step:
    if _is_arange(node):
        if labels[0] is None:
            raise NotElementwise(f"arange '{node.name}' runs over no attention position")
        start, _, stride = _arange_range(node)
        return Step("index", labels, (start, stride))
    if _is_filled(node):
        return Step("fill", labels, (_fill_value(node), example_value(node).dtype))
    if not (_is_elementwise(node) or _is_shape_op(node) or _triangle(node)):
        if node not in buffers:  # a graph input, or computed by something not looked into
            buffers.append(node)
        return Step("buffer", labels, buffers.index(node))

    def argument(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        value = example_value(a)
        return visit(a, _input_labels(node, a, labels)) if isinstance(value, torch.Tensor) else value

    args, kwargs = tree_map(argument, (node.args, node.kwargs))
    if _is_shape_op(node):
        return Step("view", labels, args[0])
    if _triangle(node):
        name = node.target if node.op == "call_method" else node.target.__name__
        diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
        return Step("triangle", labels, (_TRIANGLES[name], args[0], diagonal))
    if node.op == "call_method":
        return Step("call", labels, (Method(node.target), args, kwargs))
    return Step("call", labels, (node.target, args, kwargs))


def dense_program(target: fx.Node) -> IndexProgram:
    """Read the mask/bias tensor whole, at each position (for masks `index_program` cannot take)."""
    return IndexProgram([Step("buffer", _right_aligned(tuple(example_value(target).shape)), 0)], [target])


# -- labelling -------------------------------------------------------------------------------------

def _right_aligned(shape: tuple[int, ...]) -> tuple[str | None, ...]:
    names = POSITIONS[4 - len(shape):]
    return tuple(name if size != 1 else None for name, size in zip(names, shape))


def _input_labels(node: fx.Node, source: fx.Node, out: tuple[str | None, ...]) -> tuple[str | None, ...]:
    in_shape = tuple(example_value(source).shape)
    out_shape = tuple(example_value(node).shape)
    if _is_shape_op(node):
        return _through_reshape(in_shape, out_shape, out, node)
    # elementwise with broadcasting: dims align from the right
    offset = len(out_shape) - len(in_shape)
    if offset < 0:
        raise NotElementwise(f"node '{node.name}' reduces rank")
    return tuple(out[offset + i] if size != 1 else None for i, size in enumerate(in_shape))


def _through_reshape(in_shape: tuple, out_shape: tuple, out: tuple, node: fx.Node) -> tuple:
    """Labels of a view/unsqueeze/expand/index input: its non-1 dims are the output's, in order."""
    kept = [(size, label) for size, label in zip(out_shape, out)]
    labels: list[str | None] = []
    cursor = 0
    for size in in_shape:
        if size == 1:
            labels.append(None)
            continue
        while cursor < len(kept) and kept[cursor][0] != size:
            if kept[cursor][0] != 1 and node.target not in ("expand", "expand_as"):
                raise NotElementwise(f"node '{node.name}' reshapes dims ({in_shape} -> {out_shape})")
            cursor += 1
        if cursor == len(kept):
            raise NotElementwise(f"node '{node.name}' reshapes dims ({in_shape} -> {out_shape})")
        labels.append(kept[cursor][1])
        cursor += 1
    return tuple(labels)


# -- node kinds ------------------------------------------------------------------------------------

def _is_arange(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.arange


def _arange_range(node: fx.Node) -> tuple[Any, Any, Any]:
    args = list(node.args)
    if len(args) == 1:
        return 0, args[0], 1
    start, end = args[0], args[1]
    step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
    return start, end, step


_NEW_FILLED = ("new_ones", "new_zeros", "new_full")  # x.new_ones(()) starts HF's masks


def _is_filled(node: fx.Node) -> bool:
    return ((node.op == "call_function" and node.target in (torch.ones, torch.zeros, torch.full))
            or (node.op == "call_method" and node.target in _NEW_FILLED))


def _fill_value(node: fx.Node) -> Any:
    if node.target in (torch.full, "new_full"):
        value_at = 1 if node.target is torch.full else 2  # full(size, value); x.new_full(size, value)
        return node.args[value_at] if len(node.args) > value_at else node.kwargs["fill_value"]
    return 1 if node.target in (torch.ones, "new_ones") else 0


def _is_elementwise(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    return node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS


def _is_shape_op(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(i is None or i is Ellipsis or i == slice(None) for i in index)
    return node.op == "call_function" and node.target in _SHAPE_FUNCTIONS - {operator.getitem}


def _triangle(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in _TRIANGLES and node.op in ("call_method", "call_function")
