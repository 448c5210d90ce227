"""What a compiled graph expects of each tensor it reads, and the changes transforms made to that.

Dynamo guards every tensor a graph reads (TENSOR_MATCH: Python type, dtype, device, shape,
stride, requires_grad). Those guards describe the model *as traced*. When a transform replaces a
parameter (casts it, quantizes it, shards it) the compiled code expects the replacement, so the
guards must expect it too: otherwise the first call fails its own guards, or worse, a later call
with the original kind of tensor runs code built for the replacement.

`GuardModel` is the explicit table of those expectations for one graph, built from the
placeholders Dynamo recorded. Transforms never edit Dynamo's guards directly: they call
`GuardModel.expect(...)` (through `CapturedGraph.replace_parameter`), and the pipeline then makes
Dynamo's guards match the table (`install`), checking that the module really holds what the
table says.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch

from xform._torch.dynamo import DynamoFrame


def readable_source(name: str) -> str:
    """`L['self']._modules['blocks']._modules['0']._parameters['weight']` -> `L['self'].blocks.0.weight`."""
    return re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", name)


def _dims(values: Any) -> tuple[int | str, ...]:
    """Concrete sizes stay ints; symbolic ones are kept by name (`s0`) so the table is readable."""
    return tuple(int(v) if isinstance(v, int) else str(v) for v in values)


@dataclass(frozen=True)
class TensorExpectation:
    """What the compiled code expects of one tensor it reads, named by its Dynamo source."""

    source: str
    role: str  # "parameter", "buffer" or "input"
    tensor_type: str
    dtype: torch.dtype
    device: str
    shape: tuple[int | str, ...]
    stride: tuple[int | str, ...]
    requires_grad: bool
    placement: str | None = None  # e.g. "Shard(0) over 2 ranks" once a transform shards it

    @classmethod
    def of(cls, source: str, role: str, tensor: torch.Tensor, placement: str | None = None) -> TensorExpectation:
        return cls(
            source=source,
            role=role,
            tensor_type=type(tensor).__name__,
            dtype=tensor.dtype,
            device=str(tensor.device),
            shape=_dims(tensor.shape),
            stride=_dims(tensor.stride()),
            requires_grad=bool(tensor.requires_grad),
            placement=placement,
        )

    def matches(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is what this expectation describes (what the guard will then check)."""
        return TensorExpectation.of(self.source, self.role, tensor, self.placement) == self

    def describe(self) -> str:
        shape = ", ".join(str(d) for d in self.shape)
        text = f"{str(self.dtype).removeprefix('torch.')}[{shape}] {self.tensor_type}"
        return f"{text} {self.placement}" if self.placement else text

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["dtype"] = str(self.dtype)
        data["shape"] = list(self.shape)
        data["stride"] = list(self.stride)
        return data


@dataclass(frozen=True)
class GuardChange:
    """One rewritten expectation: what the graph expected as traced, what it expects now, and who changed it."""

    before: TensorExpectation
    after: TensorExpectation
    changed_by: str

    @property
    def source(self) -> str:
        return self.after.source

    def describe(self) -> str:
        return f"{readable_source(self.source)}: {self.before.describe()} -> {self.after.describe()} ({self.changed_by})"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "before": self.before.to_dict(), "after": self.after.to_dict(),
                "changed_by": self.changed_by}


@dataclass(frozen=True)
class ModuleSwap:
    """A module replaced by another class (Linear -> Float8Linear): its type guard now expects the new one."""

    source: str
    before: str
    after: str
    changed_by: str

    def describe(self) -> str:
        return f"{readable_source(self.source)}: {self.before} -> {self.after} ({self.changed_by})"

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class GuardModel:
    """The expectations of one compiled graph, one per tensor placeholder, keyed by source name."""

    def __init__(self, expectations: list[TensorExpectation]) -> None:
        self._traced = {e.source: e for e in expectations}
        self._current = dict(self._traced)
        self._changed_by: dict[str, str] = {}
        self.module_swaps: list[ModuleSwap] = []

    def __getitem__(self, source: str) -> TensorExpectation:
        return self._current[source]

    def __iter__(self) -> Iterator[TensorExpectation]:
        return iter(self._current.values())

    def __len__(self) -> int:
        return len(self._current)

    def expect(self, source: str, tensor: torch.Tensor, *, changed_by: str, placement: str | None = None) -> GuardChange:
        """Record that the graph now expects `tensor` (its type, dtype, shape, ...) at `source`."""
        if source not in self._current:
            raise KeyError(f"{changed_by}: the graph reads no tensor from {source}")
        before = self._traced[source]
        self._current[source] = TensorExpectation.of(source, before.role, tensor, placement)
        self._changed_by[source] = changed_by
        return GuardChange(before, self._current[source], changed_by)

    def swap_module(self, source: str, before: type, after: type, *, changed_by: str) -> ModuleSwap:
        """Record that the module at `source` is now of class `after`."""
        swap = ModuleSwap(source, before.__name__, after.__name__, changed_by)
        self.module_swaps.append(swap)
        return swap

    @property
    def changes(self) -> list[GuardChange]:
        return [
            GuardChange(self._traced[s], self._current[s], by)
            for s, by in self._changed_by.items()
            if self._traced[s] != self._current[s]
        ]

    def install(self, frame: DynamoFrame, sources: dict[str, Any], live: dict[str, Any]) -> None:
        """Make Dynamo's guards check the current expectations.

        `sources` maps each source name to Dynamo's Source object, `live` to the tensor or module
        the model holds there now. A mismatch between what a transform declared and what it really
        put in the model is a bug in that transform, reported as such rather than left to fail later.
        """
        for swap in self.module_swaps:
            if type(live[swap.source]).__name__ != swap.after:
                raise RuntimeError(
                    f"xform: transform '{swap.changed_by}' declared that {swap.source} is now a {swap.after}, "
                    f"but the model holds a {type(live[swap.source]).__name__} there"
                )
            frame.rewrite_module_type_guard(sources[swap.source])
        for change in self.changes:
            tensor = live[change.source]
            if not change.after.matches(tensor):
                actual = TensorExpectation.of(change.source, change.after.role, tensor).describe()
                raise RuntimeError(
                    f"xform: transform '{change.changed_by}' declared that {change.source} is now "
                    f"{change.after.describe()}, but the model holds {actual} there"
                )
        frame.rewrite_tensor_guards([(sources[c.source], live[c.source]) for c in self.changes])

    def to_dict(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self]
