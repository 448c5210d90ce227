"""Only `xform/_torch/` reaches into torch's private APIs: a torch upgrade then breaks one package,
whose version differences are named in `xform/_torch/versions.py`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import xform

PACKAGE = Path(xform.__file__).parent
# torch's private attributes of tensors, storages and operators (the allocator's, autograd's, the dispatcher's)
PRIVATE_ATTRIBUTES = {"_cdata", "_version", "_swap_data_ptr_", "_new_with_weak_ptr", "_schema", "_qualified_op_name",
                      "_example", "_set_storage_data_ptr_access_error_msg"}


def _private(dotted: str) -> bool:
    """Whether a dotted torch name has a private part: torch._dynamo, torch.utils._pytree, torch._C.
    Operators (`torch.ops.aten._local_scalar_dense`) are not APIs but what graphs hold: matched freely."""
    parts = dotted.split(".")
    return (parts[0] == "torch" and parts[1:2] != ["ops"]
            and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]))


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_uses(source: str) -> list[str]:
    """Each private torch name `source` imports or reads, as `line: name`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            names = [dotted] if dotted else []
            if node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"{node.lineno}: .{node.attr}")
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
              "y = tensor._version\nz = torch.utils._pytree.tree_map\nok = torch.nn.functional.linear\n"
              "fine = torch.__version__\nop = torch.ops.aten._local_scalar_dense\n")
    lines = {int(use.split(":")[0]) for use in private_uses(source)}
    assert lines == {1, 2, 3, 4, 5, 6, 7}


def test_the_torch_package_names_each_version_difference():
    from xform._torch import versions

    flags = {name: value for name, value in vars(versions).items() if name.isupper()}
    assert flags and all(isinstance(value, bool) for value in flags.values())
    source = Path(versions.__file__).read_text().splitlines()
    for name in flags:  # a one-line comment over each: what differs, which versions
        line = next(i for i, text in enumerate(source) if text.startswith(f"{name} ="))
        assert source[line - 1].startswith("#") and "torch" in source[line - 1], name
