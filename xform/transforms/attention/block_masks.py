"""Block masks: which blocks of 128 x 128 positions a site's masks leave full, partial or empty,
built once at compile time for a mask of positions, or from the data a mask reads (per-block bounds
of it, or every position where the bounds cannot go), before the call and reused while that data is
unchanged, or in the graph on every call; one per set of masks a graph's sites share.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from xform._torch import flex_attention
from xform._torch.dispatch import DisableTorchFunctionSubclass, FakeTensor
from xform._torch.functorch import functorch_on
from xform.captured import CapturedGraph
from xform.fx_rewrite import example_value, insert_call
from xform.transforms.attention.block_bounds import NotBounded, block_bounds
from xform.transforms.attention.index_mods import causal_program
from xform.transforms.attention.match import AttentionSite, Term
from xform.transforms.attention.mods import all_allowed, block_template, with_buffers
from xform.transforms.attention.reused_inputs import ReusedComputation

BLOCK = 128  # flex's default block size, that of create_block_mask


class BlockMaskBuild:
    """Graph call target: the BlockMask of a site's masks, from the tensors they read, as the tuple of
    its tensors (so that several attentions of a graph can share one build).

    Two ways: by per-block bounds (`block_bounds`: the min and max of each tensor
    over each block of 128 positions, the aranges' ends), which costs about the tensors' size; or,
    for masks those bounds cannot take (`fallback` says why), `create_block_mask`, which evaluates
    the masks at all B*H*Q*KV positions. Either way flex still applies the mask_mod inside every
    block not marked full, so a block marked partial that is in fact full or empty is only slower.
    """

    def __init__(self, masks: list[Term], sizes: tuple[int | None, ...], device: torch.device) -> None:
        self.masks, self.sizes, self.device = masks, sizes, device
        self.fallback: str | None = None
        self.__name__ = "flex_block_mask"

    def block_mask(self, *buffers: torch.Tensor) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        mask_mod = lambda b, h, qi, ki: all_allowed(self.masks, b, h, qi, ki, *buffers)  # noqa: E731
        if self.fallback is None:
            return _bounded_block_mask(self.masks, buffers, self.sizes, self.device, mask_mod)
        return create_block_mask(mask_mod, *self.sizes, device=self.device)

    def __call__(self, *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with functorch_on():  # run eagerly (eager handoff, a build before the call), it vmaps
            return tuple(x for x in self.block_mask(*buffers).as_tuple() if isinstance(x, torch.Tensor))

    def how(self, before_the_call: bool) -> str:
        if not before_the_call:
            when = "built per call"
        elif self.device.type == "cpu":
            when = "built before each call, and reused while that data is unchanged,"
        else:  # comparing the data with the last call's would wait for the GPU (`reused_inputs`)
            when = "built before each call"
        if self.fallback is None:
            return f"{when} from per-block bounds of the data it reads"
        return f"{when} from the data it reads, at every position ({self.fallback})"


def _bounded_block_mask(masks: list[Term], buffers: tuple, sizes: tuple[int | None, ...], device: torch.device,
                        mask_mod: Any) -> Any:
    """The BlockMask create_block_mask would build, but from per-block bounds: a block is full only
    where every mask holds on all of it, and left out only where one holds nowhere on it."""
    batch, heads, q_len, kv_len = (s or 1 for s in sizes)
    full = some = torch.ones((), dtype=torch.bool, device=device)
    for term, own in with_buffers(masks, buffers):
        holds, may_hold = block_bounds(term.program or causal_program(), own, (batch, heads, q_len, kv_len), BLOCK,
                                       device)
        if term.negate:
            holds, may_hold = ~may_hold, ~holds
        full, some = full & holds, some & may_hold
    q_blocks, kv_blocks = -(-q_len // BLOCK), -(-kv_len // BLOCK)
    whole_q = torch.arange(q_blocks, device=full.device) < q_len // BLOCK  # a block running past the end is never
    whole_kv = torch.arange(kv_blocks, device=full.device) < kv_len // BLOCK  # full, as in create_block_mask
    full = (full & whole_q[:, None] & whole_kv[None, :]).expand(batch, heads, q_blocks, kv_blocks)
    partial = some.expand(batch, heads, q_blocks, kv_blocks) & ~full
    return flex_attention.block_mask_from_blocks(partial.to(torch.int8), full.to(torch.int8), mask_mod,
                                                 (q_len, kv_len), BLOCK)


@dataclass
class BuiltBlockMask:
    """A block mask in the graph: the nodes of its tensors, its BlockMask tuple as FlexCall takes it,
    and what it was built for (so that another site with the same masks reuses it)."""

    masks: list[Term]
    sizes: tuple[int | None, ...]
    device: torch.device
    tensors: list[fx.Node]
    template: tuple
    how: str
    first: str  # the site it was built for

    def serves(self, masks: list[Term], sizes: tuple[int | None, ...], device: torch.device) -> bool:
        """Same sizes and device, and masks that are the same programs of the same graph nodes."""
        try:
            return self.sizes == sizes and self.device == device and bool(self.masks == masks)
        except (RuntimeError, TypeError):  # a program holding something that does not compare
            return False


def block_mask_nodes(graph: CapturedGraph, site: AttentionSite, sizes: tuple[int | None, ...],
                      device: torch.device) -> BuiltBlockMask:
    """A mask that depends on positions only: its BlockMask built now, its tensors constant inputs.
    One that reads data: a BlockMaskBuild node computing it from that data on every call."""
    from torch.nn.attention.flex_attention import create_block_mask

    if all(t.is_static for t in site.masks):
        block_mask = create_block_mask(lambda b, h, qi, ki: all_allowed(site.masks, b, h, qi, ki), *sizes,
                                       device=device)
        tensors = [x for x in block_mask.as_tuple() if isinstance(x, torch.Tensor)]
        nodes = [graph.add_constant_input(f"block_mask_{site.output.name}_{i}", t) for i, t in enumerate(tensors)]
        return BuiltBlockMask(site.masks, sizes, device, nodes, block_template(block_mask), "built once", site.where)
    build = BlockMaskBuild(site.masks, sizes, device)
    buffers = tuple(n for t in site.masks for n in t.buffer_nodes)
    values = [example_value(n) for n in buffers]
    fake_mode = next((v.fake_mode for v in values if isinstance(v, FakeTensor)), contextlib.nullcontext())
    with fake_mode, DisableTorchFunctionSubclass():
        try:
            example = build.block_mask(*values)
        except NotBounded as why:
            build.fallback = f"per-block bounds cannot take {why}"
            example = build.block_mask(*values)
    name = f"block_mask_{site.output.name}"
    if built_before_the_call(site, graph):
        indices = [graph.dynamo_input_index(n) for n in buffers]
        reads = [graph.example_inputs[i] for i in indices]
        reused = ReusedComputation(build, indices, compile_with_inductor=graph.handoff == "inductor")
        with torch.no_grad(), DisableTorchFunctionSubclass():
            results = build(*reads)
        reused.prime(reads, results)
        nodes = graph.add_derived_inputs(name, reused, results)
        return BuiltBlockMask(site.masks, sizes, device, nodes, block_template(example), build.how(True), site.where)
    g = graph.gm.graph
    node = insert_call(g, "call_function", build, buffers)
    nodes = [insert_call(g, "call_function", operator.getitem, (node, i)) for i in range(len(node.meta["example_value"]))]
    return BuiltBlockMask(site.masks, sizes, device, nodes, block_template(example), build.how(False), site.where)


def built_before_the_call(site: AttentionSite, graph: CapturedGraph) -> bool:
    """Whether a data mask's block mask is built before the call (and reused while its data is
    unchanged) rather than in the graph: for per-token ids (a document mask: the same ids are often
    passed again, as for evaluation on fixed packing) that the caller passes. Other data masks (a
    decode step's `positions <= pos`) change with every call, and a build inside the graph is
    recorded with it by `cudagraphs`, where one before the call would be launched every step."""
    buffers = [n for t in site.masks for n in t.buffer_nodes]
    return (bool(buffers) and any(t.program is not None and t.program.reads_ids() for t in site.masks)
            and all(n.op == "placeholder" and graph.dynamo_input_index(n) is not None for n in buffers))
