"""Work hoisted out of a compiled graph and redone only when the values it reads change.

A BlockMask built from data (a document mask's per-token ids) depends on nothing but that data.
Inside the graph it is rebuilt on every call, even when the caller passes the same ids every time,
as a hand-written model builds its BlockMask once. `ReusedComputation` runs before the compiled
graph instead (`CapturedGraph.add_derived_inputs`) and hands its last results back while every
tensor it reads holds the values it held then, compared value by value with a copy kept of them.
Nothing cheaper is safe: a tensor's version counter misses writes through numpy (`from_numpy`
buffers a loader fills again), through `.data` and through its storage. The copy and the
comparison are kept to CPU tensors; one on a GPU is recomputed on every call, since comparing its
values would wait for the GPU. The results are never written by the graph (they are inputs it only
reads), so handing the same tensors out again is safe.

When it must recompute, it runs the computation compiled by Inductor where the graph is (made
with `make_fx` on the first recomputation, outside any Dynamo frame), else as written.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from xform._torch import inductor
from xform.log import logger

def _kept(tensor: torch.Tensor) -> torch.Tensor | None:
    """A copy of a CPU tensor's values to compare later calls with; None on a GPU: recomputed."""
    return tensor.detach().clone() if tensor.device.type == "cpu" else None


def _unchanged(kept: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    return (kept is not None and kept.shape == tensor.shape and kept.dtype == tensor.dtype
            and kept.device == tensor.device and torch.equal(kept, tensor))


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
        # the values read at the last computation and its results, replaced together (a call in
        # another thread sees one pair or the other)
        self._last: tuple[list[torch.Tensor | None], tuple[torch.Tensor, ...]] = ([], ())
        self._compiled: Callable[..., Any] | None = None

    def prime(self, reads: Sequence[torch.Tensor], results: tuple[torch.Tensor, ...]) -> None:
        """Take `results` as computed from `reads` (the example inputs, at compile time)."""
        self._last = ([_kept(t) for t in reads], results)

    def __call__(self, args: tuple) -> tuple[torch.Tensor, ...]:
        reads = [args[i] for i in self.indices]
        kept, results = self._last
        if kept and all(_unchanged(k, t) for k, t in zip(kept, reads)):
            return results
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
