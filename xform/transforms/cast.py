"""`Cast`: selected Linear layers hold their weight and bias in bf16 (or fp16) and compute in it.

What it changes, per graph:
- the model: each selected `nn.Linear` gets its `weight`/`bias` replaced by a `LowPrecisionWeight`
  parameter of the new dtype (half the bytes of fp32); the module really holds it afterwards, so
  an optimizer created after the first call steps the new parameters;
- the graph: `linear(x, w, b)` becomes `linear(x.to(bf16), w, b).to(x.dtype)`;
- the guards: each replaced parameter is guarded as what it now is (type, dtype), so assigning a
  new fp32 weight later recompiles (and the new weight is cast again) instead of running code
  built for bf16.

`LowPrecisionWeight` gives eager PyTorch the same meaning as the rewritten graph (a Linear computes
in its weight's dtype and returns its input's dtype), which is what makes a later recompile
(new input shape, graph break) trace the already-cast model correctly.

What it refuses, with the reason in the report: parameters read by anything other than a linear
call (a tied embedding, a hand-written matmul), since those ops would silently see bf16 values;
non-floating parameters; layers already in the target dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from xform._torch.dispatch import DisableTorchFunctionSubclass, make_subclass
from xform.captured import CapturedGraph, GraphParameter
from xform.fx_rewrite import example_value, insert_call
from xform.transforms.linear_layers import (LayerFilter, LinearLayer, dtype_name, layer_selector,
                                            linear_layers, other_reader_refusal, own_forward_refusal,
                                            parameter_linear_calls, unchanged_layers)
from xform.registry import register_transform
from xform.report import TransformRecord, format_bytes
from xform.transform import Transform, option_error

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}

# Operations whose result must stay a LowPrecisionWeight, so that nn.Parameter(...) and .clone()
# give one back. The result is rewrapped with _make_subclass, which (unlike the default rewrapping,
# a view) gives a tensor that is not a view: Dynamo would otherwise guard its `_base` too.
_KEEPS_TYPE = {torch.Tensor.detach, torch.Tensor.clone}


class LowPrecisionWeight(torch.Tensor):
    """A Linear parameter stored, and computed with, in a lower precision than the activations."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return _linear_in_weight_dtype(*args, **kwargs)
        with DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _KEEPS_TYPE:
            return make_subclass(cls, out, out.requires_grad)
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> LowPrecisionWeight:
        if id(self) not in memo:
            with DisableTorchFunctionSubclass():
                data = self.detach().clone()
            copy = make_subclass(type(self), data, self.requires_grad)
            memo[id(self)] = nn.Parameter(copy, self.requires_grad) if isinstance(self, nn.Parameter) else copy
        return memo[id(self)]


def _linear_in_weight_dtype(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    with DisableTorchFunctionSubclass():
        if not input.is_floating_point():  # as written: it raises, as the model did in full precision
            return F.linear(input, weight, bias)
        dtype = weight.dtype
        x = input if input.dtype == dtype else input.to(dtype)
        b = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
        out = F.linear(x, weight, b)
        return out if out.dtype == input.dtype else out.to(input.dtype)


def low_precision_parameter(param: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    data = param.detach().to(dtype).as_subclass(LowPrecisionWeight)
    return nn.Parameter(data, requires_grad=param.requires_grad)


@register_transform
class Cast(Transform):
    """Linear weights and biases held and computed in bf16/fp16 (`cast:bf16`)."""

    name = "cast"
    nothing_found = "no nn.Linear layer in this graph"

    def __init__(self, dtype: torch.dtype | str = torch.bfloat16, *, filter: LayerFilter = None) -> None:
        accepted = f"torch.bfloat16, torch.float16 or one of {', '.join(map(repr, DTYPES))}"
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise option_error(self.name, "dtype", dtype, accepted)
            dtype = DTYPES[dtype]
        if dtype not in DTYPES.values():
            raise option_error(self.name, "dtype", dtype, accepted)
        self.dtype = dtype
        self.filter = filter
        self._selects = layer_selector(filter, self.name)

    @classmethod
    def from_spec(cls, argument: str | None) -> Cast:
        return cls(argument or "bf16")

    def transform_parameters(self, graph: CapturedGraph, record: TransformRecord) -> None:
        for layer in linear_layers(graph, self._selects):
            self._cast_layer(graph, layer, record)
        for path, reason in unchanged_layers(graph, self._selects):
            record.skipped(path, reason)

    def _cast_layer(self, graph: CapturedGraph, layer: LinearLayer, record: TransformRecord) -> None:
        reason = own_forward_refusal(layer) or next(filter(None, (self._refusal(p) for p in layer.params)), None)
        if reason is not None and any(isinstance(p.tensor, LowPrecisionWeight) and other_reader_refusal(p)
                                      for p in layer.params):
            raise ValueError(
                f"xform: transform 'cast': {layer.path} was cast to {dtype_name(self.dtype)} in an earlier graph of "
                f"this model, and this one ({graph.frame.code_name if graph.frame else 'a later graph'}) reads it "
                f"otherwise: {reason}. Its full-precision values are gone, so that op would compute with "
                f"{dtype_name(self.dtype)} values. Exclude the layer from cast (filter=), or remove the graph break "
                f"between its call and that op, so that one graph sees both")
        if reason is not None:
            record.skipped(layer.path, reason)
            return
        if all(isinstance(p.tensor, LowPrecisionWeight) and p.tensor.dtype == self.dtype for p in layer.params):
            record.note(f"{layer.path} was cast by an earlier compile of this model")
            return
        recast = next((p.tensor for p in layer.params if isinstance(p.tensor, LowPrecisionWeight)  # model.float()
                       and p.tensor.dtype != self.dtype and p.tensor.element_size() < 4), None)  # is lossless
        if recast is not None:
            raise ValueError(
                f"xform: transform 'cast': {layer.path} holds {dtype_name(recast.dtype)} values that xform cast "
                f"earlier, and this cast is to {dtype_name(self.dtype)}: another compile of this model casts it "
                f"otherwise, or the model was converted after the cast (model.half(), model.to(dtype)). Casting again "
                f"would round its values twice, and two compiled views casting one model differently would recompile "
                f"on every call. Compile the model with one cast, deepcopy it for another "
                f"(copy.deepcopy(model) before compiling), or convert it before compiling")
        saved = 0
        for param in layer.params:
            before = param.tensor
            graph.replace_parameter(param, low_precision_parameter(before, self.dtype), by=self.name)
            saved += before.nbytes - param.tensor.nbytes
        record.changed("layer", layer.path,
                       f"{dtype_name(before.dtype)} -> {dtype_name(self.dtype)}, {format_bytes(saved)} saved")

    def _refusal(self, param: GraphParameter) -> str | None:
        if type(param.tensor) not in (nn.Parameter, LowPrecisionWeight):
            return (f"its {param.name} is a {type(param.tensor).__name__} (another transform changed it); "
                    f"cast takes plain parameters")
        if not param.tensor.is_floating_point():
            return f"its {param.name} is {param.tensor.dtype}, not floating point"
        if param.tensor.dtype == self.dtype and not isinstance(param.tensor, LowPrecisionWeight):
            return f"its {param.name} is already {dtype_name(self.dtype)}"
        return other_reader_refusal(param)

    def transform_graph(self, graph: CapturedGraph, record: TransformRecord) -> None:
        rewritten = 0
        for node, x, weight, bias, param in parameter_linear_calls(graph):
            x_value = example_value(x)
            if (not isinstance(param.tensor, LowPrecisionWeight) or x_value.dtype == param.tensor.dtype
                    or not x_value.is_floating_point()):  # an integer input raises as written, as it did before
                continue
            g = graph.gm.graph
            dtype = param.tensor.dtype
            with g.inserting_before(node):
                cast_x = insert_call(g, "call_method", "to", (x, dtype))
                if bias is not None and example_value(bias).dtype != dtype:
                    bias = insert_call(g, "call_method", "to", (bias, dtype))
                linear = insert_call(g, "call_function", F.linear, (cast_x, weight, bias))
                back = insert_call(g, "call_method", "to", (linear, x_value.dtype))
            node.replace_all_uses_with(back)
            g.erase_node(node)
            rewritten += 1
        if rewritten:
            record.changed("nodes", f"{rewritten} linear calls",
                           "compute in the weights' dtype, outputs cast back to the input dtype")
