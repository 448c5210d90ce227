"""The ordered list of transforms, checked once, then run hook by hook on each captured graph.

Hooks run in data-flow order (parameters, graph, AOT graphs during the handoff's compile, guards,
the compiled callable), and within a hook in the order the user listed the transforms. The guard
model is installed into Dynamo after the guard hooks, before the backend returns: Dynamo builds
the frame's guards only then, so they describe the transformed model.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

from torch import fx

from xform._torch.dynamo import DYNAMO_SIGNALS, retrace
from xform.captured import CapturedGraph
from xform.faults import TransformFailed, strict, transform_failure, warn_dropped
from xform.handoff import Handoff, InductorHandoff
from xform.log import logger
from xform.optimizers import retarget_optimizers
from xform.registry import resolve
from xform.report import GraphRecord, TransformRecord
from xform.retrace import EarlierTrace, ParametersRetyped, hand_over, retrace_key, retyped, taken_over
from xform.transform import Transform

PARAMETERS_NOT_INPUTS = (
    "the graph reads them as attributes of the graph module, not as inputs (a graph traced outside "
    "Dynamo, or torch < 2.13 with torch._dynamo.config.inline_inbuilt_nn_modules = False); xform "
    "transforms only parameters that are graph inputs: compile with torch.compile and the default config"
)


def check_order(transforms: Sequence[Transform]) -> None:
    """Refuse duplicates and orders that break a transform's `must_follow` / `must_precede`."""
    names = [t.name or type(t).__name__ for t in transforms]
    for name in set(names):
        if names.count(name) > 1:
            raise ValueError(f"xform: transform '{name}' is listed {names.count(name)} times; list it once")
    position = {name: i for i, name in enumerate(names)}
    for t, name in zip(transforms, names):
        for earlier, why in t.must_follow.items():
            if earlier in position and position[earlier] > position[name]:
                raise ValueError(
                    f"xform: transform '{name}' must come after '{earlier}' ({why}); "
                    f"reorder the list, e.g. {_reordered(names, earlier, name)}"
                )
        for later, why in t.must_precede.items():
            if later in position and position[later] < position[name]:
                raise ValueError(
                    f"xform: transform '{name}' must come before '{later}' ({why}); "
                    f"reorder the list, e.g. {_reordered(names, name, later)}"
                )


def _reordered(names: list[str], first: str, second: str) -> list[str]:
    rest = [n for n in names if n not in (first, second)]
    return [first, second, *rest]


class Pipeline:
    """Transforms (objects or spec strings), resolved and order-checked at construction."""

    def __init__(self, transforms: Iterable[Transform | str], handoff: Handoff) -> None:
        self.transforms = [resolve(t) for t in transforms]
        check_order(self.transforms)
        self.handoff = handoff
        if isinstance(handoff, InductorHandoff):
            handoff.with_transform_config(
                {k: v for t in self.transforms for k, v in t.inductor_config().items()},
                {k: v for t in self.transforms for k, v in t.required_inductor_config().items()},
                {k: t.name for t in self.transforms for k in t.required_inductor_config()})
        own_compile = [t.name for t in self.transforms if t.overrides("compile_graph")]
        if len(own_compile) > 1:
            raise ValueError(f"xform: transforms {own_compile} each compile the graph in their own parts; list one")
        needs_aot = [t.name for t in self.transforms if t.overrides("transform_aot_graph") or t.overrides("compile_graph")]
        if needs_aot and not handoff.supports_aot_hooks:
            raise ValueError(
                f"xform: transform(s) {needs_aot} work on AOTAutograd graphs, which handoff={handoff.label!r} "
                f"does not produce; use handoff='inductor' or 'eager'"
            )

    def run(self, make_graph: Callable[[], CapturedGraph], record: GraphRecord) -> Callable[..., Any]:
        """Transform one captured graph, compile it, install its guards and wrap the result.

        A transform that fails inside its own code (anything but the ValueError it raises for bad
        input) is dropped for this graph: its changes to the model are undone, the graph is
        transformed again from Dynamo's original by the others, and the report says what failed.
        With XFORM_STRICT=1 the failure is raised instead.

        A transform that gives parameters another dtype has Dynamo trace the frame again
        (`xform.retrace`); what this trace did is kept for the next (`EarlierTrace`).
        """
        graph = make_graph()
        key = retrace_key(record.graph, graph)
        earlier = taken_over(key)
        failures = list(earlier.failures)
        active = [t for t in self.transforms if t.name not in {f.transform for f in failures}]
        while True:
            graph.inherit(earlier.undo, earlier.replacements)
            try:
                compiled = self._run_once(graph, active, record, earlier.records)
            except ParametersRetyped as changed:
                hand_over(key, EarlierTrace(changed.records, graph.take_undo(), graph.replacements, failures))
                frame = graph.frame
                graph.release()  # the model keeps its changes: the next trace is to see them
                raise retrace(frame, str(changed)) from None
            except Exception as error:
                failure = transform_failure(error)
                if failure is None or strict():
                    graph.undo_model_changes()  # the model as the user left it
                    raise
                warn_dropped([*graph.root_modules(), *([graph.code] if graph.code is not None else [])], failure)
                failed = TransformRecord(failure.transform.name)
                failed.failed(f"failed in {failure.hook}: {failure.reason}; this graph was compiled without it "
                              f"(XFORM_STRICT=1 raises instead)")
                failures.append(failed)
                active = [t for t in active if t is not failure.transform]
                if any(r.by == failure.transform.name for r in earlier.replacements):
                    # this trace saw the model as the failed transform changed it: undone, trace it again
                    graph.undo_model_changes()
                    hand_over(key, EarlierTrace(failures=failures))
                    raise retrace(graph.frame, f"xform: transform {failure.transform.name!r} failed; its changes "
                                               f"to the model were undone") from error
                graph.undo_model_changes(keep_inherited=True)
                graph = make_graph()
                continue
            record.transforms += failures
            graph.release()
            return compiled

    def _run_once(self, graph: CapturedGraph, transforms: list[Transform], record: GraphRecord,
                  earlier: dict[str, TransformRecord]) -> Callable[..., Any]:
        records = {t.name: copy.deepcopy(earlier[t.name]) if t.name in earlier else TransformRecord(t.name)
                   for t in transforms}
        record.transforms = list(records.values())

        def using(hook: str) -> list[Transform]:
            return [t for t in transforms if t.overrides(hook)]

        held = graph.parameters_held_by_graph_module()
        ran: list[str] = []
        for t in using("transform_parameters"):
            # after a retrace the parameters are as the earlier trace left them: report what it did
            target = TransformRecord(t.name) if t.name in earlier else records[t.name]
            if held:
                target.skipped(f"{len(held)} parameters", PARAMETERS_NOT_INPUTS)
            replaced = len(graph.replacements)
            with _timed(t, target, "transform_parameters"):
                t.transform_parameters(graph, target)
            ran.append(t.name)
            changed = retyped(graph.replacements[replaced:])
            if changed and graph.frame is not None and t.name not in earlier:  # once per transform: no loop
                raise ParametersRetyped(t.name, changed, {name: records[name] for name in ran})
        for t in using("transform_graph"):
            with _timed(t, records[t.name], "transform_graph"):
                t.transform_graph(graph, records[t.name])
                graph.gm.graph.lint()
                graph.gm.recompile()
        record.nodes_after = graph.node_count()
        logger.debug("graph %s after transforms:\n%s", record.graph, graph.gm.code)

        start = time.perf_counter()
        aot_hook = _aot_hook(using("transform_aot_graph"), records)
        try:
            compiled = None
            for t in using("compile_graph"):
                with _timed(t, records[t.name], "compile_graph"):
                    compiled = t.compile_graph(graph, partial(self.handoff.compile, aot_hook=aot_hook), records[t.name])
            if compiled is None:
                compiled = self.handoff.compile(graph.gm, graph.example_inputs, aot_hook)
        except DYNAMO_SIGNALS as error:
            logger.info("graph %s: handoff %r raised %s, which Dynamo handles itself (a restart or a graph "
                        "break)", record.graph, self.handoff.label, type(error).__name__)
            raise
        except Exception as error:
            if transform_failure(error) is not None:
                raise
            raise RuntimeError(
                f"xform: handoff {self.handoff.label!r} failed to compile graph {record.graph} after transforms "
                f"{[t.name for t in transforms]}: {type(error).__name__}: {error}\n"
                f"To tell a transform's bad graph from a handoff bug, compile with handoff='eager' "
                f"(XFORM_LOG=debug prints the transformed graph)."
            ) from error
        record.handoff_seconds = time.perf_counter() - start
        if graph.added_inputs:
            compiled = _with_added_inputs(compiled, graph.added_inputs)

        for t in using("transform_guards"):
            with _timed(t, records[t.name], "transform_guards"):
                t.transform_guards(graph.guards, records[t.name])
        record.guard_changes = graph.install_guards()
        record.module_swaps = list(graph.guards.module_swaps)

        for t in using("wrap_compiled"):
            with _timed(t, records[t.name], "wrap_compiled"):
                compiled = t.wrap_compiled(compiled, graph, records[t.name])
        for by, notes in retarget_optimizers(graph.replacements).items():
            for note in notes:
                records[by].note(note)
        for t in transforms:
            if not (records[t.name].changes or records[t.name].skips or records[t.name].notes):
                records[t.name].note(t.nothing_found)
        return compiled


def _aot_hook(users: list[Transform], records: dict[str, TransformRecord]) -> Callable[[fx.GraphModule, str], None] | None:
    if not users:
        return None

    def hook(gm: fx.GraphModule, kind: str) -> None:
        for t in users:
            with _timed(t, records[t.name], "transform_aot_graph"):
                t.transform_aot_graph(gm, kind, records[t.name])
                gm.graph.lint()
                gm.recompile()

    return hook


def _with_added_inputs(compiled: Callable[..., Any], added: list[Any]) -> Callable[..., Any]:
    """The compiled graph, called with the inputs Dynamo passes plus the ones xform added: constant
    tensors, and tensors computed from the call's inputs (`CapturedGraph.add_derived_inputs`)."""
    if not any(callable(a) for a in added):
        constants = tuple(added)
        return lambda *args: compiled(*args, *constants)
    parts = [a if callable(a) else (lambda _, t=a: (t,)) for a in added]

    def call(*args: Any) -> Any:
        return compiled(*args, *(t for part in parts for t in part(args)))

    return call


@contextmanager
def _timed(transform: Transform, record: TransformRecord, hook: str) -> Iterator[None]:
    """Time a hook into its record, and give any failure the transform's name and hook."""
    start = time.perf_counter()
    try:
        yield
    except (ValueError, NotImplementedError, TransformFailed, *DYNAMO_SIGNALS):
        raise  # bad input, said plainly by the transform; already attributed; or Dynamo's own signal
    except Exception as error:
        raise TransformFailed(transform, hook, error) from error
    finally:
        record.seconds += time.perf_counter() - start
