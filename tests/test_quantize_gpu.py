"""Quantize on a CUDA GPU (run on the device machine): the recipes that need one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import xform
from xform.transforms import RECIPES, Quantize, QuantizeUnsupported
from test_quantize import sqnr

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
    with torch.no_grad():
        exact = model(x)

    compiled = xform.compile(model, f"quantize:{recipe}")
    with torch.set_grad_enabled(training):
        out = compiled(x)
        expected = torch.compile(by_hand)(x)
    # each against the bf16 model first: where the two disagree, this says which one is wrong (float8-blockwise
    # on torch 2.11, 2026-12-07: both, 3 dB and -31.6 dB; now refused there by its probe, docs/quantize.md)
    against_bf16 = f"SQNR against bf16: xform {sqnr(exact, out):.1f} dB, torchao by hand {sqnr(exact, expected):.1f} dB"
    assert sqnr(exact, out) >= 10.0 and sqnr(exact, expected) >= 10.0, against_bf16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2, msg=lambda m: f"{m}\n{against_bf16}")
    if training:
        out.sum().backward()
    with no_recompile(), torch.set_grad_enabled(training):
        compiled(x)
    assert [c.target for c in xform.report(model).changes("quantize") if c.kind == "layer"] == ["0", "2"]
    if RECIPES[recipe].first_use:  # float8-blockwise: torchao autotunes for minutes on a cold Triton cache
        assert any(RECIPES[recipe].first_use in note for note in xform.report(model).notes("quantize"))


@pytest.mark.parametrize("graphs", [True, False], ids=["with-cudagraphs", "without"])
@pytest.mark.parametrize("recipe, out_db", [("float8-rowwise", 20.0), ("float8-weight-only", 25.0)])
def test_quantize_composes_with_flex_attention_and_cudagraphs(recipe, out_db, graphs):
    """All three on one transformer block: the same as quantize alone, recorded and replayed. Also without
    cudagraphs, to tell which of the two flex-attention's failure there (H100, 2026-12-07) needs."""
    from models import TransformerBlock

    training = RECIPES[recipe].training
    reference = nn.Sequential(TransformerBlock(dim=256, heads=2)).cuda().bfloat16()
    composed_model, alone_model = copy.deepcopy(reference), copy.deepcopy(reference)
    transforms = [f"quantize:{recipe}", "flex-attention"] + (["cudagraphs"] if graphs else [])
    composed = xform.compile(composed_model, *transforms)
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
    assert report.failures() == [] and report.changes("flex-attention")
    assert bool(report.changes("cudagraphs")) == graphs


def test_rowwise_amax_pass_rewrites_the_swiglu_backward_and_loses_no_accuracy():
    """xform/transforms/quantize/split_amax.py on the pattern it is for: a SwiGLU trained in float8-rowwise, whose backward
    reduces both gradients of the SwiGLU by rows and by columns. The weights' gradients are the same bit
    for bit (H100, 2026-12-05); the input's gradient is not: it differed from the one without the pass
    by a relative norm of 0.024 (H100, 2026-12-06; the casts compute the SwiGLU gradient in another
    kernel, which rounds its intermediates at other points). So the input's gradient is held to its
    error against float32 without float8: no larger with the pass than without."""
    from test_split_amax import CountingPass

    torch.manual_seed(0)

    class SwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w3 = nn.Linear(512, 2048, bias=False), nn.Linear(512, 2048, bias=False)
            self.w2 = nn.Linear(2048, 512, bias=False)

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    reference = SwiGLU().cuda().bfloat16()
    # x needs a gradient: else the backward casts the SwiGLU gradients only by columns (for the
    # weights' gradients), and there is no pair of amaxes to split
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counting, grads = CountingPass(), []
    for amax_pass in (counting, None):
        model = copy.deepcopy(reference)
        with torch._inductor.config.patch(force_disable_caches=True):
            xform.compile(model, "quantize:float8-rowwise",
                          inductor_options={"post_grad_custom_post_pass": amax_pass})(x).float().square().mean().backward()
        grads.append([p.grad for p in model.parameters()] + [x.grad])
        x.grad = None
    assert sum(counting.rewritten) == 4, counting.rewritten  # the row and column amaxes of both SwiGLU gradients
    *weights, x_grad = zip(*grads)
    for with_pass, without in weights:
        assert torch.equal(with_pass, without)
    x_exact = x.detach().float().requires_grad_()
    copy.deepcopy(reference).float()(x_exact).square().mean().backward()
    with_pass, without = (((g.float() - x_exact.grad).norm() / x_exact.grad.norm()).item() for g in x_grad)
    print(f"input gradient's error against float32: {with_pass:.4f} with the pass, {without:.4f} without")
    assert with_pass <= 1.1 * without, (with_pass, without)  # no less accurate than float8 is without the pass
