"""How well the cost model predicts: single-device latency and link bandwidth, against real runs here.

Run: ``python -m bench.cost_fidelity [--models gpt3 googlenet ...] [--threads 1] [--group-size 8]``.

Latency: for every small model of the bench zoo (plus a plain MLP), the predicted single-device
latency is the sum of the compute times of its op groups on the local CPU, ``analytic``
(roofline from the detected CPU) and ``measured`` (every group timed inside runs of the whole
traced graph, median of repeats; see :mod:`moirai.cluster.cost`); the references are the traced fx graph
run whole, which is what moirai runs (on one device, and each part of a split model is such a
graph), and the eager model. The traced graph has no per-module Python calls, so on models made of
many small modules (the CNNs) it runs 15-30% faster than eager, and a prediction of what moirai
runs is that much below eager. The graph is measured per op and coarsened into contiguous groups
of ``--group-size`` ops in graph order (a stand-in for the coarsener: contiguous groups of a
topological order keep the graph acyclic). Profiles go to a fresh cache, so every number is
measured in this run; real and measured alternate over ``--rounds``
rounds and each column is the median over rounds. ``--threads`` sets torch's thread count for
every run (1 by default: on a shared machine, multi-threaded timings wait on descheduled threads).
Groups are profiled with ``clock=time.thread_time`` and the real model's reference is its median
CPU time (with one thread: its run time minus the time other processes held the core), printed
next to its median wall time: on a busy 2-core machine a run of a few ms is often preempted for a
whole time slice (~10 ms).

Links: ``moirai.cluster.calibration`` fits latency and bandwidth between two gloo processes from its default
1 KiB - 16 MiB sweep; a separate timing of 128 MiB messages gives the reference bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from bench.models import build, model_sizes
from moirai.cluster.calibration import DEFAULT_SIZES_BYTES, TransferTimings, measure_transfers
from moirai.cluster.cost import analytic_compute_s, node_dtypes, profile_nodes
from moirai.cluster.devices import Cluster
from moirai.frontend.graph import OpGraph, build_op_graph
from moirai.frontend.trace import trace

LARGE_TRANSFER_BYTES = 128 * 2**20


@dataclasses.dataclass(frozen=True)
class LatencyRow:
    model: str
    ops: int
    groups: int
    real_wall_s: float
    real_cpu_s: float
    fx_cpu_s: float
    analytic_s: float
    measured_per_op_s: float
    measured_grouped_s: float


def mlp() -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    layers = [nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10)]
    return nn.Sequential(*layers).eval(), (torch.randn(64, 512),), {}


def median_run_times_s(run: Callable[[], object], warmup: int = 3, repeats: int = 21) -> tuple[float, float]:
    """Median wall time and median CPU time of this thread over the same runs."""
    wall, cpu = [], []
    with torch.no_grad():
        for index in range(warmup + repeats):
            start_wall, start_cpu = time.perf_counter(), time.thread_time()
            run()
            if index >= warmup:
                wall.append(time.perf_counter() - start_wall)
                cpu.append(time.thread_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def contiguous_groups(graph: OpGraph, group_size: int) -> OpGraph:
    count = len(graph.nodes)
    return graph.merge([range(start, min(start + group_size, count)) for start in range(0, count, group_size)])


def latency_row(name: str, model: nn.Module, args: tuple, kwargs: dict, group_size: int, rounds: int) -> LatencyRow:
    """Medians over ``rounds`` rounds, each timing the real model then profiling into a fresh cache,
    so that both sides see the same (shared, busy) machine."""
    traced = trace(model, args, kwargs)
    graph = build_op_graph(traced)
    grouped = contiguous_groups(graph, group_size)
    detected = Cluster.detect().devices[0]
    # The detected CPU counts every core; the runs here use torch.get_num_threads() of them.
    share = torch.get_num_threads() / max(torch.get_num_threads(), os.cpu_count() or 1)
    device = dataclasses.replace(detected, peak_flops=detected.peak_flops * share)
    analytic = analytic_compute_s(graph, Cluster.from_links([device], []), node_dtypes(graph, traced)).sum()
    flat_inputs = traced.flatten_inputs(args, kwargs)
    wall, cpu, fx_cpu, per_op, per_group = [], [], [], [], []
    for _ in range(rounds):
        round_wall, round_cpu = median_run_times_s(lambda: model(*args, **kwargs))
        wall.append(round_wall)
        cpu.append(round_cpu)
        fx_cpu.append(median_run_times_s(lambda: traced.graph_module(*flat_inputs))[1])
        with tempfile.TemporaryDirectory(prefix="moirai-profiles-") as cache_dir:
            for target, profiled in ((per_op, graph), (per_group, grouped)):
                times = profile_nodes(
                    profiled, traced, "cpu", cache_dir=cache_dir, progress=False, clock=time.thread_time
                )
                target.append(times.sum())
    median = statistics.median
    return LatencyRow(
        name,
        len(graph.nodes),
        len(grouped.nodes),
        median(wall),
        median(cpu),
        median(fx_cpu),
        analytic,
        median(per_op),
        median(per_group),
    )


def error(predicted: float, real: float) -> str:
    return f"{(predicted - real) / real:+.1%}"


def latency_table(rows: list[LatencyRow]) -> Table:
    table = Table(
        title=f"Single-device latency on this CPU ({torch.get_num_threads()} thread(s)): predicted vs real; "
        "errors against the eager model's CPU time (last column: against the traced fx graph's, which moirai runs)"
    )
    for column in (
        "model",
        "ops",
        "groups",
        "eager wall ms",
        "eager cpu ms",
        "fx cpu ms",
        "analytic ms",
        "err",
        "measured/op ms",
        "err",
        "measured/group ms",
        "err",
        "err vs fx",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        table.add_row(
            r.model,
            str(r.ops),
            str(r.groups),
            f"{r.real_wall_s * 1e3:.2f}",
            f"{r.real_cpu_s * 1e3:.2f}",
            f"{r.fx_cpu_s * 1e3:.2f}",
            f"{r.analytic_s * 1e3:.2f}",
            error(r.analytic_s, r.real_cpu_s),
            f"{r.measured_per_op_s * 1e3:.2f}",
            error(r.measured_per_op_s, r.real_cpu_s),
            f"{r.measured_grouped_s * 1e3:.2f}",
            error(r.measured_grouped_s, r.real_cpu_s),
            error(r.measured_grouped_s, r.fx_cpu_s),
        )
    return table


def link_table(rounds: int) -> Table:
    """Each round times the sweep and then the large messages in one session, so both see the same
    machine; the table shows the median over rounds."""
    fitted: dict[tuple[int, int], list[tuple[float, float]]] = {}
    reference: dict[tuple[int, int], list[float]] = {}
    for _ in range(rounds):
        timings = measure_transfers(["cpu", "cpu"], (*DEFAULT_SIZES_BYTES, LARGE_TRANSFER_BYTES), repeats=7)
        for link, measured in timings.items():
            sweep = TransferTimings(*(values[:-1] for values in dataclasses.astuple(measured)))
            cost = sweep.fit()
            fitted.setdefault(link, []).append((cost.latency_s, cost.bandwidth_bytes_per_s))
            reference.setdefault(link, []).append(LARGE_TRANSFER_BYTES / measured.delay_s[-1])
    table = Table(
        title=f"gloo link between two local processes: calibrated (1 KiB - 16 MiB sweep) vs 128 MiB "
        f"messages, median of {rounds} rounds"
    )
    for column in ("link", "fitted latency us", "fitted GB/s", "128 MiB GB/s", "err"):
        table.add_column(column, justify="right")
    for (src, dst), fits in sorted(fitted.items()):
        latency = statistics.median(fit[0] for fit in fits)
        bandwidth = statistics.median(fit[1] for fit in fits)
        large = statistics.median(reference[src, dst])
        table.add_row(
            f"rank{src} -> rank{dst}",
            f"{latency * 1e6:.0f}",
            f"{bandwidth / 1e9:.2f}",
            f"{large / 1e9:.2f}",
            error(bandwidth, large),
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    zoo = [name for name, _ in model_sizes(paper_sizes=False)]
    parser.add_argument("--models", nargs="*", default=["mlp", *zoo], help=f"from mlp {' '.join(zoo)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-links", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=190)
    rows = []
    console.print(f"load average before: {os.getloadavg()}")
    for name in args.models:
        torch.manual_seed(0)
        model, model_args, model_kwargs = mlp() if name == "mlp" else build(name, "small")
        rows.append(latency_row(name, model, model_args, model_kwargs, args.group_size, args.rounds))
    console.print(f"load average after: {os.getloadavg()}")
    console.print(latency_table(rows))
    if not args.skip_links:
        console.print(link_table(args.rounds))


if __name__ == "__main__":
    main()
