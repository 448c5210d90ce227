"""nn.Module's private state xform needs: converting every parameter and buffer in place (what
`.to()` does, with any function), state-dict hooks run around `state_dict()` and before
`load_state_dict()`, and a module's hooks and attributes carried to the module swapped in for it."""

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
    return [module._register_state_dict_hook(after_save), add_load_hook(module, before_load)]


def add_load_hook(module: nn.Module, before_load: Callable[..., Any]) -> Any:
    """Run `before_load(module, state, prefix, ...)` at the start of `load_state_dict()`; the handle."""
    return module._register_load_state_dict_pre_hook(before_load, with_module=True)


_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook",
          "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def carry_over(old: nn.Module, new: nn.Module) -> None:
    """Give `new`, swapped in for `old`, the hooks registered on `old` (the same dicts, so that their
    handles still remove them) and the attributes `old` has that `new` lacks (`lora_scale`, say)."""
    for name in _HOOKS:
        if hasattr(old, name):
            hooks = getattr(old, name)
            if isinstance(hooks, dict) and isinstance(getattr(new, name, None), dict):
                for key, hook in getattr(new, name).items():  # the new class's own hooks stay
                    hooks.setdefault(key, hook)
            object.__setattr__(new, name, hooks)
    for name, value in vars(old).items():
        if name not in vars(new) and not name.startswith("_"):
            object.__setattr__(new, name, value)
