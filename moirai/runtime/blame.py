"""Naming the guilty rank when a distributed run fails.

A rank whose wait fails writes what it was waiting for into the store (:func:`report_failure`),
reads the others' reports and follows who waited for whom to the rank that failed on its own or
that nobody heard from within a grace period, a hung or dead rank (:func:`blamed`). The store may be on a host
whose network went away, where a store call waits for TCP to give up (many minutes): every call here is bounded
(:func:`moirai.runtime.store.answered_within`), and a store that does not answer counts as a rank nobody heard from.
"""

from __future__ import annotations

import datetime
import json
import time
import traceback
from collections.abc import Mapping
from typing import Any

from moirai.errors import DistributedError
from moirai.runtime.groups import Group
from moirai.runtime.store import StoreSilent, answered_within, get_json, json_value, store_call

# How long a failed rank waits for the other ranks' reports before naming a rank nobody heard from.
# A rank that gave up this much later than the one waiting for it was stopped meanwhile (SIGSTOP, starved).
_STOPPED_GAP_S = 1.0
_REPORT_GRACE_S = 3.0
_REPORT_POLL_S = 0.05


class PeerFailure(DistributedError):
    """A wait on ``peer`` failed: usually a consequence of that rank's (or a rank it waits for) failure."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class RankSilent(DistributedError):
    """The error naming a rank nobody heard from (``rank``, hung or dead): it will not end on its own, so whoever
    stops the ranks kills it at once rather than waiting for it."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def failure_key(rank: int) -> str:
    """Where rank ``rank`` says why it failed (:func:`report_failure`)."""
    return f"moirai/failure/{rank}"


def report_failure(store: Any, rank: int, peer: int | None, message: str) -> None:
    """Tell the other ranks why this rank failed: on its own (``peer`` None) or waiting for ``peer``."""
    report = {"peer": peer, "message": message, "at": time.time()}

    def write() -> None:
        store.set_timeout(datetime.timedelta(seconds=_REPORT_GRACE_S))
        store.set(failure_key(rank), json.dumps(report))

    try:
        answered_within(write, _REPORT_GRACE_S)
    except Exception:
        pass  # the store's host is gone too: the others name this rank as one nobody heard from


def read_report(store: Any, rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank``'s failure report, checked: :class:`moirai.DistributedError` naming the key unless it is one."""

    def valid(report: Any) -> bool:
        peer = report.get("peer", ...) if isinstance(report, dict) else ...
        return (
            isinstance(report, dict)
            and isinstance(report.get("message"), str)
            and (peer is None or (type(peer) is int and 0 <= peer < world_size and peer != rank))
            and isinstance(report.get("at", 0.0), int | float)
        )

    expected = f'{{"peer": null or a rank 0..{world_size - 1} other than {rank}, "message": a string}}'
    return get_json(store, failure_key(rank), "failure report", valid, expected, answer_s=_REPORT_GRACE_S)


def _read_report(store: Any, rank: int, world_size: int, deadline: float) -> dict[str, Any] | None:
    key = failure_key(rank)
    while True:
        try:
            if answered_within(lambda: store.check([key]), _REPORT_GRACE_S):
                return read_report(store, rank, world_size)
        except StoreSilent:
            return None  # the store does not answer: nobody heard from this rank
        except DistributedError:
            raise
        except Exception:
            return None  # the store is gone (or does not answer): nobody heard from this rank
        if time.monotonic() > deadline:
            return None
        time.sleep(_REPORT_POLL_S)


def setup_failure_key(rank: int) -> str:
    return f"moirai/failure/setup/{rank}"


def report_setup_failure(store: Any, rank: int, error: BaseException) -> None:
    """Tell the ranks waiting for this one to join them why it never will (:func:`wait_for_ranks` names it)."""
    message = f"{type(error).__name__}: {error}"

    def write() -> None:
        store.set(setup_failure_key(rank), json.dumps({"message": message, "at": time.time()}))

    try:
        answered_within(write, _REPORT_GRACE_S)
    except Exception:
        pass  # the store is gone: the waiting ranks say that instead


_JOIN_POLL_S = 0.05


def _setup_message(rank: int, raw: bytes) -> str:
    """The error in rank ``rank``'s setup failure report ``raw``, or why it is none (written by no rank of ours)."""

    def valid(report: Any) -> bool:
        return isinstance(report, dict) and isinstance(report.get("message"), str)

    try:
        return json_value(setup_failure_key(rank), raw, "setup failure report", valid)["message"][:2000]
    except DistributedError as forged:
        return f"({forged})"


def wait_for_ranks(store: Any, keys: Mapping[int, str], doing: str, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for every rank of ``keys`` to set its key (``doing`` it, e.g. "joining the process
    group"); a :class:`moirai.DistributedError` naming the rank that reported failing before it got there, with its
    error (:func:`report_setup_failure`), or the ranks that did not within ``timeout_s``, and what to do."""
    deadline = time.monotonic() + timeout_s
    pending = dict(keys)
    while pending:
        who = f"rank {min(pending)}"
        if store_call(lambda: store.check(list(pending.values())), who, doing):
            return
        for rank, key in sorted(pending.items()):
            if store_call(lambda key=key: store.check([key]), f"rank {rank}", doing):
                del pending[rank]
            elif store_call(lambda rank=rank: store.check([setup_failure_key(rank)]), f"rank {rank}", doing):
                report = store_call(lambda rank=rank: store.get(setup_failure_key(rank)), who, doing)
                raise DistributedError(
                    f"rank {rank} failed before {doing}, so this rank stops too: {_setup_message(rank, report)}; "
                    f"fix rank {rank}'s error (see its output) and start every rank again"
                )
        if pending and time.monotonic() > deadline:
            late = ", ".join(str(k) for k in sorted(pending))
            raise DistributedError(
                f"rank{'s' if len(pending) > 1 else ''} {late} did not get to {doing} within {timeout_s:g} s: "
                f"{'they' if len(pending) > 1 else 'it'} failed or stopped before (see its output), or its script "
                "does not call what this rank's does (every rank but 0 calls moirai.serve_rank(compiled), or every "
                "rank run_rank, in the same order); start every rank again"
            )
        time.sleep(_JOIN_POLL_S)


def blamed(group: Group, error: BaseException, what: str) -> DistributedError:
    """Report this rank's failure, then the error naming the guilty rank: who failed on its own, or went silent.

    Starting from the rank this one waited for, follow each report's "waiting for" to a rank that
    failed on its own or that sent no report within the grace period (hung or dead). A report that
    is none (forged, or written without the run's secret) is the error, naming its store key.
    """
    try:
        return _blamed(group, error, what)
    except DistributedError as forged:
        return DistributedError(f"rank {group.rank} ({group.devices[group.rank]}) failed during {what}: {forged}")


def _blamed(group: Group, error: BaseException, what: str) -> DistributedError:
    rank = group.rank
    peer = error.peer if isinstance(error, PeerFailure) else None
    own = str(error) if peer is not None else describe_error(error)
    report_failure(group.store, rank, peer, own)
    if peer is None:
        return DistributedError(f"rank {rank} ({group.devices[rank]}) failed during {what}: {own}")
    chain = [f"rank {rank}: {own.removeprefix(f'rank {rank}: ')}"]
    reports: dict[int, dict[str, Any]] = {rank: {"peer": peer, "at": time.time(), "message": own}}
    guilty, named_at, silent = peer, reports[rank]["at"], False
    while True:
        report = _read_report(group.store, guilty, group.world_size, _report_deadline(named_at))
        if report is None:
            headline = (
                f"rank {guilty} ({group.devices[guilty]}) hung or died during {what}: no rank heard from it within the "
                f"time limit{group.describe_rank(guilty)} (a part that computes for longer than the time limit, "
                "timeout_s, looks the same: raise it for requests that take that long)"
            )
            silent = True
            break
        if report["peer"] is None:
            headline = f"rank {guilty} ({group.devices[guilty]}) failed during {what}: {report['message']}"
            break
        chain.append(f"rank {guilty}: {report['message'].removeprefix(f'rank {guilty}: ')}")
        reports[guilty] = report
        if report["peer"] in reports:
            headline = _loop_headline(group, reports, report["peer"], what) or (
                f"rank {guilty} ({group.devices[guilty]}) failed during {what}: {report['message']}"
            )
            break
        guilty, named_at = report["peer"], report.get("at", time.time())
    message = headline + "\nwhile " + "\nwhile ".join(chain)
    return RankSilent(message, guilty) if silent else DistributedError(message)


def _report_deadline(named_at: float) -> float:
    """Until when (monotonic) to wait for the report of a rank that a report written at ``named_at`` (wall clock)
    waited for: the grace counts from that report, so that a rank further down a chain, which learnt of the failure
    later, does not wait the grace again (over gloo each rank learns only when the one it waited for exits, after
    its own verdict); never longer than the grace from now, whatever the clocks say."""
    remaining_s = min(max(named_at + _REPORT_GRACE_S - time.time(), 0.0), _REPORT_GRACE_S)
    return time.monotonic() + remaining_s


def _loop_headline(group: Group, reports: dict[int, dict[str, Any]], start: int, what: str) -> str | None:
    """Ranks that waited for each other in a loop: the rank that gave up first waited for the one that stopped first
    (a suspended or starved process, this one included), which the others then waited for in turn. None where the
    rank it waited for gave up too within ``_STOPPED_GAP_S``, its own wait timing out, or any two ranks of the loop,
    one waiting for the other, did: then nobody stopped, the waits timed out together (a message the program never
    sends), and the rank whose report closed the loop is named as failing. A rank whose wait failed otherwise (its
    peer hung up) was alive but late: a part computing for longer than the time limit, however soon after the other
    it failed."""
    loop, member = [start], reports[start]["peer"]
    while member != start:
        loop.append(member)
        member = reports[member]["peer"]
    first = min(loop, key=lambda k: reports[k].get("at", float("inf")))
    stopped = reports[first]["peer"]
    first_at = reports[first].get("at")
    if first_at is None:
        return None
    # A rank whose own wait did not time out learnt of the failure from the first one's hang-up: it was alive, late.
    together = reports[stopped].get("at", first_at) - first_at < _STOPPED_GAP_S and _timed_out(reports[stopped])
    # Nor did anyone stop where two ranks of the loop, one waiting for the other, both timed out together: the waits
    # of one request ran out alike (equal limits started together), and which rank wrote first is a coin toss.
    if together or any(_timed_out_together(reports[m], reports[reports[m]["peer"]]) for m in loop):
        return None
    late_s = reports[group.rank]["at"] - reports[first].get("at", reports[group.rank]["at"])
    this = ", this process" if stopped == group.rank else ""
    return (
        f"rank {stopped} ({group.devices[stopped]}{this}) stopped responding during {what}: rank {first} gave up "
        f"waiting for it first, {late_s:.1f} s before this rank's error; did its part compute for longer than the "
        "time limit (raise timeout_s for requests that take that long), or was it suspended (SIGSTOP, a debugger) "
        "or starved of CPU for that long?"
    )


def _timed_out_together(waiting: dict[str, Any], waited_for: dict[str, Any]) -> bool:
    """Whether a rank's wait and the wait of the rank it waited for both timed out, within ``_STOPPED_GAP_S``."""
    at, other_at = waiting.get("at"), waited_for.get("at")
    if at is None or other_at is None:
        return False
    return abs(other_at - at) < _STOPPED_GAP_S and _timed_out(waiting) and _timed_out(waited_for)


def _timed_out(report: dict[str, Any]) -> bool:
    """Whether a report's wait ended at its time limit (shared memory's TimeoutError, gloo's "Timed out ..."), not
    because its peer closed the connection."""
    return "timed out" in str(report.get("message", "")).lower()


def describe_error(error: BaseException) -> str:
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    return f"{type(error).__name__}: {error}\n{''.join(frames[-6:])}"
