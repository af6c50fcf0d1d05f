"""The weights a world's ranks were sent, and whether the model has changed them in place since.

Rank 0 runs part 0 on the program's own tensors, which are the model's (detached aliases that share their version
counters), so a change made in place there (``load_state_dict``, ``weight.mul_(2)``) reaches its next request. Every
other rank holds the copies it was sent when it started (or loaded the program): changed in place afterwards, the
model would compute with the old weights there beside the new ones, a silent mix. A :class:`WeightsSent` taken when
the ranks got the program says which weight has changed since, by the version counters alone (a cheap look per
tensor and request). A buffer a part writes in place (a KV cache, a counter) is the ranks' own state, not a weight
sent, and is left out ([Note: weights a server was sent] in docs/design.md). What no version counter sees is not
caught: a write through ``.data`` (``p.data.add_(1)``, as some EMA updates and loaders do) and a change to an
inference tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moirai.errors import InputError
from moirai.runtime.split import SplitProgram
from moirai.runtime.written_state import written_states


@dataclass(frozen=True, eq=False)
class WeightsSent:
    """The tensors parts other than part 0 read and never write, by part and attribute, and their versions then."""

    names: tuple[tuple[int, str], ...]  # (device, attribute) per tensor
    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, program: SplitProgram) -> WeightsSent:
        written = {(state.device, state.attribute) for state in written_states(program)}
        names, tensors = [], []
        for part in program.parts[1:]:
            for attribute in part.attribute_names:
                value = getattr(part.graph_module, attribute, None)
                # An inference tensor keeps no version; it can only be changed under inference_mode.
                if isinstance(value, torch.Tensor) and not value.is_inference():
                    if (part.device, attribute) not in written:
                        names.append((part.device, attribute))
                        tensors.append(value)
        return cls(tuple(names), tuple(tensors), tuple(t._version for t in tensors))

    def changed(self) -> list[tuple[int, str]]:
        """The (device, attribute) of every tensor changed in place since this was taken."""
        return [
            name
            for name, tensor, version in zip(self.names, self.tensors, self.versions, strict=True)
            if tensor._version != version
        ]

    def refuse_changed(self, device_names: list[str]) -> None:
        """An :class:`InputError` naming what changed where any weight has."""
        changed = self.changed()
        if not changed:
            return
        shown = ", ".join(f"{attribute} on {device_names[device]}" for device, attribute in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise InputError(
            f"the model's weights were changed in place after this server's ranks were sent them ({shown}{more}): "
            "the ranks other than 0 hold the copies they were sent and would compute with the old values beside "
            "the new ones, so the request is refused; close this server and open a new one to serve the new weights "
            "(compiled(...) and run_distributed read them where they are)"
        )
