"""moirai: split one PyTorch model across heterogeneous devices, placing every op where the model finishes soonest.

Imports are lazy: ``import moirai.planning.problem`` (or the simulator, the bounds, any placer) loads no torch;
``moirai.compile`` and the other names below load their module on first use.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# Public name -> the module that defines it.
_EXPORTS = {
    "CacheError": "moirai.errors",
    "Cluster": "moirai.cluster.devices",
    "ClusterError": "moirai.errors",
    "CompiledLM": "moirai.generation.lm",
    "CompiledModel": "moirai.compile",
    "Device": "moirai.cluster.devices",
    "DistributedError": "moirai.errors",
    "FusionRuleError": "moirai.errors",
    "InfeasibleError": "moirai.errors",
    "InputError": "moirai.errors",
    "MoiraiError": "moirai.errors",
    "MoiraiWarning": "moirai.errors",
    "OverMemoryWarning": "moirai.errors",
    "OversubscriptionWarning": "moirai.errors",
    "PaddingWarning": "moirai.errors",
    "RandomOpsWarning": "moirai.errors",
    "PlacerOptionError": "moirai.errors",
    "TrainingModeWarning": "moirai.errors",
    "Objective": "moirai.planning.objective",
    "Plan": "moirai.planning.plan",
    "PlanError": "moirai.errors",
    "Problem": "moirai.planning.problem",
    "ProblemError": "moirai.errors",
    "RequestError": "moirai.errors",
    "SharedMemoryWarning": "moirai.errors",
    "StateLeftBehindWarning": "moirai.errors",
    "Timeline": "moirai.planning.simulate",
    "TraceError": "moirai.errors",
    "UsageError": "moirai.errors",
    "coarsen": "moirai.frontend.coarsen",
    "gantt": "moirai.viz",
    "compile": "moirai.compile",
    "compile_lm": "moirai.generation.lm",
    "list_placers": "moirai.planning.placers",
    "load": "moirai.compile",
    "load_lm": "moirai.generation.lm",
    "lower_bound": "moirai.planning.bounds",
    "place": "moirai.planning.placers",
    "serve_rank": "moirai.compile",
    "simulate": "moirai.planning.simulate",
    "trace": "moirai.frontend.trace",
}
_SUBMODULES = ("demo",)

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"moirai.{name}")
    else:
        raise AttributeError(f"module 'moirai' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and the package's submodules loaded so far, not the helpers this file imports."""
    loaded = {name for name, value in globals().items() if isinstance(value, types.ModuleType) and name not in _HIDDEN}
    return sorted({*__all__, *loaded})


_HIDDEN = {"importlib", "sys", "types"}  # this file's own imports


class _Package(types.ModuleType):
    """Keeps ``moirai.compile`` the function: importing the submodule ``moirai.compile`` binds it on its package,
    and the function shares its module's name."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
