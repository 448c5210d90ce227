"""Only `xform/_torch/` reaches into torch's private APIs: a torch upgrade then breaks one package,
whose version differences are named in `xform/_torch/versions.py`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import xform

PACKAGE = Path(xform.__file__).parent
def _torch_private_attributes() -> set[str]:
    """The private attributes of torch's tensors, storages, modules and compiled objects, and the
    ones Dynamo and AOTAutograd set on functions and tensors."""
    from torch._dynamo.eval_frame import OptimizedModule

    owners = (torch.Tensor, torch.UntypedStorage, torch.nn.Module, OptimizedModule, torch.fx.GraphModule)
    names = {n for owner in owners for n in dir(owner) if n.startswith("_") and not n.startswith("__")}
    return names | {"_torchdynamo_orig_callable", "_boxed_call", "_dynamo_static_input_type", "_example",
                    "_qualified_op_name", "_schema", "_orig_mod"}


PRIVATE_ATTRIBUTES = _torch_private_attributes()
NAMED_ACCESS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(dotted: str) -> bool:
    """Whether a dotted torch name has a private part: torch._dynamo, torch.utils._pytree, torch._C.
    Operators (`torch.ops.aten._local_scalar_dense`) are not APIs but what graphs hold: matched freely."""
    parts = dotted.split(".")
    return (parts[0] == "torch" and parts[1:2] != ["ops"]
            and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]))


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to torch modules: `import torch as t`, `from torch import nn`."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname: a.name for a in node.names if a.asname and a.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            aliases |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    return aliases


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def private_uses(source: str) -> list[str]:
    """Each private torch name `source` imports or reads, as `line: name`."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node, aliases)
            names = [dotted] if dotted else []
            if node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and node.args:
            called = _dotted(node.func, aliases) or ""
            name = _string(node.args[1]) if called in NAMED_ACCESS and len(node.args) > 1 else None
            owner = _dotted(node.args[0], aliases) or ""
            if name is not None and (name in PRIVATE_ATTRIBUTES or _private(f"{owner}.{name}")):
                found.append(f"{node.lineno}: {called}({owner or '...'}, {name!r})")
            if called.endswith("import_module") and _string(node.args[0]):
                names = [_string(node.args[0])]
        found += [f"{node.lineno}: {name}" for name in names if _private(name)]
    return sorted(set(found))


def _modules_outside_torch_package() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "_torch" not in p.relative_to(PACKAGE).parts]


@pytest.mark.parametrize("path", _modules_outside_torch_package(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_outside_xform_torch_uses_a_private_torch_api(path):
    uses = private_uses(path.read_text())
    assert not uses, (f"{path.relative_to(PACKAGE.parent)} uses torch's private API {uses}: add what it needs to "
                      f"xform/_torch/ and import it from there")


def test_the_check_finds_each_kind_of_private_use():
    source = ("import torch._dynamo\nfrom torch._inductor.compile_fx import compile_fx\nfrom torch import _C\n"
              "from torch.utils._pytree import tree_map\nx = torch._C._cuda_clearCublasWorkspaces\n"
              "y = tensor._version\nz = torch.utils._pytree.tree_map\nimport torch as t\nw = t._scaled_mm\n"
              "v = getattr(torch, '_scaled_mm')\nu = hasattr(storage, '_swap_data_ptr_')\n"
              "s = importlib.import_module('torch._dynamo')\nr = model._apply(f)\nq = compiled._orig_mod\n"
              "ok = torch.nn.functional.linear\nfine = torch.__version__\nop = torch.ops.aten._local_scalar_dense\n"
              "mine = self._pool\n")
    lines = {int(use.split(":")[0]) for use in private_uses(source)}
    assert lines == {1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14}


def test_the_torch_package_names_each_version_difference():
    from xform._torch import versions

    flags = {name: value for name, value in vars(versions).items() if name.isupper()}
    assert flags and all(isinstance(value, bool) for value in flags.values())
    source = Path(versions.__file__).read_text().splitlines()
    for name in flags:  # a one-line comment over each: what differs, which versions
        line = next(i for i, text in enumerate(source) if text.startswith(f"{name} ="))
        assert source[line - 1].startswith("#") and "torch" in source[line - 1], name
