"""When a transform fails: what counts as its failure, and whether to raise it (XFORM_STRICT=1)."""

from __future__ import annotations

import os
import traceback
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xform._torch.dynamo import PassedOnError

if TYPE_CHECKING:
    from xform.transform import Transform


def strict() -> bool:
    """XFORM_STRICT=1: a transform's failure is raised, not worked around."""
    return os.environ.get("XFORM_STRICT", "").strip() == "1"


class TransformFailed(RuntimeError):
    """A transform raised inside one of its hooks (a bug in it, not a bad input)."""

    def __init__(self, transform: Transform, hook: str, error: BaseException) -> None:
        self.transform, self.hook = transform, hook
        self.reason = f"{type(error).__name__}: {error} ({raised_at(error)})"
        super().__init__(f"xform: transform '{transform.name}' failed in {hook}: {self.reason}")


class XformError(PassedOnError, ValueError):
    """A `ValueError` of xform's (a bad option, an input a transform refuses) raised inside a
    compile: Dynamo passes it to the user as it is, its message xform's, not wrapped in
    `BackendCompilerFailed`."""


_PASSED_ON: dict[type, type] = {}


def passed_on(error: ValueError) -> ValueError:
    """`error` as an `XformError` that is still of its own class (`QuantizeUnsupported`, say), so
    that Dynamo passes it on and `except` clauses naming its class still catch it."""
    if isinstance(error, XformError):
        return error
    kind = type(error)
    if kind not in _PASSED_ON:
        _PASSED_ON[kind] = type(kind.__name__, (XformError, kind), {"__module__": kind.__module__,
                                                                    "__reduce__": _reduce_passed_on})
    passed = _PASSED_ON[kind](str(error))
    passed.args = error.args
    passed.__dict__.update(vars(error))
    passed.original = error
    return passed


def _reduce_passed_on(self: BaseException) -> tuple[Any, tuple[Any, ...]]:
    """Pickled as the error it was made from, passed on again when unpickled (a process pool)."""
    return passed_on, (self.original,)


class TransformDropped(UserWarning):
    """A model runs without a transform asked for, because xform's own code failed in it."""


# model (or traced function's code) -> the transforms it was warned about: said once, not per graph
_warned: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def warn_dropped(owners: list[Any], failure: TransformFailed) -> None:
    """Warn, once per model and transform, that the model was compiled without `failure`'s
    transform: a silent fallback would leave a user measuring the model they did not ask for."""
    name = failure.transform.name
    fresh = [owner for owner in owners if name not in _warned.setdefault(owner, set())]
    if owners and not fresh:
        return
    for owner in fresh:
        _warned[owner].add(name)
    # explicitly, with a registry of its own: Python's would say one text once per line of xform's,
    # and a second model failing alike would go unsaid; the once-per-model rule is `_warned`'s
    warnings.warn_explicit(f"xform: compiled without transform '{name}': xform's own code failed in "
                           f"{failure.hook}: {failure.reason}. The model runs as if '{name}' had not been asked "
                           f"for; xform.report(model) says which graphs. Please report this; XFORM_STRICT=1 raises "
                           f"instead.", TransformDropped, __file__, 0, registry={})


def transform_failure(error: BaseException | None) -> TransformFailed | None:
    """The TransformFailed behind `error`, however deep in Dynamo's or Inductor's wrapping."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, TransformFailed):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def raised_at(error: BaseException) -> str:
    """Where `error` was raised and, when that is outside xform, the last line of xform's on the way
    ("raised at torch/_tensor.py:12 in f, from xform/transforms/attention/transform.py:34 in _rewrite"):
    what a bug report, or a fix, needs first, said even where the stack trace is not shown (the
    report). `xform/_torch/` only passes calls on to torch, so its lines are not the ones named."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "raised at an unknown place"
    last = frames[-1]
    # the pipeline calls every hook: its line says nothing of the transform's
    own = next((f for f in reversed(frames) if _is_own(f.filename)), None)
    where = f"raised at {_frame(last)}"
    return where if own is None or own is last else f"{where}, from {_frame(own)}"


_PACKAGE = Path(__file__).resolve().parent


def _frame(frame: traceback.FrameSummary) -> str:
    return f"{_short_path(frame.filename)}:{frame.lineno} in {frame.name}"


def _is_own(filename: str) -> bool:
    """A line of xform that says what it was doing: not the pipeline, which calls every hook, nor
    `xform/_torch/`, which passes calls on to torch."""
    path = _within_xform(filename)
    return path is not None and path != "xform/pipeline.py" and not path.startswith("xform/_torch/")


def _within_xform(filename: str) -> str | None:
    """The path of a file of this package from its parent directory on (xform/...), else None."""
    path = Path(filename).resolve()
    return path.relative_to(_PACKAGE.parent).as_posix() if path.is_relative_to(_PACKAGE) else None


def _short_path(filename: str) -> str:
    """xform/..., the path from site-packages on (torch/...), or else the file's name."""
    own = _within_xform(filename)
    if own is not None:
        return own
    parts = Path(filename).parts
    for packages in ("site-packages", "dist-packages"):
        if packages in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(packages):])
    return Path(filename).name
