"""Pinned host memory without torch's rounding."""

from __future__ import annotations

import weakref

import torch


def pinned_empty(numel: int, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
    """A host tensor the copy engines can read and write while the CPU goes on. Registered with the driver as it
    is, not taken from torch's pinned allocator, which rounds every block up to a power of two: a 13.6 GiB buffer
    would hold 16."""
    tensor = torch.empty(numel, dtype=dtype)
    if cuda and numel:
        pin(tensor)
    return tensor


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """Registers a host tensor's memory (one it owns whole, such as a mapping of shared memory) with the driver, so
    that the copy engines read and write it directly; unregistered when the tensor object goes."""
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0))
    # Unregistered when this tensor object goes: freed memory still registered would make the next registration of
    # those pages fail. The caller keeps it (views made by slicing keep it through `_base`; a parameter given a view
    # through `.data` does not).
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
    return tensor
