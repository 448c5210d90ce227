"""What an `IndexProgram` (a mask or bias re-evaluated per position) can be on whole blocks of
positions: `block_bounds` gives, per block of the attention, whether a mask holds everywhere on it
and whether it may hold anywhere, from the bounds of the data it reads, without evaluating it at
every position. The BlockMask of a data mask is built from these.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch

from xform.transforms.attention.index_mods import POSITIONS, IndexProgram, Labels, Method, Ref, Step


class NotBounded(Exception):
    """`block_bounds` cannot bound an op of the program (the caller evaluates it at every position)."""


@dataclass
class _Truth:
    """A boolean on each block: `all` where it holds at every position, `any` where it may hold at some."""

    all: torch.Tensor
    any: torch.Tensor

    def negated(self) -> _Truth:
        return _Truth(~self.any, ~self.all)


@dataclass
class _Range:
    """A number on each block: every value at a position of the block lies in [lo, hi]."""

    lo: torch.Tensor
    hi: torch.Tensor


def block_bounds(program: IndexProgram, buffers: tuple[torch.Tensor, ...], sizes: tuple[int, int, int, int],
                 block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(all, any) of a boolean program on each (b, h, q-block, kv-block) of `block` x `block`
    positions, as bool tensors that broadcast to [B, H, ceil(Q / block), ceil(KV / block)]: `all`
    only where the program holds at every position of the block, `any` wherever it may hold at one.

    Exact for any data, by interval arithmetic: an arange is bounded on a block by its ends, a
    tensor read at q or kv by its min and max over the block (so 'ids[q] == ids[kv]' can hold
    only where the two blocks' id ranges meet, and holds everywhere only where both blocks hold one
    and the same id), each op by what its inputs' bounds allow. Bounds may be loose (a block
    called mixed that is in fact all or nothing: slower, never wrong) but never too tight. Raises
    NotBounded for an op it has no rule for, and for float tensors (a NaN would defeat min/max).
    Integer overflow is not modelled: values are assumed to stay well inside their dtype.
    """
    truth = _as_truth(_BlockEvaluator(sizes, block, buffers, device).run(program))
    return truth.all, truth.any


_COMPARISONS = {"eq", "ne", "ge", "gt", "le", "lt"}
_CONNECTIVES = {"and": "and", "logical_and": "and", "bitwise_and": "and", "or": "or", "logical_or": "or",
                "bitwise_or": "or", "xor": "xor", "logical_xor": "xor", "invert": "not", "logical_not": "not",
                "bitwise_not": "not"}
_CAST_METHODS = {"bool": torch.bool, "int": torch.int32, "long": torch.int64, "float": torch.float32,
                 "half": torch.float16, "bfloat16": torch.bfloat16}
_DIVISIONS = {"truediv": operator.truediv, "div": operator.truediv, "floordiv": operator.floordiv}


def _op_key(fn: Any) -> str:
    """'eq' for operator.eq, torch.eq, x.eq and x.__eq__; 'and' for operator.and_ and x.__and__."""
    return (fn.name if isinstance(fn, Method) else getattr(fn, "__name__", "")).strip("_")


def _as_truth(value: _Truth | _Range) -> _Truth:
    if isinstance(value, _Truth):
        return value
    zero = (value.lo == 0) & (value.hi == 0)
    return _Truth((value.lo > 0) | (value.hi < 0), ~zero)


def _as_range(value: _Truth | _Range) -> _Range:
    return _Range(value.all.long(), value.any.long()) if isinstance(value, _Truth) else value


def _compare(op: str, a: _Range, b: _Range) -> _Truth:
    if op in ("le", "lt"):
        return _compare({"le": "ge", "lt": "gt"}[op], b, a)
    if op == "ge":
        return _Truth(a.lo >= b.hi, a.hi >= b.lo)
    if op == "gt":
        return _Truth(a.lo > b.hi, a.hi > b.lo)
    equal = _Truth((a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo), (a.lo <= b.hi) & (b.lo <= a.hi))
    return equal if op == "eq" else equal.negated()


def _connect(op: str, a: _Truth, b: _Truth) -> _Truth:
    if op == "and":
        return _Truth(a.all & b.all, a.any & b.any)
    if op == "or":
        return _Truth(a.all | b.all, a.any | b.any)
    return _Truth((a.all & ~b.any) | (~a.any & b.all), (a.any & ~b.all) | (~a.all & b.any))  # xor


def _where(cond: _Truth, a: _Truth | _Range, b: _Truth | _Range) -> _Truth | _Range:
    if isinstance(a, _Truth) and isinstance(b, _Truth):
        return _Truth((cond.all & a.all) | (~cond.any & b.all) | (a.all & b.all),
                      (cond.any & a.any) | (~cond.all & b.any))
    a, b = _as_range(a), _as_range(b)
    lo = torch.where(cond.all, a.lo, torch.where(~cond.any, b.lo, torch.minimum(a.lo, b.lo)))
    hi = torch.where(cond.all, a.hi, torch.where(~cond.any, b.hi, torch.maximum(a.hi, b.hi)))
    return _Range(lo, hi)


def _cast(value: _Truth | _Range, dtype: torch.dtype) -> _Truth | _Range:
    if dtype == torch.bool:
        return _as_truth(value)
    if isinstance(value, _Truth):
        return _Range(value.all.to(dtype), value.any.to(dtype))
    return _Range(value.lo.to(dtype), value.hi.to(dtype))  # a cast is monotone


def _dtype_of(value: _Truth | _Range) -> torch.dtype:
    return torch.bool if isinstance(value, _Truth) else value.lo.dtype


class _BlockEvaluator:
    """Runs an IndexProgram on blocks instead of positions (see `block_bounds`)."""

    def __init__(self, sizes: tuple[int, int, int, int], block: int, buffers: tuple[torch.Tensor, ...],
                 device: torch.device) -> None:
        self.sizes, self.block, self.buffers, self.device = sizes, block, buffers, device

    def run(self, program: IndexProgram) -> _Truth | _Range:
        values: list[Any] = []
        for step in program.steps:
            values.append(self._step(step, values))
        return values[-1]

    def _step(self, step: Step, values: list[Any]) -> _Truth | _Range:
        resolve = lambda a: values[a.step] if isinstance(a, Ref) else a  # noqa: E731
        if step.kind == "buffer":
            return self._read(self.buffers[step.payload], step.labels)
        if step.kind == "index":
            return self._index(step.labels[0], *step.payload)
        if step.kind == "fill":
            return self._constant(*step.payload)
        if step.kind == "view":
            return resolve(step.payload)
        if step.kind == "triangle":
            keep_when, source, diagonal = step.payload
            offset = self._index("kv", 0, 1)
            q = self._index("q", 0, 1)
            offset = _Range(offset.lo - q.hi, offset.hi - q.lo)
            x = self._lift(resolve(source))
            zero = _cast(self._constant(0, torch.long), _dtype_of(x))
            return _where(_compare(keep_when.__name__, offset, self._lift(diagonal)), x, zero)
        fn, args, kwargs = step.payload
        args = [resolve(a) for a in args]
        kwargs = {k: resolve(v) for k, v in kwargs.items()}
        return self._call(_op_key(fn), args, kwargs)

    # leaves

    def _constant(self, value: Any, dtype: torch.dtype) -> _Truth | _Range:
        if isinstance(value, bool) or dtype == torch.bool:
            flag = torch.full((), bool(value), device=self.device)  # a factory op: tensor() would be a lifted constant
            return _Truth(flag, flag)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise NotBounded(f"the constant {value!r}")
        number = torch.full((), value, dtype=dtype, device=self.device)
        return _Range(number, number)

    def _lift(self, value: Any) -> Any:
        """Python numbers in an op's arguments as constant bounds; other non-tensors stay as they are."""
        if isinstance(value, bool):
            return self._constant(value, torch.bool)
        if isinstance(value, (int, float)):
            return self._constant(value, torch.long if isinstance(value, int) else torch.get_default_dtype())
        return value

    def _shaped(self, x: torch.Tensor, label: str) -> torch.Tensor:
        shape = [1, 1, 1, 1]
        shape[POSITIONS.index(label)] = x.shape[0]
        return x.reshape(shape)

    def _index(self, label: str, start: Any, stride: Any) -> _Range:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start, stride)):
            raise NotBounded(f"an arange with start {start!r}, step {stride!r}")
        position = POSITIONS.index(label)
        if label in ("b", "h"):
            point = torch.arange(self.sizes[position], device=self.device) * stride + start
            return _Range(self._shaped(point, label), self._shaped(point, label))
        length = self.sizes[position]
        first = torch.arange(0, length, self.block, device=self.device)
        last = (first + self.block - 1).clamp(max=length - 1)
        ends = (first * stride + start, last * stride + start)
        return _Range(self._shaped(torch.minimum(*ends), label), self._shaped(torch.maximum(*ends), label))

    def _read(self, tensor: torch.Tensor, labels: Labels) -> _Truth | _Range:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            raise NotBounded(f"a {tensor.dtype} tensor, whose NaNs min/max cannot bound")
        kept = [label for label in labels if label]
        if len(labels) != tensor.dim() or kept != sorted(set(kept), key=POSITIONS.index):
            raise NotBounded(f"a tensor of shape {tuple(tensor.shape)} read at {labels}")
        x = tensor[tuple(0 if label is None else slice(None) for label in labels)]
        truth = x.dtype == torch.bool
        lo = hi = x.to(torch.uint8) if truth else x
        for axis, label in enumerate(kept):
            if label in ("q", "kv"):
                lo, hi = self._per_block(lo, axis, label, torch.amin), self._per_block(hi, axis, label, torch.amax)
        shape = [lo.shape[kept.index(p)] if p in kept else 1 for p in POSITIONS]
        lo, hi = lo.reshape(shape), hi.reshape(shape)
        return _Truth(lo.bool(), hi.bool()) if truth else _Range(lo, hi)

    def _per_block(self, x: torch.Tensor, axis: int, label: str, reduce: Any) -> torch.Tensor:
        length = self.sizes[POSITIONS.index(label)]
        if x.shape[axis] != length:
            raise NotBounded(f"a tensor of {x.shape[axis]} along {label}, which runs over {length}")
        pad = -length % self.block
        if pad:  # repeat the last value: the bounds stay those of the real positions
            tail = list(x.shape)
            tail[axis] = pad
            x = torch.cat([x, x.narrow(axis, length - 1, 1).expand(tail)], axis)
        x = x.reshape(*x.shape[:axis], -1, self.block, *x.shape[axis + 1:])
        return reduce(x, dim=axis + 1)

    # ops

    def _call(self, op: str, raw: list[Any], kwargs: dict[str, Any]) -> _Truth | _Range:
        args = [self._lift(a) for a in raw]
        if op in _COMPARISONS and len(args) == 2 and not kwargs:
            return _compare(op, _as_range(args[0]), _as_range(args[1]))
        if op in _CONNECTIVES and not kwargs:
            connective = _CONNECTIVES[op]
            if not op.startswith("logical") and not all(isinstance(a, _Truth) for a in args):
                raise NotBounded(f"a bitwise '{op}' of integers")
            truths = [_as_truth(a) for a in args]
            return truths[0].negated() if connective == "not" else _connect(connective, *truths)
        if op in _CAST_METHODS and not args[1:] and not kwargs:
            return _cast(args[0], _CAST_METHODS[op])
        if op == "to":
            dtype = kwargs.get("dtype", next((a for a in raw[1:] if isinstance(a, torch.dtype)), None))
            return args[0] if dtype is None else _cast(args[0], dtype)
        if op == "type_as":
            return _cast(args[0], _dtype_of(args[1]))
        if op == "where" and len(args) == 3 and not kwargs:
            return _where(_as_truth(args[0]), args[1], args[2])
        if op == "masked_fill" and len(args) == 3 and not kwargs:
            return _where(_as_truth(args[1]), args[2], args[0])
        if kwargs and not (op == "clamp" or (op == "div" and kwargs.get("rounding_mode") is None)):
            raise NotBounded(f"'{op}' with {sorted(kwargs)}")
        return self._arithmetic(op, args, raw, kwargs)

    def _arithmetic(self, op: str, args: list[Any], raw: list[Any], kwargs: dict[str, Any]) -> _Range:
        ranges = [_as_range(a) if isinstance(a, (_Truth, _Range)) else a for a in args]
        if op in ("add", "radd") and len(ranges) == 2:
            a, b = ranges
            return _Range(a.lo + b.lo, a.hi + b.hi)
        if op in ("sub", "rsub") and len(ranges) == 2:
            a, b = ranges if op == "sub" else ranges[::-1]
            return _Range(a.lo - b.hi, a.hi - b.lo)
        if op == "neg" and len(ranges) == 1:
            return _Range(-ranges[0].hi, -ranges[0].lo)
        if op in ("mul", "rmul") and len(ranges) == 2:
            a, b = ranges
            corners = torch.broadcast_tensors(a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi)
            stacked = torch.stack(corners)
            return _Range(stacked.amin(0), stacked.amax(0))
        if op == "abs" and len(ranges) == 1:
            (a,) = ranges
            lo = torch.where(a.lo >= 0, a.lo, torch.where(a.hi <= 0, -a.hi, torch.zeros_like(a.lo)))
            return _Range(lo, torch.maximum(a.lo.abs(), a.hi.abs()))
        if op in ("minimum", "maximum") and len(ranges) == 2:
            fn = getattr(torch, op)
            return _Range(fn(ranges[0].lo, ranges[1].lo), fn(ranges[0].hi, ranges[1].hi))
        if op == "clamp" and all(v is None or _is_plain_number(v) for v in [*raw[1:], *kwargs.values()]):
            low = raw[1] if len(raw) > 1 else kwargs.get("min")
            high = raw[2] if len(raw) > 2 else kwargs.get("max")
            return _Range(ranges[0].lo.clamp(low, high), ranges[0].hi.clamp(low, high))
        if op in _DIVISIONS and len(raw) == 2 and _is_plain_number(raw[1]) and raw[1] != 0:
            divide, divisor = _DIVISIONS[op], raw[1]
            ends = (divide(ranges[0].lo, divisor), divide(ranges[0].hi, divisor))  # monotone in the dividend
            return _Range(*(ends if divisor > 0 else ends[::-1]))
        raise NotBounded(f"the op '{op}'")


def _is_plain_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
