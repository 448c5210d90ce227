"""Inductor's and AOTAutograd's entry points and configuration, as the handoffs and the
transforms that compile parts of a graph themselves call them.

The compiler itself is imported at first use: `import torch._inductor.compile_fx` costs seconds,
and a model compiled with `handoff="eager"` never needs it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["CustomGraphPass", "aot_autograd", "autograd_cache_off", "boxed", "compile_fx", "compile_fx_inner",
           "files_hash", "flash_attention_available", "mark_boxed", "mode_options", "option_names"]


def mode_options(mode: str) -> dict[str, Any]:
    """The config patches of a torch.compile `mode` ("max-autotune", ...); RuntimeError if unknown."""
    import torch._inductor

    return torch._inductor.list_mode_options(mode)


def option_names() -> list[str]:
    """Every Inductor config name `options=` may set."""
    import torch._inductor

    return list(torch._inductor.list_options())


def compile_fx(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """`torch._inductor.compile_fx.compile_fx`: what `backend="inductor"` runs."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx(gm, example_inputs, **kwargs)


def compile_fx_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
    """Inductor's compile of one AOTAutograd graph (forward, backward or inference)."""
    from torch._inductor.compile_fx import compile_fx_inner as inner

    return inner(gm, example_inputs, *args, **kwargs)


@contextlib.contextmanager
def autograd_cache_off() -> Iterator[None]:
    """AOTAutograd's cache off: a hit would skip `inner_compile`, and with it xform's AOT hooks."""
    import torch._functorch.config

    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def aot_autograd(**compilers: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo's AOTAutograd backend with the given forward/backward/inference compilers."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**compilers)


def boxed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` called the way AOTAutograd calls compiled functions (a list of inputs)."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(fn)


def files_hash(*paths: str) -> bytes:
    """The hash Inductor's FX graph cache keys a custom pass on: that of its source files."""
    return get_hash_for_files(paths)


def flash_attention_available() -> bool:
    """Whether Inductor's Flash flex-attention backend can run here (raises ImportError-like
    errors saying what is missing when it cannot)."""
    from torch._inductor.kernel.flex.flex_flash_attention import ensure_flash_available

    return ensure_flash_available()


def mark_boxed(fn: Any) -> None:
    """Mark `fn` as taking its inputs as one list it may empty, as AOTAutograd calls compiled
    functions (an attribute of the object itself: `functools.wraps` copies only those)."""
    fn._boxed_call = True
