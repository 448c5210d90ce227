"""What attention a graph computes: each SDPA call and each hand-written attention (`q @ k^T`,
scaled, masked or biased, softmax, `@ v`) matched as an `AttentionSite`, its masks and biases as
`Term`s whose index programs (`index_mods`) say what they are at every position; or the reason a
match was refused.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from xform.fx_rewrite import example_value, op_name, user_source
from xform.transforms.attention.index_mods import IndexProgram, NotElementwise, dense_program, index_program

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
        program = _program(cond)
        # a finite fill (finfo.min of fp32, bf16) from data is added as written, raised to BIAS_FLOOR
        # (Term.bias), so a row it masks everywhere stays even; fp16's (-65504) stays a mask, refused
        if fill == -math.inf or fill > BIAS_FLOOR or program.is_static:
            site.masks.append(Term(program, negate=not attend_when, fill=fill))
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
                return (f"{node_and_line(value)} soft-caps the scores (`c * tanh(scores / c)`) with {under} under it; "
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


def node_and_line(node: fx.Node) -> str:
    source = user_source(node)
    return f"node '{node.name}'" + (f" ({source})" if source else "")
