"""Serving throughput: requests/s through ``compiled.server()`` for planned and hand-made splits, against eager.

Run: ``python -m bench.serving [--quick] [--models mlp gpt2] [--requests 200]``.

Two logical CPU devices of one core each (``["cpu", "cpu"]``, ``cost="measured"``, profiled with the
one core and thread a rank gets), so every row uses the same two cores except eager, which is the
model called in this process on one core with one thread. Rows, each through the same server path:

* eager: the original model, requests back to back;
* latency plan: ``moirai.compile``'s plan, placed for the latency of one request;
* throughput plan: the same problem placed by ``milp`` with ``objective="throughput"`` (the period);
* even split: contiguous stages along a topological order with equal numbers of op groups per
  device (vLLM's default pipeline split, by layer count);
* speed split: contiguous stages whose compute is proportional to each device's speed.

Columns: requests/s with the server's requests in flight (after warm-up), the predicted requests/s
(a block of requests as the bench times it, from the first submit to the last output, simulated as a
stream of requests through the plan, :mod:`moirai.planning.stream`: its steady-state period, never shorter than
the busiest device or link per request, ``Timeline.period_s``, plus the pipeline's filling and draining),
their ratio, the speedup over eager, and the median latency of one request alone in the server
against the plan's simulated latency. One more row calls the latency plan without the server, one request
after another through a :class:`moirai.runtime.DistributedRunner` (the path ``bench/realized.py`` times), so
that what serving adds to a lone request's latency shows apart from the profile's error. Every output is
checked against eager. Targets (printed, not asserted): on the chain model the throughput plan >= 1.6x eager
requests/s and within 15% of its prediction; the latency plan's latency unchanged by serving through the
server (within 10% of the same plan called without it), and, stricter, within 10% of its prediction.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import moirai
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate
from moirai.planning.stream import simulate_stream
from moirai.runtime import DistributedRunner
from moirai.runtime.resources import RankResources, apply_resources, rank_resources, restore_resources
from moirai.runtime.server import Server

DEVICES = ["cpu", "cpu"]  # the default of --devices
DISTINCT_INPUTS = 8  # requests cycle through these; every output is checked against eager's for its input
CHAIN_MODEL = "mlp"
SPEEDUP_TARGET = 1.6
PREDICTION_TOLERANCE = 0.15
LATENCY_TOLERANCE = 0.10
UNSERVED = "latency plan, no server"


@dataclass(frozen=True)
class Workload:
    name: str
    model: torch.nn.Module
    inputs: list[tuple[torch.Tensor, ...]]  # distinct requests, each a tuple of positional arguments


@dataclass(frozen=True)
class Row:
    name: str
    requests_per_s: float
    latency_s: float  # median of requests served one at a time
    predicted_period_s: float | None = None
    predicted_latency_s: float | None = None


def chain_mlp(quick: bool) -> Workload:
    """A deep chain: no parallel branches, so only pipelining can use the second device."""
    width, layers, batch = (512, 12, 8) if quick else (1024, 12, 16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[module for _ in range(layers) for module in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    ).eval()
    return Workload(CHAIN_MODEL, model, [(torch.randn(batch, width),) for _ in range(DISTINCT_INPUTS)])


def gpt2_decoder(quick: bool) -> Workload:
    """A Hugging Face GPT-2 decoder from a config (GPT-2 small's width and heads), random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads, vocab, tokens = (2, 256, 4, 1024, 16) if quick else (4, 768, 12, 8192, 16)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, bos_token_id=0, eos_token_id=0, use_cache=False
    )
    model = GPT2LMHeadModel(config).eval()
    return Workload("gpt2", model, [(torch.randint(0, vocab, (1, tokens)),) for _ in range(DISTINCT_INPUTS)])


WORKLOADS: dict[str, Callable[[bool], Workload]] = {CHAIN_MODEL: chain_mlp, "gpt2": gpt2_decoder}


@contextmanager
def pinned(resources: RankResources, device_name: str) -> Iterator[None]:
    """This process on ``resources``' cores and threads (what rank 0 gets in the server), then as before."""
    before = apply_resources(resources, device_name)
    try:
        yield
    finally:
        restore_resources(before)


def stage_plan(problem: Problem, task_weight: np.ndarray, device_share: Sequence[float], name: str) -> Plan:
    """Contiguous pipeline stages along a topological order, stage ``k`` on device ``k`` holding ``device_share[k]``
    of the total ``task_weight``: each task goes to the stage that holds the middle of its weight."""
    order = np.array(problem.topological_order)
    weight = np.asarray(task_weight, float)[order]
    share = np.asarray(device_share, float)
    stage_ends = np.cumsum(share / share.sum())[:-1] * weight.sum()
    middles = np.cumsum(weight) - weight / 2
    placement = np.empty(problem.num_tasks, int)
    placement[order] = np.searchsorted(stage_ends, middles, side="right")
    plan = Plan(placement, problem.device_names, placer=name)
    plan.makespan_s = simulate(problem, plan).makespan_s
    return plan


@dataclass(frozen=True)
class Variant:
    """One way of answering requests: ``one`` answers a request alone, ``many`` a block of them (pipelined)."""

    name: str
    one: Callable[[tuple], Any]
    many: Callable[[list[tuple]], list]
    plan: Plan | None = None
    pipelined: bool = True  # ``many`` keeps several requests in flight (else one after another)


def eager_variant(model: torch.nn.Module) -> Variant:
    return Variant(
        "eager (1 device, 1 thread)", lambda request: model(*request), lambda block: [model(*r) for r in block]
    )


def served_variant(name: str, compiled: moirai.CompiledModel, server: Server) -> Variant:
    return Variant(
        name, lambda request: server.submit(*request).result(), lambda block: list(server.map(block)), compiled.plan
    )


def unserved_variant(compiled: moirai.CompiledModel, runner: DistributedRunner) -> Variant:
    """The plan called one request at a time through a runner, without the server's queues and threads."""

    def one(request: tuple) -> Any:
        flat = compiled.traced.flatten_inputs(request, {})
        return compiled.traced.unflatten_outputs(runner.run(compiled.program, flat))

    return Variant(UNSERVED, one, lambda block: [one(r) for r in block], compiled.plan, pipelined=False)


def measure(variants: list[Variant], workload: Workload, problem: Problem, options: argparse.Namespace) -> list[Row]:
    """Rounds of every variant in turn, so that load on the machine hits all alike: per round and variant,
    ``latency_requests`` requests alone, then a block of ``requests / rounds`` timed together. The first
    round is warm-up. Requests/s and latency are medians over the other rounds; every output is checked."""
    with torch.no_grad():
        expected = [workload.model(*inputs) for inputs in workload.inputs]
    block = max(1, options.requests // options.rounds)
    # A GPU's kernels sum in another order than the CPU's: its outputs are compared as bench/realized.py compares.
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if any(d.startswith("cuda") for d in options.devices) else {}
    rates_per_s: dict[str, list[float]] = {v.name: [] for v in variants}
    latencies_s: dict[str, list[float]] = {v.name: [] for v in variants}
    for round_index in range(1 + options.rounds):
        for variant in variants:
            indices = [(round_index * block + r) % DISTINCT_INPUTS for r in range(block)]
            durations = []
            with torch.no_grad():
                for index in indices[: options.latency_requests]:
                    begun = time.perf_counter()
                    variant.one(workload.inputs[index])
                    durations.append(time.perf_counter() - begun)
                started = time.perf_counter()
                outputs = variant.many([workload.inputs[index] for index in indices])
                elapsed = time.perf_counter() - started
            for index, output in zip(indices, outputs, strict=True):
                torch.testing.assert_close(
                    torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.cpu, output),
                    expected[index],
                    msg=lambda m, name=variant.name: f"{name}: {m}",
                    **tolerance,
                )
            if round_index > 0:
                rates_per_s[variant.name].append(block / elapsed)
                latencies_s[variant.name].extend(durations)
    return [
        Row(
            v.name,
            statistics.median(rates_per_s[v.name]),
            statistics.median(latencies_s[v.name]),
            predicted_period_s(problem, v, block),
            None if v.plan is None else v.plan.makespan_s,
        )
        for v in variants
    ]


def predicted_period_s(problem: Problem, variant: Variant, block: int) -> float | None:
    """The predicted time per request of ``variant``'s blocks: pipelined (:func:`block_period_s`), or one
    request after another (the plan's latency); None without a plan."""
    if variant.plan is None:
        return None
    return block_period_s(problem, variant.plan, block) if variant.pipelined else variant.plan.makespan_s


def block_period_s(problem: Problem, plan: Plan, block: int) -> float:
    """The predicted time per request of a block of ``block`` requests timed as :func:`measure` times them, from
    the first submit to the last output: the stream simulated through the plan, its filling and draining included
    (a block of 50 on the MLP chain: 2% slower than the steady state)."""
    return float(simulate_stream(problem, plan, block).request_finish_s.max()) / block


def bench_model(workload: Workload, options: argparse.Namespace) -> list[Row]:
    devices = options.devices
    rank0 = rank_resources(devices)[0]
    with pinned(rank0, devices[0]):
        # Profiled with rank 0's core and thread count, which every rank gets.
        compiled = moirai.compile(
            workload.model,
            devices,
            workload.inputs[0],
            cost="measured",
            placer="milp",
            time_limit_s=options.time_limit_s,
        )
    problem = compiled.problem
    plans = {
        "latency plan": compiled.plan,
        "throughput plan": moirai.place(problem, "milp", objective="throughput", time_limit_s=options.time_limit_s),
        "even split (layers)": stage_plan(problem, np.ones(problem.num_tasks), [1.0] * len(devices), "even split"),
        "speed split": stage_plan(problem, problem.mean_compute_s, problem.device_speed, "speed split"),
    }
    # Every server stays open (idle ranks cost nothing) so the rounds can alternate between them; this process is
    # rank 0 of each, on rank 0's core, where eager runs too.
    with pinned(rank0, devices[0]), ExitStack() as servers:
        variants = [eager_variant(workload.model)]
        for name, plan in plans.items():
            served = compiled if plan is compiled.plan else compiled.with_plan(plan)
            variants.append(served_variant(name, served, servers.enter_context(served.server())))
        runner = servers.enter_context(DistributedRunner(compiled.cluster.devices))
        variants.insert(2, unserved_variant(compiled, runner))
        return measure(variants, workload, problem, options)


def table_of(workload: Workload, rows: list[Row], devices: list[str]) -> Table:
    eager = rows[0]
    table = Table(title=f"{workload.name}: requests/s on {devices} (a CPU device: one core) vs eager on one core")
    columns = (
        "plan",
        "requests/s",
        "predicted req/s",
        "measured / predicted",
        "speedup over eager",
        "latency served (ms)",
        "plan latency (ms)",
        "served / plan latency",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "plan" else "right")
    for row in rows:
        predicted_rate = None if row.predicted_period_s is None else 1.0 / row.predicted_period_s
        table.add_row(
            row.name,
            f"{row.requests_per_s:.1f}",
            _or_dash(predicted_rate, "{:.1f}"),
            _or_dash(None if predicted_rate is None else row.requests_per_s / predicted_rate, "{:.2f}"),
            f"{row.requests_per_s / eager.requests_per_s:.2f}x",
            f"{row.latency_s * 1e3:.2f}",
            _or_dash(None if row.predicted_latency_s is None else row.predicted_latency_s * 1e3, "{:.2f}"),
            _or_dash(None if row.predicted_latency_s is None else row.latency_s / row.predicted_latency_s, "{:.2f}"),
        )
    return table


def targets(rows: list[Row]) -> list[str]:
    """The chain model's targets, as lines saying whether each was met (printed, not asserted)."""
    by_name = {row.name: row for row in rows}
    eager = rows[0]
    throughput = by_name["throughput plan"]
    speedup = throughput.requests_per_s / eager.requests_per_s
    off = throughput.requests_per_s * throughput.predicted_period_s - 1.0
    lines = [
        f"throughput plan / eager = {speedup:.2f}x (target >= {SPEEDUP_TARGET}x): {_met(speedup >= SPEEDUP_TARGET)}",
        f"throughput plan measured vs predicted: {off:+.0%} (target within {PREDICTION_TOLERANCE:.0%}): "
        f"{_met(abs(off) <= PREDICTION_TOLERANCE)}",
    ]
    latency, unserved = by_name["latency plan"], by_name[UNSERVED]
    for reference, what in ((unserved.latency_s, "without the server"), (latency.predicted_latency_s, "its plan")):
        off = latency.latency_s / reference - 1.0
        lines.append(
            f"latency plan served latency vs {what}: {off:+.0%} (target within {LATENCY_TOLERANCE:.0%}): "
            f"{_met(abs(off) <= LATENCY_TOLERANCE)}"
        )
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small models, few requests")
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--requests", type=int, default=200, help="requests timed per row, after a warm-up round")
    parser.add_argument("--rounds", type=int, default=4, help="the requests are timed in this many blocks per row")
    parser.add_argument("--latency-requests", type=int, default=8, help="requests served alone, per round and row")
    parser.add_argument("--devices", nargs="+", default=DEVICES, help="torch devices, e.g. cuda:0 cpu")
    parser.add_argument("--time-limit-s", type=float, default=10.0, help="the milp placer's time limit")
    options = parser.parse_args()
    if options.quick:
        options.requests, options.rounds, options.latency_requests = 24, 2, 4
    console = Console(width=200)
    for name in options.models:
        workload = WORKLOADS[name](options.quick)
        rows = bench_model(workload, options)
        console.print(table_of(workload, rows, options.devices))
        if name == CHAIN_MODEL:
            for line in targets(rows):
                console.print(f"  {line}")


if __name__ == "__main__":
    main()
