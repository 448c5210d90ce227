"""Small edits on a Dynamo FX graph that keep its nodes' example values (`meta["example_value"]`)
filled in, so later transforms can read the dtype and shape of every node they insert; and how a
report names a node: its op, and the user's line that made it."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch import fx

from xform._torch.dispatch import DisableTorchFunctionSubclass, FakeTensor, OpOverload, OpOverloadPacket, is_mutable
from xform._torch.dynamo import resumed_function_name
from xform._torch.pytree import tree_flatten, tree_map


def example_value(node: Any) -> Any:
    """The fake tensor (or constant) a node stands for; constants stand for themselves. Dynamo's
    graphs keep it in meta["example_value"], AOTAutograd's in meta["val"]."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def fake_like(traced: FakeTensor, real: torch.Tensor) -> FakeTensor:
    """A fake of `real` in the fake mode the graph was traced in (that of `traced`)."""
    return traced.fake_mode.from_tensor(real, static_shapes=True)


def insert_call(graph: fx.Graph, op: str, target: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any] | None = None) -> fx.Node:
    """Create a `call_function`/`call_method` node at the graph's insert point, with its example value
    computed in the fake mode of its arguments."""
    kwargs = kwargs or {}
    node = graph.create_node(op, target, args, kwargs)
    values, kw_values = tree_map(example_value, (args, kwargs))
    fakes = [v for v in tree_flatten((values, kw_values))[0] if isinstance(v, FakeTensor)]
    if not fakes:
        raise ValueError(f"xform: cannot insert {target} with no traced tensor among its arguments")
    with fakes[0].fake_mode, DisableTorchFunctionSubclass():
        fn = getattr(values[0], target) if op == "call_method" else target
        node.meta["example_value"] = fn(*(values[1:] if op == "call_method" else values), **kw_values)
    return node


_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.imatmul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                       operator.ilshift, operator.irshift, operator.setitem}
_SIDE_EFFECTS = {print, setattr, "__setitem__", "record_stream", "backward", "retain_grad", "register_hook"}


def op_name(node: fx.Node, *, as_written: bool = False) -> str:
    """The op a node runs, as a report names it: 'transpose', 'bmm', 'linear', or a custom op with its
    namespace ('transformers.grouped_mm_fallback'), which says whose op it is. `as_written`: as the
    user wrote it, which says where to look: `Tensor.item`, `torch.nonzero`, `aten.nonzero.default`,
    `module fc`."""
    target = node.target
    if as_written and node.op in ("call_method", "call_module"):
        return f"Tensor.{target}" if node.op == "call_method" else f"module {target}"
    if isinstance(target, str):
        return target
    if isinstance(target, OpOverloadPacket) or (as_written and isinstance(target, OpOverload)):
        return str(target)
    name = getattr(target, "__name__", str(target))
    module = getattr(target, "__module__", None) or ""
    if as_written and module.startswith("torch") and not module.startswith("torch._"):
        return f"{module}.{name}"
    return name


def user_source(node: fx.Node) -> str | None:
    """The innermost frame of the node's stack trace: `file.py:LINE in FUNCTION: CODE`."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return None
    path, line, function, code = frames[-1]
    function = resumed_function_name(function)  # the code after a graph break
    return f"{path.rsplit('/', 1)[-1]}:{line} in {function}: {code.strip()}"


def is_in_place(node: fx.Node) -> bool:
    """Whether the op writes into its first argument (add_, copy_, index_copy_, x[i] = v, a &= b)."""
    target = node.target
    if isinstance(target, OpOverload):
        return is_mutable(target)
    if getattr(target, "__module__", None) == "_operator":  # operator.and_ is `a & b`; `a &= b` is iand
        return target in _IN_PLACE_OPERATORS
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _pure(node: fx.Node) -> bool:
    """Whether removing an unused `node` cannot change what the graph does: a call with no side
    effect. Dynamo graphs hold torch-level calls, which FX's own dead-code pass cannot judge (it
    would drop an unused `x.mul_(2)`), so in-place calls and known side effects count as impure."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if is_in_place(node) or node.target in _SIDE_EFFECTS or name in _SIDE_EFFECTS:
        return False
    return not (node.op == "call_function" and (name.startswith("_set_") or "grad_enabled" in name))


_PRODUCTS = {operator.matmul, torch.matmul, torch.bmm, torch.mm, torch.baddbmm}  # a new tensor, no view
_IN_PLACE_SCALES = {operator.itruediv, operator.imul, "div_", "mul_"}


def _scales_a_dead_product(node: fx.Node, dead: set[fx.Node]) -> bool:
    """Whether `node` scales in place (`scores /= d`) the result of a matmul that nothing else reads:
    then it changes nothing anyone sees, and goes with that result."""
    written = node.args[0] if node.op in ("call_function", "call_method") and node.args else None
    return (node.target in _IN_PLACE_SCALES and isinstance(written, fx.Node) and written.op == "call_function"
            and written.target in _PRODUCTS and all(u is node or u in dead for u in written.users))


def unused_after(starts: list[Any], gone: set[fx.Node] | frozenset = frozenset()) -> set[fx.Node]:
    """The nodes, walking up from `starts`, that nothing would use once `gone` were erased: each a
    pure call (see `_pure`) whose users are all in `gone` or found unused themselves."""
    dead: set[fx.Node] = set()
    stack = [n for n in starts if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node in dead or any(u not in dead and u not in gone for u in node.users):
            continue
        if not (_pure(node) or _scales_a_dead_product(node, dead | set(gone))):
            continue
        dead.add(node)
        stack.extend(node.all_input_nodes)  # a node passed over while a user was alive comes back here
    return dead


def remove_unused(graph: fx.Graph, starts: list[Any]) -> int:
    """Erase the nodes left unused by a rewrite, walking up from `starts` (the inputs of what was
    replaced) and stopping at anything impure or still used. Returns how many were erased."""
    dead = unused_after([n for n in starts if isinstance(n, fx.Node) and n.graph is graph])
    for node in reversed(list(graph.nodes)):  # users before the nodes they use
        if node in dead:
            graph.erase_node(node)
    return len(dead)
