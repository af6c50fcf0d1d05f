"""Decode groups as sequences leave: a split LLM's server after half its sequences, all of one decode group, ended.

Run: ``python -m bench.decode_groups [--layers 8] [--hidden 1024] [--sequences 8] [--new-tokens 48] [--runs 3]``.

bench/generate.py's Llama (random weights) split evenly over two logical CPU devices (``even_split``, analytic
costs) and served with ``sequences`` slots and as many sequences: the even-numbered ones, which join decode group
0, end with their first token, the others generate ``new-tokens`` tokens each. Until they leave the groups are even;
after, one group holds every sequence left. Decode tokens/s of the long sequences (tokens stamped from when each had
its first to when the first of them ended), with the engine's group balancing (``Engine._balance_groups``) and with
it switched off, alternating, ``runs`` each; every long sequence's tokens are checked against HF's greedy ones.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

import moirai
from bench.generate import PROMPT_TOKENS, even_split, make_model, prompts_for
from moirai.generation.engine import Engine


def served_tokens_per_s(lm: moirai.CompiledLM, prompts: list[torch.Tensor], new_tokens: int, expected) -> float:
    stamps: dict[int, list[float]] = {i: [] for i in range(1, len(prompts), 2)}

    def stamp(index: int):
        return lambda _token: stamps[index].append(time.perf_counter())

    with lm.server() as server:
        futures = [
            server.submit(p, max_new_tokens=1)
            if i % 2 == 0
            else server.submit(p, max_new_tokens=new_tokens, on_token=stamp(i))
            for i, p in enumerate(prompts)
        ]
        tokens = [future.result() for future in futures]
    if tokens[1::2] != expected:
        raise AssertionError("a long sequence's tokens differ from HF's greedy tokens")
    start = max(times[0] for times in stamps.values())
    end = min(times[-1] for times in stamps.values())
    return sum(start < t <= end for times in stamps.values() for t in times) / (end - start)


def main(argv: Sequence[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    model = make_model(args.layers, args.hidden, args.vocab)
    prompts = prompts_for(args.sequences, args.vocab)
    lm = moirai.compile_lm(
        model,
        ["cpu", "cpu"],
        max_batch_size=args.sequences,
        sequences=args.sequences,
        max_seq_len=PROMPT_TOKENS + args.new_tokens,
        max_prefill=PROMPT_TOKENS,
        prompt_tokens=PROMPT_TOKENS,
        new_tokens=args.new_tokens,
        cost="analytic",
        placer="contiguous",
        progress=False,
    )
    lm = even_split(lm)
    with torch.no_grad():
        expected = [
            model.generate(p[None], max_new_tokens=args.new_tokens, do_sample=False)[0, PROMPT_TOKENS:].tolist()
            for p in prompts[1::2]
        ]
    balance = Engine._balance_groups
    results: dict[str, list[float]] = {"balanced": [], "not balanced": []}
    try:
        for _ in range(args.runs):
            for name in results:
                Engine._balance_groups = balance if name == "balanced" else (lambda self: None)
                results[name].append(served_tokens_per_s(lm, prompts, args.new_tokens, expected))
    finally:
        Engine._balance_groups = balance
    table = Table(title=f"{args.sequences // 2} of {args.sequences} sequences left in one decode group: tokens/s")
    for column in ("groups", "median", "runs"):
        table.add_column(column)
    for name, values in results.items():
        table.add_row(name, f"{statistics.median(values):.1f}", ", ".join(f"{v:.1f}" for v in values))
    Console().print(table)
    ratio = statistics.median(results["balanced"]) / statistics.median(results["not balanced"])
    Console().print(f"balanced / not balanced: {ratio:.2f}")
    return results


if __name__ == "__main__":
    main()
