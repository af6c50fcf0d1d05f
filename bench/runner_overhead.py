"""What a call through the runners costs on top of running the same part in this process.

Run: ``python -m bench.runner_overhead [--models transformer googlenet] [--calls 30] [--world-size 2]``.

For each model a single-device plan (every op on device 0) is run three ways, alternating call by
call so that load on the machine hits all alike: its one part's GraphModule called in this
process (no transport: a one-part program has no messages), the local runner
(:func:`moirai.runtime.run_local`, what ``compiled(x)`` calls: the part node by node, pausing where
a part waits for another's tensor) and :class:`moirai.runtime.DistributedRunner` with
``--world-size`` ranks (this process is rank 0; the others idle). All run inside the open runner,
so all use rank 0's share of the cores. The table gives medians after warm-up and the runners'
overheads; the distributed runner's target is at most 10% or 0.5 ms over in-process, whichever is
larger. On a loaded machine the medians swing with the
load (a preempted call waits a whole time slice); the minima show the cost without contention.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from bench.models import build
from moirai.frontend.trace import trace
from moirai.runtime import DistributedRunner, run_local
from moirai.runtime.split import split_module


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["transformer", "googlenet", "mlp"])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    options = parser.parse_args()
    title = f"single-device plan: in-process vs local runner and runner ({options.world_size} ranks), medians"
    table = Table(title=title)
    columns = (
        "model", "in-process", "local runner", "local / in-process", "runner", "runner / in-process", "overhead",
        "target met", "minima",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "model" else "right")
    with DistributedRunner(["cpu"] * options.world_size, timeout_s=60.0) as runner:
        for name in options.models:
            if name == "mlp":
                model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).eval()
                args: tuple = (torch.randn(8, 256),)
                kwargs: dict = {}
            else:
                model, args, kwargs = build(name, "small")
            traced = trace(model, args, kwargs)
            ops = [n.name for n in traced.graph_module.graph.nodes if n.op in ("call_function", "call_method")]
            program = split_module(traced, dict.fromkeys(ops, 0), 1)
            flat_inputs = traced.flatten_inputs(args, kwargs)
            part = program.parts[0].graph_module
            local_s, run_local_s, runner_s = [], [], []
            for call in range(options.warmup + options.calls):
                started = time.perf_counter()
                with torch.no_grad():
                    expected = list(part(None, *flat_inputs))
                    local_done = time.perf_counter()
                    local_outputs = run_local(program, flat_inputs, ["cpu"])
                middle = time.perf_counter()
                outputs = runner.run(program, flat_inputs)
                finished = time.perf_counter()
                if call >= options.warmup:
                    local_s.append(local_done - started)
                    run_local_s.append(middle - local_done)
                    runner_s.append(finished - middle)
            torch.testing.assert_close(outputs, expected)
            torch.testing.assert_close(local_outputs, expected)
            local_ms, run_local_ms, runner_ms = _median_ms(local_s), _median_ms(run_local_s), _median_ms(runner_s)
            met = runner_ms <= local_ms + max(0.1 * local_ms, 0.5)
            table.add_row(
                name,
                f"{local_ms:.3f} ms",
                f"{run_local_ms:.3f} ms",
                f"{run_local_ms / local_ms:.3f}",
                f"{runner_ms:.3f} ms",
                f"{runner_ms / local_ms:.3f}",
                f"{runner_ms - local_ms:+.3f} ms",
                "yes" if met else "no",
                f"{min(local_s) * 1e3:.3f} / {min(run_local_s) * 1e3:.3f} / {min(runner_s) * 1e3:.3f} ms",
            )
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
