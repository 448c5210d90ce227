"""xform keeps vmap working where a failed tensor print left functorch off in the thread (torch holds
`_DisableFuncTorch` in the printing frame, which the exception's traceback keeps alive). On the
H100 this made every flex-attention rewrite after a test that printed a stale CUDA-graph output fail."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import xform
from xform._torch import functorch as functorch_state
from xform._torch.functorch import functorch_on
from test_attention_gpu import causal, document  # the GPU tests' patterns, here on the CPU

STALE = "this tensor is an output of the CUDA graph of inference 0, and a later replay wrote over its memory"


def printing_failure() -> RuntimeError:
    """An exception raised inside torch's tensor printing, as reading a stale output raises one (there
    from the storage, which a CPU build cannot invalidate; here from the printer)."""
    def raising(self, tensor_contents=None):
        raise RuntimeError(STALE)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch._tensor_str, "_str_intern", raising)
        try:
            print(torch.ones(1))
        except RuntimeError as error:
            held = error
    return held


def vmap_works() -> bool:
    """Whether a nested vmap runs, as a mask_mod's evaluation over (q, kv) does (one vmap alone does)."""
    pairs = torch.vmap(torch.vmap(torch.ge, in_dims=(None, 0)), in_dims=(0, None))
    try:
        pairs(torch.arange(4), torch.arange(4))
    except RuntimeError as error:
        assert "doesn't have storage" in str(error)
        return False
    return True


def test_a_failed_print_leaves_vmap_off_while_its_exception_lives():
    """Torch's behaviour, which the rest works around: off until the exception is collected."""
    held = printing_failure()
    assert not vmap_works()
    del held
    gc.collect()
    assert vmap_works()


@pytest.mark.parametrize("pattern", [causal, document], ids=lambda p: p.__name__)
def test_flex_attention_rewrites_and_runs_while_a_failed_print_holds_functorch_off(pattern, monkeypatch, caplog):
    monkeypatch.setattr(functorch_state, "_warned", False)
    held = printing_failure()
    q, k, v = (torch.randn(2, 4, 256, 32) for _ in range(3))
    ids = (torch.arange(256) // 64).expand(2, 256).contiguous()
    args = (q, k, v, ids)
    with caplog.at_level(logging.WARNING, logger="xform"):
        out = xform.compile(pattern, "flex-attention", handoff="eager")(*args)
    (change,) = xform.report(pattern).changes("flex-attention")
    assert "-> flex_attention" in change.detail
    assert not vmap_works()  # left as found: the caller still holds the exception
    del held
    gc.collect()
    torch.testing.assert_close(out, pattern(*args))
    warnings = [r.getMessage() for r in caplog.records if "functorch (vmap) was off" in r.getMessage()]
    assert len(warnings) == 1 and "drop that exception" in warnings[0]


def test_functorch_on_collects_an_unreferenced_failure_first(monkeypatch, caplog):
    """The usual case: the exception is garbage in a cycle; collecting it turns functorch on for good."""
    monkeypatch.setattr(functorch_state, "_warned", False)
    printing_failure()  # dropped, but alive in a cycle until the collector runs
    assert not vmap_works()
    with caplog.at_level(logging.WARNING, logger="xform"), functorch_on():
        assert vmap_works()
    assert vmap_works() and not caplog.records
