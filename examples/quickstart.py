"""Quickstart: compile a small transformer with xform on CPU (GPU when present) and read the report.

    python examples/quickstart.py

It compiles a 2-layer decoder (random weights) with three transforms: `quantize` (the MLP
layers' weights to float8, through torchao), `cast:bf16` (the other Linear layers held and
computed in bf16) and `CountOps`, a transform written below in a dozen lines to show the
protocol. Then it checks the result against eager, prints xform's report and times both.
"""

from __future__ import annotations

import collections
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import xform


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, 4 * dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.heads, dim // self.heads).transpose(1, 3).unbind(2)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, seq, dim))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 1024, dim: int = 256, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CountOps(xform.Transform):
    """A transform is a class with the hooks it needs: this one only reads the graph."""

    name = "count-ops"

    def transform_graph(self, graph: xform.CapturedGraph, record) -> None:
        ops = collections.Counter(
            getattr(n.target, "__name__", str(n.target)) for n in graph.gm.graph.nodes if n.op.startswith("call")
        )
        record.note("most used ops: " + ", ".join(f"{op} x{count}" for op, count in ops.most_common(4)))


def median_ms(fn, *args, repeats: int = 20) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = Decoder().to(device).eval()
    tokens = torch.randint(0, 1024, (4, 128), device=device)
    with torch.no_grad():
        reference = model(tokens)
        eager_ms = median_ms(model, tokens)

        is_mlp = lambda path, module: path.rsplit(".", 1)[-1] in ("gate", "up", "down")  # noqa: E731
        compiled = xform.compile(model,
                                 xform.transforms.Quantize("float8-weight-only", filter=is_mlp),
                                 xform.transforms.Cast(torch.bfloat16, filter=lambda p, m: not is_mlp(p, m)),
                                 CountOps())
        start = time.perf_counter()
        logits = compiled(tokens)
        compile_s = time.perf_counter() - start
        compiled_ms = median_ms(compiled, tokens)

    error = (logits - reference).abs().max().item()
    print(xform.report(compiled))
    print()
    held = {name: type(getattr(model.blocks[0], name).weight).__name__ for name in ("qkv", "up")}
    print(f"max |xform - eager| = {error:.3g} (float8 / bf16 Linear layers); block 0 now holds {held}")
    print(f"{device}: eager {eager_ms:.2f} ms/step, xform {compiled_ms:.2f} ms/step "
          f"({eager_ms / compiled_ms:.2f}x), first call (compile) {compile_s:.1f} s")


if __name__ == "__main__":
    main()
