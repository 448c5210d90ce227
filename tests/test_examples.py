"""The examples run as a user runs them, in a new process."""

from __future__ import annotations

import io
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_prints_the_report_and_a_timing_line():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.startswith("xform report: 1 graph(s)")
    assert "quantize" in out and "cast" in out and "count-ops" in out
    assert "block 0 now holds {'qkv': 'LowPrecisionWeight', 'up': 'Float8Tensor'}" in out
    assert " ms/step, xform " in out


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


def test_the_progress_bar_draws_in_place_and_only_when_asked():
    sys.path.insert(0, str(ROOT))
    from examples.progress import Progress

    stream = io.StringIO()
    bar = Progress(4, "train", stream=stream, enabled=True, width=8)
    bar.update(1, "loss 2.000")
    bar.update(4, "loss 1.000")
    bar.close()
    drawn = stream.getvalue()
    assert drawn.startswith("\rtrain [##------] 1/4 loss 2.000 ") and "\rtrain [########] 4/4 loss 1.000 " in drawn
    assert drawn.endswith(" s/step\n")
    quiet = io.StringIO()  # not a terminal: no bar
    Progress(100, "train", stream=quiet).update(50)
    assert quiet.getvalue() == ""
