"""Environment variables set for the span of a block, then put back as they were."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def variable_set(name: str, value: str) -> Iterator[None]:
    """Inside: ``os.environ[name] == value``; after: the variable as it was (unset where it was unset). Not
    thread-safe by itself: a caller that others may race holds its own lock around it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
