"""A family of random layered DAGs whose best throughput is known: a contiguous split into equal stages.

Layers of 1 to 5 tasks, each reading 1-3 tasks of the layer before (as :func:`moirai.testing.random_layered_problem`),
on ``num_devices`` identical devices. The layers are cut into ``num_devices`` runs of about equal task counts and
every task's time is scaled so that each run's compute adds up to exactly :data:`STAGE_S`; tensors are small (every
link carries at most half a stage per request) and cost their devices no CPU time. The split that puts run ``j`` on
device ``j`` then has period :data:`STAGE_S`, and no plan's is shorter (the devices' load bound: all the work shared
by ``num_devices`` equal devices), so the optimum is known and contiguous. Other plans reach it too (any split into
equal loads whose links carry less than a stage); what the family asks is whether a placer finds one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate

STAGE_S = 1e-3  # each stage's compute per request
MAX_WIDTH = 5  # tasks per layer, at most


@dataclass(frozen=True)
class KnownSplit:
    problem: Problem
    split: Plan  # the contiguous split the family is built around
    optimum_s: float  # its period, STAGE_S: no plan's period is shorter


def known_split_problem(num_tasks: int, num_devices: int, seed: int = 0) -> KnownSplit:
    """A layered DAG of ``num_tasks`` tasks on ``num_devices`` identical devices and its optimal contiguous split."""
    rng = np.random.default_rng(seed)
    layers: list[list[int]] = []
    placed = 0
    while placed < num_tasks:
        size = int(min(rng.integers(1, MAX_WIDTH + 1), num_tasks - placed))
        layers.append(list(range(placed, placed + size)))
        placed += size
    consumers: list[list[int]] = [[] for _ in range(num_tasks)]
    for previous, layer in zip(layers, layers[1:], strict=False):
        for v in layer:
            for u in rng.choice(previous, size=min(len(previous), int(rng.integers(1, 4))), replace=False):
                consumers[int(u)].append(v)
    # Stage j: the layers whose first task falls in the j-th equal share of the tasks (never an empty stage).
    first_task = np.array([layer[0] for layer in layers])
    layer_stage = np.minimum(first_task * num_devices // num_tasks, num_devices - 1)
    stage = np.empty(num_tasks, int)
    for layer, j in zip(layers, layer_stage, strict=True):
        stage[layer] = j
    if len(set(stage.tolist())) < num_devices:
        raise ValueError(f"{num_tasks} tasks in {len(layers)} layers cannot make {num_devices} stages")
    work = rng.uniform(0.2, 1.0, num_tasks)
    work *= STAGE_S / np.bincount(stage, weights=work)[stage]  # every stage sums to STAGE_S exactly
    compute = np.repeat(work[:, None], num_devices, axis=1)
    producers = [u for u in range(num_tasks) if consumers[u]]
    crossing = np.bincount([stage[u] for u in producers if any(stage[c] != stage[u] for c in consumers[u])])
    # A stage boundary's tensors together take at most half a stage on its link.
    size = rng.uniform(0.2, 1.0, len(producers)) * 0.5 * STAGE_S / max(1, int(crossing.max(initial=1)))
    transfer = np.repeat(np.repeat(size[:, None, None], num_devices, axis=1), num_devices, axis=2)
    transfer[:, np.arange(num_devices), np.arange(num_devices)] = 0.0
    problem = Problem(
        device_names=tuple(f"acc{d}" for d in range(num_devices)),
        memory_capacity_bytes=np.full(num_devices, np.inf),
        task_names=tuple(f"task{i}" for i in range(num_tasks)),
        compute_s=compute,
        memory_bytes=np.zeros(num_tasks),
        tensor_names=tuple(f"out{u}" for u in producers),
        tensor_producer=np.array(producers, int),
        tensor_consumers=tuple(tuple(consumers[u]) for u in producers),
        transfer_s=transfer,
    )
    split = Plan(stage, problem.device_names, placer="known split")
    return KnownSplit(problem, split, simulate(problem, split).period_s)
