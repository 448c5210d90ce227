"""The examples run as a user runs them, in a new process."""

from __future__ import annotations

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
