"""What the colocation contraction costs the milp placer on small random problems.

For every seed: a random problem (moirai.testing.random_problem) with random colocated sets, the brute-force
optimum over placements that keep every set on one device (the floor: members may interleave with other tasks),
the brute-force optimum of the contracted problem (the ceiling: what the placer sees), and the milp placer's plan
through ``place()`` (contraction, expansion, list-scheduled alternative)::

    python bench/colocation_cost.py --seeds 40
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moirai.planning.colocation import contract  # noqa: E402
from moirai.planning.placers import place  # noqa: E402
from moirai.testing import brute_force_optimum, random_problem  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args()
    over_floor = []
    print("| seed | tasks | sets | groups | floor s | ceiling s | milp s | milp / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for seed in range(args.seeds):
        rng = np.random.default_rng(1000 + seed)
        problem = random_problem(seed)
        sets = [rng.choice(4, size=int(rng.integers(2, 4)), replace=False).tolist() for _ in range(rng.integers(1, 4))]
        problem = dataclasses.replace(problem, colocated=tuple(tuple(s) for s in sets))
        contraction = contract(problem)
        floor = brute_force_optimum(problem)
        ceiling = brute_force_optimum(contraction.problem)
        milp = place(problem, "milp", time_limit_s=30.0).makespan_s
        over_floor.append(milp / floor - 1)
        groups = [list(contraction.members[c]) for c in contraction.groups]
        print(
            f"| {seed} | {problem.num_tasks} | {[list(s) for s in problem.colocated]} | {groups} | {floor:.3f} "
            f"| {ceiling:.3f} | {milp:.3f} | {milp / floor:.3f} |"
        )
    excess = np.array(over_floor)
    print(
        f"\nmilp over the floor: median {np.median(excess):.1%}, mean {excess.mean():.1%}, max {excess.max():.1%}; "
        f"at the floor (within 1e-6) on {int((excess < 1e-6).sum())} of {len(excess)} seeds"
    )


if __name__ == "__main__":
    main()
