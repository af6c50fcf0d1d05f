"""Zero-filled tensors that take memory only where they are written, and the runs of a storage that are not zero.

A KV cache is zeros until sequences fill it, and a model's cache for every slot and layer is often larger than its
weights. [Note: zeros where they are used] A cache that ``torch.zeros`` allocated in the calling process was
committed there whole (every page written by the fill), even though each rank uses only its own layers' share, and
it was then copied byte for byte into every rank's load payload. Two things avoid both:

- :func:`zeros_on_demand` maps anonymous memory, which the kernel gives as zero pages and makes resident one page
  at a time as it is written: the calling process's copy of a cache takes no memory until a sequence writes it,
  and moving it to a GPU reads zero pages without making them resident. (The kernel may still count the whole
  map against its commit limit: under ``vm.overcommit_memory=2`` it does, and a map larger than memory and swap
  fails under the default heuristic, as an allocation of that size would.)
- :func:`written_runs` lets the program codec send a storage of zeros as its size alone, and one that sequences
  have written in part (a local ``generate`` before a server) as its size and the blocks that are not zero; the
  receiving rank maps its own zero pages and copies those blocks in (``moirai.runtime.program_codec``).
"""

from __future__ import annotations

import mmap

import torch

# What a storage is scanned in: a run of a cache that a sequence wrote travels in blocks of this size. Weights are
# rarely zero anywhere: a storage whose first, middle and last blocks are all written travels whole, unscanned.
BLOCK_BYTES = 65536


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


def written_runs(storage: torch.Tensor) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of the one-dimensional uint8 ``storage`` that hold anything but zeros, in
    blocks of :data:`BLOCK_BYTES` (adjacent blocks merged): ``[]`` for a storage of zeros, the whole storage at
    once where its first, middle and last blocks are all written (weights: no scan), a few runs for a cache that a
    few sequences have written (from its first slot on)."""
    size = storage.numel()
    if size == 0:
        return []
    middle = size // 2
    samples = (storage[:BLOCK_BYTES], storage[middle : middle + BLOCK_BYTES], storage[-BLOCK_BYTES:])
    if all(bool(sample.any()) for sample in samples):
        return [(0, size)]
    whole_blocks = size // BLOCK_BYTES
    written = storage[: whole_blocks * BLOCK_BYTES].view(whole_blocks, BLOCK_BYTES).any(dim=1).tolist()
    if size % BLOCK_BYTES:
        written.append(bool(storage[whole_blocks * BLOCK_BYTES :].any()))
    runs: list[tuple[int, int]] = []
    for block, is_written in enumerate(written):
        if not is_written:
            continue
        start, end = block * BLOCK_BYTES, min((block + 1) * BLOCK_BYTES, size)
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs
