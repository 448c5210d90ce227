"""Randomized corpus: seeded small models (tests/corpus.py) compiled with every transform that runs
on CPU and every pair of them. XFORM_CORPUS_MODELS=5000 runs a longer sweep and
XFORM_CORPUS_FIRST=N starts it at seed N (CI: 30 models x 11 sets = 330 cases; the first FAST
models in the fast lane, the rest marked slow).

Two checks per case. (1) The compiled model against the same model run eagerly *after* the
transforms changed it (cast and quantize keep the eager meaning of what they did): outputs and
gradients must agree to float32 rounding, so any compiler-side wrong answer shows. (2) Its output
against the original fp32 model, within the transform's numerical tolerance (SQNR), so a
transform that is consistent but wrong shows too."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import xform
import xform.transforms.cudagraphs.transform as cudagraphs
from corpus import random_model
from simulated_recorder import SimulatedRecorder

FIRST = int(os.environ.get("XFORM_CORPUS_FIRST", "0"))
MODELS = int(os.environ.get("XFORM_CORPUS_MODELS", "30"))
FAST = 5

# transform set -> (specs, minimum output SQNR (dB) against the fp32 model (None: must match it to
# float32 rounding), tolerance of compiled against eager). Compiled and eager run the same ops, so
# that tolerance is float32 rounding, except where flex_attention's few-ulp differences from SDPA
# meet a later low-precision cast and flip one bf16 (or float8) rounding.
FLOAT32, BF16_ULP, FLOAT8_ULP = 1e-4, 2e-2, 6e-2
SETS = {
    "none": ([], None, FLOAT32),
    "cast": (["cast:bf16"], 22.0, FLOAT32),
    "quantize": (["quantize:float8-rowwise"], 12.0, FLOAT32),
    "flex-attention": (["flex-attention"], None, FLOAT32),
    "cast+flex-attention": (["cast:bf16", "flex-attention"], 22.0, BF16_ULP),
    "quantize+flex-attention": (["quantize:float8-rowwise", "flex-attention"], 12.0, FLOAT8_ULP),
    "quantize+cast": (["quantize:float8-rowwise", "cast:bf16"], 12.0, FLOAT32),
    # cudagraphs records on the simulated recorder (the CPU as the recorded device, its pool
    # scribbled over before every replay), launches moving pointers where its check allows
    "cudagraphs": (["cudagraphs"], None, FLOAT32),
    "cudagraphs+cast": (["cudagraphs", "cast:bf16"], 22.0, FLOAT32),
    "cudagraphs+quantize": (["cudagraphs", "quantize:float8-rowwise"], 12.0, FLOAT32),
    "cudagraphs+flex-attention": (["cudagraphs", "flex-attention"], None, FLOAT32),
}


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    reference, actual = reference.double(), actual.double()
    noise = (reference - actual).norm()
    return float("inf") if noise == 0 else (20 * torch.log10(reference.norm() / noise)).item()


def step(forward, model: torch.nn.Module, x: torch.Tensor):
    """Output, input gradient and parameter gradients of one forward/backward."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = forward(x)
    out.float().square().mean().backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
    return out.detach().float(), x.grad.float(), grads


def mismatches(expected, actual, tolerance: float) -> list[str]:
    (out_e, dx_e, grads_e), (out_a, dx_a, grads_a) = expected, actual
    pairs = [("output", out_e, out_a), ("input gradient", dx_e, dx_a)]
    pairs += [(f"gradient of {p}", grads_e[p], g) for p, g in grads_a.items() if p in grads_e]
    return [f"{name}: max |diff| {(a - e).abs().max().item():.3g}" for name, e, a in pairs
            if not torch.allclose(a, e, atol=tolerance, rtol=10 * tolerance)]


@pytest.mark.parametrize("seed", [pytest.param(seed, marks=() if seed < FIRST + FAST else pytest.mark.slow)
                                  for seed in range(FIRST, FIRST + MODELS)])
def test_random_model_with_every_transform_set(seed, monkeypatch):
    monkeypatch.setattr(cudagraphs, "available_recorder", SimulatedRecorder)
    model, x = random_model(seed)
    original = copy.deepcopy(model)
    reference_out = original(x).detach().float()
    problems = []
    for set_name, (transforms, min_db, tolerance) in SETS.items():
        torch._dynamo.reset()
        candidate = copy.deepcopy(model)
        forward = xform.compile(candidate, *transforms, handoff="eager")
        for _ in range(2 if "cudagraphs" in transforms else 0):  # warm-up, then the recording's call
            step(forward, candidate, x)
        compiled = step(forward, candidate, x)  # with cudagraphs: a replay
        eager = step(candidate, candidate, x)  # the model as the transforms left it, run eagerly
        problems += [f"{set_name}: compiled vs eager {m}" for m in mismatches(eager, compiled, tolerance)]
        db = sqnr(reference_out, compiled[0])
        if min_db is not None and db < min_db:
            problems.append(f"{set_name}: output SQNR {db:.1f} dB against the fp32 model < {min_db} dB")
        elif min_db is None and not torch.allclose(compiled[0], reference_out, atol=1e-4, rtol=1e-3):
            problems.append(f"{set_name}: output differs from the fp32 model")
    assert not problems, f"seed {seed} ({model.kinds}):\n" + "\n".join(problems)
