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


def test_reads_the_inputs_at_its_indices_and_reuses_while_their_values_are_unchanged():
    reused, runs = make()
    x, y = torch.arange(6.0).view(2, 3), torch.ones(2, 3)
    first = reused(("other", x, y))
    assert len(runs) == 1 and torch.equal(first[0], x * 2 + y)
    assert reused(("other", x, y)) is first and len(runs) == 1
    assert reused(("other", x.clone(), y)) is first and len(runs) == 1  # equal values, another tensor
    y.add_(1)
    assert torch.equal(reused(("other", x, y))[0], x * 2 + y) and len(runs) == 2
    with torch.no_grad():
        x[0, 0] = 9
    assert torch.equal(reused(("other", x, y))[1], x.amax(-1)) and len(runs) == 3
    assert reused.computed == 3


@pytest.mark.parametrize("write", ["numpy", "data", "storage", "data swap"])
def test_a_write_the_version_counter_misses_is_seen(write):
    """A loader filling a `torch.from_numpy` buffer again, `.data` and storage writes move no version
    counter: batch 2 was computed with batch 1's result."""
    np = pytest.importorskip("numpy")
    reused, runs = make()
    array = np.zeros((2, 3), dtype=np.float32)
    x, y = torch.from_numpy(array), torch.zeros(2, 3)
    reused((None, x, y))
    if write == "numpy":
        array[:] = 1
    elif write == "data":
        x.data.copy_(torch.ones(2, 3))
    elif write == "storage":
        x.untyped_storage().copy_(torch.ones(2, 3).untyped_storage())
    else:
        x.data = torch.ones(2, 3)
    out = reused((None, x, y))
    assert len(runs) == 2 and torch.equal(out[0], torch.full((2, 3), 2.0))


def test_a_primed_result_is_used_for_its_inputs_and_inference_tensors_are_compared_too():
    reused, runs = make()
    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    primed = (torch.full((2, 3), 7.0), torch.zeros(2))
    reused.prime([x, y], primed)
    assert reused((None, x, y)) is primed and runs == []
    with torch.inference_mode():
        a, b = torch.ones(2, 3), torch.ones(2, 3)
    reused((None, a, b))
    reused((None, a, b))
    assert len(runs) == 1


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
