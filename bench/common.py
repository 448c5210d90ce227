"""What every benchmark shares: where results go, the environment they ran in, a table printer."""

from __future__ import annotations

import gc
import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch
from tabulate import tabulate
from torch import nn
from tqdm import tqdm

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


def say(text: str) -> None:
    """Print a line above the progress bar (`tqdm.write`), flushed at once: a run cut short keeps its log."""
    tqdm.write(text)
    sys.stdout.flush()


def print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    """`columns` of `rows` as a markdown table, each value as `str()` writes it (ready to paste into the docs)."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    print(tabulate(cells, headers=list(columns), tablefmt="github", disable_numparse=True))


def run_in_process(script: str, spec: str, *args: str, env: dict[str, str] | None = None,
                   timeout: float = 1800) -> dict[str, Any]:
    """`python script --one spec *args` in a process of its own (so no configuration is timed with
    another's compiled code, caches or memory), `env` added to its environment: the JSON line it
    prints last (kept if the process then fails on its way out), or the end of its stderr; one that
    runs past `timeout` seconds is an error row, and the next configuration runs."""
    import os
    import subprocess

    try:
        done = subprocess.run([sys.executable, script, "--one", spec, *args], capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        row = {"spec": spec, "error": f"no result after {timeout:.0f} s: {(expired.stderr or b'')[-2000:]!r}"}
        say(json.dumps(row)[:600])
        return row
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")), None)
    row = json.loads(line) if line else {"spec": spec, "error": done.stderr[-3000:]}
    say(json.dumps(row)[:600])
    return row


def first_then_timed(call: Callable[[], Any], untimed: int, repeats: int) -> tuple[float, list[float], Any]:
    """Seconds of the first `call()` (it compiles), then `untimed` calls (graphs recorded on a later
    call are recorded there), then the seconds of each of `repeats` calls, with the GPU's peak memory
    statistics reset before them; and what the last call returned. Each time waits for the GPU."""
    import time

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for i in range(1 + untimed + repeats):
        if i == 1 + untimed and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        returned = call()
        sync()
        times.append(time.perf_counter() - start)
    return times[0], times[1 + untimed:], returned


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
