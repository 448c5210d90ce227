"""The `cast` transform: which layers, what it refuses, training through it, saving and loading."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import xform
from xform.transforms import Cast, LowPrecisionWeight
from models import TransformerBlock, mlp


def cast_layers(model: nn.Module) -> list[str]:
    return [c.target for c in xform.report(model).changes("cast") if c.kind == "layer"]


@pytest.mark.parametrize("filter, expected", [
    (None, ["qkv", "proj", "up", "down"]),
    ("up|down", ["up", "down"]),
    (["qkv"], ["qkv"]),
    (lambda path, module: module.out_features == 32, ["proj", "down"]),
])
def test_filter_selects_layers(filter, expected):
    model = TransformerBlock()
    xform.compile(model, Cast(filter=filter), handoff="eager")(torch.randn(2, 8, 32))
    assert cast_layers(model) == expected
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            assert (module.weight.dtype == torch.bfloat16) == (name in expected)


def test_unselected_layers_are_not_reported_as_skipped():
    model = TransformerBlock()
    xform.compile(model, Cast(filter="up"), handoff="eager")(torch.randn(2, 8, 32))
    assert xform.report(model).skips("cast") == []


@pytest.mark.parametrize("filter, message", [
    ("up(", r"transform 'cast': option filter='up\(' is not accepted; accepted: a valid regex \(this one: "),
    (3, r"transform 'cast': option filter=3 is not accepted; accepted: None, a regex string, a list of module paths"),
])
def test_bad_filter(filter, message):
    with pytest.raises(ValueError, match=message):
        Cast(filter=filter)


def test_bad_dtype():
    with pytest.raises(ValueError, match=r"transform 'cast': option dtype=torch.int8 is not accepted; accepted: "
                                         r"torch.bfloat16, torch.float16"):
        Cast(torch.int8)


def test_fp16():
    model = mlp()
    out = xform.compile(model, "cast:fp16", handoff="eager")(torch.randn(2, 16))
    assert model[0].weight.dtype == torch.float16 and out.dtype == torch.float32


def test_layers_already_in_the_target_dtype_are_skipped_with_the_reason():
    model = mlp().bfloat16()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16, dtype=torch.bfloat16))
    assert [(s.target, s.reason) for s in xform.report(model).skips("cast")] == [
        ("0", "its weight is already bfloat16"), ("2", "its weight is already bfloat16")]


def test_weight_read_by_another_op_is_skipped_with_the_reason():
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x) + x @ self.fc.weight

    model = Reuse()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))
    (skip,) = xform.report(model).skips("cast")
    assert skip.target == "fc" and "its weight is also read by node 'matmul' (matmul); changing it would change" in skip.reason
    assert model.fc.weight.dtype == torch.float32


def test_a_layer_multiplying_by_its_own_weight_is_skipped_with_the_reason():
    class Conv1D(nn.Module):  # GPT-2's: a Linear with a transposed weight, computed with addmm
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 8))
            self.bias = nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight)

    model = nn.Sequential(Conv1D(), nn.Linear(8, 8))
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))
    assert [(s.target, s.reason) for s in xform.report(model).skips("cast")] == [
        ("0", "it is a Conv1D, not an nn.Linear: it computes torch.addmm with its weight, and only nn.Linear layers "
              "(F.linear calls) are changed; left as written. Replace it by an nn.Linear (its weight transposed) "
              "to change it")]
    assert model[0].weight.dtype == torch.float32 and model[1].weight.dtype == torch.bfloat16


def test_training_steps_the_cast_parameters():
    model = mlp()
    compiled = xform.compile(model, "cast:bf16", handoff="eager")
    x, target = torch.randn(8, 16), torch.randn(8, 16)
    compiled(x)  # the first call replaces the parameters: create the optimizer after it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model[0].weight.detach().clone()
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert type(model[0].weight) is LowPrecisionWeight and model[0].weight.dtype == torch.bfloat16
    assert not torch.equal(before, model[0].weight.detach())
    assert losses[-1] < losses[0]


def test_state_dict_saves_and_loads_into_a_fresh_cast_model():
    model = mlp()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    torch.serialization.add_safe_globals([LowPrecisionWeight])
    state = torch.load(buffer)  # weights_only=True, with the class allowed

    fresh = mlp()
    compiled = xform.compile(fresh, "cast:bf16", handoff="eager")
    compiled(torch.randn(2, 16))
    fresh.load_state_dict(state)

    x = torch.randn(3, 16)
    torch.testing.assert_close(compiled(x), model(x))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values()))


def test_eager_cast_model_matches_the_compiled_one():
    model = TransformerBlock()
    compiled = xform.compile(model, "cast:bf16", handoff="eager")
    x = torch.randn(2, 8, 32)
    out = compiled(x)
    torch.testing.assert_close(model(x), out)  # LowPrecisionWeight gives eager code the graph's meaning


def test_deepcopy_of_a_cast_model():
    model = mlp()
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))
    twin = copy.deepcopy(model)
    assert type(twin[0].weight) is LowPrecisionWeight and isinstance(twin[0].weight, nn.Parameter)
    assert twin[0].weight.data_ptr() != model[0].weight.data_ptr()
    x = torch.randn(2, 16)
    torch.testing.assert_close(twin(x), model(x))


def test_a_second_instance_of_the_same_class_is_cast_too():
    first, second = mlp(), mlp()
    compiled_first = xform.compile(first, "cast:bf16", handoff="eager")
    compiled_second = xform.compile(second, "cast:bf16", handoff="eager")
    x = torch.randn(2, 16)
    compiled_first(x)
    out = compiled_second(x)
    assert second[0].weight.dtype == torch.bfloat16
    torch.testing.assert_close(out, second(x))


def test_cast_leaves_layers_another_transform_quantized():
    model = mlp(128)
    xform.compile(model, xform.transforms.Quantize("float8-weight-only", filter=["0"]), "cast:bf16",
                  handoff="eager")(torch.randn(2, 128))
    (skip,) = xform.report(model).skips("cast")
    assert skip.target == "0" and skip.reason == ("its weight is a Float8Tensor (another transform changed it); "
                                                  "cast takes plain parameters")
    assert type(model[2].weight) is LowPrecisionWeight


class ReadAcrossABreak(nn.Module):
    """The layer's call and another op reading its weight in two graphs (a graph break between)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        torch._dynamo.graph_break()
        return h @ self.fc.weight.float().T


def test_a_weight_another_graph_reads_otherwise_is_an_error_not_a_silent_bf16_read():
    """The first graph sees only the layer's call and casts it; the second reads the weight with a
    matmul, which would silently compute with bf16 values: refused, naming the layer and the fix."""
    with pytest.raises(Exception, match=r"xform: transform 'cast': fc was cast to bfloat16 in an earlier graph of "
                                        r"this model, and this one \(.*\) reads it otherwise: its weight is also read "
                                        r"by node .*Exclude the layer from cast \(filter=\), or remove the graph break"):
        xform.compile(ReadAcrossABreak(), "cast:bf16", handoff="eager")(torch.randn(2, 8))


def test_excluded_with_filter_the_model_runs_in_full_precision_across_the_break():
    model = ReadAcrossABreak()
    x = torch.randn(2, 8)
    out = xform.compile(model, Cast(torch.bfloat16, filter=[]), handoff="eager")(x)
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("spec, dtype", [("cast:bf16", torch.float32), ("quantize:float8-rowwise", torch.bfloat16),
                                         ("quantize:float8-weight-only", torch.bfloat16)])
def test_an_integer_input_raises_as_the_model_does_instead_of_returning_truncated_values(spec, dtype):
    model = nn.Sequential(nn.Linear(16, 16)).to(dtype)
    tokens = torch.arange(32).view(2, 16)
    with pytest.raises(RuntimeError, match=r"must have the same dtype"):
        model(tokens)
    with pytest.raises(RuntimeError, match=r"(must|expected m1 and m2 to) have the same dtype"):
        xform.compile(model, spec, handoff="eager")(tokens)


RECAST = ("xform: transform 'cast': 0 holds {held} values that xform cast earlier, and this cast is to {to}: another "
          "compile of this model casts it otherwise, or the model was converted after the cast (model.half(), "
          "model.to(dtype)). Casting again would round its values twice, and two compiled views casting one model "
          "differently would recompile on every call. Compile the model with one cast, deepcopy it for another "
          "(copy.deepcopy(model) before compiling), or convert it before compiling")


def test_two_compiles_casting_one_model_differently_is_an_error_not_a_recompile_every_call():
    model, x = mlp(), torch.randn(4, 16)
    as_bf16 = torch.compile(model, backend=xform.Backend(["cast:bf16"]))
    as_fp16 = torch.compile(model, backend=xform.Backend(["cast:fp16"]))
    as_bf16(x)
    with pytest.raises(ValueError) as raised:
        as_fp16(x)
    assert str(raised.value).startswith(RECAST.format(held="bfloat16", to="float16"))
    assert model[0].weight.dtype == torch.bfloat16  # left as the first cast made it


def test_a_model_converted_after_the_cast_is_an_error_not_a_second_rounding():
    model, x = mlp(), torch.randn(4, 16)
    compiled = torch.compile(model, backend=xform.Backend(["cast:bf16"]))
    compiled(x)
    model.half()
    with pytest.raises(ValueError) as raised:
        compiled(x.half())
    assert str(raised.value).startswith(RECAST.format(held="float16", to="bfloat16"))


def test_a_model_made_float_after_the_cast_is_cast_again_losslessly():
    """model.float() after cast:bf16 holds the bf16 values in float32: casting them back rounds nothing."""
    model, x = mlp(), torch.randn(4, 16)
    compiled = torch.compile(model, backend=xform.Backend(["cast:bf16"]))
    expected = compiled(x)
    model.float()
    assert model[0].weight.dtype == torch.float32
    torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    assert model[0].weight.dtype == torch.bfloat16


class ReadsTheWeightsDtype(nn.Module):
    """Casts its activations to the next layer's weight dtype before calling it, as T5's feed-forward
    does (`if self.wo.weight.dtype != h.dtype: h = h.to(self.wo.weight.dtype)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.wi, self.wo = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.wi(x))
        if self.wo.weight.dtype != h.dtype:
            h = h.to(self.wo.weight.dtype)
        return self.wo(h)


@pytest.mark.parametrize("handoff", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_code_reading_a_weights_dtype_sees_the_cast_dtype_from_the_first_call(handoff):
    """Dynamo traced the model before cast changed it: the first graph took the float32 branch and
    returned float32, a recompile (another batch size) took the bfloat16 one. The frame is traced
    again after the cast, so every call returns what the cast model returns eagerly."""
    model = ReadsTheWeightsDtype()
    compiled = xform.compile(model, "cast:bf16", handoff=handoff)
    inputs = [torch.randn(batch, 8) for batch in (2, 3, 4)]

    outputs = [compiled(x) for x in inputs]

    assert [out.dtype for out in outputs] == [torch.bfloat16] * 3
    for x, out in zip(inputs, outputs):
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert [c.target for c in xform.report(model).changes("cast")] == ["wi", "wo"]


class BreaksOnTheNewDtype(ReadsTheWeightsDtype):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.wi(x))
        if self.wo.weight.dtype != h.dtype:
            torch._dynamo.graph_break()
            h = h.to(self.wo.weight.dtype)
        return self.wo(h)


def test_a_retrace_that_never_reaches_the_backend_is_undone_at_the_next_compile():
    """With fullgraph=True the retrace raises Dynamo's error at the graph break on the bf16 branch;
    the changes its trace handed over are undone by the next compile, whose report is its own."""
    model, other = BreaksOnTheNewDtype(), mlp()
    weights = list(model.parameters())
    with pytest.raises(Exception, match="graph_break"):
        torch.compile(model, backend=xform.Backend(["cast:bf16"], handoff="eager"), fullgraph=True)(torch.randn(2, 8))
    torch._dynamo.reset()  # compile ids start again at 0/0
    xform.compile(other, "cast:bf16", handoff="eager")(torch.randn(2, 16))

    assert all(a is b for a, b in zip(model.parameters(), weights))
    assert [c.target for c in xform.report(other).changes("cast")] == ["0", "2"]
