"""Generation across the split: tokens/s, TTFT and TPOT of a Llama-style model on two devices, predicted next to
measured, against Hugging Face's generate with the same cores and an even layer split through the same runtime.

Run: ``python -m bench.generate [--quick] [--layers 8] [--hidden 1024] [--new-tokens 32] [--max-seq-len N]
[--devices cpu cpu]``.

The model is a ``LlamaConfig`` with random weights (8 layers, hidden 1024 by default: a decode step of tens of ms on
one core). Two logical CPU devices of one core each (``["cpu", "cpu"]``: each rank pinned to its core, one thread);
Hugging Face's ``generate`` runs in this process with as many threads as the devices have cores. Rows:

* HF generate, one sequence, and a batch of 8 sequences (one call, padded batch);
* moirai, one sequence: the plan for one sequence (TTFT + n x TPOT), served alone;
* moirai, as many sequences in flight as stages, and 8 sequences: plans for that many sequences (the decode step
  time with one step per stage in flight), served together;
* even split: the layers cut in two halves by weight (vLLM's default pipeline split), same runtime, as many
  sequences as stages.

Columns: decode tokens/s measured and predicted (the plan's decode step time with its steps in flight), decode alone
as HF's rows are timed (each step of one call stamped as its logits come out): the tokens that came from when every
sequence had its first token (the last prefill done) to when the first of them ended; TTFT measured for a sequence
served alone (submit to first token) against the prefill's prediction; TPOT, each sequence's mean gap between its
tokens in that window, against the steps in flight times the step time (a sequence's next step waits for its token).
``cost="measured"`` profiles on the core and thread count a rank gets, and for several sequences in flight beside a
process computing on the other rank's core (the steady state). Every moirai row's tokens are checked against
HF's greedy tokens. Targets (printed, not asserted): as many sequences as stages >= 1.6x
one sequence's tokens/s; 8 sequences >= HF's batch of 8; measured TTFT and TPOT within 15% of predicted; the plan no
slower than the even split.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
import transformers
from rich.console import Console
from rich.table import Table

import moirai
from moirai.cluster.cost import COST_MODES
from moirai.frontend.state import mutable_buffers
from moirai.generation.lm import CompiledLM
from moirai.planning.plan import Plan

PROMPT_TOKENS = 32
HF_BATCH = 8
TOLERANCE = 0.15


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    tokens_per_s: float
    predicted_tokens_per_s: float | None = None
    ttft_s: float | None = None
    predicted_ttft_s: float | None = None
    tpot_s: float | None = None
    predicted_tpot_s: float | None = None
    equal: bool | None = None


def make_model(layers: int, hidden: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def prompts_for(count: int, vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (PROMPT_TOKENS,), generator=generator) for _ in range(count)]


def hf_rows(model: torch.nn.Module, prompts: Sequence[torch.Tensor], new_tokens: int, threads: int) -> list[Row]:
    """HF's ``generate`` on one sequence and on a batch, each timed step by step within one call (the median of
    three calls): TTFT to the first token's logits, decode from there to the last token's."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            one = prompts[0][None]
            model.generate(one, max_new_tokens=2, do_sample=False)  # warm-up
            ttft_s, decode_s = _hf_step_times(model, one, new_tokens)
            batch = torch.stack(list(prompts[:HF_BATCH]))
            _, batch_decode_s = _hf_step_times(model, batch, new_tokens)
    finally:
        torch.set_num_threads(previous)
    tpot_s = decode_s / (new_tokens - 1)
    return [
        Row("HF generate, 1 sequence", 1 / tpot_s, ttft_s=ttft_s, tpot_s=tpot_s),
        Row(f"HF generate, batch of {len(batch)}", len(batch) * (new_tokens - 1) / batch_decode_s),
    ]


class _StepClock(transformers.LogitsProcessor):
    """Stamps each step of ``generate`` as its logits come out (the forward done, before the token is picked)."""

    def __init__(self) -> None:
        self.stamps_s: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps_s.append(time.perf_counter())
        return scores


def _hf_step_times(model: torch.nn.Module, batch: torch.Tensor, new_tokens: int, repeats: int = 3):
    """Medians over ``repeats`` greedy calls of ``generate`` on ``batch``: the time to the first token's logits,
    and from there to the last token's (the decode steps alone: no subtraction of two noisy calls)."""
    ttfts_s, decodes_s = [], []
    for _ in range(repeats):
        clock = _StepClock()
        start_s = time.perf_counter()
        model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # a random model may pick its end token: every row times the same steps
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([clock]),
        )
        assert len(clock.stamps_s) == new_tokens, f"generate ran {len(clock.stamps_s)} steps, not {new_tokens}"
        ttfts_s.append(clock.stamps_s[0] - start_s)
        decodes_s.append(clock.stamps_s[-1] - clock.stamps_s[0])
    return statistics.median(ttfts_s), statistics.median(decodes_s)


def served_row(
    name: str, lm: CompiledLM, prompts: Sequence[torch.Tensor], new_tokens: int, expected: Sequence[list[int]]
) -> Row:
    """Tokens/s and each sequence's time per token with ``len(prompts)`` sequences together, and the TTFT of one
    sequence alone, on one server; predicted: the plan's decode step time with its steps in flight (a sequence's next
    step waits for its token: its time per token is the steps in flight times the step time), and the prefill's."""
    with lm.server() as server:
        server.submit(prompts[0], max_new_tokens=4).result()  # warm-up: workers started, parts loaded
        (alone,), _ = _timed_sequences(server, prompts[:1], 2)
        together, tokens = _timed_sequences(server, prompts, new_tokens)
    # Decode alone, as HF's batch row times it: from when every sequence has its first token (the last prefill done)
    # to when the first of them ends, the tokens that came in between.
    start_s, end_s = max(times[0] for times in together), min(times[-1] for times in together)
    window = [[t for t in times if start_s <= t <= end_s] for times in together]
    tokens_per_s = sum(sum(1 for t in times if t > start_s) for times in window) / (end_s - start_s)
    prediction = lm.prediction()
    steps = min(len(prompts), max(lm.objective.sequences, lm.stages))
    predicted_step_s = prediction.step_s if len(prompts) > 1 else prediction.tpot_s
    return Row(
        name,
        tokens_per_s,
        predicted_tokens_per_s=len(prompts) / (steps * predicted_step_s),
        ttft_s=alone[0],
        predicted_ttft_s=prediction.ttft_s,
        tpot_s=float(np.mean([np.mean(np.diff(times)) for times in window if len(times) > 1])),
        predicted_tpot_s=steps * predicted_step_s,
        equal=tokens == list(expected[: len(prompts)]),
    )


def _timed_sequences(server, prompts: Sequence[torch.Tensor], new_tokens: int):
    """Per sequence, the times (from submitting) its tokens came at; and its tokens."""
    stamps: list[list[float]] = [[] for _ in prompts]
    lock = threading.Lock()
    start = time.perf_counter()

    def stamp(index: int):
        def record(_token: int) -> None:
            with lock:
                stamps[index].append(time.perf_counter() - start)

        return record

    futures = [server.submit(p, max_new_tokens=new_tokens, on_token=stamp(i)) for i, p in enumerate(prompts)]
    tokens = [future.result(timeout=600) for future in futures]
    return stamps, tokens


def even_split(lm: CompiledLM) -> CompiledLM:
    """The step's op groups cut in topological order into contiguous halves of equal weight bytes (caches
    excluded), the cut moved off any cache's ops: vLLM's even layer split."""
    compiled = lm.compiled
    problem = compiled.problem
    devices = len(compiled.cluster)
    cache = {buffer.name for buffer in mutable_buffers(compiled.traced.graph_module)}
    weights = np.array(
        [
            sum(compiled.graph.parameter_bytes.get(p, 0.0) for p in node.param_names if p not in cache)
            for node in compiled.graph.nodes
        ]
    )
    order = sorted(range(problem.num_tasks), key=lambda i: problem.topological_position[i])
    cumulative = np.cumsum(weights[order]) / max(weights.sum(), 1.0)
    stage = np.minimum((cumulative * devices).astype(int), devices - 1)
    placement = np.zeros(problem.num_tasks, int)
    placement[order] = np.maximum.accumulate(stage)
    for members in getattr(problem, "colocated", ()):
        placement[list(members)] = placement[list(members)].min()
    plan = Plan(placement, problem.device_names, placer="even split")
    return dataclasses.replace(lm, compiled=compiled.with_plan(plan))


def print_table(rows: Sequence[Row], console: Console) -> None:
    table = Table(title="Generation: tokens/s, TTFT and TPOT, measured (predicted)", title_justify="left")
    for column in ("row", "tokens/s", "pred.", "ratio", "TTFT ms", "pred.", "TPOT ms", "pred.", "tokens = HF"):
        table.add_column(column, justify="left" if column == "row" else "right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    for row in rows:
        ratio = "-" if row.predicted_tokens_per_s is None else f"{row.tokens_per_s / row.predicted_tokens_per_s:.2f}"
        table.add_row(
            row.name,
            f"{row.tokens_per_s:.1f}",
            "-" if row.predicted_tokens_per_s is None else f"{row.predicted_tokens_per_s:.1f}",
            ratio,
            ms(row.ttft_s),
            ms(row.predicted_ttft_s),
            ms(row.tpot_s),
            ms(row.predicted_tpot_s),
            "-" if row.equal is None else str(row.equal),
        )
    console.print(table)


def print_targets(rows: dict[str, Row], stages: int, console: Console) -> None:
    one, in_flight, eight = rows["moirai, 1 sequence"], rows[f"moirai, {stages} in flight"], rows["moirai, 8 in flight"]
    hf_batch = rows[f"HF generate, batch of {HF_BATCH}"]
    checks = [
        (f"{stages} in flight >= 1.6x one sequence", in_flight.tokens_per_s / one.tokens_per_s, 1.6),
        ("8 in flight >= HF batch of 8", eight.tokens_per_s / hf_batch.tokens_per_s, 1.0),
        ("plan >= even split (tokens/s)", in_flight.tokens_per_s / rows["even split"].tokens_per_s, 1.0),
    ]
    for row in (one, in_flight, eight):
        for what, measured, predicted in (
            ("TTFT", row.ttft_s, row.predicted_ttft_s),
            ("TPOT", row.tpot_s, row.predicted_tpot_s),
        ):
            checks.append((f"{row.name}: {what} within 15% of predicted", measured / predicted, None))
    for label, value, floor in checks:
        met = abs(value - 1) <= TOLERANCE if floor is None else value >= floor
        console.print(f"{'met ' if met else 'MISS'} {label}: {value:.2f}")


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few tokens (a smoke run)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--max-seq-len", type=int, default=None, help="each cache slot's positions (default: the prompt and new tokens)"
    )
    parser.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
    parser.add_argument("--placer", default="milp")
    parser.add_argument("--cost", default="measured", choices=COST_MODES)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.vocab, args.new_tokens = 2, 128, 512, 6
    console = Console(width=max(Console().width, 120))
    model = make_model(args.layers, args.hidden, args.vocab)
    prompts = prompts_for(HF_BATCH, args.vocab)
    with torch.no_grad():
        expected = [
            model.generate(p[None], max_new_tokens=args.new_tokens, do_sample=False)[0, PROMPT_TOKENS:].tolist()
            for p in prompts
        ]
    stages = len(args.devices)
    options = {
        "max_seq_len": args.max_seq_len or PROMPT_TOKENS + args.new_tokens,
        "max_prefill": PROMPT_TOKENS,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.new_tokens,
        "placer": args.placer,
        "cost": args.cost,
        "progress": False,
    }
    if args.placer == "milp":
        options["time_limit_s"] = 5 if args.quick else 20
    rows = hf_rows(model, prompts, args.new_tokens, threads=stages)
    # cost="measured" profiles on the core and thread count a rank gets (moirai.cluster.cost.measured_compute_s).
    one = moirai.compile_lm(model, args.devices, max_batch_size=stages, sequences=1, **options)
    several = moirai.compile_lm(model, args.devices, max_batch_size=stages, sequences=stages, **options)
    eight = moirai.compile_lm(model, args.devices, max_batch_size=HF_BATCH, sequences=HF_BATCH, **options)
    rows.append(served_row("moirai, 1 sequence", one, prompts[:1], args.new_tokens, expected))
    rows.append(served_row(f"moirai, {stages} in flight", several, prompts[:stages], args.new_tokens, expected))
    rows.append(served_row("moirai, 8 in flight", eight, prompts[:HF_BATCH], args.new_tokens, expected))
    rows.append(served_row("even split", even_split(several), prompts[:stages], args.new_tokens, expected))
    print_table(rows, console)
    several.summary(console)
    print_targets({row.name: row for row in rows}, stages, console)
    return rows


if __name__ == "__main__":
    main()
