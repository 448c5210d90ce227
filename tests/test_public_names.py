"""What the README and the docs name exists: every `xform.<name>` they mention imports, every
`from xform... import ...` of their examples works, and every relative link leads to a file."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is a module, or an attribute chain reached from the longest module prefix."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:]:
                value = getattr(value, name)
        except AttributeError:
            return False
        return True
    return False


def _names(text: str) -> set[str]:
    dotted = set(re.findall(r"(?<![\w/.])xform(?:\.[A-Za-z_]\w*)+", text))
    for module, names in re.findall(r"^\s*from (xform(?:\.\w+)*) import ([\w, ]+)$", text, flags=re.M):
        dotted |= {f"{module}.{name.strip()}" for name in names.split(",") if name.strip()}
    return {d for d in dotted if not d.endswith((".md", ".py"))}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_xform_name_a_page_mentions_exists(page):
    missing = sorted(n for n in _names(page.read_text()) if not _resolves(n))
    assert not missing, f"{page.relative_to(ROOT)} names what xform does not have: {missing}"


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_of_a_page_exists(page):
    links = re.findall(r"\]\(([^)#:]+)(?:#([^)]*))?\)", page.read_text())
    missing = [link for link, _ in links if not (page.parent / link).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"
    broken = [f"{link}#{anchor}" for link, anchor in links
              if anchor and link.endswith(".md") and anchor not in _anchors(page.parent / link)]
    assert not broken, f"{page.relative_to(ROOT)} links to headings that do not exist: {broken}"
