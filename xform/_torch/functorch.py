"""Keep functorch (vmap) on where an exception left it off in this thread.

Torch prints a tensor under `torch._C._DisableFuncTorch()`, a guard held as a local of
`torch._tensor_str._str` that takes functorch's dispatch keys out of the thread until it is
destroyed. When printing raises (reading a CUDA-graph output that a later replay overwrote, under
`CudaGraphs(stale_outputs="error")` or `mode="reduce-overhead"`), the exception's traceback keeps
that frame, and the guard, alive: in a reference cycle until the collector runs, or for as long as
the caller holds the exception (a notebook keeps the last one). Meanwhile every `vmap` in the thread
meets its batched tensors without functorch and fails ("Cannot access data pointer of Tensor that
doesn't have storage"); flex-attention's block masks are built with `vmap`. Measured on the H100
(2026-12-07): a test printing a stale output made every flex-attention rewrite after it fail.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch

from xform.log import logger

_warned = False  # said once a process: the eager handoff runs through here every step
_KEYS = (torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode, torch._C.DispatchKey.FuncTorchDynamicLayerBackMode)


def _off() -> list[torch._C.DispatchKey]:
    return [key for key in _KEYS if torch._C._dispatch_tls_is_dispatch_key_excluded(key)]


@contextlib.contextmanager
def functorch_on() -> Iterator[None]:
    """Run the block with functorch on in this thread, and leave it as it was found.

    Where it is off, the collector runs first: the usual holder is an exception in a cycle, and
    freeing it destroys the guard, which turns functorch back on for good. Where something still
    holds the exception, functorch is turned on for the block alone and off again after it, as
    the guard still alive expects (what the block runs drops no exception of the caller's)."""
    off = _off()
    if off:
        gc.collect()
        off = _off()
    if not off:
        yield
        return
    global _warned
    if not _warned:
        _warned = True
        logger.warning("xform: functorch (vmap) was off in this thread, as torch leaves it while an exception "
                       "raised inside tensor printing is alive (reading a stale CUDA-graph output, say): turned "
                       "on while xform compiles or runs; drop that exception to turn it on for your own code too")
    for key in off:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key in off:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, True)
