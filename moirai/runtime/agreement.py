"""Under torchrun every rank built its program itself: before a program's first request the ranks check that they
built the same one, since a rank that runs another plan, or its part with other weights, gives a silent wrong answer.

Each rank publishes a :class:`ProgramDigest` of its program through the run's store (sealed where
``MOIRAI_RUN_SECRET`` is set): its structure (every part's ops and messages, the transfers, the input and output
specs: what every rank must agree on) and a sample of the weights of its own part. Rank 0, which holds every part,
compares each rank's with its own and hands every rank its verdict, so every rank fails with the same
:class:`moirai.PlanError` naming the rank that differs and what differs, before any request runs.

[Note: weights are compared by sample] Hashing every byte of a large model costs seconds per GB on every rank, so
each tensor's digest covers its name, shape and dtype and up to 64 KiB from the start, the middle and the end of its
values: enough to catch another seed or checkpoint, not a change to a few weights in between. Buffers a part writes
in place (a counter, a KV cache) are compared by name, shape and dtype only: their values are state, which a local
run on one rank may have moved on. Weights left on the meta device (a plan without weights) have no bytes to compare.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from moirai.errors import PlanError
from moirai.frontend.state import written_in_place
from moirai.runtime.blame import wait_for_ranks
from moirai.runtime.groups import Group
from moirai.runtime.split import DevicePart, SplitProgram
from moirai.runtime.store import get_json, wait_for_key

SAMPLE_BYTES = 64 * 1024  # from each of a tensor's start, middle and end ([Note: weights are compared by sample])
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a default repr's address differs between processes
_AGREED = "agreed"


@dataclass(frozen=True)
class ProgramDigest:
    """What one rank says of its program: a hash of each structural component, and its part's weights by name."""

    structure: dict[str, str]  # "part 1's ops" (or "the transfers", ...) -> sha256 hex of its canonical text
    op_counts: tuple[int, ...]  # each part's nodes, to say how two plans differ
    weights: dict[str, str]  # tensor name -> digest of its name, shape, dtype and sampled bytes

    def to_json(self) -> str:
        return json.dumps({"structure": self.structure, "op_counts": list(self.op_counts), "weights": self.weights})

    @classmethod
    def read(cls, store: Any, key: str) -> ProgramDigest:
        """The digest a rank set under ``key`` (:meth:`to_json`), checked: a :class:`moirai.DistributedError` naming
        the key unless it is one."""

        def valid(record: Any) -> bool:
            return (
                isinstance(record, dict)
                and _strings(record.get("structure"))
                and isinstance(record.get("op_counts"), list)
                and all(type(count) is int for count in record["op_counts"])
                and _strings(record.get("weights"))
                and all(digest.count(":") == 1 for digest in record["weights"].values())
            )

        expected = '{"structure": {name: hash}, "op_counts": [int, ...], "weights": {name: "shape:values"}}'
        record = get_json(store, key, "program digest", valid, expected)
        return cls(record["structure"], tuple(record["op_counts"]), record["weights"])


def _strings(value: Any) -> bool:
    """Whether ``value`` maps strings to strings."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def program_digest(program: SplitProgram, part: int) -> ProgramDigest:
    """``program``'s structure, with the weights of part ``part`` (the part this rank runs)."""
    structure = {f"part {p.device}'s ops": _hash(_part_text(p)) for p in program.parts}
    structure["the transfers between parts"] = _hash(repr(program.transfers))
    structure["the outputs' places"] = _hash(repr(program.outputs))
    structure["the input specs"] = _hash(repr((program.input_specs, program.dynamic_dims)))
    op_counts = tuple(len(p.graph_module.graph.nodes) for p in program.parts)
    return ProgramDigest(structure, op_counts, part_weights(program.parts[part]))


def part_weights(part: DevicePart) -> dict[str, str]:
    """Every tensor ``part`` reads as an attribute, by name: a digest of its name, shape, dtype and sampled values."""
    module = part.graph_module
    written = {str(node.target) for node in written_in_place(module.graph) if node.op == "get_attr"}
    digests = {}
    for node in module.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(node.target)(module)
        if isinstance(value, torch.Tensor):
            digests[str(node.target)] = tensor_digest(value, sample=node.target not in written)
    return digests


def tensor_digest(tensor: torch.Tensor, sample: bool = True) -> str:
    """``shape:values``: a digest of ``tensor``'s shape and dtype, and one of up to :data:`SAMPLE_BYTES` from the
    start, middle and end of its values (empty where not ``sample``d, or on the meta device)."""
    shape = hashlib.sha256(f"{tuple(tensor.shape)} {tensor.dtype}".encode()).hexdigest()[:16]
    if not sample or tensor.is_meta or not tensor.numel():
        return f"{shape}:"
    values = hashlib.sha256()
    flat = tensor.detach().reshape(-1)
    count = max(1, SAMPLE_BYTES // tensor.element_size())
    for start in sorted({0, max(0, (flat.numel() - count) // 2), max(0, flat.numel() - count)}):
        values.update(flat[start : start + count].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return f"{shape}:{values.hexdigest()[:32]}"


# Programs this process has checked, and how many checks it has made: the ranks pair their checks in order.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CHECKS = itertools.count()


def check_same_program(group: Group, program: SplitProgram, timeout_s: float) -> None:
    """Before ``program``'s first request on this rank: a :class:`moirai.PlanError` on every rank unless every rank
    built the same program with the same weights (a collective: every rank calls it for its program, in one order)."""
    if program in _CHECKED:
        return
    key = f"moirai/agreement/{next(_CHECKS)}"
    digest = program_digest(program, group.rank)
    if group.rank == 0:
        verdict = _compare(group, program, digest, key, timeout_s)
        group.store.set(f"{key}/verdict", json.dumps(verdict))
    else:
        group.store.set(f"{key}/{group.rank}", digest.to_json())
        wait_for_key(group.store, f"{key}/verdict", "rank 0", "comparing the ranks' programs", timeout_s)
        verdict = read_verdict(group.store, f"{key}/verdict")
    if verdict != _AGREED:
        raise PlanError(verdict)
    _CHECKED[program] = True


def read_verdict(store: Any, key: str) -> str:
    """Rank 0's verdict as it set it under ``key`` (a JSON string)."""
    return get_json(store, key, "verdict of rank 0", lambda v: isinstance(v, str), "a JSON string")


def _compare(group: Group, program: SplitProgram, own: ProgramDigest, key: str, timeout_s: float) -> str:
    """Rank 0's verdict: :data:`_AGREED`, or the error naming the first rank whose program differs and how."""
    others = range(1, group.world_size)
    wait_for_ranks(group.store, {k: f"{key}/{k}" for k in others}, "saying which program it runs", timeout_s)
    for rank in others:
        theirs = ProgramDigest.read(group.store, f"{key}/{rank}")
        difference = plan_difference(own, theirs, rank) or weights_difference(
            part_weights(program.parts[rank]), theirs.weights, rank
        )
        if difference:
            return f"{difference}; no request was run"
    return _AGREED


def plan_difference(own: ProgramDigest, theirs: ProgramDigest, rank: int) -> str | None:
    """How rank ``rank``'s plan differs from rank 0's, in words; None where they agree."""
    differing = [name for name, value in own.structure.items() if theirs.structure.get(name) != value]
    if not differing and set(theirs.structure) == set(own.structure):
        return None
    counts = (
        f" (nodes per part: {list(own.op_counts)} on rank 0, {list(theirs.op_counts)} on rank {rank})"
        if own.op_counts != theirs.op_counts
        else ""
    )
    return (
        f"rank {rank} runs another plan than rank 0: {', '.join(differing) or 'the number of parts'} differ{counts}. "
        "Every rank must run the same plan: compile on every rank (rank 0 plans and hands its plan over), or give "
        "moirai.load the same plan file, model and example inputs on every rank"
    )


def weights_difference(own: dict[str, str], theirs: dict[str, str], rank: int) -> str | None:
    """Which of part ``rank``'s weights rank ``rank`` holds otherwise than rank 0's copy of that part; None if none."""
    differing = [name for name in sorted(own.keys() | theirs.keys()) if _differ(own.get(name), theirs.get(name))]
    if not differing:
        return None
    shown = ", ".join(differing[:3]) + (f" and {len(differing) - 3} more" if len(differing) > 3 else "")
    return (
        f"rank {rank}'s part holds other weights than rank 0's copy of it: {shown} differ (compared by shape, dtype "
        f"and a sample of their values). Every rank must build the model with the same weights: load the same "
        "checkpoint (or seed the same) on every rank"
    )


def _differ(own: str | None, theirs: str | None) -> bool:
    """Whether two :func:`tensor_digest` differ: their shapes or dtypes, or their values where both have some."""
    if own is None or theirs is None:
        return True
    own_shape, own_values = own.split(":")
    their_shape, their_values = theirs.split(":")
    return own_shape != their_shape or (bool(own_values) and bool(their_values) and own_values != their_values)


def _part_text(part: DevicePart) -> str:
    """Part ``part`` as text every rank that built it from the same plan writes alike."""
    nodes = [_ADDRESS.sub("", node.format_node()) for node in part.graph_module.graph.nodes]
    messages = (part.input_indices, [t.index for t in part.receives], [t.index for t in part.sends])
    return "\n".join([*nodes, repr(messages), repr(part.output_specs), repr(part.attribute_names)])


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
