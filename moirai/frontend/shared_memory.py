"""Refuse a call whose input tensors share memory with a tensor the program writes in place.

Eager PyTorch sees a write through every alias: ``m(x, x)`` where ``forward`` does ``x.add_(1)`` changes what it
reads as ``y`` too. A split program treats each flat input as its own tensor (a part that writes an input writes a
copy of its own, and a spawned rank gets copies anyway), so such a call would give other outputs than the model,
which depend on the plan's order besides. Inputs that share memory but are only read are fine (the same tensor passed
twice is common); so are inputs of a program that writes none of them and no buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    """Whether two tensors share bytes of one storage (identical tensors too; a view within the other's span, even
    one that skips the other's elements, counts: the check is by byte range)."""
    if first.device != second.device or first.device.type == "meta" or not _has_bytes(first) or not _has_bytes(second):
        return False
    if first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return False
    (first_start, first_end), (second_start, second_end) = _byte_range(first), _byte_range(second)
    return first_start < second_end and second_start < first_end


def _has_bytes(tensor: torch.Tensor) -> bool:
    return tensor.layout == torch.strided and not tensor.is_nested and tensor.numel() > 0


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The half-open range of storage bytes a non-empty strided tensor spans."""
    size = tensor.element_size()
    start = tensor.storage_offset() * size
    last = sum((n - 1) * abs(stride) for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (last + 1) * size
