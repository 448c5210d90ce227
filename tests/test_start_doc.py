"""docs/start.md, the user's first page: its example prints the report it shows, its links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
START = (DOCS / "start.md").read_text()


def without_timings(text: str) -> list[str]:
    return [re.sub(r"[\d.]+ ms", "N ms", line).rstrip() for line in text.strip().splitlines()]


@pytest.mark.slow
def test_the_first_compile_prints_the_report_shown(capsys):
    code = re.search(r"## A first compile\n\n```python\n(.*?)```", START, flags=re.S).group(1)
    exec(compile(code, str(DOCS / "start.md"), "exec"), {})  # noqa: S102 - the doc is ours
    shown = re.search(r"On a CPU the code above prints:\n\n```\n(.*?)```", START, flags=re.S).group(1)
    assert without_timings(capsys.readouterr().out) == without_timings(shown)


def test_every_relative_link_exists():
    links = re.findall(r"\]\(([^)#:]+)\)", START)
    assert links and all((DOCS / link).exists() for link in links), [link for link in links if not (DOCS / link).exists()]
