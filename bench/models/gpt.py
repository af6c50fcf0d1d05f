"""GPT-3 style decoder: pre-LayerNorm blocks, learned positions, causal attention, LM head tied to the embedding.

Sizes follow the GPT-3 paper's Table 2.1 (Brown et al. 2020): layers / width / heads. The Moirai paper's
Table IV labels the first one "330M" and gives the 1.3B model 32 layers; 32 layers at width 2048 would make
1.7B parameters, so the GPT-3 paper's 24 layers are used, with Table IV's 32 heads (the GPT-3 paper's 24
heads of width 128 do not divide width 2048). The GPT-3 paper counts
the 24 x 1024 model as 350M (it has 356M parameters with tied embeddings), so that is its nominal count.
The 13B model has width 5120 (the GPT-3 paper prints 5140, which 40 heads do not divide).
Input: one sequence of 2048 tokens (the Moirai paper's setting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.models.layers import FeedForward, MultiHeadAttention
from bench.models.spec import Family, PaperOpCounts, SizeSpec


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    width: int
    heads: int
    vocab: int = 50257
    sequence_length: int = 2048


class DecoderBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = MultiHeadAttention(width, heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = FeedForward(width, 4 * width, nn.GELU(approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), causal=True)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab, config.width)
        self.position_embedding = nn.Embedding(config.sequence_length, config.width)
        self.blocks = nn.Sequential(*(DecoderBlock(config.width, config.heads) for _ in range(config.layers)))
        self.final_norm = nn.LayerNorm(config.width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(tokens) + self.position_embedding.weight[: tokens.shape[1]]
        x = self.final_norm(self.blocks(x))
        return x @ self.token_embedding.weight.t()


def make_inputs(config: GPTConfig, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict[str, Any]]:
    return (torch.randint(0, config.vocab, (1, config.sequence_length), device=device),), {}


FAMILY = Family(
    name="gpt3",
    description="GPT-3 decoder, 2048 tokens",
    sizes={
        "small": SizeSpec(GPTConfig(4, 128, 4, vocab=1000, sequence_length=32), None, paper_size=False),
        "330M": SizeSpec(GPTConfig(24, 1024, 16), 350e6, PaperOpCounts(4872, 3682)),
        "1.3B": SizeSpec(GPTConfig(24, 2048, 32), 1.3e9, PaperOpCounts(9480, 7308)),
        "2.7B": SizeSpec(GPTConfig(32, 2560, 32), 2.7e9, PaperOpCounts(12640, 9825)),
        "13B": SizeSpec(GPTConfig(40, 5120, 40), 13e9, PaperOpCounts(19640, 15283)),
    },
    make_model=GPT,
    make_inputs=make_inputs,
)
