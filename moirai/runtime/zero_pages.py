"""Zero-filled tensors that take memory only where they are written, and the test for a storage of zeros.

A KV cache is zeros until sequences fill it, and a model's cache for every slot and layer is often larger than its
weights. [Note: zeros where they are used] A cache that ``torch.zeros`` allocated in the calling process was
committed there whole (every page written by the fill), even though each rank uses only its own layers' share, and
it was then copied byte for byte into every rank's load payload. Two things avoid both:

- :func:`zeros_on_demand` maps anonymous memory, which the kernel gives as zero pages and makes resident one page
  at a time as it is written: the calling process's copy of a cache takes no memory until a sequence writes it,
  and moving it to a GPU reads zero pages without making them resident. (The kernel may still count the whole
  map against its commit limit: under ``vm.overcommit_memory=2`` it does, and a map larger than memory and swap
  fails under the default heuristic, as an allocation of that size would.)
- :func:`is_all_zero` lets the program codec send a storage of zeros as its size alone; the receiving rank maps
  its own zero pages (``moirai.runtime.program_codec``).
"""

from __future__ import annotations

import mmap

import torch

# Weights are rarely zero in their first bytes: a storage whose first block is not all zero is decided at once.
_FIRST_BLOCK_BYTES = 4096


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages are committed only as they are written (anonymous memory)."""
    num_bytes = dtype.itemsize
    for size in shape:
        num_bytes *= size
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private (not mmap's default, shared): a forked child must not write its parent's pages, and shared anonymous
    # memory is committed as it is read.
    pages = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer holds a reference to the map, which stays open as long as a tensor uses it.
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def zero_storage(num_bytes: int) -> torch.Tensor:
    """A one-dimensional uint8 CPU tensor of ``num_bytes`` zeros, committed as written."""
    return zeros_on_demand((num_bytes,), torch.uint8)


def is_all_zero(storage: torch.Tensor) -> bool:
    """Whether every byte of the one-dimensional uint8 ``storage`` is zero (False for a meta tensor)."""
    if storage.is_meta or storage.numel() == 0:
        return False
    if storage[:_FIRST_BLOCK_BYTES].any():
        return False
    return not storage.any()
