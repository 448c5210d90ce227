"""Work hoisted out of a compiled graph and redone only when the inputs it reads change.

A BlockMask built from data (a document mask's per-token ids) depends on nothing but that data.
Inside the graph it is rebuilt on every call, even when the caller passes the same ids tensor
every time, as a hand-written model builds its BlockMask once. `ReusedComputation` runs before the
compiled graph instead (`CapturedGraph.add_derived_inputs`) and hands its last results back while
every tensor it reads is unchanged:
- the same tensor object (a weak reference: a tensor freed and another allocated at the same
  address is not it),
- not written since (its version counter, which every in-place op and `copy_` bumps, with or
  without autograd),
- over the same memory (its data pointer: `.data =` swaps memory without a write).
A tensor made under `torch.inference_mode` has no version counter, so it is never taken as
unchanged. The results are never written by the graph (they are inputs it only reads), so handing
the same tensors out again is safe.

When it must recompute, it runs the computation compiled by Inductor where the graph is (made
with `make_fx` on the first recomputation, outside any Dynamo frame), else as written.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from xform._torch import inductor
from xform._torch.memory import version_counter
from xform.log import logger

Stamp = tuple[Any, int, int]  # (weak reference, version, data pointer) of one tensor read


def _stamp(tensor: torch.Tensor) -> Stamp | None:
    if tensor.is_inference():
        return None
    return weakref.ref(tensor), version_counter(tensor), tensor.data_ptr()


def _unchanged(stamp: Stamp | None, tensor: torch.Tensor) -> bool:
    return (stamp is not None and stamp[0]() is tensor and stamp[1] == version_counter(tensor)
            and stamp[2] == tensor.data_ptr())


class ReusedComputation:
    """`compute(*reads)` of the graph inputs at `indices`, redone only when one of them changed.

    Called with a call's inputs as Dynamo passes them; returns the tuple of tensors `compute`
    gives. `computed` counts how many times it really ran.
    """

    def __init__(self, compute: Callable[..., tuple[torch.Tensor, ...]], indices: Sequence[int], *,
                 compile_with_inductor: bool) -> None:
        self.compute, self.indices = compute, tuple(indices)
        self.compile_with_inductor = compile_with_inductor
        self.computed = 0
        self._stamps: list[Stamp | None] = []
        self._results: tuple[torch.Tensor, ...] = ()
        self._compiled: Callable[..., Any] | None = None

    def prime(self, reads: Sequence[torch.Tensor], results: tuple[torch.Tensor, ...]) -> None:
        """Take `results` as computed from `reads` (the example inputs, at compile time)."""
        self._stamps, self._results = [_stamp(t) for t in reads], results

    def __call__(self, args: tuple) -> tuple[torch.Tensor, ...]:
        reads = [args[i] for i in self.indices]
        if self._stamps and all(_unchanged(s, t) for s, t in zip(self._stamps, reads)):
            return self._results
        with torch.no_grad():
            results = tuple(self._run(reads))
        self.computed += 1
        self.prime(reads, results)
        return results

    def _run(self, reads: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        if not self.compile_with_inductor:
            return self.compute(*reads)
        if self._compiled is None:
            from torch.fx.experimental.proxy_tensor import make_fx

            try:
                traced = make_fx(self.compute, tracing_mode="fake")(*reads)
                self._compiled = inductor.compile_fx(traced, list(reads))
            except Exception as error:  # the computation as written is still right, only slower
                logger.warning("xform: %s could not be compiled by Inductor (%s: %s); it runs as written",
                               getattr(self.compute, "__name__", "a computation before the graph"),
                               type(error).__name__, error)
                self.compile_with_inductor = False
                return self.compute(*reads)
        return self._compiled(*reads)
