"""A Hugging Face training step, as users write it: xform against Inductor and torchao by hand.

Two models, random weights in bf16 (built from their configs: nothing is downloaded), the widths of
bench/hf.py's Llama (dim 2048, 32 query / 8 KV heads, FFN 8192, vocabulary 128256) with `--layers`
decoder layers (default 4: the compile of each configuration stays near a minute):
  llama      LlamaForCausalLM, SDPA attention (causal)
  sliding    MistralForCausalLM with a sliding window of 1024, SDPA attention (HF builds the mask)
One step: `model(input_ids=ids, labels=ids).loss.backward()`, AdamW's step (the optimizer made
before compiling, as training scripts do), `zero_grad`; batch 1, sequence 4096. Each configuration
runs in a process of its own: the first step (it compiles) is timed alone, then the median of
`--repeats` steps after two more (each timed from the host, the GPU synchronized after it), and the
peak allocated memory over those steps. The sliding-window baseline is HF's sdpa with the dense
boolean mask HF builds (no flash kernel takes it): "xform-flex" against it measures the blocks
flex_attention skips.

Configurations (`--only` takes a comma-separated list of model:configuration):
  inductor                 torch.compile(model)
  torchao-float8-rowwise   torchao's convert_to_float8_training, rowwise (by hand), then torch.compile
  xform-float8-rowwise     backend="xform", ["quantize:float8-rowwise"]
  xform-flex               backend="xform", ["flex-attention"]
  xform-flex-float8        backend="xform", ["flex-attention", "quantize:float8-rowwise"]

    python bench/hf_train.py [--out DIR] [--only llama:inductor,sliding:xform-flex]   # needs a CUDA GPU
    python bench/hf_train.py --size tiny --repeats 1                                    # a check, on the CPU too
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import first_then_timed, print_table, run_in_process, write_result  # noqa: E402
from bench.hf import SIZES, arguments, register_xform, xform_summary  # noqa: E402

TRANSFORMS = {"xform-float8-rowwise": ["quantize:float8-rowwise"], "xform-flex": ["flex-attention"],
              "xform-flex-float8": ["flex-attention", "quantize:float8-rowwise"]}
CONFIGS = ("inductor", "torchao-float8-rowwise", *TRANSFORMS)
RUNS = {"llama": ("inductor", "torchao-float8-rowwise", "xform-float8-rowwise"),
        "sliding": ("inductor", "xform-flex", "xform-flex-float8")}
SEQ = {"bench": 4096, "tiny": 64}
WINDOW = {"bench": 1024, "tiny": 16}


def build(model: str, size: str, layers: int, device: str) -> torch.nn.Module:
    import transformers

    widths = {**SIZES[size], "num_hidden_layers": layers if size == "bench" else SIZES[size]["num_hidden_layers"]}
    if model == "llama":
        config = transformers.LlamaConfig(**widths, max_position_embeddings=SEQ[size], attn_implementation="sdpa")
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.MistralConfig(**widths, max_position_embeddings=SEQ[size], sliding_window=WINDOW[size],
                                            attn_implementation="sdpa")
        cls = transformers.MistralForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        return cls(config).to(torch.bfloat16).train()


def compiled(model: torch.nn.Module, config: str, device: str) -> Callable[..., Any]:
    if config in TRANSFORMS:
        register_xform()
        return torch.compile(model, backend="xform", options={"transforms": TRANSFORMS[config]})
    if config == "torchao-float8-rowwise":
        from bench.quantize import by_hand

        return by_hand(model, "float8-rowwise", device)
    return torch.compile(model)


def train_run(model_name: str, config: str, repeats: int, size: str, layers: int) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(model_name, size, layers, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    run = compiled(model, config, device)
    ids = torch.randint(0, model.config.vocab_size, (1, SEQ[size]), device=device)

    def step() -> None:
        run(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    first, seconds, _ = first_then_timed(step, 2, repeats)
    times = [t * 1e3 for t in seconds]
    row = {"model": model_name, "config": config, "ms_per_step": round(statistics.median(times), 2),
           "first_step_s": round(first, 1), "layers": layers if size == "bench" else SIZES[size]["num_hidden_layers"],
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if device == "cuda" else None,
           "runs_ms": [round(t, 2) for t in times]}
    return {**row, "xform": xform_summary(model)} if config in TRANSFORMS else row


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: each configuration's step time and its speed-up over Inductor's."""
    table = []
    for model in dict.fromkeys(r["model"] for r in rows):
        here = {r["config"]: r for r in rows if r["model"] == model}
        base = here.get("inductor", {}).get("ms_per_step")
        for config, row in here.items():
            table.append({"model": model, "config": config, "ms": row["ms_per_step"],
                          "x inductor": round(base / row["ms_per_step"], 3) if base else None,
                          "peak GiB": row["peak_allocated_gib"], "first s": row["first_step_s"]})
    return table


def main() -> None:
    parser = arguments(__doc__, "model:config", "model:config pairs", 10, "steps")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the bench size (default 4)")
    args = parser.parse_args()
    if args.one:
        model, config = args.one.split(":")
        print(json.dumps(train_run(model, config, args.repeats, args.size, args.layers)))
        return
    if not torch.cuda.is_available() and args.size == "bench":
        sys.exit("bench/hf_train.py needs a CUDA GPU (--size tiny runs on the CPU)")
    specs = args.only.split(",") if args.only else [f"{m}:{c}" for m, configs in RUNS.items() for c in configs]
    unknown = [s for s in specs if s.partition(":")[0] not in RUNS or s.partition(":")[2] not in CONFIGS]
    if unknown:
        sys.exit(f"unknown model:configuration {unknown}; models {', '.join(RUNS)}, configurations {', '.join(CONFIGS)}")
    rows: list[dict[str, Any]] = []
    for spec in specs:
        rows.append(run_in_process(__file__, spec, "--repeats", str(args.repeats), "--size", args.size,
                                   "--layers", str(args.layers)))
        write_result("hf_train", rows, args.out, summary=summarize([r for r in rows if "model" in r]))
    print_table(summarize([r for r in rows if "model" in r]), ["model", "config", "ms", "x inductor", "peak GiB",
                                                               "first s"])


if __name__ == "__main__":
    main()
