"""Storages and the CUDA caching allocator, where the public API stops short: a storage over
memory it does not own, a storage's identity, repointing or invalidating a storage, allocating
into a CUDA graph pool outside a capture, and cuBLAS's per-stream workspaces.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch



def unowned_storage(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A storage over `storage`'s memory that does not keep it allocated."""
    return torch._C._construct_storage_from_data_pointer(storage.data_ptr(), storage.device, storage.nbytes())


def storage_id(storage: torch.UntypedStorage) -> int:
    """The identity of the storage implementation behind `storage` (shared by every tensor viewing it)."""
    return storage._cdata


def swap_data_ptr(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
    """Exchange the memory of two storages; every tensor over `storage` follows (torch >= 2.13)."""
    storage._swap_data_ptr_(other)


def invalidate(storage: torch.UntypedStorage, message: str) -> None:
    """Make every later read of `storage`'s memory, through any tensor, raise `message` (how CUDA
    Graph Trees mark outputs a later replay overwrote; CUDA builds only)."""
    torch._C._set_storage_data_ptr_access_error_msg(storage._cdata, message)


def _ptrs_equal(args: list[Any], ptrs: list[int | None], idxs: list[int]) -> bool:
    return all(args[i].data_ptr() == ptrs[i] for i in idxs)


# whether args[i].data_ptr() == ptrs[i] for each i of idxs: the C++ check CUDA Graph Trees use
# (built with CUDA only), else the same test in Python
data_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", _ptrs_equal)


@contextlib.contextmanager
def allocating_to_pool(device: int, pool: Any) -> Iterator[None]:
    """Every allocation of this thread on `device` goes to the CUDA graph pool `pool`, uncaptured."""
    torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
    try:
        yield
    finally:
        torch._C._cuda_endAllocateToPool(device, pool)
        torch._C._cuda_releasePool(device, pool)


def clear_cublas_workspaces() -> None:
    """Free the workspaces cuBLAS keeps per stream, made by the first GEMMs on each stream."""
    torch._C._cuda_clearCublasWorkspaces()


def storage_of(ref: Any) -> torch.UntypedStorage | None:
    """The storage a `StorageWeakRef` refers to, or None once it died."""
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
