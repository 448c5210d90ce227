"""`FlexAttention`: attention in the forms people write becomes `flex_attention`.

`FlexAttention(backend="auto"|"flash"|"triton")`, spec `flex-attention[:backend]`.

What it changes, per graph (the model and its guards are untouched):
- each `F.scaled_dot_product_attention` call (is_causal, boolean or additive `attn_mask`, `scale`,
  `enable_gqa`), and each hand-written attention (`q @ k.transpose(-2, -1)`, scaled, with an
  additive bias and/or a `masked_fill`/`where` mask, `softmax(-1)`, `@ v`) becomes one call of
  flex_attention's operator;
- the mask and bias become a `mask_mod` and a `score_mod`: the subgraph that built them is
  re-evaluated per position (`index_mods`), so causal, sliding-window, prefix-LM, document
  (per-token ids) and ALiBi masks become their closed forms, and any other dense mask is read
  per position;
- a mask that depends on positions only gets its BlockMask built once, at compile time, for the
  graph's shapes (its tensors become constant inputs of the compiled graph); one that reads data
  (document ids) gets it built from that data (`BlockMaskBuild`: from per-block bounds of the
  data, or at every position where the bounds cannot go): for a document mask of ids the caller
  passes, before the call and reused while the ids are unchanged (`reused_inputs`), else
  inside the graph on every call; attentions with the same masks of the same tensors share one
  block mask.

Backend: "flash" (FlashAttention-4 through CuTeDSL) where it is importable, the GPU is SM90+,
q/k/v are fp16/bf16 with a head dim of 8..256, and no tensor the mods read needs a gradient;
else "triton" on CUDA; on CPU, flex's CPU kernels (inference only, so attention that needs a
gradient on CPU is left as written under Inductor; `handoff="eager"` runs flex's reference math,
which has one). `backend="flash"` where Flash cannot run is an error saying what is missing.

What it leaves as written, with the reason in the report: dropout > 0, q/k/v that are not
[B, H, S, D], a hand-written attention with something between QK^T and the softmax that is not a
scale, a bias or a mask.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from xform.captured import CapturedGraph
from xform.fx_rewrite import example_value, insert_call, remove_unused, unused_after
from xform.registry import register_transform
from xform.report import TransformRecord
from xform.transform import Transform, option_error
from xform.transforms.attention.block_masks import BuiltBlockMask, block_mask_nodes
from xform.transforms.attention.match import AttentionSite, match_handwritten, match_sdpa
from xform.transforms.attention.mods import FlexCall, describe_mask
from xform.transforms.attention.refusals import (flash_missing, inductor_cpu_refusal, inductor_cuda_refusal,
                                                 site_refusal)

BACKENDS = ("auto", "flash", "triton")


@register_transform
class FlexAttention(Transform):
    """SDPA and hand-written attention rewritten to flex_attention (`flex-attention[:backend]`)."""

    name = "flex-attention"
    nothing_found = ("no attention in this graph: an F.scaled_dot_product_attention call, or softmax(q @ k^T) @ v "
                     "written out")

    def __init__(self, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise option_error(self.name, "backend", backend, ", ".join(BACKENDS))
        self.backend = backend

    @classmethod
    def from_spec(cls, argument: str | None) -> FlexAttention:
        return cls(argument or "auto")

    def transform_graph(self, graph: CapturedGraph, record: TransformRecord) -> None:
        sites = []
        for node in list(graph.gm.graph.nodes):
            site = match_sdpa(node) or match_handwritten(node)
            if site is not None:
                sites.append(site)
        built: list[BuiltBlockMask] = []  # this graph's block masks, shared by the sites whose masks match
        refusals = [site_refusal(s) for s in sites]  # once each: a finite-fill mask is checked row by row
        taken = [s for s, refusal in zip(sites, refusals) if refusal is None]
        replaced = {s.output for s in taken}
        replaced |= unused_after([n for s in taken for n in s.output.all_input_nodes], gone=replaced)
        for site, refusal in zip(sites, refusals):
            reason = refusal or self._device_refusal(site, graph, replaced)
            if reason is not None:
                record.skipped(site.where, reason)
                continue
            backend, why = self._backend_for(site)
            old = site.output
            new = self._rewrite(graph, site, backend, why, record, built)
            for later in sites:  # an attention's output feeding the next one (q = attention(q, ...))
                later.q, later.k, later.v = (new if n is old else n for n in (later.q, later.k, later.v))

    def _device_refusal(self, site: AttentionSite, graph: CapturedGraph, replaced: set[fx.Node]) -> str | None:
        """`replaced`: the attentions to be rewritten and the nodes only they use."""
        if graph.handoff != "inductor":  # the refusals are of Inductor's lowerings; flex's reference math takes all
            return None
        device = example_value(site.q).device.type
        if device == "cpu":
            return inductor_cpu_refusal(site)
        return inductor_cuda_refusal(site, graph, replaced) if device == "cuda" else None

    def _backend_for(self, site: AttentionSite) -> tuple[str, str | None]:
        """The backend for the site, and why auto did not take Flash (None where it did, or was not asked)."""
        q = example_value(site.q)
        if q.device.type != "cuda":
            if self.backend == "flash":
                raise ValueError(f"xform: transform 'flex-attention': backend='flash' needs a CUDA GPU; "
                                 f"{site.where} runs on {q.device.type}")
            return "cpu", None
        if self.backend == "triton":
            return "triton", None
        missing = flash_missing(site)
        if self.backend == "flash" and missing:
            raise ValueError(f"xform: transform 'flex-attention': backend='flash' cannot run {site.where}: {missing}. "
                             f"Use backend='auto' (Flash where it runs, else Triton) or 'triton'")
        return ("triton", missing) if missing else ("flash", None)

    def _rewrite(self, graph: CapturedGraph, site: AttentionSite, backend: str, why: str | None,
                 record: TransformRecord, built: list[BuiltBlockMask]) -> fx.Node:
        q, k = example_value(site.q), example_value(site.k)
        batch, heads, q_len, kv_len = map(fixed_size, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
        used = set().union(*(t.positions_used for t in site.masks)) if site.masks else set()
        sizes = (batch if "b" in used else None, heads if "h" in used else None, q_len, kv_len)
        options = {"BACKEND": "FLASH"} if backend == "flash" else {}
        g = graph.gm.graph
        block_mask = next((b for b in built if b.serves(site.masks, sizes, q.device)), None)
        if block_mask is None:
            with g.inserting_before(site.output):
                block_mask = block_mask_nodes(graph, site, sizes, q.device)
            built.append(block_mask)
            how = block_mask.how
        else:
            how = f"{block_mask.how}, shared with {block_mask.first}"
        call = FlexCall(site, block_mask.template, options)
        buffers = [n for t in site.masks + site.biases for n in t.buffer_nodes]
        with g.inserting_before(site.output):
            qkv = [site.q, site.k, site.v]
            if backend == "cpu" and graph.handoff == "inductor":
                # Inductor's CPU flex template fails to lower q/k/v that are views of a projection's
                # output reshaped to heads (ValueError: not enough values to unpack): made contiguous
                qkv = [insert_call(g, "call_method", "contiguous", (n,)) for n in qkv]
            node = g.call_function(call, (*qkv, *block_mask.tensors, *buffers))
        node.meta["example_value"] = site.output.meta.get("example_value")
        site.output.replace_all_uses_with(node)
        replaced_inputs = site.output.all_input_nodes
        g.erase_node(site.output)
        remove_unused(g, replaced_inputs)  # the mask/bias/score nodes only the old attention read
        record.changed("attention", site.where,
                       f"-> flex_attention ({describe_mask(site, q_len, kv_len)}; "
                       f"{backend if why is None else f'{backend}, not Flash: {why}'}; block mask {how})")
        return node


def fixed_size(size: int | torch.SymInt) -> int | torch.SymInt:
    """A size as an int where its value is fixed. Dynamo may hand a SymInt of fixed value (a graph
    recompiled for another size), which a BlockMask built per call cannot expand by; a dynamic one
    (a batch no mask reads) stays symbolic: int() would specialize it."""
    return size if free_symbols(size) else int(size)
