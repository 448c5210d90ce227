"""The cudagraphs transform on the CPU: capture-safety analysis, region partitioning, explanations,
and the replay rules (signatures, copied-out outputs, failed recordings) with the simulated recorder
(simulated_recorder.py, the `recorder` fixture: the CPU as the recorded device, its pool scribbled
over before every replay). The CUDA-only part (the one pool, real capture failures, memory) is in
test_cudagraphs_gpu.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import networkx as nx
import pytest
import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import xform
import xform.transforms.cudagraphs.transform as cudagraphs
from xform._torch import memory, versions
from xform.transforms.cudagraphs.capture_safety import find_breaks
from xform.transforms.cudagraphs.pool_outputs import handouts
from xform.transforms.cudagraphs.recorder import unowned_view
from xform.transforms.cudagraphs.regions import plan_regions
from xform.transforms.cudagraphs.replay import GraphedFunction
from xform.transforms import CudaGraphs

from simulated_recorder import SimulatedRecorder


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.LayerNorm(8))


def compiled(model, transform, handoff="eager"):
    return torch.compile(model, backend=xform.Backend([transform], handoff=handoff))


# --- without a GPU ----------------------------------------------------------------------------


def test_without_a_gpu_the_transform_is_a_no_op_that_says_why():
    model = mlp()
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(model, CudaGraphs())(x), model(x))
    (skip,) = xform.report(model).skips("cudagraphs")
    assert skip.target == "graph" and skip.reason.startswith("no CUDA device here (torch.cuda.is_available() is False)")


# --- analysis on graphs traced with fake CUDA tensors -----------------------------------------


def test_fake_cuda_graph_breaks_name_the_op_the_reason_and_the_fix():
    def f(x):
        a = (x.sin() + 1) @ x
        return a.cpu() * 2, a.cos() * 3

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, 4, device="cuda")
    gm = make_fx(f, tracing_mode="fake")(x)
    breaks = {n.name: b for n, b in find_breaks(gm).items()}
    assert set(breaks) == {"_to_copy", "mul"}
    assert breaks["_to_copy"].reason.startswith("it copies a cuda tensor to the CPU, which waits for the GPU")
    assert breaks["_to_copy"].fix.startswith("keep the tensor on the GPU")
    assert breaks["mul"].reason.startswith("it runs on the CPU: its result is a cpu tensor")
    plan = plan_regions(gm, {n for n in gm.graph.nodes if n.name in breaks}, min_ops=1)
    assert [(r.kind, [n.name for n in r.nodes]) for r in plan.regions] == [
        ("graphed", ["sin", "add", "mm", "cos", "mul_1"]), ("plain", ["_to_copy", "mul"])]


# --- partitioning -----------------------------------------------------------------------------


def _traced(fn):
    return fx.symbolic_trace(fn)


def _regions_run_in_some_order(gm, regions):
    """The oracle, independent of the partitioner: contracting each region into one node leaves
    the graph's data edges acyclic."""
    block = {n: i for i, r in enumerate(regions) for n in r.nodes}
    contracted = nx.DiGraph()
    contracted.add_nodes_from(block.get(n, n) for n in gm.graph.nodes)
    contracted.add_edges_from((block.get(a, a), block.get(n, n)) for n in gm.graph.nodes for a in n.all_input_nodes
                              if block.get(a, a) != block.get(n, n))
    return nx.is_directed_acyclic_graph(contracted)


def _plan(gm, unsafe_names, min_ops=1):
    unsafe = {n for n in gm.graph.nodes if n.name in unsafe_names}
    plan = plan_regions(gm, unsafe, min_ops)
    assert _regions_run_in_some_order(gm, plan.regions)
    return [(r.kind, {n.name for n in r.nodes}) for r in plan.regions]


def test_regions_around_a_break_never_form_a_cycle():
    def diamond(x):
        a = x.sin()
        u = a.cos()  # the unsafe op
        return (a + u).exp()  # reads a directly and through u: a and add cannot share a region

    assert _plan(_traced(diamond), {"cos"}) == [("graphed", {"sin"}), ("plain", {"cos"}), ("graphed", {"add", "exp"})]


def test_independent_branches_join_one_region():
    def branches(x, y):
        u = y.cos()  # unsafe, on a branch of its own
        return x.sin().exp() + 1, u * 2, x.tanh()

    # u * 2 depends on the break only, and the rest not at all: one region holds every safe op
    assert _plan(_traced(branches), {"cos"}) == [("plain", {"cos"}), ("graphed", {"sin", "exp", "add", "mul", "tanh"})]


def test_regions_below_the_threshold_stay_plain_with_the_reason():
    def f(x):
        return x.sin().cos().exp().relu().neg() + x.abs()

    gm = _traced(f)
    plan = plan_regions(gm, {n for n in gm.graph.nodes if n.name == "relu"}, min_ops=3)
    kinds = [(r.kind, r.op_count, r.why_plain) for r in plan.regions]
    assert kinds[0] == ("graphed", 4, None)  # sin, cos, exp and abs (abs joins: nothing unsafe lies between)
    assert kinds[1][0] == "plain" and kinds[1][1] == 3  # relu, then neg and add merged in: 2 ops are too few
    assert plan.regions[1].why_plain is None  # it holds the break, which explains it


# --- the replay rules, on a simulated recorder -------------------------------------------------


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        x = torch.relu(self.linear(x)) + x
        if x.isnan().any().item():  # a graph break: each layer becomes a call of one compiled graph
            raise FloatingPointError("NaN")
        return x


def _assert_grads_match_eager(model: nn.Module, step, x: torch.Tensor) -> None:
    """A training step through `step` and one through `model` eagerly, each from gradients set to
    None: the same gradients."""
    model.zero_grad(set_to_none=True)
    step(x).square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("handoff", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_replays_match_eager_in_inference_and_training(recorder, handoff):
    model, transform = mlp(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform, handoff)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            torch.testing.assert_close(step(x), model(x))
    x = torch.randn(4, 8)
    for _ in range(4):
        _assert_grads_match_eager(model, step, x)
    stats = {f.stats.name.split()[0]: f.stats for f in transform.functions}
    assert stats["inference"].replays == 3
    assert stats["forward"].recordings == 1 and stats["forward"].replays == 3
    assert stats["backward"].recordings == 1 and stats["backward"].replays == 3
    assert xform.report(model).changes("cudagraphs")[0].detail.startswith("the whole graph")


def test_a_later_replay_never_changes_an_earlier_output(recorder):
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    inputs = [torch.randn(4, 8) for _ in range(5)]
    with torch.no_grad():
        outputs = [step(x) for x in inputs]  # every output still held when the next call runs
        for x, out in zip(inputs, outputs):
            torch.testing.assert_close(out, model(x))
    # the warm-up's output is in the pool, where the allocator keeps the recording out of its way;
    # each replay's is handed out there, and moved out (copied once) by the next replay, which
    # writes there: only the last is still in place
    assert [recorder.holds(out) for out in outputs] == [True, False, False, False, True]
    stats = transform.functions[0].stats
    assert (stats.recordings, stats.replays, stats.uncaptured_calls) == (1, 4, 0)  # one recording serves all
    assert stats.moved_bytes == 3 * outputs[0].untyped_storage().nbytes()


def test_outputs_dropped_before_the_next_replay_are_never_copied(recorder):
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 8)
            out = step(x)
            torch.testing.assert_close(out, model(x))
            in_pool = recorder.holds(out)
            del out
    assert in_pool and transform.functions[0].stats.moved_bytes == 0


def test_saved_tensors_and_gradients_survive_later_replays(recorder):
    # two layers, a graph break after each: a layer's backward reads what its forward saved after
    # the other layer's forward and backward replayed (and, in a pool, reused the memory)
    model, transform = nn.Sequential(Layer(), Layer()), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    for _ in range(3):
        model.zero_grad(set_to_none=False)  # .grad accumulates: a replay must not overwrite the held one
        inputs = [torch.randn(4, 8), torch.randn(4, 8)]
        for x in inputs:
            step(x).square().mean().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=False)
        for x in inputs:
            model(x).square().mean().backward()
        for g, p in zip(got, model.parameters()):
            torch.testing.assert_close(g, p.grad)
    # the gradients are the warm-up's outputs, allocated in the pool and held since (owned: no
    # recording placed anything there), and the replays' were added into them
    assert all(any(start <= p.grad.data_ptr() < end and owned for start, end, owned in handouts.alive())
               for p in model.parameters())
    kinds = sorted(f.stats.name.split()[0] for f in transform.functions)
    assert kinds == ["backward", "backward", "forward", "forward"]  # each layer's, one recording each
    assert all(f.stats.recordings == 1 and f.stats.replays == 5 for f in transform.functions)


def test_without_swapping_storages_a_held_output_in_the_way_runs_the_call_uncaptured(recorder, monkeypatch):
    # torch < 2.13 cannot repoint a storage the allocator does not own: the call that would write
    # over a held output runs uncaptured, and its graph copies its outputs out from then on
    monkeypatch.setattr(versions, "STORAGE_SWAPS_DATA_PTR", False)
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    x = torch.randn(4, 8)
    with torch.no_grad():
        step(x), step(x)  # warm-up, recording
        held = step(x)  # a replay's output, in the pool
        expected = held.clone()
        torch.testing.assert_close(step(x), model(x))  # in its way: uncaptured
        torch.testing.assert_close(held, expected)
        stats = transform.functions[0].stats
        assert (stats.replays, stats.uncaptured_calls, stats.stuck) == (2, 1, 1)
        del held
        outputs = [step(x) for _ in range(3)]  # replayed again, each output a copy of its own
    assert stats.replays == 5 and not any(recorder.holds(out) for out in outputs)
    for out in outputs:  # the copies hold the replays' values
        torch.testing.assert_close(out, model(x))
    (note,) = [n for n in xform.report(model).graphs[0].transforms[0].notes if "could not be moved" in n]
    assert "UntypedStorage._swap_data_ptr_, torch >= 2.13" in note and "copies its outputs out from now on" in note


@pytest.mark.parametrize("swaps", [True, False], ids=["torch-2.13", "torch-2.11"])
def test_stale_outputs_error_invalidates_a_held_output_instead_of_copying_it(recorder, monkeypatch, swaps):
    # CUDA Graph Trees' contract, chosen: an output alive where a later replay writes is not copied
    # but invalidated (on a CUDA build reading it then raises the message: test_cudagraphs_gpu.py),
    # with no uncaptured call on either torch; an output fed back as the next call's input is
    # treated as with stale_outputs="copy": the call reads it
    monkeypatch.setattr(versions, "STORAGE_SWAPS_DATA_PTR", swaps)
    invalidated = []
    monkeypatch.setattr(memory, "invalidate", lambda storage, message: invalidated.append(message))
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1, stale_outputs="error")
    step = compiled(model, transform)
    x = torch.randn(4, 8)
    with torch.no_grad():
        outputs = [step(x) for _ in range(6)]  # warm-up, recording and first replay, 4 replays, all held
        torch.testing.assert_close(outputs[-1], model(x))
    stats = transform.functions[0].stats
    # each replay's output is invalidated by the replay after it (the warm-up's is not in the way)
    assert (stats.replays, stats.uncaptured_calls, stats.stuck, stats.moved_bytes) == (5, 0, 0, 0)
    assert stats.invalidated == len(invalidated) == 4
    assert invalidated[0].startswith("xform cudagraphs: this tensor is an output of the CUDA graph of inference 0, "
                                     "and a later replay wrote over its memory")
    assert "Clone it before the next call to the compiled code (out = out.clone())" in invalidated[0]
    with torch.no_grad():
        fed = outputs[-1]
        for _ in range(3):  # the output is the next call's input
            expected = model(fed)
            fed = step(fed)
            torch.testing.assert_close(fed, expected)
    if swaps:  # moved out of the way, each; torch 2.11 cannot move it: one call uncaptured, then copies
        assert (stats.invalidated, stats.uncaptured_calls) == (4, 0) and stats.moved_bytes > 0


def test_stale_outputs_error_trains_as_eagerly_when_nothing_is_held_across_steps(recorder, monkeypatch):
    # a training loop that sets gradients to None each step holds no output through a later
    # replay: with stale_outputs="error" nothing is invalidated, nothing moved, and a layer's
    # backward still reads what its forward saved, after the other layer replayed
    invalidated = []
    monkeypatch.setattr(memory, "invalidate", lambda storage, message: invalidated.append(message))
    model, transform = nn.Sequential(Layer(), Layer()), CudaGraphs(min_region_ops=1, stale_outputs="error")
    step = compiled(model, transform)
    for _ in range(4):
        _assert_grads_match_eager(model, step, torch.randn(4, 8))
    assert len(transform.functions) == 4  # each layer's forward and backward
    assert all(f.stats.replays == 3 and f.stats.moved_bytes == 0 for f in transform.functions)
    assert invalidated == []


def test_a_recording_made_while_an_output_is_held_moves_it_out_first(recorder):
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    x = torch.randn(4, 8)
    with torch.no_grad():
        step(x), step(x)  # warm-up, recording
        held = step(x)  # a replay's output, which the allocator believes free
        expected = held.clone()
        model[0].weight.data = torch.randn(32, 8)  # a new signature: its first call runs uncaptured,
        for _ in range(2):  # its second is recorded
            torch.testing.assert_close(step(x), model(x))
    torch.testing.assert_close(held, expected)
    assert transform.functions[0].stats.recordings == 2 and not recorder.holds(held)


def test_an_input_the_caller_fills_again_in_place_is_read_where_it_is(recorder):
    """A buffer at the address of the first call is read there, as module state is: nothing is copied in,
    and each replay reads what the caller wrote into it since."""
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(5):
            x.copy_(torch.randn(4, 8))
            torch.testing.assert_close(step(x), model(x))
    (stats,) = [f.stats for f in transform.functions]
    assert (stats.recordings, stats.replays, stats.copied_in_bytes, stats.uncaptured_calls) == (1, 4, 0, 0)


def test_weights_passed_as_plain_tensors_are_read_in_place(recorder):
    """Weights given as arguments (`torch.func.functional_call`, a server's weight dict) are neither
    parameters nor buffers; found where the first call found them, they are read in place: nothing is
    copied in (CUDA Graph Trees copy such inputs into their pool, for every recording)."""
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1)
    weights = {name: p.detach() for name, p in model.named_parameters()}
    step = compiled(lambda w, x: torch.func.functional_call(model, w, (x,)), transform)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(5):
            x.copy_(torch.randn(4, 8))
            torch.testing.assert_close(step(weights, x), model(x))
        weights["0.weight"].mul_(2)  # written in place: the replay reads the new values
        torch.testing.assert_close(step(weights, x), model(x))
    (stats,) = [f.stats for f in transform.functions]
    assert (stats.recordings, stats.replays, stats.copied_in_bytes, stats.uncaptured_calls) == (1, 5, 0, 0)


def test_inputs_that_move_are_copied_in_from_the_next_recording_on(recorder):
    """A call with the input elsewhere records once more, copying the inputs in; the recording that reads
    them in place still serves calls at their first address. Both give the model's results."""
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    x = torch.randn(4, 8)
    with torch.no_grad():
        step(x), step(x)  # warm-up, recording in place
        for call in range(6):
            arg = x if call % 2 else torch.randn(4, 8)  # elsewhere, then the first tensor again
            torch.testing.assert_close(step(arg), model(arg))
    (stats,) = [f.stats for f in transform.functions]
    assert (stats.recordings, stats.uncaptured_calls) == (2, 0)
    assert stats.copied_in_bytes == 3 * x.numel() * x.element_size()  # the 3 calls with a fresh tensor


def test_a_layer_reads_the_previous_layers_output_in_place(recorder):
    model, transform = nn.Sequential(*[Layer() for _ in range(3)]).eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            torch.testing.assert_close(step(x), model(x))
    (layers,) = [f for f in transform.functions if f.stats.recordings == 3]
    # the first call warms up (each layer's first call runs uncaptured), the second records: only
    # layer 0 copies its input in (the caller's), in its 3 replays; layers 1 and 2 read theirs where
    # the layer before left it, in the pool
    assert layers.stats.copied_in_bytes == 3 * x.numel() * x.element_size()
    assert layers.stats.moved_bytes == 0


def _plus_one_then_twice(recorder, second_recorder=None, seen=None):
    """Two region functions as Inductor compiles them (each takes its list of inputs over): the
    first makes y = x + 1 in the pool, the second consumes y (frees it) to make 2 y. `seen`, when
    given, gets per run of the second whether `seen["y"]` (a weak reference to the caller's y) had
    died by then, that is, whether anything but the region held it."""
    def plus_one(args):
        return [args.pop() + 1]

    def twice(args):
        (y,) = args
        args.clear()
        out = y * 2
        del y
        if seen is not None:
            seen["freed"].append(seen["y"].expired())
        return [out]

    not_state = lambda index, t: False  # noqa: E731
    return (GraphedFunction(plus_one, "forward 0", recorder, not_state),
            GraphedFunction(twice, "backward 1", second_recorder or recorder, not_state))


def _chain(first, second, x, *, hold=False):
    (y,) = first([x])
    args = [y]
    if not hold:
        del y
    return second(args)[0]


def test_an_input_the_region_consumes_is_freed_as_it_runs(recorder):
    # a backward's saved activations die inside it, in the warm-up, the recording and the replays
    # alike: the pool need not hold them and what the backward allocates after their last use
    seen = {"freed": []}
    first, second = _plus_one_then_twice(recorder, seen=seen)
    for _ in range(4):  # warm-up, recording, replays
        x = torch.randn(8)
        (y,) = first([x])
        seen["y"] = StorageWeakRef(y.untyped_storage())
        args = [y]
        del y
        torch.testing.assert_close(second(args)[0], (x + 1) * 2)
    assert (second.stats.recordings, second.stats.replays) == (1, 3)
    assert len(seen["freed"]) >= 4 and all(seen["freed"])


def test_an_output_where_a_consumed_input_lay_is_an_output_of_its_own(recorder):
    # the region frees its input, and the allocator gives that memory to an output: the output is
    # no view of the input (it is tracked as a handout), though its address is the input's
    memory = torch.zeros(8)

    def replace(args):
        (y,) = args
        args.clear()
        total = y.sum()
        del y
        return [unowned_view(memory).fill_(total)]

    function = GraphedFunction(replace, "backward 0", recorder, lambda index, t: False)
    (out,) = function([unowned_view(memory).fill_(1.0)])
    torch.testing.assert_close(out, torch.full((8,), 8.0))
    assert (memory.data_ptr(), memory.data_ptr() + 32, True) in handouts.alive()


@pytest.mark.parametrize("swaps", [True, False])
def test_a_consumed_input_the_caller_still_holds_keeps_its_values(recorder, monkeypatch, swaps):
    # recorded while nothing else held y, the graph writes over y's memory after its last read; a
    # later caller holding y gets it moved out first (or, where storages cannot be repointed, the
    # call runs uncaptured)
    monkeypatch.setattr(versions, "STORAGE_SWAPS_DATA_PTR", swaps)
    first, second = _plus_one_then_twice(recorder)
    for _ in range(3):
        _chain(first, second, torch.randn(8))
    x = torch.randn(8)
    (y,) = first([x])
    expected = y.clone()
    torch.testing.assert_close(second([y])[0], (x + 1) * 2)
    torch.testing.assert_close(y, expected)
    if swaps:
        assert second.stats.moved_bytes == y.untyped_storage().nbytes() and second.stats.uncaptured_calls == 0
    else:
        assert (second.stats.stuck, second.stats.uncaptured_calls) == (1, 1)


def test_a_failed_recording_of_a_region_that_consumes_its_input_still_runs_the_call(recorder):
    failing = SimulatedRecorder(fail=RuntimeError("operation not permitted when stream is capturing"))
    first, second = _plus_one_then_twice(recorder, failing)
    for _ in range(3):
        x = torch.randn(8)
        torch.testing.assert_close(_chain(first, second, x), (x + 1) * 2)
    assert second.stats.fallback.startswith("recording failed") and first.stats.replays == 2


def test_a_parameter_moved_through_data_is_read_from_its_new_place(recorder):
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            step(x)
        model[0].weight.data = torch.randn(32, 8)  # a new address; Dynamo's guards do not see it
        for _ in range(2):  # run uncaptured, then recorded
            torch.testing.assert_close(step(x), model(x))
    assert transform.functions[0].stats.recordings == 2


def test_a_failed_recording_falls_back_and_strict_mode_raises(monkeypatch):
    sim = SimulatedRecorder(fail=RuntimeError("operation not permitted when stream is capturing"))
    monkeypatch.setattr(cudagraphs, "available_recorder", lambda: sim)
    model, transform = mlp().eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            torch.testing.assert_close(step(x), model(x))
    assert transform.functions[0].stats.fallback == ("recording failed: RuntimeError: operation not permitted when "
                                                     "stream is capturing")
    notes = xform.report(model).notes()
    assert notes == ["inference 0: runs uncaptured from now on: recording failed: RuntimeError: operation not "
                     "permitted when stream is capturing"]

    torch._dynamo.reset()
    monkeypatch.setenv("XFORM_STRICT", "1")
    strict_step = compiled(mlp().eval(), CudaGraphs(min_region_ops=1))
    with torch.no_grad():
        strict_step(x)  # the warm-up runs uncaptured
        with pytest.raises(RuntimeError, match="stream is capturing"):
            strict_step(x)


@pytest.mark.parametrize("handoff", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_host_read_inside_the_graph_splits_it_and_is_explained(recorder, request, handoff):
    # config.patch, not monkeypatch: on torch 2.11 monkeypatch's undo deletes the config entry
    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(capture_scalar_outputs=True))
    request.addfinalizer(stack.close)

    def f(x, w):
        h = torch.relu(x @ w) * 2 + 1
        scale = h.max().item()
        return (h / scale).sin().cos() @ w

    transform = CudaGraphs(min_region_ops=2)
    step = compiled(f, transform, handoff)
    w = torch.randn(8, 8)
    for _ in range(4):
        x = torch.randn(4, 8)
        torch.testing.assert_close(step(x, w), f(x, w))
    record = xform.report(f).graphs[-1].transforms[0]  # f's code is shared by both parametrizations
    (item,) = [s for s in record.skips if "item" in s.target]
    assert item.target.startswith("Tensor.item (node item) at test_cudagraphs.py:")
    assert item.target.endswith("in f: scale = h.max().item()")
    assert item.reason.startswith(".item() copies a GPU value into Python, which waits for the GPU. Fix: keep the value")
    graphed = record.changes
    assert len(graphed) == 2 and all("graphed" in c.target for c in graphed)
    assert len(transform.functions) == 2 and all(fn.stats.replays == 3 for fn in transform.functions)  # after the warm-up
    truediv = next(s for s in record.skips if "truediv" in s.target)
    assert truediv.reason.startswith("it uses 'item', a number read from the GPU on the host")


def test_dynamic_shapes_leave_the_graph_unrecorded_and_say_so(recorder):
    model = mlp()
    step = torch.compile(model, backend=xform.Backend([CudaGraphs()], handoff="eager"), dynamic=True)
    step(torch.randn(4, 8))
    (skip,) = xform.report(model).skips("cudagraphs")
    assert skip.reason.startswith("the graph was compiled for dynamic shapes (s") and "dynamic=False" in skip.reason


class Length:
    """A cache length kept as a Python int the step increments, as Hugging Face's sliding-window
    cache keeps one: Dynamo makes it a SymInt input from the second value on."""

    def __init__(self) -> None:
        self.value = 0


class CountsTokens(nn.Module):
    def __init__(self, scale_by_length: bool = False) -> None:
        super().__init__()
        self.fc, self.scale_by_length = nn.Linear(8, 8), scale_by_length

    def forward(self, x, length):
        length.value += 1
        y = self.fc(x).relu().sin()
        return y * length.value if self.scale_by_length else y


def test_a_number_only_host_arithmetic_reads_leaves_the_graph_recordable(recorder):
    """The int is a dynamic input, but only `length.value + 1` reads it, on the host: the tensor work
    has static sizes and is recorded, the arithmetic runs between the replays."""
    model, transform = CountsTokens(), CudaGraphs()
    step, length = compiled(model, transform), Length()
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(6):
            torch.testing.assert_close(step(x, length), model.fc(x).relu().sin())
    assert length.value == 6
    assert xform.report(model).skips("cudagraphs") == []
    assert sum(f.stats.replays for f in transform.functions) >= 2 and recorder.recorded >= 1


def test_a_number_a_tensor_op_reads_keeps_the_dynamic_graph_unrecorded(recorder):
    model, transform = CountsTokens(scale_by_length=True), CudaGraphs()
    step, length = compiled(model, transform), Length()
    x = torch.randn(2, 8)
    with torch.no_grad():
        for call in range(1, 4):
            torch.testing.assert_close(step(x, length), model.fc(x).relu().sin() * call)
    reasons = [s.reason for s in xform.report(model).skips("cudagraphs")]
    assert reasons and all(r.startswith("the graph was compiled for dynamic shapes (") for r in reasons), reasons


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, out):
        self.calls.add_(1)  # a buffer
        out.copy_(x.sin() * self.calls)  # an argument
        return out.cos().exp().relu()


def _functions_of(transform):
    return [f.stats for f in transform.functions]


def _written_in_place_five_times(handoff: str, mark: bool):
    """Counter's step called five times on one `out` (marked with mark_static_address or not): written
    in place by one recording, nothing copied. Returns the step, the transform, x and out."""
    model, transform = Counter(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform, handoff=handoff)
    x, out = torch.randn(4), torch.zeros(4)
    if mark:
        torch._dynamo.mark_static_address(out)
    with torch.no_grad():
        for call in range(1, 6):
            result = step(x, out)
            torch.testing.assert_close(out, x.sin() * call)
            torch.testing.assert_close(result, out.cos().exp().relu())
    assert not xform.report(model).skips("cudagraphs")
    (stats,) = _functions_of(transform)
    assert stats.recordings == 1 and stats.replays >= 2 and stats.copied_in_bytes == 0
    return step, transform, x, out


@pytest.mark.parametrize("handoff", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_an_argument_written_in_place_is_recorded_and_the_callers_tensor_written(recorder, handoff):
    """Unmarked, an argument the step writes is read and written in place while the caller passes the
    same tensor (a cache it allocated once), as a buffer is; a tensor at a new address each call is
    copied in and, after the replay, copied back (its copy held through the recording, where a
    copied input's memory is otherwise reused after its last read: the simulated recorder scribbles
    over those): written every time, never a stale copy, and no recording per call. (Before, the
    write was a break and the copy ran outside the graphs.)"""
    step, transform, x, out = _written_in_place_five_times(handoff, mark=False)
    with torch.no_grad():
        for call in range(6, 12):  # a new tensor each call
            fresh = torch.full((4,), -1.0)
            result = step(x, fresh)
            torch.testing.assert_close(fresh, x.sin() * call)
            torch.testing.assert_close(result, fresh.cos().exp().relu())
        step(x, out)
        torch.testing.assert_close(out, x.sin() * 12)
    (stats,) = _functions_of(transform)
    assert stats.recordings == 2 and stats.copied_in_bytes > 0 and stats.uncaptured_calls == 0
    # under Inductor the write is in the recorded graph; eagerly AOTAutograd writes it back after the call
    assert (stats.copied_back_bytes > 0) == (handoff == "inductor")


@pytest.mark.parametrize("handoff", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_an_argument_marked_static_is_written_in_place_and_a_moved_one_still_written(recorder, handoff):
    """Marked with mark_static_address, the argument is recorded in place, as a buffer is: the replays
    write the caller's tensor itself; another tensor there is recorded for, or runs uncaptured, and
    is written all the same, never a stale copy."""
    step, transform, x, out = _written_in_place_five_times(handoff, mark=True)
    with torch.no_grad():
        for call in range(6, 9):  # another tensor, then the first again: each written, never a stale copy
            other = torch.full((4,), -1.0)
            torch._dynamo.mark_static_address(other)
            step(x, other)
            torch.testing.assert_close(other, x.sin() * call)
        step(x, out)
        torch.testing.assert_close(out, x.sin() * 9)


class StaticCache(nn.Module):
    """A decode step writing its key into a cache the caller owns, as Hugging Face's static cache
    does (`index_copy_` into a tensor marked with `mark_static_address`)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(8, 8)

    def forward(self, x, cache, position):
        cache.index_copy_(0, position, self.k(x))
        return (cache.sum(0) * x).relu()


@pytest.mark.parametrize("handoff", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_static_kv_cache_is_no_break_and_is_written_in_place(recorder, handoff):
    """Under Inductor the write stays in the recorded graph (AOTAutograd keeps it there), which must
    then be handed the cache itself; eagerly AOTAutograd writes it back after the call."""
    model, transform = StaticCache().eval(), CudaGraphs(min_region_ops=1)
    step = compiled(model, transform, handoff=handoff)
    cache, expected_cache = torch.zeros(6, 8), torch.zeros(6, 8)
    torch._dynamo.mark_static_address(cache)
    position = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        for token in range(6):
            x = torch.randn(1, 8)
            position.fill_(token)
            got = step(x, cache, position)
            torch.testing.assert_close(got, model(x, expected_cache, position))
            torch.testing.assert_close(cache, expected_cache)
    assert not xform.report(model).skips("cudagraphs")
    (stats,) = _functions_of(transform)
    assert stats.recordings == 1 and stats.replays == 5 and stats.uncaptured_calls == 0


GENERATOR = torch.Generator().manual_seed(0)


def test_a_user_generator_and_an_op_tagged_unsafe_are_breaks():
    @torch.library.custom_op("xform_test::tagged", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
    def tagged(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    graph = fx.Graph()  # by hand: torch 2.11's tracer cannot hold a Generator argument
    x = graph.placeholder("x")
    drawn = graph.call_function(torch.rand, ((4,),), {"generator": GENERATOR})
    graph.output(graph.call_function(torch.add, (graph.call_function(torch.ops.xform_test.tagged.default, (x,)), drawn)))
    gm = SimpleNamespace(graph=graph)  # no GraphModule: its code could not print a Generator either
    breaks = {b.node: b for b in find_breaks(gm, device_type="cpu").values()}
    assert breaks["rand"].reason.startswith("it draws random numbers from a torch.Generator you passed")
    assert breaks["tagged_default"].reason == "its author tagged xform_test.tagged.default torch.Tag.cudagraph_unsafe"


@torch.library.custom_op("xform_test::scaled_by_offsets", mutates_args=())
def scaled_by_offsets(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x times the sum of `offsets`, whose backward reads `offsets` on the host, as transformers'
    grouped_mm_fallback does: AOTAutograd cannot trace that backward with fake tensors."""
    return x * offsets.sum()


scaled_by_offsets.register_fake(lambda x, offsets: torch.empty_like(x))
scaled_by_offsets.register_autograd(
    lambda ctx, grad: (grad * sum(ctx.offsets.tolist()), None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "offsets", inputs[1]))


@torch.library.custom_op("xform_test::unsafe_cos", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def unsafe_cos(x: torch.Tensor) -> torch.Tensor:
    return x.cos()


unsafe_cos.register_fake(lambda x: torch.empty_like(x))


class HostOffsets(nn.Module):
    def __init__(self, split: bool = False) -> None:
        super().__init__()
        self.linear, self.split = nn.Linear(16, 16), split
        self.register_buffer("offsets", torch.tensor([1.0, 2.0]))

    def forward(self, x):
        if self.split:
            x = unsafe_cos(x)  # a break: the graph splits into regions around it
        return scaled_by_offsets(torch.relu(self.linear(x)), self.offsets).sin()


# AOTAutograd's trace of the backward reports the failure it then raises, in anomaly mode
@pytest.mark.filterwarnings("ignore:Error detected in GeneratedBackwardFor:UserWarning")
@pytest.mark.parametrize("split", [False, True], ids=["whole-graph", "split-graph"])
def test_a_graph_aotautograd_cannot_trace_runs_without_cuda_graphs_and_says_why(recorder, monkeypatch, split):
    """Found in the whole graph as it compiles, or in a region of a split one as it first runs: the
    graph (region) runs without CUDA graphs, the report says why, and no transform is dropped, not
    even with XFORM_STRICT=1 (Dynamo would have broken the graph there, and the cast with it)."""
    monkeypatch.setenv("XFORM_STRICT", "1")
    model, x = HostOffsets(split), torch.randn(8, 16)
    step = torch.compile(model, backend=xform.Backend(["cast:bf16", CudaGraphs(min_region_ops=1)], handoff="eager"))
    for _ in range(3):
        _assert_grads_match_eager(model, step, x)
    report = xform.report(model)
    assert report.failures() == [] and [c.target for c in report.changes("cast") if c.kind == "layer"] == ["linear"]
    (skip,) = [s for s in report.skips("cudagraphs") if "AOTAutograd" in s.reason]
    assert skip.target.startswith("region ") and skip.target.endswith(" ops, graphed)") if split else skip.target == "graph"
    assert skip.reason.startswith("AOTAutograd cannot trace it (DataDependentOutputException: "
                                  "aten._local_scalar_dense.default): an op in it, or in its backward, reads a tensor's "
                                  "values on the host")
    runs = ("found when it first ran, after Dynamo's compile, it runs as written: neither compiled nor recorded"
            if split else "it runs without CUDA graphs")
    assert f"where Dynamo would break the graph; {runs}. Fix: call that op outside" in skip.reason, skip.reason
    assert skip.target not in [c.target for c in report.changes("cudagraphs")]


# --- conflicts (bad options: test_options.py) ----------------------------------------------------------------------


def test_reduce_overhead_mode_with_the_transform_is_refused():
    with pytest.raises(ValueError, match=r"transform 'cudagraphs' needs Inductor's triton.cudagraphs=False, but the "
                                         r"mode or options ask for True \(mode='reduce-overhead' records CUDA graphs"):
        xform.Backend(["cudagraphs"], mode="reduce-overhead")


def test_one_graph_serving_many_layers_records_each_layer(recorder):
    model, transform = nn.Sequential(*[Layer() for _ in range(6)]).eval(), CudaGraphs()
    step = compiled(model, transform)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            torch.testing.assert_close(step(x), model(x))
    layer_graph = next(f for f in transform.functions if f.stats.recordings > 1)
    # the first call runs each layer uncaptured (a warm-up per parameters), then one recording each
    assert (layer_graph.stats.recordings, layer_graph.stats.uncaptured_calls) == (6, 0)


class DocumentAttention(nn.Module):
    """Attention with a document mask of per-token ids the caller passes."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x, ids):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(x.shape[1])
        mask = (ids[:, None, :, None] == ids[:, None, None, :]) & (pos[:, None] >= pos[None, :])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1)


def test_a_document_mask_built_before_the_call_keeps_the_graph_one_region(recorder):
    """The block mask of the caller's ids is built outside the graph (and reused while they are
    unchanged), so the graph records whole; a replay reads the block mask of the ids it is given."""
    model, transform = DocumentAttention().eval(), CudaGraphs(min_region_ops=1)
    step = torch.compile(model, backend=xform.Backend(["flex-attention", transform], handoff="eager"))
    x = torch.randn(2, 256, 16)
    ids = torch.randint(0, 3, (2, 256)).sort(-1).values
    with torch.no_grad():
        for call in range(5):
            if call == 3:
                ids[:, 100:] += 1  # the same tensor, written in place: its block mask is built again
            torch.testing.assert_close(step(x, ids), model(x, ids), atol=2e-5, rtol=2e-5)
        other = torch.zeros_like(ids)
        torch.testing.assert_close(step(x, other), model(x, other), atol=2e-5, rtol=2e-5)
    (change,) = xform.report(model).changes("cudagraphs")
    assert change.detail.startswith("the whole graph")
    (stats,) = [f.stats for f in transform.functions]
    # the first recording reads x, the ids and their block mask where the caller's first call had them;
    # the block mask built again for the written ids is elsewhere, so the second recording copies the
    # inputs in, and serves the other ids too
    assert stats.recordings == 2 and stats.replays >= 3


def test_a_bitwise_and_of_an_argument_is_not_a_write_into_it():
    captured = []
    torch.compile(lambda x, y: (x & y).float() * 2, backend=lambda gm, _: captured.append(gm) or gm.forward,
                  fullgraph=True)(torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool))
    assert find_breaks(captured[0], device_type="cpu") == {}  # operator.and_ is `x & y`, not `x &= y`
