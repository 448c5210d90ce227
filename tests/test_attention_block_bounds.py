"""Block masks of masks that read data (document ids, a bool mask), built on every call from
per-block bounds instead of at every position: never 'full' where a position is masked, never left
out where one is allowed, exact where the ids are packed documents; one build per graph call for
the attentions that share a mask; the fallback to create_block_mask where the bounds cannot go."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.attention.flex_attention import create_mask

import xform
from xform.transforms.attention import BLOCK, BlockMaskBuild

H, D = 2, 8


def _positions(q):
    pos = torch.arange(q.shape[-2])
    return pos[:, None], pos[None, :]


def _same(ids):
    return ids[:, None, :, None] == ids[:, None, None, :]


def doc_causal(q, k, v, ids):
    qi, ki = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_same(ids) & (qi >= ki))


def doc_only(q, k, v, ids):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_same(ids))


def doc_sliding_hand_written(q, k, v, ids):
    qi, ki = _positions(q)
    scores = q @ k.transpose(-2, -1) * D ** -0.5
    keep = _same(ids) & (qi >= ki) & (qi - ki < 100)
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def doc_or_prefix(q, k, v, ids):
    qi, ki = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_same(ids) | (ki < 70))


def doc_chunked(q, k, v, ids):
    qi, ki = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_same(ids) & (qi // 64 == ki // 64), is_causal=True)


def doc_padding(q, k, v, ids):
    qi, ki = _positions(q)
    not_pad = (ids != 0)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_same(ids) & not_pad & (qi >= ki))


def ids_greater(q, k, v, ids):
    qi, ki = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(ids[:, None, :, None] > ids[:, None, None, :] + 1)
                                          | (qi == ki))


def dense_input(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _dense_mask(ids: torch.Tensor) -> torch.Tensor:
    """A [B, 1, S, S] bool mask handed in whole: documents, causal, and a few holes."""
    seq = ids.shape[-1]
    holes = torch.rand(ids.shape[0], 1, seq, seq, generator=torch.Generator().manual_seed(seq)) < 0.001
    return (_same(ids) & torch.ones(seq, seq, dtype=torch.bool).tril() & ~holes) | torch.eye(seq, dtype=torch.bool)


MASKS = [doc_causal, doc_only, doc_sliding_hand_written, doc_or_prefix, doc_chunked, doc_padding]


def _ids(kind: str, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seq * 31 + batch + len(kind))
    if kind == "packed":  # sorted: documents of random lengths, back to back
        starts = torch.rand(batch, seq, generator=g) < 1 / 90
        return starts.long().cumsum(-1)
    if kind == "packed-long":
        return (torch.rand(batch, seq, generator=g) < 1 / 400).long().cumsum(-1)
    if kind == "unsorted":
        return torch.randint(0, 4, (batch, seq), generator=g)
    if kind == "unsorted-runs":  # documents in runs, ids in no order
        runs = (torch.rand(batch, seq, generator=g) < 1 / 60).long().cumsum(-1)
        return torch.randperm(seq, generator=g)[runs]
    if kind == "one":
        return torch.full((batch, seq), 7)
    return torch.arange(seq).expand(batch, seq).contiguous()  # every token its own document


def _built(monkeypatch, fn, q, k, v, ids):
    """Run `fn` rewritten (eager handoff); the BlockMaskBuild it ran and the tensors it read."""
    calls = []
    call = BlockMaskBuild.__call__

    def recording(self, *buffers):
        if not any(isinstance(b, FakeTensor) for b in buffers):
            calls.append((self, buffers))
        return call(self, *buffers)

    monkeypatch.setattr(BlockMaskBuild, "__call__", recording)
    with torch.no_grad():
        out = xform.compile(fn, "flex-attention", handoff="eager")(q, k, v, ids)
    return out, calls


def _dense(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[B, H, q-blocks, kv-blocks] bool from a BlockMask's (num_blocks, indices)."""
    listed = torch.arange(indices.shape[-1]) < num_blocks[..., None]
    return torch.zeros(indices.shape, dtype=torch.bool).scatter_(-1, indices.long(), listed)


def _exact_blocks(build: BlockMaskBuild, buffers) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, any) of each block, from the mask at every position, as create_block_mask counts them."""
    block_mask = build.block_mask(*buffers)
    allowed = create_mask(block_mask.mask_mod, *build.sizes, device="cpu")
    q_len, kv_len = allowed.shape[-2:]
    padded = F.pad(allowed, (0, -kv_len % BLOCK, 0, -q_len % BLOCK))  # positions past the end: masked
    b, h, q, kv = padded.shape
    count = padded.reshape(b, h, q // BLOCK, BLOCK, kv // BLOCK, BLOCK).sum((3, 5))
    return count == BLOCK * BLOCK, count > 0


@pytest.mark.parametrize("seq", [pytest.param(77, marks=pytest.mark.slow), pytest.param(256, marks=pytest.mark.slow),
                                 300, pytest.param(520, marks=pytest.mark.slow)])  # 300: a partial last block
@pytest.mark.parametrize("kind", ["packed", "packed-long", "unsorted", "unsorted-runs", "one", "distinct"])
def test_block_classes_are_never_wrong_and_exact_for_packed_documents(monkeypatch, kind, seq):
    batch = 3
    q = k = v = torch.randn(batch, H, seq, D)
    ids = _ids(kind, batch, seq)
    for fn in MASKS + [ids_greater, dense_input]:
        data = _dense_mask(ids) if fn is dense_input else ids
        out, calls = _built(monkeypatch, fn, q, k, v, data)
        (build, buffers), = calls
        assert build.fallback is None, build.fallback
        block_mask = build.block_mask(*buffers)
        full = _dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        partial = _dense(block_mask.kv_num_blocks, block_mask.kv_indices)
        exact_full, exact_any = _exact_blocks(build, buffers)
        full, partial = full.expand_as(exact_full), partial.expand_as(exact_full)
        where = f"{fn.__name__}, {kind} ids, S={seq}"
        assert not (full & partial).any(), where
        assert not (full & ~exact_full).any(), f"{where}: a block marked full holds a masked position"
        assert not (exact_any & ~(full | partial)).any(), f"{where}: a block left out holds an allowed position"
        sorted_ids = kind not in ("unsorted", "unsorted-runs")
        if fn in (ids_greater, dense_input) or (fn in (doc_causal, doc_only) and sorted_ids):
            assert torch.equal(full, exact_full) and torch.equal(full | partial, exact_any), f"{where}: not exact"
        torch.testing.assert_close(out, fn(q, k, v, data).nan_to_num(0.0), atol=2e-5, rtol=2e-5)


def test_bounds_are_exact_for_a_sliding_window_on_packed_documents(monkeypatch):
    q = k = v = torch.randn(2, H, 1024, D)
    ids = _ids("packed-long", 2, 1024)
    _, ((build, buffers),) = _built(monkeypatch, doc_sliding_hand_written, q, k, v, ids)
    block_mask = build.block_mask(*buffers)
    exact_full, exact_any = _exact_blocks(build, buffers)
    full = _dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    partial = _dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    assert torch.equal(full, exact_full) and torch.equal(full | partial, exact_any)
    assert int(exact_any.sum()) < exact_any.numel() / 4  # the block mask does skip blocks


@pytest.mark.slow
@pytest.mark.parametrize("fn,kind,seq", [
    (doc_causal, "packed", 300), (doc_causal, "unsorted-runs", 256), (doc_sliding_hand_written, "packed", 520),
    (doc_padding, "unsorted", 200),
], ids=lambda p: getattr(p, "__name__", str(p)))
def test_inductor_cpu_kernel_with_the_bounded_block_mask_matches_the_model_as_written(fn, kind, seq):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, H, seq, D) for _ in range(3))
    ids = _ids(kind, 2, seq)
    with torch.no_grad():
        out = xform.compile(fn, "flex-attention")(q, k, v, ids)
        again = _ids("unsorted", 2, seq)  # new ids, same graph: the block mask follows them
        out_again = xform.compile(fn, "flex-attention")(q, k, v, again)
        torch.testing.assert_close(out, fn(q, k, v, ids).nan_to_num(0.0), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out_again, fn(q, k, v, again).nan_to_num(0.0), atol=2e-5, rtol=2e-5)
    assert xform.report(fn).changes("flex-attention")[0].detail.endswith("per-block bounds of the data it reads)")


@pytest.mark.slow
def test_the_cpu_kernel_reads_the_block_mask(monkeypatch):
    """Not vacuous: with every block marked full (the mask_mod skipped), the output is wrong."""
    from xform.transforms.attention import block_masks as attention

    def all_full(masks, buffers, sizes, device, mask_mod):
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(lambda b, h, q, kv: q >= 0, *sizes, device="cpu")

    monkeypatch.setattr(attention, "_bounded_block_mask", all_full)
    q, k, v = (torch.randn(2, H, 256, D) for _ in range(3))
    ids = _ids("packed", 2, 256)
    with torch.no_grad():
        out = xform.compile(doc_causal, "flex-attention")(q, k, v, ids)
    assert not torch.allclose(out, doc_causal(q, k, v, ids), atol=1e-3)


def three_layers(q, k, v, ids):
    for _ in range(3):
        q = doc_causal(q, k, v, ids)
    return q


def two_windows(q, k, v, ids):
    qi, ki = _positions(q)
    same = _same(ids)
    q = F.scaled_dot_product_attention(q, k, v, attn_mask=same & (qi >= ki) & (qi - ki < 16))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & (qi >= ki) & (qi - ki < 32))


def test_attentions_with_the_same_mask_share_one_build_per_call(monkeypatch):
    q = k = v = torch.randn(2, H, 256, D)
    ids = _ids("packed", 2, 256)
    out, calls = _built(monkeypatch, three_layers, q, k, v, ids)
    assert len(calls) == 1  # one build for the three attentions
    torch.testing.assert_close(out, three_layers(q, k, v, ids), atol=2e-5, rtol=2e-5)
    details = [c.detail for c in xform.report(three_layers).changes("flex-attention")]
    assert len(details) == 3 and details[0].endswith("per-block bounds of the data it reads)")
    assert all(", shared with SDPA at node" in d for d in details[1:]), details

    out, calls = _built(monkeypatch, two_windows, q, k, v, ids)
    assert len(calls) == 2  # different masks: a build each
    torch.testing.assert_close(out, two_windows(q, k, v, ids), atol=2e-5, rtol=2e-5)


def test_static_masks_of_several_attentions_share_one_block_mask(monkeypatch):
    import torch.nn.attention.flex_attention as flex

    def causal_layers(q, k, v):
        for _ in range(3):
            q = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return q

    built = []
    original = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: built.append(1) or original(*a, **kw))
    q = k = v = torch.randn(2, H, 256, D)
    out = xform.compile(causal_layers, "flex-attention", handoff="eager")(q, k, v)
    torch.testing.assert_close(out, causal_layers(q, k, v), atol=2e-5, rtol=2e-5)
    assert len(built) == 1
    details = [c.detail for c in xform.report(causal_layers).changes("flex-attention")]
    assert details[0].endswith("block mask built once)") and "shared with" in details[2]


def mod_ids(q, k, v, ids):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_same(ids % 3), is_causal=True)


def float_mask(q, k, v, ids):
    weight = ids.float().cumsum(-1)  # a float tensor the mask reads (cumsum: not looked into)
    keep = (weight[:, None, :, None] >= weight[:, None, None, :] * 0.5) | torch.eye(q.shape[-2], dtype=torch.bool)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("fn,why,when,builds_a_call", [
    (mod_ids, "the op 'mod'", "built before each call, and reused while that data is unchanged,", 0),  # the ids passed
    (float_mask, "a torch.float32 tensor, whose NaNs min/max cannot bound", "built per call", 1),  # computed
], ids=["mod", "float"])
def test_what_the_bounds_cannot_take_is_built_at_every_position(monkeypatch, fn, why, when, builds_a_call):
    import torch.nn.attention.flex_attention as flex

    built = []
    original = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: built.append(1) or original(*a, **kw))
    q = k = v = torch.randn(2, H, 200, D)
    ids = _ids("unsorted", 2, 200)
    compiled = xform.compile(fn, "flex-attention", handoff="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v, ids), fn(q, k, v, ids).nan_to_num(0.0), atol=2e-5, rtol=2e-5)
        built.clear()
        compiled(q, k, v, ids)
    assert len(built) == builds_a_call
    (detail,) = [c.detail for c in xform.report(fn).changes("flex-attention")]
    assert detail.endswith(f"block mask {when} from the data it reads, at every position "
                           f"(per-block bounds cannot take {why}))"), detail
