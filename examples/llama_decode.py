"""Greedy decoding from a small llama with a static KV cache: quantized weights, flex-attention, CUDA graphs.

    python examples/llama_decode.py                         # CPU (the GPU when there is one), seconds
    python examples/llama_decode.py --recipe nvfp4-weight-only --dim 1024 --layers 8 --new 256
    python -m xform explain examples/llama_decode.py:make_model

The model is examples/llama.py's `DecodeLlama` (the benchmarks' decode llama too: one token a step, its
KV cache held in buffers written in place, attention through SDPA over the whole cache with a
mask of the positions written so far), compiled with `quantize:float8-weight-only` (or
`--recipe nvfp4-weight-only`), `flex-attention` and `cudagraphs`. Every step has the same shapes
(the position is a tensor), so one compile serves the prompt and every new token. The prompt is
fed one token a step too; tokens/s counts the new tokens only, after the first step (which
compiles). On a CPU, cudagraphs says there is no CUDA device; on a GPU it records the step, and
flex-attention leaves the attention as written, saying why: its mask reads the position, a
tensor, and in a graph with no backward Inductor's CUDA flex lowering frees such data before
the kernel reads it (pytorch#181800). On the H200 (torch 2.11) the defaults ran at 2,800 tokens/s
after a 42 s compile.
The weights are random, so the text is not meant to be read: the report is.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

import xform
from llama import DecodeLlama, LlamaConfig  # examples/llama.py, beside this script

RECIPES = ("float8-weight-only", "nvfp4-weight-only")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens (random)")
    parser.add_argument("--new", type=int, default=24, help="tokens to generate")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128, help="SwiGLU width (nvfp4 needs a multiple of 16)")
    parser.add_argument("--recipe", choices=RECIPES, default=RECIPES[0])
    parser.add_argument("--handoff", choices=("inductor", "eager"), default="inductor")
    return parser.parse_args(argv)


def config_of(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.heads,
                       hidden=args.hidden, max_seq=args.prompt + args.new)


def make_model() -> tuple[DecodeLlama, tuple[torch.Tensor, torch.Tensor]]:
    """The default model and one step's inputs, for `python -m xform explain examples/llama_decode.py:make_model`."""
    args = parse_args([])
    model = DecodeLlama(config_of(args), args.batch).eval()
    return model, (torch.zeros(args.batch, 1, dtype=torch.long), torch.tensor([0]))


@dataclass
class Decoded:
    report: xform.Report
    tokens: torch.Tensor  # [batch, prompt + new]
    device: torch.device
    first_s: float  # the first step, which compiles
    tokens_per_s: float  # new tokens over the whole batch, after the first step


def decode(args: argparse.Namespace) -> Decoded:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = DecodeLlama(config_of(args), args.batch).to(device, dtype).eval()
    step = xform.compile(model, f"quantize:{args.recipe}", "flex-attention", "cudagraphs", handoff=args.handoff)
    total = args.prompt + args.new
    tokens = torch.zeros(args.batch, total, dtype=torch.long, device=device)  # one buffer: steps see one stride
    tokens[:, :args.prompt] = torch.randint(0, args.vocab, (args.batch, args.prompt))
    bar = tqdm(total=total - 1, desc="decode", unit="step", disable=None)
    bar.set_postfix_str("the first step compiles")
    first_s = 0.0
    with torch.inference_mode():
        start = time.perf_counter()
        for pos in range(total - 1):
            logits = step(tokens[:, pos:pos + 1], torch.tensor([pos], device=device))
            if pos == 0:
                first_s = time.perf_counter() - start
                bar.set_postfix_str(f"compiled in {first_s:.1f} s")
            if pos + 1 == args.prompt:  # the prompt is in the cache: time the new tokens from here
                start = time.perf_counter()
            if pos + 1 >= args.prompt:
                tokens[:, pos + 1] = logits[:, -1].argmax(-1)
            bar.update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    bar.close()
    new_timed = args.new - (1 if args.prompt == 1 else 0)  # the first step compiles: not timed
    return Decoded(xform.report(step), tokens, device, first_s, args.batch * new_timed / max(elapsed, 1e-9))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    decoded = decode(args)
    print(decoded.report)
    print()
    for row in decoded.tokens.tolist():
        print(f"tokens: {row[:args.prompt]} -> {row[args.prompt:]}")
    print(f"{args.new} new tokens x {args.batch} sequences on {decoded.device}, {args.recipe}: "
          f"{decoded.tokens_per_s:,.1f} tokens/s; first step (compile) {decoded.first_s:.1f} s")


if __name__ == "__main__":
    main()
