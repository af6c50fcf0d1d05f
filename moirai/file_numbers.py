"""Numbers a file or a cache hands moirai (JSON, TOML): one rule for which of them it takes, for every reader.

A JSON or TOML integer has as many digits as its text: ``10**400`` is read, and ``float()`` of it, ``math.isfinite``
and numpy then raise OverflowError far from the file; one of 2**63 or more does not fit the int64 arrays that hold
indices. :func:`float_fault` and :func:`int_fault` say in words what makes a value no number of its field (``"is
NaN"``, ``"is an integer of 401 digits, ..."``), or None; each reader puts the words after the field's name in its
own error (:class:`moirai.PlanError`, :class:`moirai.ClusterError`, :class:`moirai.ProblemError`, a corrupt cache),
or calls :func:`checked_float` / :func:`checked_int`, which do that. Plain Python and numpy: the planning core may
use it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import numpy as np

from moirai.errors import MoiraiError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_DIGITS_PER_BIT = math.log10(2)


def is_number(value: object) -> bool:
    """A real number (a JSON or TOML one, or a numpy one from Python): not a bool, a string or null."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_integer(value: object) -> bool:
    """A whole number (a Python or numpy integer): not a bool, a float (2.0 included), a string or null."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def float_fault(value: object, *, negative: bool = False, infinite: bool = False) -> str | None:
    """What makes ``value`` no float of its field, in words that follow the field's name, or None: it must be a
    number (not a bool, a string or null) a float64 holds (an integer of about 309 digits or more does not), not
    NaN, infinite only with ``infinite`` (where it means something) and negative only with ``negative``."""
    if not is_number(value):
        return f"is {_shown(value)}, not a number"
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:
        return f"is {_integer_words(int(value))}, too large for a float (at most about 1.8e308)"  # type: ignore[call-overload]
    if math.isnan(number):
        return "is NaN"
    if math.isinf(number) and not infinite:
        return f"is {'-' if number < 0 else ''}infinite"
    if number < 0 and not negative:
        return f"is negative ({number:g})"
    return None


def int_fault(value: object, low: int = INT64_MIN, high: int = INT64_MAX) -> str | None:
    """What makes ``value`` no whole number in ``low..high`` (by default what an int64 holds), in words that follow
    the field's name, or None."""
    if not is_integer(value):
        return f"is {_shown(value)}, not a whole number"
    number = int(value)  # type: ignore[call-overload]
    if not low <= number <= high:
        shown = str(number) if abs(number) < 10**30 else _integer_words(number)
        return f"is {shown}, outside {low}..{high}"
    return None


def checked_float(
    value: object,
    where: str,
    error: Callable[[str], MoiraiError],
    rule: str,
    *,
    negative: bool = False,
    infinite: bool = False,
) -> float:
    """``value`` as a float, or ``error(f"{where} {fault}; give {rule}")`` (:func:`float_fault`'s words)."""
    fault = float_fault(value, negative=negative, infinite=infinite)
    if fault is not None:
        raise error(f"{where} {fault}; give {rule}")
    return float(value)  # type: ignore[arg-type]


def checked_int(
    value: object,
    where: str,
    error: Callable[[str], MoiraiError],
    rule: str,
    low: int = INT64_MIN,
    high: int = INT64_MAX,
) -> int:
    """``value`` as an int, or ``error(f"{where} {fault}; give {rule}")`` (:func:`int_fault`'s words)."""
    fault = int_fault(value, low, high)
    if fault is not None:
        raise error(f"{where} {fault}; give {rule}")
    return int(value)  # type: ignore[call-overload]


def _integer_words(number: int) -> str:
    """A long integer by its size: its digits would fill the message (``str()`` of one past 4300 raises)."""
    digits = int(abs(number).bit_length() * _DIGITS_PER_BIT) + 1
    return f"an integer of about {digits} digits"


def _shown(value: object) -> str:
    """``value`` as a file writes it, cut short."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return "null" if value is None else str(bool(value)).lower()
    text = repr(value) if isinstance(value, str) else f"{type(value).__name__} {str(value)[:40]!r}"
    return text if len(text) <= 60 else text[:57] + "..."
