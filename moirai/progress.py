"""What moirai is doing now: one line per long stage (trace, coarsen, cost, place, split, worker start-up).

Stages mark themselves with :func:`stage`, as a decorator or a ``with`` block::

    @progress.stage("trace")
    def trace(...): ...

A stage reports only inside :func:`shown` (``moirai.compile``, ``moirai.load`` and
``run_distributed`` open it with :func:`reports_progress` unless ``progress=False``), so a
placer called in a loop stays quiet. Only the outermost stage reports: a stage that runs another
(a placer placing with a heuristic) shows as one. Where it reports:

* a terminal: a rich spinner while the stage runs, then ``✓ trace  1.23 s``;
* Jupyter: a line that says ``… trace`` while it runs and becomes ``✓ trace  1.23 s`` (an
  IPython display that is updated, so no ipywidgets are needed);
* anything else (a log, CI): one plain line per finished stage on stderr, ``moirai: trace 1.23 s``.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from rich.console import Console

_Function = TypeVar("_Function", bound=Callable[..., Any])
_console: ContextVar[Console | None] = ContextVar("moirai_progress_console", default=None)
_in_stage: ContextVar[bool] = ContextVar("moirai_progress_in_stage", default=False)


@contextmanager
def shown(enabled: bool = True, console: Console | None = None) -> Iterator[None]:
    """Let the stages run inside this block report (to ``console``, default stderr) when ``enabled``."""
    if not enabled or _console.get() is not None:
        yield
        return
    token = _console.set(console or Console(stderr=True))
    try:
        yield
    finally:
        _console.reset(token)


def reports_progress(function: _Function) -> _Function:
    """Run ``function`` inside :func:`shown`, enabled by its own ``progress: bool = True`` argument."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def with_progress(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs).arguments
        with shown(bool(bound.get("progress", True))):
            return function(*args, **kwargs)

    return with_progress  # type: ignore[return-value]


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Report ``name`` while the block (or decorated function) runs and its time when it ends."""
    console = _console.get()
    if console is None or _in_stage.get():
        yield
        return
    token = _in_stage.set(True)
    start = time.perf_counter()
    try:
        if console.is_jupyter:
            with _jupyter_line(name, start):
                yield
        elif console.is_terminal:
            with console.status(f"{name} …"):
                yield
            console.print(f"[green]✓[/] {name}  {format_seconds(time.perf_counter() - start)}", highlight=False)
        else:
            yield
            console.print(f"moirai: {name} {format_seconds(time.perf_counter() - start)}", highlight=False)
    finally:
        _in_stage.reset(token)


@contextmanager
def _jupyter_line(name: str, start: float) -> Iterator[None]:
    from IPython.display import Pretty, display

    handle = display(Pretty(f"… {name}"), display_id=True)
    outcome = "✗"
    try:
        yield
        outcome = "✓"
    finally:
        handle.update(Pretty(f"{outcome} {name}  {format_seconds(time.perf_counter() - start)}"))


def format_seconds(seconds: float) -> str:
    """Compact time for tables and progress lines: ``850 ns``, ``12.3 us``, ``4.56 ms``, ``7.89 s``, ``12.0 min``."""
    for unit, scale in (("min", 60.0), ("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{seconds * 1e9:.0f} ns"
