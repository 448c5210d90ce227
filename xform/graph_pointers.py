"""The device addresses a recorded CUDA graph's nodes read, and changing them per launch.

A recorded graph bakes in the address of every tensor its kernels touch. To hand a replay's outputs
out in the caller's own fresh tensors and to read its inputs where they are (no copy of either),
xform rewrites, before each launch, the kernel arguments that point into those tensors
(`cuGraphExecKernelNodeSetParams`, and the memcpy/memset equivalents): the per-launch pointer
update of issue 5, which CUDA Graph Trees do not do and which is why they keep outputs in a pool.

Two layers: `Pointer`/`plan_moves` are pure (which argument words point into which moved range,
and their new values), tested on the CPU; `DriverGraph` reads and writes the nodes through the CUDA
driver (ctypes on libcuda, nothing to install), only on a GPU. An argument word is any 8-byte
aligned word of a kernel parameter (pointers inside by-value structs, as cuBLAS and CUTLASS pass
them, are found too); what a scan cannot see (a pointer kept in device memory, an encoded
descriptor) is caught by the check replay in `xform.replay`, which then keeps the copies.
"""

from __future__ import annotations

import bisect
import ctypes
import struct
from dataclasses import dataclass
from typing import Sequence

# CUgraphNodeType values that hold no device address (empty, event wait and record)
_NO_ADDRESSES = {5, 6, 7}
_KERNEL, _MEMCPY, _MEMSET = 0, 1, 2
_DEVICE_MEMORY = {2, 4}  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED
_NODE_TYPES = {3: "host function", 4: "child graph", 8: "external semaphore signal", 9: "external semaphore wait",
               10: "memory allocation", 11: "memory free", 12: "batched memory operation", 13: "conditional"}


@dataclass(frozen=True)
class Span:
    """A moved range of device memory: [start, end)."""

    start: int
    end: int


@dataclass(frozen=True)
class Pointer:
    """One argument word of a graph node that points into a moved span: node, word, old value, span."""

    node: int
    word: int
    value: int
    span: int


def find_pointers(words: Sequence[Sequence[int]], spans: Sequence[Span]) -> list[Pointer]:
    """Every word (per node, its list of argument words) whose value lies in one of `spans`
    (disjoint, in any order)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i].start)
    starts = [spans[i].start for i in order]
    found = []
    for node, node_words in enumerate(words):
        for word, value in enumerate(node_words):
            at = bisect.bisect_right(starts, value) - 1
            if at >= 0 and value < spans[order[at]].end:
                found.append(Pointer(node, word, value, order[at]))
    return found


def overlapping(allocations: Sequence[Span], span: Span) -> list[Span]:
    """The allocations that overlap `span` without lying inside it: were any made while a graph
    was recorded, kernels given their addresses would, once `span` moves, write outside it."""
    return [a for a in allocations if a.start < span.end and span.start < a.end
            and not (span.start <= a.start and a.end <= span.end)]


def widened(allocations: Sequence[Span], span: Span, slack: int) -> Span | None:
    """`span` grown over every allocation that overlaps it in part (and those overlapping the
    growth), so that all of them move together; None when that grows it by more than `slack`
    bytes (the fresh storage handed out would hold that much unused memory)."""
    grown = span
    while parts := overlapping(allocations, grown):
        grown = Span(min(grown.start, *(a.start for a in parts)), max(grown.end, *(a.end for a in parts)))
        if (grown.end - grown.start) - (span.end - span.start) > slack:
            return None
    return grown


def moved_values(pointers: Sequence[Pointer], new_starts: Sequence[int], spans: Sequence[Span]) -> dict[int, dict[int, int]]:
    """Per node, per word: the word's value once span i starts at new_starts[i]."""
    moved: dict[int, dict[int, int]] = {}
    for p in pointers:
        moved.setdefault(p.node, {})[p.word] = new_starts[p.span] + (p.value - spans[p.span].start)
    return moved


# -- the CUDA driver, through ctypes -----------------------------------------------------------

class DriverError(RuntimeError):
    pass


class _KernelParams(ctypes.Structure):
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("kernel_params", ctypes.POINTER(ctypes.c_void_p)),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _MemsetParams(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class _Memcpy3D(ctypes.Structure):
    _fields_ = [("src_x", ctypes.c_size_t), ("src_y", ctypes.c_size_t), ("src_z", ctypes.c_size_t),
                ("src_lod", ctypes.c_size_t), ("src_type", ctypes.c_uint), ("src_host", ctypes.c_void_p),
                ("src_device", ctypes.c_uint64), ("src_array", ctypes.c_void_p), ("reserved0", ctypes.c_void_p),
                ("src_pitch", ctypes.c_size_t), ("src_height", ctypes.c_size_t),
                ("dst_x", ctypes.c_size_t), ("dst_y", ctypes.c_size_t), ("dst_z", ctypes.c_size_t),
                ("dst_lod", ctypes.c_size_t), ("dst_type", ctypes.c_uint), ("dst_host", ctypes.c_void_p),
                ("dst_device", ctypes.c_uint64), ("dst_array", ctypes.c_void_p), ("reserved1", ctypes.c_void_p),
                ("dst_pitch", ctypes.c_size_t), ("dst_height", ctypes.c_size_t),
                ("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t)]


_driver: ctypes.CDLL | None = None


def _call(name: str, *args: object) -> int:
    """Call a driver function; its CUresult (0 is success)."""
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    function = getattr(_driver, name)
    function.restype = ctypes.c_int
    return function(*args)


def _check(name: str, *args: object) -> None:
    result = _call(name, *args)
    if result != 0:
        raise DriverError(f"{name} returned CUresult {result}")


class _Kernel:
    """A kernel node: its arguments copied into buffers this object owns, and their words. A
    kernel takes them either one pointer per parameter (`kernelParams`, sized through
    cuFuncGetParamInfo) or as one packed buffer (`extra`, as some launchers pass them)."""

    def __init__(self, node: ctypes.c_void_p) -> None:
        self.node = node
        self.params = _KernelParams()
        _check("cuGraphKernelNodeGetParams_v2", node, ctypes.byref(self.params))
        if self.params.kernel_params:
            sizes = self._param_sizes()
            self.buffers = [ctypes.create_string_buffer(ctypes.string_at(self.params.kernel_params[i], size), size)
                            for i, size in enumerate(sizes)]
            self.array = (ctypes.c_void_p * max(1, len(sizes)))(*[ctypes.addressof(b) for b in self.buffers])
            self.params.kernel_params = ctypes.cast(self.array, ctypes.POINTER(ctypes.c_void_p))
        elif self.params.extra:
            sizes = [self._packed()]
        else:
            sizes = []
        self.slots = [(i, offset) for i, size in enumerate(sizes) for offset in range(0, size - 7, 8)]

    def _param_sizes(self) -> list[int]:
        use_func = bool(self.params.func)
        name, handle = ("cuFuncGetParamInfo", self.params.func) if use_func else ("cuKernelGetParamInfo", self.params.kern)
        sizes = []
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        while _call(name, ctypes.c_void_p(handle), ctypes.c_size_t(len(sizes)), ctypes.byref(offset),
                    ctypes.byref(size)) == 0:
            sizes.append(size.value)
        return sizes

    def _packed(self) -> int:
        """Copy the `extra` buffer (key/value pairs: 1 its address, 2 the address of its size, 0
        the end) into one this node owns; its size."""
        pairs = ctypes.cast(self.params.extra, ctypes.POINTER(ctypes.c_void_p))
        found: dict[int, int] = {}
        i = 0
        while pairs[i]:
            found[pairs[i]] = pairs[i + 1]
            i += 2
        if set(found) != {1, 2}:
            raise DriverError(f"a kernel node's packed arguments hold keys {sorted(found)}, xform reads 1 and 2")
        self.size = ctypes.c_size_t(ctypes.c_size_t.from_address(found[2]).value)
        self.buffers = [ctypes.create_string_buffer(ctypes.string_at(found[1], self.size.value), self.size.value)]
        self.array = (ctypes.c_void_p * 5)(1, ctypes.addressof(self.buffers[0]), 2, ctypes.addressof(self.size), 0)
        self.params.extra = ctypes.cast(self.array, ctypes.c_void_p)
        return self.size.value

    def words(self) -> list[int]:
        return [struct.unpack_from("<Q", self.buffers[i], offset)[0] for i, offset in self.slots]

    def set(self, exec_: ctypes.c_void_p, values: dict[int, int], _ctx: ctypes.c_void_p) -> None:
        for word, value in values.items():
            i, offset = self.slots[word]
            struct.pack_into("<Q", self.buffers[i], offset, value)
        _check("cuGraphExecKernelNodeSetParams_v2", exec_, self.node, ctypes.byref(self.params))


class _Memset:
    def __init__(self, node: ctypes.c_void_p) -> None:
        self.node, self.params = node, _MemsetParams()
        _check("cuGraphMemsetNodeGetParams", node, ctypes.byref(self.params))

    def words(self) -> list[int]:
        return [self.params.dst]

    def set(self, exec_: ctypes.c_void_p, values: dict[int, int], ctx: ctypes.c_void_p) -> None:
        self.params.dst = values[0]
        _check("cuGraphExecMemsetNodeSetParams", exec_, self.node, ctypes.byref(self.params), ctx)


class _Memcpy:
    def __init__(self, node: ctypes.c_void_p) -> None:
        self.node, self.params = node, _Memcpy3D()
        _check("cuGraphMemcpyNodeGetParams", node, ctypes.byref(self.params))

    def words(self) -> list[int]:  # a host or array side has no device word: 0 never lies in a span
        return [self.params.src_device if self.params.src_type in _DEVICE_MEMORY else 0,
                self.params.dst_device if self.params.dst_type in _DEVICE_MEMORY else 0]

    def set(self, exec_: ctypes.c_void_p, values: dict[int, int], ctx: ctypes.c_void_p) -> None:
        if 0 in values:
            self.params.src_device = values[0]
        if 1 in values:
            self.params.dst_device = values[1]
        _check("cuGraphExecMemcpyNodeSetParams", exec_, self.node, ctypes.byref(self.params), ctx)


class DriverGraph:
    """The nodes of a recorded graph (`torch.cuda.CUDAGraph(keep_graph=True)`, instantiated), read
    once; `set(values)` writes new words into the instantiated graph before a launch."""

    def __init__(self, raw_graph: int, raw_exec: int) -> None:
        self._exec = ctypes.c_void_p(raw_exec)
        self._ctx = ctypes.c_void_p()
        _check("cuCtxGetCurrent", ctypes.byref(self._ctx))
        count = ctypes.c_size_t()
        _check("cuGraphGetNodes", ctypes.c_void_p(raw_graph), None, ctypes.byref(count))
        handles = (ctypes.c_void_p * max(1, count.value))()
        _check("cuGraphGetNodes", ctypes.c_void_p(raw_graph), handles, ctypes.byref(count))
        self.nodes: list[_Kernel | _Memset | _Memcpy] = []
        kinds = {_KERNEL: _Kernel, _MEMCPY: _Memcpy, _MEMSET: _Memset}
        for handle in handles[:count.value]:
            node, kind = ctypes.c_void_p(handle), ctypes.c_int()
            _check("cuGraphNodeGetType", node, ctypes.byref(kind))
            if kind.value in kinds:
                self.nodes.append(kinds[kind.value](node))
            elif kind.value not in _NO_ADDRESSES:
                raise DriverError(f"the graph holds a {_NODE_TYPES.get(kind.value, f'type {kind.value}')} node, "
                                  f"whose addresses xform does not read")

    def words(self) -> list[list[int]]:
        return [node.words() for node in self.nodes]

    def set(self, values: dict[int, dict[int, int]]) -> None:
        for index, node_values in values.items():
            self.nodes[index].set(self._exec, node_values, self._ctx)
