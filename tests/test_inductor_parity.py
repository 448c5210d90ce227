"""With no transforms, xform is plain Inductor: same outputs and gradients as backend="inductor"."""

from __future__ import annotations

import copy

import pytest
import torch

import xform
from models import ConvNet, TransformerBlock, mlp

CASES = [
    ("mlp", mlp, lambda: torch.randn(8, 16)),
    ("convnet", ConvNet, lambda: torch.randn(2, 3, 16, 16)),
    ("transformer block", TransformerBlock, lambda: torch.randn(2, 8, 32)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, make, inputs", CASES, ids=[c[0] for c in CASES])
def test_no_transforms_matches_inductor_forward_and_backward(name, make, inputs):
    model = make()
    twin = copy.deepcopy(model)
    x = inputs()
    by_inductor = torch.compile(model, backend="inductor")
    by_xform = torch.compile(twin, backend="xform")

    expected, actual = by_inductor(x), by_xform(x)
    expected.square().sum().backward()
    actual.square().sum().backward()

    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    for (pname, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=f"gradient of {pname}")
    graph = xform.report(twin).graphs[0]
    assert graph.handoff == "inductor" and graph.transforms == [] and graph.nodes_after == graph.nodes_before


@pytest.mark.slow
def test_cast_through_inductor_matches_cast_through_eager():
    x = torch.randn(2, 8, 32)
    model = TransformerBlock()
    twin = copy.deepcopy(model)
    eager_out = xform.compile(model, "cast:bf16", handoff="eager")(x)
    inductor_out = xform.compile(twin, "cast:bf16")(x)
    torch.testing.assert_close(inductor_out, eager_out, atol=2e-2, rtol=2e-2)
