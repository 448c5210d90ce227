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
chunks (see `sharding`). A fused qkv projection viewed as (batch, seq, 3, heads, head_dim)
is cut by heads: the sharding moves to the heads dimension, and the qkv weight's rows are cut as 3
blocks. A column Linear's layout stays open until the first view that splits its features decides
it (the first sub-dimension that N divides: the heads, not q/k/v when N does not divide 3).

The analysis is pure: it reads the graph and says what to change (`TensorParallelPlan`); the
rewrite is `tp_rewrite`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import fx

from xform.fx_rewrite import example_value
from xform.transforms.linear_layers import computes_linear, linear_operands
from xform.transforms.distribute.tp_rules import rule_for
from xform.transforms.distribute.tp_shardings import (Poison, Sharded, Slot, TensorParallelPlan, describe, flat_nodes,
                                                      operand, origins_of, shape_of, tensor_slots)


class Propagation:
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
                raise Poison(state.origins, f"{describe(at)} needs the features of '{origin.name}' cut in "
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
            raise Poison(state.origins, f"{describe(at)}: its sharded dimension ({size}"
                                         f"{f' in {outer} blocks' if outer > 1 else ''}) does not divide by "
                                         f"{self.world} ranks")

    # -- the walk --------------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.graph.nodes:
            ins = {slot: self.plan.sharded[a] for slot in tensor_slots(node)
                   if (a := operand(node, slot)) in self.plan.sharded}
            if node.op == "output":
                if flat_nodes(node.args) & self.plan.sharded.keys():
                    origins = frozenset().union(*(origins_of(self.plan.sharded[n]) for n in
                                                  flat_nodes(node.args) & self.plan.sharded.keys()))
                    raise Poison(origins, "its sharded output reaches the graph's output")
                continue
            nested = flat_nodes((node.args, node.kwargs)) & self.plan.sharded.keys()
            if not ins and nested and node.target not in (torch.cat, torch.stack):
                state = self.plan.sharded[next(iter(nested))]
                raise Poison(origins_of(state), f"{describe(node)} reads a sharded activation inside a "
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
            raise Poison(origins_of(self.plan.sharded.get(weight) or self.plan.sharded[bias]),
                          f"{describe(node)} uses a sharded activation as its weight")
        if state is None:
            if node in self.candidates:
                self.plan.sharded[node] = Sharded(len(shape_of(node)) - 1, None, frozenset({node}))
                if example_value(x).requires_grad:  # Megatron's f: each rank's input gradient is partial
                    slot = ("arg", 0) if node.args and node.args[0] is x else ("kwarg", "input")
                    self.plan.sum_gradient.setdefault(x, []).append((node, slot))
            return
        ndim = len(shape_of(x))
        if state.dim != ndim - 1:
            raise Poison(state.origins, f"{describe(node)} reads a sharded activation along a dimension that "
                                         f"is not its input features")
        refusal = self.row_ok(node)
        if refusal is not None:
            raise Poison(state.origins, f"it feeds '{node.name}', which would be row-parallel but {refusal}")
        state = self.concrete(state, node)
        self.check_divides(state, shape_of(x)[-1], node)
        self.plan.rows[node] = state.outer

    def op(self, node: fx.Node, ins: dict[Slot, Any]) -> Any:
        rule = rule_for(node)
        if rule is None:
            raise Poison(frozenset().union(*(origins_of(s) for s in ins.values())),
                         f"{describe(node)} is not an op tensor parallelism can carry a sharded activation "
                         f"through")
        return rule(self, node, ins)

    # -- helpers for rules -----------------------------------------------------------------------
    def replicated_operand(self, node: fx.Node, slot: Slot, out: Sharded, out_ndim: int) -> Sharded:
        """A replicated operand of an op whose result is sharded as `out`: cut it too if it is full-size
        along the sharded dim; sum its gradient over the ranks if it has one. Returns `out`, with its
        layout decided if the cut needed one."""
        value = operand(node, slot)
        shape = shape_of(value)
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
            raise Poison(origins, f"{describe(node)} combines activations sharded along different dimensions")
        outers = {s.outer for s in states} - {None}
        if len(outers) > 1:
            raise Poison(origins, f"{describe(node)} combines activations sharded with different layouts")
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
            raise Poison(state.origins, f"{describe(node)} gives the sharded dimension's size as a traced value")
        if value != -1:
            self.plan.size_args.setdefault(node, []).append(slot)


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
        walk = Propagation(graph, candidates, row_ok, world, choices)
        try:
            walk.run()
            for column in candidates & walk.plan.sharded.keys():
                features, outer = shape_of(column)[-1], walk.layout.get(column, 1)
                if features % (outer * world):
                    raise Poison({column}, f"its {features} output features{f' in {outer} blocks' if outer > 1 else ''}"
                                            f" do not divide by {world} ranks")
        except Poison as poison:
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


def _view_with_another_choice(walk: Propagation, origins: frozenset[fx.Node]) -> fx.Node | None:
    """The view that chose the layout of some of `origins` and has a candidate sub-dim left to try."""
    for origin in origins:
        view = walk.decided_by.get(origin)
        if view is not None and walk.choices.get(view, 0) + 1 < walk.options[view]:
            return view
    return None
