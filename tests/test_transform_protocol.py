"""The Transform hooks run in data-flow order, only when overridden, and order constraints hold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import xform
from models import mlp


class Recorder(xform.Transform):
    """Overrides every hook and logs each call into a shared list."""

    name = "recorder"

    def __init__(self, log: list, tag: str = "recorder") -> None:
        self.log = log
        self.tag = tag

    def transform_parameters(self, graph, record):
        self.log.append((self.tag, "parameters", len(graph.parameters)))

    def transform_graph(self, graph, record):
        self.log.append((self.tag, "graph", graph.node_count()))

    def transform_aot_graph(self, gm, kind, record):
        self.log.append((self.tag, "aot", kind))

    def transform_guards(self, guards, record):
        self.log.append((self.tag, "guards", len(guards)))

    def wrap_compiled(self, compiled, graph, record):
        self.log.append((self.tag, "wrap", None))

        def counted(*args):
            self.log.append((self.tag, "call", None))
            return compiled(*args)

        return counted


class Second(Recorder):
    name = "second"


@pytest.mark.parametrize("handoff", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_hooks_run_in_data_flow_order_then_per_transform_in_list_order(handoff):
    log: list = []
    model = mlp()
    compiled = xform.compile(model, Recorder(log, "a"), Second(log, "b"), handoff=handoff)
    compiled(torch.randn(2, 16)).sum().backward()

    stages = [(tag, stage) for tag, stage, _ in log]
    assert stages[:6] == [("a", "parameters"), ("b", "parameters"), ("a", "graph"), ("b", "graph"),
                          ("a", "aot"), ("b", "aot")]
    assert ("a", "aot", "forward") in log and ("a", "aot", "backward") in log
    assert stages.index(("a", "guards")) < stages.index(("b", "guards")) < stages.index(("a", "wrap"))
    assert stages.index(("a", "wrap")) < stages.index(("b", "wrap")) < stages.index(("b", "call"))
    assert ("a", "parameters", 4) in log


def test_inference_graphs_are_labelled_inference():
    log: list = []
    with torch.no_grad():
        xform.compile(mlp(), Recorder(log), handoff="eager")(torch.randn(2, 16))
    assert [kind for _, stage, kind in log if stage == "aot"] == ["inference"]


def test_hooks_not_overridden_are_not_called():
    class GraphOnly(xform.Transform):
        name = "graph-only"

        def transform_graph(self, graph, record):
            record.note("graph seen")

    transform = GraphOnly()
    assert transform.overrides("transform_graph") and not transform.overrides("transform_aot_graph")
    model = mlp()
    xform.compile(model, transform, handoff="eager")(torch.randn(2, 16))
    assert xform.report(model).graphs[0].transforms[0].notes == ["graph seen"]


def test_wrap_compiled_wraps_every_call():
    log: list = []
    compiled = xform.compile(mlp(), Recorder(log), handoff="eager")
    for _ in range(3):
        compiled(torch.randn(2, 16))
    assert sum(1 for _, stage, _ in log if stage == "call") == 3


class Early(xform.Transform):
    name = "early"
    must_precede = {"late": "late wraps what early produces"}


class Late(xform.Transform):
    name = "late"
    must_follow = {"early": "it reads the weights early replaced"}


def test_order_constraints_accept_the_right_order():
    assert [t.name for t in xform.Backend([Early(), Late()]).transforms] == ["early", "late"]


def test_must_follow_is_enforced():
    class Late2(Late):
        name = "late"
        must_follow = {"early2": "it reads the weights early2 replaced"}

    class Early2(xform.Transform):
        name = "early2"

    with pytest.raises(ValueError, match=r"transform 'late' must come after 'early2' \(it reads the weights early2 "
                                         r"replaced\); reorder the list, e.g. \['early2', 'late'\]"):
        xform.Backend([Late2(), Early2()])


def test_must_precede_is_enforced():
    class Late3(xform.Transform):
        name = "late"

    with pytest.raises(ValueError, match=r"transform 'early' must come before 'late' \(late wraps what early "
                                         r"produces\); reorder the list, e.g. \['early', 'late'\]"):
        xform.Backend([Late3(), Early()])


def test_a_transform_listed_twice_is_refused():
    with pytest.raises(ValueError, match="transform 'cast' is listed 2 times; list it once"):
        xform.Backend(["cast:bf16", "cast:fp16"])


def test_aot_hooks_with_a_handoff_that_has_no_aot_graphs():
    class FakeThunder:
        kind = label = "thunder"
        supports_aot_hooks = False

    with pytest.raises(ValueError, match=r"transform\(s\) \['recorder'\] work on AOTAutograd graphs, which "
                                         r"handoff='thunder' does not produce"):
        xform.pipeline.Pipeline([Recorder([])], FakeThunder())


class Broken(xform.Transform):
    name = "broken"

    def transform_graph(self, graph, record):
        raise KeyError("boom")


def test_a_failing_transform_is_dropped_and_named_in_the_report(monkeypatch):
    monkeypatch.delenv("XFORM_STRICT", raising=False)
    model = mlp()
    x = torch.randn(2, 16)
    out = xform.compile(model, "cast:bf16", Broken(), handoff="eager")(x)

    ((name, reason),) = xform.report(model).failures()
    assert name == "broken" and reason.startswith("failed in transform_graph: KeyError: 'boom' (raised at "
                                                  "test_transform_protocol.py:")
    assert reason.endswith(" in transform_graph); this graph was compiled without it (XFORM_STRICT=1 raises instead)")
    assert "FAILED" in str(xform.report(model))
    assert model[0].weight.dtype == torch.bfloat16  # the others still applied
    torch.testing.assert_close(out, model(x))


def test_xform_strict_raises_the_failure(monkeypatch):
    monkeypatch.setenv("XFORM_STRICT", "1")
    with pytest.raises(Exception, match=r"transform 'broken' failed in transform_graph: KeyError: 'boom'"):
        xform.compile(mlp(), Broken(), handoff="eager")(torch.randn(2, 16))


def test_transform_repr_shows_its_configuration():
    assert repr(xform.transforms.Cast(torch.float16, filter="0")) == "Cast(dtype=torch.float16, filter='0')"


def test_backend_called_outside_dynamo_compiles_an_fx_graph():
    gm = torch.fx.symbolic_trace(nn.Linear(4, 4))
    compiled = xform.Backend(handoff="eager")(gm, [torch.randn(2, 4)])
    assert compiled(torch.randn(2, 4)).shape == (2, 4)


@pytest.mark.slow
def test_a_handoff_failure_names_the_graph_and_transforms():
    class BadGraph(xform.Transform):
        name = "bad-graph"

        def transform_graph(self, graph, record):
            g = graph.gm.graph
            x = next(n for n in g.nodes if n.op == "placeholder" and "args" in n.name)
            output = next(n for n in g.nodes if n.op == "output")
            with g.inserting_before(output):
                g.call_function(torch.mm, (x, x))  # [2, 16] @ [2, 16]: shapes do not match

    with pytest.raises(Exception, match=r"(?s)handoff 'inductor' failed to compile graph 0/0 after transforms "
                                        r"\['bad-graph'\]: .*compile with handoff='eager'"):
        xform.compile(mlp(), BadGraph())(torch.randn(2, 16))


class CompilesItself(xform.Transform):
    """Compiles the graph through the handoff itself, as cudagraphs' compile_graph does."""

    name = "compiles-itself"

    def compile_graph(self, graph, compile, record):
        return compile(graph.gm, graph.example_inputs)


@pytest.mark.parametrize("transforms", [["cast:bf16"], [CompilesItself()]], ids=["handoff", "compile_graph"])
def test_a_handoff_exception_dynamo_falls_back_on_reaches_it_as_it_is(monkeypatch, transforms):
    """Inductor raising DataDependentOutputException under AOTAutograd (a Mixture-of-Experts router in
    training) is one Dynamo answers with a graph break, as it does for torch.compile(backend="inductor");
    wrapped in xform's handoff error (or, through a transform's compile_graph, as that transform's
    failure) it failed the whole compile. The graph Dynamo gave up is not reported as changed."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from xform.handoff import EagerHandoff

    def fails(self, gm, example_inputs, aot_hook, *args, **kwargs):
        raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)

    monkeypatch.setattr(EagerHandoff, "compile", fails)
    monkeypatch.setenv("XFORM_STRICT", "1")  # a transform's failure would raise, not be dropped
    model, x = mlp(), torch.randn(2, 16)
    expected = model(x)
    torch.testing.assert_close(xform.compile(model, *transforms, handoff="eager")(x), expected)  # run by Dynamo
    assert xform.report(model).graphs == []
    assert all(p.dtype == torch.float32 for p in model.parameters())
