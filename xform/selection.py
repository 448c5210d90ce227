"""Which layers a transform applies to: `filter=` as an FQN regex, a list of names, or a callable."""

from __future__ import annotations

import re
from typing import Callable, Sequence, Union

from torch import nn

from xform.transform import option_error

LayerFilter = Union[None, str, Sequence[str], Callable[[str, nn.Module], bool]]


def layer_selector(filter: LayerFilter, transform: str) -> Callable[[str, nn.Module], bool]:
    """`(module_path, module) -> bool` for a user's `filter`.

    None selects every layer; a string is a regex matched against the whole module path
    (`re.fullmatch`, so `"layers\\.0\\..*"`); a list or tuple names module paths exactly; a callable
    gets `(path, module)`.
    """
    if filter is None:
        return lambda path, module: True
    if isinstance(filter, str):
        try:
            pattern = re.compile(filter)
        except re.error as error:
            raise option_error(transform, "filter", filter, f"a valid regex (this one: {error}), a list of module "
                               f"paths or a callable (path, module) -> bool") from None
        return lambda path, module: pattern.fullmatch(path) is not None
    if isinstance(filter, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in filter):
        names = frozenset(filter)
        return lambda path, module: path in names
    if callable(filter):
        return filter
    raise option_error(transform, "filter", filter, "None, a regex string, a list of module paths or a callable "
                                                    "(path, module) -> bool")
