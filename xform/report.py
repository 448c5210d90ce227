"""What xform did to each compiled graph, and what it left alone and why.

Every graph Dynamo hands to xform gets a `GraphRecord`: the transforms that ran on it, each with
its changes (layers, parameters, nodes, regions) and its skips (with the reason), the guard
changes, the handoff and the time spent. `xform.report(compiled)` gathers the records of one
compiled model or function into a `Report`: `str()` is a table for people, `.to_dict()` is JSON.
"""

from __future__ import annotations

import itertools
import re
import textwrap
import types
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from tabulate import tabulate
from torch import nn

from xform._torch.dynamo import original_callable, reset_since_last_asked
from xform.guards import GuardChange, ModuleSwap
from xform.log import logger


@dataclass(frozen=True)
class Change:
    """One thing a transform changed: `kind` is what (layer, parameter, node, region), `target` which one."""

    kind: str
    target: str
    detail: str = ""


@dataclass(frozen=True)
class Skip:
    """One thing a transform could have changed but did not, and why, in words a user can act on."""

    target: str
    reason: str


@dataclass
class TransformRecord:
    """What one transform did to one graph."""

    transform: str
    changes: list[Change] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failure: str | None = None  # set when the transform raised and the graph was compiled without it
    seconds: float = 0.0
    _logged: set[str] = field(default_factory=set, repr=False, compare=False)  # skip reasons logged

    def changed(self, kind: str, target: str, detail: str = "") -> None:
        self.changes.append(Change(kind, target, detail))
        logger.info("%s changed %s %s: %s", self.transform, kind, target, detail)

    def skipped(self, target: str, reason: str) -> None:
        if reason not in self._logged:  # logged once per reason, as the report groups them
            self._logged.add(reason)
            logger.info("%s skipped %s: %s", self.transform, target, reason)
        self.skips.append(Skip(target, reason))

    def note(self, text: str) -> None:
        self.notes.append(text)
        logger.info("%s: %s", self.transform, text)

    def failed(self, text: str) -> None:
        self.failure = text
        logger.warning("%s %s", self.transform, text)

    def to_dict(self) -> dict[str, Any]:
        return {
            "transform": self.transform,
            "changes": [vars(c) for c in self.changes],
            "skips": [vars(s) for s in self.skips],
            "notes": list(self.notes),
            "failure": self.failure,
            "seconds": round(self.seconds, 6),
        }


@dataclass
class GraphRecord:
    """Everything xform did to one graph Dynamo captured."""

    graph: str  # Dynamo's compile id, e.g. "0/0" (frame 0, first compile)
    code: str  # the user function whose frame was traced
    handoff: str
    nodes_before: int
    nodes_after: int = 0
    transforms: list[TransformRecord] = field(default_factory=list)
    guard_changes: list[GuardChange] = field(default_factory=list)
    module_swaps: list[ModuleSwap] = field(default_factory=list)
    handoff_seconds: float = 0.0
    xform_seconds: float = 0.0  # time in xform itself: everything in the backend call but the handoff

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "code": self.code,
            "handoff": self.handoff,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "transforms": [t.to_dict() for t in self.transforms],
            "guard_changes": [g.to_dict() for g in self.guard_changes],
            "module_swaps": [m.to_dict() for m in self.module_swaps],
            "handoff_seconds": round(self.handoff_seconds, 6),
            "xform_seconds": round(self.xform_seconds, 6),
        }


@dataclass
class Report:
    """The records of every graph xform compiled for one model or function."""

    graphs: list[GraphRecord]

    def to_dict(self) -> dict[str, Any]:
        return {"graphs": [g.to_dict() for g in self.graphs]}

    def changes(self, transform: str) -> list[Change]:
        return [c for g in self.graphs for t in g.transforms if t.transform == transform for c in t.changes]

    def skips(self, transform: str) -> list[Skip]:
        return [s for g in self.graphs for t in g.transforms if t.transform == transform for s in t.skips]

    def notes(self, transform: str | None = None) -> list[str]:
        """The notes of one transform, or of all of them, over every graph in compile order."""
        return [n for g in self.graphs for t in g.transforms if transform in (None, t.transform) for n in t.notes]

    def failures(self) -> list[tuple[str, str]]:
        """(transform, what failed) for every transform a graph was compiled without."""
        return [(t.transform, t.failure) for g in self.graphs for t in g.transforms if t.failure]

    def describe(self, transform: str, width: int = 100) -> str:
        """One transform's records, graph by graph, as wrapped text: every change, skip (its reason
        indented below it) and note. For reading what one transform did, where `str()`'s table,
        one row per entry, is for scanning many transforms."""
        lines: list[str] = []
        for g in self.graphs:
            lines.append(f"graph {g.graph} ({g.code})")
            for t in (t for t in g.transforms if t.transform == transform):
                lines += [f"  changed: {c.target}" + (f": {c.detail}" if c.detail else "") for c in t.changes]
                for s in grouped_skips(t.skips):
                    lines.append(f"  not changed: {s.target}")
                    lines += textwrap.wrap(s.reason, width, initial_indent="      ", subsequent_indent="      ")
                for n in t.notes:
                    lines += textwrap.wrap(n, width, initial_indent="  note: ", subsequent_indent="        ")
                lines += [f"  FAILED: {t.failure}"] if t.failure else []
        return "\n".join(lines) if lines else "no graph compiled yet (call the compiled model once)"

    def __str__(self) -> str:
        if not self.graphs:
            return "xform report: no graph compiled yet (call the compiled model once)"
        dropped = sorted({name for name, _ in self.failures()})
        lines = [f"xform report: {len(self.graphs)} graph(s)" + (
            f"; compiled WITHOUT {', '.join(repr(n) for n in dropped)}: xform failed in it (FAILED below)"
            if dropped else "")]
        for g in self.graphs:
            lines.append("")
            lines.append(
                f"graph {g.graph} ({g.code}): {g.nodes_before} -> {g.nodes_after} nodes, "
                f"handoff {g.handoff} {g.handoff_seconds * 1e3:.0f} ms, xform {g.xform_seconds * 1e3:.1f} ms"
            )
            if not g.transforms:
                lines.append("  no transforms")
            rows = [("transform", "what", "target", "detail")]
            for t in g.transforms:
                rows.append((t.transform, f"{len(t.changes)} changed, {len(t.skips)} skipped",
                             "", f"{t.seconds * 1e3:.1f} ms"))
                rows += [("", c.kind, c.target, c.detail) for c in t.changes]
                rows += [("", "skipped", s.target, s.reason) for s in grouped_skips(t.skips)]
                rows += [("", "note", "", n) for n in t.notes]
                rows += [("", "FAILED", "", t.failure)] if t.failure else []
            if len(rows) > 1:
                lines += _table(rows)
            lines += _guard_lines("guards rewritten", g.guard_changes)
            lines += _guard_lines("module types now guarded", g.module_swaps)
        return "\n".join(lines)


GUARD_LINES = 4
_NUMBER = re.compile(r"\d+")


def grouped_skips(skips: list[Skip]) -> list[Skip]:
    """One skip per distinct reason, in the order first met: a reason met at many places (a break in
    each of 16 layers) is said once, its places summarized with their count (`describe_places`)."""
    places: dict[str, list[str]] = {}
    for skip in skips:
        places.setdefault(skip.reason, []).append(skip.target)
    return [Skip(describe_places(targets), reason) for reason, targets in places.items()]


def describe_places(targets: list[str]) -> str:
    """`layers.{0-15}.mlp (x16)` for places that differ in one number, else the first place and how
    many more; one place as it is."""
    unique = list(dict.fromkeys(targets))
    if len(unique) == 1:
        return unique[0] + (f" (x{len(targets)})" if len(targets) > 1 else "")
    numbers = [[int(n) for n in _NUMBER.findall(t)] for t in unique]
    varying = [i for i in range(len(numbers[0])) if len({n[i] for n in numbers}) > 1] \
        if len({_NUMBER.sub("#", t) for t in unique}) == 1 else []
    if len(varying) != 1:
        return f"{unique[0]} and {len(unique) - 1} more like it (x{len(unique)})"
    values = sorted({n[varying[0]] for n in numbers})
    contiguous = values == list(range(values[0], values[-1] + 1))
    span = f"{values[0]}-{values[-1]}" if contiguous else ",".join(map(str, values))
    texts, first = _NUMBER.split(unique[0]), _NUMBER.findall(unique[0])
    joined = texts[0] + "".join((f"{{{span}}}" if i == varying[0] else n) + texts[i + 1] for i, n in enumerate(first))
    return f"{joined} (x{len(unique)})"


def _guard_lines(title: str, changes: list[GuardChange] | list[ModuleSwap]) -> list[str]:
    if not changes:
        return []
    lines = [f"  {title}: {len(changes)}"]
    lines += [f"    {change.describe()}" for change in changes[:GUARD_LINES]]
    if len(changes) > GUARD_LINES:
        lines.append(f"    ... and {len(changes) - GUARD_LINES} more (Report.to_dict() lists them all)")
    return lines


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """`rows` (the first is the header) in columns two spaces apart, indented under their graph's line."""
    text = tabulate(rows, tablefmt="plain", disable_numparse=True)  # the header as a row: no rule below it
    return ["  " + line.rstrip() for line in text.splitlines()]


def format_bytes(count: float) -> str:
    """A size in the one unit family the report uses: B, KiB, MiB or GiB (powers of 1024)."""
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if count >= 1024**power * 0.99995:  # from what would read 1024.0 of the unit below
            return f"{count / 1024**power:.1f} {unit}"
    return f"{count:.0f} B"


class _Registry:
    """Graph records by what was compiled: a module (weakly held) or a function's code object."""

    def __init__(self) -> None:
        self._by_module: weakref.WeakKeyDictionary[nn.Module, list[tuple[int, GraphRecord]]] = \
            weakref.WeakKeyDictionary()
        self._by_code: dict[types.CodeType, list[tuple[int, GraphRecord]]] = {}
        self._added = itertools.count()  # the order records came in, across modules
        reset_since_last_asked()

    def forget_if_reset(self) -> None:
        """Drop every record once `torch.compiler.reset()` has dropped the code they describe."""
        if reset_since_last_asked():
            self._by_module.clear()
            self._by_code.clear()

    def add(self, root: nn.Module | types.CodeType, record: GraphRecord) -> None:
        self.forget_if_reset()
        table: Any = self._by_module if isinstance(root, nn.Module) else self._by_code
        table.setdefault(root, []).append((next(self._added), record))

    def remove(self, record: GraphRecord) -> None:
        """Unfile `record` everywhere: its graph was not compiled (Dynamo retraces or breaks it)."""
        for table in (self._by_module, self._by_code):
            for root in list(table.keys()):
                table[root] = [(order, r) for order, r in table[root] if r is not record]

    def get(self, *roots: nn.Module | types.CodeType) -> list[GraphRecord]:
        """The records filed under any of `roots`, each once, in the order they were compiled."""
        return [record for _, record in self.get_with_roots(*roots)]

    def get_with_roots(self, *roots: nn.Module | types.CodeType) -> list[tuple[Any, GraphRecord]]:
        """(the first of `roots` it was filed under, record) for the records `get` returns."""
        found: dict[int, tuple[int, Any, GraphRecord]] = {}
        for root in roots:
            table: Any = self._by_module if isinstance(root, nn.Module) else self._by_code
            for order, record in table.get(root, []):
                found.setdefault(id(record), (order, root, record))
        return [(root, record) for _, root, record in sorted(found.values(), key=lambda item: item[0])]


records = _Registry()


def report(compiled: Callable[..., Any] | nn.Module) -> Report:
    """The report of a model or function compiled with xform (`torch.compile(..., backend="xform")`,
    `torch.compile(..., backend=xform.Backend(...))` or `xform.compile(...)`).

    Accepts the compiled object or the original module/function. Graphs appear after the first
    call, since Dynamo compiles lazily.
    """
    records.forget_if_reset()
    target: Any = original_callable(compiled)
    if isinstance(target, nn.Module):  # with its submodules': a graph break leaves frames whose `self` is one
        paths = {id(module): name for name, module in target.named_modules()}  # a shared module: its first path
        return Report([_from_model(record, root, paths[id(root)]) for root, record in
                       records.get_with_roots(*target.modules())])
    code = getattr(target, "__code__", None)
    if code is None:
        raise TypeError(
            f"xform.report expects a compiled model or function, or the module/function given to "
            f"torch.compile; got {type(compiled).__name__}"
        )
    return Report(records.get(code))


def _from_model(record: GraphRecord, root: nn.Module, path: str) -> GraphRecord:
    """`record` of a frame whose `self` is the submodule `root`, at `path` in the model reported on
    (a graph break leaves such frames): its layer and parameter names, relative to `root`, made the
    model's, so that a layer of one decoder layer is not told from the same layer of another by its
    name alone. Other targets (an attention's node, a region) are left as they are; a skip carries no
    kind, so its target is taken for a layer or parameter where it names one of `root`."""
    if not path:
        return record

    def prefixed(target: str) -> str:
        return f"{path}.{target}" if target else path  # "": the frame's `self` itself

    def names_a_part(target: str) -> bool:  # skips carry no kind: a layer or parameter path of `root`
        for lookup in (root.get_submodule, root.get_parameter):
            try:
                lookup(target)
                return True
            except Exception:  # AttributeError; anything a module's property raises is no path either
                continue
        return False

    transforms = [replace(t, changes=[replace(c, target=prefixed(c.target)) if c.kind in ("layer", "parameter")
                                      else c for c in t.changes],
                          skips=[replace(s, target=prefixed(s.target)) if names_a_part(s.target) else s
                                 for s in t.skips])
                  for t in record.transforms]
    return replace(record, code=f"{record.code}, in {path}", transforms=transforms)
