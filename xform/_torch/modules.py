"""nn.Module's private methods xform needs: converting every parameter and buffer in place (what
`.to()` does, with any function), and state-dict hooks run around `state_dict()` and before
`load_state_dict()`."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def convert_tensors(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply `fn` to every parameter and buffer of `module` and its submodules, in place."""
    module._apply(fn)


def add_state_dict_hooks(module: nn.Module, after_save: Callable[..., Any], before_load: Callable[..., Any]) -> list[Any]:
    """Run `after_save(module, state, prefix, metadata)` at the end of `state_dict()` and
    `before_load(module, state, prefix, ...)` at the start of `load_state_dict()`; the handles."""
    return [module._register_state_dict_hook(after_save),
            module._register_load_state_dict_pre_hook(before_load, with_module=True)]
