"""The two-stage amax pass of float8-rowwise (xform/transforms/quantize/split_amax.py): what it rewrites, what it leaves,
and that it changes no value, on its own and under Inductor."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from xform.transforms.quantize.split_amax import SplitAmaxPairs, split_amax_pairs

aten = torch.ops.aten


def scales(x: torch.Tensor, given: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row and column amaxes of a tensor computed from x, and of `given` as it comes: the pattern
    of a rowwise float8 backward (its computed gradients, and the output gradient it is given)."""
    g = torch.sigmoid(x) * x
    return (g.abs().amax(1, keepdim=True), g.abs().amax(0, keepdim=True),
            given.abs().amax(1, keepdim=True), given.abs().amax(0, keepdim=True))


def amaxes(graph: fx.Graph) -> list[tuple[int, ...]]:
    return [tuple(n.args[0].meta["val"].shape) for n in graph.nodes if n.target is aten.amax.default]


def test_the_row_and_column_amaxes_of_a_computed_tensor_are_split_and_give_the_same_values():
    x, given = torch.randn(256, 2048), torch.randn(256, 2048)
    gm = make_fx(scales)(x, given)
    assert split_amax_pairs(gm.graph) == 1  # the row amax; the column amax's 256 rows are too few to split
    gm.recompile()
    assert amaxes(gm.graph) == [(256, 16, 128), (256, 16), (256, 2048), (256, 2048), (256, 2048)]
    for got, expected in zip(gm(x, given), scales(x, given)):
        assert torch.equal(got, expected)


def test_both_directions_split_when_both_are_long():
    x, given = torch.randn(2048, 1024), torch.randn(2048, 1024)
    gm = make_fx(scales)(x, given)
    assert split_amax_pairs(gm.graph) == 2
    gm.recompile()
    for got, expected in zip(gm(x, given), scales(x, given)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("shape, why", [((2112, 1000), "not multiples of 128"), ((512, 512), "too short")])
def test_reductions_it_cannot_chunk_are_left(shape, why):
    gm = make_fx(scales)(torch.randn(*shape), torch.randn(*shape))
    assert split_amax_pairs(gm.graph) == 0, why


def test_a_tensor_reduced_one_way_only_is_left():
    def row_only(x):
        g = x * 2
        return g.abs().amax(1, keepdim=True), g.abs().amax(1, keepdim=True)

    gm = make_fx(row_only)(torch.randn(1024, 1024))
    assert split_amax_pairs(gm.graph) == 0


def test_a_tensor_of_dynamic_size_is_left():
    gm = make_fx(scales, tracing_mode="symbolic")(torch.randn(2048, 1024), torch.randn(2048, 1024))
    assert split_amax_pairs(gm.graph) == 0


def test_the_pass_is_cached_by_its_source():
    assert SplitAmaxPairs().uuid() == SplitAmaxPairs().uuid()


class CountingPass(SplitAmaxPairs):
    def __init__(self) -> None:
        self.rewritten: list[int] = []

    def __call__(self, graph: fx.Graph) -> None:
        self.rewritten.append(split_amax_pairs(graph))


def test_inductor_compiles_the_rewritten_graph_to_the_same_values():
    # the real pattern (a rowwise float8 backward on CUDA) cannot be traced here: torchao's emulated
    # CPU backward computes no row amax of its gradients; the rewritten graph is the same aten ops
    x, given = torch.randn(2048, 1024), torch.randn(2048, 1024)
    counting = CountingPass()
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(scales, backend="inductor", options={"post_grad_custom_post_pass": counting})
        got = compiled(x, given)
    assert counting.rewritten == [2]
    for value, expected in zip(got, scales(x, given)):
        assert torch.equal(value, expected)
