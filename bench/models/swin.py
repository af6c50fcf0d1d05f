"""Swin Transformer V2 (Liu et al. 2022): shifted-window scaled-cosine attention, log-spaced continuous
position bias, residual post-norm, patch merging between four stages.

Table IV gives layers / width / heads: {32, 48, 56} blocks, stage-1 width {512, 768, 1024}, stage-1 heads
{16, 24, 32} (head width 32; widths and heads double at every stage, as in SwinV2-G). The split of blocks
over the four stages is ours, chosen SwinV2-G-like (2, 2, many, few) to give the nominal parameter counts:
1.8B: (2, 2, 26, 2); 6.6B: (2, 2, 40, 4); 13B: (2, 2, 48, 4).
Input: one 1100 x 1100 image (the paper's setting), patch size 4, window 7. The 275 x 275 patch grid is
zero-padded once to 280 x 280 so windows tile every stage (the official code pads per block instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.models.spec import Family, PaperOpCounts, SizeSpec

_POSITION_BIAS_HIDDEN = 512
_MAX_LOGIT_SCALE = math.log(100.0)


@dataclass(frozen=True)
class SwinConfig:
    width: int
    depths: tuple[int, ...]
    first_stage_heads: int
    image_size: int = 1100
    patch_size: int = 4
    window: int = 7
    classes: int = 1000


def padded_grid(grid: int, stages: int, window: int) -> int:
    """Smallest grid >= ``grid`` that halves ``stages - 1`` times and is tiled by windows at every stage."""
    size = grid
    while any(size % 2**stage or (size // 2**stage) % min(window, size // 2**stage) for stage in range(stages)):
        size += 1
    return size


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """(B, H, W, C) -> (B, windows, window * window, C)."""
    batch, height, width, channels = x.shape
    x = x.view(batch, height // window, window, width // window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(batch, -1, window * window, channels)


def window_merge(windows: torch.Tensor, window: int, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`."""
    batch, channels = windows.shape[0], windows.shape[-1]
    x = windows.view(batch, height // window, width // window, window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(batch, height, width, channels)


def shifted_window_mask(size: int, window: int, shift: int) -> torch.Tensor:
    """Additive mask (windows, N, N) keeping attention inside the regions a cyclic shift brought together."""
    region = torch.zeros(1, size, size, 1)
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for label, (rows, cols) in enumerate((r, c) for r in bounds for c in bounds):
        region[:, rows, cols, :] = label
    labels = window_partition(region, window).squeeze(0).squeeze(-1)
    different = labels.unsqueeze(1) != labels.unsqueeze(2)
    return torch.zeros(different.shape).masked_fill(different, -100.0)


class WindowAttention(nn.Module):
    """Scaled cosine attention in windows with a continuous (log-spaced coordinates -> MLP) position bias."""

    def __init__(self, width: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.logit_scale = nn.Parameter(torch.full((heads, 1, 1), math.log(10.0)))
        self.position_bias_mlp = nn.Sequential(
            nn.Linear(2, _POSITION_BIAS_HIDDEN), nn.ReLU(), nn.Linear(_POSITION_BIAS_HIDDEN, heads, bias=False)
        )
        offsets = torch.arange(-(window - 1), window, dtype=torch.float32)
        table = torch.stack(torch.meshgrid(offsets, offsets, indexing="ij"), dim=-1) / max(window - 1, 1) * 8
        self.register_buffer("coords_table", torch.sign(table) * torch.log2(table.abs() + 1.0) / 3.0, persistent=False)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("bias_index", relative[..., 0] * (2 * window - 1) + relative[..., 1], persistent=False)

    def forward(self, windows: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, count, tokens, width = windows.shape
        q, k, v = self.qkv(windows).view(batch, count, tokens, 3, self.heads, -1).permute(3, 0, 1, 4, 2, 5).unbind(0)
        scale = torch.clamp(self.logit_scale, max=_MAX_LOGIT_SCALE).exp()
        q = F.normalize(q, dim=-1) * scale
        k = F.normalize(k, dim=-1)
        bias_table = self.position_bias_mlp(self.coords_table).view(-1, self.heads)
        bias = 16 * torch.sigmoid(bias_table[self.bias_index].permute(2, 0, 1))
        if mask is not None:
            bias = bias + mask.unsqueeze(1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.proj(attended.transpose(2, 3).reshape(batch, count, tokens, width))


class SwinBlock(nn.Module):
    def __init__(self, width: int, heads: int, grid: int, window: int, shifted: bool) -> None:
        super().__init__()
        self.window = min(window, grid)
        self.shift = self.window // 2 if shifted and grid > window else 0
        self.attention = WindowAttention(width, heads, self.window)
        self.attention_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.mlp_norm = nn.LayerNorm(width)
        mask = shifted_window_mask(grid, self.window, self.shift) if self.shift else None
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[1], x.shape[2]
        shifted = torch.roll(x, (-self.shift, -self.shift), (1, 2)) if self.shift else x
        attended = self.attention(window_partition(shifted, self.window), self.mask)
        attended = window_merge(attended, self.window, height, width)
        if self.shift:
            attended = torch.roll(attended, (self.shift, self.shift), (1, 2))
        x = x + self.attention_norm(attended)
        return x + self.mlp_norm(self.mlp(x))


class PatchMerging(nn.Module):
    """2 x 2 neighbouring patches -> one, width doubles (V2: norm after the reduction)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.reduction = nn.Linear(4 * width, 2 * width, bias=False)
        self.norm = nn.LayerNorm(2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, height, width, channels = x.shape
        x = x.view(batch, height // 2, 2, width // 2, 2, channels).permute(0, 1, 3, 4, 2, 5)
        return self.norm(self.reduction(x.reshape(batch, height // 2, width // 2, 4 * channels)))


class SwinV2(nn.Module):
    def __init__(self, config: SwinConfig) -> None:
        super().__init__()
        grid = config.image_size // config.patch_size
        self.padded_grid = padded_grid(grid, len(config.depths), config.window)
        self.patch_embedding = nn.Conv2d(3, config.width, config.patch_size, config.patch_size)
        self.embedding_norm = nn.LayerNorm(config.width)
        stages: list[nn.Module] = []
        for stage, depth in enumerate(config.depths):
            width, heads = config.width * 2**stage, config.first_stage_heads * 2**stage
            stage_grid = self.padded_grid // 2**stage
            stages.extend(SwinBlock(width, heads, stage_grid, config.window, bool(i % 2)) for i in range(depth))
            if stage < len(config.depths) - 1:
                stages.append(PatchMerging(width))
        self.stages = nn.Sequential(*stages)
        final_width = config.width * 2 ** (len(config.depths) - 1)
        self.final_norm = nn.LayerNorm(final_width)
        self.head = nn.Linear(final_width, config.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embedding_norm(self.patch_embedding(images).permute(0, 2, 3, 1))
        padding = self.padded_grid - x.shape[1]
        x = F.pad(x, (0, 0, 0, padding, 0, padding))
        x = self.final_norm(self.stages(x))
        return self.head(x.mean(dim=(1, 2)))


def make_inputs(config: SwinConfig, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict[str, Any]]:
    return (torch.randn(1, 3, config.image_size, config.image_size, device=device, dtype=dtype),), {}


FAMILY = Family(
    name="swin",
    description="Swin Transformer V2, 1100x1100 image",
    sizes={
        "small": SizeSpec(
            SwinConfig(32, (2, 2, 2, 2), 2, image_size=64, window=4, classes=100), None, paper_size=False
        ),
        "1.8B": SizeSpec(SwinConfig(512, (2, 2, 26, 2), 16), 1.8e9, PaperOpCounts(6496, 5204)),
        "6.6B": SizeSpec(SwinConfig(768, (2, 2, 40, 4), 24), 6.6e9, PaperOpCounts(14352, 11512)),
        "13B": SizeSpec(SwinConfig(1024, (2, 2, 48, 4), 32), 13e9, PaperOpCounts(22120, 17947)),
    },
    make_model=SwinV2,
    make_inputs=make_inputs,
)
