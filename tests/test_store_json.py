"""A JSON value read from the run's store is checked where it is read (store.get_json): under torchrun the store is
the network's, so garbage under a key is a DistributedError naming the key and showing what it holds, never a raw
JSONDecodeError, UnicodeDecodeError, KeyError or TypeError out of the reader."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from moirai.cluster.calibration import request_cost
from moirai.errors import DistributedError
from moirai.plan_records import PlanHandover
from moirai.runtime import runner
from moirai.runtime.agreement import ProgramDigest, read_verdict
from moirai.runtime.blame import wait_for_ranks
from moirai.runtime.store import SHOWN_CHARS, RunStore, get_json

GARBAGE = {
    "not UTF-8": b"\xff\xfe\x00garbage",
    "not JSON": b"{not json",
    "another shape": b'{"something": "else"}',
    "nested past the parser": b"[" * 100_000,
}


def _torchrun_store() -> RunStore:
    return RunStore(dist.HashStore(), None)  # torchrun's store: values as any process on the network set them


def _plan(store: RunStore) -> Any:
    handover = PlanHandover(store, 1, ["cpu", "cpu"], named_hosts=True)
    store.set(handover.key, store.get("garbage"))
    return handover.receive()


def _digest(store: RunStore) -> Any:
    store.set("moirai/agreement/0/1", store.get("garbage"))
    return ProgramDigest.read(store, "moirai/agreement/0/1")


def _under(key: str, read: Callable[[RunStore], Any]) -> Callable[[RunStore], Any]:
    def reader(store: RunStore) -> Any:
        store.set(key, store.get("garbage"))
        return read(store)

    return reader


# The readers that took their value as it came (json.loads, int(), record["field"]), by the key they read.
READERS = {
    "moirai/plan/": _plan,
    "moirai/resources/1": _under("moirai/resources/1", lambda store: runner._checked_resources(store, 1)),
    "moirai/pid/1": _under("moirai/pid/1", request_cost._worker_pid),
    "moirai/halves_s/1": _under("moirai/halves_s/1", request_cost._worker_halves_s),
    "moirai/agreement/0/1": _digest,
    "moirai/agreement/0/verdict": _under(
        "moirai/agreement/0/verdict", lambda store: read_verdict(store, "moirai/agreement/0/verdict")
    ),
}


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
@pytest.mark.parametrize("key", READERS)
def test_garbage_under_a_key_a_rank_reads_is_a_distributed_error_naming_the_key(key: str, garbage: bytes) -> None:
    store = _torchrun_store()
    store.set("garbage", garbage)
    with pytest.raises(DistributedError, match=f"store key '{re.escape(key)}[0-9]*' holds no ") as error:
        READERS[key](store)
    assert "run the same moirai on every rank" in str(error.value)
    assert error.value.__cause__ is None and error.value.__context__ is None  # no raw traceback chained under it


def test_a_value_of_the_right_shape_is_returned_and_a_long_wrong_one_shown_cut() -> None:
    store = _torchrun_store()
    store.set("moirai/halves_s/1", json.dumps([0.5, 1.5]))
    assert request_cost._worker_halves_s(store) == [0.5, 1.5]
    store.set("moirai/pid/1", "1234")  # as rank 1 sets it: str(os.getpid())
    assert request_cost._worker_pid(store) == 1234
    store.set("long", json.dumps(["x" * 1000]))
    with pytest.raises(DistributedError) as error:
        get_json(store, "long", "list of numbers", lambda v: all(type(x) is float for x in v), "[float, ...]")
    message = str(error.value)
    assert f"(got b'[\"{'x' * (SHOWN_CHARS - 4)}, cut to {SHOWN_CHARS} characters); expected [float, ...]" in message


def test_a_forged_setup_failure_report_is_named_as_one() -> None:
    store = _torchrun_store()
    store.set("here/1", "1")
    store.set("moirai/failure/setup/2", b"\xff not a report")
    with pytest.raises(DistributedError, match="rank 2 failed before joining.+key 'moirai/failure/setup/2' holds"):
        wait_for_ranks(store, {1: "here/1", 2: "here/2"}, "joining", timeout_s=5.0)
