"""The `xform` logger: TORCH_LOGS=xform as for torch's own logs, XFORM_LOG as an alias, and the
dependencies' messages xform brings out that a user can do nothing about, kept quiet."""

from __future__ import annotations

import logging

import pytest
import torch

import xform
from xform.log import configure_from_env, logger
from models import TiedLM


def test_xform_log_sets_the_level_and_one_handler(monkeypatch):
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    configure_from_env({"XFORM_LOG": "debug"})
    configure_from_env({"XFORM_LOG": "DEBUG"})
    assert logger.level == logging.DEBUG and len(logger.handlers) == 1


def test_unset_xform_log_changes_nothing(monkeypatch):
    monkeypatch.setattr(logger, "handlers", [])
    configure_from_env({})
    assert logger.handlers == []


def test_a_bad_xform_log_value_warns_and_is_ignored(monkeypatch):
    monkeypatch.setattr(logger, "handlers", [])
    with pytest.warns(UserWarning, match=r"XFORM_LOG='verbose' is not a level, so it is ignored; accepted: info, "
                                         r"debug, warning \(or TORCH_LOGS=xform / \+xform\)"):
        configure_from_env({"XFORM_LOG": "verbose"})
    assert logger.handlers == []


def test_torch_logs_names_xform(monkeypatch):
    """`torch._logging.set_logs(modules={"xform": ...})` is the Python form of TORCH_LOGS=xform."""
    for attribute in ("handlers", "level", "propagate"):  # torch's logging takes the logger over: put it back
        monkeypatch.setattr(logger, attribute, getattr(logger, attribute))
    torch._logging.set_logs(modules={"xform": logging.DEBUG})
    try:
        assert logger.getEffectiveLevel() == logging.DEBUG
    finally:
        torch._logging.set_logs()


def test_torch_logs_env_in_a_new_process_logs_the_changes(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text("import torch, xform\nm = torch.nn.Linear(4, 4)\n"
                      "xform.compile(m, 'cast:bf16', handoff='eager')(torch.randn(2, 4))\n")
    result = subprocess.run([sys.executable, str(script)], env={**os.environ, "TORCH_LOGS": "xform"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "cast changed layer  (Linear): float32 -> bfloat16" in result.stderr or \
        "cast changed layer" in result.stderr, result.stderr[-2000:]


def test_torchaos_messages_a_user_cannot_act_on_are_quiet(tmp_path):
    """Quantizing on a CPU imports torchao, whose CUDA kernels its CPU wheel lacks: it said so on every
    run, with torch's deprecation of its enum registration; the output is now the user's own."""
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text("import torch, xform\nm = torch.nn.Sequential(torch.nn.Linear(128, 128)).bfloat16()\n"
                      "with torch.no_grad():\n"
                      "    xform.compile(m, 'quantize:float8-weight-only')(torch.randn(4, 128, dtype=torch.bfloat16))\n"
                      "print('done')\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "done\n" and result.stderr == "", result.stderr[-2000:]


def test_compiles_log_graphs_and_skips(caplog):
    with caplog.at_level(logging.INFO, logger="xform"):
        xform.compile(TiedLM(), "cast:bf16", handoff="eager")(torch.randint(0, 50, (2, 3)))
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("graph 0/0 (TiedLM.forward): 9 nodes") and "transforms ['cast']" in m for m in messages)
    assert any(m.startswith("cast skipped head: its weight is embed.weight") for m in messages)


def test_xform_log_env_in_a_new_process(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import torch, xform\n"
        "m = torch.nn.Linear(4, 4)\n"
        "xform.compile(m, 'cast:bf16', handoff='eager')(torch.randn(2, 4))\n"
    )
    result = subprocess.run([sys.executable, str(script)], env={**__import__("os").environ, "XFORM_LOG": "info"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "[xform INFO] graph 0/0 (Linear):" in result.stderr
