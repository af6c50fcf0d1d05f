"""Record every deterministic placer's simulated latency on the small zoo models and the paper clusters.

A refactor that must leave the plans unchanged is checked by running this before and after it::

    python bench/plans_snapshot.py record /tmp/before.json
    python bench/plans_snapshot.py compare /tmp/before.json      # exits 1 if any latency moved by more than 1e-9

The problems are traced once and stored next to the snapshot (``<file>.problems/``), so a later run
replays the same numbers even if tracing changed; the milp placer runs on small random layered problems
(7 tasks, 2 devices) that it solves to optimality, compared by objective value.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.milp_ablation import random_layered_problem  # noqa: E402
from bench.run import PAPER_CLUSTERS, SLOW_PLACERS, prepare_model  # noqa: E402
from moirai.planning.placers import list_placers, place  # noqa: E402
from moirai.planning.problem import Problem  # noqa: E402

ABSOLUTE_TOLERANCE_S = 1e-9


def _place(problem: Problem, placer: str, **options: object) -> float:
    plan = place(problem, placer, **options)
    return float(plan.makespan_s)


def _problems(directory: Path) -> dict[str, Problem]:
    from bench.models import model_sizes
    from moirai.cluster.cost import build_problem
    from moirai.cluster.devices import Cluster

    if directory.exists():
        return {path.stem: Problem.from_json(path) for path in sorted(directory.glob("*.json"))}
    directory.mkdir(parents=True)
    problems = {}
    for name, size in model_sizes(paper_sizes=False):
        graph = prepare_model(name, size, no_coarsen=False, target_nodes=None).graph
        for cluster in PAPER_CLUSTERS:
            key = f"{name}-{size}-{cluster}"
            problems[key] = build_problem(graph, Cluster.preset(cluster))
            problems[key].to_json(directory / f"{key}.json")
    return problems


def snapshot(path: Path) -> dict[str, float | str]:
    problems = _problems(path.with_suffix(".problems"))
    result: dict[str, float | str] = {}
    for key, problem in problems.items():
        for placer in list_placers():
            if placer in SLOW_PLACERS:
                continue
            try:
                result[f"{key}/{placer}"] = _place(problem, placer)
            except Exception as error:  # an infeasible or failing placer is recorded as such
                result[f"{key}/{placer}"] = f"{type(error).__name__}"
    for seed in range(6):
        result[f"layered{seed}/milp"] = _place(random_layered_problem(7, 2, seed), "milp", time_limit_s=60.0)
    return result


def main(argv: list[str]) -> int:
    mode, path = argv[0], Path(argv[1])
    if mode == "record":
        path.write_text(json.dumps(snapshot(path), indent=1))
        return 0
    before = json.loads(path.read_text())
    after = snapshot(path)
    changed = 0
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        same = (
            isinstance(old, float) and isinstance(new, float) and abs(old - new) <= ABSOLUTE_TOLERANCE_S
        ) or old == new
        if not same:
            changed += 1
            print(f"CHANGED {key}: {old} -> {new}")
    print(f"{len(after)} entries, {changed} changed (tolerance {ABSOLUTE_TOLERANCE_S:g} s)")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
