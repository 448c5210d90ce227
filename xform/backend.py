"""The `xform` torch.compile backend, by name, by object, or through `xform.compile`.

The three ways are the same thing:

    torch.compile(model, backend="xform", options={"transforms": ["cast:bf16"]})
    torch.compile(model, backend=xform.Backend(["cast:bf16"], handoff="inductor"))
    xform.compile(model, "cast:bf16")

Dynamo calls the backend once per captured graph; each call builds a `CapturedGraph`, runs the
pipeline on it and records what happened for `xform.report`.
"""

from __future__ import annotations

import itertools
import os
import time
import types
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import fx, nn

from xform._torch.dynamo import DYNAMO_SIGNALS, DynamoFrame, current_compile_id
from xform._torch.functorch import functorch_on
from xform.captured import CapturedGraph
from xform.handoff import make_handoff
from xform.faults import passed_on
from xform.log import logger
from xform.pipeline import Pipeline
from xform.report import GraphRecord, records
from xform.transform import Transform

OPTIONS = ("transforms", "handoff", "inductor")

_outside_dynamo = itertools.count()


class Backend:
    """A torch.compile backend that runs `transforms` on each graph, then hands it to `handoff`.

    `handoff` is "inductor" (default), "eager" or "thunder"; `inductor_options` are Inductor
    config patches (as `torch.compile(options=...)` takes for Inductor) and `mode` a torch.compile
    mode ("max-autotune", ...), both for the Inductor handoff.
    """

    def __init__(
        self,
        transforms: Iterable[Transform | str] = (),
        *,
        handoff: str = "inductor",
        inductor_options: dict[str, Any] | None = None,
        mode: str | None = None,
    ) -> None:
        if isinstance(transforms, (str, Transform)):
            transforms = [transforms]
        self.pipeline = Pipeline(transforms, make_handoff(handoff, inductor_options, mode))

    @classmethod
    def from_options(cls, options: dict[str, Any] | None, mode: str | None = None) -> Backend:
        """The backend `torch.compile(backend="xform", options=..., mode=...)` asks for."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"xform: unknown option(s) {unknown} for backend='xform'; accepted: {', '.join(map(repr, OPTIONS))}"
            )
        transforms = options.get("transforms", ())
        if not isinstance(transforms, (list, tuple, str, Transform)):
            raise ValueError(
                f"xform: options['transforms'] must be a list of transforms or spec strings, "
                f"got {type(transforms).__name__}"
            )
        return cls(transforms, handoff=options.get("handoff", "inductor"),
                   inductor_options=options.get("inductor"), mode=mode)

    @property
    def transforms(self) -> list[Transform]:
        return self.pipeline.transforms

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        if kwargs:
            raise ValueError(
                f"xform: torch.compile passed {sorted(kwargs)} to an xform.Backend object; give "
                f"options to xform.Backend(...) itself, or use backend='xform' with options=..."
            )
        start = time.perf_counter()
        frame = DynamoFrame.current()

        def make_graph() -> CapturedGraph:
            return CapturedGraph(gm, example_inputs, frame, self.pipeline.handoff.kind)

        graph = make_graph()
        record = GraphRecord(
            graph=_compile_id(),
            code=_traced_name(graph),
            handoff=self.pipeline.handoff.label,
            nodes_before=graph.node_count(),
        )
        _register(record, graph)
        logger.info("graph %s (%s): %d nodes, transforms %s", record.graph, record.code,
                    record.nodes_before, [t.name for t in self.transforms])
        try:
            with functorch_on():
                compiled = self.pipeline.run(make_graph, record)
        except DYNAMO_SIGNALS:
            records.remove(record)  # Dynamo retraces or breaks this graph: nothing the record says ran
            raise
        except ValueError as error:
            if not str(error).startswith("xform:"):  # not xform's word on bad input: as Dynamo reports it
                raise
            records.remove(record)  # nothing was compiled
            raise passed_on(error).with_traceback(error.__traceback__) from None
        record.xform_seconds = time.perf_counter() - start - record.handoff_seconds
        return compiled


def _compile_id() -> str:
    compile_id = current_compile_id()
    return compile_id if compile_id is not None else f"fx-{next(_outside_dynamo)}"


def _traced_name(graph: CapturedGraph) -> str:
    """`Sequential.forward`, `train_step`, ...: what the user would call the traced code. A decorator's
    wrapper around a model's forward (`can_return_tuple.<locals>.wrapper`, as transformers wraps
    them, handing it the module as its first argument) is named as the forward it wraps:
    `LlamaForCausalLM.forward`."""
    if graph.frame is None:
        return "fx graph"
    roots = graph.root_modules()
    if roots and _is_torch_code(graph.frame.code):  # the frame torch.compile(module) traces first
        return type(roots[0]).__name__
    name = graph.frame.code_name
    qualname = getattr(graph.frame.code, "co_qualname", graph.frame.code.co_name)
    if roots and "<locals>" in qualname and graph.root_sources() & {"L['self']", "L['args'][0]"}:
        return name.replace(qualname, f"{type(roots[0]).__name__}.forward", 1)
    return name


def _is_torch_code(code: types.CodeType) -> bool:
    return code.co_filename.startswith(os.path.dirname(torch.__file__))


def _register(record: GraphRecord, graph: CapturedGraph) -> None:
    """File the record under the compiled module(s) and under the user's function code."""
    for root in graph.root_modules():
        records.add(root, record)
    code = graph.code
    if code is not None and not _is_torch_code(code):
        records.add(code, record)


def xform_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                  mode: str | None = None) -> Callable[..., Any]:
    """`backend="xform"`: the entry point torch finds through the `torch_dynamo_backends` group.
    Options are checked here, at the first call (torch.compile hands them over only then): a bad one
    is an `XformError` (a ValueError) that Dynamo passes on as it is."""
    try:
        backend = Backend.from_options(options, mode=mode)
    except ValueError as error:  # every option error is xform's own ("xform: ...")
        raise passed_on(error).with_traceback(error.__traceback__) from None
    return backend(gm, example_inputs)


def compile(model: nn.Module | Callable[..., Any], *transforms: Transform | str, handoff: str = "inductor",
            inductor_options: dict[str, Any] | None = None, **torch_compile_kwargs: Any) -> Any:
    """`torch.compile(model, backend=xform.Backend(transforms, ...), **torch_compile_kwargs)`."""
    for taken in ("backend", "options"):
        if taken in torch_compile_kwargs:
            raise ValueError(f"xform.compile sets `{taken}` itself; pass transforms positionally and "
                             f"Inductor options as inductor_options=")
    mode = torch_compile_kwargs.pop("mode", None)
    backend = Backend(transforms, handoff=handoff, inductor_options=inductor_options, mode=mode)
    return torch.compile(model, backend=backend, **torch_compile_kwargs)
