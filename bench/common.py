"""What every benchmark shares: where results go, the environment they ran in, a table printer."""

from __future__ import annotations

import gc
import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
T = TypeVar("T")


class Skipped(Exception):
    """A configuration that cannot run here, for a reason said in the message (a peer that does not
    import): recorded as "skipped: <reason>" in the results, unlike a failure, which is a finding."""

    def cell(self) -> str:
        return f"skipped: {self}"


def or_skipped(make: Callable[[], T]) -> T | Skipped:
    """`make()`, or the Skipped it raised, kept in its place so that the rest of the run goes on."""
    try:
        return make()
    except Skipped as skipped:
        return skipped


def thunder_compile(cudagraphs: bool = False) -> Callable[[nn.Module], Callable[..., Any]]:
    """The ThunderFX peer: a function compiling a model with `torch.compile(model,
    backend=thunder.dynamo.ThunderCompiler())`, a backend per model since it keeps the model's
    subgraphs; `cudagraphs`: with Thunder's own CUDA graphs (its `CUDAGraphTransform` passed on to
    `thunder.jit`), the peer of reduce-overhead. Raises Skipped at once, before any model is built,
    where lightning-thunder does not import (it needs torch 2.11: torch 2.13 removed named tensors)."""
    try:
        from thunder.dynamo import ThunderCompiler
        from thunder.transforms.cudagraph import CUDAGraphTransform
    except Exception as error:  # ImportError, or AttributeError from inside thunder on a newer torch
        raise Skipped(f"lightning-thunder does not import here ({type(error).__name__}: {error})") from error

    def compile_(model: nn.Module) -> Callable[..., Any]:
        options = {"transforms": [CUDAGraphTransform()]} if cudagraphs else {}
        return torch.compile(model, backend=ThunderCompiler(**options))

    return compile_


def environment() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "python": sys.version.split()[0], "machine": platform.machine(),
            "gpu": gpu, "cpu_threads": torch.get_num_threads()}


def write_result(name: str, rows: list[dict[str, Any]], out_dir: Path | None = None, **extra: Any) -> Path:
    """Write `{environment, rows, ...}` to `<out_dir or bench/results>/<name>.json`."""
    directory = out_dir or RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "environment": environment(), "rows": rows, **extra}, indent=2))
    return path


def print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("-|-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(row, widths)))


def cuda_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of `fn()` on the GPU, by CUDA events, after warm-up."""
    import statistics

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_peak_gib(fn) -> float:
    """GPU memory `fn()` needs on top of what is already allocated (weights, grads, other models), in
    GiB: its peak allocation minus the allocation before it. Comparable across configurations that
    share a process."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def inductor_option(text: str) -> tuple[str, object]:
    """`KEY=VALUE` of a command line's --inductor-option: the value read as JSON (true, 3), else a string."""
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--inductor-option takes KEY=VALUE, not {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def release_compiled() -> None:
    """Free what finished configurations held (their graphs, caches, GPU memory) before the next one
    is measured, so that none is timed or counted with another's memory."""
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
