"""Files moirai writes and the files of its own it reads back: never through a symbolic link.

Every file moirai writes (plans, problems, cluster files, the calibration and profile caches) goes through
:func:`write_atomically`: the text goes to a new file of a name nobody can have chosen in the same directory
(``O_CREAT | O_EXCL``, which a link planted there fails), which then replaces the target in one step. A link at the
target's name is replaced, never followed, so a link another user planted in a shared directory (a
``MOIRAI_CACHE_DIR`` on ``/tmp``) cannot make moirai overwrite the file it points to; and a concurrent reader sees
the old file or the new one, never half of one. The caches moirai reads back (:func:`read_own_text`) are opened
without following a link, so none can hand moirai another file's content as its own numbers. Files a user names are
:mod:`moirai.user_files`'s. Plain ``os``: the planning core may use it (it imports no torch).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` in one step, replacing any file or link of that name (OSError as ``open``, naming
    ``path``: never the temporary file, a name the user never gave)."""
    target = Path(path)
    try:
        # Named beside the target through the same path (not made absolute, as mkstemp does): inside another mount
        # namespace a cwd and an absolute path to it can be two mounts, and the rename would fail (EXDEV).
        while True:
            partial = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
            try:
                descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
                break
            except FileExistsError:
                continue
        try:
            with os.fdopen(descriptor, "w") as stream:
                stream.write(text)
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error


def read_own_text(path: str | Path) -> str:
    """The text of a file moirai wrote (a cache), opened without following a link: a link there is an OSError
    (ELOOP), as a missing file is FileNotFoundError."""
    descriptor = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    with os.fdopen(descriptor, encoding="utf-8") as stream:
        return stream.read()


@contextlib.contextmanager
def own_lock_file(path: str | Path):  # noqa: ANN201 - a context manager of a descriptor
    """A lock file of moirai's (created if missing, mode 0600), opened without following a link; its descriptor."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        yield descriptor
    finally:
        os.close(descriptor)
