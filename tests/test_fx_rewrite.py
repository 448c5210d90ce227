"""xform.fx_rewrite's dead-code walk on Dynamo graphs: what a rewrite may erase with the nodes it replaced."""

from __future__ import annotations

import torch
from torch import fx

from xform.fx_rewrite import is_in_place, unused_after


def dynamo_graph(fn, *args) -> fx.GraphModule:
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return captured[0]


def calls(gm: fx.GraphModule, name: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if name in str(getattr(n.target, "__name__", n.target))]


def unused_once_gone(node: fx.Node) -> set[str]:
    """The targets of what nothing would use once `node` were erased."""
    return {str(getattr(n.target, "__name__", n.target)) for n in unused_after(node.all_input_nodes, gone={node})}


def test_and_is_not_in_place():
    gm = dynamo_graph(lambda x: ((x > 0) & (x < 1)).float(), torch.randn(4))
    (to_float,) = [n for n in gm.graph.nodes if n.op == "call_method"]
    assert {"and_", "gt", "lt"} <= unused_once_gone(to_float)  # operator.and_ is `a & b`; `a &= b` is iand


def scaled_in_place(q, k):
    scores = q @ k.transpose(-2, -1)
    scores /= 4.0
    return scores.softmax(-1)


def test_an_in_place_scale_of_a_product_nothing_else_reads_goes_with_it():
    q = torch.randn(2, 8, 4)
    (softmax,) = calls(gm := dynamo_graph(scaled_in_place, q, q.clone()), "softmax")
    assert {"itruediv", "matmul", "transpose"} <= unused_once_gone(softmax), gm.code


def test_an_in_place_scale_of_a_product_read_elsewhere_stays():
    def read_twice(q, k):
        scores = q @ k.transpose(-2, -1)
        total = scores.sum()  # reads the product before the scale
        scores /= 4.0
        return scores.softmax(-1), total

    q = torch.randn(2, 8, 4)
    (softmax,) = calls(dynamo_graph(read_twice, q, q.clone()), "softmax")
    assert not {"itruediv", "matmul"} & unused_once_gone(softmax)


def test_what_writes_in_place():
    def ops(x, y):
        a = x & y
        x &= y
        z = x.add(1)
        z.add_(1)
        return a, z

    gm = dynamo_graph(ops, torch.ones(4, dtype=torch.bool).int(), torch.ones(4).int())
    written = {str(getattr(n.target, "__name__", n.target)): is_in_place(n) for n in gm.graph.nodes
               if n.op in ("call_function", "call_method")}
    assert written == {"and_": False, "iand": True, "add": False, "add_": True}, written
