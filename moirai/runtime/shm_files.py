"""The files shared memory lives in (:mod:`moirai.runtime.shm`): where they go, how a peer's are opened, how much
room they take, and who owns the spill files.

Files are reserved when made (``posix_fallocate``), so a full ``/dev/shm`` is a
:class:`moirai.DistributedError`, never a SIGBUS on a write into a sparse file. A rank opens what
a peer names only as the peer's private files: the directory owned by this user with mode 0700,
each file opened without following links and checked (owner, type, size) before it is mapped.
Spill files belong to one set of links (:class:`SpillOwner`), which holds a lock file while it
lives: closing removes its own spill files only, and a spill file is another owner's leftover
only when that owner's lock can be taken (its process ended, in any PID namespace). A links directory is emptied
and removed only where it is this user's 0700 folder, opened without following a link: the owner's id is on its
lock file, so another user can plant anything of the name, and it is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import socket
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from moirai.errors import DistributedError
from moirai.files import open_own_folder, ownership_problem

ENV_SWITCH = "MOIRAI_SHARED_MEMORY"
DIR_ENV = "MOIRAI_SHM_DIR"  # where rings and spill files live (default /dev/shm)
_SPILL_PREFIX = "moirai-spill-"  # then the owner's id: "<owner>.lock" while it lives, "<owner>-<uuid>" its files
_LINKS_PREFIX = "moirai-r"  # then "<rank>-<owner>": a rank's directory of rings and FIFOs while its links connect
_LOCK_SUFFIX = ".lock"
# One id per boot of the kernel (a container sees its host's).
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def shm_dir() -> str:
    """Where rings and spill files go: ``MOIRAI_SHM_DIR``, else ``/dev/shm`` where writable, else the temp directory."""
    chosen = os.environ.get(DIR_ENV)
    if chosen:
        return chosen
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def host_identity() -> str:
    """What ranks that can share memory have alike: the hostname, the kernel's boot (two machines, or containers on
    them, may share a hostname) and the shared-memory directory's file system (two containers of one machine with
    their own ``/dev/shm`` have different ones)."""
    try:
        with open(_BOOT_ID_PATH) as boot_id_file:
            boot = boot_id_file.read().strip()
    except OSError:
        boot = "unknown boot"
    return f"{socket.gethostname()}/{boot}/{os.stat(shm_dir()).st_dev}"


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still allocate in ``directory``'s file system."""
    usage = os.statvfs(directory)
    return usage.f_bavail * usage.f_frsize


def free_and_needed_mb(free: int, needed: int) -> tuple[int, int]:
    """Free MB rounded down, needed MB rounded up: a refusal never reads "16 MB free, the run needs 16 MB"."""
    return free // 2**20, -(-needed // 2**20)


def reserve_file(fd: int, size: int, path: str) -> None:
    """Allocate ``size`` bytes of the file now: writing into a sparse file on a full tmpfs kills with SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        free_mb, needed_mb = free_and_needed_mb(free_bytes(os.path.dirname(path)), size)
        raise DistributedError(
            f"{shm_dir()} has {free_mb} MB free, the run needs {needed_mb} MB more for {path}; set {ENV_SWITCH}=0 "
            f"(send through gloo) or enlarge it (e.g. docker --shm-size), or point {DIR_ENV} at a larger tmpfs"
        ) from None


def open_checked(path: str, flags: int, kind: int, min_bytes: int = 0, dir_fd: int | None = None) -> int:
    """``path`` opened without following links, if it is this user's file of type ``kind`` (mode 0600, at least
    ``min_bytes`` long), else OSError: a file a peer names is mapped or written only if it is the run's own."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        problem = ownership_problem(info, 0o077, kind)
        if problem:
            raise PermissionError(f"{path} {problem}")
        if info.st_size < min_bytes:
            raise OSError(f"{path} holds {info.st_size} bytes, fewer than the {min_bytes} announced")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_directory(path: str) -> int:
    """A peer's directory, if it is this user's and no other user can read or write it (none can have put files in
    it)."""
    return open_own_folder(path, forbidden_bits=0o077)


class SpillOwner:
    """One set of links' spill files: named after it, removed when it closes, found dead once its lock is free."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.owner = uuid.uuid4().hex
        path = os.path.join(directory, f"{_SPILL_PREFIX}{self.owner}{_LOCK_SUFFIX}")
        # Locked under a name no sweep looks at, then renamed: a sweep (remove_dead_spill_files, another thread's
        # connect) that saw the lock unlocked between its creation and its flock took it for a dead owner's.
        hidden = os.path.join(directory, f".{_SPILL_PREFIX}{self.owner}{_LOCK_SUFFIX}")
        self._lock_fd: int | None = os.open(
            hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(hidden, path)
        except BaseException:
            os.close(self._lock_fd)
            os.unlink(hidden)
            raise

    def write(self, payload: torch.Tensor) -> str:
        """A new spill file holding ``payload``; its path."""
        path = os.path.join(self.directory, f"{_SPILL_PREFIX}{self.owner}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            reserve_file(fd, max(payload.numel(), 1), path)
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

    def links_directory(self, rank: int) -> str:
        """A new directory (this user's, mode 0700) for rank ``rank``'s rings and FIFOs while its links connect,
        named after this owner: a process killed before it removes the directory leaves it to the next
        :func:`remove_dead_spill_files`, as its spill files."""
        path = os.path.join(self.directory, f"{_LINKS_PREFIX}{rank}-{self.owner}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            # Another user of the directory can read the owner's id off its lock file and take the name first: what
            # they made there (a folder, a link) is never used.
            raise DistributedError(
                f"{path} was there before rank {rank}'s links could make it: another user of {self.directory} took "
                f"the name; have it removed, point {DIR_ENV} at a directory only you can write to, or set "
                f"{ENV_SWITCH}=0 (send through gloo)"
            ) from None
        return path

    def close(self) -> None:
        """Remove this owner's unread spill files and links directory, then its lock file."""
        if self._lock_fd is None:
            return
        _remove_owner_files(self.directory, self.owner)
        os.close(self._lock_fd)
        self._lock_fd = None


def spill_files() -> list[Path]:
    """Spill files not yet read."""
    return sorted(p for p in Path(shm_dir()).glob(f"{_SPILL_PREFIX}*") if not p.name.endswith(_LOCK_SUFFIX))


def remove_dead_spill_files() -> None:
    """Remove the spill files (and links directories) of owners whose lock can be taken: their process ended,
    nobody reads them any more."""
    directory = shm_dir()
    for lock in Path(directory).glob(f"{_SPILL_PREFIX}*{_LOCK_SUFFIX}"):
        try:
            fd = open_checked(str(lock), os.O_RDWR, stat.S_IFREG)
        except OSError:
            continue  # another user's, or gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives (in this process, another one, or another PID namespace)
        finally:
            os.close(fd)
        _remove_owner_files(directory, lock.name[len(_SPILL_PREFIX) : -len(_LOCK_SUFFIX)])


def remove_links_directory(path: str) -> None:
    """Remove a links directory (:meth:`SpillOwner.links_directory`) and its rings and FIFOs, if it is still there
    and this user's folder that no other user can enter; anything else of its name is left alone. A link among its
    entries is removed, not followed."""
    try:
        # Opened without following a link and checked: in /dev/shm another user can plant a link of the name (the
        # owner's id is on its lock file), and emptying what it points to would delete their choice of files.
        dir_fd = open_private_directory(path)
    except OSError:
        return  # gone, or not this user's private folder
    try:
        with contextlib.suppress(OSError):
            for name in os.listdir(dir_fd):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)  # an empty folder only; rmdir never follows a link


def _remove_owner_files(directory: str, owner: str) -> None:
    for path in Path(directory).glob(f"{_SPILL_PREFIX}{owner}-*"):
        with contextlib.suppress(OSError):
            path.unlink()
    for links in Path(directory).glob(f"{_LINKS_PREFIX}*-{owner}"):
        remove_links_directory(str(links))
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, f"{_SPILL_PREFIX}{owner}{_LOCK_SUFFIX}"))


@contextlib.contextmanager
def taken_spill(path: str, nbytes: int) -> Iterator[torch.Tensor]:
    """The ``nbytes`` bytes of the spill file a peer named, mapped while the context lasts; the file is removed at
    once. A path that is no spill file of this directory is a PermissionError: a peer names files, it does not
    choose them."""
    name = os.path.basename(path)
    if os.path.dirname(path) != shm_dir() or not name.startswith(_SPILL_PREFIX) or name.endswith(_LOCK_SUFFIX):
        raise PermissionError(
            f"the peer named {path!r:.200} as a spill file; spill files are {shm_dir()}/{_SPILL_PREFIX}*"
        )
    fd = open_checked(path, os.O_RDWR, stat.S_IFREG, nbytes)
    try:
        os.unlink(path)
        with mmap.mmap(fd, max(nbytes, 1)) as mapped:
            payload = torch.frombuffer(mapped, dtype=torch.uint8)[:nbytes]
            yield payload
            del payload  # the map closes only when no tensor views it
    finally:
        os.close(fd)
