"""``pieces``: a DP over the graph's cut tasks, each piece between two of them placed by the best of its patterns,
with memory priced so that the plan fits.

A decoder LLM is a stack of layers whose residual stream passes through cut tasks
(:func:`moirai.planning.solve.segment_bound.cut_tasks`: every other task leads to one, follows it, or is a dead end
or side input beside it). Between two cut tasks lies a piece: an attention block's projections, a feed-forward
block's. Every task belongs to one piece: those between two cut tasks, a dead end to the piece it follows, a side
input (a rotary table, a mask) and the tasks before the first cut task to the piece of their first consumer.

A piece's **pattern** puts each of its heaviest tasks (by share of the piece's compute or memory; as many as keep
the patterns times the device pairs within the simulations its shape is given: :data:`MAX_SIMULATIONS`, fewer where
a graph has many shapes, :data:`SIMULATIONS_PER_TASK`) on a device; every other task of the piece goes
with its first consumer in it (the cut task after it last), else with its first producer in it, else where the
piece starts. A pattern is priced by simulating the piece alone (:func:`moirai.planning.simulate.simulate`, its
tensors' CPU time on both ends included, tensors from other pieces as there already) for every device of the cut
task before it and after it (never chosen where it sends a tensor over a missing link); pieces of one shape (same
costs, same edges: a model's identical layers) are priced once.

The DP over the cut tasks' devices then picks a pattern per piece minimising the pieces' summed time plus memory's
price, ``lambda[d]`` seconds per byte on device ``d``: the pieces run one after another, so their times add up, and
what the DP cannot see (pieces overlapping) only makes the plan faster. The prices follow the subgradient of the
memory left over or missing (Lagrangian relaxation); identical pieces would all switch pattern at one price, so each
piece sees the price scaled by up to :data:`PRICE_SPREAD` by its position, and they switch one at a time. The best
plan that fits is kept; if none does, the one that overflows least is repaired, a pattern at a time, the least time
lost per byte freed first. The simulator judges the plan, list-scheduled; the milp placer starts from it for latency
([Note: pieces for memory-bound stacks] in docs/design.md).

A graph without two cut tasks, a plan that cannot be made to fit, or one that sends a tensor between pieces (which no
piece priced) over a missing link falls back to HEFT (the report says so).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from moirai.planning.costs import RequestCosts
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.schedule.heft import heft_schedule, upward_rank_mean_costs
from moirai.planning.schedule.transfers import implied_transfers
from moirai.planning.simulate import simulate
from moirai.planning.solve.segment_bound import cut_tasks

MAX_SIMULATIONS = 4096  # per shape of piece: its patterns times the pairs of devices its cut tasks can take
SIMULATIONS_PER_TASK = 16  # over all shapes, per task of the graph (at least MAX_SIMULATIONS): many different
# pieces get fewer patterns each
MAX_CUT_TASKS = 3000  # the cut tasks come from an n x n reachability matrix
PRICE_ROUNDS = 300  # subgradient steps on memory's prices
PRICE_STEP = 0.2  # the first step: this share of the unpriced plan's time per capacity overflowed
PRICE_STALL = 60  # rounds without a better plan that fits, after one, before the prices stop
PRICE_SPREAD = 0.5  # each piece sees the prices scaled by 1 +- PRICE_SPREAD / 2, by its position


@dataclass(frozen=True)
class _Prices:
    """One shape of piece priced: ``time_s[p, d, e]`` of pattern ``p`` with the piece's entry on ``d`` and its exit
    on ``e`` (inf where not runnable), ``memory_bytes[p, d, e, k]`` it puts on device ``k``, and each pattern's
    devices of its heavy tasks (``patterns[p]``, in the order of ``heavy``, positions in the piece's task list)."""

    time_s: np.ndarray
    memory_bytes: np.ndarray
    heavy: tuple[int, ...]
    patterns: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _Piece:
    """Tasks of one piece in topological order, with the cut task before it first (``entry``) and the one after it
    last (``exit``), where it has them."""

    tasks: tuple[int, ...]
    entry: bool
    exit: bool


@register("pieces", minimises=True, respects_memory=True, objectives=("latency",), start_plan=1)
def place_pieces(problem: Problem) -> Plan:
    n = problem.num_tasks
    reach = problem.reachable() if 2 <= n <= MAX_CUT_TASKS else None
    cuts = cut_tasks(problem, reach) if reach is not None else []
    if len(cuts) < 2:
        return _fallback(problem, "fewer than two cut tasks")
    pieces = _pieces(problem, reach, cuts)
    keys = [_shape_key(problem, piece) for piece in pieces]
    total = max(MAX_SIMULATIONS, SIMULATIONS_PER_TASK * n)
    budget = max(1, min(MAX_SIMULATIONS, total // len(set(keys))))
    shapes: dict[bytes, _Prices] = {}
    for key, piece in zip(keys, pieces, strict=True):
        if key not in shapes:
            shapes[key] = _price(problem, piece, budget)
    prices = [shapes[key] for key in keys]
    chosen = _chosen(problem, pieces, prices)
    if chosen is None:
        return _fallback(problem, "no plan of patterns fits memory")
    placement = np.full(n, -1)
    for piece, priced, (p, d, e) in zip(pieces, prices, chosen, strict=True):
        placement[list(piece.tasks)] = _piece_placement(problem, piece, priced.heavy, priced.patterns[p], d, e)
    if _crosses_missing_link(problem, placement):  # a tensor between pieces, which no piece priced
        return _fallback(problem, "the pieces' patterns send a tensor over a missing link")
    plan = Plan(placement, problem.device_names, placer="pieces")
    plan.report.notes.update(cut_tasks=len(cuts), shapes=len(shapes))
    return plan


def _fallback(problem: Problem, reason: str) -> Plan:
    plan = heft_schedule(problem, upward_rank_mean_costs(problem))
    plan.placer = "pieces"
    plan.report.notes["fallback"] = f"heft: {reason}"
    return plan


def _crosses_missing_link(problem: Problem, placement: np.ndarray) -> bool:
    """Whether ``placement`` sends a tensor between devices no link joins (infinite transfer time)."""
    return not np.isfinite(implied_transfers(problem, placement).duration).all()


def _pieces(problem: Problem, reach: np.ndarray, cuts: list[int]) -> list[_Piece]:
    """The pieces: before the first cut task (exit only), between two, after the last (entry only)."""
    follows = reach[cuts].sum(axis=0)  # how many cut tasks lead to each task: it lies after the last of them
    position = {c: j for j, c in enumerate(cuts)}  # cut task j ends piece j
    piece_of = np.full(problem.num_tasks, -1)
    for v in reversed(problem.topological_order):
        if v in position:
            continue
        if follows[v] > 0:
            piece_of[v] = follows[v]
        else:  # before the first cut task, or a side input: with its first consumer
            consumers = [position.get(c, piece_of[c]) for c in problem.successors[v]]
            piece_of[v] = min(consumers, default=0)
    members: list[list[int]] = [[] for _ in range(len(cuts) + 1)]
    for v in problem.topological_order:
        if v not in position:
            members[piece_of[v]].append(v)
    pieces = [_Piece((*members[0], cuts[0]), entry=False, exit=True)]
    pieces += [_Piece((cuts[j - 1], *members[j], cuts[j]), entry=True, exit=True) for j in range(1, len(cuts))]
    pieces.append(_Piece((cuts[-1], *members[-1]), entry=True, exit=False))
    return pieces


def _shape_key(problem: Problem, piece: _Piece) -> bytes:
    """What a piece's prices depend on: its tasks' costs, its tensors' costs and edges, which ends it has."""
    index = {v: j for j, v in enumerate(piece.tasks)}
    tensors = problem.tensors_among(piece.tasks)
    parts = [
        bytes([piece.entry, piece.exit]),
        problem.compute_s[list(piece.tasks)].tobytes(),
        problem.memory_bytes[list(piece.tasks)].tobytes(),
        problem.costs.output_s[list(piece.tasks)].tobytes() if not piece.exit else b"",
        repr([(index[int(problem.tensor_producer[t])], consumers) for t, consumers in tensors]).encode(),
    ]
    for array in (problem.transfer_s, problem.send_cpu_s, problem.recv_cpu_s):
        parts.append(array[[t for t, _ in tensors]].tobytes())
    return b"|".join(parts)


def _piece_problem(problem: Problem, piece: _Piece) -> Problem:
    """The piece as a problem of its own: its entry (the cut task before it, run in the piece before) takes no time,
    tensors from other pieces are there already, memory is unbounded; only the last piece keeps the model outputs'
    way back to the driver, as they end the request there."""
    tasks = list(piece.tasks)
    index = {v: j for j, v in enumerate(tasks)}
    k = problem.num_devices
    compute = problem.compute_s[tasks].copy()
    if piece.entry:
        compute[0] = 0.0
    tensors = problem.tensors_among(piece.tasks)
    chosen = [t for t, _ in tensors]
    task_costs = {}
    if not piece.exit:
        for name in ("output_s", "output_send_cpu_s", "output_recv_cpu_s", "output_link_s"):
            task_costs[name] = getattr(problem.costs, name)[tasks]
    return Problem(
        device_names=problem.device_names,
        memory_capacity_bytes=np.full(k, np.inf),
        task_names=tuple(problem.task_names[v] for v in tasks),
        compute_s=compute,
        memory_bytes=np.zeros(len(tasks)),
        tensor_names=tuple(problem.tensor_names[t] for t in chosen),
        tensor_producer=np.array([index[int(problem.tensor_producer[t])] for t in chosen], int),
        tensor_consumers=tuple(consumers for _, consumers in tensors),
        transfer_s=problem.transfer_s[chosen].reshape(len(chosen), k, k),
        tensor_bytes=problem.tensor_bytes[chosen],
        send_cpu_s=problem.send_cpu_s[chosen].reshape(len(chosen), k, k),
        recv_cpu_s=problem.recv_cpu_s[chosen].reshape(len(chosen), k, k),
        costs=RequestCosts.build(len(tasks), k, **task_costs),
    )


def _heavy_tasks(problem: Problem, piece: _Piece, simulations: int) -> tuple[int, ...]:
    """Positions of the piece's tasks a pattern places: the inner tasks with the largest share of the piece's compute
    or memory, as many as keep the patterns times the device pairs within ``simulations``."""
    k = problem.num_devices
    inner = [
        j
        for j, v in enumerate(piece.tasks)
        if not (j == 0 and piece.entry) and not (j == len(piece.tasks) - 1 and piece.exit)
    ]
    if not inner:
        return ()
    ends = k ** (piece.entry + piece.exit)
    most = int(math.floor(math.log(max(simulations / ends, 1.0), k) + 1e-9)) if k > 1 else 0
    tasks = [piece.tasks[j] for j in inner]
    compute = np.where(problem.fits[tasks], problem.compute_s[tasks], 0.0).mean(axis=1)
    memory = problem.memory_bytes[tasks]
    share = np.maximum(compute / max(compute.sum(), 1e-300), memory / max(memory.sum(), 1e-300))
    ranked = sorted(range(len(inner)), key=lambda j: -share[j])
    return tuple(sorted(inner[j] for j in ranked[: max(most, 0)] if share[j] > 0))


def _piece_placement(
    problem: Problem, piece: _Piece, heavy: tuple[int, ...], pattern: tuple[int, ...], entry: int, exit: int
) -> np.ndarray:
    """The devices of the piece's tasks: the entry's and exit's given, the heavy ones the pattern's, every other task
    with its first consumer in the piece, else its first producer in it, else the entry's (the first piece: the
    exit's); a task that cannot run there goes to its fastest device."""
    tasks = piece.tasks
    index = {v: j for j, v in enumerate(tasks)}
    device = np.full(len(tasks), -1)
    if piece.entry:
        device[0] = entry
    if piece.exit:
        device[-1] = exit
    device[list(heavy)] = pattern
    start = entry if piece.entry else exit
    for j in reversed(range(len(tasks))):
        if device[j] < 0:
            consumers = [index[c] for c in problem.successors[tasks[j]] if c in index and device[index[c]] >= 0]
            if consumers:
                device[j] = device[min(consumers)]
    for j in range(len(tasks)):
        if device[j] < 0:
            producers = [index[u] for u in problem.predecessors[tasks[j]] if u in index and device[index[u]] >= 0]
            device[j] = device[min(producers)] if producers else start
    runs = problem.fits[list(tasks), device]
    if not runs.all():
        fastest = np.where(problem.fits[list(tasks)], problem.compute_s[list(tasks)], np.inf).argmin(axis=1)
        device = np.where(runs, device, fastest)
    return device


def _price(problem: Problem, piece: _Piece, simulations: int) -> _Prices:
    """Every pattern of the piece priced for every device of its ends, in at most about ``simulations`` runs."""
    k = problem.num_devices
    sub = _piece_problem(problem, piece)
    heavy = _heavy_tasks(problem, piece, simulations)
    patterns = tuple(itertools.product(range(k), repeat=len(heavy)))
    time_s = np.full((len(patterns), k, k), np.inf)
    memory = np.zeros((len(patterns), k, k, k))
    tasks = list(piece.tasks)
    own = np.ones(len(tasks), bool)  # the entry's memory is counted in the piece before
    own[0] = not piece.entry
    entries = range(k) if piece.entry else [0]
    exits = range(k) if piece.exit else [0]
    for p, pattern in enumerate(patterns):
        if not problem.fits[[tasks[j] for j in heavy], list(pattern)].all():
            continue
        for d, e in itertools.product(entries, exits):
            if (piece.entry and not problem.fits[tasks[0], d]) or (piece.exit and not problem.fits[tasks[-1], e]):
                continue
            device = _piece_placement(problem, piece, heavy, pattern, d, e)
            if _crosses_missing_link(sub, device):
                continue  # a tensor would cross devices no link joins: no plan takes this pattern
            value = simulate(sub, Plan(device, problem.device_names)).makespan_s
            memory[p, d, e] = np.bincount(device[own], weights=problem.memory_bytes[tasks][own], minlength=k)
            time_s[p, d, e] = value
    if not piece.entry:  # no entry: every entry device prices alike
        time_s, memory = np.repeat(time_s[:, :1], k, axis=1), np.repeat(memory[:, :1], k, axis=1)
    if not piece.exit:
        time_s, memory = np.repeat(time_s[:, :, :1], k, axis=2), np.repeat(memory[:, :, :1], k, axis=2)
    return _Prices(time_s, memory, heavy, patterns)


def _chosen(problem: Problem, pieces: list[_Piece], prices: list[_Prices]) -> list[tuple[int, int, int]] | None:
    """A (pattern, entry device, exit device) per piece whose memory fits, by the DP under memory's prices: the best
    that fits of the rounds', or the one that overflowed least, repaired, if that is better."""
    capacity = problem.memory_capacity_bytes
    bounded = np.isfinite(capacity)
    scale = np.where(bounded & (capacity > 0), capacity, 1.0)
    spread = 1.0 + PRICE_SPREAD * (np.arange(len(pieces)) / max(len(pieces) - 1, 1) - 0.5)
    price = np.zeros(problem.num_devices)  # seconds per byte
    best: tuple[float, list[tuple[int, int, int]]] | None = None
    closest: tuple[float, list[tuple[int, int, int]]] | None = None
    unpriced_s = None
    since_better = 0
    for round_ in range(PRICE_ROUNDS):
        choice = _dp(prices, price, spread)
        if choice is None:
            return None
        time_s, used = _totals(prices, choice)
        unpriced_s = unpriced_s or time_s
        over = np.where(bounded, (used - np.where(bounded, capacity, 0.0)) / scale, -1.0)  # share of capacity
        since_better += 1
        if (over <= 0).all():
            if best is None or time_s < best[0]:
                best, since_better = (time_s, choice), 0
        elif closest is None or over.max() < closest[0]:
            closest = (float(over.max()), choice)
        step = PRICE_STEP * unpriced_s / math.sqrt(round_ + 1)
        price = np.maximum(0.0, price + step * over / scale)
        if best is not None and (not price.any() or since_better > PRICE_STALL):
            break  # memory does not bind, or the prices have found nothing better for a while
    repaired = _repaired(problem, prices, closest[1]) if closest is not None else None
    if repaired is not None and (best is None or _totals(prices, repaired)[0] < best[0]):
        return repaired
    return best[1] if best is not None else None


def _dp(prices: list[_Prices], price: np.ndarray, spread: np.ndarray) -> list[tuple[int, int, int]] | None:
    """Per piece the (pattern, entry, exit) minimising the pieces' time plus memory at ``price`` (scaled by
    ``spread`` per piece), the exit of each piece the entry of the next."""
    k = len(price)
    reached = np.zeros(k)  # cost so far, by the device of the last cut task
    back = []
    distinct = {id(priced): priced for priced in prices}  # pieces of one shape share their prices
    memory_s = {key: priced.memory_bytes @ price for key, priced in distinct.items()}  # seconds, at the prices
    for priced, scaled in zip(prices, spread, strict=True):
        cost = priced.time_s + scaled * memory_s[id(priced)]  # [pattern, entry, exit]
        total = reached[None, :, None] + cost
        flat = total.reshape(-1, k)  # (pattern, entry) by exit
        best = flat.argmin(axis=0)
        reached = flat[best, np.arange(k)]
        back.append(best)
    if not np.isfinite(reached).any():
        return None
    exit = int(reached.argmin())
    choice = []
    for best in reversed(back):
        pattern, entry = divmod(int(best[exit]), k)
        choice.append((pattern, entry, exit))
        exit = entry
    return choice[::-1]


def _totals(prices: list[_Prices], choice: list[tuple[int, int, int]]) -> tuple[float, np.ndarray]:
    time_s = sum(float(priced.time_s[p, d, e]) for priced, (p, d, e) in zip(prices, choice, strict=True))
    used = sum(priced.memory_bytes[p, d, e] for priced, (p, d, e) in zip(prices, choice, strict=True))
    return time_s, np.asarray(used, float)


def _repaired(
    problem: Problem, prices: list[_Prices], choice: list[tuple[int, int, int]]
) -> list[tuple[int, int, int]] | None:
    """``choice`` with patterns changed, one piece at a time, the least time lost per byte freed on a device over its
    capacity first (its cut tasks' devices kept), until every device fits; None if no change frees any."""
    capacity = problem.memory_capacity_bytes
    choice = list(choice)
    _, used = _totals(prices, choice)
    while (over := np.maximum(used - capacity, 0.0)).any():
        best: tuple[float, int, int] | None = None
        for i, (priced, (p, d, e)) in enumerate(zip(prices, choice, strict=True)):
            change = priced.memory_bytes[:, d, e] - priced.memory_bytes[p, d, e]  # [pattern, device]
            freed = np.minimum(-change, over).clip(min=0.0).sum(axis=1)
            stays = (used + change <= np.maximum(capacity, used)).all(axis=1)
            lost = priced.time_s[:, d, e] - priced.time_s[p, d, e]
            score = np.where((freed > 0) & stays & np.isfinite(lost), lost / np.maximum(freed, 1e-300), np.inf)
            q = int(score.argmin())
            if np.isfinite(score[q]) and (best is None or score[q] < best[0]):
                best = (float(score[q]), i, q)
        if best is None:
            return None
        _, i, q = best
        p, d, e = choice[i]
        used = used + prices[i].memory_bytes[q, d, e] - prices[i].memory_bytes[p, d, e]
        choice[i] = (q, d, e)
    return choice
