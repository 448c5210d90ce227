"""xform.report: per graph, each transform's changes, skips and time; readable and JSON-able."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import xform
from xform.report import format_bytes
from models import GraphBreakMLP, TiedLM, mlp


def test_report_lists_changes_notes_and_timing():
    model = mlp()
    compiled = xform.compile(model, "cast:bf16", handoff="eager")
    compiled(torch.randn(2, 16))

    report = xform.report(compiled)
    graph = report.graphs[0]
    cast = graph.transforms[0]

    assert graph.graph == "0/0" and graph.code == "Sequential" and graph.handoff == "eager"
    assert graph.nodes_after == graph.nodes_before > 0  # traced again through the cast weights: nothing to rewrite
    assert [(c.kind, c.target) for c in cast.changes] == [("layer", "0"), ("layer", "2")]
    assert cast.changes[0].detail == "float32 -> bfloat16, 1.1 KiB saved"
    assert cast.notes == ["the frame was traced again after the dtype of 4 parameters changed, so that code reading "
                          "a weight's dtype sees the new one"]
    assert cast.seconds > 0 and graph.guard_changes == []  # Dynamo guards the weights it traced
    assert report.changes("cast") == cast.changes


def test_report_lists_the_guards_xform_rewrote():
    model = mlp()
    with torch.no_grad():
        xform.compile(model, "quantize:float8-weight-only", handoff="eager")(torch.randn(2, 16))

    graph = xform.report(model).graphs[0]
    text = str(xform.report(model))

    assert len(graph.guard_changes) == 2 and {c.changed_by for c in graph.guard_changes} == {"quantize"}
    assert ("guards rewritten: 2\n    L['fn'].0.weight: float32[32, 16] Parameter -> float32[32, 16] Float8Tensor "
            "(quantize)") in text


def test_report_str_is_a_table():
    model = mlp()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))

    text = str(xform.report(model))

    assert text.startswith("xform report: 1 graph(s)")
    assert "graph 0/0 (Sequential):" in text and "handoff eager" in text
    assert "cast       " in text and "layer" in text and "float32 -> bfloat16" in text
    assert all(line == line.rstrip() for line in text.splitlines())  # the last column is not padded


@pytest.mark.parametrize("count, said", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (2**20 - 1, "1.0 MiB"),
                                         (3 * 2**19, "1.5 MiB"), (3 * 2**30, "3.0 GiB")])
def test_sizes_are_said_in_one_unit_family(count, said):
    assert format_bytes(count) == said



def test_describe_lists_one_transforms_entries_with_reasons_wrapped_below():
    model = TiedLM()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randint(0, 50, (2, 5)))

    text = xform.report(model).describe("cast", width=40)

    lines = text.splitlines()
    assert lines[0] == "graph 0/0 (TiedLM.forward)"
    assert lines[1] == "  changed: body: float32 -> bfloat16, 544 B saved"
    skipped = lines.index("  not changed: head")
    assert lines[skipped + 1].startswith("      ") and all(len(line) <= 40 for line in lines[skipped + 1:])
    note = lines.index("  note: the frame was traced again after")
    assert lines[note + 1].startswith("        the dtype")
    assert xform.Report([]).describe("cast") == "no graph compiled yet (call the compiled model once)"


def test_report_to_dict_is_json():
    model = TiedLM()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randint(0, 50, (2, 5)))

    data = json.loads(json.dumps(xform.report(model).to_dict()))

    cast = data["graphs"][0]["transforms"][0]
    assert cast["transform"] == "cast"
    assert cast["changes"][0]["target"] == "body"
    assert data["graphs"][0]["guard_changes"] == []


def test_skips_say_why():
    model = TiedLM()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randint(0, 50, (2, 5)))

    (skip,) = xform.report(model).skips("cast")

    assert skip.target == "head"
    assert skip.reason == ("its weight is embed.weight, shared with embed (Embedding, tied weights); changing it "
                           "would change that module too. Untie the weights to change it")
    assert model.head.weight.dtype == torch.float32 and model.body.weight.dtype == torch.bfloat16


class TiedLMWithABreak(TiedLM):
    """TiedLM with a graph break after the embedding: the head's graph reads the shared weight under
    the head's name only (as OPT's head after its layerdrop break)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        torch._dynamo.graph_break()
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("spec", ["cast:bf16", "quantize:nvfp4-weight-only"])
def test_a_tied_head_in_a_graph_without_its_embedding_is_still_tied(spec):
    model = TiedLMWithABreak(vocab=64, dim=32)
    with torch.no_grad():
        xform.compile(model, spec, handoff="eager")(torch.randint(0, 64, (2, 5)))

    assert model.head.weight is model.embed.weight and type(model.head.weight) is nn.Parameter
    skips = {s.target: s.reason for s in xform.report(model).skips(spec.split(":")[0])}
    assert skips["head"] == ("its weight is embed.weight, shared with embed (Embedding, tied weights); changing it "
                             "would change that module too. Untie the weights to change it")


class Router(nn.Module):
    """A module that is not an nn.Linear and calls F.linear with its own weight (a MoE router)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight).softmax(-1)


def test_a_module_calling_linear_with_its_own_weight_is_named_as_not_a_linear():
    model = nn.Sequential(nn.Linear(16, 16), Router())
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))

    (skip,) = xform.report(model).skips("cast")
    assert skip.target == "1"
    assert skip.reason == ("it is a Router, not an nn.Linear: it calls F.linear with its own weight, and only "
                           "nn.Linear layers are changed; left as written")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router, self.out = Router(), nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.router(x))


def test_one_reason_met_in_every_layer_is_one_line_with_the_layers_and_a_count():
    model = nn.Sequential(*[Block() for _ in range(12)])
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))
    report = xform.report(model)
    assert len(report.skips("cast")) == 12  # every place, for code that reads them
    lines = [line for line in str(report).splitlines() if line.split()[:1] == ["skipped"]]
    assert len(lines) == 1 and "{0-11}.router (x12)  it is a Router, not an nn.Linear" in lines[0], lines
    assert "not changed: {0-11}.router (x12)" in report.describe("cast")
    assert "cast       12 changed, 12 skipped" in str(report)  # the counts stay whole


@pytest.mark.parametrize("targets, said", [
    (["layers.3.mlp", "layers.4.mlp", "layers.5.mlp"], "layers.{3-5}.mlp (x3)"),
    (["layers.0.mlp", "layers.2.mlp"], "layers.{0,2}.mlp (x2)"),
    (["layers.0.q", "layers.0.k", "layers.1.q"], "layers.0.q and 2 more like it (x3)"),
    (["graph", "graph"], "graph (x2)"),
    (["head"], "head"),
])
def test_places_are_summarized_by_the_number_that_varies(targets, said):
    from xform.report import describe_places

    assert describe_places(targets) == said


class Experts(nn.Module):
    """A mixture of experts' stacked weights, as Mixtral holds them: multiplied one expert at a time
    (F.linear on a slice, `@ w[e].mT`) or by a batched product of all experts."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(4, 32, 16))
        self.gate = nn.Parameter(torch.randn(4, 32, 16))
        self.down = nn.Parameter(torch.randn(4, 16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.stack([torch.nn.functional.linear(x, self.up[e]) for e in range(4)])
        gate = torch.stack([x @ self.gate[e].mT for e in range(4)])
        return torch.bmm(up.relu() * gate, self.down.transpose(1, 2)).sum(0)


class NotExperts(nn.Module):
    """3-D parameters that are no stack of weight matrices: learned queries a Linear reads as its
    input (BLIP-2, Perceiver), and nn.Bilinear's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(2, 3, 16))
        self.bilinear = nn.Bilinear(16, 16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.queries, x[:16]).sum() + self.bilinear(x, x)


@pytest.mark.parametrize("spec", ["cast:bf16", "quantize:float8-weight-only"])
def test_stacked_expert_weights_are_named_with_what_multiplies_them(spec):
    model = nn.Sequential(Experts(), nn.Linear(16, 16))
    x = torch.randn(2, 16)
    expected = model(x)
    out = xform.compile(model, spec, handoff="eager")(x)
    transform = spec.split(":")[0]
    assert [c.target for c in xform.report(model).changes(transform) if c.kind == "layer"] == ["1"]

    def reason(shape: list[int], op: str, node: str) -> str:
        return (f"it is a stack of 4 weight matrices ({shape}, as a mixture of experts holds its experts) that {op} "
                f"(node '{node}') multiplies by, not an nn.Linear: only nn.Linear layers are changed; left as written. "
                f"Hold each matrix as an nn.Linear to change it")

    assert [(s.target, s.reason) for s in xform.report(model).skips(transform)] == [
        ("0.up", reason([4, 32, 16], "linear", "linear")),
        ("0.gate", reason([4, 32, 16], "matmul", "matmul")),
        ("0.down", reason([4, 16, 32], "bmm", "bmm"))]
    assert model[0].up.dtype == torch.float32  # left as written
    error = ((out.float() - expected).norm() / expected.norm()).item()
    assert error < 0.05, error  # the Linear's rounding (bf16 or float8) only: the experts are computed as written


def test_three_dimensional_parameters_that_are_no_stack_of_weights_are_not_named():
    model = NotExperts()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(16, 16))
    assert [s.target for s in xform.report(model).skips("cast")] == []


class OwnForwardLinear(nn.Linear):
    """An nn.Linear subclass computing its product itself, as Falcon's FalconLinear does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


@pytest.mark.parametrize("spec", ["cast:bf16", "quantize:float8-rowwise"])
def test_a_linear_subclass_with_a_forward_of_its_own_is_named_as_such(spec):
    model = nn.Sequential(nn.Linear(32, 32), OwnForwardLinear(32, 32))
    xform.compile(model, spec, handoff="eager")(torch.randn(4, 32))

    transform = spec.split(":")[0]
    assert [c.target for c in xform.report(model).changes(transform) if c.kind == "layer"] == ["0"]
    (skip,) = xform.report(model).skips(transform)
    assert (skip.target, skip.reason) == ("1", "it is a OwnForwardLinear, a subclass of nn.Linear with a forward of its "
                                               "own, and only nn.Linear's own forward (F.linear) is changed; left as "
                                               "written. Where its forward computes x @ weight.T + bias, replace it by "
                                               "an nn.Linear holding the same weight and bias (or call F.linear in its "
                                               "forward) to change it")
    assert type(model[1]) is OwnForwardLinear and type(model[1].weight) is nn.Parameter


class BreakInside(nn.Module):
    """A submodule whose forward breaks the graph: Dynamo compiles its frames with `self` the submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.before, self.inner = nn.Linear(8, 8), BreakInside()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.relu(self.before(x)))


def test_the_report_of_a_model_holds_the_graphs_of_its_submodules_frames():
    model = Outer()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 8))

    report = xform.report(model)
    # the inner frames' `self` is the submodule: their layers are named by their path in the model reported on
    assert [c.target for c in report.changes("cast") if c.kind == "layer"] == ["before", "inner.first", "inner.second"]
    assert [g.code.endswith(", in inner") for g in report.graphs] == [False, True, True]
    assert [c.target for c in xform.report(model.inner).changes("cast") if c.kind == "layer"] == ["first", "second"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


class TwoBreakingLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([BreakInside(), BreakInside()])
        self.head = OwnForwardLinear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_layers_of_frames_that_share_code_are_told_apart_by_their_path_skips_too():
    model = TwoBreakingLayers()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 8))
    report = xform.report(model)
    assert sorted(c.target for c in report.changes("cast") if c.kind == "layer") == [
        "layers.0.first", "layers.0.second", "layers.1.first", "layers.1.second"]
    assert [s.target for s in report.skips("cast")] == ["head"]


def test_graph_breaks_give_one_record_per_graph():
    model = GraphBreakMLP()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))

    graphs = xform.report(model).graphs

    assert len(graphs) == 2
    assert [c.target for g in graphs for c in g.transforms[0].changes if c.kind == "layer"] == ["first", "second"]
    assert graphs[1].code == "GraphBreakMLP.forward (resumed after the graph break at models.py:73)"


def test_report_of_a_compiled_function():
    layer = nn.Linear(16, 16)

    def step(x):
        return torch.relu(layer(x))

    compiled = xform.compile(step, "cast:bf16", handoff="eager")
    compiled(torch.randn(2, 16))

    for handle in (compiled, step):
        graphs = xform.report(handle).graphs
        assert len(graphs) == 1 and graphs[0].code == "test_report_of_a_compiled_function.<locals>.step"
    assert xform.report(layer).graphs == graphs  # the module its parameters hang from
    assert layer.weight.dtype == torch.bfloat16


def test_report_before_the_first_call():
    compiled = xform.compile(mlp(), "cast:bf16")
    assert str(xform.report(compiled)) == "xform report: no graph compiled yet (call the compiled model once)"


def test_report_of_something_not_compiled():
    with pytest.raises(TypeError, match="xform.report expects a compiled model or function, or the module/function "
                                        "given to torch.compile; got int"):
        xform.report(3)


def test_records_of_two_models_stay_apart():
    first, second = mlp(), mlp()
    xform.compile(first, "cast:bf16", handoff="eager")(torch.randn(2, 16))
    xform.compile(second, handoff="eager")(torch.randn(2, 16))
    assert xform.report(first).changes("cast") and not xform.report(second).changes("cast")


def test_report_of_a_module_without_parameters():
    class Attend(nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = Attend()
    q = torch.randn(1, 2, 8, 4)
    xform.compile(model, "flex-attention", handoff="eager")(q, q, q)
    assert len(xform.report(model).changes("flex-attention")) == 1


def test_a_module_shared_at_several_paths_is_named_by_its_first():
    block = BreakInside()
    model = nn.Sequential(block, block)
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 8))
    assert sorted({c.target for c in xform.report(model).changes("cast") if c.kind == "layer"}) == [
        "0.first", "0.second"]


class NamesParts(xform.Transform):
    """Records a parameter change and skip, and a target that is no part of the module, per graph."""

    name = "names-parts"

    def transform_graph(self, graph, record):
        record.changed("parameter", "first.weight")
        record.changed("region", "graph")
        record.skipped("first.bias", "a reason")
        record.skipped("region 0 (3 ops)", "another")


def test_parameter_names_of_a_submodules_frame_are_the_models_and_other_targets_stay():
    model = Outer()
    model.inner.graph = nn.Identity()  # a submodule named like the region target: it is no layer path
    xform.compile(model, NamesParts(), handoff="eager")(torch.randn(2, 8))
    inner = [g for g in xform.report(model).graphs if g.code.endswith(", in inner")]
    assert inner and all([(c.kind, c.target) for c in g.transforms[0].changes] ==
                         [("parameter", "inner.first.weight"), ("region", "graph")] for g in inner)
    assert all([s.target for s in g.transforms[0].skips] == ["inner.first.bias", "region 0 (3 ops)"] for g in inner)


@pytest.mark.parametrize("spec, note", [
    ("flex-attention", "no attention in this graph: an F.scaled_dot_product_attention call, or softmax(q @ k^T) @ v "
                       "written out"),
    ("cast:bf16", "no nn.Linear layer in this graph"),
])
def test_a_transform_that_finds_nothing_to_change_says_what_it_looked_for(spec, note):
    model = nn.Sequential(nn.Conv1d(4, 4, 3), nn.ReLU())
    xform.compile(model, spec, handoff="eager")(torch.randn(2, 4, 8))
    assert xform.report(model).notes(spec.partition(":")[0]) == [note]


def test_a_fused_fast_path_is_named_as_such_not_as_a_tied_weight():
    """nn.TransformerEncoder in eval mode without gradients runs torch's fused kernel, which reads the
    weights itself: nothing is tied, and the fix is to leave that path."""
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with torch.no_grad():
        xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 8, 32))
    reasons = {s.reason for s in xform.report(model).skips("cast")}
    assert len(reasons) == 1 and len(xform.report(model).skips("cast")) == 6
    (reason,) = reasons
    assert reason.startswith("its weight is read by torch's fused fast path (_transformer_encoder_layer_fwd), which "
                             "nn.TransformerEncoderLayer's layers take in eval mode without gradients")
    assert "untie" not in reason and "torch.backends.mha.set_fastpath_enabled(False)" in reason


def test_torch_compiler_reset_clears_the_reports_with_the_code_they_describe():
    model = mlp()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))
    assert len(xform.report(model).graphs) == 1
    torch.compiler.reset()
    assert xform.report(model).graphs == []
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))
    assert len(xform.report(model).graphs) == 1  # the new compile alone, not the one before the reset
