"""flex_attention's private helpers that xform builds on: a BlockMask from block-level
full/partial tensors, and the kernel options its frontend fills in before calling the operator."""

from __future__ import annotations

from typing import Any

import torch


def block_mask_from_blocks(partial: torch.Tensor, full: torch.Tensor, mask_mod: Any, seq_lengths: tuple[int, int],
                           block: int) -> Any:
    """The BlockMask whose blocks `partial` and `full` (int8, [B, H, Q blocks, KV blocks]) mark."""
    from torch.nn.attention.flex_attention import _create_sparse_block_from_block_mask

    return _create_sparse_block_from_block_mask((partial, full), mask_mod, seq_lengths, block, block)


def kernel_options(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any]) -> dict[str, Any]:
    """`options` completed as flex_attention's frontend completes them (no log-sum-exp returned)."""
    from torch.nn.attention.flex_attention import _apply_kernel_options

    return _apply_kernel_options(q, k, v, False, options)
