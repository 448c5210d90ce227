"""The `flex-attention` transform on CPU: every pattern, forward and gradients against the model as
written (handoff="eager" runs flex's reference math, which has a CPU backward), Inductor's CPU
kernels for inference, the refusals and their reasons."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import xform
from xform._torch import versions
from xform.transforms import FlexAttention
from models import AsModule, TransformerBlock

B, H, S, D = 2, 4, 64, 16
KV_HEADS = 2


def _positions():
    i = torch.arange(S)
    return i[:, None], i[None, :]


def sdpa_causal(q, k, v, extra):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_sliding_window(q, k, v, extra):
    qi, ki = _positions()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(qi >= ki) & (qi - ki < 16))


def sdpa_alibi_bias(q, k, v, extra):
    qi, ki = _positions()
    bias = extra["slopes"][:, None, None] * (ki - qi)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(ki > qi, float("-inf")))


def sdpa_alibi_bias_cast(q, k, v, extra):
    qi, ki = _positions()
    bias = (extra["slopes"][:, None, None] * (ki - qi)).masked_fill(ki > qi, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))  # the -inf fill under a cast


def sdpa_dense_mask(q, k, v, extra):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=extra["dense"])


def sdpa_scale_gqa(q, k, v, extra):
    return F.scaled_dot_product_attention(q, k[:, :KV_HEADS], v[:, :KV_HEADS], is_causal=True, scale=0.3,
                                          enable_gqa=True)


def hand_causal_tril(q, k, v, extra):
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def hand_prefix_lm_where(q, k, v, extra):
    qi, ki = _positions()
    scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    scores = torch.where((ki < 8) | (qi >= ki), scores, float("-inf"))
    return F.softmax(scores.float(), dim=-1).type_as(q) @ v


def hand_document(q, k, v, extra):
    ids = extra["ids"]
    scores = (q * D ** -0.5) @ k.transpose(-2, -1)
    same = ids[:, None, :, None] == ids[:, None, None, :]
    qi, ki = _positions()
    return scores.masked_fill(~(same & (qi >= ki)), float("-inf")).softmax(-1) @ v


def hand_in_place_scale(q, k, v, extra):
    scores = q @ k.transpose(-2, -1)
    scores /= math.sqrt(D)  # in place, as Falcon writes it
    qi, ki = _positions()
    return scores.masked_fill(ki > qi, float("-inf")).softmax(-1) @ v


def hand_alibi(q, k, v, extra):
    qi, ki = _positions()
    scores = q @ k.transpose(-2, -1) + extra["slopes"][:, None, None] * (ki - qi)
    scores = scores / math.sqrt(D)
    return torch.softmax(scores.masked_fill(ki > qi, -1e9), dim=-1) @ v


def hand_hf_eager(q, k, v, extra):
    """As transformers' eager attention: a bool mask begun with x.new_ones(()), added as a 0/min bias
    (its 0 a 0-dim tensor made in the graph), the probabilities cast with .type() before @ v."""
    qi, ki = _positions()
    allowed = q.new_ones((), dtype=torch.bool) & (ki <= qi)
    bias = torch.where(allowed, torch.tensor(0.0), torch.finfo(q.dtype).min)
    scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + bias
    return F.softmax(scores, dim=-1).type(torch.float32) @ v


def hand_dense_bias(q, k, v, extra):
    """As transformers' eager attention given a 4-D float mask: the mask sliced to the keys, added."""
    scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    scores = scores + extra["dense"][:, :, :, : k.shape[-2]]
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def hand_softcap_gemma2(q, k, v, extra):
    """As transformers' Gemma 2 eager attention: scale, soft-cap `c * tanh(x / c)`, then the mask added."""
    qi, ki = _positions()
    scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    scores = torch.tanh(scores / 5.0) * 5.0
    scores = scores + torch.zeros(S, S).masked_fill(ki > qi, float("-inf"))
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


PATTERNS = {
    sdpa_causal: "SDPA -> flex_attention (causal",
    sdpa_sliding_window: "SDPA -> flex_attention (sliding window 16",
    sdpa_alibi_bias: "SDPA -> flex_attention (causal + ALiBi-style per-head bias",
    sdpa_alibi_bias_cast: "SDPA -> flex_attention (causal + ALiBi-style per-head bias",
    sdpa_dense_mask: "SDPA -> flex_attention (mask read from a tensor",
    sdpa_scale_gqa: "SDPA -> flex_attention (causal",
    hand_causal_tril: "hand-written -> flex_attention (causal",
    hand_prefix_lm_where: "hand-written -> flex_attention (prefix-LM 8",
    hand_document: "hand-written -> flex_attention (document (per-token ids)",
    hand_in_place_scale: "hand-written -> flex_attention (causal",
    hand_alibi: "hand-written -> flex_attention (causal + ALiBi-style per-head bias",
    hand_hf_eager: "hand-written -> flex_attention (causal + additive bias",
    hand_softcap_gemma2: "hand-written -> flex_attention (causal + tanh soft-cap 5",
}


def inputs(requires_grad: bool):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, requires_grad=requires_grad) for _ in range(3))
    extra = {
        "slopes": torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)]),
        "dense": torch.rand(B, 1, S, S) > 0.5,
        "ids": torch.randint(0, 3, (B, S)).sort(-1).values,
    }
    extra["dense"][..., 0] = True  # no fully masked row: SDPA gives NaN there, flex gives 0
    return q, k, v, extra


def changes(fn) -> list[str]:
    return [f"{c.target.split(' at ')[0]} {c.detail}" for c in xform.report(fn).changes("flex-attention")]


@pytest.mark.parametrize("pattern", PATTERNS, ids=[p.__name__ for p in PATTERNS])
def test_pattern_matches_the_model_as_written_forward_and_backward(pattern):
    q, k, v, extra = inputs(requires_grad=True)
    compiled = xform.compile(pattern, "flex-attention", handoff="eager")

    out = compiled(q, k, v, extra)
    expected = pattern(q, k, v, extra)

    (change,) = changes(pattern)
    assert change.startswith(PATTERNS[pattern])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"gradient of {name}")


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [
    sdpa_causal, sdpa_sliding_window, hand_alibi, hand_softcap_gemma2,
    pytest.param(hand_document, marks=pytest.mark.skipif(
        not versions.CPU_FLEX_LOWERS_DATA_MASKS,
        reason="torch 2.11's CPU flex kernel cannot lower a mask_mod that reads a data tensor (NoValidChoicesError)")),
], ids=lambda p: p.__name__)
def test_inductor_cpu_kernels_for_inference(pattern):
    q, k, v, extra = inputs(requires_grad=False)
    with torch.no_grad():
        out = xform.compile(pattern, "flex-attention")(q, k, v, extra)
        expected = pattern(q, k, v, extra)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert changes(pattern)[0].endswith("cpu; block mask built once)") or pattern is hand_document


@pytest.mark.slow
def test_a_data_mask_where_the_cpu_kernel_cannot_lower_it_is_left_as_written(monkeypatch):
    """torch 2.11's CPU flex kernel raised NoValidChoicesError on a mask_mod reading a tensor; there
    the attention stays as written, said before Inductor compiles (simulated here on torch 2.13)."""
    monkeypatch.setattr(versions, "CPU_FLEX_LOWERS_DATA_MASKS", False)
    q, k, v, extra = inputs(requires_grad=False)
    model = AsModule(hand_document)
    with torch.no_grad():
        out = xform.compile(model, "flex-attention")(q, k, v, extra)
    torch.testing.assert_close(out, hand_document(q, k, v, extra), atol=2e-5, rtol=2e-5)
    (skip,) = xform.report(model).skips("flex-attention")
    assert "which Inductor's CPU flex kernel cannot lower in torch" in skip.reason


def test_static_block_masks_are_built_once(monkeypatch):
    import torch.nn.attention.flex_attention as flex

    built = []
    original = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: built.append(1) or original(*a, **kw))
    q, k, v, extra = inputs(requires_grad=False)
    static = xform.compile(sdpa_causal, "flex-attention", handoff="eager")
    for _ in range(4):
        static(q, k, v, extra)
    assert len(built) == 1  # at compile time only


def hand_document_computed_ids(q, k, v, extra):
    """The document mask of ids the graph computes (from per-token document starts)."""
    return hand_document(q, k, v, {"ids": extra["starts"].cumsum(-1)})


def hand_document_ids_read_elsewhere(q, k, v, extra):
    """The document mask, and the ids read by another op of the graph too."""
    return hand_document(q, k, v, extra) + extra["ids"][:, None, :, None]


def _builds(monkeypatch) -> list[int]:
    from xform.transforms.attention import BlockMaskBuild

    builds, call = [], BlockMaskBuild.__call__
    monkeypatch.setattr(BlockMaskBuild, "__call__", lambda self, *a: builds.append(1) or call(self, *a))
    return builds


def test_a_data_mask_of_the_callers_ids_is_built_before_the_call_and_reused_while_they_are_unchanged(monkeypatch):
    import torch.nn.attention.flex_attention as flex

    q, k, v, extra = inputs(requires_grad=False)
    model = AsModule(hand_document)
    compiled = xform.compile(model, "flex-attention", handoff="eager")
    compiled(q, k, v, extra)  # compiles: one build on fake tensors, one on the example ids
    builds = _builds(monkeypatch)
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: pytest.fail("built at every position"))

    def check(ids: torch.Tensor, expected_builds: int) -> None:
        out = compiled(q, k, v, {**extra, "ids": ids})
        torch.testing.assert_close(out, hand_document(q, k, v, {"ids": ids}), atol=2e-5, rtol=2e-5)
        assert len(builds) == expected_builds

    ids = extra["ids"]
    check(ids, 0)
    check(ids, 0)  # the same tensor, unchanged: the block mask of the example call
    ids[:, : S // 2] = 0  # written in place
    check(ids, 1)
    check(ids, 1)
    check(ids.clone(), 1)  # another tensor with the same values: the same block mask
    ids.data[:, S // 2:] = 1  # a write its version counter misses: seen all the same
    check(ids, 2)
    (change,) = changes(model)
    assert change.endswith("block mask built before each call, and reused while that data is unchanged, from "
                           "per-block bounds of the data it reads)")


def test_a_data_mask_of_ids_the_graph_computes_is_built_per_call_in_the_graph(monkeypatch):
    q, k, v, extra = inputs(requires_grad=False)
    extra["starts"] = torch.rand(B, S) < 0.05
    model = AsModule(hand_document_computed_ids)
    compiled = xform.compile(model, "flex-attention", handoff="eager")
    compiled(q, k, v, extra)
    builds = _builds(monkeypatch)
    for _ in range(2):
        out = compiled(q, k, v, extra)
    torch.testing.assert_close(out, hand_document_computed_ids(q, k, v, extra), atol=2e-5, rtol=2e-5)
    assert len(builds) == 2
    assert changes(model)[0].endswith("block mask built per call from per-block bounds of the data it reads)")


@pytest.mark.slow
@pytest.mark.skipif(not versions.CPU_FLEX_LOWERS_DATA_MASKS,
                    reason="torch 2.11's CPU flex kernel cannot lower a mask_mod that reads a data tensor")
def test_a_reused_block_mask_is_rebuilt_by_inductor_when_the_ids_change():
    q, k, v, extra = inputs(requires_grad=False)
    model = AsModule(hand_document)
    compiled = xform.compile(model, "flex-attention")  # Inductor
    with torch.no_grad():
        compiled(q, k, v, extra)
        for shift in (0, 1, 2):
            ids = (extra["ids"] + shift * (torch.arange(S) >= S // 3)).contiguous()
            torch.testing.assert_close(compiled(q, k, v, {**extra, "ids": ids}),
                                       hand_document(q, k, v, {"ids": ids}), atol=2e-5, rtol=2e-5)
    assert "reused while that data is unchanged" in changes(model)[0]


def test_a_transformer_block_gets_flex_attention():
    model = TransformerBlock()
    x = torch.randn(2, 16, 32)
    out = xform.compile(model, "flex-attention", handoff="eager")(x)
    torch.testing.assert_close(out, model(x), atol=2e-5, rtol=2e-5)
    assert changes(model) == ["SDPA -> flex_attention (causal; cpu; block mask built once)"]


def test_sdpa_with_dropout_is_left_with_the_reason():
    def dropped(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    q, k, v, _ = inputs(requires_grad=False)
    xform.compile(dropped, "flex-attention", handoff="eager")(q, k, v)
    (skip,) = xform.report(dropped).skips("flex-attention")
    assert skip.target.startswith("SDPA at node") and skip.reason.startswith("dropout_p=0.1: flex_attention has no dropout")


def test_hand_written_attention_with_dropout_in_training_is_left():
    def dropped(q, k, v):
        return F.dropout(torch.softmax(q @ k.transpose(-2, -1), dim=-1), p=0.2, training=True) @ v

    q, k, v, _ = inputs(requires_grad=False)
    xform.compile(dropped, "flex-attention", handoff="eager")(q, k, v)
    (skip,) = xform.report(dropped).skips("flex-attention")
    assert skip.reason == "dropout p=0.2 on the attention weights: flex_attention has no dropout"


def test_an_unknown_op_before_the_softmax_is_named():
    def odd(q, k, v):
        return torch.softmax(torch.sigmoid(q @ k.transpose(-2, -1)), dim=-1) @ v

    q, k, v, _ = inputs(requires_grad=False)
    out = xform.compile(odd, "flex-attention", handoff="eager")(q, k, v)
    (skip,) = xform.report(odd).skips("flex-attention")
    assert skip.reason == ("node 'sigmoid' (sigmoid) between QK^T and the softmax is not a scale, an additive bias, "
                           "a tanh soft-cap or a -inf mask")
    torch.testing.assert_close(out, odd(q, k, v))


@pytest.mark.parametrize("step, op", [
    (lambda s: torch.div(s, 4.0, rounding_mode="floor"), "div"),
    (lambda s: torch.add(s, torch.ones_like(s), alpha=2.0), "add"),
], ids=["rounded-division", "add-with-alpha"])
def test_a_division_that_rounds_or_an_add_with_alpha_is_no_scale_or_bias(step, op):
    def scored(q, k, v):
        return torch.softmax(step(q @ k.transpose(-2, -1)), dim=-1) @ v

    q, k, v, _ = inputs(requires_grad=False)
    out = xform.compile(scored, "flex-attention", handoff="eager")(q, k, v)
    skip = xform.report(scored).skips("flex-attention")[-1]  # reports are per code object: the last is this case's
    assert skip.reason.startswith(f"node '{op}' ({op}) between QK^T and the softmax is not a scale")
    torch.testing.assert_close(out, scored(q, k, v))


def test_a_bare_tanh_is_a_soft_cap_of_one_and_scales_after_it_stay_outside_it():
    def capped(q, k, v):  # F.tanh stays F.tanh in Dynamo's graph
        return torch.softmax(F.tanh(q @ k.transpose(-2, -1) * 0.5) * 3.0 * 2.0, dim=-1) @ v

    q, k, v, _ = inputs(requires_grad=True)
    out = xform.compile(capped, "flex-attention", handoff="eager")(q, k, v)
    assert changes(capped) == ["hand-written -> flex_attention (tanh soft-cap 6; cpu; block mask built once)"]
    torch.testing.assert_close(out, capped(q, k, v))


@pytest.mark.parametrize("under_the_tanh, said", [
    ("mask", "a mask, which the tanh turns into a bias (tanh(-inf) = -1)"),
    ("bias", "a bias"),
    ("second tanh", "another tanh"),
])
def test_a_mask_or_bias_under_the_soft_cap_is_left_with_the_reason(under_the_tanh, said):
    qi, ki = _positions()

    def capped(q, k, v):
        scores = q @ k.transpose(-2, -1)
        if under_the_tanh == "mask":
            scores = scores.masked_fill(ki > qi, float("-inf"))  # tanh(-inf) = -1: no longer masked
        elif under_the_tanh == "bias":
            scores = scores + (ki - qi) * 0.1
        else:
            scores = torch.tanh(scores)
        return torch.softmax(torch.tanh(scores / 4.0) * 4.0, dim=-1) @ v

    q, k, v, _ = inputs(requires_grad=False)
    out = xform.compile(capped, "flex-attention", handoff="eager")(q, k, v)
    skip = xform.report(capped).skips("flex-attention")[-1]  # reports are per code object: the last is this case's
    assert skip.reason.startswith("node 'tanh")  # the outer tanh, then the user's line
    assert skip.reason.endswith(f"soft-caps the scores (`c * tanh(scores / c)`) with {said} under it; flex_attention "
                                f"takes a soft-cap only with every mask and bias after it")
    assert "test_attention.py" in skip.reason
    torch.testing.assert_close(out, capped(q, k, v))


def test_weights_reshaped_before_the_product_with_v_are_named():
    def folded_heads(q, k, v):  # as Bloom and Falcon's ALiBi path write it
        probs = (q @ k.transpose(-2, -1) * D ** -0.5).softmax(-1)
        return torch.bmm(probs.view(B * H, S, S), v.reshape(B * H, S, D)).view(B, H, S, D)

    q, k, v, _ = inputs(requires_grad=False)
    torch.testing.assert_close(xform.compile(folded_heads, "flex-attention", handoff="eager")(q, k, v),
                               folded_heads(q, k, v))
    (skip,) = xform.report(folded_heads).skips("flex-attention")
    assert skip.reason == ("its attention weights reach the product with v through node 'view' (view); only "
                           "`softmax(scores) @ v` on [batch, heads, seq, seq] weights (casts or dropout between them) "
                           "is rewritten. Keep the weights 4-D up to the product with v to have it rewritten")


def test_three_dimensional_attention_is_left():
    def flat(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    x = torch.randn(4, S, D)
    xform.compile(flat, "flex-attention", handoff="eager")(x, x, x)
    (skip,) = xform.report(flat).skips("flex-attention")
    assert skip.reason.startswith("q/k/v have shapes [(4, 64, 16)")


@pytest.mark.parametrize("pattern, vary, left_because", [
    (sdpa_causal, "length", "its sequence length (s"),
    (sdpa_causal, "batch", None),  # the causal mask does not read the batch: one BlockMask serves every batch
    (hand_document, "batch", "its batch (s"),  # the ids are read per batch
], ids=["causal-length", "causal-batch", "document-batch"])
def test_dynamic_sizes_a_block_mask_needs_are_left_with_the_reason(pattern, vary, left_because):
    model = AsModule(pattern)
    step = torch.compile(model, backend=xform.Backend(["flex-attention"], handoff="eager"))
    for extra_size in (0, 8):
        batch, length = (B + extra_size, S) if vary == "batch" else (B, S + extra_size)
        q, k, v = (torch.randn(batch, H, length, D) for _ in range(3))
        extra = {"ids": torch.randint(0, 3, (batch, length)).sort(-1).values}
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 0 if vary == "batch" else 2)
        torch._dynamo.mark_dynamic(extra["ids"], 0 if vary == "batch" else 1)
        torch.testing.assert_close(step(q, k, v, extra), pattern(q, k, v, extra), atol=2e-5, rtol=2e-5)
    report = xform.report(model)
    if left_because is None:
        assert len(report.changes("flex-attention")) == 1 and report.skips("flex-attention") == []
        return
    (skip,) = report.skips("flex-attention")
    assert skip.reason.startswith(left_because), skip.reason
    assert "dynamic, and a BlockMask is built for fixed sizes; left as written. Compile with dynamic=False (a " \
           "graph per size), or mark those dims static" in skip.reason


def hand_finite_padding(q, k, v, extra):
    """Causal + padding, masked with a finite fill, as Hugging Face's eager attention writes it."""
    qi, ki = _positions()
    allowed = (ki <= qi) & extra["keep"][:, None, None, :]
    scores = q @ k.transpose(-2, -1) * D ** -0.5 + torch.where(allowed, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
    return scores.softmax(-1) @ v


def hand_finite_strictly_causal(q, k, v, extra):
    """A finite fill whose first row is masked everywhere (each query attends only to earlier keys)."""
    qi, ki = _positions()
    scores = (q @ k.transpose(-2, -1)).masked_fill(ki >= qi, -1e9)
    return scores.softmax(-1) @ v


def finite_padding_inputs(requires_grad: bool) -> tuple:
    q, k, v, extra = inputs(requires_grad=requires_grad)
    extra["keep"] = torch.ones(B, S, dtype=torch.bool)
    extra["keep"][1, :5] = False  # left padding: rows 0-4 of sequence 1 are masked everywhere
    return q, k, v, extra


def left_as_written(pattern, q, k, v, extra) -> str:
    """`pattern` compiled with flex-attention (handoff eager) computes what it computes as written,
    and its one attention is left as written: the reason."""
    model = AsModule(pattern)
    out = xform.compile(model, "flex-attention", handoff="eager")(q, k, v, extra)
    torch.testing.assert_close(out, pattern(q, k, v, extra))
    (skip,) = xform.report(model).skips("flex-attention")
    return skip.reason


def test_a_finite_fill_read_from_data_is_added_as_written_so_a_row_it_masks_everywhere_stays_even():
    """Hugging Face's eager attention at inference: the finite mask is added to the scores as the model
    does, so a left-padded row, masked everywhere, attends evenly to every position as written."""
    q, k, v, extra = finite_padding_inputs(requires_grad=False)
    model = AsModule(hand_finite_padding)
    out = xform.compile(model, "flex-attention", handoff="eager")(q, k, v, extra)
    expected = hand_finite_padding(q, k, v, extra)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out[1, :, :5], v[1].mean(-2, keepdim=True).expand(H, 5, D))  # rows 0-4: even
    (change,) = xform.report(model).changes("flex-attention")
    assert change.detail.startswith("-> flex_attention (additive bias; cpu;"), change.detail
    assert xform.report(model).skips("flex-attention") == []


def test_an_fp16_finite_fill_read_from_data_is_left_with_the_reason():
    """fp16's finfo.min (-65504) is no fill flex can add as written and keep a masked row even (the
    model adds it in fp16, where it rounds): it stays a mask, and a row it can mask everywhere is left."""
    q, k, v, extra = finite_padding_inputs(requires_grad=False)
    reason = left_as_written(hand_finite_padding, q.half(), k.half(), v.half(), extra)
    assert reason.startswith("its mask fills masked scores with -6.55e+04, not -inf, so on a row masked at every "
                             "position the model as written attends evenly to all of them"), reason


def test_a_finite_fill_read_from_data_is_left_in_training_with_the_reason():
    reason = left_as_written(hand_finite_padding, *finite_padding_inputs(requires_grad=True))
    assert reason.startswith("it adds to the scores a tensor it reads per query or key (node 'l_args_3_keep_' "
                             "(test_attention.py:"), reason
    assert reason.endswith("so it is left as written in training (rewritten at inference). Pass a boolean mask and "
                           "mask with masked_fill(~mask, float('-inf')) (for a Hugging Face model: "
                           "attn_implementation='sdpa', which xform rewrites)"), reason


def test_a_finite_fill_that_masks_a_whole_row_by_position_is_left_with_the_reason():
    reason = left_as_written(hand_finite_strictly_causal, *inputs(requires_grad=True))  # row 0 attends evenly
    assert reason == ("its mask fills masked scores with -1e+09, not -inf, so on a row masked at every position the "
                      "model as written attends evenly to all of them, where flex_attention attends to none, and its "
                      "row 0 is masked everywhere; left as written. Fill with float('-inf') (for a Hugging Face model "
                      "that offers it: attn_implementation='sdpa', which xform rewrites exactly)")


def sdpa_finite_key_padding(q, k, v, extra):
    """An encoder's padding mask (keys only, no causal part) with a finite fill, given to SDPA."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.where(extra["keep"][:, None, None, :], 0.0, torch.finfo(q.dtype).min))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
def test_a_finite_key_padding_mask_given_to_sdpa_is_added_as_sdpa_adds_it(requires_grad):
    """SDPA adds a float mask to the scores; so does flex_attention's score_mod, in training too (both
    recompute the probabilities from the log-sum-exp in their backward)."""
    q, k, v, extra = finite_padding_inputs(requires_grad)
    model = AsModule(sdpa_finite_key_padding)
    out = xform.compile(model, "flex-attention", handoff="eager")(q, k, v, extra)
    expected = sdpa_finite_key_padding(q, k, v, extra)
    torch.testing.assert_close(out, expected)
    if requires_grad:
        for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(expected.sum(), (q, k, v))):
            torch.testing.assert_close(got, want)
    (change,) = xform.report(model).changes("flex-attention")
    assert change.detail.startswith("-> flex_attention (additive bias; cpu;"), change.detail


def _padded_float_mask(fill: float) -> torch.Tensor:
    """A 4-D float mask as Hugging Face builds one: causal, sequence 1 left-padded by 5 (its rows 0-4
    masked everywhere), `fill` where it masks."""
    qi, ki = _positions()
    allowed = (qi >= ki).expand(B, 1, S, S).clone()
    allowed[1, :, :5, :] = False
    allowed[1, :, 5:, :5] = False
    return torch.zeros(B, 1, S, S).masked_fill(~allowed, fill)


def _query_padding_mask(fill: float) -> torch.Tensor:
    """A float mask over queries only ([B, 1, S, 1]): sequence 1's rows 0-4 masked everywhere."""
    allowed = torch.ones(B, 1, S, 1, dtype=torch.bool)
    allowed[1, :, :5] = False
    return torch.zeros(B, 1, S, 1).masked_fill(~allowed, fill)


@pytest.mark.parametrize("mask", [_padded_float_mask, _query_padding_mask], ids=["4-D", "per-query"])
@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, float("-inf")], ids=["finfo.min", "-inf"])
def test_sdpa_given_a_float_mask_with_rows_masked_everywhere_keeps_its_outputs_and_gradients(fill, mask):
    """The float mask is an additive bias. On the rows it masks everywhere, flex's backward overflowed
    on finfo.min and gave gradients unlike SDPA's (1 dB); raised to -1e30 it gives SDPA's."""
    q, k, v, extra = inputs(requires_grad=True)
    extra["dense"] = mask(fill)
    out = xform.compile(sdpa_dense_mask, "flex-attention", handoff="eager")(q, k, v, extra)
    expected = sdpa_dense_mask(q, k, v, extra)
    assert changes(sdpa_dense_mask)[-1].startswith("SDPA -> flex_attention (additive bias")
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    weights = torch.linspace(-1, 1, D)  # a loss whose gradient differs across positions
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"gradient of {name}")


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_hand_written_attention_adding_a_float_mask_it_is_given_is_left_in_training(training):
    """Written out, the softmax of a row masked everywhere by finfo.min has exact gradients (even
    attention), which flex's backward cannot give: left as written in training, with the reason;
    at inference the outputs are the same, and it is rewritten."""
    q, k, v, extra = inputs(requires_grad=training)
    extra["dense"] = _padded_float_mask(torch.finfo(torch.float32).min)
    model = AsModule(hand_dense_bias)
    out = xform.compile(model, "flex-attention", handoff="eager")(q, k, v, extra)
    torch.testing.assert_close(out, hand_dense_bias(q, k, v, extra), atol=2e-5, rtol=2e-5)
    report = xform.report(model)
    if not training:
        assert [c.detail for c in report.changes("flex-attention")][0].startswith("-> flex_attention (additive bias")
        return
    (skip,) = report.skips("flex-attention")
    assert skip.reason.startswith("it adds to the scores a tensor it reads per query or key (node '"), skip.reason
    assert ("which may be a float mask filled with finfo.min (as Hugging Face builds one); on a row such a mask masks "
            "everywhere (left padding) the model as written has gradients flex_attention's backward cannot give, so it "
            "is left as written in training (rewritten at inference)") in skip.reason
    assert skip.reason.endswith("(for a Hugging Face model: attn_implementation='sdpa', which xform rewrites)")


def test_cpu_training_under_inductor_is_left_with_the_reason():
    q, k, v, extra = inputs(requires_grad=True)
    out = xform.compile(sdpa_causal, "flex-attention")(q, k, v, extra)
    (skip,) = xform.report(sdpa_causal).skips("flex-attention")
    assert "flex_attention has no CPU backward" in skip.reason and "handoff='eager'" in skip.reason
    out.sum().backward()


@pytest.mark.slow
def test_cpu_inductor_leaves_a_mask_computed_in_the_graph_with_the_reason():
    q, k, v, extra = inputs(requires_grad=False)
    with torch.no_grad():
        out = xform.compile(hand_hf_eager, "flex-attention")(q, k, v, extra)
        torch.testing.assert_close(out, hand_hf_eager(q, k, v, extra))
    (skip,) = xform.report(hand_hf_eager).skips("flex-attention")
    assert skip.reason.startswith("its mask or bias reads node 'tensor' (test_attention.py:")
    assert ("in hand_hf_eager: bias = torch.where(allowed, torch.tensor(0.0), torch.finfo(q.dtype).min)), a tensor "
            "computed in the graph, which Inductor's CPU flex kernel cannot take (torch ") in skip.reason
    assert skip.reason.endswith("left as written. With handoff='eager' it is rewritten; the CUDA lowering realizes "
                                "them first")


def test_backend_option():
    assert FlexAttention.from_spec("triton").backend == "triton"
    with pytest.raises(ValueError, match=r"transform 'flex-attention': option backend='cudnn' is not accepted; "
                                         r"accepted: auto, flash, triton"):
        xform.Backend(["flex-attention:cudnn"])


def test_flash_on_cpu_is_a_clear_error():
    q, k, v, extra = inputs(requires_grad=False)
    with pytest.raises(Exception, match=r"backend='flash' needs a CUDA GPU; SDPA at node '.*' runs on cpu"):
        xform.compile(sdpa_causal, FlexAttention("flash"), handoff="eager")(q, k, v, extra)


def test_graphs_without_attention_are_untouched():
    def mlp(x):
        return torch.softmax(x @ x.transpose(-2, -1), dim=-1).sum(-1)  # a softmax, but no @ v after it

    x = torch.randn(2, 8, 8)
    xform.compile(mlp, "flex-attention", handoff="eager")(x)
    assert xform.report(mlp).changes("flex-attention") == [] and xform.report(mlp).skips("flex-attention") == []


def test_regression_in_place_ops_outside_the_attention_survive_the_rewrite():
    """Corpus seed 40: FX's dead-code pass, run after the rewrite, dropped an unused in-place
    `y.mul_(0.5)` elsewhere in the graph (torch-level calls look pure to it): a silent wrong answer."""
    def model(x, q, k, v):
        y = x.clone()
        y.mul_(0.5)
        return y + F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    x = torch.randn(4)
    q, k, v, _ = inputs(requires_grad=False)
    torch.testing.assert_close(xform.compile(model, "flex-attention", handoff="eager")(x, q, k, v), model(x, q, k, v))


@pytest.mark.parametrize("pattern, refused_because", [
    (hand_document, None),
    (hand_document_computed_ids, ("its block mask is built in the graph from that data, which node 'ids' "
                                  "(test_attention.py:", " in hand_document_computed_ids: return hand_document(q, k, "
                                  "v, {\"ids\": extra[\"starts\"].cumsum(-1)})) computes;")),
    (hand_document_ids_read_elsewhere, ("the graph also reads that data at node 'getitem_4' (test_attention.py:",
                                        " in hand_document_ids_read_elsewhere: return hand_document(q, k, v, extra) "
                                        "+ extra[\"ids\"][:, None, :, None])")),
    (sdpa_dense_mask, ("its block mask is built in the graph from that data (only a document mask of ids you pass "
                       "is built before the call);",)),
], ids=["ids-only-the-mask-reads", "ids-computed", "ids-read-elsewhere", "dense-mask"])
@pytest.mark.parametrize("requires_grad, training", [(False, False), (True, False), (True, True)])
def test_a_data_mask_without_a_backward_is_left_under_inductor_on_cuda_where_other_ops_read_its_data(
        monkeypatch, pattern, refused_because, requires_grad, training):
    """On the H200 with torch 2.11, flex inference with a block mask built in the graph from the
    ids the mask_mod also reads crashed (Triton: illegal memory access; Flash: UnboundLocalError,
    pytorch#181800): under Inductor on CUDA such a site stays as written unless the graph has a
    backward, or the ids are an input only the mask reads (the block mask is then built before the
    call, as by hand). The CUDA rule is applied here on the CPU, in the place of the CPU's own."""
    import xform.transforms.attention.transform as attention
    from xform.transforms.attention.refusals import inductor_cuda_refusal

    monkeypatch.setattr(attention.FlexAttention, "_device_refusal",
                        lambda self, site, graph, replaced: inductor_cuda_refusal(site, graph, replaced))
    q, k, v, extra = inputs(requires_grad)  # leaves needing a gradient, called under no_grad: no backward
    extra["starts"] = torch.rand(B, S) < 0.05
    model = AsModule(pattern)  # a module of its own: a function's report gathers every compile of it
    with torch.set_grad_enabled(training):
        out = xform.compile(model, "flex-attention", handoff="eager")(q, k, v, extra)
        torch.testing.assert_close(out, pattern(q, k, v, extra), atol=2e-5, rtol=2e-5)
    report = xform.report(model)
    if training or refused_because is None:
        assert len(report.changes("flex-attention")) == 1 and report.skips("flex-attention") == []
    else:
        (skip,) = report.skips("flex-attention")
        assert all(part in skip.reason for part in refused_because), skip.reason
        assert "in a graph with no backward Inductor's flex lowering does not keep that data alive" in skip.reason
        assert "illegal memory access" in skip.reason and "pass document ids as an input" in skip.reason


def test_a_bias_the_graph_computes_without_a_backward_is_left_under_inductor_on_cuda(monkeypatch):
    """Hugging Face's eager attention at inference adds a mask the graph computes: the CUDA rule
    (applied here on the CPU) leaves it as written until a score_mod's data is checked on a GPU."""
    import xform.transforms.attention.transform as attention
    from xform.transforms.attention.refusals import inductor_cuda_refusal

    monkeypatch.setattr(attention.FlexAttention, "_device_refusal",
                        lambda self, site, graph, replaced: inductor_cuda_refusal(site, graph, replaced))
    def computed_padding(q, k, v, extra):  # the padding computed in the graph, as HF's mask functions do
        return hand_finite_padding(q, k, v, {"keep": extra["keep"].cumsum(-1) > 0})

    reason = left_as_written(computed_padding, *finite_padding_inputs(requires_grad=False))
    assert reason.startswith("it adds to the scores a tensor the graph computes (node '"), reason
    assert reason.endswith("for a score_mod's data this is not yet checked on a GPU, so it is left as written. "
                           "With handoff='eager' it is rewritten"), reason


def test_flash_that_does_not_import_is_named_with_its_error(monkeypatch):
    # FA4 present but its CuTeDSL missing passes torch's own check (it finds the package) and then
    # failed inside Inductor's compile; xform tries the import and says what broke
    import sys
    import types

    import torch._inductor.kernel.flex.flex_flash_attention as flex_flash
    from xform.transforms.attention import flash_import_error

    monkeypatch.setattr(flex_flash, "ensure_flash_available", lambda: True, raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # `import flash_attn.cute` raises ImportError
    flash_import_error.cache_clear()
    try:
        assert flash_import_error().startswith("FlashAttention-4 does not import: ModuleNotFoundError")
        assert flash_import_error().endswith("(pip install flash-attn-4 and nvidia-cutlass-dsl)")
    finally:
        flash_import_error.cache_clear()


def test_auto_on_a_gpu_without_flash_says_why_it_took_triton():
    # traced with a fake CUDA tensor: the choice is made from the graph's example values, so no GPU is needed
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from xform.transforms.attention import flash_import_error
    from xform.transforms.attention.match import AttentionSite

    with FakeTensorMode():
        q = torch.empty(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16)
    node = fx.Graph().placeholder("q")
    node.meta["example_value"] = q
    site = AttentionSite(node, "SDPA", node, node, node)
    missing = flash_import_error()
    if missing is None:
        pytest.skip("FlashAttention-4 imports here: auto takes Flash")
    assert FlexAttention("auto")._backend_for(site) == ("triton", missing)
    assert FlexAttention("triton")._backend_for(site) == ("triton", None)  # asked for: nothing to explain
    with pytest.raises(ValueError, match=r"backend='flash' cannot run SDPA at node 'q': FlashAttention-4 "):
        FlexAttention("flash")._backend_for(site)


def sdpa_with_mask(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _sdpa_sites(fn, *args) -> list:
    """The SDPA sites Dynamo's graph of `fn(*args)` holds, as the transform finds them."""
    from xform.transforms.attention.match import match_sdpa

    sites: list = []

    def collect(gm, example_inputs):
        sites.extend(site for node in gm.graph.nodes if (site := match_sdpa(node)) is not None)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=collect)(*args)
    return sites


def test_flash_is_not_taken_for_tensors_its_mods_read_wrong():
    # measured on the H100: a float mask added per query and key gave NaN with Flash, and a tensor read
    # along a broadcast dim (Hugging Face's [B, 1, Q, KV]) did not compile: auto takes Triton, and says why
    from xform.transforms.attention.refusals import _flash_unsafe_read

    q = torch.randn(2, 4, 64, 16)
    for bias in (torch.zeros(2, 1, 64, 64), torch.zeros(2, 4, 64, 64)):
        (site,) = _sdpa_sites(sdpa_with_mask, q, q, q, bias)
        why = _flash_unsafe_read(site)
        assert why.startswith("its bias reads node '") and "per query or key, which Flash's score_mod computed " \
            "wrong (NaN outputs on the H100" in why and why.endswith("Triton's is right")
    (site,) = _sdpa_sites(sdpa_with_mask, q, q, q, torch.ones(2, 1, 64, 64, dtype=torch.bool))
    why = _flash_unsafe_read(site)
    assert why.startswith("its mask reads node '") and "of shape [2, 1, 64, 64], along a broadcast dim of size 1, " \
        "which Inductor's Flash lowering of the mods cannot index" in why
    (site,) = _sdpa_sites(sdpa_with_mask, q, q, q, torch.zeros(1, 4, 1, 1))  # per-head, broadcast over positions
    assert _flash_unsafe_read(site).startswith("its bias reads node '")
    assert "of shape [1, 4, 1, 1], along a broadcast dim" in _flash_unsafe_read(site)
    (site,) = _sdpa_sites(sdpa_with_mask, q, q, q, torch.ones(64, 64, dtype=torch.bool))
    assert _flash_unsafe_read(site) is None  # right-aligned [Q, KV]: nothing broadcast
