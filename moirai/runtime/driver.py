"""Rank 0's side of a distributed run: requests sent in order and pipelined through the ranks, futures settled.

The driver sends each request's header and inputs without waiting for earlier requests to
finish, runs part 0 itself and receives the outputs of the other parts. An idle driver sends
heartbeat headers, so a rank waits for its next header at most a fraction of the timeout while
the driver is alive. A request whose part raises fails alone with a :class:`moirai.RequestError`
(:mod:`moirai.runtime.isolation`); when a rank fails or hangs every pending request fails with one
error naming the guilty rank (:mod:`moirai.runtime.blame`).

The threads hand each other typed items: :class:`Submitted` requests and a :class:`Stop` to the
dispatcher, :class:`Ran` requests, :class:`ControlSent` headers and a :class:`Stop` to the completer.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, NamedTuple

import torch

from moirai.errors import DistributedError, InputError, PlanError, RequestError, UsageError
from moirai.runtime.blame import blamed, describe_error, report_failure
from moirai.runtime.groups import Group, placed_part
from moirai.runtime.program_codec import encode_program
from moirai.runtime.protocol import (
    _TAG_WINDOW,
    HEADERS_READ_AHEAD,
    Header,
    HeaderKind,
    Messages,
    check_tags,
    program_for_rank,
    run_part,
    send_header,
    send_inputs,
)
from moirai.runtime.resources import set_thread_count
from moirai.runtime.split import SplitProgram

# The logger concurrent.futures reports a done callback's exception to: a BaseException is reported there too.
_futures_log = logging.getLogger("concurrent.futures")

# Requests in flight at once: each holds its tags in the protocol's window while it runs, and a rank reads a few
# headers ahead; more would reuse a tag still in use.
MAX_IN_FLIGHT = _TAG_WINDOW - 2 * HEADERS_READ_AHEAD

# The defaults of every entry point's ``timeout_s`` (the longest wait of a request: a receive, a send, a rank's start
# of it) and ``max_in_flight``, the same for the runtime's functions and the compiled model's methods of one name.
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MAX_IN_FLIGHT = 8

# A heartbeat goes to a rank that has had no header for this fraction of the timeout.
_HEARTBEAT_FRACTION = 0.25
# The longest time limit: a timedelta holds ~2.7e14 s and torch's waits take milliseconds in a signed 64-bit count.
_MAX_TIMEOUT_S = 1e9


def check_timeout(timeout_s: float) -> float:
    """``timeout_s`` if it is a positive, finite number of seconds, else :class:`moirai.InputError` naming the option
    (torch's waits take a finite time limit: infinity would overflow them)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < _MAX_TIMEOUT_S:
        raise InputError(
            f"timeout_s must be a positive number of seconds below {_MAX_TIMEOUT_S:.0e} (a year is 3.2e7), got "
            f"{timeout_s!r}"
        )
    return float(timeout_s)


def check_max_in_flight(max_in_flight: int) -> int:
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or not 1 <= max_in_flight <= MAX_IN_FLIGHT:
        raise InputError(
            f"max_in_flight must be an integer from 1 to {MAX_IN_FLIGHT} (requests in flight share {_TAG_WINDOW} "
            f"message tags), got {max_in_flight!r}"
        )
    return max_in_flight


class Submitted(NamedTuple):
    """A request handed to the dispatcher: what to run on which inputs, the future its result settles."""

    program: SplitProgram
    flat_inputs: list[torch.Tensor]
    future: Future
    finish: Callable[[list[torch.Tensor]], Any]
    timeout_s: float

    def __repr__(self) -> str:
        return (
            f"Submitted({len(self.flat_inputs)} inputs, {self.program.num_devices} parts, limit {self.timeout_s:g} s)"
        )


class Sent(NamedTuple):
    """A request whose header and inputs went to the other ranks; part 0 has not run."""

    request: int
    control: list[Messages]  # its headers' sends
    messages: Messages
    submitted: Submitted

    def __repr__(self) -> str:
        return f"Sent(request {self.request}, {len(self.control)} headers)"


class Ran(NamedTuple):
    """A request whose part 0 ran: the completer waits for its outputs and settles its future."""

    request: int
    control: list[Messages]  # its headers' sends
    finish_outputs: Callable[[], list[torch.Tensor]]
    future: Future
    finish: Callable[[list[torch.Tensor]], Any]

    def __repr__(self) -> str:
        return f"Ran(request {self.request}, {len(self.control)} headers)"


class ControlSent(NamedTuple):
    """Headers of no request (loads, heartbeats, the close) whose sends the completer waits for."""

    kind: HeaderKind
    control: list[Messages]

    def __repr__(self) -> str:
        return f"ControlSent({self.kind} to {len(self.control)} ranks)"


class Stop(NamedTuple):
    """The last item of a queue: the driver closes, or the dispatcher ended."""

    reason: str

    def __repr__(self) -> str:
        return f"Stop({self.reason})"


class Driver:
    """Rank 0: sends requests in submission order, runs part 0, completes each request's future when its outputs arrive.

    Two threads: the dispatcher sends headers and inputs and runs part 0 (request after request,
    without waiting for earlier outputs; at most ``max_in_flight`` unfinished); the completer
    waits for each request's outputs in order and settles its future, on ``helper_cores`` when given
    (spare cores of the host, :attr:`moirai.runtime.resources.RankResources.helper_cores`). Once a failure
    has failed every pending request, ``on_failure(driver)`` is called (a runner starts new ranks).
    """

    def __init__(
        self,
        group: Group,
        timeout_s: float,
        max_in_flight: int,
        preloaded: SplitProgram | None = None,
        describe_rank: Callable[[int], str] | None = None,
        helper_cores: Sequence[int] | None = None,
        on_failure: Callable[[Driver], None] | None = None,
        threads: int | None = None,
    ) -> None:
        """``threads``: rank 0's torch thread count, which the threads that run part 0 set for themselves (default:
        the calling thread's count, where it computes as rank 0 already)."""
        check_max_in_flight(max_in_flight)
        self._on_failure = on_failure
        self._helper_cores = helper_cores
        self.group = group
        if describe_rank is not None:
            group.describe_rank = describe_rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.failure: DistributedError | None = None
        self._closed = False  # close() has begun: later submits are refused (nothing would serve them)
        self.dispatched = 0  # requests whose part 0 has run (the next request's index)
        self._heartbeat_s = timeout_s * _HEARTBEAT_FRACTION
        self._programs: dict[int, int] = {}  # id(program) -> program id on the ranks
        self._keep: list[SplitProgram] = []
        if preloaded is not None:
            self._programs[id(preloaded)] = 0
            self._keep.append(preloaded)
        self._headers_sent = [0] * group.world_size
        self._last_header_s = [time.monotonic()] * group.world_size
        self._slots = threading.Semaphore(max_in_flight)
        self._lock = threading.Lock()
        self._dispatching = threading.Lock()  # one thread at a time sends headers and runs part 0
        self._pending: set[Future] = set()
        self._incoming: queue.SimpleQueue[Submitted | Stop] = queue.SimpleQueue()
        self._outgoing: queue.SimpleQueue[Ran | ControlSent | Stop] = queue.SimpleQueue()
        self.threads = torch.get_num_threads() if threads is None else threads
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="moirai-dispatch", daemon=True)
        self._completer = threading.Thread(target=self._complete_loop, name="moirai-complete", daemon=True)
        self._dispatcher.start()
        self._completer.start()

    def submit(
        self,
        program: SplitProgram,
        flat_inputs: Sequence[torch.Tensor],
        finish: Callable[[list[torch.Tensor]], Any],
        timeout_s: float,
    ) -> Future:
        future = ServedFuture(self.in_own_thread)
        # The request's own copy: its inputs are read when it runs, after submit has returned, and a caller may
        # refill the same tensor for its next request meanwhile (copied first: a copy that fails leaves nothing).
        inputs = [value.clone() if isinstance(value, torch.Tensor) else value for value in flat_inputs]
        with self._lock:
            self._check_open()
            if self.failure is not None:
                future.set_exception(self.failure)
                return future
            self._pending.add(future)
            # Queued under the lock close takes: a request is queued before close's Stop, or refused.
            self._incoming.put(Submitted(program, inputs, future, finish, check_timeout(timeout_s)))
        return future

    def _check_open(self) -> None:
        if self._closed:
            raise InputError(
                "this server (or runner) is closing: a request submitted after close() began is not served; submit "
                "it before closing, or to a new one"
            )

    def run(
        self,
        program: SplitProgram,
        flat_inputs: Sequence[torch.Tensor],
        finish: Callable[[list[torch.Tensor]], Any],
        timeout_s: float,
    ) -> Any:
        """``submit(...).result()``; when no other request is unfinished, run in the caller's thread (no hand-offs)."""
        timeout_s = check_timeout(timeout_s)
        future = ServedFuture(self.in_own_thread)
        with self._lock:
            self._check_open()
            inline = self.failure is None and not self._pending
            if inline:
                self._pending.add(future)  # requests submitted meanwhile queue behind this one
        if not inline:
            return self.submit(program, flat_inputs, finish, timeout_s).result()
        request = None
        try:
            with self._dispatching, _thread_count(self.threads):
                request = self.dispatched
                sent = self._send_request(Submitted(program, list(flat_inputs), future, finish, timeout_s))
                ran = self._run_part_0(sent)
            for messages in ran.control:
                messages.wait_sends()
            return finish(ran.finish_outputs())
        except RequestError:
            raise  # this request's part raised: the ranks serve on
        except BaseException as error:
            self._fail(error, f"request {request}" if request is not None else "a request")
            if self.failure is error:
                raise
            raise self.failure from error
        finally:
            with self._lock:
                self._pending.discard(future)

    @property
    def loaded(self) -> list[SplitProgram]:
        """The programs the ranks have (sent, or preloaded under torchrun), oldest first."""
        return list(self._keep)

    def close(self) -> None:
        """Finish every submitted request, then tell the ranks to stop."""
        self.check_close_allowed()
        with self._lock:
            self._closed = True
            self._incoming.put(Stop("closed"))
        self._dispatcher.join()
        self._completer.join()

    def join_after_failure(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a failed driver's threads to end (they wake on the failure; one in the middle
        of a message ends when it fails): a process that exits while they still hold the ranks' groups can abort in
        their teardown."""
        deadline = time.monotonic() + timeout_s
        for thread in (self._dispatcher, self._completer):
            if thread is threading.current_thread():
                continue  # a done callback of a request this failure failed (it ends when the callback returns)
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    @property
    def idle(self) -> bool:
        """No request is in flight (read without the lock: a hint, as a request may come or end at once)."""
        return not self._pending

    def in_own_thread(self) -> bool:
        """The caller runs in the dispatcher or the completer (a done callback of a request's future)."""
        return threading.current_thread() in (self._dispatcher, self._completer)

    def check_close_allowed(self) -> None:
        """:class:`UsageError` where the caller runs in the driver's dispatcher or completer (a done callback of a
        request's future): close would wait there for the thread it runs in."""
        if self.in_own_thread():
            raise UsageError(
                "close() was called from a done callback of a request's future: the callback runs in the server's "
                "own thread, which must go on to finish the requests behind it, so close cannot wait for them there; "
                "close from your own thread (the callback can set a threading.Event that thread waits for)"
            )

    def _dispatch_loop(self) -> None:
        # Part 0 runs in this thread. A new thread computes with the OpenMP/MKL default team (every core) however
        # torch.get_num_threads() reads, until it sets the count itself: on rank 0's one core, that team spun
        # against itself and ran a part 25-100x slower. Set for this thread only: the caller's keep their own.
        set_thread_count(self.threads)
        # Requests sent to the other ranks whose part 0 has not run. Every queued request is sent before part 0
        # of the oldest runs: part 0 may wait for another rank's work on its request (a plan whose first stage is
        # on rank 1), and that rank must have the next requests by then, or nothing is pipelined.
        started: collections.deque[Sent] = collections.deque()
        closing = False
        try:
            while self.failure is None:
                if not closing and (not started or self._slots.acquire(blocking=False)):
                    have_slot = bool(started)
                    item: Submitted | Stop | None
                    try:
                        item = self._incoming.get_nowait() if started else self._incoming.get(timeout=self._heartbeat_s)
                    except queue.Empty:
                        item = None
                    if not isinstance(item, Submitted) and have_slot:
                        self._slots.release()
                    if isinstance(item, Stop):
                        closing = True
                    elif isinstance(item, Submitted):
                        if not have_slot:
                            self._slots.acquire()
                        if self.failure is not None:
                            return
                        with self._dispatching:
                            started.append(self._send_request(item))
                        continue
                if started:
                    with self._dispatching:
                        self._outgoing.put(self._run_part_0(started.popleft()))
                    continue
                if closing:
                    with self._dispatching:
                        self._send_control(HeaderKind.CLOSE, range(1, self.group.world_size))
                    self._outgoing.put(Stop("closed"))
                    return
                with self._dispatching:
                    due = time.monotonic() - self._heartbeat_s
                    idle = [k for k in range(1, self.group.world_size) if self._last_header_s[k] < due]
                    if idle:
                        self._send_control(HeaderKind.HEARTBEAT, idle)
        except BaseException as error:
            self._fail(error, "sending a request")
            self._outgoing.put(Stop("failed"))

    def _send_control(self, kind: HeaderKind, ranks: Sequence[int]) -> None:
        """Send ``ranks`` a header of no request and no program (a heartbeat, the close)."""
        self._outgoing.put(ControlSent(kind, self._send_headers(Header(kind), ranks)))

    def _send_request(self, submitted: Submitted) -> Sent:
        """Send a request's header and inputs to the other ranks; :meth:`_run_part_0` runs this rank's part."""
        program, flat_inputs, timeout_s = submitted.program, submitted.flat_inputs, submitted.timeout_s
        request = self.dispatched
        header = Header.run(program, self._program_id(program), request, flat_inputs, timeout_s)
        # A rank the plan leaves idle is not told: each header costs both ends CPU time on their cores.
        control = self._send_headers(header, program.working_ranks)
        messages = Messages(self.group, request, datetime.timedelta(seconds=timeout_s), header.symbol_values)
        send_inputs(program, messages, flat_inputs)
        self.dispatched += 1
        return Sent(request, control, messages, submitted)

    def _run_part_0(self, sent: Sent) -> Ran:
        program, flat_inputs = sent.submitted.program, sent.submitted.flat_inputs
        finish_outputs = run_part(program, self.group, placed_part(program, self.group), sent.messages, flat_inputs)
        return Ran(sent.request, sent.control, finish_outputs, sent.submitted.future, sent.submitted.finish)

    def _program_id(self, program: SplitProgram) -> int:
        if id(program) not in self._programs:
            check_tags(program)
            program_id = self._programs[id(program)] = len(self._programs)
            self._keep.append(program)  # ids stay unique while the program lives
            # Each rank gets its own part only: no rank holds another's weights, and a load costs one part per rank.
            sent = []
            for rank in range(1, self.group.world_size):
                payload = encode_program(program_for_rank(program, rank)).to_bytes()
                load = Header(HeaderKind.LOAD, program_id, payload=payload)
                sent += self._send_headers(load, [rank])
            self._outgoing.put(ControlSent(HeaderKind.LOAD, sent))
        return self._programs[id(program)]

    def _send_headers(self, header: Header, ranks: Sequence[int]) -> list[Messages]:
        # A request's header waits as long as the request may; the others as long as the driver's timeout.
        timeout = datetime.timedelta(milliseconds=header.timeout_ms) if header.timeout_ms else self.timeout
        sent = []
        for rank in ranks:
            sent.append(send_header(self.group, self._headers_sent[rank], rank, header, timeout))
            self._headers_sent[rank] += 1
            self._last_header_s[rank] = time.monotonic()
        return sent

    def _complete_loop(self) -> None:
        # The completer waits and settles futures: on spare cores it leaves rank 0's own core to part 0. On
        # another rank's core it would take time from that rank's part, while the model charges the driver's
        # work to device 0 (the MLP chain's throughput plan served 9-17% below its prediction that way).
        if self._helper_cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self._helper_cores)
        set_thread_count(self.threads)  # its copies compute as rank 0's would, without a team of every core
        request = None
        try:
            while not isinstance(item := self._outgoing.get(), Stop):
                if isinstance(item, ControlSent):
                    for control in item.control:
                        control.wait_sends()
                    continue
                request = item.request
                for messages in item.control:
                    messages.wait_sends()
                try:
                    result, failed = item.finish(item.finish_outputs()), None
                except RequestError as error:
                    result, failed = None, error  # this request's part raised: it fails alone
                with self._lock:
                    owned = item.future in self._pending  # else a failure took it, and fails it
                    self._pending.discard(item.future)
                if owned:  # settled outside the lock: its done callbacks may submit the next request
                    settle_future(item.future, result, failed)
                self._slots.release()
        except BaseException as error:
            self._fail(error, f"request {request}" if request is not None else "sending control messages")

    def _fail(self, error: BaseException, what: str) -> None:
        """Fail every pending request with one DistributedError naming the guilty rank (the first thread to fail
        does; another failing meanwhile, its peer thread, returns)."""
        with self._lock:
            if self.failure is not None:
                return
        if isinstance(error, DistributedError):
            failure = blamed(self.group, error, what)
        else:
            report_failure(self.group.store, 0, None, describe_error(error))
            failure = (
                error
                if isinstance(error, InputError | PlanError)
                else DistributedError(f"rank 0 ({self.group.devices[0]}) failed during {what}: {describe_error(error)}")
            )
        self.fail_named(failure)

    def fail_named(self, failure: BaseException) -> None:
        """Fail every pending request with ``failure``, which names its guilty rank already (a rank the runner saw
        dead while no request was in flight; :meth:`_fail`'s own, once named), and end both threads."""
        with self._lock:
            if self.failure is not None:
                return  # the other thread failed first, while this one named its guilty rank
            self.failure = failure
            pending, self._pending = self._pending, set()
        self._slots.release()
        # Both threads end now: a dispatcher idle until its next heartbeat, and a completer waiting for its next
        # request (a callback below may restart the ranks, which waits for them).
        self._incoming.put(Stop("failed"))
        self._outgoing.put(Stop("failed"))
        for future in pending:  # their done callbacks may submit again: this driver's threads are ending
            settle_future(future, None, failure)
        if self._on_failure is not None:
            self._on_failure(self)


@contextlib.contextmanager
def _thread_count(threads: int) -> Iterator[None]:
    """The calling thread computes with ``threads`` torch threads inside, with its own count again after: part 0
    run in a caller's thread ([Note: a torch thread count is a thread's]). Plain sets, as run() is the path without
    hand-offs: threads started later take the caller's count after, as they take it from the caller's own
    torch.set_num_threads (set_thread_count's threads would cost more than the hand-off run saves)."""
    before = torch.get_num_threads()
    if before == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ServedFuture(Future):
    """A future a server settles in threads of its own, where its done callbacks (and a sequence's ``on_token``)
    run: waiting there for one not yet settled is a :class:`UsageError`, not a hang. Those threads would have to
    settle it while they wait for it (a callback that chains the next request through ``submit(x).result()`` hung
    the server and its close for ever). ``forbid_waits_where(check)``: ``check()`` says the calling thread is one
    of them; until it is given, waits are allowed (a sequence's future exists before its engine takes it)."""

    def __init__(self, waits_forbidden: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._waits_forbidden = waits_forbidden

    def forbid_waits_where(self, waits_forbidden: Callable[[], bool]) -> None:
        self._waits_forbidden = waits_forbidden

    def result(self, timeout: float | None = None) -> Any:
        self._check_wait("result")
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._check_wait("exception")
        return super().exception(timeout)

    def _check_wait(self, call: str) -> None:
        if self._waits_forbidden is not None and not self.done() and self._waits_forbidden():
            raise UsageError(
                f"future.{call}() of a request not yet served was called in the server's own thread (from a done "
                "callback of a future, or an on_token), which is the thread that would serve it: it would wait for "
                "ever. Wait from your own thread, or chain the next step with future.add_done_callback"
            )


def settle_future(future: Future, result: Any, error: BaseException | None, in_callers_thread: bool = False) -> None:
    """Set ``future``'s result (or ``error``) unless it has settled: its caller may cancel it from another thread at
    any moment (nothing marks it running), even between a check and the set. Its done callbacks run here, so call
    it holding no lock they might take. A callback that raises is logged, as concurrent.futures logs an Exception,
    also where it raises a BaseException (a ``sys.exit()``), which concurrent.futures lets out: here it ended the
    server's thread and failed every other request; the future's callbacks after it do not run. A
    KeyboardInterrupt goes on ``in_callers_thread`` alone ([Note: whose KeyboardInterrupt])."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass  # cancelled (or settled) first: nobody waits for this result
    except BaseException as raised:
        if in_callers_thread and isinstance(raised, KeyboardInterrupt):
            raise
        _futures_log.exception("exception calling callback for %r", future)


# [Note: whose KeyboardInterrupt]
# Python delivers a real Ctrl-C to the main thread alone. Where a loop runs in its caller's thread (the engine of a
# local generate), a KeyboardInterrupt out of a callback may be that Ctrl-C, and must stop the call: it goes on. In a
# server's own threads (the generation loop, the driver's completer) it can only be user code's (an on_token, a done
# callback, a streamer's put that raised it): letting it out ended the thread, failing every user's requests and
# refusing every later one, so there it is handled as a sys.exit() is, failing or logged for its own request alone.
