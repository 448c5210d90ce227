"""The three ways to ask for transforms are equivalent, and every bad request is a clear ValueError."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import xform
from xform.transforms import Cast
from models import TransformerBlock, mlp


def _summary(model: nn.Module) -> list[tuple[str, list[tuple[str, str]]]]:
    return [
        (t.transform, [(c.kind, c.target) for c in t.changes])
        for g in xform.report(model).graphs
        for t in g.transforms
    ]


def _by_name(model, x):
    return torch.compile(model, backend="xform", options={"transforms": ["cast:bf16"], "handoff": "eager"})(x)


def _by_object(model, x):
    return torch.compile(model, backend=xform.Backend([Cast(torch.bfloat16)], handoff="eager"))(x)


def _by_function(model, x):
    return xform.compile(model, "cast:bf16", handoff="eager")(x)


def test_three_ways_are_equivalent():
    x = torch.randn(4, 16)
    results = []
    for way in (_by_name, _by_object, _by_function):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = mlp()
        out = way(model, x)
        results.append((out, _summary(model), [type(p).__name__ for p in model.parameters()]))
    for out, summary, kinds in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
        assert summary == results[0][1]
        assert kinds == results[0][2] == ["LowPrecisionWeight"] * 4


def test_no_transforms_by_name_is_plain_inductor_handoff():
    model = mlp()
    torch.compile(model, backend="xform")(torch.randn(2, 16))
    graph = xform.report(model).graphs[0]
    assert graph.handoff == "inductor" and graph.transforms == [] and graph.guard_changes == []


def test_spec_strings_and_objects_mix():
    backend = xform.Backend(["cast:fp16"])
    assert isinstance(backend.transforms[0], Cast) and backend.transforms[0].dtype == torch.float16
    assert xform.Backend("cast").transforms[0].dtype == torch.bfloat16


def test_unknown_spec_lists_what_is_accepted():
    with pytest.raises(ValueError, match=r"unknown transform 'quantise' in spec 'quantise:fp8'; accepted: 'cast', "
                                         r"'cudagraphs', 'distribute', 'flex-attention', "
                                         r"'quantize'$"):
        xform.Backend(["quantise:fp8"])


def test_planned_transforms_say_they_are_not_available_yet(monkeypatch):
    import xform.registry

    monkeypatch.setitem(xform.registry.PLANNED, "pipeline", "issue #9 (pipeline parallelism)")
    with pytest.raises(xform.TransformNotAvailable, match=r"transform 'pipeline' \(spec 'pipeline:2'\) is not available "
                                                          r"yet: issue #9 \(pipeline parallelism\).*Available now: 'cast', "
                                                          r"'cudagraphs', 'distribute', 'flex-attention', 'quantize'"):
        xform.Backend(["pipeline:2"])


def test_bad_spec_argument_names_the_transform_and_choices():
    with pytest.raises(ValueError, match=r"transform 'cast': option dtype='int3' is not accepted; accepted: "
                                         r"torch.bfloat16, torch.float16 or one of 'bf16', 'bfloat16', 'fp16', 'float16'"):
        xform.Backend(["cast:int3"])


def test_transform_that_takes_no_argument_refuses_one():
    class Plain(xform.Transform):
        name = "plain"

    with pytest.raises(ValueError, match="transform 'plain' takes no argument, got plain:x"):
        Plain.from_spec("x")


@pytest.mark.parametrize("item, message", [
    (3, r"a transform must be an xform.Transform or a spec string, got int 3; accepted spec names: 'cast'"),
    (Cast, r"got the class Cast; pass an instance, e.g. Cast\(\)"),
])
def test_bad_transform_items(item, message):
    with pytest.raises(ValueError, match=message):
        xform.Backend([item])


def test_unknown_option_key():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['transfroms'\] for backend='xform'; accepted: "
                                         r"'transforms', 'handoff', 'inductor'"):
        xform.Backend.from_options({"transfroms": ["cast"]})


def test_transforms_option_must_be_a_list():
    with pytest.raises(ValueError, match=r"options\['transforms'\] must be a list of transforms or spec strings, got dict"):
        xform.Backend.from_options({"transforms": {"cast": 1}})


def test_unknown_handoff():
    with pytest.raises(ValueError, match=r"unknown handoff 'tvm'; accepted: 'inductor', 'eager', 'thunder'"):
        xform.Backend(handoff="tvm")


def test_unknown_inductor_option():
    with pytest.raises(ValueError, match=r"unknown Inductor option\(s\) \['max_autotoon'\] in options\['inductor'\]"):
        xform.Backend(inductor_options={"max_autotoon": True})


def test_inductor_options_need_the_inductor_handoff():
    with pytest.raises(ValueError, match=r"Inductor options and mode apply to handoff='inductor' only, not 'eager'"):
        xform.Backend(handoff="eager", mode="max-autotune")


def test_unknown_mode():
    with pytest.raises(ValueError, match=r"unknown torch.compile mode 'fastest'"):
        xform.Backend(mode="fastest")


def test_mode_becomes_inductor_config():
    backend = xform.Backend(mode="max-autotune-no-cudagraphs")
    assert backend.pipeline.handoff.config_patches["max_autotune"] is True


def _skip_if_thunder_imports():
    try:
        import thunder.dynamo  # noqa: F401
    except Exception:
        return
    pytest.skip("lightning-thunder imports here; this is about machines where it does not")


def test_thunder_handoff_where_thunder_does_not_import_falls_back_to_inductor(monkeypatch):
    _skip_if_thunder_imports()
    monkeypatch.delenv("XFORM_STRICT", raising=False)
    model = mlp()
    xform.compile(model, handoff="thunder")(torch.randn(2, 16))
    handoff = xform.report(model).graphs[0].handoff
    assert handoff.startswith("inductor (instead of thunder: xform: handoff='thunder' needs lightning-thunder, which "
                              "does not import here")


def test_a_thunder_fallback_is_inductor_to_the_transforms(monkeypatch):
    """The fallback's report label says why Inductor runs; its kind is Inductor's, so the transforms'
    Inductor-only refusals apply (before, the label hid the kind: Inductor crashed with KeyError
    float8_e8m0fnu on a recipe it refuses by name)."""
    from xform.handoff import ThunderHandoff
    from xform.transforms import QuantizeUnsupported
    def no_thunder(self):
        raise ValueError("xform: handoff='thunder' needs lightning-thunder, which does not import here (simulated)")

    monkeypatch.delenv("XFORM_STRICT", raising=False)
    monkeypatch.setattr(ThunderHandoff, "__init__", no_thunder)
    backend = xform.Backend(["quantize:mxfp8-inference"], handoff="thunder")
    assert backend.pipeline.handoff.kind == "inductor"
    assert backend.pipeline.handoff.label.startswith("inductor (instead of thunder: ")
    model = nn.Sequential(nn.Linear(128, 128)).to(torch.bfloat16)
    with pytest.raises(QuantizeUnsupported, match=r"Inductor does not compile torchao's emulated MX path on CPU"):
        torch.compile(model, backend=backend)(torch.randn(4, 128, dtype=torch.bfloat16))

    block = TransformerBlock()  # training on CPU: Inductor's flex kernel has no backward, so it is left as written
    torch.compile(block, backend=xform.Backend(["flex-attention"], handoff="thunder"))(torch.randn(2, 16, 32))
    (skip,) = xform.report(block).skips("flex-attention")
    assert "flex_attention has no CPU backward" in skip.reason


def test_thunder_handoff_where_thunder_does_not_import_is_an_error_in_strict_mode(monkeypatch):
    _skip_if_thunder_imports()
    monkeypatch.setenv("XFORM_STRICT", "1")
    with pytest.raises(ValueError, match=r"handoff='thunder' needs lightning-thunder, which does not import here .*"
                                         r"xform\[thunder\].*or use handoff='inductor'"):
        xform.Backend(handoff="thunder")


def test_options_passed_to_a_backend_object_are_refused():
    compiled = torch.compile(mlp(), backend=xform.Backend(handoff="eager"), options={"x": 1})
    with pytest.raises(Exception, match=r"torch.compile passed \['options'\] to an xform.Backend object"):
        compiled(torch.randn(2, 16))


def test_xform_compile_refuses_backend_and_options():
    with pytest.raises(ValueError, match="xform.compile sets `backend` itself"):
        xform.compile(mlp(), backend="inductor")


def test_available_transforms_describes_each_name():
    names = xform.available_transforms()
    assert names["cast"].startswith("Linear weights and biases held and computed in bf16/fp16")
    assert names["quantize"].startswith("Linear layers to float8 / MX formats through torchao")
    assert names["cudagraphs"].startswith("Record the capture-safe regions of each graph as CUDA graphs")


def test_register_transform_refuses_a_taken_name():
    class Other(xform.Transform):
        name = "cast"

    with pytest.raises(ValueError, match="transform name 'cast' is already taken by Cast"):
        xform.register_transform(Other)


def test_register_transform_needs_a_name():
    class Nameless(xform.Transform):
        pass

    with pytest.raises(ValueError, match="Nameless needs a `name` to be registered"):
        xform.register_transform(Nameless)


def test_registered_transform_is_usable_by_spec():
    @xform.register_transform
    class Noop(xform.Transform):
        """Does nothing (test)."""

        name = "test-noop"

    assert isinstance(xform.Backend(["test-noop"]).transforms[0], Noop)
