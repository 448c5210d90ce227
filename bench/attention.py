"""Attention on the GPU: the model as written (SDPA, compiled with Inductor) vs hand-written
flex_attention (Triton and Flash backends) vs the same model through xform's flex-attention.

    python bench/attention.py --seq 4096 --masks causal,sliding,alibi,document --modes fwd,fwd+bwd

bf16, 16 heads, head dim 128; batch 8 at 4096 tokens, scaled to keep B*S = 32768. Masks: causal,
sliding window 1024 (causal), ALiBi + causal, document (1024-token documents) + causal. The
model as written builds its mask from aranges / per-token ids and calls SDPA, as people write
it; "thunder" is that model through Lightning Thunder's ThunderFX (`ThunderCompiler`), "skipped"
with the reason where thunder does not import. "xform new ids" (document mask only) writes the
ids in place before every step, so xform builds the block mask again each step, as in training
on packed sequences whose ids change per batch; "xform" passes the same ids every step, so its
block mask is reused, as the hand-written flex builds its block mask once. Times:
`triton.testing.do_bench` medians in ms.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Skipped, or_skipped, print_table, say, thunder_compile, write_result  # noqa: E402

import xform  # noqa: E402

HEADS, HEAD_DIM, TOKENS, WINDOW, DOC = 16, 128, 32768, 1024, 1024


class AsWritten(nn.Module):
    """Attention over given q, k, v with a mask built the way models build it."""

    def __init__(self, mask: str, seq: int) -> None:
        super().__init__()
        self.mask = mask
        self.register_buffer("slopes", torch.tensor([2 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)]))
        self.seq = seq

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.mask == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        pos = torch.arange(self.seq, device=q.device)
        qi, ki = pos[:, None], pos[None, :]
        if self.mask == "sliding":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=(qi >= ki) & (qi - ki < WINDOW))
        if self.mask == "alibi":
            bias = (self.slopes[:, None, None] * (ki - qi)).masked_fill(ki > qi, float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        same = ids[:, None, :, None] == ids[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=same & (qi >= ki))


def flex_by_hand(mask: str, seq: int, batch: int, backend: str, slopes: torch.Tensor, ids: torch.Tensor):
    """Hand-written flex_attention for the same mask: the mods a user would write."""
    def causal(b, h, q, kv):
        return q >= kv

    mask_mod, score_mod, b_len = causal, None, None
    if mask == "sliding":
        def mask_mod(b, h, q, kv):
            return (q >= kv) & (q - kv < WINDOW)
    elif mask == "alibi":
        def score_mod(score, b, h, q, kv):
            return score + slopes[h] * (kv - q)
    elif mask == "document":
        b_len = batch

        def mask_mod(b, h, q, kv):
            return (ids[b, q] == ids[b, kv]) & (q >= kv)
    block_mask = create_block_mask(mask_mod, b_len, None, seq, seq, device="cuda")
    options = {"BACKEND": "FLASH"} if backend == "flash" else {}
    compiled = torch.compile(flex_attention)

    def run(q, k, v, ids_):
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options)
    return run


def with_ids_written(fn):
    """`fn` with its ids written in place first (the same values): new ids as far as xform can tell."""
    def run(q, k, v, ids):
        ids.add_(0)
        return fn(q, k, v, ids)
    return run


def timed(fn, q, k, v, ids, mode: str) -> float:
    import triton.testing

    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v, ids)
    else:
        def step():
            fn(q, k, v, ids).sum().backward()
    step()
    return triton.testing.do_bench(step, warmup=10, rep=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096])
    parser.add_argument("--masks", default="causal,sliding,alibi,document")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--variants", default="as written,flex triton,flex flash,xform,xform new ids,thunder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    bar = tqdm(total=len(args.seq) * len(args.masks.split(",")), desc="attention", unit="mask", disable=None)
    for seq in args.seq:
        batch = max(1, TOKENS // seq)
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        ids = (torch.arange(seq, device="cuda") // DOC).expand(batch, seq).contiguous()
        for mask in args.masks.split(","):
            model = AsWritten(mask, seq).cuda()
            variants = {
                "as written": torch.compile(model),
                "flex triton": flex_by_hand(mask, seq, batch, "triton", model.slopes, ids),
                "flex flash": flex_by_hand(mask, seq, batch, "flash", model.slopes, ids),
                "xform": xform.compile(AsWritten(mask, seq).cuda(), "flex-attention"),
                "xform new ids": (with_ids_written(xform.compile(AsWritten(mask, seq).cuda(), "flex-attention"))
                                   if mask == "document" else Skipped("no data mask")),
                "thunder": or_skipped(lambda: thunder_compile()(AsWritten(mask, seq).cuda())),
            }
            for mode in args.modes.split(","):
                row = {"seq": seq, "batch": batch, "mask": mask, "mode": mode}
                for name in args.variants.split(","):
                    if isinstance(variants[name], Skipped):
                        row[name] = variants[name].cell()
                        continue
                    try:
                        row[name] = round(timed(variants[name], q, k, v, ids, mode), 3)
                    except Exception as error:  # a configuration that fails is a finding, not a crash
                        row[name] = f"error: {type(error).__name__}: {str(error)[:160]}"
                        traceback.print_exc()
                if isinstance(row.get("xform"), float) and isinstance(row.get("flex flash"), float):
                    row["xform / flash"] = round(row["xform"] / row["flex flash"], 3)
                if isinstance(row.get("xform"), float) and isinstance(row.get("as written"), float):
                    row["as written / xform"] = round(row["as written"] / row["xform"], 3)
                rows.append(row)
                say(str(row))
                write_result("attention", rows, args.out, partial=True)
            details = [c.detail for g in xform.report(variants["xform"]).graphs for t in g.transforms
                       for c in t.changes + t.skips]
            say(f"xform: {details}")
            torch._dynamo.reset()
            bar.update()
    bar.close()
    print_table(rows, ["seq", "mask", "mode", "as written", "flex triton", "flex flash", "xform", "xform new ids",
                       "thunder", "xform / flash", "as written / xform"])
    print("results:", write_result("attention", rows, args.out))


if __name__ == "__main__":
    main()
