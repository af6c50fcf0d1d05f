"""Cluster files: reading, checking and writing the TOML that describes a cluster, and the device table.

The schema is in :mod:`moirai.cluster.devices`' docstring. Every mistake in a file is a :class:`moirai.ClusterError`
naming the device, link or key, found before any number is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moirai.cluster.hardware import (
    GB,
    GBPS_IN_BYTES_PER_S,
    LOCAL_HOST,
    MICROSECOND,
    PRECISION_OF_DTYPE,
    TFLOPS,
    Device,
    FloatLiteral,
    Link,
    device_types,
    from_unit,
    in_unit,
)
from moirai.cluster.kinds import CPU, device_spellings, kind_named, kind_of, torch_device_types
from moirai.errors import ClusterError
from moirai.file_numbers import float_fault, int_fault, is_number
from moirai.user_files import check_input_path, parsing, read_text

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


_DEVICE_KEYS = {
    "name",
    "torch_device",
    "host",
    "rank",
    "kind",
    "type",
    "memory_gb",
    "peak_tflops",
    "memory_bandwidth_gb_per_s",
    "launch_overhead_us",
    "efficiency",
    "cores",
    "threads",
}
_LINK_KEYS = {"src", "dst", "bandwidth_gbps", "latency_us", "both_directions"}
_FILE_KEYS = {"name", "description", "devices", "links", "matrix"}
# The type every typed key of a [[devices]] or [[links]] entry must have (checked before any is read).
_NUMBER_KEYS = set(
    "memory_gb memory_bandwidth_gb_per_s launch_overhead_us efficiency bandwidth_gbps latency_us".split()
)
_INTEGER_KEYS = {"rank"}
_BOOLEAN_KEYS = {"both_directions"}
# Names and words: a device named 5 is not the device "5" a link names, and a type or kind is looked up as text.
_STRING_KEYS = {"name", "host", "kind", "type", "src", "dst"}


def check_device_names(names: Sequence[str]) -> None:
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ClusterError(f"duplicate device names {duplicates}; give every device its own name")


def check_device_ranks(devices: Sequence[Device]) -> None:
    """Every rank given a whole number >= 0 and no two devices one rank (a rank serves one device)."""
    for d in devices:
        if d.rank is not None and (type(d.rank) is not int or d.rank < 0):
            raise ClusterError(f"device {d.name!r} has rank {d.rank!r}; a rank is a whole number >= 0")
    ranks = [d.rank for d in devices if d.rank is not None]
    shared = sorted({r for r in ranks if ranks.count(r) > 1})
    if shared:
        names = [d.name for d in devices if d.rank in shared]
        raise ClusterError(f"devices {names} share rank {shared[0]}; give every device its own rank, or none")


def check_device(d: Device) -> None:
    if not d.memory_bytes > 0:
        raise ClusterError(f"device {d.name!r} has memory {d.memory_bytes} bytes; give it a positive memory_gb")
    peaks = [d.peak_flops, d.peak_flops_fp16, d.peak_flops_bf16]
    if any(not p > 0 for p in peaks if p is not None) or not d.memory_bandwidth_bytes_per_s > 0:
        raise ClusterError(f"device {d.name!r} needs positive peak FLOP/s and memory bandwidth")
    if not 0 < d.efficiency <= 1 or not d.launch_overhead_s >= 0:
        raise ClusterError(f"device {d.name!r}: efficiency must be in (0, 1] and launch overhead non-negative")
    kind_of(d)  # a kind the registry knows, else a ClusterError naming the device


def torch_device_name(spec: object, where: str) -> str:
    """The torch device string of ``spec`` (``"cpu"``, ``"cuda:1"``); :class:`ClusterError` naming ``where`` if none."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise ClusterError(
            f"{where} is {spec!r} of type {type(spec).__name__}; give a torch device string such as 'cpu' or 'cuda:0'"
        )
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ClusterError(f"{where} is {spec!r}, which is not a torch device; use 'cpu' or 'cuda:N'") from None
    if device.type not in torch_device_types():
        raise ClusterError(f"{where} is {spec!r}: moirai runs parts on {device_spellings()} devices, not {device.type}")
    return str(device)


def _check_arrays_of_tables(description: Mapping[str, Any]) -> None:
    """``[[devices]]`` and ``[[links]]`` must be arrays of tables; ``[devices]`` (one table) is a common slip."""
    for key in ("devices", "links"):
        entries = description.get(key)
        if entries is None or (isinstance(entries, list) and all(isinstance(e, Mapping) for e in entries)):
            continue
        got = f"a single table [{key}]" if isinstance(entries, Mapping) else f"{entries!r}"
        raise ClusterError(f"{key} must be an array of tables, one [[{key}]] entry each, got {got}; write [[{key}]]")
    if "matrix" in description and not isinstance(description["matrix"], Mapping):
        raise ClusterError(f"matrix must be a table ([matrix]), got {description['matrix']!r}")


def _check_types(entry: Mapping[str, Any], where: str) -> None:
    """Every number a number, before any is read: ``memory_gb = "lots"`` names the device and key."""
    for key, value in entry.items():
        if key in _NUMBER_KEYS:
            _check_number(value, f"{where}: {key}")
        if key in _INTEGER_KEYS and int_fault(value) is not None:
            raise ClusterError(f"{where}: {key} must be an integer, got {value!r:.60}")
        if key in _STRING_KEYS and not isinstance(value, str):
            raise ClusterError(f"{where}: {key} must be a string (in quotes), got {value!r}")
        if key in _BOOLEAN_KEYS and not isinstance(value, bool):
            raise ClusterError(f"{where}: {key} must be true or false, got {value!r}")
        if key == "peak_tflops":
            if not isinstance(value, Mapping):
                raise ClusterError(
                    f"{where}: peak_tflops must be a table of numbers like {{ fp32 = 10.0 }}, got {value!r}"
                )
            for precision, number in value.items():
                _check_number(number, f"{where}: peak_tflops.{precision}")


def _check_number(value: Any, where: str) -> None:
    """A number a float holds (:func:`moirai.file_numbers.float_fault`: ``10**400`` was read as infinity, or an
    OverflowError), not NaN; its sign and infinity are its key's check, which says what they mean there."""
    fault = float_fault(value, negative=True, infinite=True)
    if fault is not None:
        raise ClusterError(f"{where} {fault}; give a number in the key's unit")


def _check_keys(entry: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ClusterError(f"{where} has unknown keys {unknown}; allowed keys are {sorted(allowed)}")


def cluster_description(description: Mapping[str, Any]) -> tuple[tuple[Device, ...], list[Link], str]:
    """The devices, direct links and name a parsed cluster file describes, every entry checked."""
    devices, name = devices_description(description)
    names = [d.name for d in devices]
    has_links, has_matrix = "links" in description, "matrix" in description
    if has_links and has_matrix:
        raise ClusterError("give either [[links]] or [matrix] in a cluster file, not both")
    if has_matrix:
        links = _links_from_matrix(description["matrix"], names)
    elif has_links:
        links = [link for entry in description["links"] for link in _links_from_dict(entry)]
    elif len(devices) == 1:
        links = []
    else:
        raise ClusterError("a cluster file with several devices needs [[links]] or a [matrix] between them")
    return devices, links, name


def devices_description(description: Mapping[str, Any]) -> tuple[tuple[Device, ...], str]:
    """The devices and name a parsed cluster file describes, every entry checked; links, if any, are not read
    (``moirai calibrate --base`` measures them)."""
    _check_keys(description, _FILE_KEYS, "the cluster file")
    _check_arrays_of_tables(description)
    entries = description.get("devices")
    if not entries:
        raise ClusterError("a cluster file needs at least one [[devices]] entry")
    devices = tuple(_device_from_dict(entry) for entry in entries)
    check_device_names([d.name for d in devices])
    check_device_ranks(devices)
    return devices, str(description.get("name", ""))


def read_cluster_devices(path: str | Path) -> tuple[tuple[Device, ...], str]:
    """The devices and name of the cluster file at ``path``, which need not have links yet."""
    description = read_cluster_file(path)
    try:
        return devices_description(description)
    except ClusterError as error:
        raise ClusterError(f"{path}: {error}") from None


def _device_from_dict(entry: Mapping[str, Any]) -> Device:
    name = entry.get("name")
    if not name:
        raise ClusterError(f"a [[devices]] entry has no name: {dict(entry)}")
    _check_keys(entry, _DEVICE_KEYS, f"device {name!r}")
    _check_types(entry, f"device {name!r}")
    type_name = entry.get("type")
    type_row: dict[str, Any] = {}
    if type_name is not None:
        if type_name not in device_types():
            raise ClusterError(
                f"device {name!r} has unknown type {type_name!r}; known types are {sorted(device_types())}"
            )
        type_row = device_types()[type_name]
    numbers = {**{key: value for key, value in type_row.items() if key in _DEVICE_KEYS}, **entry}
    peaks = {**type_row.get("peak_tflops", {}), **entry.get("peak_tflops", {})}
    for key in ("memory_gb", "memory_bandwidth_gb_per_s"):
        if key not in numbers:
            raise ClusterError(f"device {name!r} needs {key} (or a type from the device table that gives it)")
    if "fp32" not in peaks:
        raise ClusterError(f"device {name!r} needs peak_tflops = {{ fp32 = ... }} or a type from the device table")
    unknown_precisions = sorted(set(peaks) - set(PRECISION_OF_DTYPE.values()))
    if unknown_precisions:
        raise ClusterError(f"device {name!r}: unknown peak_tflops keys {unknown_precisions}; use fp32, fp16, bf16")
    torch_device = torch_device_name(entry.get("torch_device", CPU.name), f"device {name!r}: torch_device")
    return Device(
        name=name,
        torch_device=torch_device,
        memory_bytes=from_unit(numbers["memory_gb"], GB),
        peak_flops=from_unit(peaks["fp32"], TFLOPS),
        memory_bandwidth_bytes_per_s=from_unit(numbers["memory_bandwidth_gb_per_s"], GB),
        launch_overhead_s=from_unit(numbers.get("launch_overhead_us", 5.0), MICROSECOND),
        kind=_kind_name(numbers, torch_device, str(name)),
        device_type=type_name,
        peak_flops_fp16=from_unit(peaks["fp16"], TFLOPS) if "fp16" in peaks else None,
        peak_flops_bf16=from_unit(peaks["bf16"], TFLOPS) if "bf16" in peaks else None,
        efficiency=float(numbers.get("efficiency", 0.5)),
        host=entry.get("host", LOCAL_HOST),
        rank=entry.get("rank"),
        **_cores_and_threads(entry, str(name)),
    )


def _kind_name(numbers: Mapping[str, Any], torch_device: str, name: str) -> str:
    """The kind a device entry (or its type's row) gives, by its registered name; else that of its torch device."""
    if "kind" not in numbers:
        return kind_of(torch_device).name
    return kind_named(str(numbers["kind"]), f"device {name!r}").name


def _cores_and_threads(entry: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The optional ``cores`` and ``threads`` keys of a device entry, checked."""
    cores, threads = entry.get("cores"), entry.get("threads")
    if cores is not None:
        if not isinstance(cores, list) or not cores or any(type(c) is not int or int_fault(c, 0) for c in cores):
            raise ClusterError(f"device {name!r}: cores must be a non-empty list of core numbers, got {cores!r}")
        if len(set(cores)) != len(cores):
            raise ClusterError(f"device {name!r}: cores {cores} lists a core twice")
        cores = tuple(cores)
    if threads is not None and (type(threads) is not int or int_fault(threads, 1) is not None):
        raise ClusterError(f"device {name!r}: threads must be a positive integer, got {threads!r}")
    if cores is not None and threads is not None and threads > len(cores):
        raise ClusterError(
            f"device {name!r}: {threads} threads on {len(cores)} cores would oversubscribe them; "
            "give at most one thread per core"
        )
    return {"cores": cores, "threads": threads}


def device_to_dict(d: Device) -> dict[str, Any]:
    """Explicit numbers for every field, so the file does not depend on the table's version."""
    peaks = {"fp32": d.peak_flops, "fp16": d.peak_flops_fp16, "bf16": d.peak_flops_bf16}
    entry: dict[str, Any] = {"name": d.name, "torch_device": d.torch_device, "host": d.host}
    if d.rank is not None:
        entry["rank"] = d.rank
    if d.cores is not None:
        entry["cores"] = list(d.cores)
    if d.threads is not None:
        entry["threads"] = d.threads
    entry["kind"] = kind_of(d).name
    if d.device_type is not None:
        entry["type"] = d.device_type
    entry.update(
        memory_gb=in_unit(d.memory_bytes, GB),
        peak_tflops={key: in_unit(value, TFLOPS) for key, value in peaks.items() if value is not None},
        memory_bandwidth_gb_per_s=in_unit(d.memory_bandwidth_bytes_per_s, GB),
        launch_overhead_us=in_unit(d.launch_overhead_s, MICROSECOND),
        efficiency=d.efficiency,
    )
    return entry


def _links_from_dict(entry: Mapping[str, Any]) -> list[Link]:
    src, dst = entry.get("src"), entry.get("dst")
    if src is None or dst is None:
        raise ClusterError(f"a [[links]] entry needs src and dst: {dict(entry)}")
    _check_keys(entry, _LINK_KEYS, f"link {src!r} -> {dst!r}")
    _check_types(entry, f"link {src!r} -> {dst!r}")
    if "bandwidth_gbps" not in entry:
        raise ClusterError(f"link {src!r} -> {dst!r} has no bandwidth_gbps; give its bandwidth in Gbit/s")
    bandwidth = float(entry["bandwidth_gbps"])
    if not bandwidth > 0:
        raise ClusterError(f"link {src!r} -> {dst!r} has bandwidth {bandwidth} Gbps; it must be positive")
    latency = float(entry.get("latency_us", 0.0))
    if not latency >= 0:
        raise ClusterError(f"link {src!r} -> {dst!r} has latency {latency} us; it must be non-negative")
    forward = Link(
        str(src),
        str(dst),
        from_unit(entry["bandwidth_gbps"], GBPS_IN_BYTES_PER_S),
        from_unit(entry.get("latency_us", 0.0), MICROSECOND),
    )
    if entry.get("both_directions", False):
        return [forward, dataclasses.replace(forward, src=forward.dst, dst=forward.src)]
    return [forward]


def _links_from_matrix(matrix: Mapping[str, Any], names: Sequence[str]) -> list[Link]:
    _check_keys(matrix, {"bandwidth_gbps", "latency_us"}, "[matrix]")
    if "bandwidth_gbps" not in matrix:
        raise ClusterError("[matrix] needs bandwidth_gbps, a square matrix with one row and column per device")
    k = len(names)
    bandwidth = _square(matrix["bandwidth_gbps"], k, "bandwidth_gbps")
    latency_entry = matrix.get("latency_us", 0.0)
    if not is_number(latency_entry) and not isinstance(latency_entry, list):
        raise ClusterError(f"[matrix] latency_us must be a number or a {k}x{k} matrix, got {latency_entry!r}")
    if is_number(latency_entry):
        _check_number(latency_entry, "[matrix] latency_us")
    latency = (
        np.full((k, k), float(latency_entry)) if is_number(latency_entry) else _square(latency_entry, k, "latency_us")
    )
    links = []
    for a in range(k):
        for b in range(k):
            if a == b:
                continue
            if not bandwidth[a, b] > 0:
                raise ClusterError(
                    f"[matrix] bandwidth {names[a]!r} -> {names[b]!r} is {bandwidth[a, b]} Gbps; every off-diagonal "
                    "entry must be positive (describe a partial topology with [[links]] instead)"
                )
            if not latency[a, b] >= 0:  # NaN is refused as it is read
                raise ClusterError(f"[matrix] latency {names[a]!r} -> {names[b]!r} is negative")
            latency_us = latency_entry if is_number(latency_entry) else latency_entry[a][b]
            links.append(
                Link(
                    names[a],
                    names[b],
                    from_unit(matrix["bandwidth_gbps"][a][b], GBPS_IN_BYTES_PER_S),
                    from_unit(latency_us, MICROSECOND),
                )
            )
    return links


def _square(rows: Any, k: int, label: str) -> np.ndarray:
    if not isinstance(rows, list) or any(not isinstance(row, list) or len(row) != k for row in rows) or len(rows) != k:
        shape = [len(row) if isinstance(row, list) else 1 for row in rows] if isinstance(rows, list) else rows
        raise ClusterError(f"[matrix] {label} must be {k}x{k} (one row and column per device), got rows {shape}")
    if not all(is_number(value) for row in rows for value in row):  # numpy would read "100" and true as numbers
        raise ClusterError(f"[matrix] {label} must hold numbers, got {str(rows)[:80]}")
    for a, row in enumerate(rows):
        for b, value in enumerate(row):
            _check_number(value, f"[matrix] {label}[{a}][{b}]")
    return np.array(rows, float)


# --- files ---------------------------------------------------------------------------------


def read_cluster_file(path: str | Path) -> dict[str, Any]:
    """The parsed contents of the cluster file at ``path``."""
    check_input_path(
        path, "cluster file", "a cluster file (TOML; a preset by name: Cluster.preset(name))", ClusterError
    )
    try:
        with parsing("TOML", f"cluster file {str(path)!r}", ClusterError):
            return tomllib.loads(read_text(path), parse_float=FloatLiteral)
    except FileNotFoundError:
        preset = f"; {str(path)!r} is a preset: Cluster.preset({str(path)!r})" if str(path) in preset_names() else ""
        raise ClusterError(f"cluster file {str(path)!r} does not exist{preset}") from None
    except OSError as error:  # a folder, a file we may not read
        raise ClusterError(f"cluster file {str(path)!r} cannot be read: {error.strerror or error}") from None


def preset_names() -> tuple[str, ...]:
    """Names of the built-in cluster files (``moirai/data/clusters``)."""
    return tuple(
        sorted(entry.name.removesuffix(".toml") for entry in _preset_files().iterdir() if entry.name.endswith(".toml"))
    )


def preset_description(name: str) -> dict[str, Any]:
    """The parsed contents of the built-in cluster file ``name``."""
    return tomllib.loads(_preset_files().joinpath(f"{name}.toml").read_text(), parse_float=FloatLiteral)


def _preset_files() -> Any:
    return resources.files("moirai").joinpath("data/clusters")


def to_toml(description: Mapping[str, Any]) -> str:
    """TOML for the cluster-file schema: top-level scalars, then arrays of tables."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in description.items() if not isinstance(value, list)]
    for key, entries in description.items():
        if isinstance(entries, list):
            for entry in entries:
                lines += ["", f"[[{key}]]"] + [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # A JSON string is a TOML basic string where JSON escapes nothing TOML refuses: not ensure_ascii's surrogate
        # pairs (a name outside the BMP, an emoji, was written as two escapes TOML cannot read back), and DEL escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
        if isinstance(value, FloatLiteral):
            return value.text if any(c in value.text for c in ".eE") else f"{value.text}.0"
        return repr(float(value))
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):  # a device's cores
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")
