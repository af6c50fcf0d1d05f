"""The generation step's sampler on one core: ``sample_tokens`` against the sort of the whole vocabulary it replaced
([Note: sampling among candidates] in moirai/generation/step.py), greedy rows, at the bench's and Llama 3's sizes;
and what ``ban_tokens`` adds to every step where no row bans a token ([Note: banned tokens]).

Run: ``python -m bench.sampler_speed``. Medians after warm-up, both measured in the same run.
"""

from __future__ import annotations

import statistics
import time

import torch

from moirai.generation.step import ban_tokens, sample_tokens

SIZES = ((1, 8192), (4, 8192), (1, 128256), (8, 128256))  # (rows, vocabulary): bench/generate.py's and Llama 3's


def _sorted_sampler(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The sampler before: every row's logits sorted, greedy or not."""
    temperature, top_k, top_p, uniform = rows.float().unbind(dim=-1)
    greedy = logits.argmax(dim=-1)
    sorted_logits, order = (logits / temperature.clamp_min(1e-5).unsqueeze(-1)).sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1]).unsqueeze(0)
    keep = (top_k.unsqueeze(-1) <= 0) | (rank < top_k.unsqueeze(-1))
    probabilities = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    keep = keep & ((probabilities.cumsum(dim=-1) - probabilities) < top_p.unsqueeze(-1))
    cdf = probabilities.masked_fill(~keep, 0.0).cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (uniform.unsqueeze(-1) * cdf[:, -1:]).contiguous(), right=True)
    sampled = order.gather(-1, pick.clamp_max(logits.shape[-1] - 1)).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


def _median_ms(sampler, logits: torch.Tensor, rows: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        sampler(logits, rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    print("| rows x vocabulary | sort, ms | candidates, ms | ratio | bans (none), ms |")
    print("|---|---|---|---|---|")
    for rows, vocabulary in SIZES:
        logits = torch.randn(rows, vocabulary, generator=torch.Generator().manual_seed(0))
        greedy = torch.tensor([[0.0, 0.0, 1.0, 0.0]]).repeat(rows, 1)
        repeats = 200 if vocabulary < 50_000 else 20
        before = _median_ms(_sorted_sampler, logits, greedy, repeats)
        now = _median_ms(sample_tokens, logits, greedy, repeats)
        nothing = torch.full((rows, 1), -1)  # a banned input whose rows ban nothing
        bans = _median_ms(ban_tokens, logits, nothing, repeats)
        print(f"| {rows} x {vocabulary:,} | {before:.2f} | {now:.2f} | {before / now:.1f}x | {bans:.3f} |")


if __name__ == "__main__":
    main()
