"""What the zoo knows about a model family: its sizes and how to build the model and its inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn


class PaperOpCounts(NamedTuple):
    """Operator counts the Moirai paper reports (Table IV; Fig. 4 gives only the original graph)."""

    original: int
    coarsened: int | None = None


@dataclass(frozen=True)
class SizeSpec:
    """One size of a family: its hyperparameters, the parameter count it should have, the paper's op counts.

    ``nominal_params`` is the published parameter count (None for ``small`` sizes, which have none).

    ``paper_size`` sizes are built in fp16, as they would be served; ``small`` sizes in fp32 run on CPU in tests.
    """

    config: Any
    nominal_params: float | None
    paper_ops: PaperOpCounts | None = None
    paper_size: bool = True

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16 if self.paper_size else torch.float32


@dataclass(frozen=True)
class Family:
    """A model family: ``make_model(config)`` builds the module, ``make_inputs(config, device, dtype)`` its inputs."""

    name: str
    description: str
    sizes: dict[str, SizeSpec]
    make_model: Callable[[Any], nn.Module]
    make_inputs: Callable[[Any, torch.device, torch.dtype], tuple[tuple, dict[str, Any]]]
