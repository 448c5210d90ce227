"""Whether `torch._scaled_mm` computes a blockwise float8 GEMM right on this device.

torchao's `float8-blockwise` module multiplies through `torch._scaled_mm` with 1x128 activation
scales and 128x128 weight scales, each in column-major order. On the H200 with torch 2.11.0+cu130
and torchao 0.17.0 (2026-12-07) that product was wrong: SQNR against bf16 3.0 dB eagerly, -31.6 dB
compiled, its gradients -inf; `torch._scaled_mm` alone on torchao's quantized operands gave inf.
So before the recipe is planned, one small GEMM of that layout is quantized here with plain torch
ops and checked against float32: a wrong result refuses the recipe, where it would otherwise
train on garbage without a word.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from xform._torch import dispatch

BLOCK = 128
RIGHT_DB = 15.0  # the probe's GEMM gives 28.7 dB computed right; a scale misread, 3 dB or less
FLOAT8_MAX = 448.0  # float8_e4m3fn

ScaledMM = Callable[..., torch.Tensor]


def quantize_blocks(t: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` in float8_e4m3fn by blocks of rows x cols, and the float32 scale of each block
    (dequantized = float8 * scale), the scales a (rows of blocks, columns of blocks) tensor."""
    r, c = t.shape
    blocks = t.float().reshape(r // rows, rows, c // cols, cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FLOAT8_MAX
    quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(r, c)
    return quantized, scale


def blockwise_sqnr(device: torch.device, scaled_mm: ScaledMM | None = None) -> float:
    """SQNR (dB) against float32 of `scaled_mm` (`torch._scaled_mm`) on a (128 x 256) @ (256 x 256)
    product, the operands and scales laid out as torchao's blockwise module passes them."""
    scaled_mm = scaled_mm or dispatch.scaled_mm
    generator = torch.Generator(device=device).manual_seed(0)
    # every block of its own magnitude (rows of `a` too), so that a scale read from the wrong block
    # or row shows: with data of one magnitude everywhere, scales read transposed would pass
    rows = torch.logspace(0, 3, BLOCK, device=device)[:, None]
    a = torch.randn(BLOCK, 2 * BLOCK, generator=generator, device=device) * rows * _per_block([[1.0, 50.0]], device)
    w = torch.randn(2 * BLOCK, 2 * BLOCK, generator=generator, device=device) * _per_block(
        [[1.0, 30.0], [300.0, 3.0]], device)  # (out, in), as a Linear's weight
    a8, a_scale = quantize_blocks(a, 1, BLOCK)
    w8, w_scale = quantize_blocks(w, BLOCK, BLOCK)
    out = scaled_mm(a8, w8.t(), a_scale.t().contiguous().t(), w_scale.t(), out_dtype=torch.bfloat16)
    reference = a @ w.t()
    error = (reference - out.float()).norm()
    return float(20 * torch.log10(reference.norm() / error)) if torch.isfinite(error) else float("-inf")


def _per_block(factors: list[list[float]], device: torch.device) -> torch.Tensor:
    """A factor per 128-column block (one row of factors) or per 128x128 block, expanded to elements."""
    grid = torch.tensor(factors, device=device).repeat_interleave(BLOCK, 1)
    return grid if len(factors) == 1 else grid.repeat_interleave(BLOCK, 0)


@functools.lru_cache(maxsize=None)
def blockwise_gemm_error(device: torch.device) -> str | None:
    """Why torch's blockwise float8 GEMM cannot be trusted on `device`, or None (measured once)."""
    try:
        db = blockwise_sqnr(device)
    except (RuntimeError, ValueError) as error:  # torch's own refusal of the layout is a ValueError
        return f"torch._scaled_mm refused 1x128/128x128 block scales ({str(error).strip().splitlines()[0]})"
    if db < RIGHT_DB:
        return (f"torch._scaled_mm with 1x128/128x128 block scales, which torchao's blockwise module calls, "
                f"computed a probe GEMM wrong here ({db:.1f} dB SQNR against float32; right is about 28) with "
                f"torch {torch.__version__}")
    return None
