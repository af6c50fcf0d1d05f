"""Reading a problem description, the JSON form of :class:`moirai.planning.problem.Problem`, field by field.

Every value is checked as it is read, so that a bad file is a :class:`ProblemError` naming the field
(``tasks[3].compute_s[1]``), what it holds and what to give, never a Python error or a silently different problem:
numbers are numbers of the field's :class:`Quantity`, objects hold only the keys they may (a misspelt one is
refused with the closest known key), names are strings of their own.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from moirai.errors import ProblemError, did_you_mean
from moirai.file_numbers import checked_float, is_number


@dataclass(frozen=True)
class Quantity:
    """What numbers one field may hold: never NaN or negative, and infinite only where ``infinite`` says what that
    means. :class:`Problem` checks its arrays by the same rules as the reader checks the fields they come from."""

    unit: str
    infinite: str = ""  # what Infinity means in this field; "" where it means nothing and is refused
    # Larger finite values are refused: sums of them overflowed to inf and the plan's figures read inf and nan.
    largest: ClassVar[float] = 1e18

    def wrong(self, values: Any) -> np.ndarray:
        """Where ``values`` (a number or an array) break the rule."""
        values = np.asarray(values, float)
        wrong = np.isnan(values) | (values < 0) | (np.isfinite(values) & (values > self.largest))
        return wrong if self.infinite else wrong | np.isinf(values)

    def rule(self) -> str:
        """The rule in words, for the end of an error message."""
        if self.infinite:
            return f"a non-negative number of {self.unit} up to {self.largest:g}, or Infinity ({self.infinite})"
        return f"a finite non-negative number of {self.unit} up to {self.largest:g}"


SECONDS = Quantity("seconds")  # a time that always passes: CPU time, a per-request cost, a latency


def checked_object(value: Any, where: str, keys: Collection[str], required: Sequence[str] = ()) -> dict[str, Any]:
    """``value`` as an object that has every key of ``required`` and none but ``keys``; an unknown key is named
    before a missing one, as a misspelt required key is both."""
    if not isinstance(value, dict):
        raise ProblemError(f"{where} must be an object with keys {sorted(keys)}, got {kind(value)}: {shown(value)}")
    for key in value:
        if key not in keys:
            raise ProblemError(f"{where} has unknown key {key!r}{did_you_mean(key, keys)}; its keys are {sorted(keys)}")
    missing = [key for key in required if key not in value]
    if missing:
        raise ProblemError(f"{where} lacks {missing}; it needs {list(required)}")
    return value


def checked_list(value: Any, where: str, items: str) -> list[Any]:
    """``value`` as a list (of ``items``, in words, for the message)."""
    if not isinstance(value, list):
        raise ProblemError(f"{where} must be a list of {items}, got {kind(value)}: {shown(value)}")
    return value


def checked_objects(
    value: Any, where: str, keys: Collection[str], required: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """``value`` as a list of objects, each checked by :func:`checked_object` (``where[i]``)."""
    entries = checked_list(value, where, "objects")
    return [checked_object(entry, f"{where}[{i}]", keys, required) for i, entry in enumerate(entries)]


def checked_name(value: Any, where: str) -> str:
    """``value`` as a name: a string with something in it (not a number or null that would read as one)."""
    if not isinstance(value, str) or not value:
        raise ProblemError(f"{where} must be a non-empty string, got {shown(value)}")
    return value


def unique_names(entries: list[dict[str, Any]], where: str) -> tuple[str, ...]:
    """The ``name`` of every entry of ``entries`` (the list at ``where``), each a string no other entry has: edges,
    colocated sets and plans name devices and tasks, so two of one name would be one."""
    first: dict[str, int] = {}
    for i, entry in enumerate(entries):
        name = checked_name(entry["name"], f"{where}[{i}].name")
        if name in first:
            raise ProblemError(
                f"{where}[{i}].name is {name!r}, the name of {where}[{first[name]}] too; give each its own name "
                "(edges, colocated sets and plans name them)"
            )
        first[name] = i
    return tuple(first)


def known_name(value: Any, where: str, names: dict[str, int], what: str) -> int:
    """The index of the name ``value`` among ``names`` (of ``what``, in words: "task")."""
    name = checked_name(value, where)
    if name not in names:
        raise ProblemError(
            f"{where} is {name!r}, which is no {what}'s name{did_you_mean(name, names)}; name one of {list(names)[:20]}"
        )
    return names[name]


def checked_number(value: Any, where: str, quantity: Quantity) -> float:
    return float(checked_numbers(value, (), where, quantity))


def checked_numbers(
    value: Any, shape: tuple[int, ...], where: str, quantity: Quantity, meaning: str = ""
) -> np.ndarray:
    """``value`` as an array of ``shape`` (nested lists: a matrix is a list of rows) of numbers ``quantity`` allows;
    ``meaning`` says what its entries are for, in the message of a wrong length ("one per device")."""
    numbers: list[float] = []
    _collect(value, shape, where, quantity, meaning, numbers)
    array = np.array(numbers, float).reshape(shape)
    wrong = np.flatnonzero(quantity.wrong(array))
    if wrong.size:
        index = np.unravel_index(int(wrong[0]), shape) if shape else ()
        place = where + "".join(f"[{int(i)}]" for i in index)
        raise ProblemError(f"{place} is {shown(array[index])}; give {quantity.rule()}")
    return array


def _collect(
    value: Any, shape: tuple[int, ...], where: str, quantity: Quantity, meaning: str, out: list[float]
) -> None:
    """Append ``value``'s numbers to ``out`` in row-major order, checking its type and every length."""
    if isinstance(value, np.ndarray):  # a description built in Python may hold arrays
        value = value.tolist()
    if not shape:
        if not is_number(value):
            raise ProblemError(f"{where} is {shown(value)}, not a number; give {quantity.rule()}")
        out.append(_float(value, where, quantity))
        return
    if not isinstance(value, (list, tuple)) or len(value) != shape[0]:
        meant = f" ({meaning})" if meaning else ""
        raise ProblemError(f"{where} must be {_list_words(shape)}{meant}, got {shown(value)}")
    if len(shape) == 1 and set(map(type, value)) <= {float, int}:  # what to_json writes (and zeros), in one step
        try:
            out.extend([float(v) for v in value])
            return
        except OverflowError:
            pass  # an integer too long for a float: read one by one, to say which
    for i, item in enumerate(value):
        _collect(item, shape[1:], f"{where}[{i}]", quantity, "", out)


def _float(value: Any, where: str, quantity: Quantity) -> float:
    """``value`` as a float; an integer too long for one is refused (:func:`moirai.file_numbers.float_fault`), not
    read as Infinity (which means something: a task that cannot run there, no link). The quantity's own rule is
    checked on the whole array."""
    return checked_float(value, where, ProblemError, quantity.rule(), negative=True, infinite=True)


def _list_words(shape: tuple[int, ...]) -> str:
    words = "numbers"
    for size in reversed(shape[1:]):
        words = f"lists of {size} {words}"
    return f"a list of {shape[0]} {words}"


def kind(value: Any) -> str:
    """What JSON calls ``value``'s type, with its article ("an object")."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if is_number(value):
        return "a number"
    kinds = {str: "a string", list: "a list", tuple: "a list", dict: "an object"}
    return next((word for cls, word in kinds.items() if isinstance(value, cls)), f"a {type(value).__name__}")


def shown(value: Any) -> str:
    """``value`` as its JSON text (``null``, ``"4GB"``, ``NaN``), cut short: what the file says."""
    if isinstance(value, np.generic):
        value = value.item()
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # not JSON: a Python object given to from_dict
        text = f"{value!r} ({type(value).__name__})"
    return text if len(text) <= 80 else text[:77] + "..."
