"""The Transformer (Vaswani et al. 2017), base model: 6 encoder and 6 decoder post-LayerNorm layers,
width 512, 8 heads, feed-forward 2048, sinusoidal positions, one 37000-token vocabulary shared by both
embeddings and the output projection. Input: a 128-token source and a 128-token target sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.models.layers import FeedForward, MultiHeadAttention
from bench.models.spec import Family, PaperOpCounts, SizeSpec


@dataclass(frozen=True)
class TransformerConfig:
    layers: int = 6
    width: int = 512
    heads: int = 8
    feed_forward: int = 2048
    vocab: int = 37000
    sequence_length: int = 128


class EncoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attention = MultiHeadAttention(config.width, config.heads)
        self.attention_norm = nn.LayerNorm(config.width)
        self.feed_forward = FeedForward(config.width, config.feed_forward, nn.ReLU())
        self.feed_forward_norm = nn.LayerNorm(config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x))
        return self.feed_forward_norm(x + self.feed_forward(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config.width, config.heads)
        self.self_attention_norm = nn.LayerNorm(config.width)
        self.cross_attention = MultiHeadAttention(config.width, config.heads)
        self.cross_attention_norm = nn.LayerNorm(config.width)
        self.feed_forward = FeedForward(config.width, config.feed_forward, nn.ReLU())
        self.feed_forward_norm = nn.LayerNorm(config.width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.self_attention_norm(x + self.self_attention(x, causal=True))
        x = self.cross_attention_norm(x + self.cross_attention(x, memory))
        return self.feed_forward_norm(x + self.feed_forward(x))


def sinusoidal_positions(length: int, width: int) -> torch.Tensor:
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


class Transformer(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.embedding_scale = math.sqrt(config.width)
        self.embedding = nn.Embedding(config.vocab, config.width)
        self.register_buffer("positions", sinusoidal_positions(config.sequence_length, config.width), persistent=False)
        self.encoder = nn.ModuleList(EncoderLayer(config) for _ in range(config.layers))
        self.decoder = nn.ModuleList(DecoderLayer(config) for _ in range(config.layers))

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        memory = self._embed(source)
        for layer in self.encoder:
            memory = layer(memory)
        x = self._embed(target)
        for layer in self.decoder:
            x = layer(x, memory)
        return x @ self.embedding.weight.t()

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens) * self.embedding_scale + self.positions[: tokens.shape[1]]


def make_inputs(config: TransformerConfig, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict[str, Any]]:
    shape = (1, config.sequence_length)
    source = torch.randint(0, config.vocab, shape, device=device)
    return (source, torch.randint(0, config.vocab, shape, device=device)), {}


FAMILY = Family(
    name="transformer",
    description="Transformer base (enc-dec), 128 tokens",
    sizes={
        "small": SizeSpec(TransformerConfig(2, 64, 4, 256, vocab=1000, sequence_length=16), None, paper_size=False),
        "base": SizeSpec(TransformerConfig(), 65e6, PaperOpCounts(1375)),
    },
    make_model=Transformer,
    make_inputs=make_inputs,
)
