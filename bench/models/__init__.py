"""The model zoo: the Moirai paper's model families at configurable size, built from plain torch.

Example::

    model, args, kwargs = build("gpt3", "13B", device="meta")   # fp16 weights on the meta device
    traced = moirai.trace(model, args, kwargs)

``small`` sizes (fp32, a few M parameters, small inputs) run for real on CPU; every other size is the
paper's and is built in fp16, as served. Build paper sizes on ``device="meta"``: planning needs shapes only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bench.models import evoformer, googlenet, gpt, inception, swin, transformer, yolo
from bench.models.spec import Family, PaperOpCounts, SizeSpec

ZOO: dict[str, Family] = {
    family.name: family
    for family in (
        gpt.FAMILY,
        swin.FAMILY,
        evoformer.FAMILY,
        googlenet.FAMILY,
        inception.FAMILY,
        yolo.FAMILY,
        transformer.FAMILY,
    )
}

__all__ = ["ZOO", "Family", "PaperOpCounts", "SizeSpec", "build", "model_sizes", "size_spec"]


def model_sizes(paper_sizes: bool | None = None) -> list[tuple[str, str]]:
    """Every ``(name, size)`` in the zoo; ``paper_sizes=True``/``False`` keeps only paper or only small sizes."""
    return [
        (name, size)
        for name, family in ZOO.items()
        for size, spec in family.sizes.items()
        if paper_sizes is None or spec.paper_size == paper_sizes
    ]


def size_spec(name: str, size: str) -> SizeSpec:
    if name not in ZOO:
        raise KeyError(f"unknown model {name!r}; the zoo has {sorted(ZOO)}")
    if size not in ZOO[name].sizes:
        raise KeyError(f"{name} has no size {size!r}; choose one of {list(ZOO[name].sizes)}")
    return ZOO[name].sizes[size]


def build(
    name: str, size: str = "small", device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """The model ``name`` at ``size`` in eval mode, with example inputs, all on ``device``.

    ``dtype`` defaults to fp16 for paper sizes and fp32 for ``small``. On ``device="meta"`` nothing
    is allocated, so a 13B model builds in seconds.
    """
    spec = size_spec(name, size)
    family = ZOO[name]
    device = torch.device(device)
    dtype = dtype or spec.dtype
    with device:
        model = family.make_model(spec.config)
    model = model.to(dtype).eval()
    args, kwargs = family.make_inputs(spec.config, device, dtype)
    return model, args, kwargs
