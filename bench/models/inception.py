"""Inception-v4 (Szegedy et al. 2017, Figs. 3-9): stem, 4 x Inception-A, Reduction-A, 7 x Inception-B,
Reduction-B, 3 x Inception-C, average pool, classifier. ``width`` scales every channel count for the
small variant. Input: one 299 x 299 image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.models.layers import ConvBnAct
from bench.models.spec import Family, PaperOpCounts, SizeSpec


@dataclass(frozen=True)
class InceptionV4Config:
    width: float = 1.0
    image_size: int = 299
    classes: int = 1000


class Branches(nn.Module):
    """Run every branch on the input and concatenate along channels."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


class SplitTail(nn.Module):
    """A 1xk and a kx1 convolution side by side on one input (Inception-C's widened branches)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.wide = ConvBnAct(in_channels, out_channels, (1, 3))
        self.tall = ConvBnAct(in_channels, out_channels, (3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.wide(x), self.tall(x)], dim=1)


def _pool_projection(in_channels: int, out_channels: int) -> nn.Module:
    return nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), ConvBnAct(in_channels, out_channels, 1))


class InceptionV4(nn.Module):
    def __init__(self, config: InceptionV4Config) -> None:
        super().__init__()

        def c(channels: int) -> int:
            return max(4, round(channels * config.width))

        stem_conv = [ConvBnAct(3, c(32), 3, 2, padding=0), ConvBnAct(c(32), c(32), 3, padding=0)]
        stem_conv.append(ConvBnAct(c(32), c(64), 3))
        mixed_3a = Branches(nn.MaxPool2d(3, 2), ConvBnAct(c(64), c(96), 3, 2, padding=0))
        channels = c(64) + c(96)
        mixed_4a = Branches(
            nn.Sequential(ConvBnAct(channels, c(64), 1), ConvBnAct(c(64), c(96), 3, padding=0)),
            nn.Sequential(
                ConvBnAct(channels, c(64), 1),
                ConvBnAct(c(64), c(64), (1, 7)),
                ConvBnAct(c(64), c(64), (7, 1)),
                ConvBnAct(c(64), c(96), 3, padding=0),
            ),
        )
        channels = 2 * c(96)
        mixed_5a = Branches(ConvBnAct(channels, c(192), 3, 2, padding=0), nn.MaxPool2d(3, 2))
        channels += c(192)
        blocks: list[nn.Module] = [*stem_conv, mixed_3a, mixed_4a, mixed_5a]
        for _ in range(4):
            blocks.append(
                Branches(
                    ConvBnAct(channels, c(96), 1),
                    nn.Sequential(ConvBnAct(channels, c(64), 1), ConvBnAct(c(64), c(96), 3)),
                    nn.Sequential(
                        ConvBnAct(channels, c(64), 1), ConvBnAct(c(64), c(96), 3), ConvBnAct(c(96), c(96), 3)
                    ),
                    _pool_projection(channels, c(96)),
                )
            )
            channels = 4 * c(96)
        blocks.append(
            Branches(
                ConvBnAct(channels, c(384), 3, 2, padding=0),
                nn.Sequential(
                    ConvBnAct(channels, c(192), 1), ConvBnAct(c(192), c(224), 3), ConvBnAct(c(224), c(256), 3, 2, 0)
                ),
                nn.MaxPool2d(3, 2),
            )
        )
        channels += c(384) + c(256)
        for _ in range(7):
            blocks.append(
                Branches(
                    ConvBnAct(channels, c(384), 1),
                    nn.Sequential(
                        ConvBnAct(channels, c(192), 1),
                        ConvBnAct(c(192), c(224), (1, 7)),
                        ConvBnAct(c(224), c(256), (7, 1)),
                    ),
                    nn.Sequential(
                        ConvBnAct(channels, c(192), 1),
                        ConvBnAct(c(192), c(192), (7, 1)),
                        ConvBnAct(c(192), c(224), (1, 7)),
                        ConvBnAct(c(224), c(224), (7, 1)),
                        ConvBnAct(c(224), c(256), (1, 7)),
                    ),
                    _pool_projection(channels, c(128)),
                )
            )
            channels = c(384) + 2 * c(256) + c(128)
        blocks.append(
            Branches(
                nn.Sequential(ConvBnAct(channels, c(192), 1), ConvBnAct(c(192), c(192), 3, 2, padding=0)),
                nn.Sequential(
                    ConvBnAct(channels, c(256), 1),
                    ConvBnAct(c(256), c(256), (1, 7)),
                    ConvBnAct(c(256), c(320), (7, 1)),
                    ConvBnAct(c(320), c(320), 3, 2, padding=0),
                ),
                nn.MaxPool2d(3, 2),
            )
        )
        channels += c(192) + c(320)
        for _ in range(3):
            blocks.append(
                Branches(
                    ConvBnAct(channels, c(256), 1),
                    nn.Sequential(ConvBnAct(channels, c(384), 1), SplitTail(c(384), c(256))),
                    nn.Sequential(
                        ConvBnAct(channels, c(384), 1),
                        ConvBnAct(c(384), c(448), (3, 1)),
                        ConvBnAct(c(448), c(512), (1, 3)),
                        SplitTail(c(512), c(256)),
                    ),
                    _pool_projection(channels, c(256)),
                )
            )
            channels = 6 * c(256)
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(channels, config.classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).mean(dim=(2, 3)))


def make_inputs(config: InceptionV4Config, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict[str, Any]]:
    return (torch.randn(1, 3, config.image_size, config.image_size, device=device, dtype=dtype),), {}


FAMILY = Family(
    name="inception_v4",
    description="Inception-v4, 299x299 image",
    sizes={
        "small": SizeSpec(InceptionV4Config(width=0.125, image_size=75, classes=100), None, paper_size=False),
        "full": SizeSpec(InceptionV4Config(), 42.7e6, PaperOpCounts(492)),
    },
    make_model=InceptionV4,
    make_inputs=make_inputs,
)
