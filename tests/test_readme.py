"""The README's example, and the architecture page's transform, run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
ARCHITECTURE = README.parent / "docs" / "architecture.md"


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


@pytest.mark.slow
def test_the_transform_written_on_the_architecture_page_runs(capsys):
    code = re.search(r"## Writing a transform\n.*?```python\n(.*?)```", ARCHITECTURE.read_text(), flags=re.S).group(1)
    exec(compile(code, str(ARCHITECTURE), "exec"), {})  # noqa: S102 - the doc is ours
    assert capsys.readouterr().out.strip() == "['2 linear calls']"
