"""Every option of every transform, given a wrong type or value, is a ValueError that names the
transform, the option, the value and what is accepted."""

from __future__ import annotations

import pytest
import torch

import xform
from xform.transforms import Cast, CudaGraphs, Distribute, FlexAttention, Quantize

BAD = [
    (Cast, {"dtype": torch.int8}, "cast", "dtype=torch.int8", "torch.bfloat16, torch.float16"),
    (Cast, {"dtype": "fp8"}, "cast", "dtype='fp8'", "'bf16', 'bfloat16', 'fp16', 'float16'"),
    (Cast, {"dtype": 16}, "cast", "dtype=16", "torch.bfloat16"),
    (Cast, {"filter": 3}, "cast", "filter=3", "None, a regex string, a list of module paths or a callable"),
    (Cast, {"filter": "(("}, "cast", "filter='(('", "a valid regex"),
    (Cast, {"filter": [1, 2]}, "cast", "filter=[1, 2]", "a list of module paths"),
    (Cast, {"filter": lambda path: True}, "cast", "filter=<function", "a callable taking (path, module) (too many"),
    (Quantize, {"recipe": "nvfp4", "filter": lambda: True}, "quantize", "filter=<function", "a callable taking (path, module)"),
    (Quantize, {"recipe": "int4"}, "quantize", "recipe='int4'", "training: float8-tensorwise"),
    (Quantize, {"recipe": 8}, "quantize", "recipe=8", "inference: float8-dynamic"),
    (Quantize, {"recipe": "nvfp4", "filter": object()}, "quantize", "filter=<object", "a callable"),
    (FlexAttention, {"backend": "cudnn"}, "flex-attention", "backend='cudnn'", "auto, flash, triton"),
    (FlexAttention, {"backend": None}, "flex-attention", "backend=None", "auto, flash, triton"),
    (Distribute, {"strategy": "zero3"}, "distribute", "strategy='zero3'", "ddp, fsdp, tp, fsdp+tp"),
    (Distribute, {"strategy": "fsdp", "mesh": "world"}, "distribute", "mesh='world'", "a 1-D DeviceMesh or a ProcessGroup"),
    (Distribute, {"strategy": "fsdp+tp", "mesh": "world"}, "distribute", "mesh='world'", "or a 2-D DeviceMesh"),
    (Distribute, {"strategy": "fsdp+tp", "tp_size": 1}, "distribute", "tp_size=1", "an int >= 2"),
    (Distribute, {"strategy": "tp", "tp_size": 2}, "distribute", "tp_size=2", "with strategy 'fsdp+tp' only"),
    (CudaGraphs, {"min_region_ops": 0}, "cudagraphs", "min_region_ops=0", "an int >= 1"),
    (CudaGraphs, {"max_graphs": 3}, "cudagraphs", "max_graphs=3",
     "only the options min_region_ops, max_signatures, warmup, stale_outputs (max_graphs was removed: an output still alive where a later replay writes is moved out"),
    (CudaGraphs, {"max_signatures": None}, "cudagraphs", "max_signatures=None", "an int >= 1"),
    (CudaGraphs, {"warmup": "1"}, "cudagraphs", "warmup='1'", "an int >= 1"),
    (CudaGraphs, {"stale_outputs": "move"}, "cudagraphs", "stale_outputs='move'", "'copy' (an output still alive"),
]


@pytest.mark.parametrize("cls, kwargs, transform, shown, accepted", BAD,
                         ids=[f"{c.__name__}-{'-'.join(map(str, k))}-{i}" for i, (c, k, *_) in enumerate(BAD)])
def test_bad_option_is_a_value_error_naming_everything(cls, kwargs, transform, shown, accepted):
    with pytest.raises(ValueError) as caught:
        cls(**kwargs)
    message = str(caught.value)
    assert message.startswith(f"xform: transform '{transform}': option {shown}")
    assert "is not accepted; accepted: " in message and accepted in message


@pytest.mark.parametrize("options, shown", [
    ({"transforms": "cast", "handoff": "tvm"}, "unknown handoff 'tvm'; accepted: 'inductor', 'eager', 'thunder'"),
    ({"transforms": 5}, "options['transforms'] must be a list of transforms or spec strings, got int"),
    ({"inductor": {"no_such_option": 1}}, "unknown Inductor option(s) ['no_such_option']"),
    ({"transformz": []}, "unknown option(s) ['transformz'] for backend='xform'; accepted: 'transforms', 'handoff', "
                         "'inductor'"),
])
def test_bad_backend_options(options, shown):
    with pytest.raises(ValueError) as caught:
        xform.Backend.from_options(options)
    assert shown in str(caught.value)


def test_a_bad_option_given_to_torch_compile_is_xforms_error_first():
    """torch.compile hands the options to the backend at the first call, inside Dynamo, which wraps
    what a backend raises in BackendCompilerFailed with torch's "report a bug" text: xform's error is
    passed on as it is, a ValueError whose message is xform's."""
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="xform", options={"transforms": ["cast:bf17"]})
    with pytest.raises(ValueError) as raised:
        compiled(torch.randn(2, 4))
    assert not isinstance(raised.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(raised.value).startswith("xform: transform 'cast': option dtype='bf17' is not accepted")


def test_an_error_passed_on_keeps_its_class_arguments_and_pickles():
    import pickle

    from xform.faults import XformError, passed_on
    from xform.transforms import QuantizeUnsupported

    error = passed_on(QuantizeUnsupported("xform: transform 'quantize': recipe 'nvfp4' needs ..."))
    assert isinstance(error, QuantizeUnsupported) and isinstance(error, XformError) and isinstance(error, ValueError)
    assert error.args == ("xform: transform 'quantize': recipe 'nvfp4' needs ...",)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and again.args == error.args


def test_a_value_error_not_of_xforms_making_is_left_to_dynamo(monkeypatch):
    """Only xform's own word on bad input ("xform: ...") is passed on as it is: any other ValueError
    in a compile is a bug, and keeps Dynamo's report of it."""
    class Buggy(xform.Transform):
        name = "buggy"

        def transform_graph(self, graph, record):
            raise ValueError("not enough values to unpack")

    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="not enough values to unpack"):
        xform.compile(torch.nn.Linear(4, 4), Buggy(), handoff="eager")(torch.randn(2, 4))
