"""The README's worked example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_worked_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    blocks = blocks[next(i for i, b in enumerate(blocks) if b.startswith("import")):]  # from the worked example on
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README is ours
    printed = capsys.readouterr().out
    assert "LowPrecisionWeight torch.bfloat16" in printed
    assert "xform report: 1 graph(s)" in printed
