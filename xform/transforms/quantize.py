"""`Quantize`: Linear layers to float8 and MX formats through torchao, the weights really replaced.

`Quantize(recipe, filter=None)`, spec `quantize:<recipe>`. Every recipe is torchao's own code; what
xform adds is doing it from inside the compiler, per captured graph, with the guards to match.

What it changes, per graph, for each selected Linear:
- weight recipes (inference, and MXFP8 training): torchao's `quantize_` replaces the layer's
  weight with a torchao tensor subclass (`Float8Tensor`, `MXTensor`, `NVFP4Tensor`, ...); the
  graph is unchanged (the subclass computes `F.linear` itself) and the guard on the weight now
  expects the subclass, its flatten metadata and each of its inner tensors;
- module recipes (float8 training, blockwise training): the layer is swapped for torchao's module
  (`Float8Linear`, `Float8BlockwiseLinear`) that keeps the same weight parameter; the graph's
  `linear` call becomes a call of that module's forward on the graph's weight, and the module's
  type guard expects the new class.
Either way the model keeps torchao's eager meaning, so a recompile retraces it correctly.

What it refuses: a recipe the device cannot run raises `QuantizeUnsupported` before anything is
changed, naming what it needs and what runs here instead (an emulated path torchao has is used
instead and named in the report); layers whose shape or dtype the recipe cannot take, tied
weights and weights read by other ops are skipped, each with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx, nn

from xform.captured import CapturedGraph
from xform.linear_layers import (
    LinearLayer,
    dtype_name,
    format_bytes,
    is_linear,
    linear_layers,
    linear_operands,
    other_reader_refusal,
    own_forward_refusal,
    tensor_bytes,
    unchanged_layers,
)
from xform.registry import register_transform
from xform.report import TransformRecord
from xform.scaled_mm_probe import blockwise_gemm_error
from xform.selection import LayerFilter, layer_selector
from xform.split_amax import SplitAmaxPairs
from xform.transform import Transform, option_error


class QuantizeUnsupported(ValueError):
    """The recipe cannot run on this device (or with this torch/torchao), and has no emulated path."""


@dataclass(frozen=True)
class Device:
    """What a recipe's hardware check looks at."""

    type: str
    capability: tuple[int, int] | None = None
    name: str = ""

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Device:
        if tensor.device.type == "cuda":
            index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
            return cls("cuda", torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index))
        return cls(tensor.device.type)

    def at_least(self, major: int, minor: int = 0) -> bool:
        return self.type == "cuda" and self.capability is not None and self.capability >= (major, minor)

    def __str__(self) -> str:
        if self.type != "cuda":
            return self.type.upper()
        return f"{self.name} (SM{self.capability[0]}{self.capability[1]})"


@dataclass(frozen=True)
class Plan:
    """How a recipe runs on a device: torchao's config, and the emulation note if it is emulated."""

    config: Any
    emulated: str | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    training: bool
    summary: str
    plan: Callable[[Device, str], Plan]  # (device, handoff) -> Plan, or raises QuantizeUnsupported
    swap_module: Callable[[nn.Linear, Any], nn.Module] | None = None  # module recipes; None: weight recipe
    multiple_of: int = 16  # in_features and out_features must be multiples of this
    bf16_weights: bool = False
    bias: bool = True  # whether the recipe takes layers with a bias
    instead: str = "float8-weight-only"  # what to suggest when torchao cannot run it here
    # Inductor settings for the graphs of a backend using the recipe (all its graphs: the settings are
    # the handoff's, fixed when the backend is made, before any graph is seen)
    inductor: dict[str, Any] = dataclasses.field(default_factory=dict)
    # what the first step costs that later ones do not, for the report: a user waiting minutes on a
    # first compile should know that it is expected and why
    first_use: str = ""

    def apply(self, linear: nn.Linear, plan: Plan) -> nn.Module:
        """Quantize one layer: swap its weight in place (returns it) or return the swapped-in module."""
        if self.swap_module is not None:
            return self.swap_module(linear, plan.config)
        from torchao.quantization import quantize_

        quantize_(linear, plan.config)
        return linear


def _unsupported(recipe: str, device: Device, needs: str, instead: str) -> QuantizeUnsupported:
    return QuantizeUnsupported(
        f"xform: transform 'quantize': recipe '{recipe}' needs {needs}; this is {device}. Here, use {instead}."
    )


# -- float8 training (torchao.float8: Float8Linear) ------------------------------------------------

def _float8_training(recipe_name: str, recipe: str) -> Callable[[Device, str], Plan]:
    def plan(device: Device, handoff: str) -> Plan:
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(recipe_name)
        if device.at_least(8, 9):
            return Plan(config)
        if device.type == "cpu":
            return Plan(dataclasses.replace(config, emulate=True),
                        emulated="torchao's emulated float8 matmul (float8 is computed in high precision)")
        raise _unsupported(recipe, device, "a CUDA GPU of SM89 or newer (Ada, Hopper, Blackwell) for float8 matmuls",
                           "cast:bf16")
    return plan


# Row-wise scales of the gradients need an amax over the token dimension, which Inductor fuses into
# the producer's kernel (SwiGLU's backward) as a reduction along the strided dimension; tiling in
# two dimensions makes it coalesced. On the H200 (docs/benchmarks.md) this took the FFN's
# float8-rowwise training step from 12.6 to 10.9 ms (bf16: 12.8-13.0 ms); the same setting gave
# nothing to tensorwise or rowwise-gw-hp, whose casts have no such reduction, so it is this recipe's alone.
# The gradients' row and column amaxes are also reduced in two stages (xform/split_amax.py), so that
# their casts, one of them transposed, are not fused into the row reduction's kernel.
ROWWISE_INDUCTOR = {"triton.prefer_nd_tiling": True, "post_grad_custom_post_pass": SplitAmaxPairs()}


def _to_float8_linear(linear: nn.Linear, config: Any) -> nn.Module:
    return _contiguous_float8_linear_class().from_float(linear, config=config)


@functools.lru_cache(maxsize=None)
def _contiguous_float8_linear_class() -> type:
    """torchao's Float8Linear, fed a contiguous input: with row-wise scales torchao cannot reshape a
    non-contiguous [.., K] input (its `clone` has no axiswise-scaled form), which a Linear after a
    transpose (a conv, an attention output) hands it. Made on first use, so torchao loads lazily."""
    from torchao.float8.float8_linear import Float8Linear

    class ContiguousInputFloat8Linear(Float8Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input.contiguous())

    return ContiguousInputFloat8Linear


def _blockwise_plan(device: Device, handoff: str) -> Plan:
    if not device.at_least(9, 0):
        raise _unsupported("float8-blockwise", device, "an SM90+ GPU (H100/H200) with Triton: torchao's blockwise "
                           "float8 training kernels are Triton kernels for Hopper", "float8-rowwise")
    wrong = blockwise_gemm_error(torch.device("cuda"))
    if wrong is not None:
        raise QuantizeUnsupported(f"xform: transform 'quantize': recipe 'float8-blockwise' would give wrong results "
                                  f"on {device}: {wrong}. Here, use float8-rowwise.")
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinearConfig

    return Plan(Float8BlockwiseLinearConfig())


def _to_blockwise_linear(linear: nn.Linear, config: Any) -> nn.Module:
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

    return Float8BlockwiseLinear.from_float(linear)


# -- MX and float8 through quantize_ (weight recipes) ----------------------------------------------

def _mxfp8_training_plan(device: Device, handoff: str) -> Plan:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    if device.at_least(10, 0):
        return Plan(MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL))
    return Plan(MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
                emulated="torchao's emulated MXFP8 recipe (no SM100 MXFP8 kernels here)")


# torchao's `recommended_inductor_config_setter`, which its float8 inference configs run by default
# (`set_inductor_config=True`) on the process's global Inductor config, changing every later
# compile in the process (coordinate descent over all directions: minutes of compile for a model
# with attention). xform turns that off and asks for the same settings for the graphs it compiles only.
TORCHAO_INDUCTOR = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True,
                    "force_fuse_int_mm_with_mul": True}


def _float8_dynamic_plan(device: Device, handoff: str) -> Plan:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    if not device.at_least(8, 9):
        raise _unsupported("float8-dynamic", device, "a CUDA GPU of SM89 or newer for float8 matmuls with "
                           "dynamically quantized activations", "float8-weight-only or nvfp4-weight-only")
    return Plan(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False))


def _float8_weight_only_plan(device: Device, handoff: str) -> Plan:
    from torchao.quantization import Float8WeightOnlyConfig

    return Plan(Float8WeightOnlyConfig(set_inductor_config=False))


def _mxfp8_inference_plan(device: Device, handoff: str) -> Plan:
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig
    from torchao.quantization.quantize_.common import KernelPreference

    if device.at_least(10, 0):
        return Plan(MXDynamicActivationMXWeightConfig())
    if device.type == "cpu" and handoff == "inductor":
        raise _unsupported("mxfp8-inference", device, "an SM100 GPU, or on CPU handoff='eager': Inductor does not "
                           "compile torchao's emulated MX path on CPU (float8_e8m0fnu scales)",
                           "handoff='eager', or nvfp4-weight-only / float8-weight-only")
    return Plan(MXDynamicActivationMXWeightConfig(kernel_preference=KernelPreference.EMULATED),
                emulated="torchao's emulated MXFP8 matmul (no SM100 MX kernels here)")


def _nvfp4_plan(device: Device, handoff: str) -> Plan:
    from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

    if not device.at_least(10, 0):
        raise _unsupported("nvfp4", device, "an SM100+ GPU (Blackwell) for NVFP4 activations and matmuls",
                           "nvfp4-weight-only or float8-rowwise" if device.type == "cuda"
                           else "nvfp4-weight-only or float8-weight-only")
    return Plan(NVFP4DynamicActivationNVFP4WeightConfig())


def _nvfp4_weight_only_plan(device: Device, handoff: str) -> Plan:
    from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig

    return Plan(NVFP4WeightOnlyConfig())


RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("float8-tensorwise", True, "float8 training, one scale per tensor (fastest float8 on H100/H200)",
           _float8_training("tensorwise", "float8-tensorwise"), _to_float8_linear, instead="cast:bf16"),
    Recipe("float8-rowwise", True, "float8 training, one scale per row (more accurate)",
           _float8_training("rowwise", "float8-rowwise"), _to_float8_linear, instead="cast:bf16",
           inductor=ROWWISE_INDUCTOR),
    Recipe("float8-rowwise-gw-hp", True, "float8 rowwise training, weight gradient in high precision",
           _float8_training("rowwise_with_gw_hp", "float8-rowwise-gw-hp"), _to_float8_linear, instead="cast:bf16"),
    Recipe("float8-blockwise", True, "DeepSeek-V3 style float8 training: 1x128 activation, 128x128 weight blocks "
                                     "(tokens per step a multiple of 128)",
           _blockwise_plan, _to_blockwise_linear, multiple_of=128, bf16_weights=True, bias=False,
           instead="float8-rowwise",
           first_use="the first step with a new layer shape takes minutes, not seconds: torchao's blockwise Triton "
                     "kernels autotune on first use (45 configurations for each quantization kernel, per size), "
                     "measured 1-1.5 minutes a layer shape on an H100. Triton keeps the compiled kernels on disk, "
                     "so a later process takes seconds"),
    Recipe("mxfp8", True, "MXFP8 training (32-element blocks, e8m0 scales)", _mxfp8_training_plan,
           multiple_of=32, bf16_weights=True, instead="float8-rowwise"),
    Recipe("float8-dynamic", False, "float8 weights and per-row dynamically quantized activations",
           _float8_dynamic_plan, inductor=TORCHAO_INDUCTOR),
    Recipe("float8-weight-only", False, "float8 weights, activations in high precision", _float8_weight_only_plan,
           multiple_of=1, inductor=TORCHAO_INDUCTOR),
    Recipe("mxfp8-inference", False, "MXFP8 weights and activations", _mxfp8_inference_plan, multiple_of=32,
           bf16_weights=True),
    Recipe("nvfp4", False, "NVFP4 weights and activations (Blackwell)", _nvfp4_plan),
    Recipe("nvfp4-weight-only", False, "NVFP4 weights, activations in high precision", _nvfp4_weight_only_plan),
]}


class ModuleForward:
    """Graph call target: run a swapped-in torchao module's forward on the weight (and bias) the
    graph passes, so the graph keeps taking the parameters as inputs. It computes a linear layer
    with the operands of `F.linear` (`computes_linear`), so graph passes that cut linear layers
    (tensor parallelism) can cut it too; a None bias means none, even where the module has one (a
    row-parallel layer adds its bias after summing over ranks)."""

    computes_linear = True

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.__name__ = f"{type(module).__name__}_forward"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        tensors = {"weight": weight} if self.module.bias is None else {"weight": weight, "bias": bias}
        return torch.func.functional_call(self.module, tensors, (x,))


@register_transform
class Quantize(Transform):
    """Linear layers to float8 / MX formats through torchao (`quantize:<recipe>`)."""

    name = "quantize"

    def __init__(self, recipe: str, *, filter: LayerFilter = None) -> None:
        if recipe not in RECIPES:
            raise option_error(self.name, "recipe", recipe, _recipe_list())
        self.recipe = recipe
        self.filter = filter
        self._selects = layer_selector(filter, self.name)

    @classmethod
    def from_spec(cls, argument: str | None) -> Quantize:
        if argument is None:
            raise ValueError(f"xform: transform 'quantize' needs a recipe, e.g. quantize:float8-rowwise; "
                             f"accepted: {_recipe_list()}")
        return cls(argument)

    def inductor_config(self) -> dict[str, Any]:
        return dict(RECIPES[self.recipe].inductor)

    def check(self, device: torch.device | str, handoff: str = "inductor") -> Plan:
        """How the recipe would run on `device` (raises `QuantizeUnsupported` if it cannot)."""
        return self._plan(Device.of(torch.empty(0, device=device)), handoff)

    def _plan(self, device: Device, handoff: str) -> Plan:
        return _cached_plan(self.recipe, device, handoff)

    def transform_parameters(self, graph: CapturedGraph, record: TransformRecord) -> None:
        recipe = RECIPES[self.recipe]
        layers = linear_layers(graph, self._selects)
        fresh = [layer for layer in layers if not self._already_quantized(layer, record)]
        if fresh:
            plan = self._plan(Device.of(fresh[0].weight.tensor), graph.handoff)
            if plan.emulated:
                record.note(f"{self.recipe} runs emulated here: {plan.emulated}")
            if recipe.first_use:
                record.note(f"{self.recipe}: {recipe.first_use}")
            training = [layer.path for layer in fresh if layer.weight.tensor.requires_grad]
            if not recipe.training and torch.is_grad_enabled() and training:
                record.note(f"{self.recipe} is an inference recipe, and this graph trains ({training[0]}'s weight "
                            f"needs a gradient): its quantized weights get none, so they stay as quantized. For "
                            f"training pick a training recipe (float8-rowwise, float8-tensorwise, mxfp8)")
            for layer in fresh:
                reason = self._refusal(recipe, layer)
                if reason is not None:
                    record.skipped(layer.path, reason)
                elif recipe.swap_module is None:
                    self._swap_weight(graph, layer, plan, record)
                else:
                    self._swap_module(graph, layer, recipe, plan, record)
        for path, reason in unchanged_layers(graph, self._selects):
            record.skipped(path, reason)

    def _already_quantized(self, layer: LinearLayer, record: TransformRecord) -> bool:
        swapped = type(layer.module).__module__.startswith(("torchao.", "xform."))  # by torchao or by this transform
        if type(layer.weight.tensor) is nn.Parameter and (type(layer.module) is nn.Linear or not swapped):
            return False  # a Linear subclass of the model's own is refused with its reason
        record.note(f"{layer.path} is a {type(layer.module).__name__} with a {type(layer.weight.tensor).__name__} "
                    f"weight, not a plain Linear (quantized by an earlier compile, or changed by hand): left as it is")
        return True

    def _refusal(self, recipe: Recipe, layer: LinearLayer) -> str | None:
        if (own_forward := own_forward_refusal(layer)) is not None:
            return own_forward
        out_features, in_features = layer.module.out_features, layer.module.in_features
        if in_features % recipe.multiple_of or out_features % recipe.multiple_of:
            return (f"{recipe.name} needs in_features and out_features that are multiples of {recipe.multiple_of}; "
                    f"this layer is {in_features} -> {out_features}")
        if recipe.bf16_weights and layer.weight.tensor.dtype != torch.bfloat16:
            return (f"{recipe.name} takes bfloat16 weights, this one is {dtype_name(layer.weight.tensor.dtype)}; "
                    f"convert the model with model.bfloat16() first")
        if not recipe.bias and layer.module.bias is not None:
            return f"{recipe.name} takes layers without a bias (torchao's kernels have no bias term)"
        return next(filter(None, (other_reader_refusal(p) for p in layer.params)), None)

    def _swap_weight(self, graph: CapturedGraph, layer: LinearLayer, plan: Plan, record: TransformRecord) -> None:
        param = layer.weight
        before = param.tensor
        after = RECIPES[self.recipe].apply(layer.module, plan).weight  # torchao assigned it to the module
        setattr(param.owner, param.name, before)  # so that undoing the replacement puts back the original
        graph.replace_parameter(param, after, by=self.name)
        record.changed("layer", layer.path, f"{dtype_name(before.dtype)} -> {type(after).__name__}, "
                                            f"{format_bytes(tensor_bytes(before))} -> {format_bytes(tensor_bytes(after))}")

    def _swap_module(self, graph: CapturedGraph, layer: LinearLayer, recipe: Recipe, plan: Plan,
                     record: TransformRecord) -> None:
        swapped = recipe.apply(layer.module, plan)
        graph.replace_module(layer.weight, swapped, by=self.name)
        record.changed("layer", layer.path, f"Linear -> {type(swapped).__name__} ({recipe.name}), "
                                            f"weight kept in {dtype_name(layer.weight.tensor.dtype)}")

    def transform_graph(self, graph: CapturedGraph, record: TransformRecord) -> None:
        """Point each linear call of a swapped layer at the swapped module's forward."""
        swapped = graph.modules_replaced_by(self.name)
        rewritten = 0
        for node in list(graph.gm.graph.nodes):
            if not is_linear(node):
                continue
            x, weight, bias = linear_operands(node)
            param = graph.parameter_for(weight) if isinstance(weight, fx.Node) else None
            if param is None or not any(param.owner is module for module in swapped):
                continue
            g = graph.gm.graph
            with g.inserting_before(node):
                call = g.call_function(ModuleForward(param.owner), (x, weight) if bias is None else (x, weight, bias))
            call.meta.update(node.meta)
            node.replace_all_uses_with(call)
            g.erase_node(node)
            rewritten += 1
        if rewritten:
            record.changed("nodes", f"{rewritten} linear calls", f"call torchao's {self.recipe} module forward")


@functools.lru_cache(maxsize=None)
def _cached_plan(recipe: str, device: Device, handoff: str) -> Plan:
    """The recipe's plan for the device, tried once on a small layer there: torchao knows best what
    its kernels accept (e.g. torchao 0.17 refuses MXFP8 training on torch 2.11), and a refusal is
    far clearer here than from deep inside a compile. Importing the recipe's torchao module is part
    of the try: torchao 0.17's blockwise module imports its CuTeDSL kernels, which raise on a
    CuTeDSL of another version (the one FlashAttention-4 brings, say)."""
    spec = RECIPES[recipe]
    dtype = torch.bfloat16 if spec.bf16_weights or device.type == "cuda" else torch.float32
    try:
        plan = spec.plan(device, handoff)
        probe = nn.Linear(128, 128, bias=spec.bias, device=torch.device(device.type), dtype=dtype)
        with torch.enable_grad():  # a training recipe is probed with a backward, even when compiled under no_grad
            layer = spec.apply(probe, plan)
            x = torch.randn(128, 128, device=probe.weight.device, dtype=dtype, requires_grad=spec.training)
            out = layer(x)
            if spec.training:
                out.float().sum().backward()
    except QuantizeUnsupported:
        raise
    except Exception as error:
        raise QuantizeUnsupported(
            f"xform: transform 'quantize': recipe '{recipe}' does not run here ({device}, torch {torch.__version__}, "
            f"torchao {_torchao_version()}): torchao raised {type(error).__name__}: {str(error).strip()[:300]}. "
            f"Here, use {spec.instead}."
        ) from error
    return plan


def _torchao_version() -> str:
    import torchao

    return torchao.__version__


def _recipe_list() -> str:
    training = ", ".join(n for n, r in RECIPES.items() if r.training)
    inference = ", ".join(n for n, r in RECIPES.items() if not r.training)
    return f"training: {training}; inference: {inference}"
