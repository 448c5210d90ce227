"""Apply a `TensorParallelPlan` to a captured graph: cut the weights, insert the collectives, make
the graph's sizes and example values the local ones.

- column Linear: weight (and bias) rows cut (`ShardSpec(dim=0, outer=layout)`); its input goes
  through Megatron's *f* (identity forward, gradient summed over ranks) when it needs a gradient;
- row Linear: weight columns cut (`dim=1`); its output is summed over ranks (*g*: all-reduce
  forward, identity backward) and only then gets its bias, which stays whole;
- views and expands of sharded activations get their sharded size divided by N; a replicated
  operand that is full-size along a sharded dimension (a per-feature table) is cut to the local
  chunk; replicated operands that need a gradient go through *f* too.
The module holds the cut weights (`CapturedGraph.replace_parameter`), so the guards expect the
local shards, an optimizer created after the first call steps them, and `state_dict()` is full.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from xform.captured import CapturedGraph, GraphParameter
from xform.fx_rewrite import example_value, insert_call
from xform.transforms.linear_layers import linear_operands
from xform.transforms.distribute.sharding import ShardSpec, cut_parameter, local_part
from xform.transforms.distribute.tp_plan import Sharded, Slot, TensorParallelPlan, operand


class _SumGradient(torch.autograd.Function):
    """Identity; backward: the gradient summed (or averaged) over the ranks."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
        ctx.op, ctx.group_name = op, group_name
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        from xform._torch.distributed import funcol

        return funcol.all_reduce(grad.contiguous(), ctx.op, ctx.group_name), None, None


class _SumValue(torch.autograd.Function):
    """The value summed over the ranks; backward: identity (each rank already has the whole gradient)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group_name: str) -> torch.Tensor:
        from xform._torch.distributed import funcol

        return funcol.all_reduce(tensor.contiguous(), "sum", group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def reduce_gradient(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """`tensor`, whose gradient is all-reduced with `op` ("sum", "avg") over the group."""
    return _SumGradient.apply(tensor, op, group_name)


def sum_over_ranks(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return _SumValue.apply(tensor, group_name)


def take_local(tensor: torch.Tensor, dim: int, outer: int, world: int, rank: int) -> torch.Tensor:
    """This rank's chunk of a replicated tensor along `dim` (as `sharding.local_part`)."""
    return local_part(tensor, ShardSpec(dim, tensor.shape[dim], "", world, rank, outer))


def apply_plan(graph: CapturedGraph, plan: TensorParallelPlan, group_name: str, rank: int, *,
               by: str) -> list[tuple[str, str]]:
    """Rewrite `graph` as `plan` says. Returns (parameter, what was done) per cut parameter, for the report."""
    lines = []
    for linear, outer in plan.columns.items():
        _, weight, bias = linear_operands(linear)
        for node in (weight, bias):
            if node is not None:
                spec = ShardSpec(0, example_value(node).shape[0], group_name, plan.world, rank, outer, "slice")
                lines.append(_cut(graph, node, spec, by, "column"))
    summed_rows = {}  # row linear -> its summed output, which its readers now read instead
    for linear, outer in plan.rows.items():
        _, weight, bias = linear_operands(linear)
        spec = ShardSpec(1, example_value(weight).shape[1], group_name, plan.world, rank, outer, "slice")
        lines.append(_cut(graph, weight, spec, by, "row"))
        summed_rows[linear] = _sum_then_bias(graph.gm.graph, linear, bias, group_name)
    g = graph.gm.graph
    last_placeholder = graph.placeholders[-1]
    for value, readers in plan.sum_gradient.items():
        value = summed_rows.get(value, value)  # a row layer's output feeding the next column layer
        with g.inserting_after(last_placeholder if value.op == "placeholder" else value):
            summed = insert_call(g, "call_function", reduce_gradient, (value, "sum", group_name))
        for reader, slot in readers:
            _set_operand(reader, slot, summed)
    for (reader, slot), (dim, outer) in plan.narrow.items():
        with g.inserting_before(reader):
            local = insert_call(g, "call_function", take_local, (operand(reader, slot), dim, outer, plan.world, rank))
        _set_operand(reader, slot, local)
    for node, slots in plan.size_args.items():
        _divide_sizes(node, slots, plan.world)
    for node, state in plan.sharded.items():
        node.meta["example_value"] = _local_value(example_value(node), state, plan.world)
    g.lint()
    graph.gm.recompile()
    return lines


def _cut(graph: CapturedGraph, node: fx.Node, spec: ShardSpec, by: str, kind: str) -> tuple[str, str]:
    param = graph.parameter_for(node)
    before = tuple(param.tensor.shape)
    new = cut_parameter(graph, param, spec, by=by)
    blocks = f", {spec.outer} blocks" if spec.outer > 1 else ""
    return param.fqn, f"{kind}-parallel, {before} -> {tuple(new.shape)}{blocks}"


def _sum_then_bias(g: fx.Graph, linear: fx.Node, bias: fx.Node | None, group_name: str) -> fx.Node:
    """linear(x, w, b) -> sum_over_ranks(linear(x, w)) + b: the partial products summed, the bias
    once. Returns the node the linear's readers now read."""
    users = list(linear.users)
    if bias is not None:
        _set_operand(linear, ("arg", 2) if len(linear.args) > 2 else ("kwarg", "bias"), None)
    with g.inserting_after(linear):
        out = insert_call(g, "call_function", sum_over_ranks, (linear, group_name))
    if bias is not None:
        with g.inserting_after(out):
            out = insert_call(g, "call_function", operator.add, (out, bias))
    for user in users:
        user.replace_input_with(linear, out)
    return out


def _set_operand(node: fx.Node, slot: Slot, value: Any) -> None:
    kind, key = slot
    if kind == "arg":
        node.update_arg(key, value)
    else:
        node.update_kwarg(key, value)


def _divide_sizes(node: fx.Node, slots: list[Slot], world: int) -> None:
    for kind, key in slots:
        if kind == "nested":  # view(x, (b, s, h, d)): the sizes are one tuple argument
            sizes = list(node.args[1])
            sizes[key] //= world
            node.update_arg(1, type(node.args[1])(sizes))
        else:
            node.update_arg(key, node.args[key] // world)


def _local_value(value: Any, state: Any, world: int) -> Any:
    """The example value of a sharded node as one rank sees it."""
    if isinstance(state, tuple):
        return type(value)(_local_value(v, s, world) for v, s in zip(value, state))
    assert isinstance(state, Sharded)
    shape = list(value.shape)
    shape[state.dim] //= world
    with value.fake_mode:
        local = torch.empty(shape, dtype=value.dtype, device=value.device)
    return local.requires_grad_(value.requires_grad)


def linear_refusal(graph: CapturedGraph, linear: fx.Node) -> str | None:
    """Why the weight (and bias) of a linear node cannot be cut; None if they can."""
    _, weight, bias = linear_operands(linear)
    for node, what in ((weight, "weight"), (bias, "bias")):
        if node is None and what == "bias":
            continue
        param = graph.parameter_for(node) if isinstance(node, fx.Node) else None
        reason = _param_refusal(param, what)
        if reason is not None:
            return reason
    if example_value(weight).dim() != 2:
        return "its weight is not 2-D"
    return None


def _param_refusal(param: GraphParameter | None, what: str) -> str | None:
    if param is None:
        return f"its {what} is not a parameter the graph reads directly (computed, or gathered)"
    if param.owner is None:
        return f"its {what} is not a module parameter: there is no module to hold its shard"
    if type(param.tensor) is not torch.nn.Parameter:
        return (f"its {what} is a {type(param.tensor).__name__} (another transform changed it, e.g. quantize); "
                f"tensor parallelism cuts plain parameters")
    if len(param.node.users) != 1:
        readers = ", ".join(f"'{u.name}'" for u in param.node.users)
        return f"its {what} {param.fqn} is read by {readers} (shared, tied?): cutting it would change them all"
    return None
