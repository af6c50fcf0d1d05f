"""Messages between ranks of one host through shared memory: a ring and a FIFO per ordered pair of ranks.

gloo carries every message over a loopback TCP socket in three steps (the sender's notice, the
receiver's notice, the payload), each waking the peer's I/O thread; a rank paid 0.2-0.6 ms of CPU
per message on a shared core (bench/RESULTS.md). Here a message is one copy into the receiver's
ring (a file in ``/dev/shm`` both ranks map) and one byte written to the receiver's FIFO, which
only costs a wake-up when the receiver is blocked on it. The receiver copies the payload out when
it waits for the message, so no thread works in the background.

Messages are matched by tag, as gloo's are: a waiter reads the messages ahead of its own and keeps
them for their waiters, one reader at a time per ring (:class:`_Inbound`). A message too large for
half a ring, or that finds the ring full, goes in a file of its own whose path travels in the ring.
A peer that exits closes its end of the FIFO, so a rank waiting on it fails at once; a wait also
ends at its time limit. Send and receive return objects with gloo's ``wait(timeout)``.

Set ``MOIRAI_SHARED_MEMORY=0`` to send through gloo instead (to compare, or where ``/dev/shm`` is
too small), ``MOIRAI_SHM_DIR`` to keep the files elsewhere (a tmpfs of your own).

The files (where they go, how a peer's are opened and checked, the room they take, who owns the
spill files) are :mod:`moirai.runtime.shm_files`'s; a full ``/dev/shm`` is a
:class:`moirai.DistributedError` (:func:`moirai.runtime.shm_files.reserve_file`); what a run will need is
:func:`room_shortfall`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import mmap
import os
import select
import stat
import struct
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

import torch

from moirai.runtime import shm_files
from moirai.runtime.shm_files import DIR_ENV, ENV_SWITCH  # noqa: F401  (DIR_ENV: named as shm's by its users)
from moirai.runtime.store import get_json

RING_BYTES = 8 << 20  # per ordered pair of ranks; larger messages go in files of their own
_CONTROL_BYTES = 64  # the ring file's head: the receiver's consumed count (int64)
_ALIGN = 64
_RECORD = struct.Struct("<qqqq")  # tag, payload bytes, kind, length of a spill file's path
_INLINE, _WRAP, _SPILL = 0, 1, 2
_FULL_RING_POLL_S = 0.0005


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def host_transport() -> str:
    """What carries host-memory messages between ranks of one host, for people to read."""
    return "shared memory" if enabled() else "gloo"


class _Done:
    """A send: complete once its bytes are in the ring."""

    complete_when_posted = True  # nothing to wait for (Messages keeps no record of it)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True


class _Receive:
    def __init__(self, inbound: _Inbound, tag: int, buffer: torch.Tensor) -> None:
        self._inbound, self._tag = inbound, tag
        inbound.post(tag, buffer)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._inbound.wait(self._tag, None if timeout is None else timeout.total_seconds())
        return True


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # A one-element tensor may carry any stride (a [1, 1] slice of a wider tensor); it is dense all the same.
        flat = flat.as_strided((flat.numel(),), (1,))
    elif flat.stride(0) != 1:
        flat = flat.contiguous()
    return flat.view(torch.uint8)


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def ring_file_bytes() -> int:
    return _CONTROL_BYTES + RING_BYTES


def spills(nbytes: int) -> bool:
    """Whether a message of ``nbytes`` bytes always goes in a spill file of its own (too large for half a ring)."""
    return _aligned(_RECORD.size + nbytes) > RING_BYTES // 2


def room_shortfall(
    message_bytes: Sequence[int],
    world_size: int = 0,
    needing: str = "the plan",
    spilled: str = "to load the parts",
    taken_bytes: int = 0,
) -> str | None:
    """Why the shared-memory directory cannot hold the rings of a world of ``world_size`` ranks (0: they exist) and
    a spill file for each of ``message_bytes`` that spills, all at once (what ``needing`` needs, the spill files
    ``spilled``), beside ``taken_bytes`` that others will write and are not written yet; None where it can."""
    directory = shm_files.shm_dir()
    rings = world_size * (world_size - 1) * ring_file_bytes()
    spilled_bytes = sum(nbytes for nbytes in message_bytes if spills(nbytes))
    free = max(0, shm_files.free_bytes(directory) - taken_bytes)
    if free >= rings + spilled_bytes:
        return None
    free_mb, needed_mb = shm_files.free_and_needed_mb(free, rings + spilled_bytes)
    parts = [f"{-(-rings // 2**20)} MB for the rings of {world_size} ranks"] if rings else []
    parts += [f"{-(-spilled_bytes // 2**20)} MB {spilled}"] if spilled_bytes else []
    return f"{directory} has {free_mb} MB free, {needing} needs {needed_mb} MB ({', '.join(parts)})"


class _Ring:
    """A ring file mapped by its sender and its receiver; offsets grow forever, positions wrap."""

    def __init__(self, path: str, create: bool, dir_fd: int | None = None) -> None:
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        else:
            fd = shm_files.open_checked(path, os.O_RDWR, stat.S_IFREG, ring_file_bytes(), dir_fd)
        try:
            if create:
                shm_files.reserve_file(fd, ring_file_bytes(), path)
            self._map = mmap.mmap(fd, _CONTROL_BYTES + RING_BYTES)
        finally:
            os.close(fd)
        # Made in whichever thread connects (under torchrun the caller's, maybe inside torch.inference_mode) and
        # written by the driver's threads: never an inference tensor, which those could not write.
        with torch.inference_mode(False):
            self.data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_CONTROL_BYTES)

    @property
    def consumed(self) -> int:
        return struct.unpack_from("<q", self._map, 0)[0]

    @consumed.setter
    def consumed(self, value: int) -> None:
        struct.pack_into("<q", self._map, 0, value)

    def write_record(self, position: int, tag: int, nbytes: int, kind: int, extra: int = 0) -> None:
        _RECORD.pack_into(self._map, _CONTROL_BYTES + position, tag, nbytes, kind, extra)

    def read_record(self, position: int) -> tuple[int, int, int, int]:
        return _RECORD.unpack_from(self._map, _CONTROL_BYTES + position)


class _Outbound:
    """This rank's messages to one peer: records in the peer's ring, a byte per message in its FIFO."""

    def __init__(self, ring: _Ring, fifo_fd: int, spills: shm_files.SpillOwner) -> None:
        self._ring, self._fifo, self._spills = ring, fifo_fd, spills
        self._produced = 0
        # Guards the ring's write position and the FIFO's descriptor: a send never writes to a descriptor that
        # close() has given back (the number may already name another file of this process).
        self._lock = threading.Lock()
        self._closed = False

    def send(self, tensor: torch.Tensor, tag: int, timeout_s: float) -> None:
        payload = _bytes_of(tensor)
        nbytes = payload.numel()
        with self._lock:
            if self._closed:
                raise ConnectionError("this rank's links were closed")
            if _aligned(_RECORD.size + nbytes) <= RING_BYTES // 2 and self._reserve(_RECORD.size + nbytes, None):
                position = self._produced % RING_BYTES
                self._ring.write_record(position, tag, nbytes, _INLINE)
                start = position + _RECORD.size
                self._ring.data[start : start + nbytes].copy_(payload)
                self._produced += _aligned(_RECORD.size + nbytes)
            else:
                path = self._spills.write(payload).encode()
                self._reserve(_RECORD.size + len(path), time.monotonic() + timeout_s)
                position = self._produced % RING_BYTES
                self._ring.write_record(position, tag, nbytes, _SPILL, len(path))
                start = position + _RECORD.size
                self._ring.data[start : start + len(path)].copy_(torch.frombuffer(bytearray(path), dtype=torch.uint8))
                self._produced += _aligned(_RECORD.size + len(path))
            os.write(self._fifo, b"\0")

    def _reserve(self, size: int, deadline: float | None) -> bool:
        """Room for a record of ``size`` bytes at the write position, wrapping to the start if needed; with no
        ``deadline``, False when there is none now, else wait for the receiver to make room until then."""
        size = _aligned(size)
        while True:
            to_end = RING_BYTES - self._produced % RING_BYTES
            needed = size + (to_end if to_end < size else 0)
            if RING_BYTES - (self._produced - self._ring.consumed) >= needed:
                if to_end < size:
                    self._ring.write_record(self._produced % RING_BYTES, 0, 0, _WRAP)
                    self._produced += to_end
                return True
            if deadline is None:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"the receiver's ring stayed full ({RING_BYTES} bytes unread)")
            time.sleep(_FULL_RING_POLL_S)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(OSError):
                    os.close(self._fifo)


class _Inbound:
    """One peer's messages to this rank. Waiters take turns reading the ring; a message read for another
    waiter goes into that waiter's posted buffer, or is kept until its receive is posted."""

    def __init__(self, ring: _Ring, fifo_fd: int) -> None:
        self._ring, self._fifo = ring, fifo_fd
        self._consumed = 0
        self._unread = 0  # messages announced on the FIFO and not yet read
        self._cond = threading.Condition()
        self._reading = False
        self._posted: dict[int, torch.Tensor] = {}
        self._kept: dict[int, torch.Tensor] = {}
        self._filled: set[int] = set()
        self._closed: str | None = None
        # close() wakes a reader waiting on the FIFO through this pipe and leaves the descriptors to it: closed
        # under a select, a descriptor's number could be reused by another file before the select returns.
        self._wake_read, self._wake_write = os.pipe()
        self._descriptors_open = True

    def close(self) -> None:
        with self._cond:
            if self._closed is None:
                self._closed = "this rank's links were closed"
            if not self._descriptors_open:
                return
            if self._reading:
                with contextlib.suppress(OSError):
                    os.write(self._wake_write, b"\0")
            else:
                self._close_descriptors()

    def _close_descriptors(self) -> None:
        """Called holding the condition, by close() or by the reader that close() woke."""
        if self._descriptors_open:
            self._descriptors_open = False
            for fd in (self._fifo, self._wake_read, self._wake_write):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def post(self, tag: int, buffer: torch.Tensor) -> None:
        with self._cond:
            kept = self._kept.pop(tag, None)
            if kept is None:
                self._posted[tag] = buffer
            else:
                self._fill(tag, buffer, kept)

    def wait(self, tag: int, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while tag not in self._filled:
                if self._closed is not None:
                    raise ConnectionError(self._closed)
                remaining_s = None if deadline is None else deadline - time.monotonic()
                if remaining_s is not None and remaining_s <= 0:
                    raise TimeoutError(f"Timed out after {timeout_s:.3g} s waiting for the message with tag {tag}")
                if self._reading:
                    self._cond.wait(remaining_s)
                    continue
                self._reading = True
                try:
                    self._read_one(deadline)
                finally:
                    self._reading = False
                    if self._closed is not None:
                        self._close_descriptors()
                    self._cond.notify_all()
            self._filled.discard(tag)

    def _read_one(self, deadline: float | None) -> None:
        """Read the next message (called holding the condition, which the wait for the FIFO releases)."""
        if self._unread == 0:
            self._cond.release()
            try:
                announced = self._wait_fifo(deadline)
            finally:
                self._cond.acquire()
            if not announced:  # the deadline passed, or a spurious wake-up
                return
            self._unread += announced
        self._unread -= 1
        while True:
            position = self._consumed % RING_BYTES
            tag, nbytes, kind, extra = self._ring.read_record(position)
            if kind != _WRAP:
                break
            self._consumed += RING_BYTES - position
        start = position + _RECORD.size
        if kind == _INLINE:
            self._deliver(tag, self._ring.data[start : start + nbytes])
            self._consumed += _aligned(_RECORD.size + nbytes)
        else:
            path = bytes(self._ring.data[start : start + extra].numpy()).decode()
            self._consumed += _aligned(_RECORD.size + extra)
            self._deliver_spilled(tag, path, nbytes)
        self._ring.consumed = self._consumed

    def _wait_fifo(self, deadline: float | None) -> int | None:
        """Messages announced since the last read (0 or None: none now, or none before the deadline); a closed
        FIFO closes this."""
        remaining_s = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        readable, _, _ = select.select([self._fifo, self._wake_read], [], [], remaining_s)
        if not readable or self._wake_read in readable:  # the deadline, or close(): the wait's loop finds it closed
            return None
        try:
            announced = os.read(self._fifo, 1 << 16)
        except BlockingIOError:
            return 0
        if not announced:
            self._closed = "the peer closed its connection (its process ended)"
            raise ConnectionError(self._closed)
        return len(announced)

    def _deliver(self, tag: int, payload: torch.Tensor) -> None:
        buffer = self._posted.pop(tag, None)
        if buffer is None:
            self._kept[tag] = payload.clone()
        else:
            self._fill(tag, buffer, payload)

    def _deliver_spilled(self, tag: int, path: str, nbytes: int) -> None:
        with shm_files.taken_spill(path, nbytes) as payload:
            self._deliver(tag, payload)

    def _fill(self, tag: int, buffer: torch.Tensor, payload: torch.Tensor) -> None:
        target = _bytes_of(buffer)
        if target.numel() != payload.numel():
            raise ValueError(
                f"message with tag {tag} has {payload.numel()} bytes; its receive expects {target.numel()}"
            )
        target.copy_(payload)
        self._filled.add(tag)


class SharedMemoryLinks:
    """This rank's shared-memory links to the ranks of its host, with a process group's send/recv.

    A send waits for room in a full ring at most ``timeout_s``.
    """

    def __init__(
        self,
        outbound: dict[int, _Outbound],
        inbound: dict[int, _Inbound],
        timeout_s: float,
        spills: shm_files.SpillOwner,
    ) -> None:
        self._outbound, self._inbound, self._timeout_s, self._spills = outbound, inbound, timeout_s, spills
        self.peers = frozenset(outbound) & frozenset(inbound)

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> _Done:
        (tensor,) = tensors
        self._outbound[dst].send(tensor, tag, self._timeout_s)
        return _Done()

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int) -> _Receive:
        (buffer,) = tensors
        return _Receive(self._inbound[src], tag, buffer)

    def close(self) -> None:
        """Close the FIFOs: a peer still waiting on this rank then fails at once."""
        for link in [*self._outbound.values(), *self._inbound.values()]:
            link.close()
        self._spills.close()


def connect(
    rank: int, world_size: int, store: Any, timeout_s: float, prefix: str, neighbours: Collection[int] | None = None
) -> SharedMemoryLinks | None:
    """Links to every rank of this host that makes them too (a collective: every rank calls it), or None when off.

    ``neighbours``: the ranks the plan and the launcher put on this rank's host (None: any); a rank outside them
    keeps gloo even where it shares this machine. Ranks are on one host only where their
    :func:`shm_files.host_identity` (hostname, boot, the shared-memory directory's file system) is the same.

    Each rank makes a ring and a FIFO for each peer to write to, publishes where they are under
    ``prefix`` in ``store``, opens its peers' and removes its own files once every peer has opened
    them (so nothing is left behind, whatever happens to the run); a rank killed before that leaves its
    directory to the next connect on this host (it is named after the links' spill owner, whose lock dies with
    it). A pair whose ends do not both open (other hosts, other ``/dev/shm``s) keeps gloo.
    """
    if not enabled():
        return None
    shm_files.remove_dead_spill_files()
    host = shm_files.host_identity()
    spills = shm_files.SpillOwner(shm_files.shm_dir())
    try:
        directory = spills.links_directory(rank)
    except BaseException:
        spills.close()  # its lock file goes, not left held until the process ends
        raise
    peers = [k for k in range(world_size) if k != rank]
    rings: dict[int, _Ring] = {}
    fifos: dict[int, int] = {}
    try:
        for peer in peers:
            os.mkfifo(os.path.join(directory, f"fifo-{peer}"), 0o600)
            fifos[peer] = os.open(os.path.join(directory, f"fifo-{peer}"), os.O_RDONLY | os.O_NONBLOCK)
            rings[peer] = _Ring(os.path.join(directory, f"ring-{peer}"), create=True)
        store.set(f"{prefix}/{rank}/where", json.dumps({"host": host, "directory": directory}))
        outbound = {}
        for peer in peers:
            where = _where(store, f"{prefix}/{peer}/where", timeout_s)
            if where["host"] != host or (neighbours is not None and peer not in neighbours):
                continue
            with contextlib.suppress(OSError):
                outbound[peer] = _open_outbound(where["directory"], rank, spills)
        store.set(f"{prefix}/{rank}/opened", json.dumps(sorted(outbound)))
        inbound = {}
        for peer in peers:
            if rank in _opened(store, f"{prefix}/{peer}/opened", world_size, timeout_s):
                inbound[peer] = _Inbound(rings[peer], fifos[peer])
        for peer in peers:
            if peer not in inbound:
                os.close(fifos[peer])
        for peer in set(outbound) - set(inbound):
            outbound.pop(peer).close()
        return SharedMemoryLinks(outbound, inbound, timeout_s, spills)
    except BaseException:
        spills.close()
        raise
    finally:
        shm_files.remove_links_directory(directory)


def _open_outbound(directory: str, rank: int, spills: shm_files.SpillOwner) -> _Outbound:
    """This rank's end of the ring and FIFO a peer made for it in ``directory`` (checked: the peer's own files)."""
    dir_fd = shm_files.open_private_directory(directory)
    try:
        ring = _Ring(f"ring-{rank}", create=False, dir_fd=dir_fd)
        fd = shm_files.open_checked(f"fifo-{rank}", os.O_WRONLY | os.O_NONBLOCK, stat.S_IFIFO, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    os.set_blocking(fd, True)
    return _Outbound(ring, fd, spills)


def _where(store: Any, key: str, timeout_s: float) -> dict[str, str]:
    def valid(where: Any) -> bool:
        return (
            isinstance(where, dict)
            and isinstance(where.get("host"), str)
            and isinstance(where.get("directory"), str)
            and os.path.isabs(where["directory"])
        )

    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return get_json(store, key, "shared-memory address", valid, '{"host": a string, "directory": an absolute path}')


def _opened(store: Any, key: str, world_size: int, timeout_s: float) -> list[int]:
    def valid(opened: Any) -> bool:
        return isinstance(opened, list) and all(type(k) is int and 0 <= k < world_size for k in opened)

    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return get_json(store, key, f"list of ranks 0..{world_size - 1}", valid)
