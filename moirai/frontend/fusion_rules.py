"""Fusion rule files: the bundled sets (``moirai/data/fusion_rules/*.toml``), their op classes, and the parsing of a
user's rule file into a :class:`RuleSet` that :func:`moirai.frontend.coarsen.coarsen` fuses by.

A rule file holds ``[[rule]]`` tables with ``ops`` (op class words, each optionally suffixed ``?`` optional, ``+``
repeated, ``*`` both), an optional ``name`` and ``multi_output``, and an optional ``[classes]`` table that adds or
redefines op classes of the bundled ``op_classes.toml``. Every mistake in a file is a
:class:`moirai.errors.FusionRuleError` naming the file and line.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from moirai.errors import FusionRuleError
from moirai.user_files import parsing

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BUNDLED_RULE_SETS = ("eigen", "cudnn", "transformer", "pointwise")
# "default": every bundled set. Each only fires on the ops it names, so the union suits CNNs
# (eigen, cudnn) and transformers (transformer) alike; pointwise adds Inductor-style epilogues.
DEFAULT_RULE_SETS = BUNDLED_RULE_SETS
ANY_OP = "any"
QUANTIFIERS = {"": (False, False), "?": (True, False), "+": (False, True), "*": (True, True)}


class RuleElement(NamedTuple):
    op_class: str
    targets: frozenset[str] | None  # None: every op ("any")
    optional: bool
    repeated: bool


class FusionRule(NamedTuple):
    name: str
    elements: tuple[RuleElement, ...]
    multi_output: bool


@dataclass(frozen=True)
class RuleSet:
    """Fusion rules in priority order (the first whole match names a fusion) and where they came from."""

    rules: tuple[FusionRule, ...]
    sources: tuple[str, ...]

    def __add__(self, other: RuleSet) -> RuleSet:
        return RuleSet(self.rules + other.rules, self.sources + other.sources)


def _bundled_rule_file(name: str) -> importlib.resources.abc.Traversable:
    """A rule file shipped with moirai, beside the device table (``moirai/data/fusion_rules``)."""
    return importlib.resources.files("moirai").joinpath("data", "fusion_rules", name)


def load_rules(spec: str | Path | RuleSet | Sequence[str | Path | RuleSet]) -> RuleSet:
    """The rules named by ``spec`` (see :func:`coarsen`), pooled in the order given."""
    if isinstance(spec, RuleSet):
        return spec
    if isinstance(spec, str) and spec == "default":
        return load_rules(DEFAULT_RULE_SETS)
    if isinstance(spec, str) and spec in BUNDLED_RULE_SETS:
        text = _bundled_rule_file(f"{spec}.toml").read_text()
        return parse_rules(text, f"{spec}.toml")
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if not path.is_file():
            raise FusionRuleError(
                f"{spec!s} is neither a bundled rule set nor a file; use 'default', one of "
                f"{', '.join(BUNDLED_RULE_SETS)}, or the path of a .toml rule file"
            )
        try:
            with parsing("TOML", str(path), FusionRuleError):
                text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise FusionRuleError(f"{path} cannot be read: {error.strerror or error}") from None
        return parse_rules(text, str(path))
    if not isinstance(spec, Iterable) or isinstance(spec, (bytes, bytearray, Mapping)):
        raise FusionRuleError(
            f"fusion_rules={spec!r} ({type(spec).__name__}) names no rule set; pass 'default', one of "
            f"{', '.join(BUNDLED_RULE_SETS)}, the path of a .toml rule file (a str or os.PathLike), a RuleSet, or a "
            "list of these"
        )
    rule_sets = [load_rules(item) for item in spec]
    if not rule_sets:
        raise FusionRuleError("no rule sets given; pass 'default' for the bundled ones")
    return sum(rule_sets[1:], rule_sets[0])


def parse_rules(text: str, source: str = "<rules>") -> RuleSet:
    """Rules from TOML text: ``[[rule]]`` tables with ``ops`` (op classes, each optionally suffixed
    ``?`` optional, ``+`` repeated, ``*`` both), optional ``name`` and ``multi_output``; an optional
    ``[classes]`` table adds or redefines op classes of the bundled ``op_classes.toml``."""
    data = _parse_toml(text, source)
    classes = {**_bundled_op_classes(), **_op_classes(data, text, source)}
    entries = data.get("rule", [])
    if not isinstance(entries, list) or not entries or not all(isinstance(entry, dict) for entry in entries):
        raise FusionRuleError(f"{source}: defines no rules; write each as a [[rule]] table with ops = [...]")
    stem = Path(source).stem
    rules = []
    for index, entry in enumerate(entries):
        where = f"{source}:{_line_of(text, index, None)}"
        unknown_keys = set(entry) - {"name", "ops", "multi_output"}
        if unknown_keys:
            raise FusionRuleError(f"{where}: unknown key(s) {sorted(unknown_keys)}; a rule has name, ops, multi_output")
        words = entry.get("ops")
        if not isinstance(words, list) or not words or not all(isinstance(word, str) for word in words):
            raise FusionRuleError(f"{where}: a rule needs ops = a non-empty list of op classes, like ['conv', 'bn']")
        multi_output = entry.get("multi_output", False)
        if not isinstance(multi_output, bool):
            raise FusionRuleError(f"{where}: multi_output must be true or false")
        name = str(entry.get("name", "+".join(words)))
        elements = tuple(
            _rule_element(word, classes, f"{source}:{_line_of(text, index, word)}", name) for word in words
        )
        rules.append(FusionRule(f"{stem}:{name}", elements, multi_output))
    return RuleSet(tuple(rules), (stem,))


def _rule_element(word: str, classes: Mapping[str, frozenset[str]], where: str, rule_name: str) -> RuleElement:
    match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)([?+*]?)", word)
    if match is None:
        raise FusionRuleError(
            f"{where}: rule {rule_name!r}: {word!r} is not an op class word with an optional ?, + or * suffix"
        )
    op_class, quantifier = match.groups()
    if op_class != ANY_OP and op_class not in classes:
        raise FusionRuleError(
            f"{where}: rule {rule_name!r} names unknown op class {op_class!r}; known classes: "
            f"{', '.join(sorted(classes))}, {ANY_OP}. Fix the spelling or define it under [classes] in this file"
        )
    optional, repeated = QUANTIFIERS[quantifier]
    return RuleElement(op_class, None if op_class == ANY_OP else classes[op_class], optional, repeated)


def _parse_toml(text: str, source: str) -> dict:
    with parsing("TOML", source, FusionRuleError):
        return tomllib.loads(text)


def _op_classes(data: dict, text: str, source: str) -> dict[str, frozenset[str]]:
    table = data.get("classes", {})
    if not isinstance(table, dict):
        raise FusionRuleError(f"{source}: [classes] must be a table of word = [aten targets]")
    classes = {}
    for word, targets in table.items():
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            line = next((i + 1 for i, line in enumerate(text.splitlines()) if line.strip().startswith(word)), "?")
            raise FusionRuleError(f"{source}:{line}: op class {word!r} must be a list of aten target strings")
        classes[word] = frozenset(targets)
    return classes


_BUNDLED_OP_CLASSES: dict[str, frozenset[str]] = {}


def _bundled_op_classes() -> dict[str, frozenset[str]]:
    if not _BUNDLED_OP_CLASSES:
        text = _bundled_rule_file("op_classes.toml").read_text()
        _BUNDLED_OP_CLASSES.update(_op_classes(_parse_toml(text, "op_classes.toml"), text, "op_classes.toml"))
    return _BUNDLED_OP_CLASSES


def _line_of(text: str, rule_index: int, word: str | None) -> int:
    """1-based line of rule ``rule_index``'s [[rule]] header, or of ``word`` quoted inside that rule."""
    lines = text.splitlines()
    headers = [i for i, line in enumerate(lines) if re.match(r"\s*\[\[\s*rule\s*\]\]", line)]
    start = headers[rule_index] if rule_index < len(headers) else 0
    if word is not None:
        quoted = re.compile(r"[\"']" + re.escape(word) + r"[\"']")
        return next((i + 1 for i in range(start, len(lines)) if quoted.search(lines[i])), start + 1)
    return start + 1
