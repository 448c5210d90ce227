"""Faults: a transform that throws is dropped for that graph, its changes to the model are undone,
the step completes, the report names what failed; XFORM_STRICT=1 raises instead."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

import xform
from xform.transforms import Cast
from models import mlp
from test_transform_protocol import Broken


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.delenv("XFORM_STRICT", raising=False)


class ReplacesThenFails(xform.Transform):
    """Replaces every weight by a doubled copy, then fails in its graph hook: the replacement must go."""

    name = "replaces-then-fails"

    def transform_parameters(self, graph, record):
        for param in graph.parameters:
            graph.replace_parameter(param, nn.Parameter(param.tensor.detach() * 2), by=self.name)

    def transform_graph(self, graph, record):
        raise RuntimeError("bug in the transform")


def test_model_changes_of_a_failed_transform_are_undone():
    model = mlp()
    weights = [p for p in model.parameters()]
    x = torch.randn(2, 16)
    expected = model(x)

    out = xform.compile(model, ReplacesThenFails(), handoff="eager")(x)

    assert all(a is b for a, b in zip(model.parameters(), weights))
    torch.testing.assert_close(out, expected)
    (failure,) = xform.report(model).failures()
    assert failure[0] == "replaces-then-fails" and "RuntimeError: bug in the transform" in failure[1]
    assert xform.report(model).graphs[0].guard_changes == []


def test_a_weight_torchao_quantized_is_put_back_when_a_later_transform_fails():
    """torchao assigns the quantized weight to the module itself: undo must restore the original, so that
    the graph compiled again without the failed transform quantizes the original weight once, not the
    quantized weight a second time (which raised inside torchao on the H100)."""
    model = nn.Sequential(nn.Linear(128, 128, bias=False)).bfloat16()
    alone = copy.deepcopy(model)
    x = torch.randn(4, 128, dtype=torch.bfloat16)

    out = xform.compile(model, "quantize:nvfp4-weight-only", Broken(), handoff="eager")(x)

    assert [f[0] for f in xform.report(model).failures()] == ["broken"]
    assert [c.target for c in xform.report(model).changes("quantize")] == ["0"]
    torch.testing.assert_close(out, xform.compile(alone, "quantize:nvfp4-weight-only", handoff="eager")(x),
                               rtol=0, atol=0)


class FailsInAot(xform.Transform):
    name = "fails-in-aot"

    def transform_aot_graph(self, gm, kind, record):
        raise IndexError("aot bug")


@pytest.mark.parametrize("handoff", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_failure_inside_the_handoff_compile_is_attributed_and_survived(handoff):
    model = mlp()
    x = torch.randn(2, 16)
    out = xform.compile(model, "cast:bf16", FailsInAot(), handoff=handoff)(x)
    (failure,) = xform.report(model).failures()
    assert failure[0] == "fails-in-aot"
    assert re.fullmatch(r"failed in transform_aot_graph: IndexError: aot bug \(raised at test_faults\.py:\d+ in "
                        r"transform_aot_graph\); this graph was compiled without it \(XFORM_STRICT=1 raises instead\)",
                        failure[1]), failure[1]
    torch.testing.assert_close(out, model(x))  # cast still applied, and consistent with eager
    assert model[0].weight.dtype == torch.bfloat16


class FailsWrapping(xform.Transform):
    name = "fails-wrapping"

    def wrap_compiled(self, compiled, graph, record):
        raise TypeError("wrapper bug")


def test_a_failing_wrapper_is_dropped():
    model = mlp()
    x = torch.randn(2, 16)
    out = xform.compile(model, FailsWrapping(), handoff="eager")(x)
    assert xform.report(model).failures()[0][0] == "fails-wrapping"
    torch.testing.assert_close(out, model(x))


def test_bad_input_errors_are_not_swallowed():
    model = nn.Sequential(nn.Linear(128, 128)).bfloat16()
    with pytest.raises(Exception, match="recipe 'nvfp4' needs an SM100"):
        xform.compile(model, "quantize:nvfp4", handoff="eager")(torch.randn(2, 128, dtype=torch.bfloat16))


def test_strict_mode_raises_the_failure_and_leaves_the_model_alone(monkeypatch):
    monkeypatch.setenv("XFORM_STRICT", "1")
    model = mlp()
    weights = list(model.parameters())
    with pytest.raises(Exception, match=r"transform 'replaces-then-fails' failed in transform_graph"):
        xform.compile(model, ReplacesThenFails(), handoff="eager")(torch.randn(2, 16))
    assert all(a is b for a, b in zip(model.parameters(), weights))


class AsksDynamoToRestart(xform.Transform):
    """Raises Dynamo's restart signal once, as AOTAutograd does from inside a backend when a float
    read on the host must become a tensor: it must reach Dynamo, not count as a failure."""

    name = "asks-dynamo-to-restart"
    raised = 0

    def transform_graph(self, graph, record):
        if not self.raised:
            type(self).raised += 1
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()


def test_dynamos_restart_signal_passes_through_and_is_no_failure(monkeypatch):
    monkeypatch.setenv("XFORM_STRICT", "1")  # a failure would raise
    model, x = mlp(), torch.randn(2, 16)
    torch.testing.assert_close(xform.compile(model, AsksDynamoToRestart(), handoff="eager")(x), model(x))
    assert AsksDynamoToRestart.raised == 1 and xform.report(model).failures() == []


def test_a_failure_says_where_it_was_raised_and_the_line_of_xform_on_the_way():
    """Raised inside torch from xform's code: both lines, so the report alone is enough to start a fix."""
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from xform.faults import raised_at
    from xform.fx_rewrite import insert_call

    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    with FakeTensorMode():
        a.meta["example_value"], b.meta["example_value"] = torch.empty(2, 3), torch.empty(4, 5)
    with pytest.raises(RuntimeError) as caught:
        insert_call(graph, "call_function", torch.matmul, (a, b))  # shapes that cannot be multiplied
    where = raised_at(caught.value)
    assert re.fullmatch(r"raised at torch/\S+\.py:\d+ in \w+, from xform/fx_rewrite\.py:\d+ in insert_call",
                        where), where


def test_a_dropped_transform_warns_once_per_model_and_heads_the_report():
    """A model run without a transform asked for is loud: a TransformDropped warning, once per model
    however many graphs dropped it, and the report's first line."""
    from xform.faults import TransformDropped

    model = mlp()
    compiled = xform.compile(model, Broken(), handoff="eager", dynamic=False)
    with pytest.warns(TransformDropped, match=r"xform: compiled without transform 'broken': xform's own code failed "
                                              r"in transform_graph: KeyError: 'boom' .*XFORM_STRICT=1 raises instead"):
        compiled(torch.randn(2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TransformDropped)
        compiled(torch.randn(3, 16))  # a second graph (another batch size) drops it again: no second warning
    assert len(xform.report(model).graphs) == 2
    assert str(xform.report(model)).splitlines()[0] == (
        "xform report: 2 graph(s); compiled WITHOUT 'broken': xform failed in it (FAILED below)")
    with pytest.warns(TransformDropped):  # another model: warned again
        xform.compile(mlp(), Broken(), handoff="eager")(torch.randn(2, 16))


def test_a_failure_in_torch_names_xforms_line_not_the_torch_package_passing_the_call_on():
    """xform/_torch/ only passes calls on to torch: the line named as xform's is the caller's."""
    from xform.faults import raised_at
    from xform.transforms.quantize.probe import blockwise_sqnr

    with pytest.raises(ValueError) as raised:  # the CPU's _scaled_mm takes no block scales
        blockwise_sqnr(torch.device("cpu"))
    assert re.fullmatch(r"raised at xform/_torch/dispatch\.py:\d+ in scaled_mm, "
                        r"from xform/transforms/quantize/probe\.py:\d+ in blockwise_sqnr", raised_at(raised.value))


def test_a_transform_failing_after_a_cast_was_traced_again_leaves_the_cast_alone(monkeypatch):
    """cast changes the weights' dtype, so the frame is traced again from the cast model; a later
    transform failing there is dropped as any is, the cast kept, and no third trace is needed."""
    model, alone = mlp(), mlp()
    alone.load_state_dict(model.state_dict())
    x = torch.randn(2, 16)
    traces = []
    call = xform.Backend.__call__
    monkeypatch.setattr(xform.Backend, "__call__", lambda self, gm, inputs: (traces.append(1), call(self, gm, inputs))[1])

    with pytest.warns(xform.faults.TransformDropped, match="'broken'"):
        out = xform.compile(model, "cast:bf16", Broken(), handoff="eager")(x)

    assert len(traces) == 2
    assert [f[0] for f in xform.report(model).failures()] == ["broken"]
    assert [c.target for c in xform.report(model).changes("cast")] == ["0", "2"]
    assert model[0].weight.dtype == torch.bfloat16
    torch.testing.assert_close(out, xform.compile(alone, "cast:bf16", handoff="eager")(x), rtol=0, atol=0)


class CastsThenFails(Cast):
    """Casts (so the frame is traced again), then fails in its graph hook on the retrace."""

    name = "casts-then-fails"

    def transform_graph(self, graph, record):
        raise RuntimeError("bug after the cast")


def test_the_transform_that_asked_for_the_retrace_failing_is_undone_and_traced_once_more(monkeypatch):
    model = mlp()
    weights, x = list(model.parameters()), torch.randn(2, 16)
    expected = model(x)
    traces = []
    call = xform.Backend.__call__
    monkeypatch.setattr(xform.Backend, "__call__", lambda self, gm, inputs: (traces.append(1), call(self, gm, inputs))[1])

    with pytest.warns(xform.faults.TransformDropped, match="'casts-then-fails'"):
        out = xform.compile(model, CastsThenFails(), handoff="eager")(x)

    assert len(traces) == 3  # cast, the retrace where it fails, the trace of the model put back
    assert all(a is b for a, b in zip(model.parameters(), weights))
    assert [f[0] for f in xform.report(model).failures()] == ["casts-then-fails"]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
