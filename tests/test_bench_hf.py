"""bench/hf.py and bench/hf_train.py run each configuration in a process of its own and write their
rows: checked on the CPU with the tiny models (figures come from the GPU, docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_hf_runs_its_configurations_and_writes_the_report_in_numbers(tmp_path):
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, "bench/hf.py", "--size", "tiny", "--only", "eager,xform-float8",
                           "--batches", "1", "--repeats", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "hf_generate.json").read_text())["rows"]
    assert [(r["config"], r["batch"]) for r in rows] == [("eager", 1), ("xform-float8", 1)]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    summary = rows[1]["xform"]
    assert summary["graphs"] >= 1 and not summary["failures"] and summary["quantize changes"] == 2 * 7 + 1


@pytest.mark.slow
def test_bench_hf_train_runs_its_configurations_and_writes_the_report_in_numbers(tmp_path):
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, "bench/hf_train.py", "--size", "tiny", "--only",
                           "llama:inductor,llama:xform-float8-rowwise", "--repeats", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "hf_train.json").read_text())
    assert [(r["model"], r["config"]) for r in result["rows"]] == [("llama", "inductor"), ("llama", "xform-float8-rowwise")]
    assert all(r["ms_per_step"] > 0 for r in result["rows"])
    summary = result["rows"][1]["xform"]  # 15 modules swapped, and one entry for the 15 calls rewritten
    assert summary["graphs"] >= 1 and not summary["failures"] and summary["quantize changes"] == 2 * 7 + 1 + 1
    assert [row["x inductor"] is not None for row in result["summary"]] == [True, True]


@pytest.mark.slow
def test_bench_hf_builds_the_sliding_window_model_and_files_its_rows_apart(tmp_path):
    """The sliding-window Mistral through xform, and torchao by hand (its config as xform builds it)."""
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, "bench/hf.py", "--model", "sliding", "--size", "tiny", "--only",
                           "xform,torchao-float8-ro", "--batches", "1", "--repeats", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "hf_generate_sliding.json").read_text())["rows"]
    assert [(r["model"], r["config"], r["batch"]) for r in rows] == [("sliding", "xform", 1),
                                                                      ("sliding", "torchao-float8-ro", 1)]
    assert all(r["tokens_per_s"] > 0 for r in rows) and not rows[0]["xform"]["failures"]
