"""Ranks run on their share of the cores; the server pipelines requests, survives idle time and fails cleanly."""

from __future__ import annotations

import multiprocessing
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import moirai
from moirai.cluster.host import available_cores, split_cores
from moirai.errors import ClusterError, DistributedError
from moirai.runtime import DistributedRunner, orphans
from moirai.runtime import driver as driver_module
from moirai.runtime.driver import Driver
from moirai.runtime.rank_processes import started_ranks
from moirai.runtime.resources import rank_resources, set_thread_count

ROOT = Path(__file__).resolve().parent.parent


def _chain_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(6)]
    return torch.nn.Sequential(*layers).eval()


@pytest.fixture(scope="module")
def chain():
    model = _chain_model()
    compiled = moirai.compile(model, ["cpu"] * 3, example_inputs=(torch.randn(4, 64),), placer="round_robin")
    assert {t.dst for t in compiled.program.transfers} == {1, 2}, "a chain through the three devices"
    return model, compiled


def _eager(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_each_rank_runs_on_its_own_cores_with_its_share_of_threads() -> None:
    threads_before, cores_before = torch.get_num_threads(), available_cores()
    with DistributedRunner(["cpu", "cpu"], timeout_s=30.0) as runner:
        used = runner.resources_in_use()
    blocks = split_cores(available_cores(), 2)
    assert [tuple(rank["cores"]) for rank in used] == blocks
    assert [rank["threads"] for rank in used] == [len(block) for block in blocks]
    assert used[1]["interop_threads"] == 1
    if len(available_cores()) >= 2:
        assert not set(used[0]["cores"]) & set(used[1]["cores"]), "disjoint cores"
        for rank in used:
            # gloo's I/O threads run off their rank's cores: on its own core one spins against the rank's thread.
            assert rank["io_thread_cores"], "the rank's process groups have I/O threads"
            for io_cores in rank["io_thread_cores"]:
                assert set(io_cores) and not set(io_cores) & set(rank["cores"]), (rank, io_cores)
    assert (torch.get_num_threads(), available_cores()) == (threads_before, cores_before), "rank 0's share given back"


def test_io_threads_go_to_spare_cores_else_to_the_other_ranks() -> None:
    two_ranks_two_cores = rank_resources(["cpu", "cpu"], cores=[0, 1])
    assert [(r.cores, r.io_cores) for r in two_ranks_two_cores] == [((0,), (1,)), ((1,), (0,))]
    two_ranks_five_cores = rank_resources(["cpu", "cpu"], cores=[0, 1, 2, 3, 4])
    assert [(r.cores, r.io_cores) for r in two_ranks_five_cores] == [((0, 1), (4,)), ((2, 3), (4,))]
    # The driver's helper thread goes only where no rank computes: its work is charged to rank 0's device.
    assert [r.helper_cores for r in two_ranks_two_cores] == [None, None]
    assert [r.helper_cores for r in two_ranks_five_cores] == [(4,), (4,)]
    assert rank_resources(["cpu"], cores=[0])[0].io_cores is None, "one rank on one core: nowhere else to go"


def test_a_second_runner_splits_the_same_cores_while_the_first_pins_this_process() -> None:
    """The first runner pins this process to rank 0's share; the second must still split the host's cores,
    or all its ranks land on rank 0's core (measured: a second server ran at half the first one's rate)."""
    cores_before = available_cores()
    blocks = split_cores(cores_before, 2)
    with (
        DistributedRunner(["cpu", "cpu"], timeout_s=30.0) as first,
        DistributedRunner(["cpu", "cpu"], timeout_s=30.0) as second,
    ):
        used_first, used_second = first.resources_in_use(), second.resources_in_use()
    assert [tuple(rank["cores"]) for rank in used_first] == blocks
    assert [tuple(rank["cores"]) for rank in used_second] == blocks
    assert available_cores() == cores_before, "both runners gave the process its cores back"


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs two cores")
def test_cluster_file_cores_and_threads_reach_the_ranks(tmp_path) -> None:
    last = available_cores()[-1]
    path = tmp_path / "cluster.toml"
    path.write_text(
        f"""
[[devices]]
name = "pinned"
type = "cpu"
cores = [{last}]
[[devices]]
name = "rest"
type = "cpu"
threads = 1
[[links]]
src = "pinned"
dst = "rest"
bandwidth_gbps = 10
both_directions = true
"""
    )
    cluster = moirai.Cluster.from_file(path)
    assert cluster.devices[0].cores == (last,) and cluster.devices[1].threads == 1
    assert moirai.Cluster.from_dict(cluster.to_dict()).devices == cluster.devices
    with DistributedRunner(cluster.devices, timeout_s=30.0) as runner:
        used = runner.resources_in_use()
    free = [c for c in available_cores() if c != last]
    assert used[0]["cores"] == [last] and used[0]["threads"] == 1
    assert used[1]["cores"] == free and used[1]["threads"] == 1


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"cores": "0-3"}, "cores must be a non-empty list"),
        ({"cores": []}, "cores must be a non-empty list"),
        ({"cores": [0, -1]}, "cores must be a non-empty list"),
        ({"cores": [1, 1]}, "lists a core twice"),
        ({"threads": 0}, "threads must be a positive integer"),
        ({"threads": "many"}, "threads must be a positive integer"),
        ({"cores": [0], "threads": 4}, "oversubscribe"),
    ],
)
def test_bad_cores_and_threads_are_cluster_errors(entry, message) -> None:
    description = {"devices": [{"name": "c", "type": "cpu", **entry}]}
    with pytest.raises(ClusterError, match=f"device 'c'.*{message}"):
        moirai.Cluster.from_dict(description)


def test_two_devices_claiming_one_core_is_a_cluster_error() -> None:
    cluster = moirai.Cluster.from_dict(
        {
            "devices": [{"name": "a", "type": "cpu", "cores": [0]}, {"name": "b", "type": "cpu", "cores": [0]}],
            "links": [{"src": "a", "dst": "b", "bandwidth_gbps": 10, "both_directions": True}],
        }
    )
    with pytest.raises(ClusterError, match="'a' and 'b' on host 'localhost' both claim core 0"):
        rank_resources(cluster.devices)


def test_gpu_ranks_get_a_few_host_threads_and_cpu_ranks_split_the_cores() -> None:
    resources = rank_resources(["cuda:0", "cpu", "cpu"], cores=[0, 1, 2, 3])
    assert resources[0].cores is None and resources[0].threads == 2
    assert [r.cores for r in resources[1:]] == [(0, 1), (2, 3)] and [r.threads for r in resources[1:]] == [2, 2]


@pytest.mark.slow
def test_fifty_pipelined_requests_from_several_threads_equal_eager(chain) -> None:
    model, compiled = chain
    requests = [torch.randn(4, 64) for _ in range(50)]
    with compiled.server(timeout_s=60.0, max_in_flight=4) as server:
        with ThreadPoolExecutor(4) as pool:
            futures = list(pool.map(server.submit, requests[:30]))
        mapped = list(server.map(requests[30:]))
        # One tensor refilled for each next request: each request keeps the inputs it was submitted with (the
        # ranks read them after submit returns, and had read the refilled ones).
        buffer, refilled = torch.empty(4, 64), []
        for request in requests[:10]:
            buffer.copy_(request)
            refilled.append(server.submit(buffer))
    outputs = [f.result() for f in futures] + mapped
    for request, output in zip(requests, outputs, strict=True):
        torch.testing.assert_close(output, _eager(model, request))
    for request, future in zip(requests[:10], refilled, strict=True):
        torch.testing.assert_close(future.result(), _eager(model, request))


@pytest.mark.slow
def test_server_idle_past_its_timeout_still_answers(chain) -> None:
    model, compiled = chain
    x = torch.randn(4, 64)
    with compiled.server(timeout_s=1.0) as server:
        torch.testing.assert_close(server.submit(x).result(), _eager(model, x))
        time.sleep(3.0)
        torch.testing.assert_close(server.submit(x).result(), _eager(model, x))


@pytest.mark.slow
def test_ranks_started_inside_inference_mode_serve(chain) -> None:
    """The first submit starts the ranks in the caller's thread: under torch.inference_mode its shared-memory rings
    were inference tensors, which the driver's threads could not write, and the request failed as 'rank 1 hung or
    died'. run's inline request, in the caller's thread too, must leave nothing the threads cannot use."""
    model, compiled = chain
    x = torch.randn(4, 64)
    with torch.inference_mode(), compiled.server(timeout_s=30.0) as server:
        outputs = [server.submit(x).result() for _ in range(2)]
    with DistributedRunner(["cpu"] * 3, timeout_s=30.0) as runner:
        with torch.inference_mode():
            outputs.append(runner.run(compiled.program, [x])[0])
        outputs.append(runner.submit(compiled.program, [x]).result()[0])
    for output in outputs:
        torch.testing.assert_close(output, _eager(model, x))


@pytest.mark.slow
def test_killed_rank_fails_every_pending_request_naming_it(chain) -> None:
    model, compiled = chain
    timeout_s = 5.0
    with DistributedRunner(["cpu"] * 3, timeout_s=timeout_s) as runner:
        x = torch.randn(4, 64)
        torch.testing.assert_close(runner.run(compiled.program, [x])[0], _eager(model, x))
        os.kill(runner._workers[1].pid, signal.SIGKILL)  # rank 2
        started = time.monotonic()
        futures = [runner.submit(compiled.program, [x]) for _ in range(10)]
        errors = []
        for future in futures:
            with pytest.raises(DistributedError) as failure:
                future.result(timeout=timeout_s + 30.0)
            errors.append(str(failure.value))
        assert time.monotonic() - started < timeout_s + 10.0
    assert all(re.match(r"rank 2 \(cpu\) hung or died", error) for error in errors), errors[0]
    assert "exited with code -9" in errors[0]


@pytest.mark.slow
def test_done_callbacks_may_submit_and_are_told_not_to_close(chain) -> None:
    """A future's done callbacks run in the server's own threads: one that submits the next request gets its
    outputs (after a success, and after a killed rank failed it: the ranks restart), one that closes the server is
    refused with a UsageError, and the server still closes after."""
    model, compiled = chain
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    follow_ups: queue.SimpleQueue = queue.SimpleQueue()

    def submit_follow_up(_: Future) -> None:
        follow_ups.put(server.submit(y))

    with compiled.server(timeout_s=10.0) as server:
        server.submit(x).add_done_callback(submit_follow_up)
        torch.testing.assert_close(follow_ups.get(timeout=60.0).result(timeout=60.0), _eager(model, y))
        assert "close from your own thread" in str(close_in_a_done_callback(server, lambda: server.submit(x)))
        waited: queue.SimpleQueue = queue.SimpleQueue()

        def wait_for_the_next(_: Future) -> None:  # hung the server, and its close, for ever
            try:
                waited.put(server.submit(y).result())
            except moirai.UsageError as error:
                waited.put(error)

        server.submit(x).add_done_callback(wait_for_the_next)
        assert "in the server's own thread" in str(waited.get(timeout=60.0))
        torch.testing.assert_close(server.submit(x).result(timeout=60.0), _eager(model, x))
        (rank_2,) = [p for p in multiprocessing.active_children() if p.name == orphans.rank_process_name(2)]
        os.kill(rank_2.pid, signal.SIGKILL)  # the next request fails, and its callback submits again
        failed = server.submit(x)
        failed.add_done_callback(submit_follow_up)
        with pytest.raises(DistributedError):
            failed.result(timeout=60.0)
        torch.testing.assert_close(follow_ups.get(timeout=60.0).result(timeout=60.0), _eager(model, y))
    # A runner closed while its callbacks submit: each submit is served, or refused once close has begun (close
    # held the lock a submit takes while it waited for the callbacks' thread: deadlock).
    chained: queue.SimpleQueue = queue.SimpleQueue()

    def submit_next(_: Future) -> None:
        try:
            chained.put(runner.submit(compiled.program, [y]))
        except moirai.InputError as error:
            chained.put(error)

    with DistributedRunner(["cpu"] * 3, timeout_s=10.0) as runner:
        for _ in range(5):
            runner.submit(compiled.program, [x]).add_done_callback(submit_next)
        runner.close()
    for _ in range(5):
        outcome = chained.get(timeout=60.0)
        if isinstance(outcome, Exception):
            assert "is closing" in str(outcome)
        else:
            torch.testing.assert_close(outcome.result(timeout=60.0)[0], _eager(model, y))


@pytest.mark.slow
def test_a_keyboard_interrupt_from_a_done_callback_in_the_servers_thread_is_logged_and_the_server_serves_on(
    chain, caplog
) -> None:
    """[Note: whose KeyboardInterrupt] No Ctrl-C reaches the server's threads: one from a done callback there is
    user code's. It ended the completer's loop, failing the requests in flight and the driver with them."""
    model, compiled = chain
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    caller, interrupted = threading.current_thread(), threading.Event()

    def interrupt(_: Future) -> None:
        if threading.current_thread() is not caller:  # in the caller's thread (settled already): not what is tested
            interrupted.set()
            raise KeyboardInterrupt

    with compiled.server(timeout_s=10.0) as server:
        while not interrupted.is_set():
            first = server.submit(x)
            first.add_done_callback(interrupt)
            behind = server.submit(y)  # in flight when the callback raises, or submitted after
            torch.testing.assert_close(first.result(timeout=60.0), _eager(model, x))
            torch.testing.assert_close(behind.result(timeout=60.0), _eager(model, y))
        torch.testing.assert_close(server.submit(x).result(timeout=60.0), _eager(model, x))
    assert "exception calling callback" in caplog.text and "KeyboardInterrupt" in caplog.text


def close_in_a_done_callback(server, submit: Callable[[], Future]) -> object:
    """What ``server.close()`` raised in a done callback of a request ``submit()`` made, run in the server's own
    thread (a request that finished before its callback was added runs it here: it is submitted again), or
    "closed" where close did not refuse."""
    outcomes: queue.SimpleQueue = queue.SimpleQueue()
    caller = threading.current_thread()

    def close(_: Future) -> None:
        if threading.current_thread() is caller:
            outcomes.put(None)  # where close may run: not what is tested
            return
        try:
            server.close()
            outcomes.put("closed")
        except moirai.UsageError as error:
            outcomes.put(error)

    while True:
        submit().add_done_callback(close)
        if (outcome := outcomes.get(timeout=60.0)) is not None:
            return outcome


README = (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_readme_serve_script_runs_under_torchrun(tmp_path) -> None:
    (script,) = re.findall(r"```python\n(# serve\.py.+?)\n```", README, re.DOTALL)
    assert "torchrun --nproc-per-node 2 serve.py" in script
    (tmp_path / "serve.py").write_text(script)
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "serve.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served 50 requests, all equal to the model's" in result.stdout


def _serve_with_rank_1_stopped(
    model: torch.nn.Module, compiled: moirai.CompiledModel, world_size: int, requests: list, dispatched_means: str
) -> None:
    """Stop rank 1, submit ``requests``: the driver dispatches every one and none finishes; once rank 1
    resumes, all equal eager."""
    with DistributedRunner(["cpu"] * world_size, timeout_s=60.0, max_in_flight=4) as runner:
        runner.run(compiled.program, [requests[0]])
        driver, rank_1 = runner._driver, runner._workers[0].pid
        os.kill(rank_1, signal.SIGSTOP)
        try:
            # Queued before the dispatcher sends the first (it sends under _dispatching): the driver promises to
            # send every queued request before part 0 of the oldest runs, not to wait for requests still to come.
            with driver._dispatching:
                futures = [runner.submit(compiled.program, [x]) for x in requests]
            deadline = time.monotonic() + 30.0
            while driver.dispatched < 1 + len(requests) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert driver.dispatched == 1 + len(requests), dispatched_means
            assert not any(f.done() for f in futures), "none could finish without rank 1"
        finally:
            os.kill(rank_1, signal.SIGCONT)
        for request, future in zip(requests, futures, strict=True):
            torch.testing.assert_close(future.result(timeout=60.0)[0], _eager(model, request))


@pytest.mark.slow
def test_device_0_runs_the_next_requests_while_device_1_has_not_finished_this_one(chain) -> None:
    """Rank 1 is stopped: rank 0 still runs its part of every request in flight; all finish once rank 1 resumes."""
    model, compiled = chain
    requests = [torch.randn(4, 64) for _ in range(3)]
    _serve_with_rank_1_stopped(model, compiled, 3, requests, "part 0 ran for every request in flight")


@pytest.mark.slow
def test_requests_reach_rank_1_while_part_0_waits_for_rank_1() -> None:
    """First stage on rank 1, last on rank 0: part 0 of a request waits for rank 1, so the driver must send
    rank 1 the next requests before it runs part 0, or the two devices never work at once."""
    model = _chain_model()
    compiled = moirai.compile(model, ["cpu"] * 2, example_inputs=(torch.randn(4, 64),), placer="round_robin")
    reversed_plan = moirai.Plan(1 - compiled.plan.placement, compiled.plan.device_names, placer="by hand")
    compiled = compiled.with_plan(reversed_plan)
    assert [(t.src, t.dst) for t in compiled.program.transfers] == [(1, 0)]
    requests = [torch.randn(4, 64) for _ in range(4)]
    _serve_with_rank_1_stopped(model, compiled, 2, requests, "every request in flight was sent to rank 1")


class _Biased(torch.nn.Module):
    """A model called with keyword arguments, as a Hugging Face model with ``return_dict=False`` is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, return_dict: bool = True) -> tuple[torch.Tensor, ...]:
        y = self.second(torch.relu(self.first(x) + bias))
        return (y,) if not return_dict else {"y": y}


def test_map_items_take_every_form_submit_does() -> None:
    """A tensor, positional arguments, keyword arguments, or an (args, kwargs) pair: each reaches submit as such."""
    from concurrent.futures import Future

    from moirai.runtime.server import Server

    def submit_flat(flat: list, finish) -> Future:
        future: Future = Future()
        future.set_result(finish(flat))
        return future

    server = Server(submit_flat, lambda args, kwargs: [(args, kwargs)], lambda flat: flat[0], lambda: None, 2)
    items = ["t", ("a", "b"), {"mask": "m"}, (("a",), {"mask": "m"})]
    assert list(server.map(items)) == [(("t",), {}), (("a", "b"), {}), ((), {"mask": "m"}), (("a",), {"mask": "m"})]
    server.close()


def test_a_submit_racing_close_is_queued_before_close_waits_or_refused() -> None:
    """A submit that had passed its check when close began was queued after close had stopped the ranks, and its
    runner started a fresh world nobody closed."""
    from moirai.runtime.server import Server

    events, entered, release = [], threading.Event(), threading.Event()

    def submit_flat(flat: list, finish) -> Future:
        entered.set()
        release.wait(10)
        events.append(f"queued {flat[0]}")
        future: Future = Future()
        future.set_result(finish(flat))
        return future

    server = Server(submit_flat, lambda args, kwargs: list(args), lambda flat: flat, lambda: events.append("closed"), 2)
    submitter = threading.Thread(target=server.submit, args=("x",))
    submitter.start()
    assert entered.wait(10)
    closer = threading.Thread(target=server.close)
    closer.start()
    time.sleep(0.2)  # close would run now, before the submit has queued, without the lock it waits for
    release.set()
    submitter.join(10)
    closer.join(10)
    assert events == ["queued x", "closed"]
    with pytest.raises(moirai.InputError, match="this server is closed"):
        server.submit("y")
    with pytest.raises(moirai.InputError, match="this server is closed"), server:
        pass  # entered again: said at the with


@pytest.mark.slow
def test_map_serves_a_model_traced_with_example_kwargs() -> None:
    model = _Biased().eval()
    example = {"x": torch.randn(4, 16), "bias": torch.randn(16), "return_dict": False}
    compiled = moirai.compile(model, ["cpu", "cpu"], example_kwargs=example, placer="round_robin", progress=False)
    requests = [{"x": torch.randn(4, 16), "bias": torch.randn(16), "return_dict": False} for _ in range(4)]
    with compiled.server(timeout_s=60.0) as server:
        outputs = list(server.map([requests[0], ((), requests[1]), *requests[2:]]))
    for request, (output,) in zip(requests, outputs, strict=True):
        with torch.no_grad():
            torch.testing.assert_close(output, model(**request)[0])


def _in_thread(function: Callable[[], object]) -> object:
    """``function()`` in a thread of its own (a shutdown hook; a thread started now)."""
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(function()))
    thread.start()
    thread.join(120.0)
    return results[0]


def test_set_thread_count_sets_the_calling_threads_count_and_no_other() -> None:
    main, for_new_threads = torch.get_num_threads(), _in_thread(torch.get_num_threads)

    def set_and_read() -> int:
        set_thread_count(for_new_threads + 2)
        return torch.get_num_threads()

    assert _in_thread(set_and_read) == for_new_threads + 2
    assert torch.get_num_threads() == main
    assert _in_thread(torch.get_num_threads) == for_new_threads, "torch.set_num_threads alone sets it for new threads"


@pytest.mark.slow
def test_each_thread_keeps_its_torch_thread_count_while_part_0_computes_with_rank_0s(chain, monkeypatch) -> None:
    """Serving code submits first from a request handler's thread and closes from a shutdown hook's: rank 0's count
    (set where the ranks started) stayed in the handler's thread for good, and the hook's thread took the handler's."""
    model, compiled = chain
    seen_by_part_0 = []
    run_part = driver_module.run_part
    monkeypatch.setattr(
        driver_module, "run_part", lambda *args: (seen_by_part_0.append(torch.get_num_threads()), run_part(*args))[1]
    )
    rank_0_threads = rank_resources(["cpu"] * 3)[0].threads
    handler_threads = rank_0_threads + 2  # not rank 0's count, whatever the host
    x = torch.randn(4, 64)
    runner = DistributedRunner(["cpu"] * 3, timeout_s=60.0)
    with ThreadPoolExecutor(1) as handler:
        handler.submit(torch.set_num_threads, handler_threads).result()  # threads started later take it too
        main_threads, new_threads = torch.get_num_threads(), _in_thread(torch.get_num_threads)
        submitted = handler.submit(lambda: runner.submit(compiled.program, [x]).result(timeout=60.0)).result()
        ran = handler.submit(lambda: runner.run(compiled.program, [x])).result()  # part 0 inline, in the handler
        assert handler.submit(torch.get_num_threads).result() == handler_threads, "while the runner is open"
        _in_thread(runner.close)
        assert handler.submit(torch.get_num_threads).result() == handler_threads, "after a close in another thread"
    assert seen_by_part_0 == [rank_0_threads, rank_0_threads], "the dispatcher's part 0, then the inline one"
    assert torch.get_num_threads() == main_threads
    assert _in_thread(torch.get_num_threads) == new_threads, "a thread started now computes as it did before"
    for outputs in (submitted, ran):
        torch.testing.assert_close(outputs[0], _eager(model, x))


@pytest.mark.slow
def test_a_close_cut_short_by_ctrl_c_is_finished_by_the_next(chain, monkeypatch) -> None:
    """Ctrl-C in close() marked the server closed: every later close returned at once, and the ranks, the pinned
    cores and the driver's threads stayed until the process exited."""
    model, compiled = chain
    cores = os.sched_getaffinity(0)
    finish_requests = Driver.close

    def interrupted(driver: Driver) -> None:
        finish_requests(driver)
        raise KeyboardInterrupt  # the requests finished, the ranks not yet stopped

    x = torch.randn(4, 64)
    server = compiled.server(timeout_s=60.0)
    future = server.submit(x)
    monkeypatch.setattr(Driver, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.close()
    monkeypatch.undo()
    assert len(started_ranks()) == 2, "the interrupted close left the ranks"
    server.close()
    assert started_ranks() == [] and os.sched_getaffinity(0) == cores
    torch.testing.assert_close(future.result(timeout=0), _eager(model, x))
    with pytest.raises(moirai.InputError, match="this server is closed"):
        server.submit(x)


def test_a_server_dropped_unclosed_is_closed_in_a_thread_of_its_own_with_a_resource_warning() -> None:
    """A dropped server kept its ranks and pinned cores until the process exited, silently. It may be collected in
    one of its own threads, which its close waits for: the close runs elsewhere."""
    from moirai.runtime.server import Server

    closed_in, done = [], threading.Event()

    def close() -> None:
        closed_in.append(threading.current_thread())
        done.set()

    server = Server(lambda flat, finish: Future(), lambda args, kwargs: list(args), lambda flat: flat, close, 2)
    with pytest.warns(ResourceWarning, match="dropped without close"):
        del server
    assert done.wait(10.0)
    assert closed_in[0] is not threading.current_thread()
    closed = Server(lambda flat, finish: Future(), lambda args, kwargs: list(args), lambda flat: flat, close, 2)
    closed.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del closed  # closed: nothing to say, nothing to close again
    assert len(closed_in) == 2


@pytest.mark.slow
def test_a_dropped_server_gives_back_its_ranks_and_cores_and_still_answers_its_requests(chain) -> None:
    model, compiled = chain
    cores, x = os.sched_getaffinity(0), torch.randn(4, 64)
    server = compiled.server(timeout_s=60.0)
    future = server.submit(x)
    with pytest.warns(ResourceWarning, match="dropped without close"):
        del server
    torch.testing.assert_close(future.result(timeout=60.0), _eager(model, x))
    deadline = time.monotonic() + 60.0
    while (started_ranks() or os.sched_getaffinity(0) != cores) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started_ranks() == [] and os.sched_getaffinity(0) == cores
    closers = [thread for thread in threading.enumerate() if thread.name == "moirai-close-dropped"]
    for thread in closers:
        thread.join(30.0)


def _parameter_on(compiled: moirai.CompiledModel, model: torch.nn.Module, device: int) -> torch.nn.Parameter:
    """A parameter of ``model`` that part ``device`` reads (its tensor shares the parameter's storage)."""
    part = compiled.program.parts[device]
    pointers = {getattr(part.graph_module, name).data_ptr() for name in part.attribute_names}
    return next(p for p in model.parameters() if p.data_ptr() in pointers)


def test_a_server_refuses_a_request_after_the_model_changed_a_weight_another_rank_holds() -> None:
    """Rank 0 runs part 0 on the model's own tensors, the other ranks on the copies they were sent: a weight changed
    in place would have been served old on rank 1 and new on rank 0, a silent mix."""
    model = _chain_model()
    compiled = moirai.compile(
        model, ["cpu", "cpu"], example_inputs=(torch.randn(4, 64),), placer="round_robin", progress=False
    )
    x = torch.randn(4, 64)
    with compiled.server(timeout_s=60.0) as server:
        torch.testing.assert_close(server.submit(x).result(), _eager(model, x), rtol=0, atol=0)
        with torch.no_grad():
            _parameter_on(compiled, model, 0).mul_(2)  # rank 0's own: it follows
        torch.testing.assert_close(server.submit(x).result(), _eager(model, x), rtol=0, atol=0)
        with torch.no_grad():
            _parameter_on(compiled, model, 1).add_(1)
        with pytest.raises(
            moirai.InputError,
            match=r"changed in place after this server's ranks were sent them \(.* on cpu_1\).*open a new one",
        ):
            server.submit(x)
    torch.testing.assert_close(compiled(x), _eager(model, x), rtol=0, atol=0)  # the local run reads them where they are
    with compiled.server(timeout_s=60.0) as server:  # a new server is sent the new weights
        torch.testing.assert_close(server.submit(x).result(), _eager(model, x), rtol=0, atol=0)
