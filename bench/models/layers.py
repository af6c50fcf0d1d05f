"""Building blocks shared by several zoo families (plain torch, traceable by torch.export)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvBnAct(nn.Module):
    """Convolution without bias, batch norm, activation: the unit of GoogLeNet, Inception-v4 and YOLOv5."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int = 1,
        padding: int | tuple[int, int] | None = None,
        activation: type[nn.Module] = nn.ReLU,
    ) -> None:
        super().__init__()
        if padding is None:
            padding = tuple(k // 2 for k in kernel_size) if isinstance(kernel_size, tuple) else kernel_size // 2
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=1e-3)
        self.act = activation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate q/k/v projections; ``key_value`` defaults to ``query`` (self-attention)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, query: torch.Tensor, key_value: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        key_value = query if key_value is None else key_value
        batch, length, width = query.shape
        q = self._split_heads(self.q_proj(query))
        k = self._split_heads(self.k_proj(key_value))
        v = self._split_heads(self.v_proj(key_value))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out_proj(attended.transpose(1, 2).reshape(batch, length, width))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        return x.view(batch, length, self.heads, width // self.heads).transpose(1, 2)


class FeedForward(nn.Sequential):
    """Linear, activation, linear: the transformer MLP."""

    def __init__(self, width: int, hidden: int, activation: nn.Module) -> None:
        super().__init__(nn.Linear(width, hidden), activation, nn.Linear(hidden, width))
