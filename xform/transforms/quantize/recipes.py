"""The quantize recipes: per recipe, torchao's config, what it takes (multiples, bias, dtype),
what it needs of the device and what runs instead, its Inductor settings, and the check that
tries it once on a small layer of the device before any model is changed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from xform.transforms.quantize.probe import blockwise_gemm_error
from xform.transforms.quantize.split_amax import SplitAmaxPairs


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
# two dimensions makes it coalesced (measured: docs/benchmarks-history.md, "2-D tiling"); the
# other float8 recipes' casts have no such reduction, so the setting is this recipe's alone.
# The gradients' row and column amaxes are also reduced in two stages (`split_amax`), so that
# their casts, one of them transposed, are not fused into the row reduction's kernel.
ROWWISE_INDUCTOR = {"triton.prefer_nd_tiling": True, "post_grad_custom_post_pass": SplitAmaxPairs()}


def _to_float8_linear(linear: nn.Linear, config: Any) -> nn.Module:
    from xform.transforms.quantize.float8_linear import ContiguousInputFloat8Linear

    return ContiguousInputFloat8Linear.from_float(linear, config=config)


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


@functools.lru_cache(maxsize=None)
def cached_plan(recipe: str, device: Device, handoff: str) -> Plan:
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


def recipe_list() -> str:
    training = ", ".join(n for n, r in RECIPES.items() if r.training)
    inference = ", ".join(n for n, r in RECIPES.items() if not r.training)
    return f"training: {training}; inference: {inference}"
