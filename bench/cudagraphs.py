"""CUDA graphs: xform's `cudagraphs` transform against Inductor without graphs and `mode="reduce-overhead"`.

Every configuration runs in a process of its own (memory peaks and graph pools do not mix), one
after another on the same GPU (memory runs several at a time with `--jobs`):

- decode: the llama-style decoder (16 layers, dim 2048, static KV cache of 1024, bf16), one token
  a step, batch 1 and 8, as written (`plain`), with a host sync (`.item()`) in every layer
  (`sync`), and with its weights passed as plain tensor arguments (`weights`: called through
  `torch.func.functional_call`, `bench/models.py::WeightsAsInputs`); ms a step.
  Also xform with `CudaGraphs(stale_outputs="error")` (`xform-error`: the logits held through the
  next call are invalidated, as reduce-overhead does, not copied out). Peers here also: Lightning
  Thunder's ThunderFX (`thunder`) and ThunderFX with Thunder's own CUDA graphs
  (`thunder-cudagraphs`), "skipped" with the reason where thunder does not import.
- memory: peak reserved GPU memory over the same run without CUDA graphs, where graph pools cost.
  Training (8 layers, fwd + bwd + AdamW, 8 steps): `train` (4 x 512 tokens, one graph),
  `train-breaks` (the same with a graph break after every layer, `Llama(graph_breaks=True)`) and
  `train-breaks-big` (the same at 8 x 1024 tokens: four times the activations). Inference at
  several batch sizes, each its own static graph (`dynamic=False`), as servers record them, 4
  rounds: `buckets` (8 layers, batch 1, 2, 4, 8 x 256 tokens) and `buckets-big` (16 layers, batch
  1, 2, 4, 8, 16, 32 x 512 tokens), and both with the weights passed as arguments
  (`buckets-weights`, `buckets-big-weights`), which CUDA Graph Trees copy into their pool.

    python bench/cudagraphs.py [--out DIR] [--only decode]   # all of it, or part (needs a CUDA GPU)
    python bench/cudagraphs.py --only memory --jobs 6        # memory runs 6 processes at a time
    python bench/cudagraphs.py --only memory:train --where   # also what was allocated at each peak
    python bench/cudagraphs.py --only sync:1:xform,sync:1:reduce  # those configurations
    python bench/cudagraphs.py --one decode:sync:1:xform     # one configuration, prints its JSON
    python bench/cudagraphs.py --only decode:plain:8 --processes 5  # 5 processes each, alternating
    python bench/cudagraphs.py --only decode:plain:1 --kernels  # also each one's device time a step

`--jobs` overlaps only memory runs (a peak is per process, so it does not mix; their seconds do);
decode runs, which are timed, always run alone. `--processes N` runs each timed configuration in N
processes, the configurations alternating, and reports the median over processes with the
range. Before the timed processes, each decode configuration runs once untimed, to fill
Inductor's and Triton's caches: a process that compiles its kernels itself (a cold cache) steps
about 6% faster than one that loads them from the cache, with the same kernels, whichever the
configuration (H100, 2026-12-06: the gaps between kernels in the graph, 0.1 against 0.45 us), so
the first process on a fresh machine would otherwise win.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Skipped, print_table, run_in_process, thunder_compile, write_result  # noqa: E402
from bench.kernel_split import split  # noqa: E402
from bench.memory_peak import PeakTracer  # noqa: E402
from bench.models import DecodeLlama, Llama, LlamaConfig, WeightsAsInputs, plain_weights  # noqa: E402

CONFIGS = ("inductor", "reduce-overhead", "xform")
# decode only: xform with CudaGraphs(stale_outputs="error"), CUDA Graph Trees' contract for an output
# held through the next call (the logits); ThunderFX, plain and with Thunder's CUDA graphs
XFORM_ERROR = "xform-error"
PEERS = ("thunder", "thunder-cudagraphs")
DECODE_CONFIGS = CONFIGS + (XFORM_ERROR,) + PEERS
DECODE = [f"decode:{v}:{b}:{c}" for v in ("plain", "sync", "weights") for b in (1, 8) for c in DECODE_CONFIGS]
TRAIN = {"train": (LlamaConfig(layers=8, max_seq=512), False, (4, 512)),
         "train-breaks": (LlamaConfig(layers=8, max_seq=512), True, (4, 512)),
         "train-breaks-big": (LlamaConfig(layers=8, max_seq=1024), True, (8, 1024))}
# (model, batch sizes, tokens, weights passed as arguments)
BUCKETS = {"buckets": (LlamaConfig(layers=8, max_seq=256), (1, 2, 4, 8), 256, False),
           "buckets-big": (LlamaConfig(layers=16, max_seq=512), (1, 2, 4, 8, 16, 32), 512, False),
           "buckets-weights": (LlamaConfig(layers=8, max_seq=256), (1, 2, 4, 8), 256, True),
           "buckets-big-weights": (LlamaConfig(layers=16, max_seq=512), (1, 2, 4, 8, 16, 32), 512, True)}
# the longest to compile first, so that overlapping runs (--jobs) end together
MEMORY = [f"memory:{w}:{c}" for w in ("buckets-big-weights", "buckets-big", "train", "train-breaks-big",
                                      "train-breaks", "buckets-weights", "buckets") for c in CONFIGS]


KERNELS_ENV = "XFORM_BENCH_KERNELS"  # set by --kernels for the processes it starts
PRIME_ENV = "XFORM_BENCH_PRIME"  # a decode process that compiles, runs 5 steps and stops
WHERE_ENV = "XFORM_BENCH_WHERE"  # set by --where: memory runs say what was allocated at their peak
TRANSFORMS: list[Any] = []  # the xform configuration's transform, for its replay statistics


def compiler(config: str, dynamic: bool | None = None) -> Callable[[torch.nn.Module], Callable[..., Any]]:
    """How a configuration compiles a model; for a peer that does not import here it raises Skipped
    at once, before a model is built."""
    if config in PEERS:
        return thunder_compile(cudagraphs=config == "thunder-cudagraphs")
    if config == "inductor":
        return lambda model: torch.compile(model, dynamic=dynamic)
    if config == "reduce-overhead":
        return lambda model: torch.compile(model, mode="reduce-overhead", dynamic=dynamic)
    import xform
    from xform.transforms import CudaGraphs

    TRANSFORMS.append(CudaGraphs(stale_outputs="error" if config == XFORM_ERROR else "copy"))
    return lambda model: torch.compile(model, backend=xform.Backend(TRANSFORMS), dynamic=dynamic)


def replay_stats() -> dict[str, int]:
    """Totals over xform's recorded functions: what was recorded, replayed and run uncaptured."""
    functions = [f for t in TRANSFORMS for f in t.functions]
    return {"functions": len(functions), "recordings": sum(f.stats.recordings for f in functions),
            "replays": sum(f.stats.replays for f in functions),
            "uncaptured_calls": sum(f.stats.uncaptured_calls for f in functions),
            "fallbacks": sum(f.stats.fallback is not None for f in functions),
            "moved_mib": round(sum(f.stats.moved_bytes for f in functions) / 2**20, 1),
            "invalidated": sum(f.stats.invalidated for f in functions),
            "copied_in_mib": round(sum(f.stats.copied_in_bytes for f in functions) / 2**20, 1)}


def decode(variant: str, batch: int, config: str, steps: int = 200, repeats: int = 5) -> dict[str, Any]:
    compile_ = compiler(config)
    torch.manual_seed(0)
    model = DecodeLlama(LlamaConfig(), batch, host_sync=variant == "sync").to("cuda", torch.bfloat16).eval()
    # weights that need no gradient: ThunderFX reads requires_grad from the graph's inputs, not the
    # no_grad below, and traced a forward for backward (its CUDA graphs then failed, and its SDPA
    # executor at batch 8, on the H100 2026-12-05); the other configurations do the same either way
    model.requires_grad_(False)
    step = compile_(model) if variant != "weights" else with_weights(compile_, model)
    tokens = torch.randint(32000, (batch, 1), device="cuda")
    positions = torch.arange(1024, device="cuda")

    def run(count: int, first: int = 5) -> None:
        """`count` steps from position `first`, each fed the last one's token (the logits held
        through the next call, as a generation loop holds them)."""
        nonlocal tokens
        for i in range(count):
            logits = step(tokens, positions[first + i:first + i + 1])
            tokens = logits[:, -1].argmax(-1, keepdim=True)

    times = []
    with torch.no_grad():
        run(5, first=0)
        if os.environ.get(PRIME_ENV):
            return {"primed": True}
        for _ in range(repeats):  # the median of several runs of `steps` steps, positions 5.. each time
            torch.cuda.synchronize()
            start = time.perf_counter()
            run(steps)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3 / steps)
        # ms a step of GEMMs, Triton kernels and the rest (copies too), the costliest kernels, and
        # the GPU's span and idle time a step
        kernels = split(lambda: run(1), steps=20, top=6) if os.environ.get(KERNELS_ENV) else {}
    return {"ms_per_step": round(statistics.median(times), 3), "runs_ms": [round(t, 3) for t in times],
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3), **kernels}


def with_weights(compile_: Callable[[torch.nn.Module], Callable[..., Any]],
                 model: torch.nn.Module) -> Callable[..., Any]:
    """`model` compiled with its parameters passed in as plain tensors (`WeightsAsInputs`), called
    as `model` is."""
    step, weights = compile_(WeightsAsInputs(model)), plain_weights(model)
    return lambda *args: step(weights, *args)


def training_calls(workload: str, config: str) -> list[Callable[[], None]]:
    """Eight training steps of a TRAIN workload: compiled forward and backward, eager loss and AdamW."""
    c, graph_breaks, (batch, seq) = TRAIN[workload]
    model = Llama(c, graph_breaks=graph_breaks).to("cuda", torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step = compiler(config)(model)
    tokens = torch.randint(c.vocab, (batch, seq), device="cuda")

    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        step(tokens).float().square().mean().backward()
        optimizer.step()

    return [run] * 8


def bucket_calls(workload: str, config: str) -> list[Callable[[], None]]:
    """Four rounds of inference at each batch size of a BUCKETS workload."""
    c, batches, seq, weights_passed = BUCKETS[workload]
    model = Llama(c).to("cuda", torch.bfloat16).eval()
    compile_ = compiler(config, dynamic=False)  # one static graph per batch size, as servers record
    step = with_weights(compile_, model) if weights_passed else compile_(model)
    inputs = [torch.randint(c.vocab, (b, seq), device="cuda") for b in batches]

    def infer(tokens: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                step(tokens)
        return run

    return [infer(t) for t in inputs] * 4


def memory(workload: str, config: str) -> dict[str, Any]:
    torch.manual_seed(0)
    calls = training_calls(workload, config) if workload in TRAIN else bucket_calls(workload, config)
    tracer = PeakTracer() if os.environ.get(WHERE_ENV) else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    with tracer or contextlib.nullcontext():
        for call in calls:
            call()
        torch.cuda.synchronize()
    return {"seconds": round(time.perf_counter() - start, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            **({"at_peak": tracer.at_peak} if tracer else {})}


def run_one(spec: str) -> dict[str, Any]:
    kind, *rest = spec.split(":")
    try:
        if kind == "decode":
            variant, batch, config = rest
            result = decode(variant, int(batch), config)
        else:
            workload, config = rest
            result = memory(workload, config)
    except Skipped as skipped:
        return {"spec": spec, "skipped": str(skipped)}
    return {"spec": spec, **result, **({"xform": replay_stats()} if TRANSFORMS else {})}


def run_all(specs: list[str], jobs: int, save: Callable[[list[dict[str, Any]]], Any],
            processes: int = 1) -> list[dict[str, Any]]:
    """Memory runs `jobs` at a time (each process's Inductor gets its share of the CPUs), then
    the timed runs one by one, `processes` rounds of them, after one untimed process per decode
    configuration that fills the compile caches; `save` gets the rows so far after each one, so
    that a run ended early (a time limit) keeps what it measured."""
    overlapping = [s for s in specs if s.startswith("memory") and jobs > 1]
    timed = [s for s in specs if s not in overlapping]
    primed = [s for s in timed if s.startswith("decode")]
    env = {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(overlapping) + len(primed) + processes * len(timed), desc="cudagraphs", unit="process",
              disable=None) as bar:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for row in pool.map(lambda spec: run_in_process(__file__, spec, env=env), overlapping):
                rows.append(row)
                save(rows)
                bar.update()
        for spec in primed:  # fill Inductor's and Triton's caches: every timed process then loads from them
            run_in_process(__file__, spec, env={PRIME_ENV: "1"})
            bar.update()
        for _ in range(processes):
            for spec in timed:
                rows.append(run_in_process(__file__, spec))
                save(rows)
                bar.update()
    return rows


def selected(wanted: list[str] | None) -> list[str]:
    """The configurations `--only` names: those containing one of `wanted`, but a full name selects
    that configuration alone (decode:plain:1:xform, not also decode:plain:1:xform-error)."""
    every = DECODE + MEMORY
    return [s for s in every if wanted is None or any(w == s or (w not in every and w in s) for w in wanted)]


def unmeasured(row: dict[str, Any]) -> str | None:
    """What a configuration without a figure shows in the summary: its skip reason, or that it failed."""
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    return "error: its row in the JSON has the end of its stderr" if "error" in row else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per decode case: each configuration's ms (the median over its processes, with their range
    where there are several) and xform / reduce-overhead; per memory workload: each configuration's
    peak reserved memory over Inductor's, and xform's overhead / reduce-overhead's."""
    by_spec = {r["spec"]: r for r in rows}
    table = []
    for case in sorted({s.rsplit(":", 1)[0] for s in by_spec}):
        got = {c: by_spec.get(f"{case}:{c}", {}) for c in DECODE_CONFIGS}
        if case.startswith("decode"):
            runs = {c: [r["ms_per_step"] for r in rows if r["spec"] == f"{case}:{c}" and "ms_per_step" in r]
                    for c in DECODE_CONFIGS}
            ms = {c: round(statistics.median(runs[c]), 3) if runs[c] else None for c in DECODE_CONFIGS}
            ratios = {f"{c}/reduce-overhead": round(ms[c] / ms["reduce-overhead"], 3) if ms[c] and ms["reduce-overhead"]
                      else None for c in ("xform", XFORM_ERROR)}
            cells = {f"{c} ms": ms[c] or unmeasured(got[c]) for c in DECODE_CONFIGS}
            spread = {f"{c} range": f"{min(runs[c])}-{max(runs[c])} ({len(runs[c])})"
                      for c in DECODE_CONFIGS if len(runs[c]) > 1}
            table.append({"case": case, **cells, **ratios, **spread})
        else:
            peak = {c: got[c].get("peak_reserved_gib") for c in CONFIGS}
            base = peak["inductor"]
            over = {c: round(peak[c] - base, 3) if peak[c] is not None and base is not None else None for c in CONFIGS}
            ratio = (round(over["xform"] / over["reduce-overhead"], 3)
                     if over["xform"] is not None and over["reduce-overhead"] else None)
            table.append({"case": case, **{f"{c} GiB": peak[c] for c in CONFIGS},
                          **{f"{c} overhead GiB": over[c] for c in CONFIGS[1:]},
                          "overhead xform/reduce-overhead": ratio})
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help="run one configuration in this process and print its JSON")
    parser.add_argument("--only", help="run only the configurations whose name contains this (e.g. decode, :8:), "
                                       "or is this full name, or one of these, comma-separated")
    parser.add_argument("--out", type=Path, help="directory for the JSON result (default bench/results)")
    parser.add_argument("--jobs", type=int, default=1, help="memory runs at a time (default 1)")
    parser.add_argument("--processes", type=int, default=1,
                        help="processes per timed configuration, alternating (default 1)")
    parser.add_argument("--kernels", action="store_true",
                        help="profile 20 more steps of each decode configuration (bench/kernel_split.py): its "
                             "GPU time a step by kind of kernel, its costliest kernels, the GPU's span a step and its idle "
                             "time between kernels (not part of the timed runs)")
    parser.add_argument("--where", action="store_true",
                        help="memory runs record the allocator's history (bench/memory_peak.py) and report what "
                             "was allocated, by stream and by where in the code, when the reserved total peaked")
    args = parser.parse_args()
    if args.kernels:
        os.environ[KERNELS_ENV] = "1"
    if args.where:
        os.environ[WHERE_ENV] = "1"
    if args.one:
        print(json.dumps(run_one(args.one)))
        return
    if not torch.cuda.is_available():
        sys.exit("bench/cudagraphs.py needs a CUDA GPU")
    wanted = args.only.split(",") if args.only else None
    specs = selected(wanted)
    name = "cudagraphs" + ("_" + "_".join(w.strip(":").replace(":", "_") for w in wanted) if wanted else "")
    rows = run_all(specs, args.jobs, lambda rows: write_result(name, rows, args.out, summary=summarize(rows),
                                                               partial=True), args.processes)
    table = summarize(rows)
    for part in ("decode", "memory"):
        part_rows = [r for r in table if r["case"].startswith(part)]
        if part_rows:
            print_table(part_rows, list(part_rows[0]))
    print("wrote", write_result(name, rows, args.out, summary=table))


if __name__ == "__main__":
    main()
