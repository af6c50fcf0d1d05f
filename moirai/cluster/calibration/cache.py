"""This machine's calibration, cached on disk: measured the first time a link kind is needed, then read.

One file per host, CPU, core count and torch version, beside the measured profiles
(:func:`moirai.files.default_cache_dir`); one process of a host measures at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import socket
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from moirai.cluster.calibration.fit import HostLink, NoisyTimingsError, TransferCost, link_kind
from moirai.cluster.calibration.measure import measure_link_kinds
from moirai.cluster.calibration.request_cost import RequestCost, measure_request_cost
from moirai.cluster.host import cpu_model
from moirai.cluster.kinds import CPU
from moirai.errors import CacheError, ClusterError, MoiraiWarning, did_you_mean, user_stacklevel
from moirai.file_numbers import float_fault
from moirai.files import (
    default_cache_dir,
    lock_exclusively,
    lock_holders,
    own_lock_file,
    private_cache_folder,
    read_own_text,
    set_aside_corrupt,
    write_atomically,
)
from moirai.progress import stage
from moirai.user_files import parsing

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

# 2: the sender computes around its send; 3: one host's ranks message through shared memory; 4: the runtime's
# own work per request (RequestCost); 5: that work measured between parts that compute as a model's do; 7: ranks
# of several threads calibrate on one (measure.calibration_resources)
CALIBRATION_FORMAT_VERSION = 7
# The words for a calibration measured (then cached) on this machine, not read from a file.
MEASURED_CALIBRATIONS = ("auto", "remeasure")
_CALIBRATION_WORDS = (*MEASURED_CALIBRATIONS, "none")
_CALIBRATION_CHOICES = (
    "pass 'auto' (this machine's cached calibration), 'remeasure', 'none' (the detected defaults) or the path of a "
    "calibration file (moirai calibrate --save PATH)"
)


def check_calibration(calibration: object) -> None:
    """A :class:`ClusterError` unless ``calibration`` is one of its words or the path of a file, whatever the
    devices: compile's, load's and compile_lm's argument, checked where a list of one device would never read it."""
    if not isinstance(calibration, (str, os.PathLike)):
        raise ClusterError(
            f"calibration={calibration!r} ({type(calibration).__name__}) is not a word or a path; "
            + _CALIBRATION_CHOICES
        )
    if calibration in _CALIBRATION_WORDS or Path(calibration).is_file():
        return
    if not os.fspath(calibration).strip():  # Path("") is ".", a folder
        raise ClusterError(f"calibration={calibration!r} is empty; {_CALIBRATION_CHOICES}")
    if Path(calibration).is_dir():  # a folder exists: "does not exist" sent the user looking for a typo
        raise ClusterError(
            f"calibration={str(calibration)!r} is a folder, not a calibration file; {_CALIBRATION_CHOICES}"
        )
    if isinstance(calibration, str) and os.sep not in calibration and not Path(calibration).suffix:
        close = did_you_mean(calibration.strip(), _CALIBRATION_WORDS)
        raise ClusterError(
            f"calibration={calibration!r} is not a calibration word{close} nor a file; {_CALIBRATION_CHOICES}"
        )
    raise ClusterError(f"calibration file {str(calibration)!r} does not exist; {_CALIBRATION_CHOICES}")


# How long a compile waits for another process measuring this machine's links: longer than measuring them takes.
_LOCK_WAIT_S = 600.0


def local_calibration(
    torch_devices: Sequence[str], calibration: str | Path = "auto", cache_dir: str | Path | None = None
) -> dict[str, TransferCost]:
    """Transfer costs of every link kind between ``torch_devices``, by :func:`link_kind`.

    ``calibration``: ``"auto"`` reads this machine's cached calibration and measures (then
    caches) only the link kinds it lacks; ``"remeasure"`` measures them again and replaces the
    cached ones; a path reads a calibration file (written by ``moirai calibrate --save``) and
    measures nothing.
    """
    devices = [str(torch.device(d)) for d in torch_devices]
    needed = {link_kind(a, b): (a, b) for a in devices for b in devices if a != b or devices.count(a) > 1}
    check_calibration(calibration)
    if calibration == "none":
        raise ClusterError(
            "calibration='none' (the detected defaults) measures and reads no links; local_calibration needs 'auto', "
            "'remeasure' or a calibration file"
        )
    if calibration not in MEASURED_CALIBRATIONS:
        stored = read_calibration(calibration)
        missing = sorted(set(needed) - set(stored))
        if missing:
            raise ClusterError(
                f"calibration file {str(calibration)!r} has no {missing} links; measure them with "
                "moirai calibrate on this machine, or pass calibration='auto'"
            )
        return {kind: stored[kind] for kind in needed}
    path = calibration_cache_path(cache_dir)
    # One process measures at a time: the torchrun ranks of a host that compile at once then all read the
    # calibration the first one measured, and so make the same plan.
    with _exclusive(path.with_suffix(".lock")):
        cached = cached_links(path) if calibration == "auto" else {}
        missing = {kind: pair for kind, pair in needed.items() if kind not in cached}
        for kind, pair in missing.items():
            if kind not in cached:  # measuring a -> b measures b -> a too
                with stage("calibrate links", f"{pair[0]} <-> {pair[1]}, once for this machine (then cached)"):
                    cached.update(_measured_again_if_noise(pair))
        if missing:
            write_calibration(
                path,
                {**cached_links(path), **cached},
                _read_cached_requests(path),
                cached_host_links(path),
                private=True,
            )
    return {kind: cached[kind] for kind in needed}


def local_request_cost(calibration: str | Path = "auto", cache_dir: str | Path | None = None) -> RequestCost:
    """The runtime's own work per request on this machine (:class:`RequestCost`), read and measured as
    :func:`local_calibration` reads and measures links (measured once per machine, 20-40 s, then cached beside
    them)."""
    if calibration not in MEASURED_CALIBRATIONS:
        stored = read_request_cost(calibration)
        if stored is None:
            raise ClusterError(
                f"calibration file {str(calibration)!r} has no request costs; measure them with moirai calibrate "
                "--save PATH on this machine, or pass calibration='auto'"
            )
        return stored
    link = local_calibration([CPU.name, CPU.name], "auto", cache_dir)[link_kind(CPU.name, CPU.name)]
    path = calibration_cache_path(cache_dir)
    with _exclusive(path.with_suffix(".lock")):
        links = cached_links(path)  # read first: a corrupt request cost sets the whole file aside
        requests = _read_cached_requests(path) if calibration == "auto" else None
        if requests is None:
            with stage("calibrate requests", "the runtime's own work per request, once for this machine (then cached)"):
                requests = measure_request_cost(link)
            write_calibration(path, links, requests, cached_host_links(path), private=True)
    return requests


def _measured_again_if_noise(pair: tuple[str, str]) -> dict[str, TransferCost]:
    """:func:`measure_link_kinds`, measured once more (with a warning) where the first timings fit no line: a compile
    should not fail on one burst of another process's work; twice is an error that says so."""
    try:
        return measure_link_kinds(pair)
    except NoisyTimingsError as error:
        warnings.warn(
            f"calibrating {pair[0]} <-> {pair[1]}: {error}; measuring again",
            MoiraiWarning,
            stacklevel=user_stacklevel(),
        )
    return measure_link_kinds(pair)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (POSIX; elsewhere nothing is locked), waited for at most
    ``_LOCK_WAIT_S``: a process of this user's that hangs holding it must not hang every later compile."""
    with own_lock_file(lock_path) as lock:
        if fcntl is not None and not lock_exclusively(lock, _LOCK_WAIT_S):
            holders = ", ".join(f"process {pid}" for pid in lock_holders(lock)) or "another process"
            raise CacheError(
                f"the calibration cache's lock {lock_path} is held by {holders} (for {_LOCK_WAIT_S:g} s now), which "
                "measures this machine's links one process at a time; end it if it hangs, or pass a calibration "
                "file or calibration='none'"
            )
        yield


def cached_links(path: Path) -> dict[str, TransferCost]:
    """The cached calibration, or nothing when there is none, it was measured by an older moirai or it is corrupt."""
    if not path.exists():
        return {}
    try:
        return read_calibration(path)
    except CorruptCalibrationError as error:
        set_aside_corrupt(path, "the calibration cache", error.what)
    except ClusterError:
        pass
    return {}


def local_host_links(
    calibration: str | Path = "auto", cache_dir: str | Path | None = None
) -> dict[HostLink, TransferCost]:
    """The links between hosts measured under torchrun (``moirai calibrate --save`` or ``--update-cache``, or
    ``compile`` with ``"auto"``: :func:`~.across_hosts.measure_host_links`): a calibration file's, or with ``"auto"``
    and ``"remeasure"`` this machine's cached ones (measuring them needs every host's ranks, so nothing here measures
    them)."""
    if calibration in MEASURED_CALIBRATIONS:
        return cached_host_links(calibration_cache_path(cache_dir))
    return read_host_links(calibration)


def cache_host_links(links: Mapping[HostLink, TransferCost], cache_dir: str | Path | None = None) -> None:
    """Add ``links`` (measured under torchrun) to this machine's cached calibration, replacing those it had."""
    path = calibration_cache_path(cache_dir)
    with _exclusive(path.with_suffix(".lock")):
        host_links = {**cached_host_links(path), **links}
        write_calibration(path, cached_links(path), _read_cached_requests(path), host_links, private=True)


def cached_host_links(path: Path) -> dict[HostLink, TransferCost]:
    """The cached links between hosts, or nothing (as :func:`cached_links`)."""
    if not path.exists():
        return {}
    try:
        return read_host_links(path)
    except CorruptCalibrationError as error:
        set_aside_corrupt(path, "the calibration cache", error.what)
    except ClusterError:
        pass
    return {}


def _read_cached_requests(path: Path) -> RequestCost | None:
    """The cached request cost, or None when there is none, it was measured by an older moirai or it is corrupt."""
    if not path.exists():
        return None
    try:
        return read_request_cost(path)
    except CorruptCalibrationError as error:
        set_aside_corrupt(path, "the calibration cache", error.what)
    except ClusterError:
        pass
    return None


def calibration_cache_path(cache_dir: str | Path | None = None) -> Path:
    """Where this machine's calibration lives: one file per host, CPU, core count, torch version and calibration
    format (two moirai versions on one machine keep their own rather than measuring again over each other's), in a
    folder of this user's that no other can write to (:func:`moirai.files.private_cache_folder`)."""
    machine = f"{socket.gethostname()}|{cpu_model()}|cores={os.cpu_count()}|torch {torch.__version__}"
    machine += f"|format {CALIBRATION_FORMAT_VERSION}"
    digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
    root = cache_dir if cache_dir is not None else default_cache_dir()
    return private_cache_folder(root, "calibration") / f"{digest}.json"


class CorruptCalibrationError(ClusterError):
    """A calibration file that is not what moirai writes: not JSON, or of this format with the wrong structure."""

    def __init__(self, path: str | Path, what: str) -> None:
        self.what = what
        super().__init__(f"calibration file {str(path)!r} is corrupt: {what}; moirai calibrate --save PATH writes one")


def read_calibration(path: str | Path) -> dict[str, TransferCost]:
    """The transfer costs stored in a calibration file, by link kind."""
    links = _calibration_record(path).get("links")
    if not isinstance(links, dict):
        raise CorruptCalibrationError(path, "it has no 'links' table")
    return {kind: _fields_of(TransferCost, fields, path, f"links[{kind!r}]") for kind, fields in links.items()}


def read_host_links(path: str | Path) -> dict[HostLink, TransferCost]:
    """The links between hosts stored in a calibration file (none where it was measured on one host)."""
    entries = _calibration_record(path).get("host_links", [])
    if not isinstance(entries, list):
        raise CorruptCalibrationError(path, "'host_links' is not a list")
    links = {}
    for i, entry in enumerate(entries):
        where = f"host_links[{i}]"
        ends = [entry.get(key) for key in HostLink._fields] if isinstance(entry, dict) else []
        if len(ends) != len(HostLink._fields) or not all(isinstance(end, str) for end in ends):
            raise CorruptCalibrationError(path, f"{where} does not name {', '.join(HostLink._fields)} ({entry!r:.80})")
        links[HostLink(*ends)] = _fields_of(TransferCost, entry.get("cost"), path, f"{where}.cost")
    return links


def read_request_cost(path: str | Path) -> RequestCost | None:
    """The runtime's work per request stored in a calibration file (None when it holds links only)."""
    fields = _calibration_record(path).get("requests")
    return None if fields is None else _fields_of(RequestCost, fields, path, "requests")


def _fields_of(cls: type, fields: Any, path: str | Path, where: str) -> Any:
    """``cls(**fields)`` when ``fields`` holds exactly ``cls``'s fields, each a finite number >= 0 (a bandwidth > 0)
    that a float holds (:func:`moirai.file_numbers.float_fault`: ``10**400`` was an OverflowError that no reader
    caught): times and rates as measured, which no fit makes negative."""
    names = [field.name for field in dataclasses.fields(cls)]
    if not isinstance(fields, dict) or sorted(fields) != sorted(names):
        raise CorruptCalibrationError(path, f"{where} is not the numbers {', '.join(names)} ({str(fields)[:80]})")
    for name, value in fields.items():
        rate = name.startswith("bandwidth")
        fault = float_fault(value)
        if fault is None and rate and value == 0:
            fault = "is 0"
        if fault is not None:
            least = "positive" if rate else "non-negative"
            raise CorruptCalibrationError(path, f"{where}.{name} {fault}; it must be {least}")
    return cls(**{name: float(value) for name, value in fields.items()})


def _calibration_record(path: str | Path) -> dict[str, Any]:
    try:
        with parsing("JSON", "it", functools.partial(CorruptCalibrationError, path)):
            record = json.loads(read_own_text(path))
    except FileNotFoundError:
        raise ClusterError(f"calibration file {str(path)!r} does not exist; run moirai calibrate --save") from None
    except OSError as error:  # a link (moirai reads its own files without following one), a directory, ...
        if os.path.islink(path):
            raise ClusterError(
                f"calibration file {str(path)!r} is a symbolic link, which moirai does not follow (a link in a shared "
                f"folder could hand it another file's numbers); give the file it points to, "
                f"{os.path.realpath(path)!r}, instead"
            ) from None
        raise ClusterError(f"calibration file {str(path)!r} cannot be read: {error.strerror}") from None
    if not isinstance(record, dict):
        raise CorruptCalibrationError(path, f"it holds a {type(record).__name__}, not a table")
    if record.get("format") != CALIBRATION_FORMAT_VERSION:
        raise ClusterError(f"{path} is not a moirai calibration of format {CALIBRATION_FORMAT_VERSION}; measure again")
    return record


def write_calibration(
    path: str | Path,
    costs: Mapping[str, TransferCost],
    requests: RequestCost | None = None,
    host_links: Mapping[HostLink, TransferCost] | None = None,
    private: bool = False,
) -> None:
    """Write a calibration file: one the user names keeps the mode of the file of theirs it replaces, else 0644 less
    the umask (:func:`moirai.files.write_atomically`); ``private``: this machine's cache, mode 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "format": CALIBRATION_FORMAT_VERSION,
        "links": {k: dataclasses.asdict(c) for k, c in costs.items()},
    }
    if requests is not None:
        record["requests"] = dataclasses.asdict(requests)
    if host_links:
        record["host_links"] = [{**link._asdict(), "cost": dataclasses.asdict(c)} for link, c in host_links.items()]
    write_atomically(path, json.dumps(record, indent=1), private=private)
