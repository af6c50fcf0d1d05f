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

Files are reserved when made (``posix_fallocate``), so a full ``/dev/shm`` is a
:class:`moirai.DistributedError` (at start: :func:`check_space`), never a SIGBUS on a write into
a sparse file. A rank opens what a peer names only as the peer's private files: the directory
owned by this user with mode 0700, each file opened without following links and checked (owner,
type, size) before it is mapped. Spill files belong to one set of links (:class:`_SpillOwner`),
which holds a lock file while it lives: closing removes its own spill files only, and a spill file
is another owner's leftover only when that owner's lock can be taken (its process ended, in any
PID namespace).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import mmap
import os
import select
import socket
import stat
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moirai.errors import DistributedError

RING_BYTES = 8 << 20  # per ordered pair of ranks; larger messages go in files of their own
ENV_SWITCH = "MOIRAI_SHARED_MEMORY"
DIR_ENV = "MOIRAI_SHM_DIR"  # where rings and spill files live (default /dev/shm)
_CONTROL_BYTES = 64  # the ring file's head: the receiver's consumed count (int64)
_ALIGN = 64
_RECORD = struct.Struct("<qqqq")  # tag, payload bytes, kind, length of a spill file's path
_INLINE, _WRAP, _SPILL = 0, 1, 2
_FULL_RING_POLL_S = 0.0005
_SPILL_PREFIX = "moirai-spill-"  # then the owner's id: "<owner>.lock" while it lives, "<owner>-<uuid>" its files
_LOCK_SUFFIX = ".lock"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def host_transport() -> str:
    """What carries host-memory messages between ranks of one host, for people to read."""
    return "shared memory" if enabled() else "gloo"


class _Done:
    """A send: complete once its bytes are in the ring."""

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
    return tensor.reshape(-1).view(torch.uint8)


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _shm_dir() -> str:
    chosen = os.environ.get(DIR_ENV)
    if chosen:
        return chosen
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def ring_file_bytes() -> int:
    return _CONTROL_BYTES + RING_BYTES


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still allocate in ``directory``'s file system."""
    usage = os.statvfs(directory)
    return usage.f_bavail * usage.f_frsize


def check_space(world_size: int) -> None:
    """:class:`moirai.DistributedError` unless the shared-memory directory holds every ring of a world of this size."""
    directory = _shm_dir()
    needed = world_size * (world_size - 1) * ring_file_bytes()
    free = free_bytes(directory)
    if free < needed:
        raise DistributedError(
            f"{directory} has {free / 2**20:.0f} MB free, the plan needs {needed / 2**20:.0f} MB for the shared-memory "
            f"rings of {world_size} ranks; set {ENV_SWITCH}=0 (send through gloo) or enlarge {directory} (e.g. docker "
            f"--shm-size), or point {DIR_ENV} at a larger tmpfs"
        )


def _reserve_file(fd: int, size: int, path: str) -> None:
    """Allocate ``size`` bytes of the file now: writing into a sparse file on a full tmpfs kills with SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise DistributedError(
            f"{_shm_dir()} has {free_bytes(os.path.dirname(path)) / 2**20:.0f} MB free, the run needs "
            f"{size / 2**20:.0f} MB more for {path}; set {ENV_SWITCH}=0 (send through gloo) or enlarge it (e.g. docker "
            f"--shm-size), or point {DIR_ENV} at a larger tmpfs"
        ) from None


def _open_checked(path: str, flags: int, kind: int, min_bytes: int = 0, dir_fd: int | None = None) -> int:
    """``path`` opened without following links, if it is this user's file of type ``kind`` (mode 0600, at least
    ``min_bytes`` long), else OSError: a file a peer names is mapped or written only if it is the run's own."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or stat.S_IFMT(info.st_mode) != kind or info.st_mode & 0o077:
            raise PermissionError(f"{path} is not this user's private {stat.filemode(kind)[0]} file")
        if info.st_size < min_bytes:
            raise OSError(f"{path} holds {info.st_size} bytes, fewer than the {min_bytes} announced")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_private_directory(path: str) -> int:
    """A peer's directory, if it is this user's with mode 0700 (no other user can have put files in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) != 0o700:
        os.close(fd)
        raise PermissionError(
            f"{path} is not this user's private directory (owner {info.st_uid}, mode {info.st_mode:o})"
        )
    return fd


class _Ring:
    """A ring file mapped by its sender and its receiver; offsets grow forever, positions wrap."""

    def __init__(self, path: str, create: bool, dir_fd: int | None = None) -> None:
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        else:
            fd = _open_checked(path, os.O_RDWR, stat.S_IFREG, ring_file_bytes(), dir_fd)
        try:
            if create:
                _reserve_file(fd, ring_file_bytes(), path)
            self._map = mmap.mmap(fd, _CONTROL_BYTES + RING_BYTES)
        finally:
            os.close(fd)
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

    def __init__(self, ring: _Ring, fifo_fd: int, spills: _SpillOwner) -> None:
        self._ring, self._fifo, self._spills = ring, fifo_fd, spills
        self._produced = 0
        self._lock = threading.Lock()

    def send(self, tensor: torch.Tensor, tag: int, timeout_s: float) -> None:
        payload = _bytes_of(tensor)
        nbytes = payload.numel()
        with self._lock:
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
        with self._lock, contextlib.suppress(OSError):
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

    def close(self) -> None:
        with self._cond, contextlib.suppress(OSError):
            self._closed = "this rank's links were closed"
            os.close(self._fifo)

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
        readable, _, _ = select.select([self._fifo], [], [], remaining_s)
        if not readable:
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
        name = os.path.basename(path)
        if os.path.dirname(path) != _shm_dir() or not name.startswith(_SPILL_PREFIX) or name.endswith(_LOCK_SUFFIX):
            raise PermissionError(
                f"the peer named {path!r:.200} as a spill file; spill files are {_shm_dir()}/{_SPILL_PREFIX}*"
            )
        fd = _open_checked(path, os.O_RDWR, stat.S_IFREG, nbytes)
        try:
            os.unlink(path)
            with mmap.mmap(fd, max(nbytes, 1)) as mapped:
                payload = torch.frombuffer(mapped, dtype=torch.uint8)[:nbytes]
                self._deliver(tag, payload)
                del payload  # the map closes only when no tensor views it
        finally:
            os.close(fd)

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
        self, outbound: dict[int, _Outbound], inbound: dict[int, _Inbound], timeout_s: float, spills: _SpillOwner
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


def connect(rank: int, world_size: int, store: Any, timeout_s: float, prefix: str) -> SharedMemoryLinks | None:
    """Links to every rank of this host that makes them too (a collective: every rank calls it), or None when off.

    Each rank makes a ring and a FIFO for each peer to write to, publishes where they are under
    ``prefix`` in ``store``, opens its peers' and removes its own files once every peer has opened
    them (so nothing is left behind, whatever happens to the run). A pair whose ends do not both
    open (other hosts, other ``/dev/shm``s) keeps gloo.
    """
    if not enabled():
        return None
    remove_dead_spill_files()
    host = socket.gethostname()
    spills = _SpillOwner(_shm_dir())
    directory = tempfile.mkdtemp(prefix=f"moirai-r{rank}-", dir=_shm_dir())  # mode 0700, this user's
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
            if where["host"] != host:
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
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def _get(store: Any, key: str, timeout_s: float) -> str:
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return store.get(key).decode()


def _open_outbound(directory: str, rank: int, spills: _SpillOwner) -> _Outbound:
    """This rank's end of the ring and FIFO a peer made for it in ``directory`` (checked: the peer's own files)."""
    dir_fd = _open_private_directory(directory)
    try:
        ring = _Ring(f"ring-{rank}", create=False, dir_fd=dir_fd)
        fd = _open_checked(f"fifo-{rank}", os.O_WRONLY | os.O_NONBLOCK, stat.S_IFIFO, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    os.set_blocking(fd, True)
    return _Outbound(ring, fd, spills)


def _where(store: Any, key: str, timeout_s: float) -> dict[str, str]:
    where = _json(store, key, timeout_s)
    if not (
        isinstance(where, dict)
        and isinstance(where.get("host"), str)
        and isinstance(where.get("directory"), str)
        and os.path.isabs(where["directory"])
    ):
        raise DistributedError(f"store key {key!r} holds no shared-memory address: {where!r:.120}")
    return where


def _opened(store: Any, key: str, world_size: int, timeout_s: float) -> list[int]:
    opened = _json(store, key, timeout_s)
    if not (isinstance(opened, list) and all(type(k) is int and 0 <= k < world_size for k in opened)):
        raise DistributedError(f"store key {key!r} holds no list of ranks 0..{world_size - 1}: {opened!r:.120}")
    return opened


def _json(store: Any, key: str, timeout_s: float) -> Any:
    try:
        return json.loads(_get(store, key, timeout_s))
    except ValueError:
        raise DistributedError(f"store key {key!r} holds no JSON") from None


def _get(store: Any, key: str, timeout_s: float) -> str:
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return store.get(key).decode()


class _SpillOwner:
    """One set of links' spill files: named after it, removed when it closes, found dead once its lock is free."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.owner = uuid.uuid4().hex
        path = os.path.join(directory, f"{_SPILL_PREFIX}{self.owner}{_LOCK_SUFFIX}")
        self._lock_fd: int | None = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def write(self, payload: torch.Tensor) -> str:
        """A new spill file holding ``payload``; its path."""
        path = os.path.join(self.directory, f"{_SPILL_PREFIX}{self.owner}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _reserve_file(fd, max(payload.numel(), 1), path)
            with mmap.mmap(fd, max(payload.numel(), 1)) as mapped:
                view = torch.frombuffer(mapped, dtype=torch.uint8)
                view[: payload.numel()].copy_(payload)
                del view
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return path

    def close(self) -> None:
        """Remove this owner's unread spill files, then its lock file."""
        if self._lock_fd is None:
            return
        _remove_owner_files(self.directory, self.owner)
        os.close(self._lock_fd)
        self._lock_fd = None


def spill_files() -> list[Path]:
    """Spill files not yet read."""
    return sorted(p for p in Path(_shm_dir()).glob(f"{_SPILL_PREFIX}*") if not p.name.endswith(_LOCK_SUFFIX))


def remove_dead_spill_files() -> None:
    """Remove the spill files of owners whose lock can be taken: their process ended, nobody reads them any more."""
    directory = _shm_dir()
    for lock in Path(directory).glob(f"{_SPILL_PREFIX}*{_LOCK_SUFFIX}"):
        try:
            fd = _open_checked(str(lock), os.O_RDWR, stat.S_IFREG)
        except OSError:
            continue  # another user's, or gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives (in this process, another one, or another PID namespace)
        finally:
            os.close(fd)
        _remove_owner_files(directory, lock.name[len(_SPILL_PREFIX) : -len(_LOCK_SUFFIX)])


def _remove_owner_files(directory: str, owner: str) -> None:
    for path in Path(directory).glob(f"{_SPILL_PREFIX}{owner}-*"):
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, f"{_SPILL_PREFIX}{owner}{_LOCK_SUFFIX}"))
