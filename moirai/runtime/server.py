"""Serve requests through a split program: futures, in-order maps, several requests in flight.

Example::

    with compiled.server() as server:
        future = server.submit(x)                 # a concurrent.futures.Future of the model's outputs
        outputs = list(server.map([(x1,), (x2,)]))  # in input order, pipelined through the devices
        outputs = list(server.map([((x1,), {"mask": m1}), {"x": x2, "mask": m2}]))  # with keyword arguments

Outside torchrun the server starts one process per device but the first (this process is
rank 0, see :class:`moirai.runtime.distributed.DistributedRunner`). Under torchrun, rank 0
opens the server and every other rank calls ``moirai.serve_rank(compiled)``, which returns when
rank 0 closes the server. A server dropped without ``close()`` is closed in a thread of its own, with a
:class:`ResourceWarning` ([Note: a server dropped unclosed]).
"""

from __future__ import annotations

import collections
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from moirai.errors import InputError

if TYPE_CHECKING:
    from moirai.runtime.runner import Worlds

_log = logging.getLogger(__name__)


class Server:
    """``submit`` and ``map`` requests; thread-safe; ``close`` (or leaving the ``with``) finishes those in flight."""

    def __init__(
        self,
        submit_flat: Callable[[list, Callable[[list], Any]], Future],
        flatten: Callable[[tuple, dict], list],
        unflatten: Callable[[list], Any],
        close: Callable[[], None],
        max_in_flight: int,
        check_close: Callable[[], None] = lambda: None,
        worlds: Worlds | None = None,
    ) -> None:
        """``check_close``: raises :class:`UsageError` where ``close`` cannot run in the calling thread (a done
        callback in the server's own threads), before the server is marked closed. ``worlds``: the ranks' restarts
        (None: ranks that never restart, under torchrun), which a caller keeping state on the ranks reads."""
        self.worlds = worlds
        self._submit_flat = submit_flat
        self._flatten = flatten
        self._unflatten = unflatten
        self._close = close
        self._check_close = check_close
        self._max_in_flight = max_in_flight
        self._closed = False  # close() has begun: submits are refused
        self._close_running = False  # a close() is under way: another returns at once (it may be its done callback)
        # A submit checks and queues under it, close marks the server closed under it: a submit racing close is
        # queued before close waits for the requests, or refused, never left to start a fresh world after close.
        self._closing = threading.Lock()
        # Alive until a close() has finished: closes a server dropped unclosed.
        self._unclosed = close_when_dropped(self, close, "compiled.server()")

    def __enter__(self) -> Server:
        self._check_open()  # else the block's first submit would say so
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        """A future of the model's outputs for these inputs (raises InputError at once if they do not fit)."""
        flat = self._flatten(args, kwargs)
        with self._closing:
            self._check_open()
            return self._submit_flat(flat, self._unflatten)

    def submit_flat(self, flat_inputs: Sequence[torch.Tensor]) -> Future:
        """As :meth:`submit`, given the traced model's flat input tensors in order (a caller that builds them so, as
        the generation engine does every decode step, skips flattening its arguments; the runner still checks
        them against the traced shapes)."""
        with self._closing:
            self._check_open()
            return self._submit_flat(list(flat_inputs), self._unflatten)

    def _check_open(self) -> None:
        if self._closed:
            raise InputError("this server is closed; open a new one with compiled.server()")

    def map(self, inputs: Iterable[Any]) -> Iterator[Any]:
        """The outputs for each item of ``inputs``, in order.

        An item is one tensor, a tuple of positional arguments, a dict of keyword arguments, or an ``(args, kwargs)``
        pair (a tuple of a tuple and a dict), as ``submit(*args, **kwargs)`` takes them. Keeps up to twice the
        server's in-flight requests submitted ahead of the one it yields.
        """
        ahead: collections.deque[Future] = collections.deque()
        for item in inputs:
            args, kwargs = _arguments(item)
            ahead.append(self.submit(*args, **kwargs))
            if len(ahead) >= 2 * self._max_in_flight:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()

    def close(self) -> None:
        """Wait for the requests in flight, then stop the other ranks. A close cut short (Ctrl-C) is finished by the
        next; one called while another runs returns at once."""
        self._check_close()
        with self._closing:  # not held while it waits: a done callback that submits meanwhile is refused, not stuck
            if self._close_running or not self._unclosed.alive:
                return
            self._closed = self._close_running = True
        try:
            self._close()
            self._unclosed.detach()  # closed: only now, so that an interrupted close leaves the next one its work
        finally:
            with self._closing:
                self._close_running = False


# [Note: a server dropped unclosed]
# A server's driver threads hold its runner, so a server dropped without close() kept its ranks, this process pinned to
# rank 0's cores and the driver's threads until the process exited, silently. Collected, it is closed as a file is,
# with a ResourceWarning (shown under `python -X dev` and pytest): its requests in flight finish first, so a future
# still held gets its result. The close runs in a thread of its own, never where the server was collected: that may
# be one of the server's own threads (which close would wait for) or any allocation of a thread holding the runner's
# lock (the garbage collector runs there). The thread is not a daemon, so the interpreter waits for it at exit before
# it tears anything down ([Note: no thread of ours outlives close]).


def close_when_dropped(server: object, close: Callable[[], None], opened_by: str) -> weakref.finalize:
    """Call ``close`` (which must not hold ``server``) once ``server``, opened by ``opened_by``, is collected unclosed,
    with a :class:`ResourceWarning`; the server detaches it when its own close has finished. Not at exit: the
    runners' own exit hook closes them (moirai.runtime.runner), and a server still referenced then was not dropped."""
    unclosed = weakref.finalize(server, _close_dropped, close, opened_by)
    unclosed.atexit = False
    return unclosed


def _close_dropped(close: Callable[[], None], opened_by: str) -> None:
    """Close a server collected unclosed, in a thread of its own, and say so."""
    try:
        threading.Thread(target=_close_quietly, args=(close,), name="moirai-close-dropped").start()
    except RuntimeError:  # the interpreter is exiting: the runners' exit hook closes them
        return
    warnings.warn(  # after the close started: a warning turned into an error must not leave the server open
        f"a moirai server was dropped without close(): it is closed now (its requests in flight finish first); close "
        f"it with `with {opened_by} as server:` or server.close() to give its processes and cores back when you "
        "choose",
        ResourceWarning,
        stacklevel=1,  # collected, it has no caller to name: the warning names this line
    )


def _close_quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception as error:  # nobody calls this thread: say what went wrong
        _log.warning("closing a server dropped without close() failed: %s", error)


def _arguments(item: Any) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of one item of :meth:`Server.map`."""
    if isinstance(item, dict):
        return (), item
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple) and isinstance(item[1], dict):
        return item
    return (item if isinstance(item, tuple) else (item,)), {}
