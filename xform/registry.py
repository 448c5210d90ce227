"""Spec strings (`"cast:bf16"`, `"quantize:float8-rowwise"`) and the transforms they name.

A transform class registers itself with `@register_transform`; its `from_spec(argument)` turns the
part after the colon into a configured instance (and raises `ValueError` listing what it accepts).
The built-in transforms register when `xform.transforms` is imported, which `import xform` does
before anything can ask for a name; this module imports none of them.
Names of transforms still being built are listed in `PLANNED`, so that asking for one says so
plainly instead of pretending to work or reading as a typo.
"""

from __future__ import annotations

from typing import TypeVar

from xform.transform import Transform

T = TypeVar("T", bound=type[Transform])

_REGISTERED: dict[str, type[Transform]] = {}

PLANNED: dict[str, str] = {}


class TransformNotAvailable(NotImplementedError):
    """A registered transform name whose implementation has not landed yet."""


def register_transform(cls: T) -> T:
    """Class decorator: make `cls` available under `cls.name` in spec strings."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name` to be registered")
    if cls.name in _REGISTERED and _REGISTERED[cls.name] is not cls:
        raise ValueError(f"transform name '{cls.name}' is already taken by {_REGISTERED[cls.name].__name__}")
    _REGISTERED[cls.name] = cls
    return cls


def available_transforms() -> dict[str, str]:
    """Every accepted name, with what it is: the first docstring line, or when it is planned."""
    names = {n: f"not available yet: {why}" for n, why in PLANNED.items()}
    names.update({n: next(iter((c.__doc__ or "").strip().splitlines()), c.__name__) for n, c in _REGISTERED.items()})
    return dict(sorted(names.items()))


def _accepted() -> str:
    return ", ".join(f"'{n}'" + ("" if n in _REGISTERED else " (not available yet)") for n in available_transforms())


def parse_spec(spec: str) -> Transform:
    """`"name"` or `"name:argument"` -> a configured transform."""
    name, _, argument = spec.strip().partition(":")
    if name in _REGISTERED:
        return _REGISTERED[name].from_spec(argument or None)
    if name in PLANNED:
        raise TransformNotAvailable(
            f"xform: transform '{name}' (spec {spec!r}) is not available yet: {PLANNED[name]}. "
            f"Available now: {', '.join(repr(n) for n in sorted(_REGISTERED))}"
        )
    raise ValueError(f"xform: unknown transform {name!r} in spec {spec!r}; accepted: {_accepted()}")


def resolve(item: object) -> Transform:
    """A transform object or spec string -> a transform object."""
    if isinstance(item, Transform):
        return item
    if isinstance(item, str):
        return parse_spec(item)
    if isinstance(item, type) and issubclass(item, Transform):
        raise ValueError(f"xform: got the class {item.__name__}; pass an instance, e.g. {item.__name__}()")
    raise ValueError(
        f"xform: a transform must be an xform.Transform or a spec string, got {type(item).__name__} {item!r}; "
        f"accepted spec names: {_accepted()}"
    )
