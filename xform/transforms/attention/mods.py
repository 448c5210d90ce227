"""A site's masks and biases as flex_attention's `mask_mod` and `score_mod`, the call that runs
them (`FlexCall`, a graph call target), and what a mask is, in words, for the report."""

from __future__ import annotations

import math
from typing import Any

import torch

from xform._torch import flex_attention
from xform._torch.functorch import functorch_on
from xform.transforms.attention.match import AttentionSite, Term

def describe_mask(site: AttentionSite, q_len: int, kv_len: int) -> str:
    """'causal', 'sliding window 1024', 'prefix-LM 64', 'document', 'ALiBi-style bias', ... ."""
    parts = []
    static = [t for t in site.masks if t.is_static]
    if static:
        parts.append(_static_mask_name(static, q_len, kv_len))
    if any(not t.is_static for t in site.masks):
        parts.append("document (per-token ids)" if any(t.program.reads_ids() for t in site.masks if t.program)
                     else "mask read from a tensor")
    if site.softcap is not None:  # applied to the score before the biases are added
        parts.append(f"tanh soft-cap {site.softcap:g}")
    for term in site.biases:
        program = term.program
        per_head = any(labels == ("h",) for _, labels in program.buffer_reads())
        parts.append("ALiBi-style per-head bias" if per_head and {"q", "kv"} <= program.positions_used
                     else "additive bias")
    return " + ".join(p for p in parts if p) or "no mask"


def _static_mask_name(terms: list[Term], q_len: int, kv_len: int) -> str:
    """Name a position-only mask by evaluating it on a few full rows."""
    rows = torch.tensor(sorted({0, 1, q_len // 2, q_len - 1}))[:, None]
    kv = torch.arange(kv_len)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    allowed = all_allowed(terms, zero, zero, rows, kv).expand(rows.shape[0], kv_len)
    causal = (kv <= rows).expand_as(allowed)
    if bool(allowed.all()):
        return ""
    if torch.equal(allowed, causal):
        return "causal"
    width = int(allowed[-1].sum())
    if torch.equal(allowed, causal & (rows - kv < width)):
        return f"sliding window {width}"
    prefix = int(allowed[0].sum())
    if torch.equal(allowed, causal | (kv < prefix)):
        return f"prefix-LM {prefix}"
    return "custom mask"


def all_allowed(terms: list[Term], b: Any, h: Any, q: Any, kv: Any, *buffers: torch.Tensor) -> torch.Tensor:
    """The AND of the masks (True where all attend), each reading its slice of `buffers`; True everywhere
    with none. Seeded with the first mask, not a constant: the mask_mod runs per element of every
    partial block, so an operation more is a cost in the kernel."""
    allowed = None
    for term, own in with_buffers(terms, buffers):
        mask = term.allowed(b, h, q, kv, *own)
        allowed = mask if allowed is None else allowed & mask
    return q >= 0 if allowed is None else allowed


def with_buffers(terms: list[Term], buffers: tuple) -> list[tuple[Term, tuple]]:
    """Pair each term with its slice of the flat buffer list."""
    pairs, start = [], 0
    for term in terms:
        count = len(term.buffer_nodes)
        pairs.append((term, tuple(buffers[start:start + count])))
        start += count
    return pairs


_TENSOR = object()  # a BlockMask tuple's slot that the graph passes in


def block_template(block_mask: Any) -> tuple:
    """A BlockMask's tuple with its tensors left as slots (and no mask_mod: each call brings its own)."""
    return tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in block_mask.as_tuple()[:-1]) + (None,)


class FlexCall:
    """Graph call target: `flex_attention(q, k, v)` with the site's mods, block mask and kernel options.

    Takes (q, k, v, *block_mask_tensors, *mask_buffers, *bias_buffers) so that every tensor it
    reads is a graph value, as AOTAutograd needs; calls flex_attention's operator directly (the
    frontend would try to compile itself, which it cannot from inside a compile).
    """

    def __init__(self, site: AttentionSite, block_template: tuple, kernel_options: dict[str, Any]) -> None:
        self.masks, self.biases, self.scale, self.softcap = site.masks, site.biases, site.scale, site.softcap
        self.kernel_options = kernel_options
        self.block_template = block_template  # a BlockMask tuple, its tensors `_TENSOR` slots
        self.__name__ = "flex_attention"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        count = sum(x is _TENSOR for x in self.block_template)
        block_tensors, rest = iter(tensors[:count]), tensors[count:]
        mask_count = sum(len(t.buffer_nodes) for t in self.masks)
        mask_buffers, bias_buffers = tuple(rest[:mask_count]), tuple(rest[mask_count:])

        def mask_mod(b, h, q_idx, kv_idx, *buffers):
            return all_allowed(self.masks, b, h, q_idx, kv_idx, *buffers)

        def score_mod(score, b, h, q_idx, kv_idx, *buffers):
            if self.softcap is not None:
                score = self.softcap * torch.tanh(score)
            for term, own in with_buffers(self.biases, buffers):
                score = score + term.bias(b, h, q_idx, kv_idx, *own)
            return score

        block = tuple(next(block_tensors) if x is _TENSOR else x for x in self.block_template)
        options = flex_attention.kernel_options(q, k, v, dict(self.kernel_options))
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        with functorch_on():  # run eagerly (eager handoff), flex's reference math vmaps the mods
            out, *_ = torch.ops.higher_order.flex_attention(
                q, k, v, score_mod, block[:-1] + (mask_mod,), scale, options, bias_buffers, mask_buffers)
        return out
