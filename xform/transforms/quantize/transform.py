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

from typing import Any, Callable

import torch
from torch import nn

from xform._torch.modules import add_load_hook
from xform.captured import CapturedGraph
from xform.fx_rewrite import example_value
from xform.registry import register_transform
from xform.report import TransformRecord, format_bytes
from xform.transform import Transform, option_error
from xform.transforms.linear_layers import (LayerFilter, LinearLayer, dtype_name, layer_selector,
                                            linear_layers, other_reader_refusal, own_forward_refusal,
                                            parameter_linear_calls, tensor_bytes, unchanged_layers)
from xform.transforms.quantize import recipes
from xform.transforms.quantize.recipes import RECIPES, Device, Plan, Recipe, recipe_list


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
        if torch.is_inference_mode_enabled():
            # torchao's row-wise float8 layer raises under inference_mode ('aten.reshape.default with
            # axiswise scaling is not supported yet'); without gradients it computes the same
            with torch.inference_mode(False), torch.no_grad():
                return torch.func.functional_call(self.module, tensors, (x,))
        return torch.func.functional_call(self.module, tensors, (x,))


def _quantizing_on_load(recipe: str, plan: Plan, name: str) -> Callable[..., None]:
    """A load_state_dict pre-hook: a checkpoint's plain weight for a quantized one is quantized with
    the same recipe before it is copied in (a full-precision checkpoint loads into the quantized
    model, as it loaded into the model before), instead of torchao failing halfway through."""
    def hook(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        key, held = prefix + name, getattr(module, name)
        value = state.get(key)
        if isinstance(value, torch.Tensor) and type(value) is not type(held) and value.shape == held.shape:
            layer = torch.nn.utils.skip_init(nn.Linear, value.shape[1], value.shape[0], bias=False,
                                             device=held.device, dtype=held.dtype)
            with torch.no_grad():
                layer.weight.copy_(value)  # from the checkpoint's device (often the CPU) to the model's
            state[key] = RECIPES[recipe].apply(layer, plan).weight

    return hook


@register_transform
class Quantize(Transform):
    """Linear layers to float8 / MX formats through torchao (`quantize:<recipe>`)."""

    name = "quantize"
    nothing_found = "no nn.Linear layer in this graph"

    def __init__(self, recipe: str, *, filter: LayerFilter = None) -> None:
        if recipe not in RECIPES:
            raise option_error(self.name, "recipe", recipe, recipe_list())
        self.recipe = recipe
        self.filter = filter
        self._selects = layer_selector(filter, self.name)

    @classmethod
    def from_spec(cls, argument: str | None) -> Quantize:
        if argument is None:
            raise ValueError(f"xform: transform 'quantize' needs a recipe, e.g. quantize:float8-rowwise; "
                             f"accepted: {recipe_list()}")
        return cls(argument)

    def inductor_config(self) -> dict[str, Any]:
        return dict(RECIPES[self.recipe].inductor)

    def check(self, device: torch.device | str, handoff: str = "inductor") -> Plan:
        """How the recipe would run on `device` (raises `QuantizeUnsupported` if it cannot)."""
        return self._plan(Device.of(torch.empty(0, device=device)), handoff)

    def _plan(self, device: Device, handoff: str) -> Plan:
        return recipes.cached_plan(self.recipe, device, handoff)  # looked up per call: tests give it a fresh cache

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
        handle = add_load_hook(layer.module, _quantizing_on_load(self.recipe, plan, param.name))
        graph.on_undo(handle.remove)
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
        for node, x, weight, bias, param in parameter_linear_calls(graph):
            if not any(param.owner is module for module in swapped) or not example_value(x).is_floating_point():
                continue  # an integer input raises as written, as it did before the swap
            g = graph.gm.graph
            with g.inserting_before(node):
                call = g.call_function(ModuleForward(param.owner), (x, weight) if bias is None else (x, weight, bias))
            call.meta.update(node.meta)
            node.replace_all_uses_with(call)
            g.erase_node(node)
            rewritten += 1
        if rewritten:
            record.changed("nodes", f"{rewritten} linear calls", f"call torchao's {self.recipe} module forward")
