"""The demo behind ``python -m moirai demo``: plan a small decoder on a three-device cluster
whose devices differ in speed and memory, print the plan, run the split model in one process
per device and check its outputs against the original model's.

The three devices are logical CPU devices (separate processes messaging through shared memory,
or gloo where that is switched off) described as a fast device with little memory, a medium one
and a slow one with plenty: no single device holds the model, so the plan must split it.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import moirai
from moirai.cluster.devices import Cluster, Device
from moirai.planning.placers import check_options, spec, start_plans
from moirai.runtime import shm
from moirai.runtime.resources import apply_resources, rank_resources, restore_resources


class DecoderBlock(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width)
        self.attention = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyDecoder(torch.nn.Module):
    """A GPT-style decoder with tied input embedding and LM head (the tied weight may be split)."""

    def __init__(self, vocab: int = 4096, width: int = 256, layers: int = 6, heads: int = 8, context: int = 64) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = torch.nn.ModuleList(DecoderBlock(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("causal_mask", torch.triu(torch.full((context, context), float("-inf")), diagonal=1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embedding(tokens) + self.position[:length]
        mask = self.causal_mask[:length, :length]
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x) @ self.embedding.weight.T


# Every rank computes with one torch thread on any host, so the original run with one thread is what the split
# model must equal: a CPU's matrix products may sum in another order with another thread count.
RANK_THREADS = 1


def demo_cluster() -> Cluster:
    megabyte = 1e6
    devices = tuple(
        Device(
            name,
            "cpu",
            memory_bytes=memory_mb * megabyte,
            peak_flops=gflops * 1e9,
            memory_bandwidth_bytes_per_s=gb_per_s * 1e9,
            threads=RANK_THREADS,
        )
        for name, memory_mb, gflops, gb_per_s in (("fast", 16, 120, 40), ("medium", 12, 60, 20), ("slow", 64, 20, 10))
    )
    bandwidth = np.full((3, 3), 2e9)
    latency = np.full((3, 3), 50e-6)
    np.fill_diagonal(latency, 0.0)
    return Cluster(devices, bandwidth, latency)


def baselines() -> list[str]:
    """The placers the demo compares against: those the milp placer starts from that respect memory and are
    meant for latency, in the milp placer's order."""
    return [s.name for s in start_plans("latency") if s.respects_memory]


def compare_placers(problem: moirai.Problem, plan: moirai.Plan, console: Console) -> None:
    """Simulated latency of the chosen plan next to the published heuristics' on the same problem."""
    table = Table(title="the same problem placed by the baselines (simulated latency)")
    for column in ("placer", "latency", "moirai's speedup"):
        table.add_column(column, justify="left" if column == "placer" else "right")
    table.add_row(plan.placer, f"{plan.makespan_s * 1e3:.3f} ms", "")
    for name in baselines():
        if name == plan.placer:
            continue  # the row above
        try:
            baseline = moirai.place(problem, placer=name)
        except moirai.InfeasibleError:
            table.add_row(name, "does not fit", "")
            continue
        table.add_row(name, f"{baseline.makespan_s * 1e3:.3f} ms", f"{baseline.makespan_s / plan.makespan_s:.2f}x")
    console.print(table)


# The milp placer's limit in the demo, where none is given: a demo that shows a plan in seconds, not a minute.
DEMO_TIME_LIMIT_S = 20.0


def run_demo(placer: str = "milp", console: Console | None = None, time_limit_s: float | None = None) -> bool:
    """Plan, run and check the demo with ``placer``; ``time_limit_s`` for a placer that takes a limit (None: the
    milp placer's :data:`DEMO_TIME_LIMIT_S`, another's default). Placer and limit are checked before anything is
    printed."""
    console = console or Console()
    traits = spec(placer)  # an unknown placer is the registry's error
    if time_limit_s is None and placer == "milp":
        time_limit_s = DEMO_TIME_LIMIT_S
    options = {} if time_limit_s is None else {"time_limit_s": time_limit_s}
    check_options(traits, options)  # a limit the placer does not take is refused, not dropped
    torch.manual_seed(0)
    model = TinyDecoder().eval()
    tokens = torch.randint(0, 4096, (2, 64))
    cluster = demo_cluster()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    console.print(
        f"[bold]moirai demo[/]: TinyDecoder ({parameters / 1e6:.1f} MB of weights) on "
        + ", ".join(
            f"{d.name} ({d.memory_bytes / 1e6:.0f} MB, {d.peak_flops / 1e9:.0f} GFLOP/s)" for d in cluster.devices
        )
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        # Its speeds are described, not this host's, and it checks outputs, not times: on a host with fewer cores
        # than its three devices, their sharing cores changes nothing the demo shows.
        warnings.simplefilter("ignore", moirai.OversubscriptionWarning)
        compiled = moirai.compile(model, cluster, example_inputs=(tokens,), placer=placer, **options)
    console.print(f"compiled in {time.perf_counter() - start:.1f} s")
    compiled.summary(console)
    compare_placers(compiled.problem, compiled.plan, console)
    with torch.no_grad():
        actual = compiled.run_distributed(tokens)
        here = model(tokens)
        before = apply_resources(rank_resources(cluster.devices)[0], cluster.devices[0].name, own_process=False)
        try:
            expected = model(tokens)  # as rank 0 runs, with the ranks' one thread
        finally:
            restore_resources(before)
    used = len(set(compiled.node_device.values()))
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as mismatch:
        console.print(f"[red]outputs differ[/] from the original run with {RANK_THREADS} thread(s): {mismatch}")
        return False
    console.print(
        f"[green]outputs match[/]: split model on {used} processes ({shm.host_transport()}) vs original, both with "
        f"{RANK_THREADS} thread(s) per process, max abs difference {(actual - expected).abs().max().item():.2e} "
        f"(vs the original with this process's {torch.get_num_threads()} threads: "
        f"{(actual - here).abs().max().item():.2e})"
    )
    return True
