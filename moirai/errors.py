"""Exceptions a user of moirai can cause; each message says what was wrong and what to do."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MoiraiError(Exception):
    """Base class of every error moirai raises on purpose."""


class TraceError(MoiraiError):
    """The model could not be traced into an fx graph."""


class ClusterError(MoiraiError):
    """A cluster description is malformed or inconsistent."""


class ProblemError(MoiraiError):
    """A placement problem is malformed (bad shapes, unknown names, cycles)."""


class FusionRuleError(MoiraiError):
    """A fusion rule file is malformed or names an op class that does not exist."""


class PlanError(MoiraiError):
    """A plan does not fit the problem or graph it is applied to."""


class InfeasibleError(MoiraiError):
    """No placement satisfies the constraints (usually memory)."""


class InputError(MoiraiError):
    """Inputs given to a compiled model do not match the traced example inputs."""


class DistributedError(MoiraiError):
    """A rank of a distributed run failed or timed out."""


class PlacerOptionError(MoiraiError):
    """An option given to a placer is unknown to it or out of its range."""


class RequestError(MoiraiError):
    """One request raised inside a part (an op rejected its inputs): that request fails alone, the ranks serve on."""


class UsageError(MoiraiError):
    """An API was called where it cannot do its work (a server closed from its own thread)."""


class CacheError(MoiraiError):
    """moirai's cache folder cannot be trusted (another user's, writable by others, a link) or its lock is held."""


class MoiraiWarning(UserWarning):
    """Base class of every warning moirai gives on purpose."""


class TrainingModeWarning(MoiraiWarning):
    """The model is in training mode: dropout and batch norm make the split outputs differ from call to call."""


class RandomOpsWarning(MoiraiWarning):
    """The model draws random numbers (``torch.randn_like`` noise, ``torch.rand``, ``multinomial``) in eval mode too:
    the split model's draws differ from the model's under one seed, by plan and by process."""


class OverMemoryWarning(MoiraiWarning):
    """A placer that ignores memory returned a plan that puts more on a device than it holds."""


class PlanVersionWarning(MoiraiWarning):
    """A plan file was saved by another version of moirai or torch."""


class OversubscriptionWarning(MoiraiWarning):
    """More logical CPU devices than cores, or more threads than a rank's cores: ranks share cores."""


class SharedMemoryWarning(MoiraiWarning):
    """The shared-memory directory cannot hold what a run sends through it: the run sends through gloo instead."""


class StateLeftBehindWarning(MoiraiWarning):
    """A closed server's ranks other than 0 wrote buffers or inputs in place: that state ended with their processes."""


class PaddingWarning(MoiraiWarning):
    """A generate call's mask leaves out tokens after a row's first kept one (right padding, holes): moirai
    generates each row as if they were absent, where model.generate, made for left padding, can give other tokens."""


def closest_name(word: object, names: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The name among ``names`` most like ``word`` (difflib's ratio at least ``cutoff``), or None: what a message
    offers for a misspelt key, name or option."""
    close = difflib.get_close_matches(str(word), list(names), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(word: object, names: Iterable[str]) -> str:
    """`` (did you mean 'name'?)`` for the name among ``names`` most like ``word``, or nothing."""
    close = closest_name(word, names)
    return f" (did you mean {close!r}?)" if close is not None else ""


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning given by the function calling this name the user's line: the first
    frame outside the moirai package (and Python's contextlib), however deep inside moirai the warning arises."""
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1  # the caller of this function: warnings.warn's stacklevel=1
    while frame is not None and (
        os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep)
        or frame.f_code.co_filename.endswith("contextlib.py")
    ):
        frame, level = frame.f_back, level + 1
    return level
