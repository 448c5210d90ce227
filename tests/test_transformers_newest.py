"""The Hugging Face tests again with the newest transformers the declared range admits (the one
`tests/transformers-newest.txt` names), installed apart under build/ and put first on the path of
a pytest run of their own: users run the newest, CI's environment pins an older one. That run
leaves out the tests marked slow (those compiling with Inductor, and the conformance suite but for
its fast lane), which the pinned one runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENT = ROOT / "tests" / "transformers-newest.txt"
TARGET = ROOT / "build" / "transformers-newest"
SUITES = ["tests/test_hf_models.py", "tests/test_calling_forms.py", "tests/test_conformance.py"]


def _wanted() -> str:
    return next(line.split("==")[1].strip() for line in REQUIREMENT.read_text().splitlines()
                if line.startswith("transformers=="))


def _install() -> None:
    """Into TARGET, with torch held at the installed build (a range would pull a CUDA build)."""
    if (TARGET / f"transformers-{_wanted()}.dist-info").exists():
        return
    constraints = TARGET.parent / "transformers-newest-constraints.txt"
    constraints.parent.mkdir(parents=True, exist_ok=True)
    constraints.write_text(f"torch=={torch.__version__}\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(TARGET), "-r", str(REQUIREMENT),
                    "-c", str(constraints)], check=True, cwd=ROOT)


@pytest.mark.slow
def test_the_hugging_face_suites_pass_with_the_newest_transformers():
    _install()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TARGET), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert version == _wanted()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *SUITES],
                         env=env, cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, f"transformers {version}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
