"""The one home of HiGHS (highspy): every linear and integer program moirai solves goes through here.

* :func:`new_highs` makes every solver instance: HiGHS runs all instances of a process on one thread
  pool, sized by the first run's ``threads`` option, and a run asking another size fails with model
  status "Not Set" unless the pool is reset first (so an LP placer after the bounds LP failed).
* :class:`SparseLinearProgram`: an LP or MIP built row by row as sparse triplets (the bounds LP and the
  LP-based placers: m-SCT's favourite-child LP, GETF's group assignment).
* :func:`run_highs`: a Pyomo model (the MILP and Pesto's ILP), written as an LP file and read back.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import highspy
import numpy as np

from moirai.errors import InfeasibleError

if TYPE_CHECKING:
    from pyomo.common.collections import ComponentMap
    from pyomo.environ import ConcreteModel

_pool_threads: int | None = None  # the thread count HiGHS's process-wide pool was started with


_banner_shown = False  # HiGHS prints its banner when a process makes its first instance


@contextlib.contextmanager
def _banner_silenced() -> Iterator[None]:
    """Keep HiGHS's banner off this process's stdout: its C++ side writes it to file descriptor 1 when the
    first instance is made, before any option can turn logging off, so that one construction runs with
    descriptor 1 on /dev/null."""
    global _banner_shown
    if _banner_shown:
        yield
        return
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
        _banner_shown = True


def new_highs(threads: int | None = None) -> highspy.Highs:
    """A HiGHS instance that will run on ``threads`` threads (None: HiGHS's default), logging nowhere."""
    global _pool_threads
    wanted = 0 if threads is None else int(threads)  # 0 is HiGHS's "choose for me"
    if _pool_threads is not None and _pool_threads != wanted:
        highspy.Highs.resetGlobalScheduler(True)
    _pool_threads = wanted
    with _banner_silenced():
        highs = highspy.Highs()
    highs.setOptionValue("log_to_console", False)
    highs.setOptionValue("threads", wanted)
    return highs


def set_gaps(highs: highspy.Highs, mip_gap: float) -> None:
    """Stop at the relative ``mip_gap`` only. HiGHS also stops at an absolute gap (1e-6 by default); in model units
    (horizon / 1000) a period can be far below it when the horizon dwarfs it, and HiGHS would call its start plan
    optimal."""
    highs.setOptionValue("mip_rel_gap", mip_gap)
    highs.setOptionValue("mip_abs_gap", 0.0)


class MipResult(NamedTuple):
    """What :meth:`SparseLinearProgram.solve_mip` found: the best point, whether it is proved optimal, and the
    solver's proven lower bound on the cost (``-inf`` where it proved none)."""

    values: np.ndarray
    optimal: bool
    bound: float


class SparseLinearProgram:
    """``minimise cost @ x`` subject to ``lower <= A x <= upper`` and variable bounds."""

    def __init__(self, num_vars: int, lower: np.ndarray, upper: np.ndarray, cost: np.ndarray) -> None:
        self.num_vars = num_vars
        self.var_lower = np.broadcast_to(np.asarray(lower, float), (num_vars,)).copy()
        self.var_upper = np.broadcast_to(np.asarray(upper, float), (num_vars,)).copy()
        self.cost = np.broadcast_to(np.asarray(cost, float), (num_vars,)).copy()
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._values: list[float] = []
        self._row_lower: list[float] = []
        self._row_upper: list[float] = []

    @property
    def num_rows(self) -> int:
        return len(self._row_lower)

    def add_row(self, columns: Sequence[int], values: Sequence[float], lower: float, upper: float) -> None:
        row = self.num_rows
        self._rows.extend([row] * len(columns))
        self._cols.extend(int(c) for c in columns)
        self._values.extend(float(v) for v in values)
        self._row_lower.append(lower)
        self._row_upper.append(upper)

    def solve(
        self, integer_vars: Sequence[int] = (), time_limit_s: float | None = None, method: str = "choose"
    ) -> np.ndarray:
        """Optimal (or, for a MIP stopped by the time limit, best found) values of the variables.

        ``method`` is HiGHS's ``solver`` option: "choose", "simplex" or "ipm" (interior point).
        """
        highs = self._loaded(integer_vars, time_limit_s, method)
        highs.run()
        status = highs.getModelStatus()
        solution = highs.getSolution()
        if not solution.value_valid:
            reason = highs.modelStatusToString(status)
            raise InfeasibleError(f"HiGHS found no solution of the linear program ({reason})")
        return np.asarray(solution.col_value, float)

    def solve_mip(
        self,
        integer_vars: Sequence[int],
        time_limit_s: float,
        start: dict[int, float] | None = None,
        mip_gap: float = 1e-6,
    ) -> MipResult | None:
        """The best values found within ``time_limit_s`` from ``start`` (values of some variables; HiGHS completes
        them), whether they are proved optimal within the relative ``mip_gap``, and the proven lower bound on the
        cost; None when HiGHS found no feasible point (or reports a numerical failure)."""
        highs = self._loaded(integer_vars, time_limit_s, "choose")
        set_gaps(highs, mip_gap)
        if start:
            columns = np.fromiter(start, np.int32, len(start))
            highs.setSolution(len(columns), columns, np.fromiter(start.values(), float, len(start)))
        highs.run()
        info = highs.getInfo()
        if info.primal_solution_status != 2:  # 2: a feasible point exists
            return None
        optimal = highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
        values = np.asarray(highs.getSolution().col_value, float)
        bound = float(info.mip_dual_bound)
        if not np.isfinite(bound):  # none reported (a MIP solved in presolve): an optimal point is within the gap
            cost = float(self.cost @ values)
            bound = cost - mip_gap * abs(cost) if optimal else -np.inf
        return MipResult(values, optimal, bound)

    def _loaded(self, integer_vars: Sequence[int], time_limit_s: float | None, method: str) -> highspy.Highs:
        highs = new_highs(threads=1)
        highs.setOptionValue("output_flag", False)
        if time_limit_s is not None:
            highs.setOptionValue("time_limit", float(time_limit_s))
        highs.setOptionValue("solver", method)
        inf = highs.getInfinity()
        highs.addVars(self.num_vars, np.clip(self.var_lower, -inf, inf), np.clip(self.var_upper, -inf, inf))
        highs.changeColsCost(self.num_vars, np.arange(self.num_vars, dtype=np.int32), self.cost)
        if self.num_rows:
            order = np.argsort(np.asarray(self._rows), kind="stable")
            rows = np.asarray(self._rows)[order]
            starts = np.searchsorted(rows, np.arange(self.num_rows)).astype(np.int32)
            highs.addRows(
                self.num_rows,
                np.clip(self._row_lower, -inf, inf),
                np.clip(self._row_upper, -inf, inf),
                len(order),
                starts,
                np.asarray(self._cols, np.int32)[order],
                np.asarray(self._values, float)[order],
            )
        if len(integer_vars):
            columns = np.asarray(integer_vars, np.int32)
            highs.changeColsIntegrality(
                len(columns), columns, np.full(len(columns), highspy.HighsVarType.kInteger, np.uint8)
            )
        return highs


def _run_from(highs: highspy.Highs, known: Sequence[tuple[int, float]], time_limit_s: float) -> None:
    """Run ``highs`` for at most ``time_limit_s`` (at least 0.01 s) from the start values ``known`` (column,
    value)."""
    highs.setOptionValue("time_limit", max(time_limit_s, 0.01))
    if known:
        highs.setSolution(len(known), np.array([c for c, _ in known], np.int32), np.array([v for _, v in known]))
    highs.run()


def _incumbent_within_gap(highs: highspy.Highs, mip_gap: float) -> bool:
    """Whether the incumbent HiGHS hands back, priced from its own columns, agrees with what HiGHS says of it: an
    optimal run's within ``mip_gap`` of the dual bound, any run's no lower than that bound (True without an
    incumbent or a finite bound). [Note: HiGHS's presolve and a start]."""
    info, lp = highs.getInfo(), highs.getLp()
    if not any(kind != highspy.HighsVarType.kContinuous for kind in lp.integrality_):
        return True  # an LP (a relaxation) has no MIP bound to contradict
    if info.primal_solution_status != 2 or info.mip_dual_bound is None or not np.isfinite(info.mip_dual_bound):
        return True
    value = float(np.dot(lp.col_cost_, highs.getSolution().col_value)) + float(lp.offset_)
    if lp.sense_ == highspy.ObjSense.kMaximize:
        value, bound = -value, -float(info.mip_dual_bound)
    else:
        bound = float(info.mip_dual_bound)
    slack = 1e-9 * max(1.0, abs(value))  # the rounding of a sum over the columns
    if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return value >= bound - slack
    return bound - slack <= value <= bound + mip_gap * abs(value) + slack


class SolverOutcome(NamedTuple):
    status: str
    optimal: bool  # proven optimal within the gap asked for
    bound: float | None  # objective bound, in the model's units
    value: Callable[[Any], float] | None  # value of a model variable in the incumbent; None: no incumbent


def run_highs(
    model: ConcreteModel,
    start: ComponentMap | None,
    time_limit_s: float,
    mip_gap: float = 1e-4,
    threads: int | None = None,
    log: io.TextIOBase | None = None,
    progress: Callable[[float, float], None] | None = None,
) -> SolverOutcome:
    """Solve a Pyomo model with HiGHS from an optional start (values of its variables), within ``time_limit_s``.

    HiGHS stops as soon as it proves the relative gap at most ``mip_gap``. ``progress`` receives
    the incumbent's objective and the bound (model units) at every line of HiGHS's MIP log.

    The model goes to HiGHS the way Pyomo writes it (LP format), which loads an order of
    magnitude faster than Pyomo's persistent HiGHS interface and lets the start be set. The
    time to write and load the model counts against ``time_limit_s``.
    """
    from pyomo.repn.plugins.lp_writer import LPWriter  # Pyomo loads only for the models that need it

    started = time.perf_counter()
    highs = new_highs(threads)
    highs.setOptionValue("log_to_console", False)
    if log is not None:
        highs.cbLogging.subscribe(lambda event: log.write(event.message))
    if progress is not None:
        highs.cbMipLogging.subscribe(
            lambda event: progress(event.data_out.mip_primal_bound, event.data_out.mip_dual_bound)
        )
    with tempfile.TemporaryDirectory(prefix="moirai-milp-") as folder:
        path = os.path.join(folder, "model.lp")
        with open(path, "w") as stream:
            symbols = LPWriter().write(model, stream).symbol_map
        if highs.readModel(path) == highspy.HighsStatus.kError:  # a warning (e.g. tiny coefficients dropped) is fine
            raise RuntimeError("HiGHS could not read the model Pyomo wrote")
    column = {name: c for c, name in enumerate(highs.getLp().col_names_)}

    def column_of(var: Any) -> int | None:
        return column.get(symbols.byObject.get(id(var)))

    for option, setting in (("mip_feasibility_tolerance", 1e-9), ("primal_feasibility_tolerance", 1e-9)):
        highs.setOptionValue(option, setting)
    set_gaps(highs, mip_gap)
    known: list[tuple[int, float]] = []
    if start is not None:
        known = [(c, value) for var, value in start.items() if (c := column_of(var)) is not None]
    _run_from(highs, known, time_limit_s - (time.perf_counter() - started))
    consistent = _incumbent_within_gap(highs, mip_gap)
    if known and not consistent:
        # [Note: HiGHS's presolve and a start] in docs/design.md: solved again without presolve, from the start.
        highs.clearSolver()
        highs.setOptionValue("presolve", "off")
        _run_from(highs, known, time_limit_s - (time.perf_counter() - started))
        consistent = _incumbent_within_gap(highs, mip_gap)
    info = highs.getInfo()
    status = highs.modelStatusToString(highs.getModelStatus())
    optimal = highs.getModelStatus() == highspy.HighsModelStatus.kOptimal and consistent
    # A bound that its own incumbent contradicts proves nothing.
    bound = float(info.mip_dual_bound) if info.mip_dual_bound is not None and consistent else None
    if info.primal_solution_status != 2:  # 2: a feasible incumbent exists
        return SolverOutcome(status, optimal, bound, None)
    solution = np.asarray(highs.getSolution().col_value)

    def value(var: Any) -> float:
        c = column_of(var)
        return float(solution[c]) if c is not None else float(var.lb or 0.0)

    return SolverOutcome(status, optimal, bound, value)
