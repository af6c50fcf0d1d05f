"""The latency search against the best baseline: milp's makespan over the best other placer's, at one budget.

Problems: the known-optimum layered family's members (``known200``: 200 tasks on 4 identical devices, ``known500``:
500 on 6; :mod:`bench.known_split`), random layered DAGs on heterogeneous devices with device-side communication
(``random300-s0``: :func:`moirai.testing.random_layered_problem` (300, 4, seed 0, ``cpu_ratio=0.3``)) and zoo models
on a paper cluster (``googlenet:full@moirai-inter-server``: fusion rules, analytic costs, as ``bench/run.py``).
The baselines are every placer the milp placer starts from plus ``contiguous``; every value is the simulator's.
``bound ms`` is milp's (:func:`moirai.lower_bound`); ``--cut-bound S`` adds the cut-task bound
(:mod:`moirai.planning.solve.segment_bound`, up to ``S`` seconds of MILPs), where the graph has cut tasks.

Run::

    python bench/latency_search.py --time-limit 30 known200 random300-s0 googlenet:full@moirai-inter-server
    python bench/latency_search.py --repo /tmp/base ...   # the same problems with another checkout's moirai

``--repo`` puts another checkout first on the import path, so one invocation per checkout, one after the other on
the same machine, compares two versions of the search (the problems are built the same way by both).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("problems", nargs="+", help="known<N>, random<N>-s<seed>, or model:size@cluster")
    parser.add_argument("--time-limit", type=float, default=30.0, help="milp's budget (s)")
    parser.add_argument("--repo", help="import moirai (and bench) from this checkout instead")
    parser.add_argument("--no-baselines", action="store_true", help="milp only (the baselines do not change)")
    parser.add_argument("--cut-bound", type=float, default=0.0, help="seconds for the cut-task bound (0: none)")
    return parser.parse_args()


def build_named(name: str):  # noqa: ANN201 - the Problem type is imported after the path is set
    from moirai.testing import random_layered_problem

    if name.startswith("known"):
        from bench.known_split import known_split_problem

        tasks = int(name.removeprefix("known"))
        devices = {200: 4, 500: 6, 1000: 8, 2000: 14}[tasks]
        return known_split_problem(tasks, devices, seed=0).problem
    if name.startswith("random"):
        tasks, seed = name.removeprefix("random").split("-s")
        return random_layered_problem(int(tasks), 4, int(seed), cpu_ratio=0.3)
    from bench.run import prepare_model
    from moirai.cluster.cost import build_problem
    from moirai.cluster.devices import Cluster

    model, cluster = name.split("@")
    graph = prepare_model(*model.split(":"), no_coarsen=False, target_nodes=None).graph
    return build_problem(graph, Cluster.preset(cluster))


def main() -> None:
    options = _arguments()
    root = Path(options.repo).resolve() if options.repo else Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from moirai.planning.placers import place, start_plans

    print(f"moirai from {root}; milp budget {options.time_limit:g} s")
    print(
        "| problem | tasks | best baseline (ms) | milp ms | milp / best | bound ms | cut bound ms | milp s | stop "
        "| windows |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in options.problems:
        problem = build_named(name)
        best_name, best_s = "-", float("inf")
        if not options.no_baselines:
            for placer in [s.name for s in start_plans("latency")] + ["contiguous"]:
                value = place(problem, placer).makespan_s
                if value < best_s:
                    best_name, best_s = placer, value
        started = time.perf_counter()
        plan = place(problem, "milp", time_limit_s=options.time_limit, progress=False)
        elapsed = time.perf_counter() - started
        report = plan.report
        ratio = f"{plan.makespan_s / best_s:.3f}" if best_s < float("inf") else "-"
        cut = "-"
        if options.cut_bound > 0:
            from moirai.planning.solve.segment_bound import segment_lower_bound

            found = segment_lower_bound(problem, options.cut_bound)
            cut = f"{found.bound_s * 1e3:.3f} ({found.cuts} cuts, {found.pieces_optimal}/{found.pieces_solved} optimal)"
        print(
            f"| {name} | {problem.num_tasks} | {best_name} {best_s * 1e3:.3f} | {plan.makespan_s * 1e3:.3f} | {ratio} "
            f"| {plan.lower_bound_s * 1e3:.3f} | {cut} | {elapsed:.1f} | {report.stop_reason} "
            f"| {report.windows_improved}/{report.windows_tried} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
