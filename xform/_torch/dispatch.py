"""Torch's dispatch internals that transforms name: fake tensors, op overloads, the switch that
turns a tensor subclass's `__torch_function__` off, and the private operators xform calls.

Classes and context managers are re-exported as they are (not wrapped): Dynamo recognizes them
when it traces code that uses them (a subclass's `__torch_function__` on a retrace).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

make_subclass = torch.Tensor._make_subclass  # a tensor of a subclass over the same data, as a new leaf

__all__ = ["DisableTorchFunctionSubclass", "FakeTensor", "FakeTensorMode", "OpOverload", "OpOverloadPacket",
           "foreach_copy_", "forget_real_tensor", "is_mutable", "is_op_overload", "is_traceable_wrapper_subclass", "make_subclass",
           "overload_name", "scaled_mm"]

foreach_copy_ = torch._foreach_copy_  # one launch copying a list of tensors into another


def scaled_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
    """`torch._scaled_mm`, the float8 GEMM torchao's modules call (looked up at each call)."""
    return torch._scaled_mm(*args, **kwargs)


def is_op_overload(target: object) -> bool:
    """Whether an FX node's target is an aten-style operator (`aten.add.Tensor` or `aten.add`)."""
    return isinstance(target, (OpOverload, OpOverloadPacket))


def overload_name(target: OpOverload | OpOverloadPacket) -> str:
    """The operator's name without namespace or overload: `nonzero` for `aten.nonzero.default`."""
    qualified = target._schema.name if isinstance(target, OpOverload) else target._qualified_op_name
    return qualified.split("::")[-1]


def is_mutable(op: OpOverload) -> bool:
    """Whether the operator writes one of its arguments (`aten.add_.Tensor`, `aten.index_copy_`)."""
    return op._schema.is_mutable


def forget_real_tensor(fake_mode: FakeTensorMode, tensor: torch.Tensor) -> None:
    """Drop `fake_mode`'s record of a real tensor it made a fake of (a weak reference, which makes
    `nn.Module.to()` refuse to swap the tensor while the fake mode lives)."""
    fake_mode.fake_tensor_converter.meta_converter.describer.lookup_tensor.pop(tensor, None)
