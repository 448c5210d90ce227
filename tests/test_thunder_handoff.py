"""handoff="thunder": Lightning Thunder's ThunderFX compiles the transformed graph (torch 2.11 only)."""

from __future__ import annotations

import pytest
import torch

import xform
from models import mlp


def _thunder_import_error() -> str | None:
    try:
        import thunder.dynamo  # noqa: F401
    except Exception as error:  # AttributeError on torch >= 2.13 (named tensors are gone)
        return f"lightning-thunder does not import here ({type(error).__name__}: {error})"
    return None


pytestmark = [pytest.mark.thunder, pytest.mark.skipif(_thunder_import_error() is not None,
                                                       reason=_thunder_import_error() or "")]


def test_thunder_handoff_matches_eager_with_no_transforms():
    model = mlp()
    x = torch.randn(4, 16)
    torch.testing.assert_close(xform.compile(model, handoff="thunder")(x), model(x))
    assert xform.report(model).graphs[0].handoff == "thunder"


def test_thunder_handoff_runs_the_cast_graph_forward_and_backward():
    model = mlp()
    x = torch.randn(4, 16)
    reference = model(x)
    out = xform.compile(model, "cast:bf16", handoff="thunder")(x)
    out.sum().backward()
    torch.testing.assert_close(out, reference, atol=3e-2, rtol=3e-2)
    assert model[0].weight.dtype == torch.bfloat16 and model[0].weight.grad.dtype == torch.bfloat16
