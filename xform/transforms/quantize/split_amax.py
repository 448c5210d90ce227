"""An Inductor post-grad pass: the row and column amaxes of a computed 2-D tensor, in two stages.

Float8 training with row-wise scales (torchao's `Float8LinearConfig` "rowwise") casts each gradient
the backward computes (a SwiGLU's, say) twice: scaled per row for the input gradient's GEMM, and
scaled per column and transposed for the weight gradient's, so it reduces the tensor along both
dimensions: `amax(abs(g), [1])` and `amax(abs(g), [0])`. Inductor fuses the computation of `g`
and both casts into the row reduction's kernel, a kernel over rows, where the transposed cast
stores one byte per row at a stride of the whole column: on the H100 two such kernels took 1.9 ms
of the FFN's 11.2 ms step, about 1.65 times what the bytes they move need.

This pass reduces each of those amaxes in two stages (the amax of each 128-element chunk, then
the amax of those): the same values, bit for bit, since max is associative. Neither stage has the
shape of the casts, so Inductor no longer fuses the casts into a reduction, and emits them as
one pointwise kernel tiled in two dimensions (as it does for tensor-wise scales), where the
transposed store is coalesced. Tensors the graph is given (weights, saved activations, the output
gradient) are left: their reductions were not fused with a transposed cast.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import fx

from xform._torch.inductor import CustomGraphPass, files_hash

aten = torch.ops.aten
CHUNK = 128  # elements a first-stage amax reduces
MIN_REDUCED = 1024  # shorter reductions are cheap as they are
_VIEWS = (aten.view.default, aten.reshape.default, aten.permute.default, aten.t.default, aten.expand.default)


def split_amax_pairs(graph: fx.Graph) -> int:
    """Rewrite, in place, every `amax(abs(x), [d], keepdim=True)` of a 2-D contiguous static-shaped `x` that
    the graph computes and also reduces along its other dimension, over at least MIN_REDUCED elements
    in multiples of CHUNK, into two amaxes. Returns how many were rewritten."""
    by_tensor: dict[fx.Node, list[tuple[fx.Node, int]]] = {}
    for node in graph.nodes:
        reduced = _amax_of_abs(node)
        if reduced is not None:
            by_tensor.setdefault(reduced[0], []).append((node, reduced[1]))
    count = 0
    for x, amaxes in by_tensor.items():
        value = x.meta["val"]
        if {dim for _, dim in amaxes} != {0, 1} or _source(x).op == "placeholder" or not value.is_contiguous() \
                or not all(isinstance(size, int) for size in value.shape):  # dynamic sizes: left as they are
            continue
        for node, dim in amaxes:
            if value.shape[dim] >= MIN_REDUCED and value.shape[dim] % CHUNK == 0:
                _two_stages(graph, node, dim, tuple(value.shape))
                count += 1
    return count


def _amax_of_abs(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, dim) for `amax(abs(x), [dim], keepdim=True)` of a 2-D x, else None."""
    if node.target is not aten.amax.default or len(node.args) < 2:
        return None
    absolute, dims = node.args[0], node.args[1]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if not (isinstance(absolute, fx.Node) and absolute.target is aten.abs.default and keepdim and len(dims) == 1):
        return None
    x = absolute.args[0]
    value = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    return x, dims[0] % 2


def _source(node: fx.Node) -> fx.Node:
    """The node a chain of views starts from."""
    while node.op == "call_function" and node.target in _VIEWS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _two_stages(graph: fx.Graph, node: fx.Node, dim: int, shape: tuple[int, int]) -> None:
    rows, cols = shape
    chunked = [rows, cols // CHUNK, CHUNK] if dim == 1 else [rows // CHUNK, CHUNK, cols]
    inner = 2 if dim == 1 else 1
    absolute = node.args[0]
    with graph.inserting_before(node):
        view = graph.call_function(aten.view.default, (absolute, chunked))
        first = graph.call_function(aten.amax.default, (view, [inner]))
        second = graph.call_function(aten.amax.default, (first, [dim], True))
    value = absolute.meta["val"]
    with getattr(value, "fake_mode", None) or contextlib.nullcontext():
        view.meta["val"] = value.view(chunked)
        first.meta["val"] = view.meta["val"].amax(inner)
        second.meta["val"] = first.meta["val"].amax(dim, keepdim=True)
    node.replace_all_uses_with(second)
    graph.erase_node(node)


class SplitAmaxPairs(CustomGraphPass):
    """`split_amax_pairs` as Inductor's `post_grad_custom_post_pass` (cached by this file's hash)."""

    def __call__(self, graph: fx.Graph) -> None:
        split_amax_pairs(graph)

    def uuid(self) -> Any:
        return files_hash(__file__)
