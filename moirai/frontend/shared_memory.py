"""Refuse a call whose input tensors share memory with a tensor the program writes in place.

Eager PyTorch sees a write through every alias: ``m(x, x)`` where ``forward`` does ``x.add_(1)`` changes what it
reads as ``y`` too. A split program treats each flat input as its own tensor (a part that writes an input writes a
copy of its own, and a spawned rank gets copies anyway), so such a call would give other outputs than the model,
which depend on the plan's order besides. Inputs that share memory but are only read are fine (the same tensor passed
twice is common); so are inputs of a program that writes none of them and no buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from moirai.errors import InputError


def check_no_written_aliases(
    inputs: Sequence[torch.Tensor],
    input_names: Sequence[str],
    written_inputs: Sequence[int],
    weights: Mapping[str, torch.Tensor],
    written_weights: Sequence[str],
    model_name: str,
) -> None:
    """:class:`moirai.InputError` where an input shares memory with another input or with a parameter or buffer of
    the program (``weights``), and the program writes one of the two in place (``written_inputs``: positions in
    ``inputs``; ``written_weights``: names in ``weights``). Costs nothing for a program that writes no state."""
    if not written_inputs and not written_weights:
        return
    named = [(f"input {i} ({name})", tensor) for i, (name, tensor) in enumerate(zip(input_names, inputs, strict=True))]
    for position in written_inputs:  # a written input against every other input and every weight
        others = [pair for i, pair in enumerate(named) if i != position]
        others += [(f"the model's {_kind(t)} {name!r}", t) for name, t in weights.items()]
        _refuse_overlap(named[position], others, model_name)
    for name in written_weights:  # a written buffer against every input
        weight = (f"the model's {_kind(weights[name])} {name!r}", weights[name])
        _refuse_overlap(weight, named, model_name)


def _kind(tensor: torch.Tensor) -> str:
    return "parameter" if isinstance(tensor, torch.nn.Parameter) else "buffer"


def _refuse_overlap(
    written: tuple[str, torch.Tensor], others: Sequence[tuple[str, torch.Tensor]], model_name: str
) -> None:
    written_name, written_tensor = written
    for other_name, other in others:
        if overlaps(written_tensor, other):
            raise InputError(
                f"{model_name}: {written_name} and {other_name} share memory, and the model writes the first in "
                "place; eager PyTorch sees the write through both, a split program does not, so its outputs would "
                "differ. Pass separate tensors (e.g. x.clone() for one of them)"
            )


def overlaps(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two tensors share a byte of memory (identical tensors too), whatever storage objects hold them (two
    ``torch.from_numpy`` views of one array are two storages over one memory). Views that interleave without a
    common byte (``b[:, 0]`` and ``b[:, 1]``) do not overlap; where the two span over
    :data:`_EXACT_CHECK_ELEMENTS` elements between them and their spans meet, they are taken to overlap."""
    if first.device != second.device or first.device.type == "meta" or not _has_bytes(first) or not _has_bytes(second):
        return False
    (first_start, first_end), (second_start, second_end) = _address_range(first), _address_range(second)
    if not (first_start < second_end and second_start < first_end):
        return False
    if first.numel() + second.numel() > _EXACT_CHECK_ELEMENTS:
        return True  # erring on the side of a refusal, which a .clone() answers
    return bool(np.intersect1d(_byte_addresses(first), _byte_addresses(second)).size)


# The most elements two tensors whose spans meet may hold for their bytes to be compared one by one (a few MB).
_EXACT_CHECK_ELEMENTS = 1 << 20


def _has_bytes(tensor: torch.Tensor) -> bool:
    return tensor.layout == torch.strided and not tensor.is_nested and tensor.numel() > 0


def _address_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The half-open range of memory addresses a non-empty strided tensor spans."""
    size = tensor.element_size()
    last = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * size


def _byte_addresses(tensor: torch.Tensor) -> np.ndarray:
    """Every memory address a non-empty strided tensor's elements occupy."""
    offsets = np.zeros(1, np.int64)
    for n, stride in zip(tensor.shape, tensor.stride(), strict=True):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    size = tensor.element_size()
    return np.unique((offsets[:, None] * size + np.arange(size, dtype=np.int64)).ravel()) + tensor.data_ptr()
