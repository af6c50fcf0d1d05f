"""Environment variables: set for the span of a block, then put back as they were; and the one reading of which rank
this process is, of how many (torchrun's ``RANK`` and ``WORLD_SIZE``), that every layer asks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from moirai.errors import InputError


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


@dataclass(frozen=True)
class TorchrunWorld:
    """This process's place in a run of two ranks or more: torchrun's, or a group the user set up with ``RANK`` and
    ``WORLD_SIZE`` (and ``MASTER_ADDR``/``MASTER_PORT``)."""

    rank: int
    world_size: int


def torchrun_world(environment: Mapping[str, str] | None = None) -> TorchrunWorld | None:
    """This process's rank and world where ``RANK`` and ``WORLD_SIZE`` say it is one of two ranks or more; None where
    either is unset (or empty), or the world is of one rank (``torchrun --nproc-per-node 1``): such a run is a local
    run everywhere (compile plans here, a server spawns its ranks, ``run_rank`` runs the whole model). A value that
    is not an integer, or a rank outside its world, is an :class:`InputError` naming the variable."""
    environment = os.environ if environment is None else environment
    if not (environment.get("RANK") and environment.get("WORLD_SIZE")):
        return None
    rank, world_size = integer_variable(environment, "RANK"), integer_variable(environment, "WORLD_SIZE")
    if not 0 <= rank < world_size:
        raise InputError(
            f"RANK={rank} and WORLD_SIZE={world_size} do not fit: a rank is from 0 to WORLD_SIZE - 1 (torchrun sets "
            "both; where you set them yourself, set them so, or unset both for a local run)"
        )
    return TorchrunWorld(rank, world_size) if world_size >= 2 else None


def require_torchrun_world(caller: str) -> TorchrunWorld:
    """:func:`torchrun_world`, or an :class:`InputError` saying that ``caller`` needs two ranks or more."""
    world = torchrun_world()
    if world is None:
        raise InputError(
            f"{caller} runs under torchrun with two ranks or more, but RANK and WORLD_SIZE are unset or the world is "
            "of one rank, a local run: run the script with torchrun --nproc-per-node 2 or more (or use "
            "compiled.server() or compiled(...) here)"
        )
    return world


def integer_variable(environment: Mapping[str, str], name: str) -> int:
    """The variable ``name`` of ``environment`` as an integer; an :class:`InputError` naming it where it is not one."""
    value = environment[name]
    try:
        return int(value)
    except ValueError:
        raise InputError(
            f"{name}={value!r} is not an integer: torchrun sets {name}; where you set it yourself, make it a whole "
            "number (or unset RANK and WORLD_SIZE for a local run)"
        ) from None
