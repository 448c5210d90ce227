"""`FlexAttention`: attention in the forms people write becomes `flex_attention`.

`FlexAttention(backend="auto"|"flash"|"triton")`, spec `flex-attention[:backend]`.

What it changes, per graph (the model and its guards are untouched):
- each `F.scaled_dot_product_attention` call (is_causal, boolean or additive `attn_mask`, `scale`,
  `enable_gqa`), and each hand-written attention (`q @ k.transpose(-2, -1)`, scaled, with an
  additive bias and/or a `masked_fill`/`where` mask, `softmax(-1)`, `@ v`) becomes one call of
  flex_attention's operator;
- the mask and bias become a `mask_mod` and a `score_mod`: the subgraph that built them is
  re-evaluated per position (`xform.index_mods`), so causal, sliding-window, prefix-LM, document
  (per-token ids) and ALiBi masks become their closed forms, and any other dense mask is read
  per position;
- a mask that depends on positions only gets its BlockMask built once, at compile time, for the
  graph's shapes (its tensors become constant inputs of the compiled graph); one that reads data
  (document ids) gets it built from that data (`BlockMaskBuild`: from per-block bounds of the
  data, or at every position where the bounds cannot go): for a document mask of ids the caller
  passes, before the call and reused while the ids are unchanged (`xform.reused_inputs`), else
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

import contextlib
import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import free_symbols

from xform.capture_safety import user_source
from xform.captured import CapturedGraph
from xform.fx_rewrite import example_value, insert_call, op_name, remove_unused, unused_after
from xform.functorch_state import functorch_on
from xform.index_mods import (IndexProgram, NotBounded, NotElementwise, block_bounds, causal_program, dense_program,
                              index_program)
from xform.registry import register_transform
from xform.reused_inputs import ReusedComputation
from xform.report import TransformRecord
from xform.transform import Transform, option_error

BACKENDS = ("auto", "flash", "triton")
BLOCK = 128  # flex's default block size, that of create_block_mask
MASKED = -1e4  # a masked_fill value at or below this is a mask, not a bias
BIAS_FLOOR = -1e30  # see Term.bias


@dataclass
class Term:
    """A mask (True: attend) or a bias (added to the scaled score, times `weight`).

    `program` None is the causal mask (q >= kv); `negate` flips a mask (`masked_fill(cond, -inf)`
    masks where `cond` holds)."""

    program: IndexProgram | None
    weight: float = 1.0
    negate: bool = False
    fill: float = float("-inf")  # a mask's value where it masks: finite (-1e9, finfo.min) as some models write it

    @property
    def buffer_nodes(self) -> list[fx.Node]:
        return self.program.buffer_nodes if self.program is not None else []

    @property
    def is_static(self) -> bool:
        return self.program is None or self.program.is_static

    @property
    def positions_used(self) -> set[str]:
        return {"q", "kv"} if self.program is None else self.program.positions_used

    def allowed(self, b: Any, h: Any, q: Any, kv: Any, *buffers: torch.Tensor) -> torch.Tensor:
        if self.program is None:
            return q >= kv
        value = self.program.evaluate(b, h, q, kv, *buffers).bool()
        return ~value if self.negate else value

    @property
    def reads_per_position(self) -> bool:
        """Whether it reads a tensor at each query or key: a mask or bias passed in (a 4-D float mask,
        or one over keys or queries only), not one of positions and per-head values (ALiBi's slopes)."""
        return self.program is not None and any({"q", "kv"} & set(labels) for _, labels in self.program.buffer_reads())

    def bias(self, b: Any, h: Any, q: Any, kv: Any, *buffers: torch.Tensor) -> torch.Tensor:
        """The bias; where it reads a tensor per query or key, finite values below BIAS_FLOOR raised
        to it. Such a tensor is often a float mask filled with finfo.min, a score on which flex's
        backward overflows: a row masked everywhere (left padding) got gradients unlike SDPA's. Raised, flex
        gives SDPA's gradients there (both recompute the probabilities from the log-sum-exp, which
        a fill this low swamps) and the same outputs (beside any unmasked score either value's exp
        is 0, and a row of nothing else is still even); the gradient of the bias tensor itself at
        those positions becomes 0. -inf stays -inf."""
        value = self.program.evaluate(b, h, q, kv, *buffers)
        value = value * self.weight if self.weight != 1.0 else value
        if not self.reads_per_position:
            return value
        return torch.where((value < BIAS_FLOOR) & (value != float("-inf")), BIAS_FLOOR, value)


@dataclass
class AttentionSite:
    """One attention the graph computes, and what flex_attention needs to compute the same."""

    output: fx.Node
    form: str  # "SDPA" or "hand-written"
    q: fx.Node | None
    k: fx.Node | None
    v: fx.Node | None
    scale: float | None = None  # None: flex's default 1/sqrt(head dim), as SDPA's
    # a tanh soft-cap (Gemma 2's `c * tanh(scores / c)`): the score becomes `softcap * tanh(score)`,
    # the division folded into `scale`; None: no tanh
    softcap: float | None = None
    masks: list[Term] = field(default_factory=list)
    biases: list[Term] = field(default_factory=list)
    refusal: str | None = None

    @property
    def where(self) -> str:
        return f"{self.form} at node '{self.output.name}'"


# -- matching ----------------------------------------------------------------------------------

def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _is_call(node: Any, functions: tuple = (), methods: tuple = ()) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target in functions) or (node.op == "call_method" and node.target in methods))


def match_sdpa(node: fx.Node) -> AttentionSite | None:
    if not _is_call(node, (F.scaled_dot_product_attention,)):
        return None
    site = AttentionSite(node, "SDPA", node.args[0], node.args[1], node.args[2], scale=node.kwargs.get("scale"))
    dropout = _arg(node, 4, "dropout_p", 0.0)
    if dropout:
        site.refusal = f"dropout_p={dropout}: flex_attention has no dropout; use dropout_p=0 at inference"
        return site
    if _arg(node, 5, "is_causal", False):
        site.masks.append(Term(None))
    mask = _arg(node, 3, "attn_mask")
    if isinstance(mask, fx.Node):
        _add_mask_or_bias(site, mask, weight=1.0)
    return site


def _add_mask_or_bias(site: AttentionSite, node: fx.Node, weight: float) -> None:
    """A boolean `node` is a mask; a float one a bias, split into its mask part when it is built
    as `x.masked_fill(cond, -inf)` or `where(cond, x, -inf)`."""
    if example_value(node).dtype == torch.bool:
        site.masks.append(Term(_program(node)))
        return
    split = _masking_fill(_through_casts_up(node))  # `bias.masked_fill(cond, -inf).to(q.dtype)` as people write it
    if split is not None:
        kept, cond, attend_when, fill = split
        site.masks.append(Term(_program(cond), negate=not attend_when, fill=fill))
        if not isinstance(kept, fx.Node):  # `where(cond, 0.0, -inf)`: a number added where the mask holds
            return  # is added to every score a row keeps, which the softmax does not see
        node = kept
    site.biases.append(Term(_program(node), weight))


def _masking_fill(node: fx.Node) -> tuple[fx.Node, fx.Node, bool, float] | None:
    """(value, condition, attend-when-condition, fill) for `value.masked_fill(cond, -inf)` or
    `where(cond, value, -inf)` (or a fill at or below `MASKED`); None for anything else."""
    if _is_call(node, (torch.masked_fill,), ("masked_fill",)):
        value, cond, fill = node.args[0], node.args[1], node.args[2]
        if isinstance(fill, (int, float)) and fill <= MASKED and isinstance(cond, fx.Node):
            return value, cond, False, float(fill)
    if _is_call(node, (torch.where,)) and len(node.args) == 3:
        cond, value, fill = node.args
        if isinstance(fill, (int, float)) and fill <= MASKED and isinstance(cond, fx.Node):
            return value, cond, True, float(fill)
    return None


def _program(node: fx.Node) -> IndexProgram:
    try:
        return index_program(node)
    except NotElementwise:
        return dense_program(node)


_MATMUL = (operator.matmul, torch.matmul)
_MULS = (operator.mul, operator.imul, torch.mul)  # in place too: `scores *= scale` on QK^T, which nothing else reads
_DIVS = (operator.truediv, operator.itruediv, torch.div)
_SOFTMAX = (F.softmax, torch.softmax)
_TANH = (torch.tanh, F.tanh)
_CASTS = ("to", "float", "type", "type_as", "half", "bfloat16")


def match_handwritten(softmax: fx.Node) -> AttentionSite | None:
    """`softmax(scale * q @ k^T + bias, masked) @ v`, from its softmax node; None if it is not one."""
    if not _is_call(softmax, _SOFTMAX, ("softmax",)) or _arg(softmax, 1, "dim", None) not in (-1, 3):
        return None
    probabilities = softmax
    after = _single_user_through_casts(softmax)
    if after is not None and _is_call(after, (F.dropout,), ("dropout",)):
        p = _arg(after, 1, "p", 0.5)
        if _arg(after, 2, "training", True) and p:
            return AttentionSite(after, "hand-written", None, None, None,
                                 refusal=f"dropout p={p} on the attention weights: flex_attention has no dropout")
        probabilities, after = after, _single_user_through_casts(after)
    if after is not None and not _is_call(after, _MATMUL, ("matmul",)):
        reshaped = _matmul_after_reshapes(after)
        if reshaped is not None:  # `probs.view(B * H, S, S) @ v`: attention all the same, not in a form taken
            return AttentionSite(reshaped, "hand-written", None, None, None, refusal=(
                f"its attention weights reach the product with v through node '{after.name}' ({_op(after)}); "
                f"only `softmax(scores) @ v` on [batch, heads, seq, seq] weights (casts or dropout between them) "
                f"is rewritten. Keep the weights 4-D up to the product with v to have it rewritten"))
    if (after is None or not _is_call(after, _MATMUL, ("matmul",))
            or _through_casts_up(after.args[0]) is not probabilities):
        return None
    v = after.args[1]
    steps: list[tuple[str, Any]] = []  # from the softmax up to QK^T
    node = _through_casts_up(softmax.args[0])
    while True:
        if _is_call(node, _MATMUL, ("matmul",)):
            break
        split = _masking_fill(node)
        if split is not None:
            steps.append(("mask", split))
            node = _through_casts_up(split[0])
        elif _is_call(node, _MULS, ("mul", "mul_")) and _scalar_operand(node) is not None:
            steps.append(("scale", _scalar_operand(node)[0]))
            node = _through_casts_up(_scalar_operand(node)[1])
        elif (_is_call(node, _DIVS, ("div", "div_")) and _is_number(node.args[1])
              and node.kwargs.get("rounding_mode") is None):  # a rounded division is no scale
            steps.append(("scale", 1.0 / node.args[1]))
            node = _through_casts_up(node.args[0])
        elif (_is_call(node, (operator.add, torch.add), ("add",)) and all(isinstance(a, fx.Node) for a in node.args[:2])
              and node.kwargs.get("alpha", 1) == 1):  # `add(scores, bias, alpha=a)` adds a * bias
            scores, bias = _scores_and_bias(node)
            steps.append(("bias", bias))
            node = _through_casts_up(scores)
        elif _is_call(node, _TANH, ("tanh",)):
            steps.append(("tanh", node))
            node = _through_casts_up(node.args[0])
        else:
            site = AttentionSite(after, "hand-written", None, None, v)
            site.refusal = (f"node '{getattr(node, 'name', node)}' ({_op(node)}) between QK^T and the softmax is not a "
                            f"scale, an additive bias, a tanh soft-cap or a -inf mask")
            return site
    q, kt = node.args[0], node.args[1]
    k = _untransposed(kt)
    if k is None:
        return None
    scale_before_qk = 1.0
    if _is_call(q, (operator.mul, torch.mul), ("mul",)) and _scalar_operand(q) is not None:
        scale_before_qk, q = _scalar_operand(q)
    site = AttentionSite(after, "hand-written", q, k, v)
    site.refusal = _fold_steps(site, list(reversed(steps)), scale_before_qk)
    return site


def _fold_steps(site: AttentionSite, steps: list[tuple[str, Any]], scale: float) -> str | None:
    """Turn the ops from QK^T to the softmax, in order, into flex's scale, soft-cap, biases and
    masks: a bias added before a later scale is scaled with it, so score_mod can add it to the
    scaled score. Scales before a tanh go into flex's scale, scales after it into the soft-cap.
    Returns why the steps cannot be folded, or None."""
    pending: list[tuple[fx.Node, float]] = []
    for kind, value in steps:
        if kind == "tanh":
            under = ("another tanh" if site.softcap is not None else "a bias" if pending else
                     "a mask, which the tanh turns into a bias (tanh(-inf) = -1)" if site.masks else None)
            if under is not None:
                return (f"{_node_and_line(value)} soft-caps the scores (`c * tanh(scores / c)`) with {under} under it; "
                        f"flex_attention takes a soft-cap only with every mask and bias after it")
            site.softcap = 1.0
        elif kind == "scale":
            if site.softcap is None:
                scale *= value
            else:
                site.softcap *= value
            pending = [(bias, weight * value) for bias, weight in pending]
        elif kind == "bias":
            pending.append((value, 1.0))
        else:
            kept, cond, attend_when, fill = value
            site.masks.append(Term(_program(cond), negate=not attend_when, fill=fill))
    site.scale = scale
    for bias, weight in pending:
        _add_mask_or_bias(site, bias, weight)
    return None


def _scores_and_bias(add: fx.Node) -> tuple[fx.Node, fx.Node]:
    a, b = add.args[0], add.args[1]
    return (a, b) if _reaches_matmul(a) else (b, a)


def _reaches_matmul(node: fx.Node, depth: int = 12) -> bool:
    """Whether a QK^T matmul (a matmul by a transposed tensor) lies among `node`'s near ancestors."""
    frontier, seen = [node], set()
    for _ in range(depth):
        frontier = [n for n in frontier if isinstance(n, fx.Node) and n not in seen]
        if not frontier:
            return False
        if any(_is_call(n, _MATMUL, ("matmul",)) and _untransposed(n.args[1]) is not None for n in frontier):
            return True
        seen.update(frontier)
        frontier = [i for n in frontier for i in n.all_input_nodes]
    return False


def _scalar_operand(node: fx.Node) -> tuple[float, fx.Node] | None:
    a, b = node.args[0], node.args[1]
    if _is_number(a) and isinstance(b, fx.Node):
        return float(a), b
    if _is_number(b) and isinstance(a, fx.Node):
        return float(b), a
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _untransposed(kt: Any) -> fx.Node | None:
    """k, for kt = k.transpose(-2, -1) (or .mT, or the permute swapping the last two dims)."""
    if _is_call(kt, (torch.transpose,), ("transpose",)):
        dims = {d % 4 for d in kt.args[1:3]}
        return kt.args[0] if dims == {2, 3} else None
    if _is_call(kt, (), ("permute",)):
        dims = kt.args[1:] if not isinstance(kt.args[1], (list, tuple)) else kt.args[1]
        return kt.args[0] if tuple(dims) == (0, 1, 3, 2) else None
    if isinstance(kt, fx.Node) and kt.op == "call_function" and kt.target is getattr and kt.args[1] == "mT":
        return kt.args[0]
    return None


def _through_casts_up(node: Any) -> Any:
    while _is_call(node, (), _CASTS):
        node = node.args[0]
    return node


_RESHAPES = ("view", "reshape", "flatten", "unflatten", "contiguous")


def _matmul_after_reshapes(node: fx.Node, depth: int = 3) -> fx.Node | None:
    """The matmul (or bmm) that `node`, a reshape of attention weights, feeds as its left operand
    through at most `depth` reshapes and casts; None if there is none."""
    for _ in range(depth):
        if not _is_call(node, (torch.reshape, torch.flatten), _RESHAPES + _CASTS) or len(node.users) != 1:
            return None
        (node,) = node.users
        if _is_call(node, _MATMUL + (torch.bmm,), ("matmul", "bmm")):
            return node
    return None


def _single_user_through_casts(node: fx.Node) -> fx.Node | None:
    while len(node.users) == 1:
        (user,) = node.users
        if not _is_call(user, (), _CASTS):
            return user
        node = user
    return None


def _op(node: Any) -> str:
    return op_name(node) if isinstance(node, fx.Node) else type(node).__name__


# -- what a mask is, for the report ------------------------------------------------------------

def describe_mask(site: AttentionSite, q_len: int, kv_len: int) -> str:
    """'causal', 'sliding window 1024', 'prefix-LM 64', 'document', 'ALiBi-style bias', ... ."""
    parts = []
    static = [t for t in site.masks if t.is_static]
    if static:
        parts.append(_static_mask_name(static, q_len, kv_len))
    if any(not t.is_static for t in site.masks):
        parts.append("document (per-token ids)" if any(t.program.reads_ids() for t in site.masks if t.program)
                     else "mask read from a tensor")
    if site.softcap is not None:  # applied to the score before the biases are added
        parts.append(f"tanh soft-cap {site.softcap:g}")
    for term in site.biases:
        program = term.program
        per_head = any(labels == ("h",) for _, labels in program.buffer_reads())
        parts.append("ALiBi-style per-head bias" if per_head and {"q", "kv"} <= program.positions_used
                     else "additive bias")
    return " + ".join(p for p in parts if p) or "no mask"


def _static_mask_name(terms: list[Term], q_len: int, kv_len: int) -> str:
    """Name a position-only mask by evaluating it on a few full rows."""
    rows = torch.tensor(sorted({0, 1, q_len // 2, q_len - 1}))[:, None]
    kv = torch.arange(kv_len)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    allowed = _all_allowed(terms, zero, zero, rows, kv).expand(rows.shape[0], kv_len)
    causal = (kv <= rows).expand_as(allowed)
    if bool(allowed.all()):
        return ""
    if torch.equal(allowed, causal):
        return "causal"
    width = int(allowed[-1].sum())
    if torch.equal(allowed, causal & (rows - kv < width)):
        return f"sliding window {width}"
    prefix = int(allowed[0].sum())
    if torch.equal(allowed, causal | (kv < prefix)):
        return f"prefix-LM {prefix}"
    return "custom mask"


def _all_allowed(terms: list[Term], b: Any, h: Any, q: Any, kv: Any, *buffers: torch.Tensor) -> torch.Tensor:
    """The AND of the masks (True where all attend), each reading its slice of `buffers`; True everywhere
    with none. Seeded with the first mask, not a constant: the mask_mod runs per element of every
    partial block, so an operation more is a cost in the kernel."""
    allowed = None
    for term, own in _split(terms, buffers):
        mask = term.allowed(b, h, q, kv, *own)
        allowed = mask if allowed is None else allowed & mask
    return q >= 0 if allowed is None else allowed


def _split(terms: list[Term], buffers: tuple) -> list[tuple[Term, tuple]]:
    """Pair each term with its slice of the flat buffer list."""
    pairs, start = [], 0
    for term in terms:
        count = len(term.buffer_nodes)
        pairs.append((term, tuple(buffers[start:start + count])))
        start += count
    return pairs


# -- the flex_attention call -------------------------------------------------------------------

class BlockMaskBuild:
    """Graph call target: the BlockMask of a site's masks, from the tensors they read, as the tuple of
    its tensors (so that several attentions of a graph can share one build).

    Two ways: by per-block bounds (`xform.index_mods.block_bounds`: the min and max of each tensor
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

        mask_mod = lambda b, h, qi, ki: _all_allowed(self.masks, b, h, qi, ki, *buffers)  # noqa: E731
        if self.fallback is None:
            return _bounded_block_mask(self.masks, buffers, self.sizes, self.device, mask_mod)
        return create_block_mask(mask_mod, *self.sizes, device=self.device)

    def __call__(self, *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with functorch_on():  # run eagerly (eager handoff, a build before the call), it vmaps
            return tuple(x for x in self.block_mask(*buffers).as_tuple() if isinstance(x, torch.Tensor))

    def how(self, before_the_call: bool) -> str:
        when = "built before each call, and reused while that data is unchanged," if before_the_call else \
            "built per call"
        if self.fallback is None:
            return f"{when} from per-block bounds of the data it reads"
        return f"{when} from the data it reads, at every position ({self.fallback})"


def _bounded_block_mask(masks: list[Term], buffers: tuple, sizes: tuple[int | None, ...], device: torch.device,
                        mask_mod: Any) -> Any:
    """The BlockMask create_block_mask would build, but from per-block bounds: a block is full only
    where every mask holds on all of it, and left out only where one holds nowhere on it."""
    from torch.nn.attention.flex_attention import _create_sparse_block_from_block_mask

    batch, heads, q_len, kv_len = (s or 1 for s in sizes)
    full = some = torch.ones((), dtype=torch.bool, device=device)
    for term, own in _split(masks, buffers):
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
    return _create_sparse_block_from_block_mask((partial.to(torch.int8), full.to(torch.int8)), mask_mod,
                                                (q_len, kv_len), BLOCK, BLOCK)


_TENSOR = object()  # a BlockMask tuple's slot that the graph passes in


def _template(block_mask: Any) -> tuple:
    """A BlockMask's tuple with its tensors left as slots (and no mask_mod: each call brings its own)."""
    return tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in block_mask.as_tuple()[:-1]) + (None,)


class FlexCall:
    """Graph call target: `flex_attention(q, k, v)` with the site's mods, block mask and kernel options.

    Takes (q, k, v, *block_mask_tensors, *mask_buffers, *bias_buffers) so that every tensor it
    reads is a graph value, as AOTAutograd needs; calls flex_attention's operator directly (the
    frontend would try to compile itself, which it cannot from inside a compile).
    """

    def __init__(self, site: AttentionSite, block_template: tuple, kernel_options: dict[str, Any]) -> None:
        self.masks, self.biases, self.scale, self.softcap = site.masks, site.biases, site.scale, site.softcap
        self.kernel_options = kernel_options
        self.block_template = block_template  # a BlockMask tuple, its tensors `_TENSOR` slots
        self.__name__ = "flex_attention"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import _apply_kernel_options

        count = sum(x is _TENSOR for x in self.block_template)
        block_tensors, rest = iter(tensors[:count]), tensors[count:]
        mask_count = sum(len(t.buffer_nodes) for t in self.masks)
        mask_buffers, bias_buffers = tuple(rest[:mask_count]), tuple(rest[mask_count:])

        def mask_mod(b, h, q_idx, kv_idx, *buffers):
            return _all_allowed(self.masks, b, h, q_idx, kv_idx, *buffers)

        def score_mod(score, b, h, q_idx, kv_idx, *buffers):
            if self.softcap is not None:
                score = self.softcap * torch.tanh(score)
            for term, own in _split(self.biases, buffers):
                score = score + term.bias(b, h, q_idx, kv_idx, *own)
            return score

        block = tuple(next(block_tensors) if x is _TENSOR else x for x in self.block_template)
        options = _apply_kernel_options(q, k, v, False, dict(self.kernel_options))
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        with functorch_on():  # run eagerly (eager handoff), flex's reference math vmaps the mods
            out, *_ = torch.ops.higher_order.flex_attention(
                q, k, v, score_mod, block[:-1] + (mask_mod,), scale, options, bias_buffers, mask_buffers)
        return out


# -- the transform -----------------------------------------------------------------------------

@register_transform
class FlexAttention(Transform):
    """SDPA and hand-written attention rewritten to flex_attention (`flex-attention[:backend]`)."""

    name = "flex-attention"

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
        built: list[_BuiltBlockMask] = []  # this graph's block masks, shared by the sites whose masks match
        refusals = [_refusal(s) for s in sites]  # once each: a finite-fill mask is checked row by row
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
            return _inductor_cpu_refusal(site)
        return _inductor_cuda_refusal(site, graph, replaced) if device == "cuda" else None

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
        missing = _flash_missing(site)
        if self.backend == "flash" and missing:
            raise ValueError(f"xform: transform 'flex-attention': backend='flash' cannot run {site.where}: {missing}. "
                             f"Use backend='auto' (Flash where it runs, else Triton) or 'triton'")
        return ("triton", missing) if missing else ("flash", None)

    def _rewrite(self, graph: CapturedGraph, site: AttentionSite, backend: str, why: str | None,
                 record: TransformRecord, built: list[_BuiltBlockMask]) -> fx.Node:
        q, k = example_value(site.q), example_value(site.k)
        batch, heads, q_len, kv_len = map(_fixed, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
        used = set().union(*(t.positions_used for t in site.masks)) if site.masks else set()
        sizes = (batch if "b" in used else None, heads if "h" in used else None, q_len, kv_len)
        options = {"BACKEND": "FLASH"} if backend == "flash" else {}
        g = graph.gm.graph
        block_mask = next((b for b in built if b.serves(site.masks, sizes, q.device)), None)
        if block_mask is None:
            with g.inserting_before(site.output):
                block_mask = _block_mask_nodes(graph, site, sizes, q.device)
            built.append(block_mask)
            how = block_mask.how
        else:
            how = f"{block_mask.how}, shared with {block_mask.first}"
        call = FlexCall(site, block_mask.template, options)
        buffers = [n for t in site.masks + site.biases for n in t.buffer_nodes]
        with g.inserting_before(site.output):
            node = g.call_function(call, (site.q, site.k, site.v, *block_mask.tensors, *buffers))
        node.meta["example_value"] = site.output.meta.get("example_value")
        site.output.replace_all_uses_with(node)
        replaced_inputs = site.output.all_input_nodes
        g.erase_node(site.output)
        remove_unused(g, replaced_inputs)  # the mask/bias/score nodes only the old attention read
        record.changed("attention", site.where,
                       f"-> flex_attention ({describe_mask(site, q_len, kv_len)}; "
                       f"{backend if why is None else f'{backend}, not Flash: {why}'}; block mask {how})")
        return node


@dataclass
class _BuiltBlockMask:
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


def _block_mask_nodes(graph: CapturedGraph, site: AttentionSite, sizes: tuple[int | None, ...],
                      device: torch.device) -> _BuiltBlockMask:
    """A mask that depends on positions only: its BlockMask built now, its tensors constant inputs.
    One that reads data: a BlockMaskBuild node computing it from that data on every call."""
    from torch.nn.attention.flex_attention import create_block_mask

    if all(t.is_static for t in site.masks):
        block_mask = create_block_mask(lambda b, h, qi, ki: _all_allowed(site.masks, b, h, qi, ki), *sizes,
                                       device=device)
        tensors = [x for x in block_mask.as_tuple() if isinstance(x, torch.Tensor)]
        nodes = [graph.add_constant_input(f"block_mask_{site.output.name}_{i}", t) for i, t in enumerate(tensors)]
        return _BuiltBlockMask(site.masks, sizes, device, nodes, _template(block_mask), "built once", site.where)
    build = BlockMaskBuild(site.masks, sizes, device)
    buffers = tuple(n for t in site.masks for n in t.buffer_nodes)
    values = [example_value(n) for n in buffers]
    fake_mode = next((v.fake_mode for v in values if isinstance(v, FakeTensor)), contextlib.nullcontext())
    with fake_mode, torch._C.DisableTorchFunctionSubclass():
        try:
            example = build.block_mask(*values)
        except NotBounded as why:
            build.fallback = f"per-block bounds cannot take {why}"
            example = build.block_mask(*values)
    name = f"block_mask_{site.output.name}"
    if _built_before_the_call(site, graph):
        indices = [graph.dynamo_input_index(n) for n in buffers]
        reads = [graph.example_inputs[i] for i in indices]
        reused = ReusedComputation(build, indices, compile_with_inductor=graph.handoff == "inductor")
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            results = build(*reads)
        reused.prime(reads, results)
        nodes = graph.add_derived_inputs(name, reused, results)
        return _BuiltBlockMask(site.masks, sizes, device, nodes, _template(example), build.how(True), site.where)
    g = graph.gm.graph
    node = insert_call(g, "call_function", build, buffers)
    nodes = [insert_call(g, "call_function", operator.getitem, (node, i)) for i in range(len(node.meta["example_value"]))]
    return _BuiltBlockMask(site.masks, sizes, device, nodes, _template(example), build.how(False), site.where)


def _built_before_the_call(site: AttentionSite, graph: CapturedGraph) -> bool:
    """Whether a data mask's block mask is built before the call (and reused while its data is
    unchanged) rather than in the graph: for per-token ids (a document mask: the same ids are often
    passed again, as for evaluation on fixed packing) that the caller passes. Other data masks (a
    decode step's `positions <= pos`) change with every call, and a build inside the graph is
    recorded with it by `cudagraphs`, where one before the call would be launched every step."""
    buffers = [n for t in site.masks for n in t.buffer_nodes]
    return (bool(buffers) and any(t.program is not None and t.program.reads_ids() for t in site.masks)
            and all(n.op == "placeholder" and graph.dynamo_input_index(n) is not None for n in buffers))


def _inductor_cpu_refusal(site: AttentionSite) -> str | None:
    """Why Inductor's CPU flex kernel cannot take this site, or None."""
    if any(example_value(n).requires_grad for n in (site.q, site.k, site.v)):
        return ("it needs a gradient, and flex_attention has no CPU backward (torch: 'FlexAttention does not "
                "support backward on CPU'); left as written. On CPU the rewrite runs for inference "
                "(torch.no_grad), or with handoff='eager' (flex's reference math)")
    computed = next((n for t in site.masks + site.biases for n in t.buffer_nodes if n.op != "placeholder"), None)
    if computed is not None:
        return (f"its mask or bias reads {_node_and_line(computed)}, a tensor computed in the graph, which "
                f"Inductor's CPU flex kernel cannot take (torch {torch.__version__}: its CPU lowering reads the "
                f"mods' tensors before realizing them, NotImplementedError: Pointwise); left as written. With "
                f"handoff='eager' it is rewritten; the CUDA lowering realizes them first")
    return None


def _inductor_cuda_refusal(site: AttentionSite, graph: CapturedGraph, replaced: set[fx.Node]) -> str | None:
    """Why Inductor's CUDA flex lowering cannot take this site, or None: a mask that reads data which
    another op of a graph without a backward reads too. On the H200 (torch 2.11) that crashed with
    either kernel: the lowering does not count the mask_mod's reads, so the data is freed after the
    other op (pytorch#181800). Data the caller passes, read by nothing else once the attentions are
    rewritten, is safe: its block mask is built before the call, as a hand-written model builds it."""
    if _has_backward(site) or all(t.is_static for t in site.masks):
        return None
    buffers = [n for t in site.masks for n in t.buffer_nodes]
    before = _built_before_the_call(site, graph)
    also_read = next((u for n in buffers for u in n.users if u not in replaced and not isinstance(u.target, FlexCall)),
                     None)
    if before and also_read is None:
        return None
    if before:
        why = f"the graph also reads that data at {_node_and_line(also_read)}"
    else:
        computed = next((n for n in buffers if n.op != "placeholder"), None)
        why = "its block mask is built in the graph from that data" + (
            f", which {_node_and_line(computed)} computes" if computed is not None else
            " (only a document mask of ids you pass is built before the call)")
    return (f"its mask reads data and {why}; in a graph with no backward Inductor's flex lowering does not "
            "keep that data alive for the kernel that reads it: on the H200 with torch 2.11 the Triton kernel "
            "then hit 'CUDA error: an illegal memory access' and the Flash one an UnboundLocalError "
            "(pytorch/pytorch#181800); left as written. In training it is rewritten; for inference, pass "
            "document ids as an input that only the mask reads, or build the BlockMask outside the compiled "
            "model and call flex_attention by hand, or compile with handoff='eager'")


def _node_and_line(node: fx.Node) -> str:
    source = user_source(node)
    return f"node '{node.name}'" + (f" ({source})" if source else "")


def _refusal(site: AttentionSite) -> str | None:
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
    elif site.softcap is None:
        fix = ("Fill with float('-inf') (for a Hugging Face model that offers it: attn_implementation='sdpa', which "
               "xform rewrites exactly)")
    else:
        fix = ("Fill with float('-inf') (for a Hugging Face model: attn_implementation='flex_attention', Hugging "
               "Face's own flex_attention, which keeps the soft-cap; its 'sdpa' drops the soft-cap)")
    data = next((n for t in site.masks for n in t.buffer_nodes), None)
    if data is not None and not any("q" in t.positions_used for t in site.masks):
        return (f"{why}; it reads data at each key ({_node_and_line(data)}), the same for every query, so a row is "
                f"masked everywhere only where a whole sequence is (all padding), which cannot be ruled out before "
                f"the call; left as written to keep your model's results. {fix}")
    if data is not None:
        return (f"{why}; it reads data ({_node_and_line(data)}), so a row may be (a left-padded one is); left as "
                f"written to keep your model's results. {fix}")
    q_len, kv_len = example_value(site.q).shape[2], example_value(site.k).shape[2]
    kv = torch.arange(kv_len)[None, :]
    for start in range(0, q_len, 256):  # positions only (no data), so the same for every batch and head
        q = torch.arange(start, min(start + 256, q_len))[:, None]
        empty = ~_all_allowed(site.masks, 0, 0, q, kv).expand(len(q), kv_len).any(-1)
        if bool(empty.any()):
            return f"{why}, and its row {start + int(empty.nonzero()[0])} is masked everywhere; left as written. {fix}"
    return None


def _fixed(size: int | torch.SymInt) -> int | torch.SymInt:
    """A size as an int where its value is fixed. Dynamo may hand a SymInt of fixed value (a graph
    recompiled for another size), which a BlockMask built per call cannot expand by; a dynamic one
    (a batch no mask reads) stays symbolic: int() would specialize it."""
    return size if free_symbols(size) else int(size)


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
    return (f"it adds to the scores a tensor it reads per query or key ({_node_and_line(data)}), which may be a "
            f"float mask filled with finfo.min (as Hugging Face builds one); on a row such a mask masks everywhere "
            f"(left padding) the model as written has gradients flex_attention's backward cannot give, so it is "
            f"left as written in training (rewritten at inference). Pass a boolean mask and mask with "
            f"masked_fill(~mask, float('-inf')) (for a Hugging Face model: attn_implementation='sdpa', which xform "
            f"rewrites)")


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
        from torch._inductor.kernel.flex.flex_flash_attention import ensure_flash_available

        if not ensure_flash_available():
            return f"FlashAttention-4 is not importable ({fix})"
        import flash_attn.cute  # noqa: F401  (imports the CuTeDSL)
    except Exception as error:  # a half-installed CuTeDSL raises RuntimeError as well
        return f"FlashAttention-4 does not import: {type(error).__name__}: {error} ({fix})"
    return None


def _flash_missing(site: AttentionSite) -> str | None:
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
        return (f"its bias reads {_node_and_line(data)} per query or key, which Flash's score_mod computed wrong "
                f"(NaN outputs on the H100, torch {torch.__version__}); Triton's is right")
    for term in site.masks + site.biases:
        for number, labels in term.program.buffer_reads() if term.program is not None else ():
            if None in labels:
                node = term.program.buffer_nodes[number]
                return (f"its {'mask' if term in site.masks else 'bias'} reads {_node_and_line(node)}, of shape "
                        f"{list(example_value(node).shape)}, along a broadcast dim of size 1, which Inductor's Flash "
                        f"lowering of the mods cannot index (torch {torch.__version__}); Triton's can")
    return None


def _has_backward(site: AttentionSite) -> bool:
    """Whether the graph will have a backward through this attention: grad mode on and q, k or v
    needing a gradient (leaves that need one, called under no_grad, give a graph without)."""
    return torch.is_grad_enabled() and any(example_value(n).requires_grad for n in (site.q, site.k, site.v))
