"""What moirai is doing now: one line per long stage (calibration, trace, coarsen, cost, place, split, workers).

Stages mark themselves with :func:`stage`, as a decorator or a ``with`` block::

    @progress.stage("trace")
    def trace(...): ...

A stage reports only inside :func:`shown` (``moirai.compile``, ``moirai.load``, ``run_distributed`` and ``server``
open it with :func:`reports_progress` unless ``progress=False``, a compiled model's methods as it was compiled), so a
placer called in a loop stays quiet. Only the outermost stage reports: a stage that runs another
(a placer placing with a heuristic) shows as one. Where it reports:

* a terminal: a rich spinner while the stage runs, then ``✓ trace  1.23 s``;
* Jupyter: a line that says ``… trace`` while it runs and becomes ``✓ trace  1.23 s`` (an
  IPython display that is updated, so no ipywidgets are needed);
* anything else (a log, CI): one plain line per finished stage on stderr, ``moirai: trace 1.23 s``; a stage
  that may take long (it says what it will do: ``stage("place", "milp, limit 1 min")``) also prints a start line,
  ``moirai: place: milp, limit 1 min``, and what it reports with :func:`update` at most every few seconds.

``shown(False)`` (``progress=False``) silences the stages inside and tells placers with a status line of
their own (milp) to keep quiet too (:func:`silenced`). Under torchrun only rank 0 reports.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from rich.console import Console

from moirai.environment import torchrun_world
from moirai.errors import InputError

_Function = TypeVar("_Function", bound=Callable[..., Any])
_console: ContextVar[Console | None] = ContextVar("moirai_progress_console", default=None)
_in_stage: ContextVar[bool] = ContextVar("moirai_progress_in_stage", default=False)
_silenced: ContextVar[bool] = ContextVar("moirai_progress_silenced", default=False)
# Where the running stage shows what it is doing now (None outside a stage that reports).
_update: ContextVar[Callable[[str], None] | None] = ContextVar("moirai_progress_update", default=None)
LOG_EVERY_S = 5.0  # in a log, the least time between two lines of one stage's progress
LONG_STAGE_S = 2.0  # a stage whose budget is at least this long says so when it starts


@contextmanager
def shown(enabled: bool = True, console: Console | None = None) -> Iterator[None]:
    """Let the stages run inside this block report (to ``console``, default stderr) when ``enabled``; a disabled
    block silences every stage inside, placers' own status lines included. Only rank 0 of torchrun reports."""
    if _console.get() is not None or _silenced.get():
        yield
        return
    if not enabled or not _reports_here():
        token = _silenced.set(True)
        try:
            yield
        finally:
            _silenced.reset(token)
        return
    token = _console.set(console or Console(stderr=True))
    try:
        yield
    finally:
        _console.reset(token)


def _reports_here() -> bool:
    """Whether this process reports: rank 0 of a torchrun world, or a local run
    (:func:`moirai.environment.torchrun_world`). A malformed ``RANK`` or ``WORLD_SIZE`` reports too: what uses ranks
    refuses it itself, and planning a problem file, which uses none, is not stopped by a variable left in a shell."""
    try:
        world = torchrun_world()
    except InputError:
        return True
    return world is None or world.rank == 0


def silenced() -> bool:
    """Whether the caller asked for no progress at all (``progress=False``, or a rank other than 0)."""
    return _silenced.get()


def showing() -> bool:
    """Whether a stage is reporting now, so that :func:`update` reaches the user."""
    return _update.get() is not None


def update(text: str) -> None:
    """Show ``text`` as what the running stage is doing now (in a log, at most every :data:`LOG_EVERY_S`)."""
    show = _update.get()
    if show is not None:
        show(text)


def reports_progress(function: _Function) -> _Function:
    """Run ``function`` inside :func:`shown`, enabled by its own ``progress`` argument (:func:`progress_wanted`)."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def with_progress(*args: Any, **kwargs: Any) -> Any:
        with shown(progress_wanted(signature.bind_partial(*args, **kwargs).arguments)):
            return function(*args, **kwargs)

    return with_progress  # type: ignore[return-value]


def progress_wanted(arguments: dict[str, Any]) -> bool:
    """Whether a call with these bound ``arguments`` reports: its ``progress`` where given (not None), else, for a
    method, its object's ``progress`` setting (a compiled model keeps compile's, so that ``progress=False`` there
    also quiets its ``run_distributed`` and its server's start), else True."""
    given = arguments.get("progress")
    if given is not None:
        if not isinstance(given, bool):  # "no" is true: a word would switch reporting on, not off
            raise InputError(f"progress={given!r} ({type(given).__name__}): give True, False or None")
        return given
    return bool(getattr(arguments.get("self"), "progress", True))


def carried() -> Callable[[], AbstractContextManager[None]]:
    """This block's reporting (where to, or silenced), to re-enter later: a server starts its workers at its first
    request, in a call or thread of its own, after the call that opened it and its :func:`shown` have returned."""
    console, silent = _console.get(), _silenced.get()

    @contextmanager
    def again() -> Iterator[None]:
        console_token, silent_token = _console.set(console), _silenced.set(silent)
        try:
            yield
        finally:
            _silenced.reset(silent_token)
            _console.reset(console_token)

    return again


@contextmanager
def stage(name: str, plan: str | None = None) -> Iterator[None]:
    """Report ``name`` while the block (or decorated function) runs and its time when it ends.

    ``plan``: what a stage that may take longer than a couple of seconds will do (``"milp, limit 1 min"``); a
    log then gets a start line, so that a long silence has a reason.
    """
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
            with console.status(f"{name} …") as status, _updating(lambda text: status.update(f"{name} … {text}")):
                yield
            console.print(f"[green]✓[/] {name}  {format_seconds(time.perf_counter() - start)}", highlight=False)
        else:
            if plan is not None:
                _log_line(console, f"moirai: {name}: {plan}")
            with _updating(_log_lines(console, name)):
                yield
            _log_line(console, f"moirai: {name} {format_seconds(time.perf_counter() - start)}")
    finally:
        _in_stage.reset(token)


@contextmanager
def _updating(show: Callable[[str], None]) -> Iterator[None]:
    token = _update.set(show)
    try:
        yield
    finally:
        _update.reset(token)


def _log_lines(console: Console, name: str) -> Callable[[str], None]:
    """A line per update, but none sooner than :data:`LOG_EVERY_S` after the last (a log is read later)."""
    last = [time.perf_counter()]

    def show(text: str) -> None:
        now = time.perf_counter()
        if now - last[0] >= LOG_EVERY_S:
            last[0] = now
            _log_line(console, f"moirai: {name}: {text}")

    return show


def _log_line(console: Console, text: str) -> None:
    """``text`` as one line of a log, however long: rich wraps at its width (80 where stderr is no terminal), and a
    continuation without the ``moirai:`` prefix reads as another program's line to a reader or a grep."""
    console.print(text, highlight=False, soft_wrap=True, markup=False)


@contextmanager
def _jupyter_line(name: str, start: float) -> Iterator[None]:
    from IPython.display import Pretty, display

    handle = display(Pretty(f"… {name}"), display_id=True)
    outcome = "✗"
    try:
        with _updating(lambda text: handle.update(Pretty(f"… {name}: {text}"))):
            yield
        outcome = "✓"
    finally:
        handle.update(Pretty(f"{outcome} {name}  {format_seconds(time.perf_counter() - start)}"))


def format_seconds(seconds: float) -> str:
    """Compact time for tables and progress lines: ``850 ns``, ``12.3 us``, ``4.56 ms``, ``7.89 s``, ``12.0 min``;
    beyond 999 min in hours, days, then years (``3.17e+300 years``, not a number of 300 digits)."""
    if math.isinf(seconds):
        return "inf"
    if seconds >= _ROUNDS_TO_1000 * 60:
        value, unit = seconds / 3600, "h"
        for larger, scale in (("d", 86400.0), ("years", 365.25 * 86400)):
            if value >= _ROUNDS_TO_1000:
                value, unit = seconds / scale, larger
        return f"{value:.3g} {unit}" if value < 99.95 or value >= _ROUNDS_TO_1000 else f"{value:.0f} {unit}"
    for unit, scale in (("min", 60.0), ("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale * _ROUNDS_TO_1000 / 1000:  # 0.9996 s is 1.00 s, not 1000 ms
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 99.95 else f"{value:.0f} {unit}"
    return f"{seconds * 1e9:.0f} ns"


_ROUNDS_TO_1000 = 999.5  # a value this large prints as 1000 of its unit: the next unit shows it
