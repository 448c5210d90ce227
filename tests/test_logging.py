"""The `xform` logger and XFORM_LOG."""

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


def test_bad_xform_log_value():
    with pytest.raises(ValueError, match="XFORM_LOG='loud' is not a level; accepted: info, debug, warning"):
        configure_from_env({"XFORM_LOG": "loud"})


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
