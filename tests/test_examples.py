"""The examples run as a user runs them, in a new process."""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_prints_the_report_what_each_transform_saved_and_timings_with_their_reasons():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""  # no warning, and no progress bar where stderr is not a terminal
    out = result.stdout
    assert out.startswith("A 2-layer decoder with a sliding-window attention (256 tokens), compiled by xform with ")
    assert "\nxform report: 1 graph(s)\n\ngraph 0/0 (Decoder.forward)" in out
    assert all(name in out for name in ("quantize", "cast", "flex-attention", "count-ops"))
    assert re.search(r"quantize +6 Linear layers \(gate, up, down\), now Float8Tensor: weights 6.0 MiB -> 1.5 MiB", out)
    assert re.search(r"cast +5 Linear layers \(qkv, out, head\), now LowPrecisionWeight: weights 3.0 MiB -> 1.5 MiB",
                     out)
    assert "flex-attention  2 attentions, SDPA -> flex_attention (sliding window 256; cpu; block mask built once)" in out
    assert "it computes 9% of the 128 x 128 blocks of scores" in out
    assert "torch.compile (Inductor), the model as written" in out and "the baseline" in out
    ratios = [line for line in out.splitlines() if re.search(r" ms +\d+\.\d\dx", line)]
    assert len(ratios) == 2 and all(re.search(r"\dx (faster|\(slower\)): \w", line) for line in ratios)
    assert out.rstrip().endswith(quickstart().GPU_LINE)


def quickstart():
    """examples/quickstart.py as a module (its main() not run)."""
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_quickstart_quotes_the_gpu_figures_of_the_benchmarks_page():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    sliding = next(line for line in page.splitlines() if line.startswith("| sliding window 1024 | fwd |"))
    as_written_over_xform = float(sliding.split("|")[8].split()[0])
    rowwise = next(line for line in page.splitlines() if line.startswith("| FFN | train | float8-rowwise |"))
    over_bf16 = float(rowwise.split("|")[7].strip(" *x"))
    line = quickstart().GPU_LINE
    assert f"{as_written_over_xform:.1f}x faster through flex-attention" in line
    assert f"{over_bf16:.2f}x faster than bf16" in line


def run_example(*argv: str, launcher: tuple[str, ...] = (sys.executable,)) -> str:
    result = subprocess.run([*launcher, *argv], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def losses_of(out: str) -> list[float]:
    line = next(line for line in out.splitlines() if line.startswith("loss by step: "))
    return [float(pair.split(": ")[1]) for pair in line.removeprefix("loss by step: ").split(", ")]


@pytest.mark.slow
def test_llama_train_loss_falls_and_the_report_says_what_each_transform_did():
    out = run_example("examples/llama_train.py", "--steps", "8")
    assert out.startswith("xform report: 1 graph(s)")
    losses = losses_of(out)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < 0.8 * losses[0]
    assert "Linear -> ContiguousInputFloat8Linear (float8-rowwise)" in out
    assert "-> flex_attention (causal; cpu; block mask built once)" in out
    assert "single process (WORLD_SIZE 1, no process group): nothing to distribute" in out
    assert "no CUDA device here (torch.cuda.is_available() is False)" in out
    assert "8 steps on 1 process(es), cpu, handoff eager: loss " in out and " tokens/s per process" in out


@pytest.mark.slow
def test_llama_train_under_torchrun_shards_with_fsdp():
    out = run_example("--nproc_per_node", "2", "examples/llama_train.py", "--steps", "3",
                      launcher=(sys.executable, "-m", "torch.distributed.run"))
    assert "output.weight                    (128, 64) shard of 256 rows" in out
    assert "3 steps on 2 process(es)" in out
    assert all(math.isfinite(loss) for loss in losses_of(out))


@pytest.mark.slow
def test_llama_decode_prints_tokens_per_second_and_the_report():
    out = run_example("examples/llama_decode.py", "--prompt", "4", "--new", "4")
    assert out.startswith("xform report: 1 graph(s)")  # one compile for the prompt and every new token
    assert "float32[192, 64] Parameter -> float32[192, 64] Float8Tensor (quantize)" in out
    assert "-> flex_attention (mask read from a tensor; cpu; block mask built per call" in out
    assert "no CUDA device here" in out
    rows = [line for line in out.splitlines() if line.startswith("tokens: ")]
    assert len(rows) == 2 and all(len(row.split("-> ")[1].split(",")) == 4 for row in rows)
    assert re.search(r"4 new tokens x 2 sequences on cpu, float8-weight-only: [\d,.]+ tokens/s; first step", out)


def test_the_examples_import_nothing_from_bench():
    for script in (ROOT / "examples").glob("*.py"):
        tree = ast.parse(script.read_text())
        modules = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        modules += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        assert not [module for module in modules if module.split(".")[0] == "bench"], script.name
