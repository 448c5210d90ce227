"""Shared fixtures: a clean Dynamo cache per test, a guard against silent recompiles, and the
simulated CUDA-graph recorder (simulated_recorder.py) as the cudagraphs transform's recorder."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import xform.transforms.cudagraphs.transform as cudagraphs
from simulated_recorder import SimulatedRecorder


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_recompile():
    """Inside `with no_recompile():` any recompile raises."""
    return lambda: torch._dynamo.config.patch(error_on_recompile=True)


@pytest.fixture
def recorder(monkeypatch) -> SimulatedRecorder:
    """The simulated recorder, as the one the cudagraphs transform records with (the CPU as its device)."""
    sim = SimulatedRecorder()
    monkeypatch.setattr(cudagraphs, "available_recorder", lambda: sim)
    return sim
