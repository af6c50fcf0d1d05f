"""What one traced generation step costs on one core, by sequences and by the context they attend over.

Run: ``python -m bench.generation_step [--layers 8] [--hidden 1024] [--slots 8] [--max-seq-len 2048]
[--sequences 1 4] [--contexts 64 512 2048] [--repeats 7]``.

The step of bench/generate.py's Llama (random weights), traced as ``compile_lm`` traces it, run whole in this
process pinned to one core with one thread: a decode step of ``sequences`` rows at the last position of a context
of ``contexts`` positions (the rows' caches hold zeros; their values do not change the work). Median of
``--repeats`` runs after two. A step's cost should follow the context its rows attend over, not the slots'
``max_seq_len`` ([Note: the context a step attends over] in moirai/generation/step.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

from bench.generate import make_model
from bench.realized import median_time_s
from moirai.generation.engine import SamplingParams
from moirai.generation.lm import trace_step
from moirai.generation.step import CausalLMStep, context_input


def step_inputs(rows: int, context: int) -> tuple[torch.Tensor, ...]:
    """A greedy decode step of ``rows`` sequences in slots 0.., each at the last position of ``context``."""
    return (
        torch.zeros(rows, 1, dtype=torch.long),
        torch.full((rows, 1), context - 1),
        torch.arange(rows),
        torch.tensor(SamplingParams().row(0.0)).repeat(rows, 1),
        torch.full((rows, 4), -1),
        context_input(context),
    )


def main(argv: Sequence[str] | None = None) -> dict[tuple[int, int], float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    step = CausalLMStep(make_model(args.layers, args.hidden, args.vocab), args.slots, args.max_seq_len).eval()
    traced = trace_step(step, args.slots, 32)
    module = traced.graph_module
    times: dict[tuple[int, int], float] = {}
    with torch.no_grad():
        for rows in args.sequences:
            for context in args.contexts:
                flat = traced.flatten_inputs(step_inputs(rows, min(context, args.max_seq_len)), {})
                times[rows, context] = median_time_s(lambda flat=flat: module(*flat), 2, args.repeats)
    table = Table(title=f"Traced step, slots of {args.max_seq_len} positions, one core: ms (median of {args.repeats})")
    table.add_column("context")
    for rows in args.sequences:
        table.add_column(f"{rows} sequence(s)", justify="right")
    for context in args.contexts:
        table.add_row(str(context), *(f"{times[rows, context] * 1e3:.1f}" for rows in args.sequences))
    Console().print(table)
    return times


if __name__ == "__main__":
    main()
