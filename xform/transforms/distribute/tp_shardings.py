"""The vocabulary of the tensor-parallel analysis: an activation's sharding, the plan it ends in,
the refusal that poisons the column Linears a sharding came from, and reading a node's operands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import fx

from xform._torch.pytree import tree_leaves
from xform._torch.dispatch import is_op_overload, overload_name
from xform.fx_rewrite import example_value, op_name

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


class Poison(Exception):
    """A sharding that cannot go on: the column Linears it came from (`origins`) stay replicated, for `reason`."""

    def __init__(self, origins: Iterable[fx.Node], reason: str) -> None:
        super().__init__(reason)
        self.origins, self.reason = frozenset(origins), reason


def op_kind(node: fx.Node) -> str:
    """The op a node runs, as the rules know it: `view` for `x.view(...)`, `torch.ops.aten.view` and
    `aten.view.default` alike."""
    return overload_name(node.target) if is_op_overload(node.target) else op_name(node)


def describe(node: fx.Node) -> str:
    return f"node '{node.name}' ({op_name(node)})"


def shape_of(node: Any) -> tuple[int, ...] | None:
    value = example_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def positive_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def operand(node: fx.Node, slot: Slot) -> Any:
    """The value at `slot` of a node's call (None where the call leaves it out)."""
    kind, key = slot
    if kind == "arg":
        return node.args[key] if key < len(node.args) else None
    return node.kwargs.get(key)


def tensor_slots(node: fx.Node) -> list[Slot]:
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




def origins_of(state: Any) -> frozenset[fx.Node]:
    if isinstance(state, tuple):
        return frozenset().union(*(s.origins for s in state if s is not None))
    return state.origins


def flat_nodes(tree: Any) -> set[fx.Node]:
    return {a for a in tree_leaves(tree) if isinstance(a, fx.Node)}


def single_sharded(ins: dict[Slot, Any], node: fx.Node) -> Sharded:
    """The one sharded tensor operand of a node that takes one (its data: arg 0)."""
    state = ins.get(("arg", 0))
    if not isinstance(state, Sharded) or len(ins) > 1:
        raise Poison(frozenset().union(*(origins_of(s) for s in ins.values())),
                      f"{describe(node)} reads a sharded activation other than as its input")
    return state
