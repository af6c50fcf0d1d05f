"""The two formulations of the MILP, each one object that says which bounds, big-Ms, order rows and cuts it adds.

* :data:`PAPER`: the constraints as the paper prints them (errata fixed: ``-M delta``, one transfer per tensor and
  destination, per-link contention): one constant big-M (100 horizons), a ``delta`` for every incomparable pair of
  tasks and of transfers, no time windows.
* :data:`STRONG`: per task and device a head (earliest start there) and a tail (least time the plan runs on after
  it), both counting the transfers a device change costs; with a horizon (the best known plan's makespan, so
  ``T <= horizon`` is valid) they drop the devices a task cannot use, give time windows ``[earliest start, latest
  finish]``, pair-specific big-Ms, and drop or fix the order of pairs whose windows cannot overlap; transfer pairs
  ordered by a path need no binary; one aggregated "same device"/"same link" variable per pair; the objective's
  cuts (:mod:`moirai.planning.solve.cuts`); symmetry breaking between identical devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pyomo.environ as pyo

from moirai.errors import InfeasibleError
from moirai.planning.solve.cuts import symmetry_rows
from moirai.planning.solve.parts import MODEL_TIME_SCALE, ModelParts, Transfers
from moirai.planning.solve.window import (
    device_heads_and_tails,
    device_pair_kinds,
    devices_in_time,
    identical_device_groups,
    transfer_pair_kinds,
)

if TYPE_CHECKING:
    from moirai.planning.solve.rows import MilpRows

_NARROWING_ROUNDS = 4
DevicePairs = dict[tuple[int, int], str]  # (i, j) -> "delta" | "i_first" | "j_first" | "apart"
TransferPairs = dict[tuple[tuple[int, int], tuple[int, int]], str]  # (q, r) -> "delta" | "q_first"


@dataclass(frozen=True)
class Formulation:
    """The paper's formulation; :class:`StrongFormulation` overrides what it tightens."""

    name: ClassVar[str] = "paper"
    breaks_symmetry: ClassVar[bool] = False  # a warm start must then be relabelled to obey the symmetry rows
    big_m: ClassVar[float] = 100.0 * MODEL_TIME_SCALE

    def narrow(self, c: ModelParts) -> None:
        """Drop devices and narrow the time windows of ``c`` before any variable exists (the paper does not)."""

    def time_variables(self, c: ModelParts) -> None:
        """The start of every free task ``S`` and the makespan ``T``."""
        c.m.S = pyo.Var(c.free, domain=pyo.NonNegativeReals)
        c.m.T = pyo.Var(domain=pyo.NonNegativeReals)

    def transfer_window(
        self, c: ModelParts, key: tuple[int, int], duration: Any, earliest_s: float, latest_s: float
    ) -> None:
        """Bound the start ``R[key]`` of a transfer that may run between ``earliest_s`` and ``latest_s``."""

    def arrival_big_m(self, c: ModelParts, latest_s: float, consumer: int) -> float:
        """The big-M that lifts a consumer's wait for a transfer that ends by ``latest_s`` when it is elsewhere."""
        return self.big_m

    def device_order_rows(self, c: ModelParts) -> DevicePairs:
        """(6) no two tasks overlap on one device: per shared device, ``delta`` orders the pair."""
        m, big_m = c.m, self.big_m
        pairs = device_pair_kinds(c.free, c.allowed, c.descendants, c.earliest_s, c.latest_finish_s, c.fastest_s, False)
        m.delta = pyo.Var(list(pairs), domain=pyo.Binary)
        for i, j in pairs:
            for k in (k for k in c.allowed[i] if k in c.allowed[j]):
                off = big_m * (2 - m.x[i, k] - m.x[j, k])
                c.add(m.S[j] >= c.finish[i] - big_m * (1 - m.delta[i, j]) - off)
                c.add(m.S[i] >= c.finish[j] - big_m * m.delta[i, j] - off)
        return pairs

    def link_order_rows(self, c: ModelParts, transfers: Transfers) -> TransferPairs:
        """(8) no two transfers overlap on one directed link: per shared source, ``link_delta`` orders the pair."""
        m, big_m = c.m, self.big_m
        pairs = transfer_pair_kinds(
            c.problem, transfers.sources, c.descendants, set(c.free), transfers.earliest_s, transfers.latest_s, False
        )
        m.link_delta = pyo.Var(list(pairs), domain=pyo.Binary)
        for q, r in pairs:
            q_end = m.R[q] + transfers.duration[q]
            r_end = m.R[r] + transfers.duration[r]
            for a in (a for a in transfers.sources[q] if a in transfers.sources[r]):
                off = big_m * (2 - m.w[q[0], a, q[1]] - m.w[r[0], a, r[1]])
                c.add(m.R[r] >= q_end - big_m * (1 - m.link_delta[q, r]) - off)
                c.add(m.R[q] >= r_end - big_m * m.link_delta[q, r] - off)
        return pairs

    def cuts(self, c: ModelParts, rows: MilpRows) -> tuple[tuple[int, ...], ...]:
        """Valid inequalities beyond the formulation's rows; returns the groups of identical devices it ordered."""
        return ()


@dataclass(frozen=True)
class StrongFormulation(Formulation):
    """Heads, tails and the horizon narrow devices, windows and big-Ms; aggregated pair variables; cuts; symmetry."""

    name: ClassVar[str] = "strong"
    breaks_symmetry: ClassVar[bool] = True

    def narrow(self, c: ModelParts) -> None:
        problem, window = c.problem, c.window
        free_graph = problem.graph.subgraph(c.free)
        for _ in range(_NARROWING_ROUNDS):  # fewer devices give later heads and longer tails, which drop more
            c.head_s, c.tail_s = device_heads_and_tails(problem, window, c.allowed, free_graph)
            narrowed = devices_in_time(problem, c.allowed, c.head_s, c.tail_s, window.horizon_s)
            if narrowed == c.allowed:
                break
            c.allowed = narrowed
            if any(not narrowed[i] for i in c.free):  # the next round's heads would take a minimum over no device
                break
        stuck = [i for i in c.free if not c.allowed[i]]
        if stuck:
            raise InfeasibleError(
                f"task {problem.task_names[stuck[0]]!r} cannot finish on any device within the horizon "
                f"({window.horizon_s:g} s): no plan meets it"
            )
        # The windows narrowed by the devices left: heads and tails count transfers.
        for i in c.free:
            allowed = c.allowed[i]
            c.earliest_s[i] = max(c.earliest_s[i], min(c.head_s[i, k] for k in allowed))
            c.latest_finish_s[i] = min(c.latest_finish_s[i], window.horizon_s - min(c.tail_s[i, k] for k in allowed))
            c.fastest_s[i] = float(min(problem.compute_s[i, k] for k in allowed))

    def time_variables(self, c: ModelParts) -> None:
        bounds = {i: (c.scaled(c.earliest_s[i]), c.scaled(c.latest_finish_s[i] - c.fastest_s[i])) for i in c.free}
        c.m.S = pyo.Var(c.free, domain=pyo.NonNegativeReals, bounds=lambda _, i: bounds[i])
        c.m.T = pyo.Var(bounds=(0.0, MODEL_TIME_SCALE))

    def transfer_window(
        self, c: ModelParts, key: tuple[int, int], duration: Any, earliest_s: float, latest_s: float
    ) -> None:
        c.m.R[key].setlb(c.scaled(earliest_s))
        c.add(c.m.R[key] + duration <= c.scaled(latest_s))

    def arrival_big_m(self, c: ModelParts, latest_s: float, consumer: int) -> float:
        return c.scaled(latest_s - c.earliest_s[consumer])

    def device_order_rows(self, c: ModelParts) -> DevicePairs:
        """(6) with windows: pairs that cannot overlap dropped, fixed orders without a binary, one ``same`` each."""
        m, scaled, finish = c.m, c.scaled, c.finish
        pairs = device_pair_kinds(c.free, c.allowed, c.descendants, c.earliest_s, c.latest_finish_s, c.fastest_s, True)
        m.delta = pyo.Var([pair for pair, kind in pairs.items() if kind == "delta"], domain=pyo.Binary)
        m.same = pyo.Var(list(pairs), bounds=(0.0, 1.0))
        for (i, j), kind in pairs.items():
            shared = [k for k in c.allowed[i] if k in c.allowed[j]]
            if kind == "apart":
                for k in shared:
                    c.add(m.x[i, k] + m.x[j, k] <= 1)
                continue
            same = m.same[i, j]
            for k in shared:
                c.add(same >= m.x[i, k] + m.x[j, k] - 1)
            i_first_m = scaled(c.latest_finish_s[i] - c.earliest_s[j])
            j_first_m = scaled(c.latest_finish_s[j] - c.earliest_s[i])
            if kind == "i_first":
                c.add(m.S[j] >= finish[i] - i_first_m * (1 - same))
            elif kind == "j_first":
                c.add(m.S[i] >= finish[j] - j_first_m * (1 - same))
            else:
                c.add(m.S[j] >= finish[i] - i_first_m * (2 - m.delta[i, j] - same))
                c.add(m.S[i] >= finish[j] - j_first_m * (1 + m.delta[i, j] - same))
        return pairs

    def link_order_rows(self, c: ModelParts, transfers: Transfers) -> TransferPairs:
        """(8) with windows: pairs that cannot overlap dropped, path-ordered pairs without a binary."""
        m, scaled = c.m, c.scaled
        pairs = transfer_pair_kinds(
            c.problem, transfers.sources, c.descendants, set(c.free), transfers.earliest_s, transfers.latest_s, True
        )
        m.link_delta = pyo.Var([pair for pair, kind in pairs.items() if kind == "delta"], domain=pyo.Binary)
        m.same_link = pyo.Var(list(pairs), bounds=(0.0, 1.0))
        for (q, r), kind in pairs.items():
            q_end = m.R[q] + transfers.duration[q]
            r_end = m.R[r] + transfers.duration[r]
            same = m.same_link[q, r]
            for a in (a for a in transfers.sources[q] if a in transfers.sources[r]):
                c.add(same >= m.w[q[0], a, q[1]] + m.w[r[0], a, r[1]] - 1)
            q_first_m = scaled(transfers.latest_s[q] - transfers.earliest_s[r])
            r_first_m = scaled(transfers.latest_s[r] - transfers.earliest_s[q])
            if kind == "q_first":
                c.add(m.R[r] >= q_end - q_first_m * (1 - same))
            else:
                c.add(m.R[r] >= q_end - q_first_m * (2 - m.link_delta[q, r] - same))
                c.add(m.R[q] >= r_end - r_first_m * (1 + m.link_delta[q, r] - same))
        return pairs

    def cuts(self, c: ModelParts, rows: MilpRows) -> tuple[tuple[int, ...], ...]:
        """The objective's cuts, and (whole problem only) the order of identical devices."""
        rows.cuts(c)
        if len(c.free) != c.problem.num_tasks:
            return ()
        groups = identical_device_groups(c.problem)
        symmetry_rows(c, groups)
        return groups


PAPER = Formulation()
STRONG = StrongFormulation()
FORMULATIONS = (STRONG.name, PAPER.name)


def formulation_named(name: str) -> Formulation:
    """The formulation called ``name`` (one of :data:`FORMULATIONS`)."""
    for formulation in (STRONG, PAPER):
        if formulation.name == name:
            return formulation
    raise ValueError(f"formulation must be one of {FORMULATIONS}, got {name!r}")
