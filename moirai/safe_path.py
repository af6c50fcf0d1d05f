"""Python interpreters moirai starts import nothing from the current directory.

``python -c`` puts the current directory first on ``sys.path``, so a ``torch.py`` (or a ``multiprocessing/``) that
another local user left in a shared working directory (``/tmp``, a project folder) would run as this user in every
interpreter started that way: the calibration ranks (:func:`python_command`) and the fork server and spawned ranks
that multiprocessing starts (its command is ``-c`` too; :func:`safe_path_environment`). Each starts in safe-path mode
(``-P``, ``PYTHONSAFEPATH``: Python 3.11 and later), where ``sys.path`` holds what ``PYTHONPATH`` and the
installation name, and no current directory. Python 3.10 has no such mode: a calibration rank drops the entry
itself, and multiprocessing's interpreters there still look in the current directory first.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

from moirai.environment import variable_set

SAFE_PATH_ENV = "PYTHONSAFEPATH"
_HAS_SAFE_PATH = sys.version_info >= (3, 11)
# One start at a time sets and restores the variable: two threads interleaving would leave it set, or unset it
# under the other's start.
_ENVIRONMENT_LOCK = threading.Lock()


def python_command(code: str) -> list[str]:
    """The command line that runs ``code`` in a fresh interpreter without the current directory on ``sys.path``."""
    if _HAS_SAFE_PATH:
        return [sys.executable, "-P", "-c", code]
    # 3.10: -c always puts the current directory ('') first, and nothing is imported before the code runs.
    return [sys.executable, "-c", f"import sys; del sys.path[0]; {code}"]


@contextlib.contextmanager
def safe_path_environment() -> Iterator[None]:
    """While multiprocessing starts an interpreter (``python -c``, with this process's environment): safe-path mode,
    then the environment as it was. A rank takes rank 0's environment as its first step, so none keeps it."""
    with _ENVIRONMENT_LOCK, variable_set(SAFE_PATH_ENV, "1"):
        yield
