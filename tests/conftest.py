"""Shared fixtures: a clean Dynamo cache per test, and a guard against silent recompiles."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo


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
