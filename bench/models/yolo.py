"""YOLOv5 (Ultralytics v6.0 layout) at the x scale: CSP (C3) backbone, SPPF, PANet neck, detect head with
box decoding. ``depth``/``width`` are YOLOv5's depth and width multiples (x: 1.33 / 1.25).
Input: one 640 x 640 image; output: (1, boxes, 85) decoded predictions over 80 classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.models.layers import ConvBnAct
from bench.models.spec import Family, PaperOpCounts, SizeSpec

_ANCHORS = ((10, 13, 16, 30, 33, 23), (30, 61, 62, 45, 59, 119), (116, 90, 156, 198, 373, 326))
_STRIDES = (8, 16, 32)
_CLASSES = 80


@dataclass(frozen=True)
class YoloConfig:
    depth: float = 1.33
    width: float = 1.25
    image_size: int = 640


def _conv(in_channels: int, out_channels: int, kernel: int = 1, stride: int = 1) -> ConvBnAct:
    return ConvBnAct(in_channels, out_channels, kernel, stride, activation=nn.SiLU)


class Bottleneck(nn.Module):
    def __init__(self, channels: int, shortcut: bool) -> None:
        super().__init__()
        self.reduce = _conv(channels, channels, 1)
        self.conv = _conv(channels, channels, 3)
        self.shortcut = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.reduce(x))
        return x + y if self.shortcut else y


class C3(nn.Module):
    """CSP bottleneck with three convolutions."""

    def __init__(self, in_channels: int, out_channels: int, repeats: int, shortcut: bool = True) -> None:
        super().__init__()
        hidden = out_channels // 2
        self.main = nn.Sequential(_conv(in_channels, hidden), *(Bottleneck(hidden, shortcut) for _ in range(repeats)))
        self.bypass = _conv(in_channels, hidden)
        self.merge = _conv(2 * hidden, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merge(torch.cat([self.main(x), self.bypass(x)], dim=1))


class SPPF(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        hidden = in_channels // 2
        self.reduce = _conv(in_channels, hidden)
        self.pool = nn.MaxPool2d(5, 1, 2)
        self.merge = _conv(4 * hidden, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.reduce(x)
        pooled1 = self.pool(x)
        pooled2 = self.pool(pooled1)
        return self.merge(torch.cat([x, pooled1, pooled2, self.pool(pooled2)], dim=1))


class Detect(nn.Module):
    """1x1 prediction convolutions per level and YOLOv5's box decoding (grids precomputed for the input size)."""

    def __init__(self, in_channels: tuple[int, ...], image_size: int) -> None:
        super().__init__()
        self.outputs = _CLASSES + 5
        self.anchors_per_cell = len(_ANCHORS[0]) // 2
        self.predict = nn.ModuleList(nn.Conv2d(c, self.anchors_per_cell * self.outputs, 1) for c in in_channels)
        for level, (anchors, stride) in enumerate(zip(_ANCHORS, _STRIDES, strict=True)):
            cells = math.ceil(image_size / stride)
            ys, xs = torch.meshgrid(torch.arange(cells), torch.arange(cells), indexing="ij")
            grid = torch.stack((xs, ys), -1).view(1, 1, cells, cells, 2).float() - 0.5
            anchor_sizes = torch.tensor(anchors, dtype=torch.float32).view(1, -1, 1, 1, 2)
            anchor_grid = anchor_sizes.expand(1, self.anchors_per_cell, cells, cells, 2).contiguous()
            self.register_buffer(f"grid{level}", grid, persistent=False)
            self.register_buffer(f"anchor_grid{level}", anchor_grid, persistent=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        decoded = []
        for level, (conv, x) in enumerate(zip(self.predict, features, strict=True)):
            batch, _, height, width = x.shape
            y = conv(x).view(batch, self.anchors_per_cell, self.outputs, height, width).permute(0, 1, 3, 4, 2).sigmoid()
            xy = (y[..., :2] * 2 + getattr(self, f"grid{level}")) * _STRIDES[level]
            wh = (y[..., 2:4] * 2) ** 2 * getattr(self, f"anchor_grid{level}")
            decoded.append(torch.cat([xy, wh, y[..., 4:]], dim=-1).view(batch, -1, self.outputs))
        return torch.cat(decoded, dim=1)


class YOLOv5(nn.Module):
    def __init__(self, config: YoloConfig) -> None:
        super().__init__()

        def ch(channels: int) -> int:
            return max(8, math.ceil(channels * config.width / 8) * 8)

        def n(repeats: int) -> int:
            return max(round(repeats * config.depth), 1)

        self.stem = nn.Sequential(
            ConvBnAct(3, ch(64), 6, 2, 2, nn.SiLU), _conv(ch(64), ch(128), 3, 2), C3(ch(128), ch(128), n(3))
        )
        self.p3 = nn.Sequential(_conv(ch(128), ch(256), 3, 2), C3(ch(256), ch(256), n(6)))
        self.p4 = nn.Sequential(_conv(ch(256), ch(512), 3, 2), C3(ch(512), ch(512), n(9)))
        self.p5 = nn.Sequential(_conv(ch(512), ch(1024), 3, 2), C3(ch(1024), ch(1024), n(3)), SPPF(ch(1024), ch(1024)))
        self.lateral5 = _conv(ch(1024), ch(512))
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.top_down4 = C3(2 * ch(512), ch(512), n(3), shortcut=False)
        self.lateral4 = _conv(ch(512), ch(256))
        self.out3 = C3(2 * ch(256), ch(256), n(3), shortcut=False)
        self.down3 = _conv(ch(256), ch(256), 3, 2)
        self.out4 = C3(2 * ch(256), ch(512), n(3), shortcut=False)
        self.down4 = _conv(ch(512), ch(512), 3, 2)
        self.out5 = C3(2 * ch(512), ch(1024), n(3), shortcut=False)
        self.detect = Detect((ch(256), ch(512), ch(1024)), config.image_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c3 = self.p3(self.stem(images))
        c4 = self.p4(c3)
        top5 = self.lateral5(self.p5(c4))
        top4 = self.lateral4(self.top_down4(torch.cat([self.upsample(top5), c4], dim=1)))
        p3 = self.out3(torch.cat([self.upsample(top4), c3], dim=1))
        p4 = self.out4(torch.cat([self.down3(p3), top4], dim=1))
        p5 = self.out5(torch.cat([self.down4(p4), top5], dim=1))
        return self.detect([p3, p4, p5])


def make_inputs(config: YoloConfig, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict[str, Any]]:
    return (torch.randn(1, 3, config.image_size, config.image_size, device=device, dtype=dtype),), {}


FAMILY = Family(
    name="yolov5",
    description="YOLOv5x, 640x640 image",
    sizes={
        "small": SizeSpec(YoloConfig(depth=0.33, width=0.125, image_size=128), None, paper_size=False),
        "x": SizeSpec(YoloConfig(), 86.7e6, PaperOpCounts(420)),
    },
    make_model=YOLOv5,
    make_inputs=make_inputs,
)
