"""What a one-device plan's predicted latency is made of, next to what its pieces take when they run: for finding
where a prediction misses (written for the CUDA rows of bench/RESULTS.md, "CUDA: the first runs", where plans on an
H200 were predicted 1.6-6x slower than they ran).

Run: ``python -m bench.prediction_terms [--devices cuda:0 cpu] [--models two_branch_mlp transformer]``.

Per model, ``moirai.compile(..., placer="single", cost="measured")`` on ``--devices`` (the plan holds every group on
one device), and columns:

* predicted: the plan's latency (the simulator's makespan);
* profiled: the sum of its groups' profiled compute times on the plan's device;
* request: the runtime's own work per request on that device (``RequestCosts.request_cpu_s``, calibrated on two CPU
  ranks), and the model outputs' way to device 0 (0 when the plan's device is device 0);
* graph: the traced graph run whole on that device, on the cores and threads of its rank, synchronized at the end
  (median of the runs after a second of warm-up), what the profile's groups should add up to;
* runner: the split program called through a :class:`moirai.runtime.DistributedRunner` (what bench/realized.py
  times), synchronized at the end.

profiled / graph says whether the profile of the groups misses; predicted - profiled what the other terms add;
runner / graph what the runtime adds that the model does not know.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

import moirai
from bench.realized import MODELS, make_model
from bench.serving import pinned
from moirai.cluster.kinds import kind_of
from moirai.frontend.trace import retarget_devices
from moirai.runtime import DistributedRunner
from moirai.runtime.resources import rank_resources

WARMUP_S = 1.0
REPEATS = 30


def median_s(call: Callable[[], object], synchronize: Callable[[], None]) -> float:
    """Median seconds of ``call`` synchronized, after at least :data:`WARMUP_S` of calls."""
    warm_until = time.perf_counter() + WARMUP_S
    while time.perf_counter() < warm_until:
        call()
        synchronize()
    times = []
    for _ in range(REPEATS):
        begun = time.perf_counter()
        call()
        synchronize()
        times.append(time.perf_counter() - begun)
    return statistics.median(times)


def terms(name: str, devices: Sequence[str]) -> list[str]:
    model, inputs, kwargs = make_model(name)
    compiled = moirai.compile(
        model, list(devices), example_inputs=inputs, example_kwargs=kwargs, placer="single", cost="measured"
    )
    problem, plan = compiled.problem, compiled.plan
    device = int(plan.placement[0])
    torch_device = torch.device(compiled.cluster.devices[device].torch_device)
    kind = kind_of(torch_device)

    def synchronize() -> None:
        kind.synchronize(torch_device)

    graph_module = copy.deepcopy(compiled.traced.graph_module).to(torch_device)
    retarget_devices(graph_module, torch_device)
    flat = [t.to(torch_device) for t in compiled.traced.flatten_inputs(inputs, kwargs)]
    resources = rank_resources(compiled.cluster.devices)
    names = [d.name for d in compiled.cluster.devices]
    with torch.no_grad():
        with pinned(resources[device], names[device]):  # the cores and threads the plan's rank computes with
            graph_s = median_s(lambda: graph_module(*flat), synchronize)
        # This process is rank 0 of the runner: on rank 0's cores and threads, as a server's driver is.
        with pinned(resources[0], names[0]), DistributedRunner(compiled.cluster.devices) as runner:
            host_flat = compiled.traced.flatten_inputs(inputs, kwargs)
            runner_s = median_s(lambda: runner.run(compiled.program, host_flat), synchronize)
    profiled_s = float(problem.compute_s[:, device].sum())
    outputs_s = float(problem.costs.output_s[:, device].max())
    return [
        name,
        f"{compiled.cluster.devices[device].name} ({torch_device})",
        f"{plan.makespan_s * 1e3:.3f}",
        f"{profiled_s * 1e3:.3f}",
        f"{problem.costs.request_cpu_s[device] * 1e3:.3f}",
        f"{outputs_s * 1e3:.3f}",
        f"{graph_s * 1e3:.3f}",
        f"{runner_s * 1e3:.3f}",
        f"{profiled_s / graph_s:.2f}",
        f"{runner_s / graph_s:.2f}",
        f"{runner_s / plan.makespan_s:.2f}",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", nargs="+", default=["cuda:0", "cpu"] if torch.cuda.is_available() else ["cpu"])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["two_branch_mlp", "transformer"])
    args = parser.parse_args(argv)
    table = Table(title=f"a one-device plan's prediction, term by term, on {args.devices} (ms)")
    columns = (
        "model",
        "plan's device",
        "predicted",
        "profiled",
        "request",
        "outputs",
        "graph",
        "runner",
        "profiled / graph",
        "runner / graph",
        "runner / predicted",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "plan's device") else "right")
    for name in args.models:
        table.add_row(*terms(name, args.devices))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
