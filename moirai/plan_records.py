"""Plan records: what ``CompiledModel.save`` writes and ``moirai.load`` reads (a plan file), and what rank 0 hands
every other rank under torchrun (:class:`PlanHandover`), checked field by field before anything is built from them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moirai.cluster.devices import Cluster
from moirai.environment import torchrun_world
from moirai.errors import DistributedError, PlanError, PlanVersionWarning, user_stacklevel
from moirai.file_numbers import float_fault, int_fault
from moirai.planning.objective import OBJECTIVE_NAMES
from moirai.runtime import distributed
from moirai.runtime.blame import report_setup_failure
from moirai.runtime.hosts import rank_hosts
from moirai.runtime.store import get_json, wait_for_key
from moirai.user_files import check_input_path, load_json, parsing, read_text

if TYPE_CHECKING:
    from moirai.frontend.trace import TracedModel

PLAN_FORMAT_VERSION = 1
# Long enough for rank 0's planning (a milp within its time limit); a rank 0 that fails says so sooner.
_PLAN_HANDOVER_TIMEOUT_S = 1800.0
PLAN_KEYS = ("format", "devices", "node_device", "groups", "device_order", "plan")
# The section CompiledLM.save adds to its step's plan record (what moirai.load_lm rebuilds the CompiledLM from).
LM_KEY = "lm"


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
        world = torchrun_world()  # None for a world of one rank: that compile plans here, as outside torchrun
        if world is None:
            return None  # before reading devices: a malformed list is local_cluster's to name
        given = [d.torch_device for d in devices.devices] if isinstance(devices, Cluster) else list(devices)
        torch_devices = [str(torch.device(d)) for d in given]
        store = distributed.torchrun_store(world, torch_devices)
        if store is None:
            return None
        return cls(store, world.rank, torch_devices, isinstance(devices, Cluster))

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

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Another rank's taking of rank 0's plan: an error in it (a plan that does not fit this rank's model) is
        reported in the store, so rank 0, waiting for this rank to join its requests, names this rank and its error
        (:func:`moirai.runtime.blame.wait_for_ranks`) instead of timing out."""
        try:
            yield
        except BaseException as error:
            report_setup_failure(self.store, self.rank, error)
            raise

    def receive(self) -> dict[str, Any]:
        wait_for_key(self.store, self.key, self.planner, "planning", _PLAN_HANDOVER_TIMEOUT_S)

        def plan_or_failure(record: Any) -> bool:  # a plan record (every field of one), or rank 0's planning error
            return isinstance(record, dict) and (
                isinstance(record.get("failed"), str) or all(key in record for key in PLAN_KEYS)
            )

        record = get_json(self.store, self.key, "plan", plan_or_failure, 'a plan record, or {"failed": a string}')
        if isinstance(record.get("failed"), str):
            raise DistributedError(f"{self.planner} failed to plan, so this rank has no plan: {record['failed']}")
        # As a plan file's: what fails them is a rank 0 of another moirai, which from_plan_record would meet as a
        # raw ValueError or TypeError.
        check_plan_record(record, f"{self.planner}'s plan", "run the same moirai and torch on every rank")
        return record


def _sentence(text: str) -> str:
    """``text`` ending as a sentence does (a question keeps its mark)."""
    return text if text.endswith((".", "?")) else text + "."


def read_plan_file(path: str | Path) -> dict[str, Any]:
    """The record ``CompiledModel.save`` wrote, or a :class:`PlanError` saying what is wrong with the file."""
    check_input_path(path, "plan file", "the file CompiledModel.save(path) wrote", PlanError)
    subject, again = f"plan file {str(path)!r}", "save the plan again with CompiledModel.save(path)"

    def error(message: str) -> PlanError:
        return PlanError(f"{_sentence(message)} {again[0].upper()}{again[1:]}")

    try:
        with parsing("JSON", subject, error):
            text = read_text(path)
            if not text.strip():
                raise PlanError(f"{subject} is empty; {again}")
            record = load_json(text, subject, error)
    except FileNotFoundError:
        raise PlanError(f"{subject} does not exist; write one with CompiledModel.save(path)") from None
    except OSError as fault:
        raise PlanError(f"cannot read {subject}: {fault}") from None
    if not isinstance(record, dict):
        raise PlanError(
            f"plan file {str(path)!r} holds a JSON {type(record).__name__}, not a moirai plan (an object with keys "
            f"{list(PLAN_KEYS)}); give the file CompiledModel.save wrote"
        )
    check_plan_record(record, subject, f"{again}, or compile the model again")
    _warn_on_other_versions(record.get("versions"), path)
    return record


def check_plan_record(record: dict[str, Any], source: str, fix: str) -> None:
    """A :class:`PlanError` naming ``source`` (a plan file, rank 0's plan), the first of its fields whose type or
    range is not what save writes, and ``fix``, what to do (what the fields must say of the traced model, and of
    each other, ``from_plan_record`` checks)."""
    if not (_is_int(record.get("format")) and record["format"] == PLAN_FORMAT_VERSION):  # true and 1.0 equal 1
        raise PlanError(
            f"{source} is not a moirai plan of format {PLAN_FORMAT_VERSION} ('format' is "
            f"{str(record.get('format'))[:20]!r}); {fix}"
        )
    missing = [key for key in PLAN_KEYS if key not in record]
    if isinstance(record.get("plan"), dict):  # a plan of another type is named by its field's check
        missing += [f"plan.{key}" for key in ("placement", "device_names") if key not in record["plan"]]
    if missing:
        raise PlanError(f"{source} lacks {missing}; it is not a whole moirai plan: {fix}")
    for field, (holds, expected) in _PLAN_FIELDS.items():
        value = _field(record, field)
        if not holds(value, record):
            raise PlanError(f"{source}: {field!r} is {str(value)[:80]!r}, not {expected}; {fix}")


_ABSENT = object()  # a key the file does not have (an optional one: from_dict's default)


def _field(record: dict[str, Any], field: str) -> Any:
    """``record``'s value at ``"key"`` or ``"plan.key"`` (``plan`` is an object by then: it is checked first)."""
    outer, _, inner = field.partition(".")
    value = record.get(outer, _ABSENT)
    return value.get(inner, _ABSENT) if inner else value


def _optional(holds: Callable[[Any], bool]) -> Callable[[Any, dict[str, Any]], bool]:
    """Absent (from_dict's default), or what ``holds``."""
    return lambda value, _: value is _ABSENT or holds(value)


def _null_or(holds: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or holds(value)


def _is_int(value: Any) -> bool:
    """An int (not a bool, not a float a save never writes) an int64 holds: ``2**63`` was an OverflowError in numpy."""
    return type(value) is int and int_fault(value) is None


def _is_seconds(value: Any) -> bool:
    """A time a plan's simulation or bound gives: never negative, NaN or infinite (a plan whose task cannot run is
    refused before it has a time; a bound of no plan is null), and a float (``10**400`` was an OverflowError)."""
    return type(value) in (int, float) and float_fault(value) is None


def _is_list_of(value: Any, holds: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(holds(item) for item in value)


def _is_list_of_name_lists(value: Any) -> bool:
    return _is_list_of(value, lambda group: _is_list_of(group, lambda name: isinstance(name, str)))


def _is_device_list(value: Any) -> bool:
    """What save writes of the devices: load calls them by these names where it is given no devices, as the plan's
    problem and summary call them, so two of one name would be one."""
    return _is_list_of(value, _is_device) and len(value) > 0 and len({device["name"] for device in value}) == len(value)


def _is_device(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(key), str) for key in ("name", "torch_device"))


def _is_device_index(value: Any, record: dict[str, Any]) -> bool:
    devices = record["devices"]  # checked before node_device
    return _is_int(value) and 0 <= value < len(devices)


def _is_transfer_order(value: Any) -> bool:
    """``[[a, b, [tensor, ...]], ...]``: the tensors on link ``a -> b``, in order."""
    return _is_list_of(
        value,
        lambda link: (
            isinstance(link, list)
            and len(link) == 3
            and _is_int(link[0])
            and _is_int(link[1])
            and _is_list_of(link[2], _is_int)
        ),
    )


def _is_dynamic_dims(value: Any) -> bool:
    """What :func:`moirai.frontend.symbolic_shapes.dynamic_dims_to_json` writes: each dim's symbol, ``Dim`` name and
    range, and every symbolic input axis as ``[flat input, axis, expression]``."""
    return (
        isinstance(value, dict)
        and _is_list_of(value.get("dims"), _is_dim)
        and _is_list_of(
            value.get("axes"),
            lambda axis: (
                isinstance(axis, list)
                and len(axis) == 3
                and _is_int(axis[0])
                and _is_int(axis[1])
                and min(axis[0], axis[1]) >= 0
                and isinstance(axis[2], str)
            ),
        )
    )


def _is_dim(dim: Any) -> bool:
    return (
        isinstance(dim, dict)
        and isinstance(dim.get("symbol"), str)
        and isinstance(dim.get("name"), str)
        and dim["name"].isidentifier()  # torch.export.Dim asserts it
        and _is_int(dim.get("min"))
        and dim["min"] >= 0
        # torch.export.Dim asserts max > min: a dim of one size is no dynamic dim
        and (dim.get("max") is None or (_is_int(dim["max"]) and dim["max"] > dim["min"]))
    )


def _is_tensors(value: Any) -> bool:
    """What :func:`traced_tensors` writes."""
    return (
        isinstance(value, dict)
        and _is_list_of(value.get("inputs"), _is_tensor)
        and isinstance(value.get("weights"), dict)
        and all(_is_tensor(tensor) for tensor in value["weights"].values())
    )


def _is_tensor(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("dtype"), str)
        and _is_list_of(value.get("shape"), lambda size: (_is_int(size) and size >= 0) or isinstance(size, str))
    )


# Every field of a plan file a load reads, in the order checked (a field before those that read it), with what save
# writes there.
_PLAN_FIELDS: dict[str, tuple[Callable[[Any, dict[str, Any]], bool], str]] = {
    "devices": (
        lambda v, _: _is_device_list(v),
        "a non-empty list of {'name', 'torch_device'} objects of distinct names",
    ),
    "node_device": (
        lambda v, r: isinstance(v, dict) and all(_is_device_index(k, r) for k in v.values()),
        "an object mapping op names to device indices 0..len(devices)-1",
    ),
    "groups": (lambda v, _: _is_list_of_name_lists(v), "a list of lists of op names"),
    "device_order": (lambda v, _: _null_or(_is_list_of_name_lists)(v), "null or a list of lists of op names"),
    "plan": (lambda v, _: isinstance(v, dict), "an object (a saved Plan)"),
    "plan.placement": (
        lambda v, r: _is_list_of(v, lambda device: _is_device_index(device, r)),
        "a list of device indices 0..len(devices)-1, one per op group",
    ),
    "plan.device_names": (lambda v, _: _is_list_of(v, lambda n: isinstance(n, str)), "a list of device names"),
    "plan.order": (
        _optional(_null_or(lambda v: _is_list_of(v, lambda o: _is_list_of(o, _is_int)))),
        "null or a list of lists of op group indices, one per device",
    ),
    "plan.transfer_order": (_optional(_null_or(_is_transfer_order)), "null or a list of [from, to, [tensor, ...]]"),
    "plan.placer": (_optional(lambda v: isinstance(v, str)), "a string"),
    "plan.objective": (
        _optional(lambda v: v in OBJECTIVE_NAMES),
        f"the name of an objective, one of {OBJECTIVE_NAMES}",
    ),
    **{
        f"plan.{key}": (_optional(_null_or(_is_seconds)), "null or a finite number of seconds, 0 or more")
        for key in ("makespan_s", "objective_s", "lower_bound_s", "placement_time_s")
    },
    "plan.report": (_optional(lambda v: isinstance(v, dict)), "an object (a placer's report)"),
    "dynamic_dims": (
        _optional(_null_or(_is_dynamic_dims)),
        "null or {'dims': [{'symbol', 'name', 'min', 'max'}, ...], 'axes': [[input, axis, expression], ...]} "
        "with 0 <= min < max (or max null)",
    ),
    "tensors": (
        _optional(_null_or(_is_tensors)),
        "null or {'inputs': [{'shape', 'dtype'}, ...], 'weights': {name: {'shape', 'dtype'}}}",
    ),
}


def traced_tensors(traced: TracedModel) -> dict[str, Any]:
    """The shape and dtype of every input and weight of ``traced``, as a plan file keeps them: a dynamic dimension
    is its expression (``"s0"``), a static one its size."""
    graph_module = traced.graph_module
    names = [str(node.target) for node in graph_module.graph.find_nodes(op="get_attr")]
    weights = {name: getattr(graph_module, name) for name in names}
    return {
        "inputs": [_tensor_json(spec.shape, spec.dtype, spec.symbolic_shape) for spec in traced.input_specs],
        "weights": {
            name: _tensor_json(tuple(value.shape), value.dtype)
            for name, value in weights.items()
            if isinstance(value, torch.Tensor)
        },
    }


def _tensor_json(shape: tuple[int, ...], dtype: torch.dtype, symbolic: tuple[str, ...] | None = None) -> dict[str, Any]:
    sizes = list(shape) if symbolic is None else [int(e) if e.isdecimal() else e for e in symbolic]
    return {"shape": sizes, "dtype": str(dtype).removeprefix("torch.")}


def check_traced_tensors(record: dict[str, Any], traced: TracedModel, source: str | Path) -> None:
    """A :class:`PlanError` unless ``traced`` has the inputs and weights the plan was made for (a record without
    them, from an older moirai, is not checked): its costs and memory are those of the planned sizes."""
    if record.get("tensors") is None:
        return
    planned, here = record["tensors"], traced_tensors(traced)
    _check_no_new_dynamic_axes(planned["inputs"], here["inputs"], traced, source)
    differences = [
        f"input {position} is {_describe_tensor(now)}, planned {_describe_tensor(then)}"
        for position, (then, now) in enumerate(zip(planned["inputs"], here["inputs"], strict=False))
        if not _same_tensor(then, now)
    ]
    differences += [
        f"weight {name!r} is {_describe_tensor(here['weights'][name])}, planned {_describe_tensor(then)}"
        for name, then in planned["weights"].items()
        if name in here["weights"] and not _same_tensor(then, here["weights"][name])
    ]
    if len(planned["inputs"]) != len(here["inputs"]):
        differences.append(f"it takes {len(here['inputs'])} input tensors, planned {len(planned['inputs'])}")
    if differences:
        raise PlanError(
            f"{source} was planned for {traced.model_name} with other tensors: {'; '.join(differences[:3])}"
            f"{'; ...' if len(differences) > 3 else ''}; its costs and memory are those of the planned sizes: load "
            "it with the model and example inputs it was planned for, or compile again for these"
        )


def _check_no_new_dynamic_axes(
    planned: list[dict[str, Any]], here: list[dict[str, Any]], traced: TracedModel, source: str | Path
) -> None:
    """A :class:`PlanError` for an input axis of one size in the plan but dynamic here: the plan's costs, memory and
    split program are those of that size, so it does not serve a range."""
    axes = [
        f"input {position} axis {axis} (planned {then}, here {now})"
        for position, (before, after) in enumerate(zip(planned, here, strict=False))
        for axis, (then, now) in enumerate(zip(before["shape"], after["shape"], strict=False))
        if _is_int(then) and not _is_int(now)
    ]
    if axes:
        raise PlanError(
            f"{source} plans {traced.model_name} for one size of axes that the dynamic_shapes given make dynamic: "
            f"{'; '.join(axes[:3])}; a plan serves only the sizes it was planned for: compile the model again with "
            "these dynamic_shapes to plan for their range, or load the plan without them"
        )


def _same_tensor(planned: dict[str, Any], here: dict[str, Any]) -> bool:
    """Same dtype and rank, and the same size on every axis static in both (a dynamic one serves a range)."""
    return (
        planned["dtype"] == here["dtype"]
        and len(planned["shape"]) == len(here["shape"])
        and all(a == b for a, b in zip(planned["shape"], here["shape"], strict=True) if _is_int(a) and _is_int(b))
    )


def _describe_tensor(tensor: dict[str, Any]) -> str:
    return f"({', '.join(str(size) for size in tensor['shape'])}) {tensor['dtype']}"


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
            stacklevel=user_stacklevel(),
        )
