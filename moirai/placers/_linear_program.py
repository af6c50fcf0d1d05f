"""A sparse linear program built row by row and solved with HiGHS (highspy).

The LP-based baselines (m-SCT's favourite-child LP, GETF's group assignment) have
thousands of variables on large graphs; building them as sparse triplets and handing
them to HiGHS in one call keeps that fast, where a modelling layer would dominate.
"""

from __future__ import annotations

from collections.abc import Sequence

import highspy
import numpy as np

from moirai.errors import InfeasibleError


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
        highs = highspy.Highs()
        highs.setOptionValue("output_flag", False)
        highs.setOptionValue("threads", 1)
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
        highs.run()
        status = highs.getModelStatus()
        solution = highs.getSolution()
        if not solution.value_valid:
            reason = highs.modelStatusToString(status)
            raise InfeasibleError(f"HiGHS found no solution of the linear program ({reason})")
        return np.asarray(solution.col_value, float)
