"""Guards are transformed, not just the graph: the proof with the `cast` transform (and a
shape-changing test transform), on the eager and Inductor handoffs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import xform
from xform.transforms import Cast, LowPrecisionWeight
from models import mlp

HANDOFFS = ["eager", pytest.param("inductor", marks=pytest.mark.slow)]


def graphs_compiled(model: nn.Module) -> int:
    return len(xform.report(model).graphs)


@pytest.mark.parametrize("handoff", HANDOFFS)
def test_cast_weights_are_held_by_the_module_and_do_not_recompile(handoff, no_recompile):
    model = mlp()
    reference = copy.deepcopy(model)
    compiled = xform.compile(model, Cast(torch.bfloat16), handoff=handoff)
    x = torch.randn(4, 16)

    out = compiled(x)

    for layer in (model[0], model[2]):
        assert type(layer.weight) is LowPrecisionWeight and layer.weight.dtype == torch.bfloat16
        assert isinstance(layer.weight, nn.Parameter) and layer.bias.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x), atol=3e-2, rtol=3e-2)
    assert out.dtype == torch.float32
    with no_recompile():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), out)
        compiled(torch.randn(4, 16)).sum().backward()
    assert model[0].weight.grad.dtype == torch.bfloat16
    assert graphs_compiled(model) == 1


def test_parameter_bytes_halve():
    model = mlp(64)
    before = sum(p.nbytes for p in model.parameters())
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 64))
    assert sum(p.nbytes for p in model.parameters()) * 2 == before


@pytest.mark.parametrize("handoff", HANDOFFS)
def test_new_input_rank_and_dtype_recompile_correctly(handoff):
    model = mlp()
    compiled = xform.compile(model, "cast:bf16", handoff=handoff)
    compiled(torch.randn(4, 16))

    x3 = torch.randn(2, 3, 16)
    out3 = compiled(x3)
    x64 = torch.randn(4, 16, dtype=torch.float64)
    out64 = compiled(x64)

    assert graphs_compiled(model) == 3
    # the recompiles traced the already-cast model: same meaning as the cast model run eagerly
    torch.testing.assert_close(out3, model(x3))
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, model(x64))
    assert xform.report(model).graphs[1].transforms[0].notes  # "was cast by an earlier compile"


def test_user_assigned_weight_recompiles_instead_of_running_stale_code():
    model = mlp()
    compiled = xform.compile(model, "cast:bf16", handoff="eager")
    x = torch.randn(4, 16)
    compiled(x)

    fresh = nn.Parameter(torch.randn(32, 16))
    model[0].weight = fresh
    out = compiled(x)

    assert graphs_compiled(model) == 2
    assert type(model[0].weight) is LowPrecisionWeight  # the new weight was cast in turn
    torch.testing.assert_close(model[0].weight, fresh.detach().bfloat16(), check_dtype=False)
    expected = model[2](F.gelu(F.linear(x.bfloat16(), fresh.bfloat16(), model[0].bias).float()))
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_loaded_state_dict_is_used_without_recompiling(no_recompile):
    model = mlp()
    compiled = xform.compile(model, "cast:bf16", handoff="eager")
    x = torch.randn(4, 16)
    compiled(x)
    other = mlp()

    model.load_state_dict(other.state_dict())
    with no_recompile():
        out = compiled(x)

    torch.testing.assert_close(out, other(x), atol=3e-2, rtol=3e-2)
    assert type(model[0].weight) is LowPrecisionWeight


def test_guard_changes_are_recorded_per_parameter():
    model = mlp()
    with torch.no_grad():
        xform.compile(model, "quantize:float8-weight-only", handoff="eager")(torch.randn(4, 16))

    changes = xform.report(model).graphs[0].guard_changes

    assert [c.source.rsplit("'", 2)[-2] for c in changes] == ["weight", "weight"]
    first = changes[0]
    assert first.before.dtype == torch.float32 and first.before.tensor_type == "Parameter"
    assert first.after.dtype == torch.float32 and first.after.tensor_type == "Float8Tensor"
    assert first.after.shape == (32, 16) and first.changed_by == "quantize"
    assert "float32[32, 16] Parameter -> float32[32, 16] Float8Tensor (quantize)" in first.describe()


def test_a_cast_model_is_traced_again_and_guarded_by_dynamo_itself():
    """cast changes the weights' dtype, which code may read (T5 casts its activations to the
    weight's dtype): the frame is traced again from the cast model, whose tensors Dynamo guards."""
    model = mlp()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(4, 16))

    (graph,) = xform.report(model).graphs
    assert graph.guard_changes == [] and type(model[0].weight) is LowPrecisionWeight


def test_shape_change_is_guarded_on_the_new_shape(no_recompile):
    class Transposed(xform.Transform):
        """Linear weights stored as [in, out]: a shape change, as sharding makes. The size/stride half
        of Dynamo's TENSOR_MATCH guard must be rewritten for the compiled code to run at all."""

        name = "store-transposed"

        def transform_parameters(self, graph, record):
            for param in graph.parameters:
                if isinstance(param.owner, nn.Linear) and param.name == "weight":
                    graph.replace_parameter(param, nn.Parameter(param.tensor.detach().t().contiguous()), by=self.name)

        def transform_graph(self, graph, record):
            for node in list(graph.gm.graph.nodes):
                if node.target is F.linear and graph.parameter_for(node.args[1]) is not None:
                    with graph.gm.graph.inserting_before(node):
                        weight_t = graph.gm.graph.call_method("t", (node.args[1],))
                    node.update_arg(1, weight_t)

    model = nn.Linear(16, 8)
    original = model.weight.detach().clone()
    compiled = xform.compile(model, Transposed(), handoff="eager")
    x = torch.randn(4, 16)
    out = compiled(x)

    assert model.weight.shape == (16, 8)
    change = xform.report(model).graphs[0].guard_changes[0]
    assert change.before.shape == (8, 16) and change.after.shape == (16, 8)
    torch.testing.assert_close(out, F.linear(x, original, model.bias))
    with no_recompile():
        compiled(x)
    # putting a weight of the traced shape back must recompile, not feed [8, 16] to code built for [16, 8]
    model.weight = nn.Parameter(original)
    torch.testing.assert_close(compiled(x), F.linear(x, original, model.bias))
    assert graphs_compiled(model) == 2


def test_a_transform_that_declares_one_tensor_and_installs_another_is_caught():
    class Liar(xform.Transform):
        name = "liar"

        def transform_parameters(self, graph, record):
            param = graph.parameters[0]
            graph.replace_parameter(param, nn.Parameter(param.tensor.detach().double()), by=self.name)
            param.owner.weight = nn.Parameter(param.tensor.detach().half())  # behind the guard model's back
            param.tensor = param.owner.weight

    with pytest.raises(Exception, match=r"transform 'liar' declared that .*weight.* is now float64\[8, 16\] "
                                        r"Parameter, but the model holds float16\[8, 16\] Parameter there"):
        xform.compile(nn.Linear(16, 8), Liar(), handoff="eager")(torch.randn(2, 16))


def test_parameter_that_is_a_function_argument_cannot_be_replaced():
    weight = nn.Parameter(torch.randn(8, 16))

    class ReplaceAll(xform.Transform):
        name = "replace-all"

        def transform_parameters(self, graph, record):
            for param in graph.parameters:
                graph.replace_parameter(param, nn.Parameter(param.tensor.detach()), by=self.name)

    def f(x, w):
        return F.linear(x, w)

    with pytest.raises(Exception, match=r"transform 'replace-all' cannot replace L\['w'\]: it is not a module "
                                        r"parameter"):
        xform.compile(f, ReplaceAll(), handoff="eager")(torch.randn(2, 16), weight)


def test_guard_model_table():
    expectation = xform.TensorExpectation.of("L['x']", "input", torch.zeros(2, 3))
    model = xform.GuardModel([expectation])

    assert model["L['x']"].shape == (2, 3) and model["L['x']"].stride == (3, 1)
    assert model.changes == []
    change = model.expect("L['x']", torch.zeros(2, 3, dtype=torch.bfloat16), changed_by="t", placement="Shard(0)")
    assert model.changes == [change]
    assert change.after.describe() == "bfloat16[2, 3] Tensor Shard(0)"
    assert model.to_dict()[0]["dtype"] == "torch.bfloat16"
    with pytest.raises(KeyError, match=r"t: the graph reads no tensor from L\['y'\]"):
        model.expect("L['y']", torch.zeros(1), changed_by="t")


def test_graph_expectations_cover_inputs_and_parameters():
    seen = {}

    class Look(xform.Transform):
        name = "look"

        def transform_guards(self, guards, record):
            seen.update({e.source: e for e in guards})

    xform.compile(nn.Linear(16, 8), Look(), handoff="eager")(torch.randn(2, 16))

    roles = {source.split("'")[-2] if "_parameters" in source else source: e.role for source, e in seen.items()}
    assert roles == {"weight": "parameter", "bias": "parameter", "L['args'][0]": "input"}
    assert seen["L['args'][0]"].shape == (2, 16) and seen["L['args'][0]"].requires_grad is False


def test_placeholders_keep_example_values_of_the_replacements():
    shapes = {}

    class Look(xform.Transform):
        name = "look"

        def transform_graph(self, graph, record):
            for node in graph.gm.graph.nodes:
                if node.op in ("placeholder", "call_function", "call_method"):
                    value = node.meta["example_value"]
                    shapes[node.name] = (tuple(value.shape), value.dtype)

    xform.compile(nn.Linear(16, 8), "cast:bf16", Look(), handoff="eager")(torch.randn(2, 16))

    assert ((8, 16), torch.bfloat16) in shapes.values()
    assert ((2, 16), torch.bfloat16) in shapes.values()  # the inserted input cast
    assert all(isinstance(n, str) for n in shapes)


def test_dynamo_graph_is_valid_after_cast():
    captured: list[fx.GraphModule] = []

    class Keep(xform.Transform):
        name = "keep"

        def transform_graph(self, graph, record):
            captured.append(graph.gm)

    xform.compile(mlp(), "cast:bf16", Keep(), handoff="eager")(torch.randn(2, 16))

    code = captured[0].code
    assert code.count("torch.bfloat16") == 2 and code.count("torch.float32") == 2


def test_parameters_that_are_not_graph_inputs_are_reported():
    from xform.report import GraphRecord

    model = mlp()
    gm = fx.symbolic_trace(model)  # traced outside Dynamo: weights are get_attr nodes, not inputs
    backend = xform.Backend(["cast:bf16"], handoff="eager")
    graph = xform.CapturedGraph(gm, [torch.randn(2, 16)], frame=None)
    record = GraphRecord(graph="fx", code="fx", handoff="eager", nodes_before=graph.node_count())
    backend.pipeline.run(lambda: graph, record)

    (skip,) = record.transforms[0].skips
    assert skip.target == "4 parameters"
    assert skip.reason.startswith("the graph reads them as attributes of the graph module, not as inputs")
    assert model[0].weight.dtype == torch.float32


def test_the_guards_of_every_replaced_weight_are_rewritten_in_one_pass(monkeypatch):
    """Rewriting the guards weight by weight rebuilt Dynamo's guard set once per weight (quadratic in
    the weights: a 400-layer model spent most of its compile there); all go in one pass now."""
    import xform._torch.dynamo as dynamo

    passes = []
    remove = dynamo._remove_guards_on
    monkeypatch.setattr(dynamo, "_remove_guards_on", lambda guards, sources, **kw: (passes.append(len(sources)),
                                                                                    remove(guards, sources, **kw)))
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(20)])
    with torch.no_grad():
        torch.compile(model, backend=xform.Backend(["quantize:float8-weight-only"], handoff="eager"))(torch.randn(2, 16))
    assert passes == [20]  # 20 weights
    assert all(type(m.weight).__name__ == "Float8Tensor" for m in model)
