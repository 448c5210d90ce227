"""Tracing a frame again after a transform gave parameters another dtype.

Dynamo traces the model before the backend sees it, so the first graph of a frame is traced from
the model as the user left it. Code that reads a weight's dtype (T5 casts its activations to
`self.wo.weight.dtype`) takes the old dtype's branch there, and a recompile (a new batch size)
takes the new one's: the outputs' dtype would change between calls. So when a transform gives
parameters another dtype (cast), the pipeline has Dynamo trace the frame again
(`xform._torch.dynamo.retrace`), and the frame's graphs are traced from the model as it now is.

The retrace finds the parameters already changed; what the first trace did to them (the records of
the transforms that ran, the changes to undo if the compile fails, the replacements the optimizers
must follow) is handed to it as an `EarlierTrace`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from xform.optimizers import Replacement
from xform.report import TransformRecord

if TYPE_CHECKING:
    from xform.captured import CapturedGraph


@dataclass
class EarlierTrace:
    """What a graph's earlier trace left for the next trace of the same frame."""

    records: dict[str, TransformRecord] = field(default_factory=dict)  # of the transforms that ran on it
    undo: list[Callable[[], None]] = field(default_factory=list)  # its changes to the model, oldest first
    replacements: list[Replacement] = field(default_factory=list)  # the parameters it replaced
    failures: list[TransformRecord] = field(default_factory=list)  # the transforms dropped for this graph

    def undo_all(self) -> None:
        """Take back its changes to the model, newest first."""
        for action in reversed(self.undo):
            action()


Key = tuple[str, int, tuple[int, ...]]
_handed_over = threading.local()  # per compiling thread: the Key and EarlierTrace of the retrace under way


def retrace_key(graph_id: str, graph: CapturedGraph) -> Key:
    """What a frame's retrace has in common with its trace: Dynamo's compile id (which starts again
    at 0/0 after `torch._dynamo.reset()`), the code traced and the modules it reaches."""
    return graph_id, id(graph.code), tuple(id(m) for m in graph.root_modules())


def hand_over(key: Key, trace: EarlierTrace) -> None:
    """Keep what a trace did for the retrace Dynamo is asked for (a backend made per call, as
    `backend="xform"` is, is another object on the retrace). The retrace follows at once, in the
    same thread, so one is kept a thread."""
    _handed_over.pending = (key, trace)


def taken_over(key: Key) -> EarlierTrace:
    """What an earlier trace of the graph `key` names handed over (nothing, for a first trace). One
    handed over for another graph is from a retrace that never reached the backend (it raised:
    `fullgraph=True` and a graph break on the new dtype's branch): its changes are undone, so the
    model is as its user left it and its optimizers step the parameters it holds."""
    pending = getattr(_handed_over, "pending", None)
    _handed_over.pending = None
    if pending is None:
        return EarlierTrace()
    if pending[0] != key:
        pending[1].undo_all()
        return EarlierTrace()
    return pending[1]


class ParametersRetyped(Exception):
    """Raised by the pipeline when `transform` replaced parameters with tensors of another dtype;
    carries the records of the transforms that ran, `transform`'s noting the retrace."""

    def __init__(self, transform: str, changed: list[Replacement], records: dict[str, TransformRecord]) -> None:
        super().__init__(f"xform: transform {transform!r} changed the dtype of {len(changed)} parameters "
                         f"({changed[0].fqn}, ...); traced again so that code reading it sees the new one")
        self.records = records
        records[transform].note(f"the frame was traced again after the dtype of {len(changed)} parameters changed, "
                                f"so that code reading a weight's dtype sees the new one")


def retyped(replacements: list[Replacement]) -> list[Replacement]:
    """The replacements whose tensor has another dtype than the parameter it replaced."""
    return [r for r in replacements if r.old.dtype != r.new.dtype]
