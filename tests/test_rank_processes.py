"""Ranks forked from the fork server take rank 0's environment and standard streams as they are when they start
([Note: ranks fork from a server that imported torch once]), and run the user's main-guard check as spawned ones did."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from moirai.runtime.rank_processes import RankInheritance, rank_context

_VARIABLE = "MOIRAI_TEST_RANK_INHERITANCE"


def _report(inheritance: RankInheritance | None) -> None:
    """A rank's first steps: what it sees of rank 0's environment, on the streams it writes to."""
    if inheritance is not None:
        inheritance.apply()
    print(f"out {os.environ.get(_VARIABLE)}", flush=True)
    print(f"err {os.environ.get(_VARIABLE)}", file=sys.stderr, flush=True)


def _run(inheritance: RankInheritance | None) -> None:
    process = rank_context().Process(target=_report, args=(inheritance,))
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 0


@contextmanager
def _streams_to(out: Path, err: Path):  # noqa: ANN202
    """This process's descriptors 1 and 2 into files, as a notebook or pytest redirects them between runs."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    targets = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for path in (out, err)]
    try:
        os.dup2(targets[0], 1), os.dup2(targets[1], 2)
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for descriptor in (*saved, *targets):
            os.close(descriptor)


def test_a_rank_takes_rank_0s_environment_and_streams_as_they_are_when_it_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(_VARIABLE, "when the server started")
    _run(None)  # the fork server runs from here on, with this environment and these streams
    monkeypatch.setenv(_VARIABLE, "now")
    with _streams_to(tmp_path / "out", tmp_path / "err"):
        _run(RankInheritance.of_this_process())
    assert (tmp_path / "out").read_text() == "out now\n"
    assert (tmp_path / "err").read_text() == "err now\n"


def test_without_what_it_inherits_a_forked_rank_would_see_the_servers_environment_and_streams(
    tmp_path, monkeypatch
) -> None:
    """Why RankInheritance exists: the fork server's environment and streams are those of its own start."""
    if rank_context().get_start_method() != "forkserver":
        pytest.skip("ranks are spawned here: they take rank 0's environment and streams at their start anyway")
    monkeypatch.setenv(_VARIABLE, "when the server started")
    _run(None)
    monkeypatch.setenv(_VARIABLE, "now")
    with _streams_to(tmp_path / "out", tmp_path / "err"):
        _run(None)
    assert (tmp_path / "out").read_text() == (tmp_path / "err").read_text() == ""
