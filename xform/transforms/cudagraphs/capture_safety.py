"""Which nodes of a Dynamo graph a CUDA graph can record, and, for each one it cannot, why and the fix.

A CUDA graph records GPU work once and replays it with the same memory addresses and sizes. A node
breaks that when it needs the host (a GPU value read into Python, a CPU tensor), when its sizes are
not fixed (dynamic or data-dependent shapes), when replaying it would not do what running it does (a
user-supplied RNG generator), or when its author marked it unsafe (`torch.Tag.cudagraph_unsafe`).
Each check is a small function of one node; the first that objects gives the node's `CaptureBreak`,
in words a user can act on: the node, the line of the user's code it came from, the reason and the
fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

from xform._torch.dispatch import OpOverload, OpOverloadPacket, is_op_overload, overload_name
from xform._torch.pytree import tree_leaves
from xform.fx_rewrite import example_value, op_name, user_source

OPS = ("call_function", "call_method", "call_module")
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)  # numbers a graph computes with on the host


@dataclass(frozen=True)
class CaptureBreak:
    """A node a CUDA graph cannot record: which one, where in the user's code, why, and the fix."""

    node: str
    op: str
    reason: str
    fix: str
    source: str | None = None  # "model.py:42 in forward: y = x.max().item()"

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        return f"{self.op} (node {self.node}){where}: {self.reason}. Fix: {self.fix}"


# --- the checks: each returns (reason, fix) or None ---------------------------------------------

_HOST_READS = {
    "item": ".item() copies a GPU value into Python, which waits for the GPU",
    "tolist": ".tolist() copies GPU values into Python, which waits for the GPU",
    "numpy": ".numpy() copies GPU values to the host, which waits for the GPU",
    "_local_scalar_dense": "reads a GPU value on the host (.item()), which waits for the GPU",
    "nonzero": "nonzero's output size is known only after the GPU has run, so the host waits for it",
    "argwhere": "argwhere's output size is known only after the GPU has run, so the host waits for it",
    "masked_select": "masked_select's output size is known only after the GPU has run",
    "unique": "unique's output size is known only after the GPU has run",
    "unique_consecutive": "unique_consecutive's output size is known only after the GPU has run",
    "synchronize": "synchronizing with the GPU waits on the host; a CUDA graph records GPU work only",
}
_HOST_READ_FIX = ("keep the value on the GPU (use it as a tensor, e.g. torch.where(cond, a, b) instead of "
                  "`if cond:`), give the op a static size (nonzero(..., size=N) style padding), or move it "
                  "out of the compiled step")


def _target_name(node: fx.Node) -> str:
    target = node.target
    if is_op_overload(target):
        return overload_name(target)
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _host_read(node: fx.Node, _: Any) -> tuple[str, str] | None:
    reason = _HOST_READS.get(_target_name(node))
    return (reason, _HOST_READ_FIX) if reason else None


def _marked_unsafe(node: fx.Node, _: Any) -> tuple[str, str] | None:
    target = node.target
    if isinstance(target, OpOverloadPacket):
        target = getattr(target, "default", None)
    if isinstance(target, OpOverload) and torch.Tag.cudagraph_unsafe in target.tags:
        return (f"its author tagged {target} torch.Tag.cudagraph_unsafe",
                "keep the op out of the compiled step, or, if it is yours and it only launches GPU work, "
                "drop the tag")
    return None


def _user_generator(node: fx.Node, _: Any) -> tuple[str, str] | None:
    if node.kwargs.get("generator") is not None:
        return ("it draws random numbers from a torch.Generator you passed, whose state a replay would not "
                "advance (each replay would repeat the same numbers)",
                "use the default generator (seed it with torch.manual_seed), which CUDA graphs advance per replay")
    return None


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return [v for v in tree_leaves(list(values)) if isinstance(v, torch.Tensor)]


def _off_device(node: fx.Node, device_type: str) -> tuple[str, str] | None:
    inputs = _tensors(example_value(a) for a in node.all_input_nodes)
    outputs = _tensors([example_value(node)])
    leaving = [t.device.type for t in outputs if t.device.type != device_type]
    if leaving and any(t.device.type == device_type for t in inputs):
        return (f"it copies a {device_type} tensor to the {leaving[0].upper()}, which waits for the GPU; a CUDA graph "
                f"records {device_type} work only",
                "keep the tensor on the GPU, or move the copy (and what uses it) out of the compiled step")
    for label, tensors in (("its result", outputs), ("an input", inputs)):
        for t in tensors:
            if t.device.type != device_type:
                return (f"it runs on the {t.device.type.upper()}: {label} is a {t.device.type} tensor, and a CUDA "
                        f"graph records {device_type} work only",
                        f"create the tensor on the GPU (device='{device_type}'), or register it as a buffer of "
                        f"the module so that model.to('{device_type}') moves it")
    return None


def _host_scalar_input(node: fx.Node, _: Any) -> tuple[str, str] | None:
    for source in node.all_input_nodes:
        value = example_value(source)
        if isinstance(value, _SYM) and free_unbacked_symbols(value):
            return (f"it uses '{source.name}', a number read from the GPU on the host (.item()); a recorded graph "
                    f"would keep the value it had when recorded",
                    "keep the value a tensor on the GPU (drop the .item() and use the 0-d tensor), or move the "
                    "computation out of the compiled step")
    return None


def _symbolic(node: fx.Node, _: Any) -> tuple[str, str] | None:
    value = example_value(node)
    sizes = [s for t in _tensors([value]) for s in (*t.shape, *t.stride())]
    scalars = [v for v in tree_leaves([value]) if isinstance(v, _SYM)]
    unbacked = set().union(*(free_unbacked_symbols(s) for s in sizes + scalars)) if sizes or scalars else set()
    if unbacked:
        return ("its result's size depends on tensor data, known only after the GPU has run",
                "give it a static size (a mask multiply instead of boolean indexing, or pad to a fixed length)")
    symbols = set().union(*(free_symbols(s) for s in sizes)) if sizes else set()
    if symbols:
        return (f"its shapes are dynamic ({', '.join(sorted(map(str, symbols)))}), and a CUDA graph fixes every size",
                "compile with dynamic=False (xform then records one graph per static shape), or pad inputs to a few "
                "fixed sizes")
    return None


_VIEWS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "narrow", "select",
          "flatten", "unflatten", "t", "as_strided", "view_as", "expand_as", "contiguous", "getitem", "__getitem__",
          "split", "chunk", "unbind", "movedim", "diagonal", "detach"}


def alias_base(node: fx.Node) -> fx.Node:
    """The node whose memory `node` views (itself when it is no view)."""
    while node.op in OPS and _target_name(node) in _VIEWS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def find_breaks(gm: fx.GraphModule, device_type: str = "cuda") -> dict[fx.Node, CaptureBreak]:
    """Every op node of `gm` a CUDA graph cannot record, with its break; `device_type` is the
    device whose work is recorded. (A write into a graph input is no break: the replays write the
    caller's tensor, `replay.GraphedFunction`.)"""
    checks = (_host_read, _marked_unsafe, _user_generator, _off_device, _host_scalar_input, _symbolic)
    breaks: dict[fx.Node, CaptureBreak] = {}
    for node in gm.graph.nodes:
        if node.op not in OPS:
            continue
        for check in checks:
            found = check(node, device_type)
            if found is not None:
                breaks[node] = CaptureBreak(node.name, op_name(node, as_written=True), found[0], found[1], user_source(node))
                break
    return breaks


def host_numbers(gm: fx.GraphModule) -> set[fx.Node]:
    """The graph's number inputs (SymInts: Python ints Dynamo made dynamic) and the arithmetic on
    them alone: host work, not GPU work, run between the replays. Hugging Face's sliding-window
    cache passes its length so, and the graph returns it plus one."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", *OPS) and isinstance(example_value(node), _SYM) \
                and all(source in found for source in node.all_input_nodes):
            found.add(node)
    return found


def graph_level_reason(gm: fx.GraphModule, device_type: str = "cuda") -> str | None:
    """Why no part of the graph can be recorded, when that holds for all of it at once."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [example_value(n) for n in placeholders]
    tensors = _tensors(inputs) + _tensors(example_value(n) for n in gm.graph.nodes if n.op in OPS)
    if not any(t.device.type == device_type for t in tensors):
        return f"no tensor in this graph is on {device_type}: CUDA graphs record {device_type} work only"
    dynamic = sorted({str(s) for t in _tensors(inputs) for size in t.shape for s in free_symbols(size)})
    numbers = host_numbers(gm)  # a number only the host's arithmetic reads changes no recorded work
    dynamic += [n.name for n in placeholders if n in numbers
                and any(u.op != "output" and u not in numbers for u in _readers(n, numbers))]
    if dynamic:
        return (f"the graph was compiled for dynamic shapes ({', '.join(dynamic)}), and a CUDA graph fixes every "
                f"size. Fix: compile with dynamic=False (xform then records one graph per static shape), or "
                f"torch._dynamo.mark_static the inputs")
    return None


def _readers(node: fx.Node, numbers: set[fx.Node]) -> list[fx.Node]:
    """The nodes reading `node`, through the host arithmetic on it."""
    found, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        found.append(user)
        if user in numbers:
            todo += user.users
    return found
