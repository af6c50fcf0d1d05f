"""Two tests at a time on the machine's cores, and alone the tests that need the machine to themselves.

[Note: tests that run alone]
The suite runs in two pytest-xdist workers (pyproject's ``addopts``). Most tests compute in their own process and
judge no time, so two of them share two cores well. A slow test (``@pytest.mark.slow``) is different as a rule: it
starts ranks pinned to the cores, waits on timeouts with a bounded slack, gives a search a wall-clock budget or
compares timings, and a second test beside it would take half its cores. So slow tests run alone: after every
other test (collection puts them last, and xdist hands tests out in collection order), each holding an exclusive
lock that the other tests hold shared. A slow test that computes in one process (its own, or one it starts that
starts no ranks: a notebook's kernel) and whose checks hold however much of a core it gets (it judges no time; a
search's budget may bound it where every way the search can stop has its check) says so with
``@pytest.mark.in_process`` and runs beside the others, and first of all: the quick tests then fill in around
the long ones, where a long one handed out last would run on alone while the tests that run alone wait for it.

The lock prefers the test that runs alone: it queues on a turnstile that every test passes, so tests that keep
arriving cannot hold it off.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def runs_alone(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None and item.get_closest_marker("in_process") is None


def _phase(item: pytest.Item) -> int:
    """0: a slow test that runs beside others; 1: a quick test; 2: a test that runs alone."""
    if runs_alone(item):
        return 2
    return 0 if item.get_closest_marker("slow") is not None else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_phase)  # stable: each phase's tests in their order


def _lock_path(run_id: str, name: str) -> Path:
    return Path(tempfile.gettempdir()) / f"moirai-tests-{run_id}.{name}.lock"


@contextmanager
def _locked(path: Path, operation: int) -> Iterator[None]:
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(descriptor, operation)
        yield
    finally:
        os.close(descriptor)  # closing the descriptor releases its lock


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of ``item`` under the lock of [Note: tests that run alone]."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # one process runs every test: nothing runs beside it
        return (yield)
    turnstile, machine = _lock_path(run_id, "turnstile"), _lock_path(run_id, "machine")
    if runs_alone(item):
        with _locked(turnstile, fcntl.LOCK_EX), _locked(machine, fcntl.LOCK_EX):
            return (yield)
    with _locked(turnstile, fcntl.LOCK_EX):
        pass
    with _locked(machine, fcntl.LOCK_SH):
        return (yield)


def pytest_sessionfinish(session: pytest.Session) -> None:
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is not None and os.environ.get("PYTEST_XDIST_WORKER") is None:  # the controller, after its workers
        for name in ("turnstile", "machine"):
            _lock_path(run_id, name).unlink(missing_ok=True)
