"""The package's layout stays readable: no import cycle between xform's modules, no module past
about 450 lines, and each transform's home exports its transform."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import networkx as nx
import pytest

import xform

PACKAGE = Path(xform.__file__).parent
MAX_LINES = 460


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements under `if TYPE_CHECKING:`, which never run."""
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skipped |= {n for body in node.body for n in ast.walk(body)}
    return skipped


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The xform modules `path` imports, at its top or inside a function (both run)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                      for alias in node.names}
    return found & modules


def import_graph() -> nx.DiGraph:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(paths)
    for name, path in paths.items():
        graph.add_edges_from((name, imported) for imported in imports_of(path, set(paths)) if imported != name)
    return graph


def test_no_import_cycle_between_xform_modules():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_the_check_finds_a_cycle():
    graph = import_graph()
    graph.add_edge("xform.registry", "xform.transforms")  # what registry.py did before the layout change
    assert list(nx.simple_cycles(graph))


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_long(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines: split it along its sections"


@pytest.mark.parametrize("home, name", [("cudagraphs", "CudaGraphs"), ("attention", "FlexAttention"),
                                        ("distribute", "Distribute"), ("quantize", "Quantize")])
def test_each_transform_home_exports_its_transform(home, name):
    package = importlib.import_module(f"xform.transforms.{home}")
    assert name in package.__all__ and getattr(xform.transforms, name) is getattr(package, name)
    assert package.__doc__ and all(f"`{p.stem}`" in package.__doc__ for p in Path(package.__file__).parent.glob("*.py")
                                   if p.stem != "__init__")
