"""Quickstart: what xform changes in a small decoder, what that saves on this machine, and against what.

    python examples/quickstart.py

The model is a 2-layer decoder (random weights) whose attention keeps a sliding window of the last
256 tokens, written as models write it: a boolean mask built from the positions, passed to
`F.scaled_dot_product_attention`. xform compiles it with four transforms:
- `quantize` (float8-weight-only) on the MLP layers: torchao's float8, a byte a weight;
- `cast:bf16` on the other Linear layers: two bytes a weight, the matmuls in bf16;
- `flex-attention`: the SDPA call becomes `flex_attention`, whose kernel computes only the blocks of
  scores the window reaches, where SDPA with a dense mask computes them all;
- `CountOps`, a transform written below in a dozen lines to show the protocol.
It prints xform's report, what each transform changed and saved, and a step's time at 4096 tokens
against `torch.compile` (Inductor) on the model as written, then what to expect on a GPU. It runs
on the CPU (the GPU when there is one) in about a minute, most of it three compiles.
"""

from __future__ import annotations

import collections
import copy
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import xform
from xform.report import TransformRecord, format_bytes
from xform.transforms.linear_layers import tensor_bytes

TOKENS, WINDOW, BLOCK = 4096, 256, 128  # BLOCK: the side of the tiles of scores flex_attention computes or skips
ROUNDS = 10  # timed calls of each compiled model, taken in turn
BASELINE = "torch.compile (Inductor), the model as written"
FLEX, ALL = "xform, flex-attention", "xform, all four transforms"
# docs/benchmarks.md's figures, H100, bf16 (tests/test_examples.py checks they are still the page's)
GPU_LINE = ("On a GPU (docs/benchmarks.md, H100, bf16, 4096 tokens): a sliding-window attention (1024) ran 6.3x "
            "faster through flex-attention than as written, and float8-rowwise trained a SwiGLU FFN 1.24x faster "
            "than bf16")


def sliding_window(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """[seq, seq], True where query i attends to key j: j <= i and i - j < window."""
    i = torch.arange(seq, device=device)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window = heads, window
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
        mask = sliding_window(seq, self.window, x.device)
        attention = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, seq, dim))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 1024, dim: int = 256, heads: int = 4, layers: int = 2,
                 window: int = WINDOW) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, window) for _ in range(layers))
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

    def transform_graph(self, graph: xform.CapturedGraph, record: TransformRecord) -> None:
        ops = collections.Counter(
            getattr(n.target, "__name__", str(n.target)) for n in graph.gm.graph.nodes if n.op.startswith("call")
        )
        record.note("most used ops: " + ", ".join(f"{op} x{count}" for op, count in ops.most_common(4)))


def is_mlp(path: str, module: nn.Module) -> bool:
    return path.rsplit(".", 1)[-1] in ("gate", "up", "down")


def blocks_computed(mask: torch.Tensor) -> float:
    """The share of BLOCK x BLOCK tiles of `mask` with a True in them: those flex_attention computes."""
    tiles = mask.shape[0] // BLOCK
    return mask.view(tiles, BLOCK, tiles, BLOCK).any(3).any(1).float().mean().item()


def timed_ms(calls: dict[str, Callable[[], torch.Tensor]], bar: tqdm) -> dict[str, float]:
    """The median ms of a call of each, over ROUNDS rounds that call each in turn (so that a load from
    elsewhere on the machine slows all alike)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
            bar.update()
    return {name: statistics.median(values) for name, values in times.items()}


def weight_lines(model: nn.Module, report: xform.Report, bytes_before: dict[str, int]) -> list[str]:
    """What quantize and cast did to the Linear layers, read from the report and the model: how many
    layers, what their weights are now, and their bytes before and after."""
    lines = []
    for transform in ("quantize", "cast"):
        paths = [c.target for c in report.changes(transform) if c.kind == "layer"]
        weights = [model.get_submodule(path).weight for path in paths]
        before, after = sum(bytes_before[path] for path in paths), sum(tensor_bytes(w) for w in weights)
        names = ", ".join(dict.fromkeys(path.rsplit(".", 1)[-1] for path in paths))
        held = ", ".join(sorted({type(w).__name__ for w in weights}))
        lines.append(f"  {transform:<15} {len(paths)} Linear layers ({names}), now {held}: weights "
                     f"{format_bytes(before)} -> {format_bytes(after)} ({before / after:.1f}x smaller)")
    return lines


def speed_line(label: str, ms: float, baseline_ms: float, faster: str, slower: str) -> str:
    """A timing row with its speed against the baseline and the reason for it, faster or slower."""
    ratio = baseline_ms / ms
    why = f"{ratio:.2f}x faster: {faster}" if ratio >= 1 else f"{ratio:.2f}x (slower): {slower}"
    return f"  {label:<48} {ms:8.1f} ms  {why}"


def compiled_variants(model: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The model as written under torch.compile, and under xform with flex-attention alone and with all
    four transforms. All but the last compile a copy: xform changes the weights of the model it compiles."""
    return {
        BASELINE: torch.compile(copy.deepcopy(model)),
        FLEX: xform.compile(copy.deepcopy(model), "flex-attention"),
        ALL: xform.compile(model, xform.transforms.Quantize("float8-weight-only", filter=is_mlp),
                           xform.transforms.Cast(torch.bfloat16, filter=lambda path, module: not is_mlp(path, module)),
                           "flex-attention", CountOps()),
    }


def run(model: nn.Module, tokens: torch.Tensor) -> tuple[dict[str, float], dict[str, float]]:
    """Each variant's largest difference from the model's output as written, and its ms a step, with a
    progress bar (on a terminal) through the compiles and the timed calls."""
    variants = compiled_variants(model)
    bar = tqdm(total=1 + len(variants) * (1 + ROUNDS), desc="quickstart", unit="call", disable=None)
    with torch.no_grad():
        bar.set_postfix_str("eager, for reference")
        reference = model(tokens)  # as written: xform changes its weights at its first call, below
        bar.update()
        errors = {}
        for name in reversed(variants):  # xform's first: its graph is Dynamo's first of Decoder.forward, 0/0
            bar.set_postfix_str(f"compiling {name}")
            errors[name] = (variants[name](tokens) - reference).abs().max().item()
            bar.update()
        bar.set_postfix_str("timing")
        ms = timed_ms({name: lambda c=compiled: c(tokens) for name, compiled in variants.items()}, bar)
    bar.close()
    return errors, ms


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Decoder().to(device).eval()
    tokens = torch.randint(0, 1024, (1, TOKENS), device=device)
    bytes_before = {name: tensor_bytes(m.weight) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    errors, ms = run(model, tokens)

    report = xform.report(model)
    flex = report.changes("flex-attention")
    computed = blocks_computed(sliding_window(TOKENS, WINDOW, device))
    print(f"A 2-layer decoder with a sliding-window attention ({WINDOW} tokens), compiled by xform with quantize "
          f"(float8-weight-only, the MLP), cast:bf16 (the other Linear layers), flex-attention and count-ops:")
    print(report)
    print()
    print("What each transform changed and saved:")
    print("\n".join(weight_lines(model, report, bytes_before)))
    print(f"  {'flex-attention':<15} {len(flex)} attentions, SDPA {flex[0].detail}")
    print(f"  {'':<15} it computes {computed:.0%} of the {BLOCK} x {BLOCK} blocks of scores (those the window "
          f"reaches); SDPA with the mask computes them all")
    print(f"  {'count-ops':<15} {report.notes('count-ops')[0]}")
    print(f"  largest difference from eager's output: flex-attention alone {errors[FLEX]:.2g} (the same math), "
          f"all four {errors[ALL]:.2g} (float8 and bf16 weights)")
    print()
    print(f"A step of 1 x {TOKENS} tokens on {device} ({torch.get_num_threads()} threads; median of {ROUNDS}, "
          f"the variants taken in turn):")
    print(f"  {BASELINE:<48} {ms[BASELINE]:8.1f} ms  the baseline")
    print(speed_line(FLEX, ms[FLEX], ms[BASELINE],
                     f"flex_attention skips the {1 - computed:.0%} of blocks the window masks",
                     f"on {device} SDPA's kernel outran flex_attention's, though flex skips {1 - computed:.0%} of the "
                     f"blocks"))
    print(speed_line(ALL, ms[ALL], ms[BASELINE],
                     "flex-attention's gain, with the Linear weights in float8 and bf16 (weight-only float8 saves "
                     "memory, not time)",
                     "weight-only float8 saves memory, not time (each matmul dequantizes its weight)"
                     + (", and bf16 matmuls are fast only on CPUs with AVX512-BF16 or AMX" if device.type == "cpu"
                        else "")))
    print()
    print(GPU_LINE)


if __name__ == "__main__":
    main()
