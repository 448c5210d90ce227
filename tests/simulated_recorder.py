"""A CUDA-graph recorder simulated on the CPU, for the cudagraphs transform's tests without a GPU
(test_cudagraphs.py, the corpus, the conformance suite; the `recorder` fixture in conftest.py).

It gives a recorded graph's semantics: a replay runs what was recorded on the same input and
output buffers, reading in-place inputs where they are now. Its buffers form a simulated pool that
every replay first fills with garbage, as other graphs reusing the real pool would: anything handed
out of it, or read from it before being written, shows. With it the CPU is the recorded device, so
every path of the runtime runs here; the CUDA-only part (the one pool, real capture failures,
memory) is in test_cudagraphs_gpu.py.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from xform.transforms.cudagraphs.pool_outputs import handouts, merge_ranges
from xform.transforms.cudagraphs.recorder import Recorded, unowned_view


def _scribble(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() else 7)


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, where `dst` may be expanded (stride 0 along a dimension, one element seen
    many times, which a copy cannot write): the elements it holds once, what a kernel writes."""
    for dim, stride in enumerate(dst.stride()):
        if stride == 0 and dst.shape[dim] > 1:
            dst, src = dst.narrow(dim, 0, 1), src.narrow(dim, 0, 1)
    dst.copy_(src)


class SimulatedRecorder:
    device_type = "cpu"

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.recorded = 0
        self.pool: list[torch.Tensor] = []  # every recording's input and output buffers

    def record(self, run: Callable[[list[Any]], list[Any]], inputs: list[Any], copied: list[int],
               kept: Sequence[int] = ()) -> Recorded:
        if self.fail is not None:
            raise self.fail
        self.recorded += 1
        # a graph reads its in-place inputs at their addresses, and holds none of them
        static = [unowned_view(t) if isinstance(t, torch.Tensor) else t for t in inputs]
        for i in copied:  # laid out as the real recorder's; the values matter to the sim's eager run only
            static[i] = torch.empty_strided(inputs[i].shape, inputs[i].stride(), dtype=inputs[i].dtype,
                                            device=inputs[i].device).copy_(inputs[i])
        # the recording's run takes the inputs themselves over, as the real recorder's does, and frees
        # those it consumes after their last read (the caller holds unowned stand-ins of them)
        handed = [static[i] if i in copied else t for i, t in enumerate(inputs)]
        refs = [StorageWeakRef(t.untyped_storage()) if isinstance(t, torch.Tensor) else None for t in inputs]
        inputs.clear()
        # outputs that are views of in-place inputs, the recording's or a replay's (by identity: an
        # input the run frees may leave its address to an output; the weak references keep the
        # identities of the inputs' storages from being reused)
        caller = {t.untyped_storage()._cdata for i in range(len(static)) if i not in copied
                  for t in (static[i], handed[i]) if isinstance(t, torch.Tensor)}

        def made(outputs: list[Any]) -> list[torch.Tensor]:
            return [o for o in outputs if isinstance(o, torch.Tensor) and o.untyped_storage()._cdata not in caller]

        # a capture runs nothing: what the eager run writes into the caller's tensors is put back
        # (into those still alive after it: the run frees the inputs it consumes)
        restore = [(t, t.clone(), refs[i]) for i, t in enumerate(static) if i not in copied and isinstance(t, torch.Tensor)]
        outputs = run(handed)
        for t, before, alive in restore:
            if not alive.expired():
                _write(t, before)
        mine = made(outputs)
        own_inputs = [static[i] for i in copied]
        self.pool += own_inputs + mine
        # as the allocator: the graph may write the whole pool but the blocks in use throughout,
        # the owned outputs alive in it after the run (it believes an unowned one free, and an
        # input the run consumed was freed during it)
        live = [(start, end) for start, end, owned in handouts.alive() if owned]
        writable = [t for t in self.pool if not any(start <= _address(t) < end for start, end in live)]
        # a copied input's buffer is the graph's to reuse after its last read, as the real allocator
        # may (Inductor frees an input after its last use): only the kept ones hold their values
        held = {_address(static[i]) for i in kept}

        def replay() -> None:
            # the graph reads its inputs before anything overwrites them
            fresh = made(run(list(static)))
            for t in writable:
                if _address(t) not in held:
                    _scribble(t)
            for out, new in zip(mine, fresh):
                _write(out, new)

        replay.identities = refs  # held as long as the replays run, so that `caller`'s stay unique
        # the recording's outputs, owned by the sim (which scribbles over them) and handed out as
        # views that die with the caller's last reference, as the allocator's blocks would
        given = [unowned_view(o) if any(o is m for m in mine) else o for o in outputs]
        return Recorded(replay, own_inputs, given,
                        merge_ranges((_address(t), _address(t) + t.untyped_storage().nbytes()) for t in self.pool))

    def warm_up(self, run: Callable[[list[Any]], list[Any]], inputs: list[Any]) -> list[Any]:
        """`run(inputs)`, its outputs allocated in the pool, as the real recorder's warm-up does: the
        pool keeps their memory, which nothing outside it reuses (a recording that consumes one
        leaves its values for the replay to read), and hands them out as views that die with the
        caller's last reference."""
        refs = [StorageWeakRef(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor)]
        ours = {ref.cdata for ref in refs}  # the weak references keep these identities unique
        outputs = run(inputs)
        made = [o for o in outputs if isinstance(o, torch.Tensor) and o.untyped_storage()._cdata not in ours]
        self.pool += made
        return [unowned_view(o) if any(o is m for m in made) else o for o in outputs]

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is memory of the simulated pool."""
        return any(_address(t) == _address(p) for p in self.pool)
