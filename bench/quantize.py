"""Quantized Linear layers on the GPU: bf16 Inductor vs torchao by hand vs xform, per recipe.

    python bench/quantize.py --model ffn --recipes all [--out DIR]
    python bench/quantize.py --model block --recipes float8-tensorwise,float8-rowwise,float8-dynamic

Models: a llama-style SwiGLU FFN (4096 -> 14336 -> 4096) or a full decoder block (dim 4096,
32 heads, 8 KV heads, hidden 14336), bf16, 8192 tokens a step. Training recipes time a forward +
backward step, inference recipes a forward (prefill) under no_grad. "by hand" is what a user
writes today: torchao's `convert_to_float8_training` / `quantize_` on the model, then
`torch.compile`. "bf16 thunder" is the bf16 model through Lightning Thunder's ThunderFX
(`torch.compile(model, backend=thunder.dynamo.ThunderCompiler())`), "skipped" with the reason where
thunder does not import. `--inductor-option KEY=VALUE` (repeatable) adds an "xform tuned" row per
recipe, compiled with those Inductor options (say `triton.tile_reductions=true`), timed in the
same rounds: one device call tries a config against the default. Each row: median step time
(CUDA events, interleaved rounds), speed-up over bf16, the memory a step needs beyond what is
allocated before it, and the weights' bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (Skipped, cuda_ms, inductor_option, print_table, release_compiled, step_peak_gib,  # noqa: E402
                    say, thunder_compile, write_result)
from models import DecoderLayer, LlamaConfig  # noqa: E402

import xform  # noqa: E402
from xform.transforms.linear_layers import tensor_bytes  # noqa: E402
from xform.transforms import RECIPES, Quantize, QuantizeUnsupported  # noqa: E402

TOKENS, DIM, HIDDEN = 8192, 4096, 14336
TUNED: dict[str, object] = {}  # --inductor-option's, for the "xform tuned" rows


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One llama decoder layer with its rotary tables, taking [1, TOKENS, DIM]."""

    def __init__(self) -> None:
        super().__init__()
        config = LlamaConfig(dim=DIM, heads=32, kv_heads=8, hidden=HIDDEN, max_seq=TOKENS)
        self.layer = DecoderLayer(config)
        head_dim = DIM // 32
        freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(TOKENS).float(), freqs)
        self.register_buffer("cos", angles.cos().bfloat16(), persistent=False)
        self.register_buffer("sin", angles.sin().bfloat16(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, self.cos, self.sin)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return (SwiGLU() if kind == "ffn" else Block()).cuda().bfloat16()


def make_input(kind: str, training: bool) -> torch.Tensor:
    shape = (TOKENS, DIM) if kind == "ffn" else (1, TOKENS, DIM)
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=training)


def by_hand(model: nn.Module, recipe: str, device: str = "cuda") -> nn.Module:
    """What a user writes with torchao directly, for the same recipe and config (as it runs on `device`)."""
    config = Quantize(recipe).check(device).config
    if RECIPES[recipe].swap_module is not None and recipe != "float8-blockwise":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=config)
    else:
        from torchao.quantization import quantize_

        quantize_(model, config)
    return torch.compile(model)


def step(compiled, x: torch.Tensor, training: bool):
    if training:
        def run():
            compiled(x).sum().backward()
    else:
        def run():
            with torch.no_grad():
                compiled(x)
    return run


def compiler(variant: str, recipe: str | None) -> Callable[[nn.Module], Callable]:
    """How one configuration compiles the model; raises Skipped, before any model is built, where its
    peer does not import here."""
    if variant == "bf16 thunder":
        return thunder_compile()
    if recipe is None:
        return torch.compile
    if variant == "torchao by hand":
        return lambda model: by_hand(model, recipe)
    options = TUNED if variant == "xform tuned" else None
    return lambda model: xform.compile(model, f"quantize:{recipe}", inductor_options=options)


def prepare(kind: str, variant: str, recipe: str | None, training: bool) -> tuple[nn.Module, object]:
    """A compiled step for one configuration, already run once (so compiled)."""
    compile_ = compiler(variant, recipe)
    model = make_model(kind)
    run = step(compile_(model), make_input(kind, training), training)
    run()
    return model, run


def measure(kind: str, configs: list[tuple[str, str | None]], training: bool, rounds: int) -> list[dict]:
    """Time the configurations in interleaved rounds (so drift hits all alike), then their peak memory."""
    prepared = {}
    for variant, recipe in tqdm(configs, desc=f"compile {kind}", unit="configuration", disable=None):
        try:
            prepared[(variant, recipe)] = prepare(kind, variant, recipe, training)
        except Exception as error:  # a failing configuration is a finding, a skipped one a fact: no crash
            say(f"{variant} {recipe}: {type(error).__name__}: {error}")
            prepared[(variant, recipe)] = error
    times: dict = {key: [] for key, value in prepared.items() if not isinstance(value, Exception)}
    for _ in range(rounds):
        for key in times:
            times[key].append(cuda_ms(prepared[key][1], warmup=2, iters=10))
    rows = []
    for (variant, recipe), value in prepared.items():
        row = {"model": kind, "recipe": recipe or "bf16", "mode": "train" if training else "infer", "variant": variant}
        if isinstance(value, Skipped):
            row["skipped"] = str(value)
        elif isinstance(value, Exception):
            row["error"] = f"{type(value).__name__}: {str(value)[:300]}"
        else:
            model, run = value
            row.update(ms=round(statistics.median(times[(variant, recipe)]), 3), step_peak_gib=round(step_peak_gib(run), 2),
                       weights_gib=round(sum(tensor_bytes(p) for p in model.parameters()) / 2**30, 3))
        rows.append(row)
        print(row, flush=True)
    prepared.clear()
    release_compiled()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["ffn", "block"], default="ffn")
    parser.add_argument("--recipes", default="all", help="comma-separated recipe names, or 'all'")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inductor-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an Inductor option for the 'xform tuned' rows (the value read as JSON, else a string)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    recipes = list(RECIPES) if args.recipes == "all" else args.recipes.split(",")
    TUNED.update(inductor_option(o) for o in args.inductor_option)

    rows, refused = [], {}
    for mode in ("train", "infer"):
        runnable = []
        for recipe in (r for r in recipes if RECIPES[r].training == (mode == "train")):
            try:
                plan = Quantize(recipe).check("cuda")
            except QuantizeUnsupported as error:
                refused[recipe] = str(error)
                continue
            if plan.emulated:
                refused[recipe] = f"emulated here ({plan.emulated}): not a speed recipe on this GPU"
                continue
            runnable.append(recipe)
        if not runnable:
            continue
        rows += measure(args.model, [("bf16 inductor", None), ("bf16 thunder", None)], mode == "train", args.rounds)
        for recipe in runnable:
            variants = ["torchao by hand", "xform"] + (["xform tuned"] if TUNED else [])
            rows += measure(args.model, [(v, recipe) for v in variants], mode == "train", args.rounds)
            write_result(f"quantize_{args.model}", rows, args.out, refused=refused, tuned=TUNED or None, partial=True)
    baselines = {r["mode"]: r for r in rows if r["variant"] == "bf16 inductor"}
    for row in rows:
        if "ms" in row:
            row["speedup_vs_bf16"] = round(baselines[row["mode"]]["ms"] / row["ms"], 3)
    for row in rows:
        hand = next((r for r in rows if r["recipe"] == row["recipe"] and r["variant"] == "torchao by hand"), None)
        if row["variant"] in ("xform", "xform tuned") and hand and "ms" in hand and "ms" in row:
            row["xform_vs_by_hand"] = round(hand["ms"] / row["ms"], 3)
    print_table(rows, ["model", "mode", "recipe", "variant", "ms", "speedup_vs_bf16", "xform_vs_by_hand",
                       "step_peak_gib", "weights_gib", "error", "skipped"])
    for recipe, why in refused.items():
        print(f"not run: {recipe}: {why}")
    print("results:", write_result(f"quantize_{args.model}", rows, args.out, refused=refused, tuned=TUNED or None))


if __name__ == "__main__":
    main()
