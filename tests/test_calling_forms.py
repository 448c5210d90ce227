"""The weights are found however the model is called: the module, its bound `forward` or `__call__`
(what `generate()` compiles), a `functools.partial`, a function closing over it or reading it from a
global, and a forward wrapped by a decorator taking `*args` (as transformers >= 5.25 wraps every
model's). Every weight-changing transform applies in each, with XFORM_STRICT=1 so that a failure of
xform's own code raises instead of running the model without the transform."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import pytest
import torch
from torch import nn

import xform

transformers = pytest.importorskip("transformers")


def passing_args(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator as transformers writes them: the wrapper takes `*args`, so `self` is `args[0]`."""
    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    return wrapper


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class DecoratedNet(Net):
    @passing_args
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


_GLOBAL: dict[str, nn.Module] = {}


def _through_global(x: torch.Tensor) -> torch.Tensor:
    return _GLOBAL["model"](x)


def _global(model: nn.Module) -> Callable[..., Any]:
    _GLOBAL["model"] = model
    return _through_global


def _closure(model: nn.Module) -> Callable[..., Any]:
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    return step


FORMS: dict[str, Callable[[nn.Module], Any]] = {
    "module": lambda m: m,
    "forward": lambda m: m.forward,
    "__call__": lambda m: m.__call__,
    "partial": functools.partial,
    "closure": _closure,
    "global": _global,
}
# (spec, the weight's type afterwards, how close to eager, training)
TRANSFORMS = {
    "cast:bf16": ("LowPrecisionWeight", 2e-2, False),
    "quantize:float8-weight-only": ("Float8Tensor", 0.15, False),
    "quantize:float8-rowwise": ("Parameter", 0.15, True),  # the module is swapped; the weight stays
}


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("XFORM_STRICT", "1")
    torch.compiler.reset()


def _check(model: nn.Module, form: Callable[[nn.Module], Any], spec: str) -> None:
    weight_type, tolerance, training = TRANSFORMS[spec]
    dtype = torch.bfloat16 if spec.startswith("quantize") else torch.float32
    model.to(dtype)
    reference = copy.deepcopy(model)
    compiled = xform.compile(form(model), spec, handoff="eager")
    x = torch.randn(16, 128, dtype=dtype)
    with torch.set_grad_enabled(training):
        out = compiled(x)
        expected = reference(x)
    first = model.body[0]
    assert type(first.weight).__name__ == weight_type
    if training:
        assert type(first).__name__ != "Linear"  # torchao's Float8Linear
    assert (out.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    changes = xform.report(model).changes(spec.partition(":")[0])
    assert changes and not xform.report(model).failures()


@pytest.mark.parametrize("spec", TRANSFORMS)
@pytest.mark.parametrize("form", FORMS)
def test_every_form_of_call_transforms_the_weights(form, spec):
    _check(Net(), FORMS[form], spec)


@pytest.mark.parametrize("spec", TRANSFORMS)
def test_a_forward_wrapped_by_an_args_decorator(spec):
    model = DecoratedNet()
    _check(model, FORMS["module"], spec)
    assert xform.report(model).graphs[0].code == "DecoratedNet.forward"  # not passing_args.<locals>.wrapper


@pytest.mark.slow
@pytest.mark.parametrize("form", ["module", "forward", "__call__"])
def test_a_hugging_face_model_however_it_is_called(form):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
        got = xform.compile(FORMS[form](model), "cast:bf16", handoff="eager")(ids).logits
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "LowPrecisionWeight"
    assert (got - expected).abs().max() <= 5e-2 * expected.abs().max()
    assert len(xform.report(model).changes("cast")) >= 2 * 7  # every Linear of both layers
