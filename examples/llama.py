"""The small llama the examples train and decode: RMSNorm, rotary embeddings, SwiGLU, grouped-query
attention through SDPA. `Llama` takes whole sequences (training); `DecodeLlama` one token a step
over a static KV cache held in buffers (decoding). The benchmarks time the same models
(bench/models.py imports them from here), so the examples' figures and the benchmarks' compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 16
    heads: int = 16
    kv_heads: int = 16
    hidden: int = 5632
    max_seq: int = 1024


def rotary_tables(c: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [max_seq, head_dim / 2]."""
    head_dim = c.dim // c.heads
    freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(c.max_seq).float(), freqs)
    return angles.cos(), angles.sin()


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(c.dim, 2 * c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(c.dim), nn.RMSNorm(c.dim)
        self.attention, self.feed_forward = Attention(c), FeedForward(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """`graph_breaks`: a graph break after every layer (a print, a logging call, an unsupported op)."""

    def __init__(self, c: LlamaConfig, graph_breaks: bool = False) -> None:
        super().__init__()
        self.config, self.graph_breaks = c, graph_breaks
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        cos, sin = rotary_tables(c)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
            if self.graph_breaks:
                torch._dynamo.graph_break()
        return self.output(self.norm(x))


class CachedAttention(nn.Module):
    """Attention for one decode step, over a static KV cache held as buffers (written in place)."""

    def __init__(self, c: LlamaConfig, batch: int) -> None:
        super().__init__()
        self.heads, self.head_dim = c.heads, c.dim // c.heads
        self.wqkv = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        shape = (batch, c.heads, c.max_seq, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class DecodeLayer(nn.Module):
    def __init__(self, c: LlamaConfig, batch: int, host_sync: bool) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(c.dim), nn.RMSNorm(c.dim)
        self.attention, self.feed_forward = CachedAttention(c, batch), FeedForward(c)
        self.host_sync = host_sync

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), pos, cos, sin, mask)
        x = x + self.feed_forward(self.ffn_norm(x))
        if self.host_sync and bool(x.isnan().any().item()):  # a check many models do: waits for the GPU
            raise FloatingPointError("NaN in the hidden state")
        return x


class DecodeLlama(nn.Module):
    """The llama-style decoder for token-by-token decoding: `forward(tokens [B, 1], pos [1])` -> logits."""

    def __init__(self, c: LlamaConfig, batch: int, host_sync: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(DecodeLayer(c, batch, host_sync) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        cos, sin = rotary_tables(c)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("positions", torch.arange(c.max_seq), persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[pos], self.sin[pos]
        # expanded to the batch (a view): ThunderFX's SDPA refuses a mask that broadcasts over it
        # ("grad_forward_sdpa: Expected all inputs to have same batch_size", lightning-thunder 0.2.6)
        mask = (self.positions <= pos)[None, None, None, :].expand(tokens.shape[0], 1, 1, -1)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        return self.output(self.norm(x))
