"""xform.transforms.attention.reused_inputs on its own: what counts as an unchanged input, and the Inductor recompute."""

from __future__ import annotations

import pytest
import torch

from xform.transforms.attention.reused_inputs import ReusedComputation


def make(compile_with_inductor: bool = False) -> tuple[ReusedComputation, list[int]]:
    runs: list[int] = []

    def compute(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        runs.append(1)
        return (x * 2 + y, x.amax(-1))

    return ReusedComputation(compute, (1, 2), compile_with_inductor=compile_with_inductor), runs


def test_reads_the_inputs_at_its_indices_and_reuses_while_unchanged():
    reused, runs = make()
    x, y = torch.arange(6.0).view(2, 3), torch.ones(2, 3)
    first = reused(("other", x, y))
    assert len(runs) == 1 and torch.equal(first[0], x * 2 + y)
    assert reused(("other", x, y)) is first and len(runs) == 1
    y.add_(1)  # any write moves the version counter, with or without autograd
    assert torch.equal(reused(("other", x, y))[0], x * 2 + y) and len(runs) == 2
    with torch.no_grad():
        x[0, 0] = 9
    assert torch.equal(reused(("other", x, y))[1], x.amax(-1)) and len(runs) == 3
    assert reused.computed == 3


def test_another_tensor_or_new_memory_is_a_change_even_with_equal_values():
    reused, runs = make()
    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    reused((None, x, y))
    reused((None, x.clone(), y))  # the same values in another tensor
    x.data = torch.ones(2, 3)  # new memory, no write
    out = reused((None, x, y))
    assert len(runs) == 3 and torch.equal(out[0], torch.full((2, 3), 2.0))


def test_a_primed_result_is_used_for_its_inputs_and_an_inference_tensor_is_never_taken_as_unchanged():
    reused, runs = make()
    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    primed = (torch.full((2, 3), 7.0), torch.zeros(2))
    reused.prime([x, y], primed)
    assert reused((None, x, y)) is primed and runs == []
    with torch.inference_mode():
        a, b = torch.ones(2, 3), torch.ones(2, 3)
    reused((None, a, b))
    reused((None, a, b))
    assert len(runs) == 2


@pytest.mark.slow
def test_the_recompute_compiled_by_inductor_gives_the_same_results():
    reused, runs = make(compile_with_inductor=True)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out = reused((None, x, y))
    torch.testing.assert_close(out[0], x * 2 + y)
    torch.testing.assert_close(out[1], x.amax(-1))
    x.mul_(3)
    out = reused((None, x, y))
    torch.testing.assert_close(out[0], x * 2 + y)
    assert reused.computed == 2 and len(runs) == 1  # traced once (make_fx), then the compiled code runs


def test_a_recompute_inductor_cannot_compile_runs_as_written_and_says_so(monkeypatch, caplog):
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    def refuse(*args, **kwargs):
        raise RuntimeError("no lowering")

    monkeypatch.setattr(proxy_tensor, "make_fx", refuse)
    reused, runs = make(compile_with_inductor=True)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with caplog.at_level("WARNING", logger="xform"):
        out = reused((None, x, y))
    torch.testing.assert_close(out[0], x * 2 + y)
    assert "could not be compiled by Inductor (RuntimeError: no lowering); it runs as written" in caplog.text
    assert not reused.compile_with_inductor and len(runs) == 1
