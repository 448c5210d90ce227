"""Hugging Face `generate()` with the static cache, as users call it: xform against eager, Inductor,
`mode="reduce-overhead"` (Hugging Face's default when it compiles) and torchao by hand.

A Llama of 16 layers, dim 2048, 32 query / 8 KV heads, FFN 8192, vocabulary 128256, random weights
in bf16 (built from its config: nothing is downloaded); `--model sliding`: a Mistral of the same
widths with a sliding window of 128, shorter than the 192 tokens generated, so its cache rolls (its
length is a Python int Dynamo makes dynamic). A 64-token prompt, 128 new tokens (no early stop),
greedy. Each configuration runs in a process of its own: two untimed `generate()` calls (the
first compiles), then the median of `--repeats` timed ones; tokens/s counts new tokens over the
whole call (prefill included), and peak reserved memory covers the timed calls.

Configurations (`--only` takes a comma-separated list of them, or of batch sizes like `:8`):
  eager                      no compile (`generation_config.disable_compile`)
  inductor                   CompileConfig(backend="inductor", mode="default")
  reduce-overhead            CompileConfig(backend="inductor", mode="reduce-overhead")
  torchao-float8-ro          torchao's float8 weight-only by hand (`quantize_`), then reduce-overhead
  torchao-float8-dynamic-ro  torchao's float8 activations and weights by hand, then reduce-overhead
  xform                      CompileConfig(backend="xform", options={"transforms": ["cudagraphs"]})
  xform-float8               ["quantize:float8-weight-only", "cudagraphs"]
  xform-float8-dynamic       ["quantize:float8-dynamic", "cudagraphs"]: float8 weights and activations
  xform-nvfp4                ["quantize:nvfp4-weight-only", "cudagraphs"]
  xform-flex                 ["flex-attention", "cudagraphs"]

    python bench/hf.py [--out DIR] [--only xform,reduce-overhead] [--batches 1,8]   # needs a CUDA GPU
    python bench/hf.py --one xform:1                                                 # one, prints its JSON
    python bench/hf.py --size tiny --only eager,xform --batches 1 --repeats 1        # a check, on the CPU too
    python bench/hf.py --model sliding --only reduce-overhead,xform                  # the sliding-window cache
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import first_then_timed, print_table, run_in_process, write_result  # noqa: E402

TRANSFORMS = {"xform": ["cudagraphs"], "xform-float8": ["quantize:float8-weight-only", "cudagraphs"],
              "xform-float8-dynamic": ["quantize:float8-dynamic", "cudagraphs"],
              "xform-nvfp4": ["quantize:nvfp4-weight-only", "cudagraphs"], "xform-flex": ["flex-attention", "cudagraphs"]}
BY_HAND = {"torchao-float8-ro": "float8-weight-only", "torchao-float8-dynamic-ro": "float8-dynamic"}  # xform's recipe names
CONFIGS = ("eager", "inductor", "reduce-overhead", *BY_HAND, *TRANSFORMS)
PROMPT, NEW_TOKENS = 64, 128


SIZES = {"bench": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                   "num_attention_heads": 32, "num_key_value_heads": 8},
         # a check that every configuration runs (on the CPU too), not a figure
         "tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2}}


MODELS = ("llama", "sliding")
WINDOW = 128  # the sliding model's window: the cache rolls over after 128 of the 192 tokens


def decoder(model: str, size: str, device: str) -> torch.nn.Module:
    import transformers

    common = {**SIZES[size], "max_position_embeddings": 4096, "attn_implementation": "sdpa"}
    if model == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.MistralConfig(**common, sliding_window=WINDOW), transformers.MistralForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        return cls(config).to(torch.bfloat16).eval()


def register_xform() -> None:
    """`backend="xform"` where xform is on the path but not installed (its entry point unread)."""
    import xform.backend

    if "xform" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(xform.backend.xform_backend, name="xform")


def compile_config(config: str) -> Any:
    from transformers import CompileConfig

    if config in TRANSFORMS:
        register_xform()
        return CompileConfig(backend="xform", mode=None, options={"transforms": TRANSFORMS[config]})
    return CompileConfig(backend="inductor", mode="default" if config == "inductor" else "reduce-overhead")


def xform_summary(model: torch.nn.Module) -> dict[str, Any]:
    """What the report says, in numbers: graphs, changes and skips per transform, failures."""
    import xform

    report = xform.report(model)
    names = sorted({t.transform for g in report.graphs for t in g.transforms})
    return {"graphs": len(report.graphs), "failures": [f"{n}: {why[:200]}" for n, why in report.failures()],
            **{f"{n} changes": len(report.changes(n)) for n in names},
            **{f"{n} skips": sorted({s.reason[:160] for s in report.skips(n)}) for n in names}}


def generate_run(config: str, batch: int, repeats: int, size: str = "bench", model_name: str = "llama") -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = decoder(model_name, size, device)
    if config == "eager":
        model.generation_config.disable_compile = True
    if config in BY_HAND:  # the recipe's torchao config, as xform builds it, setting Inductor's flags as by default
        from torchao.quantization import quantize_

        from xform.transforms import Quantize

        quantize_(model, dataclasses.replace(Quantize(BY_HAND[config]).check(device).config, set_inductor_config=True))
    kwargs: dict[str, Any] = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False,
                              "cache_implementation": "static"}
    if config != "eager":
        kwargs["compile_config"] = compile_config("reduce-overhead" if config in BY_HAND else config)
        kwargs["compile_config"]._compile_all_devices = device == "cpu"  # generate() compiles on CUDA only otherwise
    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device=device)
    with torch.no_grad():
        first, times, out = first_then_timed(lambda: model.generate(ids, **kwargs), 1, repeats)
    assert out.shape == (batch, PROMPT + NEW_TOKENS), out.shape
    seconds = statistics.median(times)
    row = {"model": model_name, "config": config, "batch": batch, "s_per_generate": round(seconds, 4),
           "tokens_per_s": round(batch * NEW_TOKENS / seconds, 1), "first_generate_s": round(first, 1),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3) if device == "cuda" else None,
           "runs_s": [round(t, 4) for t in times]}
    return {**row, "xform": xform_summary(model)} if config in TRANSFORMS else row


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch: each configuration's seconds a generate() and its ratio to reduce-overhead's."""
    table = []
    for batch in sorted({r["batch"] for r in rows if "batch" in r}):
        here = {r["config"]: r for r in rows if r.get("batch") == batch}
        base = here.get("reduce-overhead", {}).get("s_per_generate")
        for config, row in here.items():
            table.append({"batch": batch, "config": config, "s": row["s_per_generate"], "tokens/s": row["tokens_per_s"],
                          "/ reduce-overhead": round(row["s_per_generate"] / base, 3) if base else None,
                          "peak GiB": row["peak_reserved_gib"], "first s": row["first_generate_s"]})
    return table


def arguments(doc: str, one: str, only: str, repeats: int, timed: str) -> argparse.ArgumentParser:
    """The command line bench/hf.py and bench/hf_train.py share: --one (a configuration in this
    process), --only, --repeats, --out and --size."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help=f"{one}, run in this process, print its JSON")
    parser.add_argument("--only", help=f"{only} to run, comma-separated (default all)")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"timed {timed} (default {repeats})")
    parser.add_argument("--out", type=Path, help="directory for the JSON result (default bench/results)")
    parser.add_argument("--size", choices=SIZES, default="bench",
                        help="the model: bench (default), or tiny, a check that each configuration runs (CPU too)")
    return parser


def main() -> None:
    parser = arguments(__doc__, "config:batch", "configurations", 3, "generate() calls")
    parser.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    parser.add_argument("--model", choices=MODELS, default="llama", help="llama (default), or sliding (a Mistral)")
    args = parser.parse_args()
    if args.one:
        config, batch = args.one.rsplit(":", 1)
        print(json.dumps(generate_run(config, int(batch), args.repeats, args.size, args.model)))
        return
    if not torch.cuda.is_available() and args.size == "bench":
        sys.exit("bench/hf.py needs a CUDA GPU (--size tiny runs on the CPU)")
    configs = args.only.split(",") if args.only else list(CONFIGS)
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        sys.exit(f"unknown configuration(s) {unknown}; accepted: {', '.join(CONFIGS)}")
    rows: list[dict[str, Any]] = []
    for batch in (int(b) for b in args.batches.split(",")):
        for config in configs:
            rows.append(run_in_process(__file__, f"{config}:{batch}", "--repeats", str(args.repeats),
                                       "--size", args.size, "--model", args.model))
            write_result("hf_generate" if args.model == "llama" else f"hf_generate_{args.model}", rows, args.out,
                         summary=summarize([r for r in rows if "batch" in r]))
    print_table(summarize([r for r in rows if "batch" in r]), ["batch", "config", "s", "tokens/s", "/ reduce-overhead",
                                                               "peak GiB", "first s"])


if __name__ == "__main__":
    main()
