"""A seeded generator of small models made of the ops real models use, for the randomized tests.

`random_model(seed)` gives the same model for the same seed: a stack of 2 to 6 blocks over a
[batch, seq, dim] activation, each block one of the kinds below. A failing seed is a regression
test waiting to be written: `random_model(seed)` rebuilds it exactly.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, SEQ, BATCH = 32, 4, 16, 2

KINDS = ["linear", "mlp", "norm", "activation", "attention_sdpa", "attention_by_hand", "conv", "views",
         "in_place", "buffer", "graph_break", "item", "control_flow"]


class Block(nn.Module):
    def __init__(self, kind: str, rng: random.Random) -> None:
        super().__init__()
        self.kind = kind
        self.options = {}
        if kind == "linear":
            self.fc = nn.Linear(DIM, DIM, bias=rng.random() < 0.5)
        elif kind == "mlp":
            self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
            self.options["act"] = rng.choice(["gelu", "silu", "relu", "tanh"])
        elif kind == "norm":
            self.norm = nn.LayerNorm(DIM) if rng.random() < 0.5 else nn.RMSNorm(DIM)
        elif kind == "activation":
            self.options["act"] = rng.choice(["gelu", "silu", "relu", "tanh", "sigmoid"])
        elif kind in ("attention_sdpa", "attention_by_hand"):
            self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
            self.options["mask"] = rng.choice(["none", "causal", "window", "bias"])
        elif kind == "conv":
            self.conv = nn.Conv1d(DIM, DIM, 3, padding=1)
        elif kind == "buffer":
            self.register_buffer("shift", torch.randn(DIM) * 0.1)
        self.options["residual"] = rng.random() < 0.6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.compute(x)
        return x + y if self.options["residual"] else y

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k == "linear":
            return self.fc(x)
        if k == "mlp":
            return self.down(_act(self.options["act"], self.up(x)))
        if k == "norm":
            return self.norm(x)
        if k == "activation":
            return _act(self.options["act"], x)
        if k in ("attention_sdpa", "attention_by_hand"):
            return self.out(self.attend(x))
        if k == "conv":
            return self.conv(x.transpose(1, 2)).transpose(1, 2)
        if k == "views":
            b, s, d = x.shape
            return x.view(b, s, HEADS, d // HEADS).transpose(1, 2).reshape(b, HEADS, s, -1).transpose(1, 2).reshape(b, s, d)
        if k == "in_place":
            y = x.clone()
            y.mul_(0.5).add_(1.0)
            return y
        if k == "buffer":
            return x + self.shift
        if k == "graph_break":
            torch._dynamo.graph_break()
            return x * 0.9
        if k == "item":
            return x * (1.0 + 0.0 * x.mean().item())
        if k == "control_flow":
            return x * 0.5 if x.sum() > 0 else x * 2.0
        raise AssertionError(k)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s, device=x.device)
        mask = self.options["mask"]
        keep = None if mask in ("none", "bias") else (pos[:, None] >= pos[None, :])
        if mask == "window":
            keep = keep & (pos[:, None] - pos[None, :] < 4)
        if self.kind == "attention_sdpa":
            if mask == "bias":
                bias = -0.1 * (pos[:, None] - pos[None, :]).abs().float()
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            elif mask == "causal":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // HEADS)
            if mask == "bias":
                scores = scores - 0.1 * (pos[:, None] - pos[None, :]).abs().float()
            elif keep is not None:
                scores = scores.masked_fill(~keep, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, s, d)


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    return {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}[name](x)


class RandomModel(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = random.Random(seed)
        torch.manual_seed(seed)
        self.kinds = [rng.choice(KINDS) for _ in range(rng.randint(2, 6))]
        self.blocks = nn.ModuleList(Block(kind, rng) for kind in self.kinds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def random_model(seed: int) -> tuple[RandomModel, torch.Tensor]:
    model = RandomModel(seed)
    torch.manual_seed(seed + 1)
    return model, torch.randn(BATCH, SEQ, DIM)
