"""Optimizers created before the first call step the parameters the transforms put in the model.

A training script usually creates its optimizer before the model's first call, and that call is
where xform replaces weights (cast's `LowPrecisionWeight`, quantize's tensor subclasses,
distribute's shards). Left alone, such an optimizer would step tensors the model no longer holds:
no error, and a loss that does not move. So once a graph's transforms have succeeded, every live
optimizer (found through the garbage collector, which tracks every optimizer object) gets each
replaced parameter swapped for its replacement in its param groups, and its state moved across.
State that cannot follow (a moment of another shape: a parameter cut into this rank's shard) makes
that optimizer's next `step()` raise, naming the parameters and what to do instead.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Replacement:
    """A parameter a transform replaced in the model: the old tensor, the new one, where, by whom."""

    old: torch.Tensor
    new: torch.Tensor
    fqn: str
    by: str


def _followed(state: dict[str, Any], old: torch.Tensor, new: torch.Tensor) -> dict[str, Any] | None:
    """An optimizer's state for a parameter, made fit for its replacement: floating tensors (momenta,
    an Adafactor's factors) in the replacement's dtype, numbers and scalars (the step count) as they
    are; None where per-element state cannot follow a replacement of another shape (a parameter cut
    into this rank's shard)."""
    moved = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            moved[key] = value
            continue
        if value.shape == old.shape and old.shape != new.shape:
            return None
        moved[key] = value.to(dtype=new.dtype) if value.is_floating_point() else value
    return moved


def _refuse_steps(blocked: list[Replacement]) -> Callable[..., None]:
    names = ", ".join(sorted({r.fqn for r in blocked}))
    by = ", ".join(sorted({repr(r.by) for r in blocked}))

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        raise RuntimeError(
            f"xform: transform {by} replaced {names} at the model's first compiled call, after this "
            f"{type(optimizer).__name__} had taken steps: its state for them has another shape than the "
            f"replacements, so it cannot follow. Create the optimizer after the first call (or load its state "
            f"then, with optimizer.load_state_dict)")

    return hook


def retarget_optimizers(replacements: list[Replacement]) -> dict[str, list[str]]:
    """Point every live optimizer holding a replaced parameter at its replacement. Returns, per
    transform, what was done, for its report."""
    if not replacements:
        return {}
    by_id = {id(r.old): r for r in replacements}
    said: dict[str, list[str]] = {}
    # by type, not isinstance: that reads `__class__`, which some module proxies warn on (deprecations)
    for optimizer in (o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)):
        moved: list[Replacement] = []
        blocked: list[Replacement] = []
        for group in optimizer.param_groups:
            params = group["params"]
            for index, param in enumerate(params):
                found = by_id.get(id(param))
                if found is None or found.old is not param:
                    continue
                params[index] = found.new
                moved.append(found)
                if param in optimizer.state:
                    state = _followed(optimizer.state.pop(param), param, found.new)
                    if state is None:
                        blocked.append(found)
                    else:
                        optimizer.state[found.new] = state
        if blocked:
            refusal = optimizer.register_step_pre_hook(_refuse_steps(blocked))
            optimizer.register_load_state_dict_post_hook(lambda _: refusal.remove())  # state that fits: steps
        for by in sorted({r.by for r in moved}):
            count = sum(r.by == by for r in moved)
            said.setdefault(by, []).append(
                f"the {type(optimizer).__name__} created before the first call now steps the {count} parameter(s) "
                f"this transform replaced" + (f"; its state for {len(blocked)} cannot follow, so its step() raises"
                                              if blocked else ""))
    return said
