"""Small models the tests compile: the layer kinds real models are made of, at toy sizes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mlp(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP block, attention through SDPA."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TiedLM(nn.Module):
    """Embedding and output head share one weight, as in GPT-2."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


class GraphBreakMLP(nn.Module):
    """Two Linear layers with a graph break (a print) between them."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(x)


class AsModule(nn.Module):
    """A function as a module: what xform.report keeps a module's records by (a function's are kept
    by its code object, so they gather every compile of it)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)
