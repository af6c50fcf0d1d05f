"""The deadline checks of the planning loops that can run long on a loaded machine ([Note: the budget on a loaded
machine] in docs/design.md): one step of such a loop is far cheaper than a look at the clock is worth."""

from __future__ import annotations

import time

CHECK_EVERY_STEPS = 64  # steps between looks at the clock (each look costs about a microsecond)


def deadline_passed(deadline: float | None, step: int) -> bool:
    """Whether ``deadline`` (a ``time.perf_counter`` value; None: no deadline) has passed, looked at on every
    :data:`CHECK_EVERY_STEPS`-th ``step`` only (false on the others)."""
    return deadline is not None and step % CHECK_EVERY_STEPS == 0 and time.perf_counter() > deadline
