"""Plan records: what ``CompiledModel.save`` writes and ``moirai.load`` reads (a plan file), and what rank 0 hands
every other rank under torchrun (:class:`PlanHandover`), checked field by field before anything is built from them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from moirai.cluster.devices import Cluster
from moirai.errors import DistributedError, PlanError, PlanVersionWarning
from moirai.runtime import distributed
from moirai.runtime.hosts import rank_hosts
from moirai.runtime.store import wait_for_key

PLAN_FORMAT_VERSION = 1
# Long enough for rank 0's planning (a milp within its time limit); a rank 0 that fails says so sooner.
_PLAN_HANDOVER_TIMEOUT_S = 1800.0
PLAN_KEYS = ("format", "devices", "node_device", "groups", "device_order", "plan")


class PlanHandover:
    """Under torchrun, rank 0 plans and hands its plan to every other rank through the run's store (sealed where
    ``MOIRAI_RUN_SECRET`` is set), so no rank plans on numbers of its own; compiles pair up in call order."""

    _compiles = itertools.count()

    def __init__(self, store: Any, rank: int, torch_devices: Sequence[str], named_hosts: bool) -> None:
        self.store = store
        self.rank = rank
        self.torch_devices = list(torch_devices)  # one per rank
        self.plans = rank == 0
        world_size = len(self.torch_devices)
        self.key = f"moirai/plan/{next(self._compiles)}"
        # Devices given as strings are put on the hosts their ranks run on, where there are several: rank 0 then
        # prices the links between hosts as measured there (a cluster names its own hosts).
        self.hosts: list[str] | None = None
        if not named_hosts:
            hosts = rank_hosts(store, rank, world_size, f"{self.key}/host", _PLAN_HANDOVER_TIMEOUT_S)
            self.hosts = hosts if len(set(hosts)) > 1 else None

    @classmethod
    def under_torchrun(cls, devices: Cluster | Sequence[str]) -> PlanHandover | None:
        """None outside torchrun, or where the devices are not one per rank of this world."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None  # before reading devices: a malformed list is local_cluster's to name
        given = [d.torch_device for d in devices.devices] if isinstance(devices, Cluster) else list(devices)
        torch_devices = [str(torch.device(d)) for d in given]
        store = distributed.torchrun_store(torch_devices)
        if store is None:
            return None
        return cls(store, int(os.environ["RANK"]), torch_devices, isinstance(devices, Cluster))

    @property
    def planner(self) -> str:
        """Rank 0, with its host where the ranks span several."""
        return "rank 0" if self.hosts is None else f"rank 0 (host {self.hosts[0]})"

    def send(self, record: dict[str, Any]) -> None:
        self.store.set(self.key, json.dumps(record))

    @contextlib.contextmanager
    def planning(self) -> Iterator[None]:
        """Rank 0's planning: an error in it is handed over in place of the plan, so the other ranks fail with it at
        once, also where rank 0's script catches it and carries on (torchrun then stops nobody)."""
        try:
            yield
        except BaseException as error:
            try:
                self.store.set(self.key, json.dumps({"failed": f"{type(error).__name__}: {error}"}))
            except Exception:
                pass  # the store is gone: the others learn it from the store
            raise

    def receive(self) -> dict[str, Any]:
        wait_for_key(self.store, self.key, self.planner, "planning", _PLAN_HANDOVER_TIMEOUT_S)
        record = json.loads(self.store.get(self.key))
        if isinstance(record, dict) and isinstance(record.get("failed"), str):
            raise DistributedError(f"{self.planner} failed to plan, so this rank has no plan: {record['failed']}")
        if not isinstance(record, dict) or any(key not in record for key in PLAN_KEYS):
            raise DistributedError(f"store key {self.key!r} holds no plan: {str(record)[:80]!r}")
        return record


def read_plan_file(path: str | Path) -> dict[str, Any]:
    """The record ``CompiledModel.save`` wrote, or a :class:`PlanError` saying what is wrong with the file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise PlanError(f"plan file {str(path)!r} does not exist; write one with CompiledModel.save(path)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError(f"cannot read plan file {str(path)!r}: {error}") from None
    if not text.strip():
        raise PlanError(f"plan file {str(path)!r} is empty; save the plan again with CompiledModel.save(path)")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(
            f"plan file {str(path)!r} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); "
            "was it cut short? Save the plan again with CompiledModel.save(path)"
        ) from None
    if not isinstance(record, dict):
        raise PlanError(
            f"plan file {str(path)!r} holds a JSON {type(record).__name__}, not a moirai plan (an object with keys "
            f"{list(PLAN_KEYS)}); give the file CompiledModel.save wrote"
        )
    if record.get("format") != PLAN_FORMAT_VERSION:
        raise PlanError(f"{path} is not a moirai plan of format {PLAN_FORMAT_VERSION}; compile the model again")
    missing = [key for key in PLAN_KEYS if key not in record]
    missing += [f"plan.{key}" for key in ("placement", "device_names") if key not in (record.get("plan") or {})]
    if missing:
        raise PlanError(f"plan file {str(path)!r} lacks {missing}; it is not a whole moirai plan: save it again")
    _check_plan_fields(record, path)
    _warn_on_other_versions(record.get("versions"), path)
    return record


def _check_plan_fields(record: dict[str, Any], path: str | Path) -> None:
    """A :class:`PlanError` naming the first field of a plan file whose type or range is not what save writes."""
    devices = record["devices"]
    problems = {
        "devices": isinstance(devices, list)
        and all(isinstance(d, dict) and isinstance(d.get("torch_device"), str) for d in devices),
        "node_device": isinstance(record["node_device"], dict)
        and all(
            type(k) is int and 0 <= k < (len(devices) if isinstance(devices, list) else 0)
            for k in record["node_device"].values()
        ),
        "groups": _is_list_of_name_lists(record["groups"]),
        "device_order": record["device_order"] is None or _is_list_of_name_lists(record["device_order"]),
    }
    wrong = [field for field, ok in problems.items() if not ok]
    if wrong:
        expected = {
            "devices": "a list of {'name', 'torch_device'} objects",
            "node_device": "an object mapping op names to device indices 0..len(devices)-1",
            "groups": "a list of lists of op names",
            "device_order": "null or a list of lists of op names",
        }
        raise PlanError(
            f"plan file {str(path)!r}: {wrong[0]!r} is {str(record[wrong[0]])[:80]!r}, not {expected[wrong[0]]}; "
            "save the plan again with CompiledModel.save(path)"
        )


def _is_list_of_name_lists(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in value)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        moirai_version = version("moirai")
    except PackageNotFoundError:
        moirai_version = "unknown"
    return {"moirai": moirai_version, "torch": torch.__version__}


def _warn_on_other_versions(saved: Any, path: str | Path) -> None:
    """A plan made by another moirai or torch may trace to other op names: say so before they fail to match."""
    if not isinstance(saved, dict):
        return
    here = versions()
    other = [f"{name} {saved[name]} (here {here[name]})" for name in here if saved.get(name) not in (None, here[name])]
    if other:
        warnings.warn(
            f"plan file {str(path)!r} was saved with {', '.join(other)}; if loading fails or the split differs, "
            "compile the model again",
            PlanVersionWarning,
            stacklevel=3,
        )
