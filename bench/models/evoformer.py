"""AlphaFold2 Evoformer stack (Jumper et al. 2021, Suppl. Alg. 6): MSA row attention with pair bias, MSA
column attention, MSA transition, outer product mean, triangle multiplication (outgoing, incoming),
triangle attention (starting, ending node), pair transition; then the single representation projection.

Table IV gives blocks / MSA width / MSA heads: {48, 64, 96, 128} / {256, 512, 1024, 1024} / {8, 16, 32, 32};
head width is 32 everywhere (as in AlphaFold2). The pair width is not given: 87M is AlphaFold2's own Evoformer
(pair width 128); for the others we chose the pair width that gives the nominal parameter count
(544 for 930M, 448 for 2.4B and 3.2B), with pair heads = pair width / 32.
Input: 128 MSA sequences (the paper's "sequence batch size of 128") of 256 residues.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.models.spec import Family, PaperOpCounts, SizeSpec

_HEAD_WIDTH = 32
_OUTER_PRODUCT_WIDTH = 32
_TRANSITION_FACTOR = 4
_SINGLE_WIDTH = 384


@dataclass(frozen=True)
class EvoformerConfig:
    blocks: int
    msa_width: int
    pair_width: int
    sequences: int = 128
    residues: int = 256


class GatedAttention(nn.Module):
    """Gated multi-head attention over the second-to-last axis, with an optional additive bias per head."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.q = nn.Linear(width, heads * _HEAD_WIDTH, bias=False)
        self.k = nn.Linear(width, heads * _HEAD_WIDTH, bias=False)
        self.v = nn.Linear(width, heads * _HEAD_WIDTH, bias=False)
        self.gate = nn.Linear(width, heads * _HEAD_WIDTH)
        self.out = nn.Linear(heads * _HEAD_WIDTH, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: (rows, length, width); ``bias``: (heads, length, length), shared by every row."""
        x = self.norm(x)
        rows, length, _ = x.shape
        q, k, v = (self._split_heads(proj(x)) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        attended = attended.transpose(1, 2).reshape(rows, length, -1)
        return self.out(torch.sigmoid(self.gate(x)) * attended)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        rows, length, _ = x.shape
        return x.view(rows, length, self.heads, _HEAD_WIDTH).transpose(1, 2)


class PairBias(nn.Module):
    """Per-head attention bias from the pair representation: (R, R, c_z) -> (heads, R, R)."""

    def __init__(self, pair_width: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(pair_width)
        self.linear = nn.Linear(pair_width, heads, bias=False)

    def forward(self, pair: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(pair)).permute(2, 0, 1)


class Transition(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.expand = nn.Linear(width, _TRANSITION_FACTOR * width)
        self.contract = nn.Linear(_TRANSITION_FACTOR * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.contract(F.relu(self.expand(self.norm(x))))


class OuterProductMean(nn.Module):
    def __init__(self, msa_width: int, pair_width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(msa_width)
        self.left = nn.Linear(msa_width, _OUTER_PRODUCT_WIDTH)
        self.right = nn.Linear(msa_width, _OUTER_PRODUCT_WIDTH)
        self.out = nn.Linear(_OUTER_PRODUCT_WIDTH**2, pair_width)

    def forward(self, msa: torch.Tensor) -> torch.Tensor:
        msa = self.norm(msa)
        sequences, residues, _ = msa.shape
        outer = torch.einsum("sic,sjd->ijcd", self.left(msa), self.right(msa)) / sequences
        return self.out(outer.reshape(residues, residues, -1))


class TriangleMultiplication(nn.Module):
    def __init__(self, pair_width: int, outgoing: bool) -> None:
        super().__init__()
        self.equation = "ikc,jkc->ijc" if outgoing else "kic,kjc->ijc"
        self.norm = nn.LayerNorm(pair_width)
        self.left = nn.Linear(pair_width, pair_width)
        self.left_gate = nn.Linear(pair_width, pair_width)
        self.right = nn.Linear(pair_width, pair_width)
        self.right_gate = nn.Linear(pair_width, pair_width)
        self.out_norm = nn.LayerNorm(pair_width)
        self.out = nn.Linear(pair_width, pair_width)
        self.out_gate = nn.Linear(pair_width, pair_width)

    def forward(self, pair: torch.Tensor) -> torch.Tensor:
        pair = self.norm(pair)
        left = torch.sigmoid(self.left_gate(pair)) * self.left(pair)
        right = torch.sigmoid(self.right_gate(pair)) * self.right(pair)
        combined = torch.einsum(self.equation, left, right)
        return torch.sigmoid(self.out_gate(pair)) * self.out(self.out_norm(combined))


class TriangleAttention(nn.Module):
    """Attention along rows of the pair representation (starting node) or along columns (ending node)."""

    def __init__(self, pair_width: int, heads: int, starting: bool) -> None:
        super().__init__()
        self.starting = starting
        self.bias = PairBias(pair_width, heads)
        self.attention = GatedAttention(pair_width, heads)

    def forward(self, pair: torch.Tensor) -> torch.Tensor:
        if not self.starting:
            pair = pair.transpose(0, 1)
        updated = self.attention(pair, self.bias(pair))
        return updated if self.starting else updated.transpose(0, 1)


class EvoformerBlock(nn.Module):
    def __init__(self, msa_width: int, pair_width: int) -> None:
        super().__init__()
        msa_heads, pair_heads = msa_width // _HEAD_WIDTH, pair_width // _HEAD_WIDTH
        self.row_bias = PairBias(pair_width, msa_heads)
        self.row_attention = GatedAttention(msa_width, msa_heads)
        self.column_attention = GatedAttention(msa_width, msa_heads)
        self.msa_transition = Transition(msa_width)
        self.outer_product_mean = OuterProductMean(msa_width, pair_width)
        self.triangle_outgoing = TriangleMultiplication(pair_width, outgoing=True)
        self.triangle_incoming = TriangleMultiplication(pair_width, outgoing=False)
        self.triangle_starting = TriangleAttention(pair_width, pair_heads, starting=True)
        self.triangle_ending = TriangleAttention(pair_width, pair_heads, starting=False)
        self.pair_transition = Transition(pair_width)

    def forward(self, msa: torch.Tensor, pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        msa = msa + self.row_attention(msa, self.row_bias(pair))
        msa = msa + self.column_attention(msa.transpose(0, 1)).transpose(0, 1)
        msa = msa + self.msa_transition(msa)
        pair = pair + self.outer_product_mean(msa)
        pair = pair + self.triangle_outgoing(pair)
        pair = pair + self.triangle_incoming(pair)
        pair = pair + self.triangle_starting(pair)
        pair = pair + self.triangle_ending(pair)
        return msa, pair + self.pair_transition(pair)


class Evoformer(nn.Module):
    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EvoformerBlock(config.msa_width, config.pair_width) for _ in range(config.blocks))
        self.single = nn.Linear(config.msa_width, _SINGLE_WIDTH)

    def forward(self, msa: torch.Tensor, pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            msa, pair = block(msa, pair)
        return self.single(msa[0]), pair


def make_inputs(config: EvoformerConfig, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict[str, Any]]:
    msa = torch.randn(config.sequences, config.residues, config.msa_width, device=device, dtype=dtype)
    pair = torch.randn(config.residues, config.residues, config.pair_width, device=device, dtype=dtype)
    return (msa, pair), {}


FAMILY = Family(
    name="evoformer",
    description="AlphaFold2 Evoformer, 128 sequences x 256 residues",
    sizes={
        "small": SizeSpec(EvoformerConfig(2, 64, 32, sequences=8, residues=16), None, paper_size=False),
        "87M": SizeSpec(EvoformerConfig(48, 256, 128), 87e6, PaperOpCounts(5136, 3618)),
        "930M": SizeSpec(EvoformerConfig(64, 512, 544), 930e6, PaperOpCounts(12992, 9252)),
        "2.4B": SizeSpec(EvoformerConfig(96, 1024, 448), 2.4e9, PaperOpCounts(37920, 26824)),
        "3.2B": SizeSpec(EvoformerConfig(128, 1024, 448), 3.2e9, PaperOpCounts(50560, 35096)),
    },
    make_model=Evoformer,
    make_inputs=make_inputs,
)
