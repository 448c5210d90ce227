"""Where a quantized step's GPU time goes: GEMMs, Triton kernels (Inductor's casts and fusions),
everything else; ms a step, from `torch.profiler`, per configuration of bench/quantize.py.

    python bench/kernel_split.py --model ffn --configs "bf16 inductor:,xform:float8-tensorwise,xform:float8-rowwise"

A configuration is `variant:recipe` as bench/quantize.py names them (`torchao by hand`, `xform`,
`xform tuned` with `--inductor-option`; no recipe for the bf16 variants). Each is prepared (compiled
and run once), warmed up 3 steps, then profiled over `--steps` steps; a kernel is a GEMM when its
name says so (cuBLAS's nvjet and gemm kernels, CUTLASS), Triton when Inductor generated it. Each row
also has the GPU's span a step, the idle time within it and the median gap between kernels.
`--top N` also lists each configuration's N costliest kernels (ms a step, calls a step), the ones
worth tuning.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import inductor_option, print_table, release_compiled, say, write_result  # noqa: E402

GEMM_MARKS = ("nvjet", "gemm", "cutlass", "sm90_xmma")


def kind(kernel: str) -> str:
    if any(mark in kernel.lower() for mark in GEMM_MARKS):
        return "gemm"
    return "triton" if kernel.startswith("triton") else "other"


def split(run, steps: int, top: int = 0) -> dict[str, Any]:
    """ms a step of each kind of kernel, over `steps` profiled steps (and the `top` costliest kernels)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {**summarize([(e.name, e.device_time_total) for e in launches], steps, top),
            **timeline([(e.time_range.start, e.time_range.end) for e in launches], steps)}


def timeline(intervals: Sequence[tuple[float, float]], steps: int) -> dict[str, float]:
    """From (start, end) us of every launch over `steps` steps: the GPU's span a step (first start to
    last end), the idle time a step within it (no kernel running), and the median gap between one
    kernel's end and the next one's start, in us. Kernels alike, a GPU that idles more between them
    (launch gaps in a CUDA graph, a wait on the host) takes longer a step."""
    ordered = sorted(intervals)
    busy_until, idle, gaps = ordered[0][1], 0.0, []
    for start, end in ordered[1:]:
        gaps.append(max(start - busy_until, 0.0))
        idle += gaps[-1]
        busy_until = max(busy_until, end)
    span = busy_until - ordered[0][0]
    return {"span ms": round(span / 1000 / steps, 3), "idle ms": round(idle / 1000 / steps, 3),
            "median gap us": round(statistics.median(gaps), 3) if gaps else 0.0}


def summarize(kernels: Sequence[tuple[str, float]], steps: int, top: int = 0) -> dict[str, Any]:
    """From (kernel name, CUDA us) of every launch over `steps` steps: ms a step per kind, and under
    "top" the `top` kernels with the most time, each with its ms and launches a step."""
    totals = {"gemm": 0.0, "triton": 0.0, "other": 0.0}
    per_kernel: dict[str, list[float]] = {}
    for name, us in kernels:
        totals[kind(name)] += us / 1000
        time_and_calls = per_kernel.setdefault(name, [0.0, 0])
        time_and_calls[0] += us / 1000
        time_and_calls[1] += 1
    result: dict[str, Any] = {f"{k} ms": round(v / steps, 3) for k, v in totals.items()}
    if top:
        costliest = sorted(per_kernel.items(), key=lambda item: -item[1][0])[:top]
        result["top"] = [{"kernel": name, "ms": round(ms / steps, 3), "calls": calls / steps}
                         for name, (ms, calls) in costliest]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["ffn", "block"], default="ffn")
    parser.add_argument("--configs", default="bf16 inductor:,xform:float8-tensorwise,xform:float8-rowwise")
    parser.add_argument("--inductor-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=0, help="also list each configuration's N costliest kernels")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import quantize  # here, not at the top: its `models` is bench's, which a test process may hold as tests'

    quantize.TUNED.update(inductor_option(o) for o in args.inductor_option)
    rows = []
    for config in tqdm(args.configs.split(","), desc="kernel split", unit="configuration", disable=None):
        variant, _, recipe = config.partition(":")
        training = recipe == "" or quantize.RECIPES[recipe].training
        model, run = quantize.prepare(args.model, variant, recipe or None, training)
        rows.append({"model": args.model, "variant": variant, "recipe": recipe or "bf16",
                     **split(run, args.steps, args.top)})
        for entry in rows[-1].get("top", []):
            say(f"  {entry['ms']:8.3f} ms  {entry['calls']:5g} calls  {entry['kernel'][:150]}")
        say(str({k: v for k, v in rows[-1].items() if k != "top"}))
        del model, run
        release_compiled()
    print_table(rows, [column for column in rows[0] if column != "top"])
    print("results:", write_result(f"kernel_split_{args.model}", rows, args.out, tuned=quantize.TUNED or None))


if __name__ == "__main__":
    main()
