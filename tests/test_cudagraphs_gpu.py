"""The cudagraphs transform on a CUDA GPU (run on the device machine): recorded, replayed, correct,
and holding no memory between replays but the outputs it hands out."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import xform
from xform._torch import versions
from xform.transforms import CudaGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64)).cuda()


def test_inference_replays_and_matches_eager():
    model, transform = mlp().eval(), CudaGraphs()
    step = torch.compile(model, backend=xform.Backend([transform]))
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(step(x), model(x), atol=1e-4, rtol=1e-4)
    (function,) = transform.functions
    assert function.stats.replays == 5 and function.stats.recordings == 1 and function.stats.fallback is None


def test_an_input_buffer_filled_again_is_read_in_place_and_a_moved_input_copied():
    """A buffer the caller writes each call is read where it is (nothing copied in), as a parameter is;
    an input elsewhere gets one more recording, which copies it in. Both give eager's results."""
    model, transform = mlp().eval(), CudaGraphs()
    step = torch.compile(model, backend=xform.Backend([transform]))
    buffer = torch.empty(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(5):
            buffer.copy_(torch.randn(8, 64, device="cuda"))
            torch.testing.assert_close(step(buffer), model(buffer), atol=1e-4, rtol=1e-4)
        (function,) = transform.functions
        assert (function.stats.recordings, function.stats.copied_in_bytes) == (1, 0)
        for _ in range(3):
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(step(x), model(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(step(buffer), model(buffer), atol=1e-4, rtol=1e-4)
    assert function.stats.recordings == 2 and function.stats.copied_in_bytes == 3 * x.numel() * x.element_size()
    assert function.stats.uncaptured_calls == 0 and function.stats.fallback is None


def test_held_outputs_are_never_overwritten_and_only_held_ones_are_copied():
    model, transform = mlp().eval(), CudaGraphs()
    step = torch.compile(model, backend=xform.Backend([transform]))
    inputs = [torch.randn(8, 64, device="cuda") for _ in range(7)]
    with torch.no_grad():
        step(inputs[0]), step(inputs[1])  # warm-up, recording
        # the recording cleared cuBLAS's workspaces (xform.transforms.cudagraphs.recorder): an eager GEMM allocates this
        # stream's again before the count, as the uncaptured calls below would
        model(inputs[0])
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        outputs = [step(x) for x in inputs[2:]]  # all held at once
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        for x, out in zip(inputs[2:], outputs):
            torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
        nbytes = [o.untyped_storage().nbytes() for o in outputs]
        stats = transform.functions[0].stats
        if versions.STORAGE_SWAPS_DATA_PTR:
            # each replay's output is handed out in the pool; the next replay moves the one before
            # out of its way (an ordinary allocation): all but the last are copies
            assert grown == sum(nbytes[:-1]) and stats.moved_bytes == sum(nbytes[:-1])
        else:
            # torch < 2.13 cannot move the first one, which stays in the pool: each later call,
            # which would write over it, runs uncaptured, its output ordinary memory
            assert grown == sum(nbytes[1:]) and stats.uncaptured_calls == 4 and stats.stuck == 4
        del outputs
        for x in inputs:  # read, then dropped: nothing in the way, nothing to move
            torch.testing.assert_close(step(x), model(x), atol=1e-4, rtol=1e-4)
    assert stats.replays == (6 if versions.STORAGE_SWAPS_DATA_PTR else 2) + 7 and stats.recordings == 1


def test_stale_outputs_error_makes_reading_an_overwritten_output_raise_and_copies_nothing():
    model, transform = mlp().eval(), CudaGraphs(stale_outputs="error")
    step = torch.compile(model, backend=xform.Backend([transform]))
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        step(x), step(x)  # warm-up, recording
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        outputs = [step(x) for _ in range(4)]  # all held: each replay writes over the one before
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= before  # nothing copied out
        torch.testing.assert_close(outputs[-1], model(x), atol=1e-4, rtol=1e-4)
        with pytest.raises(RuntimeError, match="this tensor is an output of the CUDA graph of inference 0, and a "
                                               "later replay wrote over its memory") as stale:
            print(outputs[0][0, :4])
        assert "(out = out.clone())" in str(stale.value)
        # raised inside torch's printing, whose frame the traceback keeps, and with it functorch off in
        # this thread (xform copes, tests/test_functorch_state.py; torch's own vmap does not): dropped
        del stale
        kept = step(x).clone()  # cloned: kept
        step(x)
        torch.testing.assert_close(kept, model(x), atol=1e-4, rtol=1e-4)
    stats = transform.functions[0].stats
    assert (stats.uncaptured_calls, stats.moved_bytes, stats.stuck, stats.invalidated) == (0, 0, 0, 4)


def test_an_output_held_across_another_graphs_replay_keeps_its_values():
    # two graphs share the pool: b's recording took the memory a's outputs had used, since none
    # was alive then; a's next output, held while b replays, must be moved out of b's way
    a, b = mlp().eval(), mlp().eval()
    step_a = torch.compile(a, backend=xform.Backend([CudaGraphs()]))
    step_b = torch.compile(b, backend=xform.Backend([CudaGraphs()]))
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for step in (step_a, step_a, step_b, step_b):  # warm-up and recording of each, outputs dropped
            step(x)
        for _ in range(3):
            held = step_a(x)
            expected = a(x)
            torch.testing.assert_close(step_b(x), b(x), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(held, expected, atol=1e-4, rtol=1e-4)
        held = step_a(x)
        expected = held.clone()
        a[0].weight.data = torch.randn_like(a[0].weight)  # a new signature, recorded while `held` lives
        for _ in range(2):
            torch.testing.assert_close(step_a(x), a(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(held, expected)


class BreakLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2048, 2048)

    def forward(self, x):
        x = torch.relu(self.linear(x)).sin() + x
        torch._dynamo.graph_break()
        return x


def test_recordings_hold_no_memory_between_training_steps():
    model = nn.Sequential(*[BreakLayer() for _ in range(4)]).cuda()
    x = torch.randn(8192, 2048, device="cuda")  # 64 MiB a saved activation, about 800 MiB saved a step
    transform = CudaGraphs()
    step = torch.compile(model, backend=xform.Backend([transform]))

    def train(run):
        model.zero_grad(set_to_none=True)
        run(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    train(model)  # eager first: the default stream's cuBLAS workspaces are allocated before `start`
    start = torch.cuda.memory_allocated()
    for _ in range(4):
        train(step)
    stats = [f.stats for f in transform.functions]
    assert all(s.fallback is None and s.uncaptured_calls == 0 for s in stats)
    assert {s.name.split()[0] for s in stats if s.recordings} == {"forward", "backward"}
    # the forward's saved activations stay in the pool and the backward reads them there: nothing
    # is moved, and in each of the 3 replayed steps only ordinary memory is copied in: the caller's
    # input (to the first layer's forward and, saved, its backward) and the loss's gradient
    assert sum(s.moved_bytes for s in stats) == 0 and sum(s.stuck for s in stats) == 0
    assert sum(s.copied_in_bytes for s in stats) <= 3 * 3 * x.numel() * x.element_size()
    # nothing stays per recording; the bound leaves room for cuBLAS's workspaces of the recording
    # stream, which stayed until warm-ups and recordings cleared them after them (2026-12-07); not
    # tightened since (not re-run on a GPU): the printed figure says what is left now
    left = torch.cuda.memory_allocated() - start
    print(f"allocated after the steps: {left / 2**20:.1f} MiB more than before; reserved "
          f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    assert left < 256 * 2**20


def test_training_step_records_forward_and_backward():
    torch.manual_seed(0)
    model, reference, transform = mlp(), None, CudaGraphs()
    reference = mlp()
    reference.load_state_dict(model.state_dict())
    step = torch.compile(model, backend=xform.Backend([transform]))
    for _ in range(4):
        x = torch.randn(8, 64, device="cuda")
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        step(x).square().mean().backward()
        reference(x).square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)
    kinds = {f.stats.name.split()[0]: f.stats for f in transform.functions}
    assert kinds["forward"].replays == 3 and kinds["backward"].replays == 3


def test_a_transformer_layer_trains_through_replays_as_eagerly():
    # cuBLAS, SDPA's flash kernels and Triton kernels, forward and backward, recorded and replayed
    def layer() -> nn.Module:
        return nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True).cuda().bfloat16()

    torch.manual_seed(0)
    model, reference = layer(), layer()
    reference.load_state_dict(model.state_dict())
    transform = CudaGraphs()
    step = torch.compile(model, backend=xform.Backend([transform]))
    for _ in range(4):
        x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        got = step(x)
        got.float().square().mean().backward()
        expected = reference(x)
        expected.float().square().mean().backward()
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=5e-2, rtol=5e-2)
    stats = [f.stats for f in transform.functions if f.stats.recordings]
    assert {s.name.split()[0] for s in stats} == {"forward", "backward"}
    # `got = step(x)` holds the last output through the next call: torch >= 2.13 moves it out of
    # the way; before, that call runs uncaptured once and the forward copies out from then on
    assert all(s.fallback is None and s.replays + s.uncaptured_calls == 3 for s in stats)
    assert all(s.replays == 3 for s in stats) or not versions.STORAGE_SWAPS_DATA_PTR


def test_a_host_read_inside_the_graph_splits_it_into_regions(request):
    # config.patch, not monkeypatch: on torch 2.11 monkeypatch's undo deletes the config entry
    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(capture_scalar_outputs=True))
    request.addfinalizer(stack.close)

    def f(x, w):
        h = torch.relu(x @ w) * 2 + 1
        scale = h.max().item()
        return (h / scale).sin().cos() @ w

    transform = CudaGraphs(min_region_ops=2)
    step = torch.compile(f, backend=xform.Backend([transform]))
    w = torch.randn(64, 64, device="cuda")
    for _ in range(4):
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(step(x, w), f(x, w), atol=1e-4, rtol=1e-4)
    (skip,) = [s for s in xform.report(f).skips("cudagraphs") if "item" in s.target]
    assert "test_cudagraphs_gpu.py" in skip.target and "scale = h.max().item()" in skip.target
    assert sum(fn.stats.replays for fn in transform.functions) >= 3


@torch.library.custom_op("xform_test::host_scale", mutates_args=())
def host_scale(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.abs().max().item())  # reads the GPU on the host: cannot be recorded


@host_scale.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_recording_that_fails_falls_back_and_the_step_completes(monkeypatch):
    def f(x):
        return host_scale(torch.relu(x) + 1).sin().cos()

    transform = CudaGraphs(min_region_ops=1)
    step = torch.compile(f, backend=xform.Backend([transform]))
    for _ in range(3):
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(step(x), f(x))
    (function,) = transform.functions
    assert function.stats.fallback.startswith("recording failed")
    assert any("recording failed" in n for n in xform.report(f).graphs[0].transforms[0].notes)

    torch._dynamo.reset()
    monkeypatch.setenv("XFORM_STRICT", "1")
    strict_step = torch.compile(f, backend=xform.Backend([CudaGraphs(min_region_ops=1)]))
    strict_step(torch.randn(8, 64, device="cuda"))  # warm-up: uncaptured
    with pytest.raises(Exception, match="captur"):
        strict_step(torch.randn(8, 64, device="cuda"))
