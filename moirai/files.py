"""Files moirai writes and the files of its own it reads back: never through a symbolic link.

Every file moirai writes (plans, problems, cluster files, the calibration and profile caches) goes through
:func:`write_atomically`: the text goes to a new file of a name nobody can have chosen in the same directory
(``O_CREAT | O_EXCL``, which a link planted there fails), which then replaces the target in one step. A link at the
target's name is replaced, never followed, so a link another user planted in a shared directory (a
``MOIRAI_CACHE_DIR`` on ``/tmp``) cannot make moirai overwrite the file it points to; and a concurrent reader sees
the old file or the new one, never half of one. The caches moirai reads back (:func:`read_own_text`) are opened
without following a link, so none can hand moirai another file's content as its own numbers.

The folders those caches live in (:func:`private_cache_folder`: ``$MOIRAI_CACHE_DIR`` and its ``calibration/`` and
``profiles/``) are made with mode 0700 and used only where they are this user's and no other user can write to
them (:func:`open_own_folder`, which the shared-memory folders use too): a folder another user made first (a name in
``/tmp`` is easy to take) would let them plant numbers moirai plans with, or link the folder elsewhere. Files a user
names are :mod:`moirai.user_files`'s. Plain ``os``: the planning core may use it (it imports no torch).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
import warnings
from pathlib import Path

from moirai.errors import CacheError, MoiraiWarning, user_stacklevel

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_WRITABLE_BY_OTHERS = 0o022
CACHE_DIR_ENV = "MOIRAI_CACHE_DIR"


def write_atomically(path: str | Path, text: str, private: bool = False) -> None:
    """Write ``text`` to ``path`` in one step, replacing any file or link of that name (OSError as ``open``, naming
    ``path``: never the temporary file, a name the user never gave). ``private`` (a cache): mode 0600; else the
    mode of the file of this user's it replaces (a plan the user made private stays so), or 0644 less the umask."""
    target = Path(path)
    kept_mode = None if private else _own_file_mode(target)
    try:
        # Named beside the target through the same path (not made absolute, as mkstemp does): inside another mount
        # namespace a cwd and an absolute path to it can be two mounts, and the rename would fail (EXDEV).
        while True:
            partial = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
                descriptor = os.open(partial, flags, 0o600 if private else 0o644)
                break
            except FileExistsError:
                continue
        try:
            if kept_mode is not None:
                os.fchmod(descriptor, kept_mode)
            with os.fdopen(descriptor, "w", encoding="utf-8") as stream:  # as every reader reads it
                stream.write(text)
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error


def _own_file_mode(path: Path) -> int | None:
    """The permissions of the regular file of this user's at ``path`` (not a link's), or None."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        return None
    return stat.S_IMODE(info.st_mode) & 0o777


def set_aside_corrupt(path: Path, cache: str, fault: str) -> Path:
    """Rename the corrupt cache file ``path`` to ``.corrupt``, with a warning naming ``cache`` (what it is: "the
    profile cache") and its ``fault``, so that what it held is measured again and the file can still be read; the
    new path. The one way every cache of measurements sets a corrupt file aside."""
    corrupt = path.with_suffix(".corrupt")
    os.replace(path, corrupt)
    warnings.warn(
        f"{cache} {path} was corrupt ({fault}); it was moved to {corrupt} and what it held is measured again",
        MoiraiWarning,
        stacklevel=user_stacklevel(),
    )
    return corrupt


def read_own_text(path: str | Path) -> str:
    """The text of a file moirai wrote (a cache), opened without following a link: a link there is an OSError
    (ELOOP), as a missing file is FileNotFoundError and a file that is not a regular one (a FIFO) EINVAL."""
    return read_regular_text(path, follow_links=False)


def read_regular_text(path: str | os.PathLike[str], *, follow_links: bool) -> str:
    """The UTF-8 text of the file at ``path``, checked to be a regular file (``fstat`` of the file opened, without
    blocking: a FIFO would hang the open, and ``/dev/zero`` be read until memory runs out) before a byte is read.
    Else an OSError as ``open`` raises them (a folder: IsADirectoryError, a FIFO: EINVAL), whose ``strerror`` says
    what the path is and what to give."""
    flags = os.O_RDONLY | _CLOEXEC | getattr(os, "O_NONBLOCK", 0) | (0 if follow_links else _NOFOLLOW)
    descriptor = os.open(path, flags)
    try:
        mode = os.fstat(descriptor).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "it is a folder; give the path of a file", str(path))
        if not stat.S_ISREG(mode):
            raise OSError(
                errno.EINVAL,
                "it is not a regular file (a device, a pipe or a socket, which would be read without end); give the "
                "path of a file",
                str(path),
            )
        os.set_blocking(descriptor, True)
        stream = os.fdopen(descriptor, encoding="utf-8")
    except BaseException:
        os.close(descriptor)
        raise
    with stream:
        return stream.read()


@contextlib.contextmanager
def own_lock_file(path: str | Path):  # noqa: ANN201 - a context manager of a descriptor
    """A lock file of moirai's (created if missing, mode 0600), opened without following a link; its descriptor."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        yield descriptor
    finally:
        os.close(descriptor)


def lock_exclusively(descriptor: int, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Take an exclusive ``flock`` on ``descriptor`` within ``timeout_s``; whether it was taken (POSIX)."""
    import fcntl

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def lock_holders(descriptor: int) -> list[int]:
    """The processes holding a ``flock`` on the file of ``descriptor``, as Linux's /proc/locks names them (none
    elsewhere, or where they run in another PID namespace)."""
    info = os.fstat(descriptor)
    file_id = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return []
    # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's line has "->" after the number.
    holders = [line.split() for line in lines if "->" not in line]
    return [int(fields[4]) for fields in holders if len(fields) > 5 and fields[5] == file_id and fields[4] != "0"]


def open_own_folder(path: str | Path, forbidden_bits: int = _WRITABLE_BY_OTHERS, tighten: bool = False) -> int:
    """A descriptor of the folder ``path``, opened without following a link, if it is this user's and its mode has
    none of ``forbidden_bits`` (by default: no other user can write to it; 0o077: nor read it); else
    PermissionError saying which. ``tighten``: a folder of this user's with such bits loses them instead (``fchmod``
    of the folder opened, so no other can be swapped in), as an older moirai made its caches under umask 002."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise PermissionError(f"{path} is a symbolic link, which moirai does not follow here") from None
        raise
    info = os.fstat(descriptor)
    problem = ownership_problem(info, forbidden_bits)
    if problem and tighten and info.st_uid == os.getuid():
        try:
            os.fchmod(descriptor, stat.S_IMODE(info.st_mode) & ~forbidden_bits)
            problem = None
        except OSError:
            pass
    if problem:
        os.close(descriptor)
        raise PermissionError(f"{path} {problem}")
    return descriptor


def ownership_problem(info: os.stat_result, forbidden_bits: int, kind: int = stat.S_IFDIR) -> str | None:
    """What makes the file ``info`` describes unfit for moirai to trust (another user's, not of type ``kind``, a
    mode with any of ``forbidden_bits``), or None: for its folders and the shared-memory files a peer names."""
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_IFMT(info.st_mode) != kind:
        return f"is not a {'folder' if kind == stat.S_IFDIR else f'file of type {stat.filemode(kind)[0]}'}"
    if info.st_uid != os.getuid():
        return f"belongs to user {info.st_uid}, not to this user ({os.getuid()})"
    bits = mode & forbidden_bits
    if bits:
        who = " and ".join(w for w, mask in (("its group", 0o070), ("other users", 0o007)) if bits & mask)
        can = "write to" if bits & 0o022 else "read" if bits & 0o044 else "enter"
        return f"has mode {mode:o}: {who} can {can} it"
    return None


def default_cache_dir() -> Path:
    """The root of moirai's caches (measured profiles, calibrations): ``$MOIRAI_CACHE_DIR``, else
    ``~/.cache/moirai``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "moirai")


def private_cache_folder(root: str | Path, name: str) -> Path:
    """The cache folder ``root/name``: ``root`` and it made (mode 0700) where missing and checked, each this user's
    and no link (:func:`open_own_folder`; one of this user's that others can write to, as an older moirai made them
    under umask 002, loses those bits); else :class:`moirai.CacheError` naming the folder."""
    folder = Path(root) / name
    try:
        Path(root).parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _unusable(Path(root).parent, "cannot be made", error) from None
    for path in (Path(root), folder):
        _make_folder(path)
        try:
            os.close(open_own_folder(path, tighten=True))
        except PermissionError as error:
            if error.errno is not None:  # the system's refusal (no access), not one of open_own_folder's
                raise _unusable(path, "cannot be opened", error) from None
            raise CacheError(
                f"the cache folder {error}; moirai keeps its measurements only in folders of yours that no other "
                f"user can write to (another could plant the numbers it plans with): remove it (moirai makes it "
                f"again, mode 0700), make it yours (chown) or set {CACHE_DIR_ENV} to a folder of your own"
            ) from None
        except OSError as error:
            words = "is not a folder" if error.errno == errno.ENOTDIR else "cannot be opened"
            raise _unusable(path, words, error) from None
    return folder


def _unusable(path: Path, words: str, error: OSError) -> CacheError:
    return CacheError(
        f"the cache folder {path} {words} ({error.strerror}); set {CACHE_DIR_ENV} to a folder you can write to"
    )


def _make_folder(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise _unusable(path, "cannot be made", error) from None
