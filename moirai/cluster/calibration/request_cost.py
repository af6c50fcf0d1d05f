"""The runtime's own work per request (:class:`RequestCost`), measured through its driver and public server API.

The program it serves is built through the layers below :mod:`moirai.compile` (trace, coarsen, cost, split):
calibration runs while a model compiles, so it cannot import the compiler.
"""

from __future__ import annotations

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
from moirai.cluster.calibration.measure import free_port, join_as_runtime_rank, leave_together, run_ranks
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

# Requests of the two-rank program that measures RequestCost, after as many of warm-up.
_REQUESTS = 1000


@dataclasses.dataclass(frozen=True)
class RequestCost:
    """The runtime's own CPU time per request on a rank, beyond its ops and the messages the model books.

    ``driver_cpu_s`` on rank 0: the caller's submit and wait, the driver's threads, the headers it sends and
    the model's inputs; ``worker_cpu_s`` on any other rank: its header, setting up its part (the model outputs'
    messages are booked on their own, :attr:`moirai.planning.costs.RequestCosts.output_send_cpu_s`).
    Measured with the runtime's own server on two CPU ranks (:func:`measure_request_cost`): host work, which
    the model charges to every device taking part in a request (:attr:`RequestCosts.request_cpu_s`).
    """

    driver_cpu_s: float
    worker_cpu_s: float


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
        settings = [[CPU.name, CPU.name], free_port(), requests, timeout_s, results_dir]
        run_ranks(settings, 2, timeout_s, entry=_request_rank_main)
        report = json.loads(Path(results_dir, "requests.json").read_text())
    own = [_runtime_own_cpu_s(report, way, link) for way in report["ways"]]
    driver, worker = np.mean(own, axis=0).tolist()
    return RequestCost(driver, worker)


def _runtime_own_cpu_s(report: dict[str, Any], way: dict[str, Any], link: TransferCost) -> list[float]:
    """Each rank's CPU per request of one way, less what the model books for it elsewhere: its layer's eager
    time and the messages the model charges (the charge terms of :class:`moirai.planning.costs.RequestCosts`)."""
    layer_s = report["eager_s"] / 2
    first, second = way["first"], 1 - way["first"]
    booked = [layer_s, layer_s]
    booked[first] += link.sender_cpu_time_s(report["activation_bytes"])
    booked[second] += link.receiver_cpu_time_s(report["activation_bytes"])
    # The second layer makes the output: off rank 0, a message to the driver, charged as the model charges it.
    send, receive = link.sender_cpu_time_s(report["output_bytes"]), link.receiver_cpu_time_s(report["output_bytes"])
    output = RequestCosts.build(2, 2, output_send_cpu_s=[[0, 0], [0, send]], output_recv_cpu_s=[[0, 0], [0, receive]])
    booked = (np.array(booked) + output.charges.device_s(np.array([first, second]))).tolist()
    return [max(cpu - b, 0.0) for cpu, b in zip(way["cpu_s"], booked, strict=True)]


def _request_rank_main(
    rank: int, torch_devices: list[str], port: int, requests: int, timeout_s: float, results_dir: str
) -> None:
    """One rank of :func:`measure_request_cost`: rank 0 drives and times the requests, the others serve them."""
    from moirai.runtime.protocol import serve

    group, store, resources = join_as_runtime_rank(rank, torch_devices, port, timeout_s)
    if rank == 0:
        report = _time_requests(group, store, resources.helper_cores, requests, timeout_s)
        Path(results_dir, "requests.json").write_text(json.dumps(report))
    else:
        store.set(f"moirai/pid/{rank}", str(os.getpid()))
        serve(group, {}, timeout_s)
    leave_together(store, rank, group.world_size)


def _time_requests(group: Any, store: Any, helper_cores: Sequence[int] | None, requests: int, timeout_s: float) -> dict:
    """Rank 0 of :func:`measure_request_cost`: the two ways of the two-layer chain, each rank's CPU per request."""
    import psutil

    from moirai.runtime.driver import Driver

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).eval()
    x = torch.randn(1, 4)
    chain = _TwoWayChain.of(model, x)
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
        server = chain.server(first_rank, driver, timeout_s)
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
        "activation_bytes": chain.activation_bytes,
        "output_bytes": output_bytes,
        "ways": ways,
    }


class _TwoWayChain(NamedTuple):
    """A model split in two both ways: its first op group on rank 0 and the rest on rank 1, then the reverse."""

    traced: TracedModel
    programs: tuple[SplitProgram, SplitProgram]
    activation_bytes: float  # what crosses between the parts

    @classmethod
    def of(cls, model: torch.nn.Module, x: torch.Tensor) -> _TwoWayChain:
        """Traced, coarsened and priced as compile does, split by hand (calibration cannot import compile)."""
        traced = trace(model, (x,))
        groups = coarsen(build_op_graph(traced)).graph
        problem = build_problem(groups, Cluster.from_devices([CPU.name, CPU.name]), "analytic", traced)
        first = problem.topological_order[0]
        programs = []
        for first_rank in (0, 1):
            placement = np.full(problem.num_tasks, 1 - first_rank)
            placement[first] = first_rank
            node_device = {name: int(placement[i]) for i, node in enumerate(groups.nodes) for name in node.fx_names}
            programs.append(split_module(traced, node_device, 2))
        return cls(traced, (programs[0], programs[1]), float(problem.tensor_bytes.sum()))

    def server(self, first_rank: int, driver: Any, timeout_s: float) -> Server:
        """The way with its first part on ``first_rank``, served as a compiled model's server() serves: inputs
        checked and flattened, outputs rebuilt."""
        program = self.programs[first_rank]

        def checked_flat_inputs(args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
            flat_inputs = self.traced.flatten_inputs(args, kwargs)
            check_inputs(program, flat_inputs)
            return flat_inputs

        submit = lambda flat, finish: driver.submit(program, flat, finish, timeout_s)  # noqa: E731
        return Server(submit, checked_flat_inputs, self.traced.unflatten_outputs, lambda: None, max_in_flight=8)
