"""One request that raises inside a part fails alone: the rank names the op and the cause, and serves on.

An op that raises on a request's values (an index out of range, a model that rejects an input)
is the request's fault, not the rank's. The rank that caught it writes the op and the cause to
the store (:func:`report_part_failure`), still receives every message of the request and sends
each one it owes, zeros in place of the tensors its part did not compute, so no rank waits and
no message stays unclaimed to meet a later request's tag; then its status message tells rank 0.
Rank 0 reads the reports of the ranks whose status says failed and fails that request's future
alone with a :class:`moirai.RequestError` (:func:`request_error`). A rank that receives zeros
may raise on them too: the error names first the ranks that no other failed rank sent
tensors to.

A failed send, receive or wait (a rank died or hung) is no request's fault: it ends the rank as
before (:mod:`moirai.runtime.blame`).
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from moirai.errors import RequestError
from moirai.frontend.trace import TensorSpec
from moirai.runtime.split import SplitProgram, TensorTransfer, concrete_shape
from moirai.runtime.store import get_json

STATUS_OK, STATUS_FAILED = 0, 1
_CAUSE_CHARS = 600


class PartFailure(NamedTuple):
    """What a rank's part raised on one request: the fx node that raised and the exception, in words."""

    rank: int
    op: str
    cause: str

    def __repr__(self) -> str:
        return f"PartFailure(rank {self.rank} at {self.op})"


def part_failure(rank: int, module: fx.GraphModule, error: BaseException) -> PartFailure:
    """The failure of ``module`` (called through its ``forward``, so the traceback reaches its generated code)."""
    cause = f"{type(error).__name__}: {str(error).strip()}"
    if len(cause) > _CAUSE_CHARS:
        cause = cause[:_CAUSE_CHARS] + " ..."
    return PartFailure(rank, failing_op(module, error), cause)


def failing_op(module: fx.GraphModule, error: BaseException) -> str:
    """The node of ``module`` whose line of generated code raised ``error``, as ``name (target)``."""
    code = getattr(type(module).forward, "__code__", None)
    lineno_map = getattr(module, "_lineno_map", None)
    node = None
    traceback: types.TracebackType | None = error.__traceback__
    while traceback is not None and code is not None and lineno_map:
        if traceback.tb_frame.f_code is code:
            index = lineno_map.get(traceback.tb_lineno - code.co_firstlineno)
            if index is not None:
                node = list(module.graph.nodes)[index]
        traceback = traceback.tb_next
    if node is None:
        return "an op of its part"
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.name} ({target})"


def placeholder(spec: TensorSpec, values: Mapping[str, int]) -> torch.Tensor:
    """Zeros in place of a tensor a failed part did not compute: the receiver's buffer takes the same shape."""
    return torch.zeros(concrete_shape(spec, values), dtype=spec.dtype)


def settle_failed_part(
    transport: Any, transfers: Sequence[TensorTransfer], rank: int, values: Mapping[str, int]
) -> None:
    """After ``rank``'s part raised: receive what it still had coming, send zeros for what it still owed.

    ``transport`` is the part's (:class:`moirai.runtime.protocol._Transport`): it kept what the part posted, waited
    for and sent before it raised.
    """
    for position, transfer in enumerate(transfers):
        if transfer.dst == rank and position not in transport.posted:
            transport.post_recv(position)
    for pending in list(transport.posted.values()):
        if id(pending) not in transport.waited:
            transport.wait_recv(pending)
    for position, transfer in enumerate(transfers):
        if transfer.src == rank and position not in transport.sent:
            transport.send(placeholder(transfer.spec, values), position)


def _key(request: int, rank: int) -> str:
    return f"moirai/request/{request}/failed/{rank}"


def report_part_failure(store: Any, request: int, failure: PartFailure) -> None:
    """Tell rank 0 why ``failure.rank`` failed ``request`` (written before its status message goes)."""
    store.set(_key(request, failure.rank), json.dumps({"op": failure.op, "cause": failure.cause}))


def read_part_failure(store: Any, request: int, rank: int) -> PartFailure:
    """Rank ``rank``'s report on ``request``, checked: :class:`moirai.DistributedError` naming the key unless one."""
    key = _key(request, rank)

    def valid(report: Any) -> bool:
        return isinstance(report, dict) and isinstance(report.get("op"), str) and isinstance(report.get("cause"), str)

    report = get_json(store, key, "part failure", valid, '{"op": a string, "cause": a string}')
    _forget(store, key)
    return PartFailure(rank, report["op"], report["cause"])


def _forget(store: Any, key: str) -> None:
    try:
        store.raw.delete_key(store.prefix + key)
    except Exception:
        pass  # a store without deletion keeps the key; the next failure of this request index overwrites it


def request_error(
    program: SplitProgram, devices: Sequence[torch.device], request: int, failures: Sequence[PartFailure]
) -> RequestError:
    """The error of a request whose parts raised: first the ranks no other failed rank sent tensors to."""
    failed = {failure.rank for failure in failures}
    fed = {rank: _upstream(program, rank) & (failed - {rank}) for rank in failed}
    first = [failure for failure in failures if not fed[failure.rank]] or list(failures)
    then = [failure for failure in failures if failure not in first]
    lines = [
        f"request {request} failed on rank {failure.rank} ({devices[failure.rank]}) at op {failure.op}: {failure.cause}"
        for failure in first
    ]
    lines += [
        f"then rank {failure.rank} ({devices[failure.rank]}) failed at op {failure.op} on the zeros sent in place "
        f"of rank(s) {sorted(fed[failure.rank])}'s tensors: {failure.cause}"
        for failure in then
    ]
    return RequestError(
        "\n".join(lines) + "\nonly this request failed: the ranks serve the next requests; check this request's "
        "inputs (values the model rejects, such as an index out of range)"
    )


def _upstream(program: SplitProgram, rank: int) -> set[int]:
    """The ranks whose tensors reach ``rank``'s part in a request, directly or through other parts."""
    senders: dict[int, set[int]] = {}
    for transfer in program.transfers:
        senders.setdefault(transfer.dst, set()).add(transfer.src)
    found: set[int] = set()
    frontier = [rank]
    while frontier:
        for src in senders.get(frontier.pop(), ()):
            if src not in found:
                found.add(src)
                frontier.append(src)
    return found - {rank}
