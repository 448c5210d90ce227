"""The `quantize` transform on CPU: every recipe that runs here, the refusals of those that do not,
what the model holds afterwards, numerics (SQNR against the unquantized model), training, saving."""

from __future__ import annotations

import copy
import functools
import io
import re

import pytest
import torch
from torch import nn

import xform
from xform.transforms import RECIPES, Quantize, QuantizeUnsupported
from xform.transforms.quantize.split_amax import SplitAmaxPairs

# recipe -> (handoff it is tested with on CPU, min output SQNR dB, min gradient SQNR dB)
# Thresholds sit a few dB under what torch 2.13 / torchao 0.18 and torch 2.11 / torchao 0.17 measure.
RUNS_ON_CPU = {
    "float8-tensorwise": ("eager", 22, 18),
    "float8-rowwise": ("eager", 22, 18),
    "float8-rowwise-gw-hp": ("eager", 22, 18),
    "mxfp8": ("inductor", 11, 8),  # torchao's emulated MXFP8 recipe; its eager path retraces (see below)
    "float8-weight-only": ("eager", 24, None),
    "mxfp8-inference": ("eager", 22, None),
    "nvfp4-weight-only": ("eager", 15, None),
}
NOT_ON_CPU = {
    "float8-blockwise": r"recipe 'float8-blockwise' needs an SM90\+ GPU \(H100/H200\) with Triton.*this is CPU\. "
                        r"Here, use float8-rowwise\.",
    "float8-dynamic": r"recipe 'float8-dynamic' needs a CUDA GPU of SM89 or newer .*this is CPU\. Here, use "
                      r"float8-weight-only or nvfp4-weight-only\.",
    "nvfp4": r"recipe 'nvfp4' needs an SM100\+ GPU \(Blackwell\) .*this is CPU\. Here, use nvfp4-weight-only or "
             r"float8-weight-only\.",
}


def ffn(dim: int = 128, hidden: int = 256) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)).bfloat16()


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    reference, actual = reference.float(), actual.float()
    return (20 * torch.log10(reference.norm() / (reference - actual).norm())).item()


def _mxfp8_training_runs_here() -> bool:
    try:
        Quantize("mxfp8").check("cpu", handoff="inductor")
    except QuantizeUnsupported:
        return False
    return True


def cpu_recipes():
    for name, (handoff, out_db, grad_db) in RUNS_ON_CPU.items():
        marks = [pytest.mark.slow] if handoff == "inductor" else []
        if name == "mxfp8":
            marks.append(pytest.mark.skipif(not _mxfp8_training_runs_here(),
                                            reason="torchao 0.17 refuses MXFP8 training on torch 2.11"))
        yield pytest.param(name, handoff, out_db, grad_db, marks=marks, id=name)


@pytest.mark.parametrize("recipe, handoff, out_db, grad_db", list(cpu_recipes()))
def test_recipe_quantizes_the_model_with_its_numerics(recipe, handoff, out_db, grad_db, no_recompile):
    model = ffn()
    reference = copy.deepcopy(model).float()
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=grad_db is not None)
    x_ref = x.detach().float().requires_grad_(grad_db is not None)
    compiled = xform.compile(model, f"quantize:{recipe}", handoff=handoff)

    out = compiled(x)
    expected = reference(x_ref)

    assert sqnr(expected, out) >= out_db
    layer = model[0]
    if RECIPES[recipe].swap_module is not None:
        from torchao.float8.float8_linear import Float8Linear

        assert isinstance(layer, Float8Linear) and type(layer.weight) is nn.Parameter
    else:
        assert type(layer.weight).__module__.startswith("torchao.") and isinstance(layer.weight, nn.Parameter)
    if grad_db is not None:
        out.float().square().sum().backward()
        expected.square().sum().backward()
        assert sqnr(x_ref.grad, x.grad) >= grad_db
        assert sqnr(reference[0].weight.grad, layer.weight.grad) >= grad_db
    with no_recompile():
        compiled(x)
    report = xform.report(model)
    assert [c.target for c in report.changes("quantize") if c.kind == "layer"] == ["0", "2"]
    assert len(report.graphs[0].guard_changes) + len(report.graphs[0].module_swaps) == 2


@pytest.mark.parametrize("recipe, message", NOT_ON_CPU.items(), ids=list(NOT_ON_CPU))
def test_recipes_the_cpu_cannot_run_say_what_they_need_and_what_runs_here(recipe, message):
    model = ffn()
    with pytest.raises(Exception, match=message):
        xform.compile(model, f"quantize:{recipe}", handoff="eager")(torch.randn(4, 128, dtype=torch.bfloat16))
    assert type(model[0].weight) is nn.Parameter  # refused before anything changed
    with pytest.raises(QuantizeUnsupported, match=message):
        Quantize(recipe).check("cpu")


def test_emulated_paths_are_named_in_the_report():
    model = ffn()
    xform.compile(model, "quantize:float8-rowwise", handoff="eager")(torch.randn(4, 128, dtype=torch.bfloat16))
    (note,) = xform.report(model).graphs[0].transforms[0].notes
    assert note == ("float8-rowwise runs emulated here: torchao's emulated float8 matmul (float8 is computed in "
                    "high precision)")
    assert Quantize("float8-rowwise").check("cpu").emulated.startswith("torchao's emulated float8 matmul")


def test_mxfp8_inference_with_inductor_on_cpu_is_refused_with_the_way_out():
    with pytest.raises(QuantizeUnsupported, match=r"Inductor does not compile torchao's emulated MX path on CPU.*"
                                                  r"Here, use handoff='eager'"):
        Quantize("mxfp8-inference").check("cpu", handoff="inductor")


@pytest.mark.parametrize("recipe, ratio", [("float8-weight-only", 1.9), ("nvfp4-weight-only", 3.4)])
def test_parameter_bytes_drop(recipe, ratio):
    from xform.transforms.linear_layers import tensor_bytes

    model = nn.Sequential(nn.Linear(512, 1024, bias=False), nn.GELU(), nn.Linear(1024, 512, bias=False)).bfloat16()
    before = sum(tensor_bytes(p) for p in model.parameters())
    xform.compile(model, f"quantize:{recipe}", handoff="eager")(torch.randn(4, 512, dtype=torch.bfloat16))
    after = sum(tensor_bytes(p) for p in model.parameters())
    assert before / after >= ratio


def test_layers_the_recipe_cannot_take_are_skipped_with_the_reason():
    model = nn.Sequential(nn.Linear(128, 40), nn.Linear(40, 64)).bfloat16()
    xform.compile(model, "quantize:nvfp4-weight-only", handoff="eager")(torch.randn(4, 128, dtype=torch.bfloat16))
    skips = {s.target: s.reason for s in xform.report(model).skips("quantize")}
    assert skips == {
        "0": "nvfp4-weight-only needs in_features and out_features that are multiples of 16; this layer is 128 -> 40",
        "1": "nvfp4-weight-only needs in_features and out_features that are multiples of 16; this layer is 40 -> 64",
    }
    assert type(model[0].weight) is nn.Parameter


def test_mx_recipes_need_bf16_weights():
    model = ffn().float()
    xform.compile(model, "quantize:mxfp8-inference", handoff="eager")(torch.randn(4, 128))
    (skip, _) = xform.report(model).skips("quantize")
    assert skip.reason == ("mxfp8-inference takes bfloat16 weights, this one is float32; convert the model with "
                           "model.bfloat16() first")


def test_filter_limits_the_layers():
    model = ffn()
    xform.compile(model, Quantize("nvfp4-weight-only", filter=["2"]), handoff="eager")(
        torch.randn(4, 128, dtype=torch.bfloat16))
    assert type(model[0].weight) is nn.Parameter and type(model[2].weight).__name__ == "NVFP4Tensor"


def test_training_recipe_steps_an_optimizer():
    model = ffn()
    compiled = xform.compile(model, "quantize:float8-rowwise", handoff="eager")
    x, target = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    compiled(x)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x).float(), target.float())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_a_training_recipe_first_compiled_under_no_grad(monkeypatch):
    """Evaluating a model before training it: the recipe's probe (a backward) still runs."""
    import xform.transforms.quantize.recipes as quantize

    monkeypatch.setattr(quantize, "cached_plan", functools.lru_cache(maxsize=None)(quantize.cached_plan.__wrapped__))
    model = ffn()
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        out = xform.compile(model, "quantize:float8-rowwise", handoff="eager")(x)
    assert out.shape == x.shape and len(xform.report(model).changes("quantize")) == 3  # 2 layers, 1 node rewrite


def test_module_swap_keeps_the_parameter_objects():
    model = ffn()
    weight = model[0].weight
    xform.compile(model, "quantize:float8-tensorwise", handoff="eager")(torch.randn(4, 128, dtype=torch.bfloat16))
    assert model[0].weight is weight  # an optimizer made before the first call still steps the right tensor
    (swap, _) = xform.report(model).graphs[0].module_swaps
    assert swap.describe() == "L['fn'].0: Linear -> ContiguousInputFloat8Linear (quantize)"


def test_recompile_traces_the_quantized_model():
    model = ffn()
    compiled = xform.compile(model, "quantize:float8-rowwise", handoff="eager")
    compiled(torch.randn(4, 128, dtype=torch.bfloat16))
    out = compiled(torch.randn(2, 3, 128, dtype=torch.bfloat16))
    graphs = xform.report(model).graphs
    assert out.shape == (2, 3, 128) and len(graphs) == 2
    assert any("is a ContiguousInputFloat8Linear" in n for n in graphs[1].transforms[0].notes)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("recipe", ["nvfp4-weight-only", "float8-weight-only"])
def test_state_dict_saves_and_loads_into_a_fresh_quantized_model(recipe, assign, no_recompile):
    model = ffn()
    xform.compile(model, f"quantize:{recipe}", handoff="eager")(torch.randn(4, 128, dtype=torch.bfloat16))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)

    fresh = ffn()
    compiled = xform.compile(fresh, f"quantize:{recipe}", handoff="eager")
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    compiled(x)
    fresh.load_state_dict(state, assign=assign)

    with no_recompile():
        torch.testing.assert_close(compiled(x), model(x))


def test_quantize_after_cast_leaves_cast_layers_alone():
    model = ffn().float()
    xform.compile(model, "cast:bf16", "quantize:float8-weight-only", handoff="eager")(torch.randn(4, 128))
    notes = xform.report(model).graphs[0].transforms[1].notes
    assert len(notes) == 2 and "with a LowPrecisionWeight weight, not a plain Linear" in notes[0]


def test_spec_errors():
    with pytest.raises(ValueError, match=r"transform 'quantize' needs a recipe, e.g. quantize:float8-rowwise; "
                                         r"accepted: training: float8-tensorwise, "):
        xform.Backend(["quantize"])
    with pytest.raises(ValueError, match=r"option recipe='int4' is not accepted; accepted: training: .*; inference: "
                                         r"float8-dynamic"):
        xform.Backend(["quantize:int4"])


@pytest.mark.slow
def test_float8_training_through_inductor_matches_torchao_by_hand():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = ffn()
    by_hand = copy.deepcopy(model)
    config = Float8LinearConfig.from_recipe_name("rowwise")
    convert_to_float8_training(by_hand, config=__import__("dataclasses").replace(config, emulate=True))
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    ours = xform.compile(model, "quantize:float8-rowwise")(x)
    theirs = torch.compile(by_hand)(x)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("recipe", ["float8-rowwise", "nvfp4-weight-only"])
def test_composes_with_flex_attention(recipe):
    from models import TransformerBlock

    model = TransformerBlock(dim=64, heads=4).bfloat16()
    reference = copy.deepcopy(model).float()
    training = RECIPES[recipe].training
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=training)
    x_ref = x.detach().float().requires_grad_(training)

    out = xform.compile(model, f"quantize:{recipe}", "flex-attention", handoff="eager")(x)
    expected = reference(x_ref)

    report = xform.report(model)
    assert len(report.changes("flex-attention")) == 1
    assert [c.target for c in report.changes("quantize") if c.kind == "layer"] == ["qkv", "proj", "up", "down"]
    assert sqnr(expected, out) >= RUNS_ON_CPU[recipe][1]
    if training:
        out.float().square().sum().backward()
        expected.square().sum().backward()
        assert sqnr(x_ref.grad, x.grad) >= RUNS_ON_CPU[recipe][2]


def test_regression_rowwise_float8_after_a_transpose():
    """Corpus seed 0: a Linear fed a transposed (non-contiguous) activation. torchao's Float8Linear
    with row-wise scales cannot reshape it (`clone` has no axiswise-scaled form); xform's swapped-in
    layer makes its input contiguous first."""
    conv = nn.Conv1d(32, 32, 3, padding=1)
    linear = nn.Linear(32, 32)
    model = nn.Sequential(conv, linear)

    def forward(x):
        return model[1](model[0](x.transpose(1, 2)).transpose(1, 2))

    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = forward(x)
    out = xform.compile(forward, "quantize:float8-rowwise", handoff="eager")(x)
    out.sum().backward()
    assert sqnr(expected, out) >= 20 and type(model[1]).__name__ == "ContiguousInputFloat8Linear"


def test_a_recipe_whose_torchao_module_raises_on_import_is_refused_with_the_reason(monkeypatch):
    """Met on the H200: torchao 0.17's blockwise module imports its CuTeDSL kernels, which raise
    ModuleNotFoundError against the CuTeDSL FlashAttention-4 brings; that is a refusal naming the
    recipe and torchao's error, not a crash (it had stopped a whole pytest collection)."""
    import dataclasses

    import xform.transforms.quantize.recipes as quantize

    def broken_import(device, handoff):
        raise ModuleNotFoundError("No module named 'cutlass.base_dsl._mlir_helpers'")

    monkeypatch.setattr(quantize, "cached_plan", functools.lru_cache(maxsize=None)(quantize.cached_plan.__wrapped__))
    monkeypatch.setitem(quantize.RECIPES, "float8-rowwise",
                        dataclasses.replace(quantize.RECIPES["float8-rowwise"], plan=broken_import))
    with pytest.raises(QuantizeUnsupported, match=r"recipe 'float8-rowwise' does not run here .*torchao raised "
                                                   r"ModuleNotFoundError: No module named 'cutlass.base_dsl._mlir_helpers'"
                                                   r"\. Here, use "):
        Quantize("float8-rowwise").check("cpu")


def test_a_recipe_with_a_costly_first_use_says_so_in_the_report(monkeypatch):
    """float8-blockwise autotunes for minutes on first use (H100, 2026-12-06); it needs a GPU, so
    a CPU recipe stands in for it here, and the GPU test reads the real note."""
    import dataclasses

    import xform.transforms.quantize.recipes as quantize

    monkeypatch.setitem(quantize.RECIPES, "nvfp4-weight-only",
                        dataclasses.replace(quantize.RECIPES["nvfp4-weight-only"], first_use="autotunes for minutes"))
    model = ffn()
    with torch.no_grad():
        xform.compile(model, "quantize:nvfp4-weight-only", handoff="eager")(torch.randn(4, 128, dtype=torch.bfloat16))
    assert "nvfp4-weight-only: autotunes for minutes" in xform.report(model).notes("quantize")


def test_torchao_inference_settings_reach_the_quantized_graphs_only():
    # torchao's float8 inference configs set coordinate-descent tuning on the process's global
    # Inductor config; xform keeps the global config as it was and asks for the settings for
    # its own compiles, where the user's options still win
    import torch._inductor.config as inductor_config

    before = (inductor_config.coordinate_descent_tuning, inductor_config.coordinate_descent_check_all_directions)
    model = ffn()
    compiled = xform.compile(model, "quantize:float8-weight-only", handoff="eager")
    compiled(torch.randn(4, 128, dtype=torch.bfloat16))
    assert (inductor_config.coordinate_descent_tuning, inductor_config.coordinate_descent_check_all_directions) == before
    assert xform.Backend(["quantize:float8-weight-only"]).pipeline.handoff.config_patches["coordinate_descent_tuning"]
    user = xform.Backend(["quantize:float8-dynamic"], inductor_options={"coordinate_descent_tuning": False})
    assert user.pipeline.handoff.config_patches["coordinate_descent_tuning"] is False
    assert xform.Backend(["quantize:float8-rowwise-gw-hp"]).pipeline.handoff.config_patches is None


def test_rowwise_training_asks_inductor_for_its_settings_for_its_backends_graphs_only():
    # the row-wise gradient scales reduce over the strided dimension; nd tiling made the H200's FFN
    # step 1.18x bf16 where Inductor's default gave 1.02x (docs/benchmarks-history.md); the amax pass keeps
    # the transposed casts out of the row reductions' kernels (tests/test_split_amax.py)
    import torch._inductor.config as inductor_config

    before = inductor_config.triton.prefer_nd_tiling
    patches = xform.Backend(["quantize:float8-rowwise"]).pipeline.handoff.config_patches
    assert patches.keys() == {"triton.prefer_nd_tiling", "post_grad_custom_post_pass"}
    assert patches["triton.prefer_nd_tiling"] is True and isinstance(patches["post_grad_custom_post_pass"], SplitAmaxPairs)
    assert xform.Backend(["quantize:float8-tensorwise"]).pipeline.handoff.config_patches is None
    user = xform.Backend(["quantize:float8-rowwise"],
                         inductor_options={"triton.prefer_nd_tiling": False, "post_grad_custom_post_pass": None})
    assert user.pipeline.handoff.config_patches == {"triton.prefer_nd_tiling": False, "post_grad_custom_post_pass": None}
    assert inductor_config.triton.prefer_nd_tiling == before


def test_an_inference_recipe_in_a_graph_that_trains_says_its_weights_get_no_gradient():
    training, inference = ffn(), ffn()
    xform.compile(training, "quantize:nvfp4-weight-only", handoff="eager")(torch.randn(4, 128, dtype=torch.bfloat16))
    with torch.no_grad():
        xform.compile(inference, "quantize:nvfp4-weight-only", handoff="eager")(torch.randn(4, 128, dtype=torch.bfloat16))

    (note,) = [n for n in xform.report(training).graphs[0].transforms[0].notes if "inference recipe" in n]
    assert note.startswith("nvfp4-weight-only is an inference recipe, and this graph trains (")
    assert note.endswith("its quantized weights get none, so they stay as quantized. For training pick a training "
                         "recipe (float8-rowwise, float8-tensorwise, mxfp8)")
    assert not any("inference recipe" in n for n in xform.report(inference).graphs[0].transforms[0].notes)


def blockwise_scaled_mm(a8, b8, a_scale, b_scale, out_dtype):
    """What `torch._scaled_mm` should compute with 1x128 scales for `a` and 128x128 scales for `b`."""
    a = a8.float() * a_scale.repeat_interleave(128, 1)
    b = b8.float() * b_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (a @ b).to(out_dtype)


def scales_ignored(a8, b8, a_scale, b_scale, out_dtype):
    return blockwise_scaled_mm(a8, b8, torch.ones_like(a_scale), torch.ones_like(b_scale), out_dtype)


def weight_scales_transposed(a8, b8, a_scale, b_scale, out_dtype):
    return blockwise_scaled_mm(a8, b8, a_scale, b_scale.t(), out_dtype)


def row_scales_reversed(a8, b8, a_scale, b_scale, out_dtype):
    return blockwise_scaled_mm(a8, b8, a_scale.flip(0), b_scale, out_dtype)


def test_the_blockwise_probe_tells_a_right_gemm_from_one_that_misreads_the_scales():
    from xform.transforms.quantize.probe import RIGHT_DB, blockwise_sqnr

    cpu = torch.device("cpu")
    assert blockwise_sqnr(cpu, blockwise_scaled_mm) >= 25.0
    assert all(blockwise_sqnr(cpu, wrong) < RIGHT_DB
               for wrong in (scales_ignored, weight_scales_transposed, row_scales_reversed))


def test_float8_blockwise_is_refused_where_torchs_blockwise_gemm_computes_wrong(monkeypatch):
    """On the H200 with torch 2.11 (2026-12-07) torchao's blockwise module gave 3 dB against bf16, its
    gradients -inf: torch._scaled_mm misread the block scales. The probe's verdict refuses the recipe."""
    import xform.transforms.quantize.recipes as quantize
    from xform.transforms.quantize.probe import blockwise_gemm_error

    monkeypatch.setattr(torch, "_scaled_mm", scales_ignored)
    wrong = blockwise_gemm_error.__wrapped__(torch.device("cpu"))
    assert re.fullmatch(r"torch\._scaled_mm with 1x128/128x128 block scales, which torchao's blockwise module "
                        r"calls, computed a probe GEMM wrong here \(-?\d+\.\d dB SQNR against float32; right is about "
                        r"28\) with torch .*", wrong), wrong
    monkeypatch.setattr(quantize, "blockwise_gemm_error", lambda device: wrong)
    h200 = quantize.Device("cuda", (9, 0), "NVIDIA H200")
    with pytest.raises(QuantizeUnsupported, match=r"recipe 'float8-blockwise' would give wrong results on NVIDIA H200 "
                                                  r"\(SM90\): torch\._scaled_mm with .* Here, use float8-rowwise\."):
        quantize.RECIPES["float8-blockwise"].plan(h200, "inductor")


def test_the_blockwise_probe_reports_torchs_refusal_of_the_layout():
    """The CPU's torch._scaled_mm takes no block scales: said as such, not raised."""
    from xform.transforms.quantize.probe import blockwise_gemm_error

    assert blockwise_gemm_error.__wrapped__(torch.device("cpu")).startswith(
        "torch._scaled_mm refused 1x128/128x128 block scales (Invalid scaling configuration.")


@pytest.mark.parametrize("spec", ["quantize:float8-weight-only", "quantize:nvfp4-weight-only", "cast:bf16"])
def test_the_model_can_be_moved_and_converted_after_its_weights_were_replaced(spec):
    """xform leaves no weak reference on the weights it put in the model (Dynamo's graph arguments,
    fake tensors kept with the graph), which made `.float()` / `.to()` refuse to swap them."""
    model = nn.Sequential(nn.Linear(128, 128))
    if spec.startswith("quantize"):
        model.bfloat16()
    with torch.no_grad():
        xform.compile(model, spec, handoff="eager")(torch.randn(4, 128, dtype=model[0].weight.dtype))
    replaced = type(model[0].weight)
    assert replaced is not nn.Parameter
    model.to("cpu")
    model.half()  # a dtype conversion swaps a tensor subclass's parameters


def test_a_model_with_swapped_float8_layers_can_be_saved_and_loaded_whole():
    """torch.save(model) pickles the layers by class: the swapped-in class lives at a module's top
    level (a class made inside a function could not be pickled)."""
    import io

    model = nn.Sequential(nn.Linear(128, 128)).bfloat16()
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    out = xform.compile(model, "quantize:float8-rowwise", handoff="eager")(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert type(loaded[0]).__name__ == "ContiguousInputFloat8Linear"
    torch.testing.assert_close(loaded(x), out)


class WithHooks(nn.Module):
    """A Linear carrying hooks and an attribute its parent's forward reads (a LoRA scale, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(128, 128)
        self.fc.lora_scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.fc.lora_scale


def test_hooks_and_attributes_of_a_swapped_layer_survive_the_swap():
    model = WithHooks().bfloat16()
    seen: list[str] = []
    pre = model.fc.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    model.fc.register_forward_hook(lambda module, args, out: seen.append("post"))
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    expected = model(x)
    seen.clear()
    out = xform.compile(model, "quantize:float8-rowwise", handoff="eager")(x)
    assert type(model.fc).__name__ == "ContiguousInputFloat8Linear" and model.fc.lora_scale == 2.0
    assert seen == ["pre", "post"]
    assert sqnr(expected, out) >= 20
    pre.remove()  # the handle still removes the hook from the swapped-in layer
    seen.clear()
    model(x)
    assert seen == ["post"]


@pytest.mark.parametrize("recipe", ["float8-rowwise", "float8-rowwise-gw-hp"])
def test_a_float8_training_recipe_first_called_under_inference_mode(recipe):
    """torchao's row-wise float8 layer raised under inference_mode; without gradients it computes the
    same, so the swapped layer runs that way there."""
    model = nn.Sequential(nn.Linear(128, 128)).bfloat16()
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    expected = model(x)
    with torch.inference_mode():
        out = xform.compile(model, f"quantize:{recipe}", handoff="eager")(x)
    assert type(model[0]).__name__ == "ContiguousInputFloat8Linear" and sqnr(expected, out) >= 20


@pytest.mark.parametrize("recipe", ["float8-weight-only", "nvfp4-weight-only"])
def test_a_full_precision_checkpoint_loads_into_a_weight_only_model(recipe):
    """A checkpoint saved before quantizing (float32 here) loads: each weight is quantized with the
    same recipe on the way in (torchao failed halfway: "'Tensor' object has no attribute 'qdata'")."""
    model = nn.Sequential(nn.Linear(128, 128)).bfloat16()
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        step = xform.compile(model, f"quantize:{recipe}", handoff="eager")
        step(x)
    trained = nn.Sequential(nn.Linear(128, 128))  # other weights, in float32
    model.load_state_dict(trained.state_dict())
    with torch.no_grad():
        got, expected = step(x), trained.bfloat16()(x)
    assert type(model[0].weight).__name__ in ("Float8Tensor", "NVFP4Tensor")
    assert sqnr(expected, got) >= 15
