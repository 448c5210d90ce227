"""`pip install -e .` makes backend="xform" work in a new process without importing xform."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_backend_by_name_in_a_new_process_without_importing_xform():
    script = (
        "import sys, torch\n"
        "assert 'xform' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "assert 'xform' not in sys.modules\n"
        "m = torch.nn.Linear(4, 4)\n"
        "out = torch.compile(m, backend='xform', options={'transforms': ['cast:bf16'], 'handoff': 'eager'})(torch.randn(2, 4))\n"
        "assert 'xform' in sys.modules and m.weight.dtype == torch.bfloat16\n"
        "print('ok', out.dtype)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok torch.float32"


def test_pyproject_declares_the_entry_point_python_and_dependencies():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["torch_dynamo_backends"] == {"xform": "xform.backend:xform_backend"}
    assert project["requires-python"] == ">=3.10"
    names = [d.split(">")[0].split("=")[0].split("<")[0] for d in project["dependencies"]]
    assert names == ["torch", "torchao", "networkx", "numpy", "tabulate", "tqdm"]
    assert "torch>=2.11,<2.15" in project["dependencies"]
    assert set(project["optional-dependencies"]) == {"dev", "thunder", "bench"}
    assert any(d.startswith("lightning-thunder") for d in project["optional-dependencies"]["thunder"])


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line.strip() for line in ci.splitlines() if "pytest" in line)
    assert test_command in readme
