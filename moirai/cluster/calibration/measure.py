"""The rank measurement protocol: what a message costs between two ranks set up as the runtime sets them up.

Every directed pair of ranks is timed one at a time (:func:`measure_transfers`); the ranks are fresh
interpreters that import only moirai (:func:`run_ranks`), joined as the runtime joins its workers
(:func:`join_as_runtime_rank`). See :mod:`moirai.cluster.calibration` for what is measured and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moirai.cluster.calibration.fit import TransferCost, TransferTimings, costs_by_kind
from moirai.cluster.kinds import CPU, kind_of
from moirai.errors import ClusterError, DistributedError, MoiraiWarning, user_stacklevel
from moirai.safe_path import python_command

if TYPE_CHECKING:
    from moirai.runtime.resources import RankResources

# The sweep, repeats and warm-up every calibration takes unless told otherwise: a local one, `moirai calibrate`'s
# options' defaults and compile's measurement between torchrun's hosts.
DEFAULT_MAX_SIZE_BYTES = 16 * 2**20
DEFAULT_REPEATS = 15
DEFAULT_WARMUP = 3


def sizes_up_to(max_bytes: float) -> tuple[int, ...]:
    """The sweep's message sizes, 1 KiB times powers of 4, up to ``max_bytes`` (and at most 1 TiB): small sizes pin
    the latency, large ones the bandwidth."""
    return tuple(size for size in (1024 * 4**k for k in range(16)) if size <= max_bytes)


# 1 KiB .. 16 MiB.
DEFAULT_SIZES_BYTES = sizes_up_to(DEFAULT_MAX_SIZE_BYTES)
# Long enough for the receiver to be blocked in its wait before the message leaves; the sender computes
# meanwhile, and goes on computing after its send call, as a part does.
_SENDER_PAUSE_S = 2e-3
_SENDER_COMPUTES_ON_S = 2e-3
# Round trips that estimate the clock offset between two hosts (the shortest one counts).
_CLOCK_PINGS = 20
# Messages of the largest size sent back to back between two hosts: the rate a stream of them crosses at
# ([Note: a stream's bandwidth]).
STREAM_MESSAGES = 4


def measure_transfers(
    torch_devices: Sequence[str] = (CPU.name, CPU.name),
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
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
    from moirai.runtime.store import loopback_listener

    sizes = tuple(int(s) for s in sizes_bytes)
    transport = transport_environment(len(devices), sizes)
    with tempfile.TemporaryDirectory(prefix="moirai-calibrate-") as results_dir, loopback_listener() as listener:
        settings = [devices, listener.getsockname()[1], list(sizes), repeats, warmup, timeout_s, results_dir]
        run_ranks(settings, len(devices), timeout_s, entry=_rank_main, store_listener=listener, environment=transport)
        reports = [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("rank*.json"))]
    timings = {
        (pair["src"], pair["dst"]): TransferTimings(
            sizes,
            tuple(pair["delay_s"]),
            tuple(pair["sender_cpu_s"]),
            tuple(pair["receiver_cpu_s"]),
            core_share=pair.get("core_share"),
        )
        for report in reports
        for pair in report
    }
    warn_if_cores_were_busy(devices, timings)
    return timings


# Below this median share of its core, a sender computing between its messages shared the core with other
# processes: a message then waits for the receiver's turn on its core too, and delays grow by whole time slices.
BUSY_CORE_SHARE = 0.8


def warn_if_cores_were_busy(devices: Sequence[str], timings: dict[tuple[int, int], TransferTimings]) -> None:
    """Warn where the ranks of a calibration shared their cores with other processes (:data:`BUSY_CORE_SHARE`):
    what it measured is the links of a busy machine, and it is cached for this one."""
    shares = [t.core_share for t in timings.values() if t.core_share is not None]
    if not shares or min(shares) >= BUSY_CORE_SHARE:
        return
    warnings.warn(
        f"calibrating links between {', '.join(devices)}: its ranks ran {min(shares):.0%} of the time they computed "
        "(other processes took turns on their cores), so the link costs it measured are higher than this machine's "
        "when quiet, and plans made with them split less; measure again when the machine is quiet "
        "(calibration='remeasure', or moirai calibrate --update-cache)",
        MoiraiWarning,
        stacklevel=user_stacklevel(),
    )


def measure_transfer_costs(
    torch_devices: Sequence[str] = (CPU.name, CPU.name),
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
) -> dict[tuple[int, int], TransferCost]:
    """The fitted :class:`TransferCost` of every directed pair of ranks (rank r on ``torch_devices[r]``)."""
    timings = measure_transfers(torch_devices, sizes_bytes, repeats, warmup)
    return {pair: pair_timings.fit() for pair, pair_timings in timings.items()}


def measure_link_kinds(
    pair: tuple[str, str], sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES
) -> dict[str, TransferCost]:
    """Both directions of the link between two local devices, by link kind (the runtime's pair of devices)."""
    a, b = pair
    if a == b and kind_of(a).accelerator:
        raise ClusterError(f"two ranks on {a} would share one device; calibrate {a}<->{a} links between two of them")
    return costs_by_kind([a, b], measure_transfer_costs([a, b], sizes_bytes))


def transport_environment(world_size: int, message_bytes: Sequence[int]) -> dict[str, str]:
    """What the calibration ranks are told about shared memory: where the shared-memory directory cannot hold a
    world of ``world_size`` ranks' rings and the largest of ``message_bytes`` (one message is in flight at a time),
    the runtime would send through gloo (moirai/runtime/runner.py), so the calibration measures gloo too, with a
    warning, rather than have a rank die making its ring (docker's default 64 MB /dev/shm and four ranks)."""
    from moirai.errors import SharedMemoryWarning, user_stacklevel
    from moirai.runtime import shm

    if not shm.enabled():
        return {}
    shortfall = shm.room_shortfall([max(message_bytes, default=0)], world_size, "the calibration")
    if shortfall is None:
        return {}
    warnings.warn(
        f"{shortfall}: it measures gloo, which the runtime will send through too; enlarge it "
        f"(e.g. docker --shm-size) and calibrate again for shared memory's costs",
        SharedMemoryWarning,
        stacklevel=user_stacklevel(),
    )
    return {shm.ENV_SWITCH: "0"}


# Names the descriptor of the store's listening socket that rank 0 inherits from run_ranks.
_STORE_FD_ENV = "MOIRAI_CALIBRATION_STORE_FD"


def run_ranks(
    settings: list,
    world_size: int,
    timeout_s: float,
    entry: Callable[..., None],
    store_listener: socket.socket | None = None,
    environment: dict[str, str] | None = None,
) -> None:
    """Start the ranks as fresh interpreters that import only moirai (a spawned process would re-import the
    caller's ``__main__``, and a script that compiles at top level would compile again in every rank), in safe-path
    mode (:mod:`moirai.safe_path`); each calls ``entry(rank, *settings)``, a function of a moirai module.
    ``store_listener`` (the caller's, listening on the port the settings name) is handed to rank 0 for its store:
    the port is held from the moment it is chosen, so no other process can take it before rank 0 listens
    (:func:`join_as_runtime_rank`). ``environment``: variables set in every rank beyond this process's
    (:func:`transport_environment`)."""
    from moirai.runtime.distributed import RUN_SECRET_ENV
    from moirai.runtime.store import new_secret

    # The run's secret seals the store and authenticates rank 0's headers; the environment, not the command line
    # (which every local user can read), hands it over.
    environment = {**os.environ, **(environment or {}), RUN_SECRET_ENV: new_secret().hex()}
    with contextlib.ExitStack() as stack:
        # Files, not pipes: a rank whose stderr nobody reads while another is watched would block on a full pipe.
        stderrs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(world_size)]
        handed = {} if store_listener is None else {_STORE_FD_ENV: str(store_listener.fileno())}
        ranks = [
            subprocess.Popen(
                python_command(f"from {entry.__module__} import {entry.__name__}; {_call(entry, rank, settings)}"),
                stdout=subprocess.DEVNULL,
                stderr=stderrs[rank],
                text=True,
                env={**environment, **handed} if rank == 0 else environment,
                pass_fds=(store_listener.fileno(),) if rank == 0 and store_listener is not None else (),
            )
            for rank in range(world_size)
        ]
        try:
            failures = _wait_for_ranks(ranks, stderrs, timeout_s)
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    if failures:
        raise DistributedError(f"a calibration rank failed: {'; '.join(failures)}")


def _call(entry: Callable[..., None], rank: int, settings: list) -> str:
    return f"{entry.__name__}({rank}, *{json.dumps(settings)})"


def _wait_for_ranks(ranks: list[subprocess.Popen], stderrs: list[Any], timeout_s: float) -> list[str]:
    """Wait for every rank together: the first that fails ends the wait (its peers would otherwise wait for it until
    their own timeout, rank by rank); a rank still running after ``timeout_s`` is an error naming it. Returns what
    each failed rank said last."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [process.poll() for process in ranks]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return [f"rank {rank}: {_last_line(stderrs[rank], codes[rank])}" for rank in failed]
        if all(code == 0 for code in codes):
            return []
        if time.monotonic() > deadline:
            running = [rank for rank, code in enumerate(codes) if code is None]
            raise DistributedError(
                f"calibration rank{'s' * (len(running) > 1)} {', '.join(map(str, running))} did not finish "
                f"within {timeout_s:g} s"
            )
        time.sleep(0.05)


def _last_line(stderr: Any, returncode: int) -> str:
    stderr.seek(0)
    return (stderr.read().strip().splitlines() or [f"exit code {returncode}"])[-1]


def _rank_main(
    rank: int,
    torch_devices: list[str],
    port: int,
    sizes: tuple[int, ...],
    repeats: int,
    warmup: int,
    timeout_s: float,
    results_dir: str,
    hosts: list[str] | None = None,
) -> None:
    """One rank, set up as a runtime worker: its share of the cores, the runtime's process groups and messages.
    ``hosts``: the ranks' hosts as :func:`measure_pairs` takes them (None: one host; a test names two to time a
    pair of local ranks as one between hosts)."""
    group, store, _ = join_as_runtime_rank(rank, torch_devices, port, timeout_s)
    pairs = directed_pairs(group.world_size)
    results = [result for _, result in measure_pairs(group, pairs, sizes, repeats, warmup, timeout_s, hosts=hosts)]
    Path(results_dir, f"rank{rank}.json").write_text(json.dumps(results))
    leave_together(store, rank, group.world_size)


def measure_pairs(
    group: Any,
    pairs: Sequence[tuple[int, int]],
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    timeout_s: float,
    prefix: str = "moirai/calibration",
    hosts: Sequence[str] | None = None,
) -> list[tuple[int, dict[str, Any]]]:
    """Time ``pairs`` of ranks (``(src, dst)``) over the runtime's links of ``group`` (a collective: every rank calls
    it with the same pairs); the sender of each pair returns its place in ``pairs`` and its medians.

    Every rank takes the pairs it is part of in that order, a pair only once the one before it has finished; the
    sender of a pair records the medians. ``hosts`` (one per rank; None: one host) tells pairs on two hosts, whose
    clocks differ: their sender first estimates the receiver's clock offset (:func:`_clock_offset_s`).
    """
    from moirai.runtime.protocol import Messages

    rank, store = group.rank, group.store
    timeout = datetime.timedelta(seconds=timeout_s)
    device = group.devices[rank]
    kind = kind_of(device)

    def synchronize() -> None:
        kind.synchronize(device)

    block = torch.ones(64, 64)

    def compute_for(seconds: float) -> float:
        """Keep this rank's core busy, as a part computing around its sends keeps it; returns the share of those
        seconds this thread ran (below 1: other processes took turns on its core)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        deadline = started + seconds
        while time.perf_counter() < deadline:
            block @ block
        return (time.thread_time() - cpu_started) / max(time.perf_counter() - started, 1e-9)

    with _one_compute_thread():
        results = []
        runs_per_pair = _CLOCK_PINGS + len(sizes) * (warmup + repeats) + STREAM_MESSAGES + 1
        for index, (src, dst) in enumerate(pairs):
            if rank not in (src, dst):
                continue
            # One pair at a time: the pair before this one has finished (its sender says so), so no other pair's
            # messages share the cores or the links while this one is timed.
            if index > 0:
                store.wait([f"{prefix}/pair/{index - 1}"], timeout)
            # Every rank numbers exchanges alike, whichever pairs it takes part in, so both ends of a pair tag alike.
            exchange = index * runs_per_pair
            offset_s = 0.0
            across_hosts = hosts is not None and hosts[src] != hosts[dst]
            if across_hosts:
                offset_s = _clock_offset_s(group, src, dst, exchange, timeout)
            exchange += _CLOCK_PINGS
            medians: dict[str, list[float]] = {"delay_s": [], "sender_cpu_s": [], "receiver_cpu_s": []}
            core_shares: list[float] = []
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
                    share_before = compute_for(_SENDER_PAUSE_S)
                    synchronize()
                    cpu_before, sent_at = time.process_time(), time.perf_counter()
                    messages.send(message, dst, 0, "calibration message")
                    cpu_spent = time.process_time() - cpu_before
                    share_after = compute_for(_SENDER_COMPUTES_ON_S)
                    cpu_before = time.process_time()
                    messages.wait_sends()
                    synchronize()
                    cpu_spent += time.process_time() - cpu_before
                    held_at, waited_cpu = messages.wait_recv(pending_reply).tolist()
                    if run >= warmup:
                        delays.append(held_at - offset_s - sent_at)
                        sender_cpu.append(cpu_spent)
                        receiver_cpu.append(waited_cpu)
                        core_shares += [share_before, share_after]
                if rank == src:
                    for key, values in zip(medians, (delays, sender_cpu, receiver_cpu), strict=True):
                        medians[key].append(statistics.median(values))
            stream = None
            if across_hosts:
                stream = _stream_bytes_per_s(group, src, dst, exchange, max(sizes), timeout, synchronize)
            if rank == src:
                share = statistics.median(core_shares) if core_shares else None
                results.append(
                    (index, {"src": src, "dst": dst, **medians, "stream_bytes_per_s": stream, "core_share": share})
                )
                store.set(f"{prefix}/pair/{index}", "1")
        return results


def _clock_offset_s(group: Any, src: int, dst: int, first_exchange: int, timeout: datetime.timedelta) -> float:
    """On ``src``, how far ``dst``'s clock is ahead of its own (0 on ``dst``): of ``_CLOCK_PINGS`` round trips of a
    timestamp, the shortest, whose middle is when ``dst`` read its clock give or take half of it (NTP's estimate)."""
    from moirai.runtime.protocol import Messages

    samples = []
    for ping in range(_CLOCK_PINGS):
        messages = Messages(group, first_exchange + ping, timeout)
        if group.rank == dst:
            messages.wait_recv(messages.post_recv((1,), torch.float64, src, 0, "clock ping"))
            messages.send(torch.tensor([time.perf_counter()], dtype=torch.float64), src, 1, "clock reply")
            messages.wait_sends()
            continue
        pending = messages.post_recv((1,), torch.float64, dst, 1, "clock reply")
        sent_at = time.perf_counter()
        messages.send(torch.zeros(1, dtype=torch.float64), dst, 0, "clock ping")
        their_clock = messages.wait_recv(pending).item()
        back_at = time.perf_counter()
        messages.wait_sends()
        samples.append((back_at - sent_at, their_clock - (sent_at + back_at) / 2))
    return min(samples)[1] if samples else 0.0


def _stream_bytes_per_s(
    group: Any,
    src: int,
    dst: int,
    first_exchange: int,
    size: int,
    timeout: datetime.timedelta,
    synchronize: Callable[[], None],
) -> float | None:
    """On ``src``, the bytes per second that :data:`STREAM_MESSAGES` messages of ``size`` bytes sent back to back
    crossed to ``dst`` at, timed on ``dst`` from its first message's arrival to its last (None on ``dst``, or where
    they arrived too close together to time)."""
    from moirai.runtime.protocol import Messages

    shape, device = (max(1, size // 4),), group.devices[group.rank]
    stream = [Messages(group, first_exchange + m, timeout) for m in range(STREAM_MESSAGES)]
    answer = Messages(group, first_exchange + STREAM_MESSAGES, timeout)
    if group.rank == dst:
        pending = [messages.post_recv(shape, torch.float32, src, 0, "stream message") for messages in stream]
        arrived_s = []
        for messages, receive in zip(stream, pending, strict=True):
            messages.wait_recv(receive)
            synchronize()
            arrived_s.append(time.perf_counter())
        seconds = arrived_s[-1] - arrived_s[0]
        rate = (STREAM_MESSAGES - 1) * shape[0] * 4 / seconds if seconds > 0 else 0.0
        answer.send(torch.tensor([rate], dtype=torch.float64), src, 1, "stream rate")
        answer.wait_sends()
        return None
    reply = answer.post_recv((1,), torch.float64, dst, 1, "stream rate")
    message = torch.ones(shape, device=device)
    for messages in stream:
        messages.send(message, dst, 0, "stream message")
    for messages in stream:
        messages.wait_sends()
    rate = answer.wait_recv(reply).item()
    return rate if rate > 0 else None


@contextlib.contextmanager
def _one_compute_thread() -> Iterator[None]:
    """Torch computes on one thread meanwhile ([Note: a message's CPU on one thread]): the CPU time a message is
    charged is the whole process's, which would count a rank's other compute threads spinning after each parallel
    op or copy. A local calibration rank has one already (:func:`calibration_resources`); a rank under torchrun has
    its host's share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def directed_pairs(world_size: int) -> list[tuple[int, int]]:
    """Every directed pair of ranks ``(src, dst)``, in the order every rank measures them."""
    return [(src, dst) for src in range(world_size) for dst in range(world_size) if src != dst]


def calibration_resources(resources: RankResources) -> RankResources:
    """A calibration rank's resources: the runtime rank's cores, and one compute thread ([Note: a message's CPU on one
    thread]): what is timed is CPU time of the whole process, which counts a rank's other compute threads spinning
    after each parallel op or copy, time that keeps no device from its work."""
    return dataclasses.replace(resources, threads=1)


def join_as_runtime_rank(rank: int, torch_devices: list[str], port: int, timeout_s: float) -> tuple[Any, Any, Any]:
    """This process as rank ``rank``, set up as the runtime sets up a worker: its share of the cores (with one compute
    thread, :func:`calibration_resources`), the store (rank 0 hosts it), the runtime's links: ``(group, store,
    resources)``."""
    from moirai.runtime.distributed import torchrun_secret
    from moirai.runtime.groups import local_group
    from moirai.runtime.resources import apply_resources, pin_io_threads, rank_resources
    from moirai.runtime.store import join_store, start_store

    resources = calibration_resources(rank_resources(torch_devices)[rank])
    apply_resources(resources, torch_devices[rank])
    secret = torchrun_secret()  # run_ranks set it in every rank's environment
    if secret is None:
        raise DistributedError("a calibration rank was started without the run's secret (see run_ranks)")
    world_size = len(torch_devices)
    if rank == 0:
        inherited = os.environ.pop(_STORE_FD_ENV, None)  # run_ranks's listener, already on ``port``
        store = start_store(world_size, timeout_s, secret, port, None if inherited is None else int(inherited))
    else:
        store = join_store(port, world_size, secret, timeout_s)
    group = local_group(rank, torch_devices, store, timeout_s)
    pin_io_threads(resources)
    return group, store, resources


def leave_together(store: Any, rank: int, world_size: int, prefix: str = "moirai") -> None:
    """Nobody leaves before the last message is through: a rank that exits closes its connections (``prefix``: one
    per measurement in one store)."""
    store.set(f"{prefix}/calibrated/{rank}", "1")
    store.wait([f"{prefix}/calibrated/{r}" for r in range(world_size)])
