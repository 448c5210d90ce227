"""The Linear layers a captured graph reads: which a transform's `filter=` selects, their
parameters, their calls, the ones whose weight belongs to another module, and their sizes. Shared
by the transforms that change Linear layers (cast, quantize, distribute's tensor parallelism)."""

from __future__ import annotations

import inspect
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, Union

import torch
import torch.nn.functional as F
from torch import fx, nn

from xform._torch.dispatch import is_traceable_wrapper_subclass
from xform.captured import CapturedGraph, GraphParameter
from xform.fx_rewrite import op_name
from xform.transform import option_error

LayerFilter = Union[None, str, Sequence[str], Callable[[str, nn.Module], bool]]


def layer_selector(filter: LayerFilter, transform: str) -> Callable[[str, nn.Module], bool]:
    """`(module_path, module) -> bool` for a user's `filter`.

    None selects every layer; a string is a regex matched against the whole module path
    (`re.fullmatch`, so `"layers\\.0\\..*"`); a list or tuple names module paths exactly; a callable
    gets `(path, module)`.
    """
    if filter is None:
        return lambda path, module: True
    if isinstance(filter, str):
        try:
            pattern = re.compile(filter)
        except re.error as error:
            raise option_error(transform, "filter", filter, f"a valid regex (this one: {error}), a list of module "
                               f"paths or a callable (path, module) -> bool") from None
        return lambda path, module: pattern.fullmatch(path) is not None
    if isinstance(filter, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in filter):
        names = frozenset(filter)
        return lambda path, module: path in names
    if callable(filter):
        try:
            inspect.signature(filter).bind("layers.0", nn.Linear(1, 1))
        except TypeError as error:
            raise option_error(transform, "filter", filter, f"a callable taking (path, module) ({error})") from None
        except ValueError:  # a builtin without a signature: taken as it is
            pass
        return filter
    raise option_error(transform, "filter", filter, "None, a regex string, a list of module paths or a callable "
                                                    "(path, module) -> bool")



@dataclass
class LinearLayer:
    """One `nn.Linear` (or subclass) whose parameters the graph takes as inputs."""

    path: str
    module: nn.Linear
    params: list[GraphParameter]  # weight, and bias when it has one, as the graph reads them

    @property
    def weight(self) -> GraphParameter | None:
        return next((p for p in self.params if p.name == "weight"), None)


def linear_layers(graph: CapturedGraph, selects: Callable[[str, nn.Module], bool]) -> list[LinearLayer]:
    """The Linear layers of the graph that `selects(path, module)` accepts, in graph order."""
    layers: dict[str, LinearLayer] = {}
    for param in graph.parameters:
        if isinstance(param.owner, nn.Linear) and param.name in ("weight", "bias"):
            layer = layers.setdefault(param.module_path, LinearLayer(param.module_path, param.owner, []))
            layer.params.append(param)
    return [layer for layer in layers.values()
            if selects(layer.path, layer.module) and not any(_tied_with(graph, p) for p in layer.params)]


def _tied_with(graph: CapturedGraph, param: GraphParameter) -> list[str]:
    """The other names of `param` in the model (tied weights), or []."""
    return [name for name in graph.names_of(param.tensor) if name != param.fqn]


def borrowed_weights(graph: CapturedGraph, selects: Callable[[str, nn.Module | None], bool]) -> Iterator[tuple[str, str]]:
    """(layer path, reason) for each selected linear call that is left as written because of whose
    weight it reads: a weight the model also holds under another name (tied weights, as GPT-2's
    head and embedding), which changing would change there too; or the weight of a module that is
    not an nn.Linear and calls F.linear itself (a MoE router), which only nn.Linear swaps cover."""
    roots = graph.root_modules()
    seen: set[str] = set()
    for node in graph.gm.graph.nodes:
        param = graph.parameter_for(linear_operands(node)[1]) if is_linear(node) else None
        if param is None:
            continue
        path = graph.calling_module_path(node) or node.name
        layer = roots[0].get_submodule(path) if roots and path != node.name else None
        tied = _tied_with(graph, param)
        if path in seen or not selects(path, layer) or not (tied or not isinstance(param.owner, nn.Linear)):
            continue
        seen.add(path)
        if tied:
            other = next(name for name in [param.fqn, *tied] if name != f"{path}.weight")
            owner = other.rpartition(".")[0]
            module = next((m for root in roots for name, m in root.named_modules() if name == owner), None)
            yield path, (f"its weight is {other}, shared with {owner} ({type(module).__name__}, tied weights); "
                         f"changing it would change that module too. Untie the weights to change it")
        else:
            yield path, (f"it is a {type(param.owner).__name__}, not an nn.Linear: it calls F.linear with its own "
                         f"weight, and only nn.Linear layers are changed; left as written")


_MATMULS = (torch.addmm, torch.mm, torch.matmul, operator.matmul)


def unchanged_layers(graph: CapturedGraph, selects: Callable[[str, nn.Module | None], bool]) -> Iterator[tuple[str, str]]:
    """(layer path, reason) for each selected layer that looks like a Linear but is left as written:
    tied weights (`borrowed_weights`), and modules that multiply by their weight themselves."""
    yield from borrowed_weights(graph, selects)
    yield from matmul_layers(graph, selects)
    yield from stacked_weights(graph, selects)


def matmul_layers(graph: CapturedGraph, selects: Callable[[str, nn.Module | None], bool]) -> Iterator[tuple[str, str]]:
    """(layer path, reason) for each selected module, not an nn.Linear, whose 2-D weight a matmul
    (addmm, mm, @) reads instead of F.linear: GPT-2's Conv1D, a Linear with a transposed weight."""
    seen: set[str] = set()
    for param in graph.parameters:
        if (isinstance(param.owner, nn.Linear) or param.name != "weight" or param.tensor.dim() != 2
                or param.module_path in seen or not selects(param.module_path, param.owner)):
            continue
        reader = next((u for u in param.node.users if u.op == "call_function" and u.target in _MATMULS), None)
        if reader is not None:
            seen.add(param.module_path)
            yield param.module_path, (
                f"it is a {type(param.owner).__name__}, not an nn.Linear: it computes {_name(reader.target)} with its "
                f"weight, and only nn.Linear layers (F.linear calls) are changed; left as written. Replace it by an "
                f"nn.Linear (its weight transposed) to change it")


# on the way from a stacked weight to the product that reads it: one matrix's slice, its transpose
_VIEWS = {"transpose", "permute", "view", "reshape", "contiguous", "to", "t", "getitem", "__getitem__", "select",
          "expand", "unsqueeze"}
_TRANSPOSES = {"mT", "T", "mH", "H"}  # attributes: Dynamo records `w.mT` as getattr(w, 'mT')
# products by the operand that is the weight: `linear(x, w)`, `x @ w`, `bmm(x, w)`, `baddbmm(c, x, w)`
_WEIGHT_SLOT = {"linear": 1, "matmul": 1, "__matmul__": 1, "bmm": 1, "baddbmm": 2}


def stacked_weights(graph: CapturedGraph, selects: Callable[[str, nn.Module | None], bool]) -> Iterator[tuple[str, str]]:
    """(parameter path, reason) for each parameter of 3 or more dims that a matrix product takes as
    its weight: a stack of matrices, as a mixture of experts holds its experts (Mixtral's
    `gate_up_proj`, [experts, out, in]), multiplied one slice at a time or by a grouped GEMM. No
    nn.Linear holds them, so no Linear recipe changes them; said here so that the report accounts
    for every weight matrix."""
    for param in graph.parameters:
        shape = list(param.tensor.shape)
        if (len(shape) < 3 or shape[0] < 2 or not param.tensor.is_floating_point()
                or not selects(param.module_path, param.owner)):
            continue
        reader = _product_taking_as_weight(param.node)
        if reader is not None:
            yield param.fqn, (
                f"it is a stack of {shape[0]} weight matrices ({shape}, as a mixture of experts holds its experts) "
                f"that {op_name(reader)} (node '{reader.name}') multiplies by, not an nn.Linear: only nn.Linear layers "
                f"are changed; left as written. Hold each matrix as an nn.Linear to change it")


def _product_taking_as_weight(node: fx.Node, depth: int = 4) -> fx.Node | None:
    """The first matrix product taking `node` (through up to `depth` views, slices and casts) as its
    weight operand, or None."""
    for user in node.users:
        name = op_name(user).rpartition(".")[2]
        if _is_product(name) and _operand(user, _WEIGHT_SLOT.get(name, 1)) is node:
            return user
        is_view = name in _VIEWS or (name == "getattr" and len(user.args) > 1 and user.args[1] in _TRANSPOSES)
        if depth and is_view:
            found = _product_taking_as_weight(user, depth - 1)
            if found is not None:
                return found
    return None


def _is_product(name: str) -> bool:
    return name in _WEIGHT_SLOT or "grouped_mm" in name  # torch._grouped_mm, transformers' grouped_mm_fallback


def _operand(node: fx.Node, slot: int) -> Any:
    return node.args[slot] if len(node.args) > slot else None


def _name(target: Any) -> str:
    module = getattr(target, "__module__", None) or ""
    return f"torch.{target.__name__}" if module.startswith("torch") else f"operator.{target.__name__}"


def is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.linear


def computes_linear(node: fx.Node) -> bool:
    """A call computing `F.linear(x, weight, bias)` with those operands: F.linear itself, or a call
    target that says so (quantize's torchao module forwards)."""
    return is_linear(node) or (node.op == "call_function" and getattr(node.target, "computes_linear", False))


def linear_operands(node: fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias) of a `linear` call node, wherever the caller put them."""
    args = list(node.args) + [None] * (3 - len(node.args))
    return (args[0] if args[0] is not None else node.kwargs.get("input"),
            args[1] if args[1] is not None else node.kwargs.get("weight"),
            args[2] if args[2] is not None else node.kwargs.get("bias"))


def parameter_linear_calls(graph: CapturedGraph) -> Iterator[tuple[fx.Node, Any, fx.Node, Any, GraphParameter]]:
    """Each `F.linear` call of the graph whose weight is one of the graph's parameters, as
    (node, input, weight node, bias, the weight's parameter); the graph may be edited meanwhile."""
    for node in list(graph.gm.graph.nodes):
        if not is_linear(node):
            continue
        x, weight, bias = linear_operands(node)
        param = graph.parameter_for(weight) if isinstance(weight, fx.Node) else None
        if param is not None:
            yield node, x, weight, bias, param


def non_linear_reader(node: fx.Node, slot: int) -> fx.Node | None:
    """The first node reading `node` other than as operand `slot` (1 weight, 2 bias) of a linear
    call, looking through dtype casts; None if there is none."""
    for user in node.users:
        if user.op == "call_method" and user.target == "to":
            found = non_linear_reader(user, slot)
            if found is not None:
                return found
        elif not (is_linear(user) and linear_operands(user)[slot] is node):
            return user
    return None


def own_forward_refusal(layer: LinearLayer) -> str | None:
    """Why a Linear subclass with a forward of its own is left as written (Falcon's FalconLinear
    computes `x @ weight.T + bias` itself), or None: only F.linear calls are changed."""
    if type(layer.module).forward is nn.Linear.forward:
        return None
    return (f"it is a {type(layer.module).__name__}, a subclass of nn.Linear with a forward of its own, and only "
            f"nn.Linear's own forward (F.linear) is changed; left as written. Where its forward computes "
            f"x @ weight.T + bias, replace it by an nn.Linear holding the same weight and bias (or call "
            f"F.linear in its forward) to change it")


def other_reader_refusal(param: GraphParameter) -> str | None:
    """Why `param` must not change: some op other than its layer's linear call reads it."""
    other = non_linear_reader(param.node, slot=1 if param.name == "weight" else 2)
    if other is None:
        return None
    op = op_name(other)
    if op in _FAST_PATHS:
        return (f"its {param.name} is read by torch's fused fast path ({op}), which "
                f"{_FAST_PATHS[op]} take in eval mode without gradients, not through F.linear, so no transform can "
                f"change it there. Run it in train mode or under torch.enable_grad(), or turn the fast path off "
                f"with torch.backends.mha.set_fastpath_enabled(False)")
    return (f"its {param.name} is also read by node '{other.name}' ({op}); changing it would change what that op "
            f"computes. Exclude the layer with filter= or untie it")


# torch's fused kernels that nn.Transformer*Layer and nn.MultiheadAttention run in eval mode (no
# gradients), reading the layers' weights themselves: nothing is tied, nothing for the user to untie
_FAST_PATHS = {"_transformer_encoder_layer_fwd": "nn.TransformerEncoderLayer's layers",
               "_native_multi_head_attention": "nn.MultiheadAttention's projections"}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor really stores: for a wrapper subclass (a quantized weight), its inner tensors."""
    if is_traceable_wrapper_subclass(tensor):
        inner = (getattr(tensor, name) for name in tensor.__tensor_flatten__()[0])
        return sum(tensor_bytes(t) for t in inner if isinstance(t, torch.Tensor))
    return tensor.untyped_storage().nbytes() if tensor.numel() else 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
