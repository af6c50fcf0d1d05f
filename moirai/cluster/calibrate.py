"""Calibrate links: what a transfer costs inside the runtime, per kind of local link.

Two rank processes are set up as the runtime sets up its workers (each pinned to its share of
the cores with as many compute threads, :mod:`moirai.runtime.resources`; the runtime's links: shared
memory between ranks of one host, gloo and NCCL process groups with their I/O threads off the rank's
cores) and move messages with the runtime's own
point-to-point code (staging, receive buffers, tags, waits). For each message the receiver has posted
its receive and is blocked in the wait (as a part waiting for an input is); the sender computes long
enough for it surely to be, reads the clock, sends, computes on for a while, and waits for its send to
finish. The sender computes as a part does around its sends: the I/O threads that move the message
then compete with compute for a core, which a sweep between idle ranks never shows (it measured a
third of the delay a transfer took inside a schedule). Per message, on the one clock of this host:

* **delay**: from the sender's send call to the receiver holding the tensor (woken up);
* **sender CPU time**: CPU time of the sender's process (all its threads, gloo's included)
  in its send call and its wait for the send (not the compute between): time its compute cannot use;
* **receiver CPU time**: CPU time of the receiver's process from posting its receive to the end
  of its blocked wait: the post, waking up, copying the message out (of the ring, or gloo's socket).

The median of the repeats at each size (after warm-up; the runtime sees typical messages, not
the fastest) is fitted as ``fixed + bytes * per_byte`` for each of the three: the delay gives the
link's latency and bandwidth (:class:`TransferCost`). CPU<->CPU and CPU<->GPU links of one host go
through shared memory (:mod:`moirai.runtime.shm`; gloo where it is off), GPU<->GPU over NCCL; all
use this one measurement (the device kind decides where the message lives and whether the clock
reading synchronises the device first).

Example::

    costs = measure_transfer_costs(["cpu", "cpu"])           # {(0, 1): TransferCost, (1, 0): ...}
    cluster = calibrate(world_size=2, output="cluster.toml")  # a cluster file with measured links

``compile`` on local devices reads a cached calibration of this machine (:func:`local_calibration`),
measured the first time a link kind is needed and stored next to the measured profiles.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from moirai.cluster.devices import Cluster, Device, Link
from moirai.cluster.kinds import kind_for_backend, kind_of
from moirai.errors import ClusterError, DistributedError
from moirai.planning.costs import RequestCosts

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

# 1 KiB .. 16 MiB: small sizes pin the latency, large ones the bandwidth.
DEFAULT_SIZES_BYTES = tuple(1024 * 4**k for k in range(8))
# Long enough for the receiver to be blocked in its wait before the message leaves; the sender computes
# meanwhile, and goes on computing after its send call, as a part does.
_SENDER_PAUSE_S = 2e-3
_SENDER_COMPUTES_ON_S = 2e-3
# 2: the sender computes around its send; 3: one host's ranks message through shared memory; 4: the runtime's
# own work per request (RequestCost)
CALIBRATION_FORMAT_VERSION = 4
# Requests of the two-rank program that measures RequestCost, after as many of warm-up.
_REQUESTS = 1000


@dataclasses.dataclass(frozen=True)
class TransferCost:
    """What one message over a directed link costs inside the runtime, as fitted lines in its size.

    ``latency_s + bytes / bandwidth_bytes_per_s``: from the send call to the blocked receiver
    holding the tensor. ``sender_cpu_s + bytes * sender_cpu_s_per_byte`` (and the receiver's):
    CPU time the transfer takes from that end's process.
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    sender_cpu_s: float
    sender_cpu_s_per_byte: float
    receiver_cpu_s: float
    receiver_cpu_s_per_byte: float

    def delay_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def sender_cpu_time_s(self, num_bytes: float) -> float:
        return self.sender_cpu_s + num_bytes * self.sender_cpu_s_per_byte

    def receiver_cpu_time_s(self, num_bytes: float) -> float:
        return self.receiver_cpu_s + num_bytes * self.receiver_cpu_s_per_byte


@dataclasses.dataclass(frozen=True)
class RequestCost:
    """The runtime's own CPU time per request on a rank, beyond its ops and the messages the model books.

    ``driver_cpu_s`` on rank 0: the caller's submit and wait, the driver's threads, the headers it sends and
    the model's inputs; ``worker_cpu_s`` on any other rank: its header, setting up its part (the model outputs'
    messages are booked on their own, :attr:`moirai.Problem.output_send_cpu_s`).
    Measured with the runtime's own server on two CPU ranks (:func:`measure_request_cost`): host work, which
    the model charges to every device taking part in a request (:attr:`moirai.Problem.request_cpu_s`).
    """

    driver_cpu_s: float
    worker_cpu_s: float


@dataclasses.dataclass(frozen=True)
class TransferTimings:
    """Per message size, the medians over the repeats of one directed link's three measurements."""

    sizes_bytes: tuple[int, ...]
    delay_s: tuple[float, ...]
    sender_cpu_s: tuple[float, ...]
    receiver_cpu_s: tuple[float, ...]

    def fit(self) -> TransferCost:
        latency, seconds_per_byte = fit_line(self.sizes_bytes, self.delay_s, "transfer delay")
        if not seconds_per_byte > 0:
            raise ClusterError(
                f"transfer delay does not grow with size (slope {seconds_per_byte:.3g} s/byte); "
                "the timings are noise: use larger sizes or more repeats"
            )
        # A line fitted to noisy CPU times may dip below zero at one end; no part of a cost is negative.
        sender = [max(x, 0.0) for x in fit_line(self.sizes_bytes, self.sender_cpu_s, "sender CPU time")]
        receiver = [max(x, 0.0) for x in fit_line(self.sizes_bytes, self.receiver_cpu_s, "receiver CPU time")]
        return TransferCost(max(latency, 0.0), 1.0 / seconds_per_byte, *sender, *receiver)


def fit_line(sizes_bytes: Sequence[float], values_s: Sequence[float], what: str) -> tuple[float, float]:
    """``(fixed_s, s_per_byte)`` of the least-squares line through ``values_s`` at ``sizes_bytes``."""
    sizes, values = np.asarray(sizes_bytes, float), np.asarray(values_s, float)
    if len(sizes) < 2 or np.ptp(sizes) == 0:
        raise ClusterError(f"fitting the {what} needs timings of at least two different message sizes")
    # Relative residuals: small messages (microseconds) set the fixed part as much as large ones
    # (milliseconds) set the slope; plain residuals would leave the fixed part to the large ones' noise.
    weight = 1.0 / np.maximum(np.abs(values), 1e-9)
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weight[:, None]
    (fixed, per_byte), *_ = np.linalg.lstsq(design, values * weight, rcond=None)
    return float(fixed), float(per_byte)


def measure_transfers(
    torch_devices: Sequence[str] = ("cpu", "cpu"),
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 15,
    warmup: int = 3,
    timeout_s: float = 300.0,
) -> dict[tuple[int, int], TransferTimings]:
    """Time every directed pair of ranks (rank r on ``torch_devices[r]``), one pair at a time."""
    devices = [str(torch.device(d)) for d in torch_devices]
    if len(devices) < 2:
        raise ClusterError("calibration needs at least two ranks (two devices)")
    missing = [d for d in devices if not kind_of(d).available(torch.device(d))]
    if missing:
        raise ClusterError(f"calibrating {devices} needs {missing}, which this machine does not have")
    if warmup < 0 or repeats < 1:
        raise ClusterError(f"calibration needs warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    sizes = tuple(int(s) for s in sizes_bytes)
    with tempfile.TemporaryDirectory(prefix="moirai-calibrate-") as results_dir:
        settings = [devices, _free_port(), list(sizes), repeats, warmup, timeout_s, results_dir]
        _run_ranks(settings, len(devices), timeout_s)
        reports = [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("rank*.json"))]
    return {
        (pair["src"], pair["dst"]): TransferTimings(
            sizes, tuple(pair["delay_s"]), tuple(pair["sender_cpu_s"]), tuple(pair["receiver_cpu_s"])
        )
        for report in reports
        for pair in report
    }


def measure_transfer_costs(
    torch_devices: Sequence[str] = ("cpu", "cpu"),
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 15,
    warmup: int = 3,
) -> dict[tuple[int, int], TransferCost]:
    """The fitted :class:`TransferCost` of every directed pair of ranks (rank r on ``torch_devices[r]``)."""
    timings = measure_transfers(torch_devices, sizes_bytes, repeats, warmup)
    return {pair: pair_timings.fit() for pair, pair_timings in timings.items()}


def measure_request_cost(link: TransferCost, requests: int = _REQUESTS, timeout_s: float = 300.0) -> RequestCost:
    """The runtime's own work per request (:class:`RequestCost`), measured through its driver and server.

    Two CPU ranks, set up as the runtime sets up its workers, serve a chain of two ``Linear(4, 4)`` (a few
    microseconds of compute) split across them both ways: the first layer on rank 0 and the second on rank 1,
    then the reverse. For each way, each rank's process CPU time per pipelined request (every thread), less its
    layer's eager time and the send or receive time ``link`` gives the activation between the parts, is the
    runtime's own, less also the output's message to the driver where rank 1 makes it; the two ways are averaged
    (one has the driver send a header, the other a header and the input).
    """
    with tempfile.TemporaryDirectory(prefix="moirai-calibrate-") as results_dir:
        settings = [["cpu", "cpu"], _free_port(), requests, timeout_s, results_dir]
        _run_ranks(settings, 2, timeout_s, entry="_request_rank_main")
        report = json.loads(Path(results_dir, "requests.json").read_text())
    layer_s = report["eager_s"] / 2
    own = []
    for way in report["ways"]:
        first, second = way["first"], 1 - way["first"]
        booked = [layer_s, layer_s]
        booked[first] += link.sender_cpu_time_s(report["activation_bytes"])
        booked[second] += link.receiver_cpu_time_s(report["activation_bytes"])
        # The second layer makes the output: off rank 0, a message to the driver, charged as the model charges it.
        send, receive = link.sender_cpu_time_s(report["output_bytes"]), link.receiver_cpu_time_s(report["output_bytes"])
        output = RequestCosts.build(
            2, 2, output_send_cpu_s=[[0, 0], [0, send]], output_recv_cpu_s=[[0, 0], [0, receive]]
        )
        booked = (np.array(booked) + output.charges.device_s(np.array([first, second]))).tolist()
        own.append([max(cpu - b, 0.0) for cpu, b in zip(way["cpu_s"], booked, strict=True)])
    driver, worker = np.mean(own, axis=0).tolist()
    return RequestCost(driver, worker)


def calibrate(
    world_size: int = 2,
    backend: str = "gloo",
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 15,
    base: Cluster | None = None,
    output: str | Path | None = None,
) -> Cluster:
    """A cluster whose links are measured between ``world_size`` local ranks (rank r = device r).

    ``base`` supplies the devices (one per rank, in rank order); by default they are detected
    (``cpu`` for gloo, ``cuda:r`` for nccl). ``output`` writes the result as a cluster file.
    """
    devices = _rank_devices(world_size, backend, base)
    costs = measure_transfer_costs([d.torch_device for d in devices], sizes_bytes, repeats)
    return _measured_cluster(devices, costs, base.name if base is not None else f"calibrated-{backend}", output)


def _rank_devices(world_size: int, backend: str, base: Cluster | None) -> tuple[Device, ...]:
    if world_size < 2:
        raise ClusterError("calibration needs at least two ranks (world_size >= 2)")
    if base is not None:
        if len(base) != world_size:
            raise ClusterError(f"base cluster has {len(base)} devices, calibration runs {world_size} ranks")
        return base.devices
    kind = kind_for_backend(backend)
    local = [f"{kind.name}:{r}" if kind.accelerator else kind.name for r in range(world_size)]
    host = socket.gethostname()
    return tuple(
        dataclasses.replace(d, name=f"rank{r}", host=host, rank=r)
        for r, d in enumerate(Cluster.from_devices(local).devices)
    )


def _measured_cluster(
    devices: Sequence[Device], costs: Mapping[tuple[int, int], TransferCost], name: str, output: str | Path | None
) -> Cluster:
    links = [
        Link(devices[src].name, devices[dst].name, cost.bandwidth_bytes_per_s, cost.latency_s)
        for (src, dst), cost in costs.items()
    ]
    cluster = Cluster.from_links(devices, links, name=name)
    if output is not None:
        cluster.to_file(output)
    return cluster


# --- the cached calibration of this machine ---------------------------------------------------


def link_kind(src_torch_device: str, dst_torch_device: str) -> str:
    """The kind of a local link, e.g. ``"cpu->cuda"``: links of one kind cost the same on one host."""
    return f"{torch.device(src_torch_device).type}->{torch.device(dst_torch_device).type}"


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
    if calibration not in ("auto", "remeasure"):
        if not Path(calibration).is_file():
            raise ClusterError(
                f"calibration={str(calibration)!r} is neither 'auto', 'remeasure' nor an existing calibration file "
                "(write one with moirai calibrate --save PATH)"
            )
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
        cached = _read_cached(path) if calibration == "auto" else {}
        missing = {kind: pair for kind, pair in needed.items() if kind not in cached}
        for kind, pair in missing.items():
            if kind not in cached:  # measuring a -> b measures b -> a too
                cached.update(measure_link_kinds(pair))
        if missing:
            write_calibration(path, {**_read_cached(path), **cached}, _read_cached_requests(path))
    return {kind: cached[kind] for kind in needed}


def local_request_cost(calibration: str | Path = "auto", cache_dir: str | Path | None = None) -> RequestCost:
    """The runtime's own work per request on this machine (:class:`RequestCost`), read and measured as
    :func:`local_calibration` reads and measures links (measured once, a few seconds, then cached beside them)."""
    if calibration not in ("auto", "remeasure"):
        stored = read_request_cost(calibration)
        if stored is None:
            raise ClusterError(
                f"calibration file {str(calibration)!r} has no request costs; measure them with moirai calibrate "
                "--save PATH on this machine, or pass calibration='auto'"
            )
        return stored
    link = local_calibration(["cpu", "cpu"], "auto", cache_dir)["cpu->cpu"]
    path = calibration_cache_path(cache_dir)
    with _exclusive(path.with_suffix(".lock")):
        requests = _read_cached_requests(path) if calibration == "auto" else None
        if requests is None:
            requests = measure_request_cost(link)
            write_calibration(path, _read_cached(path), requests)
    return requests


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (POSIX; elsewhere nothing is locked)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _transport(backend: str) -> str:
    from moirai.runtime import shm

    return shm.host_transport() if backend == "gloo" else backend


def _read_cached(path: Path) -> dict[str, TransferCost]:
    """The cached calibration, or nothing when there is none or it was measured by an older moirai."""
    if not path.exists():
        return {}
    try:
        return read_calibration(path)
    except ClusterError:
        return {}


def _read_cached_requests(path: Path) -> RequestCost | None:
    """The cached request cost, or None when there is none or it was measured by an older moirai."""
    if not path.exists():
        return None
    try:
        return read_request_cost(path)
    except ClusterError:
        return None


def measure_link_kinds(
    pair: tuple[str, str], sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES
) -> dict[str, TransferCost]:
    """Both directions of the link between two local devices, by link kind (the runtime's pair of devices)."""
    a, b = pair
    if a == b and kind_of(a).accelerator:
        raise ClusterError(f"two ranks on {a} would share one device; calibrate {a}<->{a} links between two of them")
    return costs_by_kind([a, b], measure_transfer_costs([a, b], sizes_bytes))


def costs_by_kind(
    torch_devices: Sequence[str], costs: Mapping[tuple[int, int], TransferCost]
) -> dict[str, TransferCost]:
    """The costs of the measured pairs of ranks per link kind; pairs of one kind (both directions of
    ``cpu->cpu``) are averaged field by field."""
    pairs_of_kind: dict[str, list[TransferCost]] = {}
    for (a, b), cost in costs.items():
        pairs_of_kind.setdefault(link_kind(torch_devices[a], torch_devices[b]), []).append(cost)
    return {
        kind: TransferCost(*np.mean([dataclasses.astuple(c) for c in same], axis=0).tolist())
        for kind, same in pairs_of_kind.items()
    }


def calibration_cache_path(cache_dir: str | Path | None = None) -> Path:
    """Where this machine's calibration lives: one file per host, CPU, core count and torch version."""
    from moirai.cluster.cost import _cpu_model, default_cache_dir

    machine = f"{socket.gethostname()}|{_cpu_model()}|cores={os.cpu_count()}|torch {torch.__version__}"
    digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / "calibration" / f"{digest}.json"


def read_calibration(path: str | Path) -> dict[str, TransferCost]:
    """The transfer costs stored in a calibration file, by link kind."""
    return {kind: TransferCost(**fields) for kind, fields in _calibration_record(path)["links"].items()}


def read_request_cost(path: str | Path) -> RequestCost | None:
    """The runtime's work per request stored in a calibration file (None when it holds links only)."""
    fields = _calibration_record(path).get("requests")
    return None if fields is None else RequestCost(**fields)


def _calibration_record(path: str | Path) -> dict[str, Any]:
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ClusterError(f"calibration file {str(path)!r} does not exist; run moirai calibrate --save") from None
    except json.JSONDecodeError as error:
        raise ClusterError(f"calibration file {str(path)!r} is not JSON ({error}); measure again") from None
    if record.get("format") != CALIBRATION_FORMAT_VERSION:
        raise ClusterError(f"{path} is not a moirai calibration of format {CALIBRATION_FORMAT_VERSION}; measure again")
    return record


def write_calibration(path: str | Path, costs: Mapping[str, TransferCost], requests: RequestCost | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "format": CALIBRATION_FORMAT_VERSION,
        "links": {k: dataclasses.asdict(c) for k, c in costs.items()},
    }
    if requests is not None:
        record["requests"] = dataclasses.asdict(requests)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)  # atomic: a concurrent reader never sees half a file


def calibrated_cluster(
    cluster: Cluster, costs: Mapping[str, TransferCost], requests: RequestCost | None = None
) -> Cluster:
    """``cluster`` with every link's latency, bandwidth and its ends' CPU times those of its kind in ``costs``,
    and, with ``requests``, the runtime's work per request on each device (the driver's on device 0).

    The measured delay already holds the receiver's CPU time of a receiver blocked in its wait; a schedule
    also books that time on the receiving device, where a receiver busy with other work loses it.
    """
    k = len(cluster)
    bandwidth, latency = cluster.bandwidth_bytes_per_s.copy(), cluster.latency_s.copy()
    cpu = {label: getattr(cluster, label).copy() for label in _CPU_FIELDS}
    for a in range(k):
        for b in range(k):
            kind = link_kind(cluster.devices[a].torch_device, cluster.devices[b].torch_device)
            if a != b and kind in costs:
                cost = costs[kind]
                bandwidth[a, b], latency[a, b] = cost.bandwidth_bytes_per_s, cost.latency_s
                for label, field_name in _CPU_FIELDS.items():
                    cpu[label][a, b] = getattr(cost, field_name)
    request_cpu = cluster.request_cpu_s
    if requests is not None:
        request_cpu = np.r_[requests.driver_cpu_s, np.full(k - 1, requests.worker_cpu_s)]
    return Cluster(cluster.devices, bandwidth, latency, name=cluster.name, **cpu, request_cpu_s=request_cpu)


# Cluster matrix -> TransferCost field.
_CPU_FIELDS = {
    "send_cpu_s": "sender_cpu_s",
    "send_cpu_s_per_byte": "sender_cpu_s_per_byte",
    "recv_cpu_s": "receiver_cpu_s",
    "recv_cpu_s_per_byte": "receiver_cpu_s_per_byte",
}


# --- the rank processes ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(settings: list, world_size: int, timeout_s: float, entry: str = "_rank_main") -> None:
    """Start the ranks as fresh interpreters that import only moirai (a spawned process would re-import the
    caller's ``__main__``, and a script that compiles at top level would compile again in every rank); each
    calls ``entry(rank, *settings)`` of this module."""
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from moirai.cluster.calibrate import {entry}; {entry}({rank}, *{json.dumps(settings)})",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    failures = []
    for rank, process in enumerate(ranks):
        try:
            _, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            raise DistributedError(f"calibration rank {rank} did not finish within {timeout_s:g} s") from None
        if process.returncode != 0:
            last_line = (stderr.strip().splitlines() or [f"exit code {process.returncode}"])[-1]
            failures.append(f"rank {rank}: {last_line}")
    if failures:
        raise DistributedError(f"a calibration rank failed: {'; '.join(failures)}")


def _rank_main(
    rank: int,
    torch_devices: list[str],
    port: int,
    sizes: tuple[int, ...],
    repeats: int,
    warmup: int,
    timeout_s: float,
    results_dir: str,
) -> None:
    """One rank, set up as a runtime worker: its share of the cores, the runtime's process groups and messages.

    Every rank takes part in every pair in the same order; the sender of a pair records the medians.
    """
    import datetime

    from moirai.runtime.protocol import Messages

    timeout = datetime.timedelta(seconds=timeout_s)
    group, store, _ = _join_as_runtime_rank(rank, torch_devices, port, timeout_s)
    device = torch.device(torch_devices[rank])
    kind = kind_of(device)

    def synchronize() -> None:
        kind.synchronize(device)

    block = torch.ones(64, 64)

    def compute_for(seconds: float) -> None:
        """Keep this rank's core busy, as a part computing around its sends keeps it."""
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            block @ block

    results = []
    exchange = 0  # one request of the runtime per message and its reply, so every tag is fresh
    for src in range(group.world_size):
        for dst in range(group.world_size):
            if src == dst or rank not in (src, dst):
                continue
            medians: dict[str, list[float]] = {"delay_s": [], "sender_cpu_s": [], "receiver_cpu_s": []}
            for size in sizes:
                shape = (max(1, size // 4),)
                message = torch.ones(shape, device=device)
                delays, sender_cpu, receiver_cpu = [], [], []
                for run in range(warmup + repeats):
                    messages = Messages(group, exchange, timeout)
                    exchange += 1
                    if rank == dst:
                        cpu_before = time.process_time()
                        pending = messages.post_recv(shape, torch.float32, src, 0, "calibration message")
                        messages.wait_recv(pending)
                        synchronize()
                        held_at = time.perf_counter()
                        # The reply: when this rank held the message, and the CPU time its wait took.
                        reply = torch.tensor([held_at, time.process_time() - cpu_before], dtype=torch.float64)
                        messages.send(reply, src, 1, "calibration reply")
                        messages.wait_sends()
                        continue
                    pending_reply = messages.post_recv((2,), torch.float64, dst, 1, "calibration reply")
                    compute_for(_SENDER_PAUSE_S)
                    synchronize()
                    cpu_before, sent_at = time.process_time(), time.perf_counter()
                    messages.send(message, dst, 0, "calibration message")
                    cpu_spent = time.process_time() - cpu_before
                    compute_for(_SENDER_COMPUTES_ON_S)
                    cpu_before = time.process_time()
                    messages.wait_sends()
                    synchronize()
                    cpu_spent += time.process_time() - cpu_before
                    held_at, waited_cpu = messages.wait_recv(pending_reply).tolist()
                    if run >= warmup:
                        delays.append(held_at - sent_at)
                        sender_cpu.append(cpu_spent)
                        receiver_cpu.append(waited_cpu)
                if rank == src:
                    for key, values in zip(medians, (delays, sender_cpu, receiver_cpu), strict=True):
                        medians[key].append(statistics.median(values))
            if rank == src:
                results.append({"src": src, "dst": dst, **medians})
    Path(results_dir, f"rank{rank}.json").write_text(json.dumps(results))
    _leave_together(store, rank, group.world_size)


def _request_rank_main(
    rank: int, torch_devices: list[str], port: int, requests: int, timeout_s: float, results_dir: str
) -> None:
    """One rank of :func:`measure_request_cost`: rank 0 drives and times the requests, the others serve them."""
    from moirai.runtime.protocol import serve

    group, store, resources = _join_as_runtime_rank(rank, torch_devices, port, timeout_s)
    if rank == 0:
        report = _time_requests(group, store, resources.helper_cores, requests, timeout_s)
        Path(results_dir, "requests.json").write_text(json.dumps(report))
    else:
        store.set(f"moirai/pid/{rank}", str(os.getpid()))
        serve(group, {}, timeout_s)
    _leave_together(store, rank, group.world_size)


def _time_requests(group: Any, store: Any, helper_cores: Sequence[int] | None, requests: int, timeout_s: float) -> dict:
    """Rank 0 of :func:`measure_request_cost`: the two ways of the two-layer chain, each rank's CPU per request."""
    import psutil

    from moirai.compile import compile as compile_model
    from moirai.planning.problem import Plan
    from moirai.runtime.driver import Driver
    from moirai.runtime.server import Server

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).eval()
    x = torch.randn(1, 4)
    compiled = compile_model(
        model, ["cpu", "cpu"], (x,), cost="analytic", placer="single", calibration="none", progress=False
    )
    problem = compiled.problem
    first = problem.topological_order[0]
    with torch.no_grad():
        for _ in range(requests):
            model(x)
        cpu_before = time.process_time()
        for _ in range(requests):
            model(x)
        eager_s = (time.process_time() - cpu_before) / requests
    worker = psutil.Process(int(store.get("moirai/pid/1")))
    driver = Driver(group, timeout_s, max_in_flight=8, helper_cores=helper_cores)
    ways = []
    for first_rank in (0, 1):
        placement = np.full(problem.num_tasks, 1 - first_rank)
        placement[first] = first_rank
        way = compiled.with_plan(Plan(placement, problem.device_names))
        # The path a user's request takes through compiled.server(): inputs checked and flattened, outputs rebuilt.
        server = Server(
            lambda flat, finish, program=way.program: driver.submit(program, flat, finish, timeout_s),
            way._checked_flat_inputs,
            way.traced.unflatten_outputs,
            lambda: None,
            max_in_flight=8,
        )
        for _ in server.map([x] * requests):  # warm-up
            pass
        cpu_before = [time.process_time(), sum(worker.cpu_times()[:2])]
        for _ in server.map([x] * requests):
            pass
        cpu_after = [time.process_time(), sum(worker.cpu_times()[:2])]
        cpu_s = [(after - before) / requests for before, after in zip(cpu_before, cpu_after, strict=True)]
        ways.append({"first": first_rank, "cpu_s": cpu_s})
    driver.close()
    with torch.no_grad():
        output_bytes = float(model(x).numel() * x.element_size())
    return {
        "eager_s": eager_s,
        "activation_bytes": float(problem.tensor_bytes.sum()),
        "output_bytes": output_bytes,
        "ways": ways,
    }


def _join_as_runtime_rank(rank: int, torch_devices: list[str], port: int, timeout_s: float) -> tuple[Any, Any, Any]:
    """This process as rank ``rank``, set up as the runtime sets up a worker: its share of the cores, the store
    (rank 0 hosts it), the runtime's links: ``(group, store, resources)``."""
    import datetime

    import torch.distributed as dist

    from moirai.runtime.groups import local_group
    from moirai.runtime.resources import apply_resources, pin_io_threads, rank_resources

    resources = rank_resources(torch_devices)[rank]
    apply_resources(resources, torch_devices[rank])
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, len(torch_devices), is_master=rank == 0, timeout=timeout)
    group = local_group(rank, torch_devices, store, timeout_s)
    pin_io_threads(resources)
    return group, store, resources


def _leave_together(store: Any, rank: int, world_size: int) -> None:
    """Nobody leaves before the last message is through: a rank that exits closes its connections."""
    store.set(f"moirai/calibrated/{rank}", "1")
    store.wait([f"moirai/calibrated/{r}" for r in range(world_size)])


# --- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``moirai calibrate``."""
    parser.add_argument("--world-size", type=int, default=2, help="number of local ranks (one device each)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--max-size-mb", type=float, default=16.0, help="largest message of the sweep (MiB)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--base", help="cluster file whose devices (one per rank, in rank order) to keep")
    parser.add_argument("--output", default="cluster.toml", help="cluster file to write")
    parser.add_argument(
        "--save",
        default=None,
        help="calibration file to write the transfer costs to (default: this machine's cached calibration, "
        "which compile(..., cost='measured') reads)",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """``moirai calibrate``: measure what transfers cost between local ranks; write a cluster file and the
    calibration compile reads."""
    sizes = tuple(s for s in (1024 * 4**k for k in range(16)) if s <= args.max_size_mb * 2**20)
    base = Cluster.from_file(args.base) if args.base else None
    devices = _rank_devices(args.world_size, args.backend, base)
    costs = measure_transfer_costs([d.torch_device for d in devices], sizes, args.repeats)
    cluster = _measured_cluster(
        devices, costs, base.name if base is not None else f"calibrated-{args.backend}", args.output
    )
    by_kind = costs_by_kind([d.torch_device for d in devices], costs)
    saved = Path(args.save) if args.save else calibration_cache_path()
    previous = _read_cached(saved)  # kinds measured before and not now, unless an older moirai measured them
    links = {**previous, **by_kind}
    if "cpu->cpu" not in links:  # the request cost's program runs on two CPU ranks
        links.update(measure_link_kinds(("cpu", "cpu")))
    requests = measure_request_cost(links["cpu->cpu"])
    write_calibration(saved, links, requests)
    table = Table(
        title=(
            f"transfers measured in the runtime ({_transport(args.backend)}, ranks pinned to their share of the cores)"
        ),
        caption=f"cluster file: {args.output}; calibration: {saved}",
    )
    for column in ("link", "latency us", "bandwidth GB/s", "sender CPU us + ns/KiB", "receiver CPU us + ns/KiB"):
        table.add_column(column, justify="right")
    for (a, b), cost in costs.items():
        table.add_row(
            f"{cluster.names[a]} -> {cluster.names[b]}",
            f"{cost.latency_s * 1e6:.1f}",
            f"{cost.bandwidth_bytes_per_s / 1e9:.2f}",
            f"{cost.sender_cpu_s * 1e6:.1f} + {cost.sender_cpu_s_per_byte * 1024e9:.0f}",
            f"{cost.receiver_cpu_s * 1e6:.1f} + {cost.receiver_cpu_s_per_byte * 1024e9:.0f}",
        )
    console.print(table)
    console.print(
        f"the runtime's own work per request (through its server): driver (rank 0) "
        f"{requests.driver_cpu_s * 1e6:.0f} us, another rank {requests.worker_cpu_s * 1e6:.0f} us"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moirai.cluster.calibrate", description=run.__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
