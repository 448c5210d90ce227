"""When a transform fails: what counts as its failure, and whether to raise it (XFORM_STRICT=1)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xform.transform import Transform


def strict() -> bool:
    """XFORM_STRICT=1: a transform's failure is raised, not worked around."""
    return os.environ.get("XFORM_STRICT", "").strip() == "1"


class TransformFailed(RuntimeError):
    """A transform raised inside one of its hooks (a bug in it, not a bad input)."""

    def __init__(self, transform: Transform, hook: str, error: BaseException) -> None:
        self.transform, self.hook = transform, hook
        self.reason = f"{type(error).__name__}: {error}"
        super().__init__(f"xform: transform '{transform.name}' failed in {hook}: {self.reason}")


def transform_failure(error: BaseException | None) -> TransformFailed | None:
    """The TransformFailed behind `error`, however deep in Dynamo's or Inductor's wrapping."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, TransformFailed):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
