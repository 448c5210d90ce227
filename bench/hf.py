"""Hugging Face `generate()` with the static cache, as users call it: xform against eager, Inductor,
`mode="reduce-overhead"` (Hugging Face's default when it compiles) and torchao by hand.

A Llama of 16 layers, dim 2048, 32 query / 8 KV heads, FFN 8192, vocabulary 128256, random weights
in bf16 (built from its config: nothing is downloaded); a 64-token prompt, 128 new tokens (no early
stop), greedy. Each configuration runs in a process of its own: two untimed `generate()` calls (the
first compiles), then the median of `--repeats` timed ones; tokens/s counts new tokens over the
whole call (prefill included), and peak reserved memory covers the timed calls.

Configurations (`--only` takes a comma-separated list of them, or of batch sizes like `:8`):
  eager                      no compile (`generation_config.disable_compile`)
  inductor                   CompileConfig(backend="inductor", mode="default")
  reduce-overhead            CompileConfig(backend="inductor", mode="reduce-overhead")
  torchao-float8-ro          torchao's float8 weight-only by hand (`quantize_`), then reduce-overhead
  xform                      CompileConfig(backend="xform", options={"transforms": ["cudagraphs"]})
  xform-float8               ["quantize:float8-weight-only", "cudagraphs"]
  xform-nvfp4                ["quantize:nvfp4-weight-only", "cudagraphs"]
  xform-flex                 ["flex-attention", "cudagraphs"]

    python bench/hf.py [--out DIR] [--only xform,reduce-overhead] [--batches 1,8]   # needs a CUDA GPU
    python bench/hf.py --one xform:1                                                 # one, prints its JSON
    python bench/hf.py --size tiny --only eager,xform --batches 1 --repeats 1        # a check, on the CPU too
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_result  # noqa: E402

TRANSFORMS = {"xform": ["cudagraphs"], "xform-float8": ["quantize:float8-weight-only", "cudagraphs"],
              "xform-nvfp4": ["quantize:nvfp4-weight-only", "cudagraphs"], "xform-flex": ["flex-attention", "cudagraphs"]}
CONFIGS = ("eager", "inductor", "reduce-overhead", "torchao-float8-ro", *TRANSFORMS)
PROMPT, NEW_TOKENS = 64, 128


SIZES = {"bench": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                   "num_attention_heads": 32, "num_key_value_heads": 8},
         # a check that every configuration runs (on the CPU too), not a figure
         "tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2}}


def llama(size: str, device: str) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(**SIZES[size], max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _register_xform() -> None:
    """`backend="xform"` where xform is on the path but not installed (its entry point unread)."""
    import xform.backend

    if "xform" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(xform.backend.xform_backend, name="xform")


def compile_config(config: str) -> Any:
    from transformers import CompileConfig

    if config in TRANSFORMS:
        _register_xform()
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


def generate_run(config: str, batch: int, repeats: int, size: str = "bench") -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = llama(size, device)
    if config == "eager":
        model.generation_config.disable_compile = True
    if config == "torchao-float8-ro":
        from torchao.quantization import Float8WeightOnlyConfig, quantize_

        quantize_(model, Float8WeightOnlyConfig())
    kwargs: dict[str, Any] = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False,
                              "cache_implementation": "static"}
    if config != "eager":
        kwargs["compile_config"] = compile_config("reduce-overhead" if config == "torchao-float8-ro" else config)
        kwargs["compile_config"]._compile_all_devices = device == "cpu"  # generate() compiles on CUDA only otherwise
    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, **kwargs)  # compiles
        sync()
        first = time.perf_counter() - start
        model.generate(ids, **kwargs)  # records, where graphs are recorded on a later call
        sync()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            sync()
            times.append(time.perf_counter() - start)
    assert out.shape == (batch, PROMPT + NEW_TOKENS), out.shape
    seconds = statistics.median(times)
    row = {"config": config, "batch": batch, "s_per_generate": round(seconds, 4),
           "tokens_per_s": round(batch * NEW_TOKENS / seconds, 1), "first_generate_s": round(first, 1),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3) if device == "cuda" else None,
           "runs_s": [round(t, 4) for t in times]}
    return {**row, "xform": xform_summary(model)} if config in TRANSFORMS else row


def run_spec(spec: str, repeats: int, size: str) -> dict[str, Any]:
    """One configuration in a process of its own: its JSON row, or the end of its stderr."""
    done = subprocess.run([sys.executable, __file__, "--one", spec, "--repeats", str(repeats), "--size", size],
                          capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")), None)
    row = json.loads(line) if line and done.returncode == 0 else {"spec": spec, "error": done.stderr[-3000:]}
    print(json.dumps(row)[:600], flush=True)
    return row


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help="config:batch, run in this process, print its JSON")
    parser.add_argument("--only", help="configurations to run, comma-separated (default all)")
    parser.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate() calls (default 3)")
    parser.add_argument("--out", type=Path, help="directory for the JSON result (default bench/results)")
    parser.add_argument("--size", choices=SIZES, default="bench",
                        help="the model: bench (default), or tiny, a check that each configuration runs (CPU too)")
    args = parser.parse_args()
    if args.one:
        config, batch = args.one.rsplit(":", 1)
        print(json.dumps(generate_run(config, int(batch), args.repeats, args.size)))
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
            rows.append(run_spec(f"{config}:{batch}", args.repeats, args.size))
            write_result("hf_generate", rows, args.out, summary=summarize([r for r in rows if "batch" in r]))
    print_table(summarize([r for r in rows if "batch" in r]), ["batch", "config", "s", "tokens/s", "/ reduce-overhead",
                                                               "peak GiB", "first s"])


if __name__ == "__main__":
    main()
