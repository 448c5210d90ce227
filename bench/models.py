"""Benchmark models: the examples' llama (examples/llama.py), and a model taking its weights as inputs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.llama import DecodeLlama, DecoderLayer, Llama, LlamaConfig  # noqa: E402

__all__ = ["DecodeLlama", "DecoderLayer", "Llama", "LlamaConfig", "WeightsAsInputs", "plain_weights"]


class WeightsAsInputs(nn.Module):
    """`model` called with its weights passed in: `forward(weights, *args)` runs
    `torch.func.functional_call(model, weights, args)`. The weights reach the compiled graph as plain
    tensor arguments, neither parameters nor buffers (as a server's weight dict or functional code
    passes them): CUDA Graph Trees copy such inputs into their pool."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, weights: dict[str, torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.model, weights, args)


def plain_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of `model` as plain tensors over the same memory (`detach`: no copy)."""
    return {name: p.detach() for name, p in model.named_parameters()}
