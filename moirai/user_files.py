"""Files a user names: reading what they hold and checking where moirai is to write, each fault the reader's or
writer's own moirai error naming the file and saying what to do, never a Python error.

:func:`parsing` guards the reading and parsing of a JSON or TOML file (problems, cluster files, calibrations, fusion
rules): text that is not UTF-8, arrays nested deeper than the parser recurses, an integer of more digits than Python
converts and text that is not the language are each one error of the reader's type naming the file;
:func:`load_json` parses a JSON file's text, refusing a number literal too large for a float (Python's json reads
``1e400`` as Infinity). :func:`read_text` reads a file a user names, refusing one that is no regular file (a FIFO,
``/dev/zero``) before reading it; each reader says what a missing file means (a calibration, read without following
a link, is read as moirai's caches are: :func:`moirai.files.read_own_text`).
:func:`check_input_path` checks that a file to read is named by a path (not a file descriptor, bytes or None).
:func:`check_output_path` checks, before any work, that a file can be written where the user asked, and
:func:`write_output` writes it there (:func:`moirai.files.write_atomically`) with the writer's error. Plain ``os``
and the standard parsers: the planning core may use it (it imports no torch).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from moirai.errors import MoiraiError
from moirai.files import read_regular_text, write_atomically

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# What a file of each language nests: what the message for one nested too deeply names.
_CONTAINERS = {"JSON": "arrays or objects", "TOML": "arrays or tables"}


@contextlib.contextmanager
def parsing(language: str, subject: str, error: Callable[[str], MoiraiError]) -> Iterator[None]:
    """Inside, read and parse a ``language`` file (``"JSON"`` or ``"TOML"``): whatever its text makes the decoder or
    parser raise becomes ``error(f"{subject} {what was wrong}")``, ``subject`` naming the file (``"cluster file
    'lab.toml'"``). Keep only the reading and parsing inside, so that no other ValueError is taken for the file's."""
    try:
        yield
    except UnicodeDecodeError as fault:
        raise error(
            f"{subject} is not UTF-8 text, so not {language} ({fault.reason} at byte {fault.start}); save it as UTF-8"
        ) from None
    except RecursionError:
        raise error(
            f"{subject} nests {_CONTAINERS.get(language, 'values')} too deeply to read (a file moirai reads nests "
            "them a few levels deep); check what wrote it"
        ) from None
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as fault:
        raise error(f"{subject} is not valid {language} ({fault}); was it cut short?") from None
    except ValueError as fault:  # what the parser's int() refuses: more digits than Python converts
        if "digits" not in str(fault):
            raise error(f"{subject} holds a value that cannot be read: {fault}") from None
        raise error(
            f"{subject} holds an integer of more than {_max_digits()} digits, more than Python "
            "converts and more than any quantity needs; write it with fewer digits (as a float, 1.5e300)"
        ) from None


def load_json(text: str, subject: str, error: Callable[[str], MoiraiError]) -> object:
    """The value of the JSON ``text`` of the file ``subject`` names, read inside :func:`parsing`. A number literal
    too large for a float (``1e400``) is ``error(message)`` naming its line and column: Python reads it as Infinity,
    which in a file means something (a task that cannot run there, no link). The literal ``Infinity`` still reads
    as Infinity, where the file's reader allows it."""

    def finite(literal: str) -> float:
        value = float(literal)
        if math.isinf(value):
            raise _TooLarge(literal)
        return value

    try:
        return json.loads(text, parse_float=finite)
    except _TooLarge as fault:
        at = text.find(fault.literal)
        line, column = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
        raise error(
            f"{subject} holds the number {fault.literal[:40]} (line {line}, column {column}), too large for a float "
            "(at most about 1.8e308), which would read as Infinity; write the number it means, or Infinity where "
            "that is meant"
        ) from None


class _TooLarge(Exception):
    """What :func:`load_json`'s float hook raises for a literal that overflows a float: not a ValueError, which
    :func:`parsing` would take for the parser's own."""

    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of the file a user names at ``path`` (a link followed: the user may point at their file), read
    only if it is a regular file (:func:`moirai.files.read_regular_text`); else an OSError whose ``strerror`` says
    what the path is and what to give, for the reader's own error naming the file."""
    return read_regular_text(path, follow_links=True)


def check_input_path(path: object, subject: str, what: str, error: Callable[[str], MoiraiError]) -> None:
    """``error(message)`` unless ``path``, naming the ``subject`` (``"plan file"``) that moirai is to read, is a path:
    a str or an os.PathLike, without a NUL character. ``what`` says which file to give (``"the file
    CompiledModel.save(path) wrote"``). An int is not one: open() takes it for a file descriptor, reads whatever the
    caller holds open there, and closes it under them."""
    if not isinstance(path, (str, os.PathLike)):
        descriptor = " (open() would take an int for a file descriptor)" if isinstance(path, int) else ""
        raise error(
            f"the {subject}'s path is {repr(path)[:80]} ({type(path).__name__}){descriptor}; give the path (a str or "
            f"pathlib.Path) of {what}"
        )
    if "\0" in os.fsdecode(os.fspath(path)):
        raise error(
            f"the {subject}'s path {str(path)!r} holds a NUL character, which no path can; give the path of {what}"
        )


def check_output_path(
    path: str | Path, what: str, error: Callable[[str], MoiraiError], *, folder_made: bool = False
) -> None:
    """``error(message)`` unless ``what`` (``"the plan"``) can be written to ``path``: its folder exists and may be
    written (or, with ``folder_made``, is missing and will be made), and ``path`` is not a folder. Called before the
    work whose result it is to hold."""
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"cannot write {what} to {repr(path)[:80]} ({type(path).__name__}): give a path, a str or a Path")
    target = Path(path)
    folder = target.parent
    where = f"cannot write {what} to {str(path)!r}"
    if not os.fspath(path):  # Path("") is ".", the current folder
        raise error(f"{where}: the path is empty; name a file")
    if folder.exists() and not folder.is_dir():
        raise error(f"{where}: {str(folder)!r} is a file, not a folder; name a file in a folder")
    if folder_made and not folder.exists():
        return
    if not folder.is_dir():
        raise error(f"{where}: folder {str(folder)!r} does not exist; create it or name a file in another folder")
    if target.is_dir():
        raise error(f"{where}: it is a folder; name a file instead (one inside it, say)")
    try:
        mode = os.lstat(target).st_mode
    except OSError:
        mode = None  # nothing there yet (or nothing this user may see): the write says what is wrong
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        # The write replaces the path by a new file in one step: a pipe or a device node there would be destroyed.
        raise error(f"{where}: it is a device, a pipe or a socket, not a file; name a file")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise error(f"{where}: folder {str(folder)!r} may not be written by this user; name a file in another folder")


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether paths ``a`` and ``b`` name one file (through links, where both exist)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): compare where they lead
        return Path(a).resolve() == Path(b).resolve()


def write_output(path: str | Path, text: str, what: str, error: Callable[[str], MoiraiError]) -> None:
    """Write ``text``, ``what`` it is (``"the plan"``), to ``path`` the user named, in one step; a path that cannot
    take it is ``error(message)`` naming it, never an OSError."""
    check_output_path(path, what, error)
    try:
        write_atomically(path, text)
    except OSError as fault:
        raise error(f"cannot write {what} to {str(path)!r}: {fault.strerror or fault}") from None


def _max_digits() -> int:
    """The most digits Python converts to an integer (``sys.get_int_max_str_digits``, from Python 3.10.7 on)."""
    return getattr(sys, "get_int_max_str_digits", lambda: 4300)()
