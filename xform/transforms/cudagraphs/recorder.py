"""Recording CUDA graphs into one memory pool shared by every graph on a device.

`CudaGraphRecorder` records a region function on a side stream into the pool and warms it up with
its allocations in the same pool, so that the memory the calls before the recordings need is the
memory the recordings reuse. `GraphRecorder` is the protocol the replay logic (`replay`) needs of
a recorder, which the tests' simulated recorder implements on the CPU.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from xform._torch import memory
from xform.transforms.cudagraphs.pool_outputs import Ranges, merge_ranges


@dataclass
class Recorded:
    """A recorded graph. `replay()` runs it; `inputs` are where the copied inputs must be written
    before it (in the order of `copied`), `outputs` what the recorded run returned: tensors the
    recording allocated in the pool, where every replay leaves them, owned until dropped (the first
    replay hands them out). `writes`: the address ranges a replay may write, sorted and disjoint."""

    replay: Callable[[], None]
    inputs: list[torch.Tensor]
    outputs: list[Any]
    writes: Ranges


class GraphRecorder(Protocol):
    """How graphs are recorded on a device: `record(run, inputs, copied, kept)` records
    `run(inputs)` with the inputs at positions `copied` replaced by buffers of the recorder's pool.
    It takes `inputs` over (empties it) and hands `run` a list no one else holds, so that the inputs
    the region consumes are freed during the recording, as in a plain run, and their memory reused;
    but the buffers of `kept` (inputs the graph writes, which the caller copies back after each
    replay) are held throughout. `Recorded.writes` may be the whole pool (the caller takes out what
    outlived the recording)."""

    device_type: str

    def record(self, run: Callable[[list[Any]], list[Any]], inputs: list[Any], copied: list[int],
               kept: Sequence[int] = ()) -> Recorded: ...

    def warm_up(self, run: Callable[[list[Any]], list[Any]], inputs: list[Any]) -> list[Any]:
        """`run(inputs)`, uncaptured, with what it allocates in the recorder's pool (`run` takes
        `inputs` over)."""
        ...


def view_spec(t: torch.Tensor) -> tuple[Any, ...]:
    """How `t` views its storage: dtype, size, stride, storage offset."""
    return (t.dtype, t.shape, t.stride(), t.storage_offset())


def view_of(storage: torch.UntypedStorage, view: tuple[Any, ...]) -> torch.Tensor:
    """A tensor viewing `storage` as `view` (a `view_spec`) says."""
    dtype, size, stride, offset = view
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def unowned(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A storage over `storage`'s memory that does not keep it allocated (as CUDA Graph Trees hold
    their outputs): a recording keeps the address, and other graphs may use the memory in between."""
    return memory.unowned_storage(storage)


def unowned_view(t: torch.Tensor) -> torch.Tensor:
    """`t` over an `unowned` storage: the same memory and view, not keeping it allocated."""
    return view_of(unowned(t.untyped_storage()), view_spec(t))


_ACTIVE = ("active_allocated", "active_pending_free")


def _pool_blocks(pool: Any) -> list[tuple[int, int, bool]]:
    """(start, end, in use) of every block of the allocator's segments in `pool`."""
    blocks = []
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) != tuple(pool):
            continue
        address = segment["address"]
        for block in segment["blocks"]:
            start = block.get("address", address)
            address = start + block["size"]
            blocks.append((start, address, block["state"] in _ACTIVE))
    return blocks


@contextlib.contextmanager
def _no_cublas_workspace_kept() -> Iterator[None]:
    """cuBLAS keeps its workspaces per stream until they are cleared, allocated by the first GEMMs
    on the stream: those made during a warm-up or a recording would stay allocated in the pool for
    good (measured on the H100: two blocks of 32 MiB alive in xform's pool at the peak of a
    training step).
    Cleared before, so that the one used here is allocated in the pool, and after, so that it is
    freed there (as CUDA Graph Trees do). A recording still writes its workspace's memory when it
    replays: it lies in the pool ranges the recording writes, so a handout left there is moved
    out first, as from any of its intermediates."""
    memory.clear_cublas_workspaces()
    try:
        yield
    finally:
        memory.clear_cublas_workspaces()


class CudaGraphRecorder:
    """`torch.cuda.CUDAGraph`s recorded on a side stream into one pool shared by every graph."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream()
        # the allocator frees a pool when its last graph goes; an empty graph held here keeps it
        # for the graphs recorded later (as CUDA Graph Trees do), and keeps the memory behind the
        # recordings' addresses reserved
        self._keeper = self._empty_graph()
        self._retired: torch.cuda.CUDAGraph | None = None

    def _empty_graph(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                pass
        return graph

    def _recover(self) -> None:
        """After a failed capture, which can leave the allocator routing to the pool and the RNG
        generators in capture mode: end a clean (empty) capture, which puts the generators back,
        and record into a fresh pool from now on (graphs already recorded keep theirs)."""
        torch.cuda.synchronize()
        # the old pool stays until the next failure: the caller runs the call uncaptured from it
        self._retired = self._keeper
        self._pool = torch.cuda.graph_pool_handle()
        self._keeper = self._empty_graph()

    def warm_up(self, run: Callable[[list[Any]], list[Any]], inputs: list[Any]) -> list[Any]:
        """Run uncaptured with every allocation in the pool, on the recording stream (as CUDA Graph
        Trees warm up): the memory the calls before the recordings need is then the memory the
        recordings reuse, not a second reservation in the ordinary pool."""
        device = torch.cuda.current_device()
        torch.cuda.synchronize()  # what the stream reuses from the pool is no longer read elsewhere
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream), _no_cublas_workspace_kept(), memory.allocating_to_pool(device, self._pool):
            outputs = run(inputs)
        torch.cuda.current_stream().wait_stream(self._stream)
        return outputs

    def record(self, run: Callable[[list[Any]], list[Any]], inputs: list[Any], copied: list[int],
               kept: Sequence[int] = ()) -> Recorded:
        graph = torch.cuda.CUDAGraph()
        static = list(inputs)
        inputs.clear()  # `run` takes the list over: what the region consumes is freed as it goes
        try:
            with _no_cublas_workspace_kept(), torch.cuda.graph(graph, pool=self._pool, stream=self._stream,
                                                                capture_error_mode="thread_local"):
                for i in copied:  # allocated in the pool; no work recorded
                    static[i] = torch.empty_strided(static[i].shape, static[i].stride(), dtype=static[i].dtype,
                                                    device=static[i].device)
                buffers = [static[i] if i in kept else unowned_view(static[i]) for i in copied]
                outputs = run(static)
        except Exception:
            self._recover()
            raise
        # the graph may write any of the pool's memory but where the blocks that outlived the
        # capture lie (which the caller knows: outputs of other recordings still alive)
        writes = merge_ranges((start, end) for start, end, _ in _pool_blocks(self._pool))
        # the allocator's snapshot does not show the pool: assume it writes anywhere
        return Recorded(graph.replay, buffers, outputs, writes or [(0, 1 << 64)])


_recorder: CudaGraphRecorder | None = None
_lock = threading.Lock()


def shared_recorder() -> GraphRecorder:
    """The process's CUDA graph recorder (and with it the one pool), made on first use."""
    global _recorder
    with _lock:
        if _recorder is None:
            _recorder = CudaGraphRecorder()
        return _recorder
