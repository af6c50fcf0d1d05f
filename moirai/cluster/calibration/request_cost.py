"""The runtime's own work per request (:class:`RequestCost`), measured through its driver and public server API.

The program it serves is built through the layers below :mod:`moirai.compile` (trace, coarsen, cost, split):
calibration runs while a model compiles, so it cannot import the compiler.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from moirai.cluster.calibration.fit import TransferCost
from moirai.cluster.calibration.measure import (
    join_as_runtime_rank,
    leave_together,
    run_ranks,
    transport_environment,
)
from moirai.cluster.cost import build_problem
from moirai.cluster.devices import Cluster
from moirai.cluster.kinds import CPU
from moirai.frontend.coarsen import coarsen
from moirai.frontend.graph import build_op_graph
from moirai.frontend.trace import TracedModel, trace
from moirai.planning.costs import RequestCosts
from moirai.runtime.local import check_inputs
from moirai.runtime.server import Server
from moirai.runtime.split import SplitProgram, split_module
from moirai.runtime.store import get_json, loopback_listener

# Requests of each timed round of each way; rounds, after one that warms up (their median resists a round that
# other processes slowed); calls of a half timed alone.
_REQUESTS = 100
_ROUNDS = 7
_PART_CALLS = 50
# One request per rank in flight, each submitted when one before it is done: a generation server's decode steps.
_IN_FLIGHT = 2
# Each half: two Linear(2048, 2048) on one row, 32 MB of weights streamed per request (milliseconds of one core),
# so the runtime's code runs between parts with its caches cold, as between the stages of a real model.
_WIDTH = 2048
_LAYERS_PER_PART = 2


@dataclasses.dataclass(frozen=True)
class RequestCost:
    """The runtime's own CPU time per request on a rank, beyond its ops and the messages the model books.

    ``driver_cpu_s`` on rank 0 while another rank works on each request: the caller's submit and wait, the
    driver's threads, the header it sends and the status it takes back; ``driver_alone_cpu_s`` on rank 0 when it
    does all the work itself (no header, no status; default: ``driver_cpu_s``); ``worker_cpu_s`` on any other rank:
    its header, setting up its part. The model's inputs' and outputs' messages are booked on their own
    (:attr:`moirai.planning.costs.RequestCosts.input_send_cpu_s`, ``output_send_cpu_s``...). Measured with the
    runtime's own server on two CPU ranks between parts that compute as a model's do (:func:`measure_request_cost`):
    host work, which the model charges to every device taking part in a request
    (:attr:`RequestCosts.request_cpu_s`: the driver's alone on device 0) and to the driver for every other device
    that takes part (:attr:`RequestCosts.driver_part_cpu_s`: ``driver_cpu_s - driver_alone_cpu_s``).
    """

    driver_cpu_s: float
    worker_cpu_s: float
    driver_alone_cpu_s: float = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.driver_alone_cpu_s is None:
            object.__setattr__(self, "driver_alone_cpu_s", self.driver_cpu_s)

    @property
    def driver_part_cpu_s(self) -> float:
        """The driver's work per request for another rank taking part: its header and status, their hand-offs."""
        return max(self.driver_cpu_s - self.driver_alone_cpu_s, 0.0)


@dataclasses.dataclass(frozen=True)
class MeasuredRequestCost:
    """:class:`RequestCost` (the median over the timed rounds) and its ``spread``: per rank, the range of the
    rounds' values (max - min), averaged over the two ways: how far the noise of one round moved it."""

    cost: RequestCost
    spread: RequestCost


def measure_request_cost(link: TransferCost, requests: int = _REQUESTS, timeout_s: float = 300.0) -> RequestCost:
    """The runtime's own work per request (:class:`RequestCost`): :func:`measure_request_cost_spread`'s cost."""
    return measure_request_cost_spread(link, requests, timeout_s).cost


def measure_request_cost_spread(
    link: TransferCost, requests: int = _REQUESTS, timeout_s: float = 300.0
) -> MeasuredRequestCost:
    """The runtime's own work per request, measured through its driver and server, and its spread.

    Two CPU ranks, set up as the runtime sets up its workers, serve a chain of four ``Linear(2048, 2048)`` on one
    row split in halves both ways: the first half on rank 0 and the second on rank 1, then the reverse; closed
    loop, a request per rank in flight, the ways alternating round by round ([Note: the driver's work per step]),
    and the whole chain on rank 0 alone (rank 1 idle), for the driver's work without another rank.
    Each round, each rank's process CPU time per request (every thread), less its half's CPU time computed alone
    in the same process on the same core and thread count (rank 0: just before the round; rank 1, which cannot
    compute alone while it serves: the median of rounds before and after serving) and the send or receive time
    ``link`` gives the activation between the halves, is the runtime's own, less also the output's message to
    the driver where rank 1 makes it. The rounds' median is taken and the two ways are averaged (one has the
    driver send a header, the other a header and the input).
    """
    with tempfile.TemporaryDirectory(prefix="moirai-calibrate-") as results_dir, loopback_listener() as listener:
        settings = [[CPU.name, CPU.name], listener.getsockname()[1], requests, timeout_s, results_dir]
        transport = transport_environment(2, [])
        run_ranks(settings, 2, timeout_s, entry=_request_rank_main, store_listener=listener, environment=transport)
        report = json.loads(Path(results_dir, "requests.json").read_text())
    return request_cost_of(report, link)


def request_cost_of(report: dict[str, Any], link: TransferCost) -> MeasuredRequestCost:
    """The cost and spread of a report of :func:`_time_requests`: per way and round, each rank's CPU per request
    and its half's alone (``rounds``: ``[cpu_s, half_s]`` pairs of per-rank lists), less what the model books."""
    medians, spreads = [], []
    for way in report["ways"]:
        own = np.array([_runtime_own_cpu_s(report, way, cpu_s, part_s, link) for cpu_s, part_s in way["rounds"]])
        medians.append(np.median(own, axis=0))
        spreads.append(own.max(axis=0) - own.min(axis=0))
    cost, spread = np.mean(medians, axis=0).tolist(), np.mean(spreads, axis=0).tolist()
    # Alone: rank 0 computes both halves and sends nothing; what is left of its CPU is the driver's own.
    alone = np.array([max(cpu_s[0] - part_s[0], 0.0) for cpu_s, part_s in report["alone"]["rounds"]])
    return MeasuredRequestCost(
        RequestCost(*cost, float(np.median(alone))), RequestCost(*spread, float(alone.max() - alone.min()))
    )


def _runtime_own_cpu_s(
    report: dict[str, Any], way: dict[str, Any], cpu_s: Sequence[float], part_s: Sequence[float], link: TransferCost
) -> list[float]:
    """Each rank's CPU per request in one round of a way (``cpu_s``), less what the model books for it elsewhere:
    its part's time computed alone (``part_s``) and the messages the model charges (the charge terms of
    :class:`moirai.planning.costs.RequestCosts`)."""
    first, second = way["first"], 1 - way["first"]
    booked = list(part_s)
    booked[first] += link.sender_cpu_time_s(report["activation_bytes"])
    booked[second] += link.receiver_cpu_time_s(report["activation_bytes"])
    # Off rank 0, the first half reads the model's input, a message from the driver, and the second makes the
    # output, a message to the driver: charged as the model charges them.
    send, receive = link.sender_cpu_time_s(report["output_bytes"]), link.receiver_cpu_time_s(report["output_bytes"])
    send_in, receive_in = link.sender_cpu_time_s(report["input_bytes"]), link.receiver_cpu_time_s(report["input_bytes"])
    messages = RequestCosts.build(
        2,
        2,
        [[0]],
        output_send_cpu_s=[[0, 0], [0, send]],
        output_recv_cpu_s=[[0, 0], [0, receive]],
        input_send_cpu_s=[[0, send_in]],
        input_recv_cpu_s=[[0, receive_in]],
    )
    booked = (np.array(booked) + messages.charges.device_s(np.array([first, second]))).tolist()
    return [max(cpu - b, 0.0) for cpu, b in zip(cpu_s, booked, strict=True)]


def _request_rank_main(
    rank: int, torch_devices: list[str], port: int, requests: int, timeout_s: float, results_dir: str
) -> None:
    """One rank of :func:`measure_request_cost`: rank 0 drives and times the requests, the others serve them and
    time their halves alone before and after."""
    from moirai.runtime.protocol import serve

    group, store, resources = join_as_runtime_rank(rank, torch_devices, port, timeout_s)
    model = _chain()
    halves = _halves(model)
    if rank == 0:
        report = _time_requests(group, store, model, resources.helper_cores, requests, timeout_s)
        Path(results_dir, "requests.json").write_text(json.dumps(report))
    else:
        before = [[_half_alone_s(half) for half in halves] for _ in range(_ROUNDS // 2 + 1)]
        store.set(f"moirai/pid/{rank}", str(os.getpid()))
        serve(group, {}, timeout_s)
        after = [[_half_alone_s(half) for half in halves] for _ in range(_ROUNDS // 2 + 1)]
        store.set(f"moirai/halves_s/{rank}", json.dumps(np.median(before + after, axis=0).tolist()))
    leave_together(store, rank, group.world_size)


def _chain() -> torch.nn.Sequential:
    """The chain both ranks build alike (the same seed), rank 0 to serve it and each rank to time its halves."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(2 * _LAYERS_PER_PART)]
    return torch.nn.Sequential(*layers).eval()


def _halves(model: torch.nn.Sequential) -> tuple[torch.nn.Module, torch.nn.Module]:
    return model[:_LAYERS_PER_PART], model[_LAYERS_PER_PART:]


def _half_alone_s(half: torch.nn.Module) -> float:
    """A half's CPU time per call, called back to back in this thread (its weights, more than one core's cache
    holds, stream in as they do served; what the other rank streaming at once slows is counted as the runtime's)."""
    x = torch.randn(1, _WIDTH)
    with torch.no_grad():
        half(x)
        cpu_before = time.process_time()
        for _ in range(_PART_CALLS):
            half(x)
        return (time.process_time() - cpu_before) / _PART_CALLS


def _worker_pid(store: Any) -> int:
    """Rank 1's process id, as it set it (``_request_rank_main``), checked."""
    return get_json(store, "moirai/pid/1", "process id", lambda pid: type(pid) is int and pid > 0)


def _worker_halves_s(store: Any) -> list[float]:
    """Rank 1's time of each half of the chain alone, as it set them (``_request_rank_main``), checked."""

    def valid(times: Any) -> bool:
        return (
            isinstance(times, list)
            and len(times) == 2
            and all(type(t) in (int, float) and 0 <= t < float("inf") for t in times)
        )

    return get_json(store, "moirai/halves_s/1", "time of each half", valid, "[seconds, seconds]")


def _process_cpu_s(process: Any) -> float:
    """Another process's CPU time, every thread: to the nanosecond from Linux's schedstat (psutil's counts clock
    ticks of 10 ms, a tenth of a millisecond per request of a round), else psutil's."""
    tasks = Path(f"/proc/{process.pid}/task")
    if not tasks.is_dir():
        return sum(process.cpu_times()[:2])
    ns = 0
    for stat in tasks.glob("*/schedstat"):
        with contextlib.suppress(OSError):  # a thread that has just ended
            ns += int(stat.read_text().split()[0])
    return ns / 1e9


def _time_requests(
    group: Any,
    store: Any,
    model: torch.nn.Sequential,
    helper_cores: Sequence[int] | None,
    requests: int,
    timeout_s: float,
) -> dict:
    """Rank 0 of :func:`measure_request_cost`: rounds of both ways of the chain, each rank's CPU per request, and
    rank 0's halves timed alone before each round."""
    import psutil

    from moirai.runtime.driver import Driver

    halves = _halves(model)
    x = torch.randn(1, _WIDTH)
    chain = _TwoWayChain.of(model, x)
    worker = psutil.Process(_worker_pid(store))
    driver = Driver(group, timeout_s, max_in_flight=_IN_FLIGHT, helper_cores=helper_cores)
    servers = [chain.server(program, driver, timeout_s) for program in chain.programs]
    # Per way (first part on rank 0, on rank 1, all on rank 0): each rank's CPU, rank 0's share computed alone.
    rounds: list[list[tuple[list[float], float]]] = [[], [], []]
    for round_index in range(_ROUNDS + 1):
        for way, server in enumerate(servers):
            # rank 0 computes the first half when it is first, the second when rank 1 is, the whole chain when
            # alone (timed whole: one half called back to back keeps more of its weights in the cache)
            half_s = _half_alone_s((halves[0], halves[1], model)[way])
            cpu_before = [time.process_time(), _process_cpu_s(worker)]
            _closed_loop(server, x, requests)
            cpu_after = [time.process_time(), _process_cpu_s(worker)]
            if round_index > 0:  # the first round warms up
                cpu_s = [(after - before) / requests for before, after in zip(cpu_before, cpu_after, strict=True)]
                rounds[way].append((cpu_s, half_s))
    driver.close()
    worker_halves_s = _worker_halves_s(store)
    with torch.no_grad():
        output_bytes = float(model(x).numel() * x.element_size())
    ways = []
    for first_rank in (0, 1):
        worker_half_s = worker_halves_s[1 - first_rank]  # rank 1 computes the second half when rank 0 is first
        ways.append(
            {
                "first": first_rank,
                "rounds": [(cpu_s, [half_s, worker_half_s]) for cpu_s, half_s in rounds[first_rank]],
            }
        )
    return {
        "activation_bytes": chain.activation_bytes,
        "input_bytes": float(x.numel() * x.element_size()),
        "output_bytes": output_bytes,
        "ways": ways,
        "alone": {"rounds": [(cpu_s, [half_s, 0.0]) for cpu_s, half_s in rounds[2]]},
    }


def _closed_loop(server: Server, x: torch.Tensor, requests: int) -> None:
    """``requests`` requests with ``_IN_FLIGHT`` in flight, each submitted once the oldest is done."""
    in_flight = collections.deque(server.submit(x) for _ in range(_IN_FLIGHT))
    for _ in range(requests - _IN_FLIGHT):
        in_flight.popleft().result()
        in_flight.append(server.submit(x))
    for future in in_flight:
        future.result()


class _TwoWayChain(NamedTuple):
    """A model split in halves both ways: the first half of its op groups on rank 0 and the rest on rank 1, then the
    reverse; and whole on rank 0."""

    traced: TracedModel
    programs: tuple[SplitProgram, SplitProgram, SplitProgram]
    activation_bytes: float  # what crosses between the parts

    @classmethod
    def of(cls, model: torch.nn.Module, x: torch.Tensor) -> _TwoWayChain:
        """Traced, coarsened and priced as compile does, split by hand (calibration cannot import compile)."""
        traced = trace(model, (x,))
        groups = coarsen(build_op_graph(traced)).graph
        problem = build_problem(groups, Cluster.from_devices([CPU.name, CPU.name]), "analytic", traced)
        first = [int(i) for i in problem.topological_order[: problem.num_tasks // 2]]
        programs = []
        for first_rank, second_rank in ((0, 1), (1, 0), (0, 0)):
            placement = np.full(problem.num_tasks, second_rank)
            placement[first] = first_rank
            node_device = {name: int(placement[i]) for i, node in enumerate(groups.nodes) for name in node.fx_names}
            programs.append(split_module(traced, node_device, 2))
        in_first = set(first)
        crossing = [
            t
            for t, producer in enumerate(problem.tensor_producer)
            if producer in in_first and not in_first.issuperset(problem.tensor_consumers[t])
        ]
        return cls(traced, (programs[0], programs[1], programs[2]), float(problem.tensor_bytes[crossing].sum()))

    def server(self, program: SplitProgram, driver: Any, timeout_s: float) -> Server:
        """``program`` served as a compiled model's server() serves: inputs checked and flattened, outputs
        rebuilt."""

        def checked_flat_inputs(args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
            flat_inputs = self.traced.flatten_inputs(args, kwargs)
            check_inputs(program, flat_inputs)
            return flat_inputs

        from moirai.runtime.driver import DEFAULT_MAX_IN_FLIGHT

        submit = lambda flat, finish: driver.submit(program, flat, finish, timeout_s)  # noqa: E731
        unflatten = self.traced.unflatten_outputs
        return Server(submit, checked_flat_inputs, unflatten, lambda: None, max_in_flight=DEFAULT_MAX_IN_FLIGHT)
