"""An optimizer created before the first call (how most training scripts are written) steps the
parameters the transforms put in the model, with its state; where the state cannot follow, its
step() raises instead of stepping tensors the model no longer holds."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import xform
from xform.optimizers import Replacement, retarget_optimizers


def _model(outputs: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, outputs))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, step, steps: int = 20,
           dtype: torch.dtype = torch.float32) -> list[float]:
    torch.manual_seed(1)
    x, y = torch.randn(64, 16, dtype=dtype), torch.randn(64, model[-1].out_features)
    losses = []
    for _ in range(steps):
        loss = ((step(x).float() - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_an_optimizer_made_before_the_first_call_trains_what_cast_put_in_the_model(optimizer):
    before, after = _model(), _model()
    made_before = optimizer(before.parameters(), lr=0.01)
    losses = _train(before, made_before, xform.compile(before, "cast:bf16", handoff="eager"))
    step_after = xform.compile(after, "cast:bf16", handoff="eager")
    step_after(torch.randn(2, 16))  # the first call replaces the weights; the optimizer comes after it
    reference = _train(after, optimizer(after.parameters(), lr=0.01), step_after)
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(reference, rel=1e-3)
    held = [p for group in made_before.param_groups for p in group["params"]]
    assert all(any(p is q for q in before.parameters()) for p in held)
    assert (f"the {optimizer.__name__} created before the first call now steps the 4 parameter(s) this "
            f"transform replaced") in xform.report(before).notes("cast")


def test_its_state_follows_in_the_replacements_dtype():
    model = _model()
    adam = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, adam, model, steps=2)  # eager steps first: moments in float32
    moments = {name: adam.state[p]["exp_avg"].clone() for name, p in model.named_parameters()}
    losses = _train(model, adam, xform.compile(model, "cast:bf16", handoff="eager"))
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        assert adam.state[p]["exp_avg"].dtype == torch.bfloat16 and int(adam.state[p]["step"]) == 22
        assert name in moments


def test_a_quantized_weight_is_what_the_optimizer_holds():
    model = _model().bfloat16()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():
        xform.compile(model, "quantize:float8-weight-only", handoff="eager")(torch.randn(2, 16, dtype=torch.bfloat16))
    held = [p for group in sgd.param_groups for p in group["params"]]
    assert type(held[0]).__name__ == "Float8Tensor" and held[0] is model[0].weight


def test_a_module_swapping_recipe_keeps_the_parameters_the_optimizer_holds():
    model = _model(outputs=16).bfloat16()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    weights = [p for p in model.parameters()]
    losses = _train(model, sgd, xform.compile(model, "quantize:float8-rowwise", handoff="eager"), dtype=torch.bfloat16)
    assert losses[-1] < losses[0]
    assert all(a is b for a, b in zip(model.parameters(), weights))
    assert not xform.report(model).notes("quantize") or all("created before" not in n
                                                             for n in xform.report(model).notes("quantize"))


def test_state_that_cannot_follow_makes_step_raise():
    old = nn.Parameter(torch.randn(8, 4))
    sgd = torch.optim.SGD([old], lr=0.1, momentum=0.9)
    old.grad = torch.ones_like(old)
    sgd.step()  # a momentum buffer of 8 x 4
    shard = nn.Parameter(torch.randn(4, 4))  # this rank's half, as distribute's fsdp cuts it
    said = retarget_optimizers([Replacement(old, shard, "layers.0.weight", "distribute")])
    assert said == {"distribute": ["the SGD created before the first call now steps the 1 parameter(s) this transform "
                                   "replaced; its state for 1 cannot follow, so its step() raises"]}
    assert sgd.param_groups[0]["params"][0] is shard
    with pytest.raises(RuntimeError, match=r"xform: transform 'distribute' replaced layers.0.weight at the model's first "
                                           r"compiled call, after this SGD had taken steps: .* Create the optimizer "
                                           r"after the first call"):
        sgd.step()


def test_an_optimizer_of_other_parameters_is_left_alone():
    model, other = _model(), copy.deepcopy(_model())
    sgd = torch.optim.SGD(other.parameters(), lr=0.01)
    held = [p for p in other.parameters()]
    xform.compile(model, "cast:bf16", handoff="eager")(torch.randn(2, 16))
    assert [p for g in sgd.param_groups for p in g["params"]] == held


def test_after_a_refusal_loading_state_that_fits_lets_it_step():
    old = nn.Parameter(torch.randn(8, 4))
    sgd = torch.optim.SGD([old], lr=0.1, momentum=0.9)
    old.grad = torch.ones_like(old)
    sgd.step()
    shard = nn.Parameter(torch.randn(4, 4))
    retarget_optimizers([Replacement(old, shard, "layers.0.weight", "distribute")])
    fresh = torch.optim.SGD([nn.Parameter(torch.randn(4, 4))], lr=0.1, momentum=0.9)
    sgd.load_state_dict(fresh.state_dict())  # what the message says to do: state made for the shard
    shard.grad = torch.ones_like(shard)
    sgd.step()


def test_state_not_shaped_like_the_parameter_follows_as_it_is():
    """Adafactor keeps row and column factors, not per-element moments: they follow a cast unchanged."""
    model = _model()
    adafactor = torch.optim.Adafactor(model.parameters(), lr=0.01)
    _train(model, adafactor, model, steps=2)
    losses = _train(model, adafactor, xform.compile(model, "cast:bf16", handoff="eager"))
    assert losses[-1] < losses[0]
