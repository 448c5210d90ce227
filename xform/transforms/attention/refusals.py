"""Why a matched attention is left as written, in the report's words with the fix: whatever the
device (a mask with a finite fill that can mask a whole row, dynamic sizes, gradients flex cannot
give), under Inductor on CPU or CUDA (what its flex lowerings cannot take), and why the Flash
backend cannot run a site here.
"""

from __future__ import annotations

import functools

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from xform._torch import inductor, versions
from xform.captured import CapturedGraph
from xform.fx_rewrite import example_value
from xform.transforms.attention.block_masks import built_before_the_call
from xform.transforms.attention.match import AttentionSite, node_and_line
from xform.transforms.attention.mods import FlexCall, all_allowed


def inductor_cpu_refusal(site: AttentionSite) -> str | None:
    """Why Inductor's CPU flex kernel cannot take this site, or None."""
    if any(example_value(n).requires_grad for n in (site.q, site.k, site.v)):
        return ("it needs a gradient, and flex_attention has no CPU backward (torch: 'FlexAttention does not "
                "support backward on CPU'); left as written. On CPU the rewrite runs for inference "
                "(torch.no_grad), or with handoff='eager' (flex's reference math)")
    computed = next((n for t in site.masks + site.biases for n in t.buffer_nodes if n.op != "placeholder"), None)
    if computed is not None:
        return (f"its mask or bias reads {node_and_line(computed)}, a tensor computed in the graph, which "
                f"Inductor's CPU flex kernel cannot take (torch {torch.__version__}: its CPU lowering reads the "
                f"mods' tensors before realizing them, NotImplementedError: Pointwise); left as written. With "
                f"handoff='eager' it is rewritten; the CUDA lowering realizes them first")
    data = next((n for t in site.masks for n in t.buffer_nodes), None)
    if data is not None and not versions.CPU_FLEX_LOWERS_DATA_MASKS:
        return (f"its mask reads data ({node_and_line(data)}), which Inductor's CPU flex kernel cannot lower in "
                f"torch {torch.__version__} (NoValidChoicesError; torch >= 2.13 can); left as written. With "
                f"handoff='eager' it is rewritten")
    return None


def inductor_cuda_refusal(site: AttentionSite, graph: CapturedGraph, replaced: set[fx.Node]) -> str | None:
    """Why Inductor's CUDA flex lowering cannot take this site, or None: a mask that reads data which
    another op of a graph without a backward reads too. On the H200 (torch 2.11) that crashed with
    either kernel: the lowering does not count the mask_mod's reads, so the data is freed after the
    other op (pytorch#181800). Data the caller passes, read by nothing else once the attentions are
    rewritten, is safe: its block mask is built before the call, as a hand-written model builds it."""
    if _has_backward(site):
        return None
    computed_bias = next((n for t in site.biases if t.reads_per_position for n in t.buffer_nodes
                          if n.op != "placeholder"), None)
    if computed_bias is not None:
        return (f"it adds to the scores a tensor the graph computes ({node_and_line(computed_bias)}), in a graph "
                f"with no backward, where Inductor's flex lowering lost data a mask_mod read (pytorch/pytorch#181800: "
                f"an illegal memory access on the H200, torch 2.11); for a score_mod's data this is not yet checked "
                f"on a GPU, so it is left as written. With handoff='eager' it is rewritten")
    if all(t.is_static for t in site.masks):
        return None
    buffers = [n for t in site.masks for n in t.buffer_nodes]
    before = built_before_the_call(site, graph)
    also_read = next((u for n in buffers for u in n.users if u not in replaced and not isinstance(u.target, FlexCall)),
                     None)
    if before and also_read is None:
        return None
    if before:
        why = f"the graph also reads that data at {node_and_line(also_read)}"
    else:
        computed = next((n for n in buffers if n.op != "placeholder"), None)
        why = "its block mask is built in the graph from that data" + (
            f", which {node_and_line(computed)} computes" if computed is not None else
            " (only a document mask of ids you pass is built before the call)")
    return (f"its mask reads data and {why}; in a graph with no backward Inductor's flex lowering does not "
            "keep that data alive for the kernel that reads it: on the H200 with torch 2.11 the Triton kernel "
            "then hit 'CUDA error: an illegal memory access' and the Flash one an UnboundLocalError "
            "(pytorch/pytorch#181800); left as written. In training it is rewritten; for inference, pass "
            "document ids as an input that only the mask reads, or build the BlockMask outside the compiled "
            "model and call flex_attention by hand, or compile with handoff='eager'")


def site_refusal(site: AttentionSite) -> str | None:
    """Why the site is left as written whatever the device, or None."""
    return site.refusal or _shape_refusal(site) or _empty_row_refusal(site) or _gradient_refusal(site)


def _empty_row_refusal(site: AttentionSite) -> str | None:
    """Why a mask written with a finite fill (-1e9, finfo.min) cannot become flex's mask: a query row
    masked at every position. There the model as written attends evenly to every position (each
    score is the same fill), and flex_attention to none (its output is 0). Rows each keep a position
    when the mask depends on positions only and holds somewhere on each row, checked here."""
    finite = next((t.fill for t in site.masks if t.fill != float("-inf")), None)
    if finite is None:
        return None
    why = (f"its mask fills masked scores with {finite:.4g}, not -inf, so on a row masked at every position the "
           f"model as written attends evenly to all of them, where flex_attention attends to none")
    if site.form == "SDPA":  # the model already calls SDPA: the mask it builds is what to change
        fix = "Fill the mask with float('-inf'), or pass SDPA a boolean mask (True: attend)"
    else:
        fix = "Fill with float('-inf') " + _keeping_the_soft_cap(site, (
            "(for a Hugging Face model that offers it: attn_implementation='sdpa', which xform rewrites exactly)"))
    data = next((n for t in site.masks for n in t.buffer_nodes), None)
    if data is not None and not any("q" in t.positions_used for t in site.masks):
        return (f"{why}; it reads data at each key ({node_and_line(data)}), the same for every query, so a row is "
                f"masked everywhere only where a whole sequence is (all padding), which cannot be ruled out before "
                f"the call; left as written to keep your model's results. {fix}")
    if data is not None:
        return (f"{why}; it reads data ({node_and_line(data)}), so a row may be (a left-padded one is); left as "
                f"written to keep your model's results. {fix}")
    q_len, kv_len = example_value(site.q).shape[2], example_value(site.k).shape[2]
    kv = torch.arange(kv_len)[None, :]
    for start in range(0, q_len, 256):  # positions only (no data), so the same for every batch and head
        q = torch.arange(start, min(start + 256, q_len))[:, None]
        empty = ~all_allowed(site.masks, 0, 0, q, kv).expand(len(q), kv_len).any(-1)
        if bool(empty.any()):
            return f"{why}, and its row {start + int(empty.nonzero()[0])} is masked everywhere; left as written. {fix}"
    return None


def _gradient_refusal(site: AttentionSite) -> str | None:
    """Why a hand-written attention adding a tensor it reads per query or key is left in training:
    that tensor may be a float mask filled with finfo.min, and on a row it masks everywhere (left
    padding) the model as written has exact softmax gradients, which flex's backward cannot give
    (it recomputes the probabilities from a log-sum-exp that such a fill swamps). SDPA recomputes
    as flex does, so an SDPA call is rewritten; at inference the outputs are the same, so this one
    is too."""
    data = next((n for t in site.biases if t.reads_per_position for n in t.buffer_nodes), None)
    if site.form != "hand-written" or data is None or not any(
            example_value(n).requires_grad for n in (site.q, site.k, site.v)):
        return None
    return (f"it adds to the scores a tensor it reads per query or key ({node_and_line(data)}), which may be a "
            f"float mask filled with finfo.min (as Hugging Face builds one); on a row such a mask masks everywhere "
            f"(left padding) the model as written has gradients flex_attention's backward cannot give, so it is "
            f"left as written in training (rewritten at inference). Pass a boolean mask and mask with "
            f"masked_fill(~mask, float('-inf')) " + _keeping_the_soft_cap(site, (
                "(for a Hugging Face model: attn_implementation='sdpa', which xform rewrites)")))


def _keeping_the_soft_cap(site: AttentionSite, sdpa_fix: str) -> str:
    """`sdpa_fix`, the attention a Hugging Face model writing `site` out should ask for instead, unless
    its scores are soft-capped (Gemma 2): HF's sdpa drops the soft-cap, its flex_attention keeps it."""
    if site.softcap is None:
        return sdpa_fix
    return ("(for a Hugging Face model: attn_implementation='flex_attention', Hugging Face's own flex_attention, "
            "which keeps the soft-cap; its 'sdpa' drops the soft-cap)")


def _shape_refusal(site: AttentionSite) -> str | None:
    shapes = [tuple(example_value(n).shape) for n in (site.q, site.k, site.v)]
    if any(len(s) != 4 for s in shapes):
        return f"q/k/v have shapes {shapes}; flex_attention takes [batch, heads, seq, head_dim]"
    used = set().union(*(t.positions_used for t in site.masks + site.biases))
    sizes = {"sequence length": (shapes[0][2], shapes[1][2]), "batch": (shapes[0][0],) if "b" in used else (),
             "heads": (shapes[0][1],) if "h" in used else ()}
    dynamic = {what: sorted({str(s) for size in values for s in free_symbols(size)}) for what, values in sizes.items()}
    dynamic = {what: symbols for what, symbols in dynamic.items() if symbols}
    if dynamic:
        named = " and ".join(f"{what} ({', '.join(symbols)})" for what, symbols in dynamic.items())
        return (f"its {named} {'is' if len(dynamic) == 1 else 'are'} dynamic, and a BlockMask is built for fixed "
                f"sizes; left as written. Compile with dynamic=False (a graph per size), or mark those dims "
                f"static (torch._dynamo.mark_static(tensor, dim))")
    return None


@functools.lru_cache(maxsize=None)
def flash_import_error() -> str | None:
    """Why FlashAttention-4 does not import here, or None. Torch's own check finds the package
    without importing it, so FA4 without its CuTeDSL (`cutlass`) would pass it and then fail
    inside Inductor's compile: the import is tried here."""
    fix = "pip install flash-attn-4 and nvidia-cutlass-dsl"
    try:
        if not inductor.flash_attention_available():
            return f"FlashAttention-4 is not importable ({fix})"
        import flash_attn.cute  # noqa: F401  (imports the CuTeDSL)
    except Exception as error:  # a half-installed CuTeDSL raises RuntimeError as well
        return f"FlashAttention-4 does not import: {type(error).__name__}: {error} ({fix})"
    return None


def flash_missing(site: AttentionSite) -> str | None:
    """Why FlashAttention-4 cannot run this site here, or None if it can."""
    q = example_value(site.q)
    missing = flash_import_error()
    if missing:
        return missing
    if torch.cuda.get_device_capability(q.device) < (9, 0):
        return f"it needs an SM90+ GPU, this is SM{''.join(map(str, torch.cuda.get_device_capability(q.device)))}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16/bf16 q/k/v, these are {q.dtype}"
    if not 8 <= q.shape[-1] <= 256:
        return f"it takes head dims 8 to 256, this is {q.shape[-1]}"
    if any(example_value(n).requires_grad for t in site.biases for n in t.buffer_nodes):
        return "its backward takes no gradient for tensors a score_mod reads (a learned bias)"
    return _flash_unsafe_read(site)


def _flash_unsafe_read(site: AttentionSite) -> str | None:
    """Why Flash cannot take a tensor the mods read, or None. Measured on the H100 (torch 2.11,
    FlashAttention-4 4.0.0b36, 2026-12-05): a score_mod adding a float mask read per query and key
    ([B, H, Q, KV], filled with finfo.min) gave NaN outputs; one read along a broadcast dim (Hugging
    Face's [B, 1, Q, KV], read at (b, 0, q, kv)) did not compile, the constant index refused
    ("Expected TensorSSA, but got <class 'int'>"), nor with that dim squeezed out of the tensor
    ("expects coordinate to be weakly congruent to the layout"). Per-token ids a mask_mod reads at q
    and at kv (a document mask) ran right there."""
    data = next((n for t in site.biases if t.reads_per_position for n in t.buffer_nodes), None)
    if data is not None:
        return (f"its bias reads {node_and_line(data)} per query or key, which Flash's score_mod computed wrong "
                f"(NaN outputs on the H100, torch {torch.__version__}); Triton's is right")
    for term in site.masks + site.biases:
        for number, labels in term.program.buffer_reads() if term.program is not None else ():
            if None in labels:
                node = term.program.buffer_nodes[number]
                return (f"its {'mask' if term in site.masks else 'bias'} reads {node_and_line(node)}, of shape "
                        f"{list(example_value(node).shape)}, along a broadcast dim of size 1, which Inductor's Flash "
                        f"lowering of the mods cannot index (torch {torch.__version__}); Triton's can")
    return None


def _has_backward(site: AttentionSite) -> bool:
    """Whether the graph will have a backward through this attention: grad mode on and q, k or v
    needing a gradient (leaves that need one, called under no_grad, give a graph without)."""
    return torch.is_grad_enabled() and any(example_value(n).requires_grad for n in (site.q, site.k, site.v))
