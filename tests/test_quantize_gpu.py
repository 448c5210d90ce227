"""Quantize on a CUDA GPU (run on the device machine): the recipes that need one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import xform
from xform.transforms import RECIPES, Quantize, QuantizeUnsupported

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_recipes():
    for name in RECIPES:
        try:
            plan = Quantize(name).check("cuda") if torch.cuda.is_available() else None
        except QuantizeUnsupported as error:
            yield pytest.param(name, marks=pytest.mark.skip(reason=str(error)[:200]), id=name)
            continue
        yield pytest.param(name, id=name, marks=[pytest.mark.skip(reason="emulated here")] if plan and plan.emulated else [])


@pytest.mark.parametrize("recipe", list(gpu_recipes()))
def test_recipe_on_gpu_matches_torchao_by_hand_and_does_not_recompile(recipe, no_recompile):
    training = RECIPES[recipe].training
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.GELU(), nn.Linear(512, 256, bias=False)).cuda().bfloat16()
    by_hand = copy.deepcopy(model)
    plan = Quantize(recipe).check("cuda")
    if RECIPES[recipe].swap_module is not None and recipe != "float8-blockwise":
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(by_hand, config=plan.config)
    else:
        from torchao.quantization import quantize_
        quantize_(by_hand, plan.config)
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=training)

    compiled = xform.compile(model, f"quantize:{recipe}")
    with torch.set_grad_enabled(training):
        out = compiled(x)
        expected = torch.compile(by_hand)(x)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    if training:
        out.sum().backward()
    with no_recompile(), torch.set_grad_enabled(training):
        compiled(x)
    assert [c.target for c in xform.report(model).changes("quantize") if c.kind == "layer"] == ["0", "2"]


@pytest.mark.parametrize("recipe, out_db", [("float8-rowwise", 20.0), ("float8-weight-only", 25.0)])
def test_quantize_composes_with_flex_attention_and_cudagraphs(recipe, out_db):
    """All three on one transformer block: the same as quantize alone, recorded and replayed."""
    from models import TransformerBlock
    from test_quantize import sqnr

    training = RECIPES[recipe].training
    reference = nn.Sequential(TransformerBlock(dim=256, heads=2)).cuda().bfloat16()
    composed_model, alone_model = copy.deepcopy(reference), copy.deepcopy(reference)
    composed = xform.compile(composed_model, f"quantize:{recipe}", "flex-attention", "cudagraphs")
    alone = xform.compile(alone_model, f"quantize:{recipe}")
    x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)

    with torch.set_grad_enabled(training):
        for _ in range(3):  # warm-up, recording, replays
            inputs = x.clone().requires_grad_(training)
            out = composed(inputs)
            if training:
                out.float().square().mean().backward()
        expected = alone(x)
        exact = reference(x)
    assert sqnr(expected, out) >= 30.0  # flex vs SDPA, graphs vs not: the same up to bf16 rounding
    assert sqnr(exact, out) >= out_db
    if training:
        assert inputs.grad is not None and torch.isfinite(inputs.grad).all()
    report = xform.report(composed_model)
    assert report.changes("flex-attention") and report.changes("cudagraphs")
    assert not report.failures()
