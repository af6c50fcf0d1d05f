"""Where the throughput optimum lies: the period program over every task and link against contiguous's split.

For each ``MODEL:SIZE@CLUSTER`` (the zoo's models traced and coarsened as ``bench/run.py`` does, analytic costs) it
solves :func:`moirai.planning.solve.period_windows.period_lower_bound` from contiguous's plan and prints, over
contiguous's served period: the load bound, the program's proven bound on every placement's period, the shortest
period it found and that placement's served period (the runtime runs each device's part whole, so a placement that
leaves a device and comes back serves at its longest round trip, [Note: the period bound]). A found period below
contiguous's says the optimum is not contiguous; its served period says whether the runtime can serve it. Then the
same program over the placements whose devices' graph of tensors has no cycle (``acyclic=True``: each served at its
period): its bound and the period it found.

Run::

    python bench/period_bound.py --time-limit 120 gpt3:small@moirai-inter-server evoformer:small@moirai-intra-server
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.run import BASELINE, build_problem, prepare_model  # noqa: E402
from moirai.cluster.devices import Cluster  # noqa: E402
from moirai.planning.objective import Throughput  # noqa: E402
from moirai.planning.placers import place  # noqa: E402
from moirai.planning.plan import Plan  # noqa: E402
from moirai.planning.simulate import simulate  # noqa: E402
from moirai.planning.solve.period_windows import period_lower_bound  # noqa: E402


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("problems", nargs="+", metavar="MODEL:SIZE@CLUSTER", help="e.g. gpt3:small@moirai-inter-server")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds for each problem's program")
    return parser.parse_args(argv)


class PeriodRow(NamedTuple):
    model: str
    cluster: str
    tasks: int
    contiguous_s: float  # contiguous's served period
    load_bound_s: float
    bound_s: float  # the program's proven bound (never below the load bound)
    period_s: float  # the shortest period the program found (never above contiguous's)
    optimal: bool
    served_s: float  # that placement's served period
    seconds: float
    acyclic_bound_s: float  # the same over placements without a cycle between devices (served at their period)
    acyclic_period_s: float
    acyclic_optimal: bool

    def cells(self) -> list[str]:
        ratio = self.contiguous_s
        return [
            self.model,
            self.cluster,
            str(self.tasks),
            f"{self.contiguous_s * 1e3:.4f}",
            f"{self.load_bound_s / ratio:.4f}",
            f"{self.bound_s / ratio:.4f}",
            f"{self.period_s / ratio:.4f}" + (" (optimal)" if self.optimal else ""),
            f"{self.served_s / ratio:.4f}",
            f"{self.acyclic_bound_s / ratio:.4f}",
            f"{self.acyclic_period_s / ratio:.4f}" + (" (optimal)" if self.acyclic_optimal else ""),
            f"{self.seconds:.0f}",
        ]


def measure(spec: str, time_limit_s: float) -> PeriodRow:
    model, _, cluster = spec.partition("@")
    name, _, size = model.partition(":")
    problem = build_problem(prepare_model(name, size, False, None).graph, Cluster.preset(cluster))
    contiguous = place(problem, BASELINE, objective="throughput")
    started = time.perf_counter()
    found = period_lower_bound(problem, contiguous.placement, time_limit_s)
    acyclic = period_lower_bound(problem, contiguous.placement, time_limit_s, acyclic=True)
    seconds = time.perf_counter() - started
    return PeriodRow(
        model,
        cluster,
        problem.num_tasks,
        simulate(problem, contiguous).served_period_s,
        Throughput().lower_bound_s(problem),
        found.bound_s,
        found.period_s,
        found.optimal,
        simulate(problem, Plan(found.placement, problem.device_names)).served_period_s,
        seconds,
        max(acyclic.bound_s, found.bound_s),  # a bound on every placement holds for those without a cycle too
        acyclic.period_s,
        acyclic.optimal,
    )


def main(argv: list[str] | None = None) -> list[PeriodRow]:
    options = parse_arguments(argv)
    table = Table(title=f"The period program over every task ({options.time_limit:g} s), over {BASELINE}'s period")
    for column in (
        "model",
        "cluster",
        "tasks",
        f"{BASELINE} ms",
        "load bound",
        "proven bound",
        "period found",
        "its served period",
        "acyclic: bound",
        "acyclic: period found",
        "s (both)",
    ):
        table.add_column(column)
    rows = [measure(spec, options.time_limit) for spec in options.problems]
    for measured in rows:
        table.add_row(*measured.cells())
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return rows


if __name__ == "__main__":
    main()
