"""GoogLeNet (Szegedy et al. 2014) with batch norm after every convolution, as served today; no auxiliary heads.

The 5x5 branches are 5x5 as in the paper (torchvision's copy uses 3x3). ``width`` scales every channel count
for the small variant. Input: one 224 x 224 image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.models.layers import ConvBnAct
from bench.models.spec import Family, PaperOpCounts, SizeSpec

# (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool projection) per inception module, paper Table 1.
_INCEPTION_3 = ((64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64))
_INCEPTION_4 = (
    (192, 96, 208, 16, 48, 64),
    (160, 112, 224, 24, 64, 64),
    (128, 128, 256, 24, 64, 64),
    (112, 144, 288, 32, 64, 64),
    (256, 160, 320, 32, 128, 128),
)
_INCEPTION_5 = ((256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128))


@dataclass(frozen=True)
class GoogLeNetConfig:
    width: float = 1.0
    image_size: int = 224
    classes: int = 1000


class Inception(nn.Module):
    def __init__(self, in_channels: int, channels: tuple[int, ...]) -> None:
        super().__init__()
        one, reduce3, three, reduce5, five, pool = channels
        self.out_channels = one + three + five + pool
        self.branch1 = ConvBnAct(in_channels, one, 1)
        self.branch3 = nn.Sequential(ConvBnAct(in_channels, reduce3, 1), ConvBnAct(reduce3, three, 3))
        self.branch5 = nn.Sequential(ConvBnAct(in_channels, reduce5, 1), ConvBnAct(reduce5, five, 5))
        self.branch_pool = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True), ConvBnAct(in_channels, pool, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch3(x), self.branch5(x), self.branch_pool(x)], dim=1)


class GoogLeNet(nn.Module):
    def __init__(self, config: GoogLeNetConfig) -> None:
        super().__init__()

        def scaled(channels: int) -> int:
            return max(4, round(channels * config.width))

        layers: list[nn.Module] = [
            ConvBnAct(3, scaled(64), 7, 2),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            ConvBnAct(scaled(64), scaled(64), 1),
            ConvBnAct(scaled(64), scaled(192), 3),
            nn.MaxPool2d(3, 2, ceil_mode=True),
        ]
        channels = scaled(192)
        for group_index, group in enumerate((_INCEPTION_3, _INCEPTION_4, _INCEPTION_5)):
            for spec in group:
                module = Inception(channels, tuple(scaled(c) for c in spec))
                channels = module.out_channels
                layers.append(module)
            if group_index < 2:
                layers.append(nn.MaxPool2d(3 if group_index == 0 else 2, 2, ceil_mode=True))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(channels, config.classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).mean(dim=(2, 3)))


def make_inputs(config: GoogLeNetConfig, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict[str, Any]]:
    return (torch.randn(1, 3, config.image_size, config.image_size, device=device, dtype=dtype),), {}


FAMILY = Family(
    name="googlenet",
    description="GoogLeNet (BN), 224x224 image",
    sizes={
        "small": SizeSpec(GoogLeNetConfig(width=0.25, image_size=64, classes=100), None, paper_size=False),
        "full": SizeSpec(GoogLeNetConfig(), 7.0e6, PaperOpCounts(306)),
    },
    make_model=GoogLeNet,
    make_inputs=make_inputs,
)
