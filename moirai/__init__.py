"""moirai: split one PyTorch model across heterogeneous devices, placing every op where the model finishes soonest."""

from moirai import demo
from moirai.bounds import lower_bound
from moirai.coarsen import coarsen
from moirai.compile import CompiledModel, compile, load
from moirai.devices import Cluster, Device
from moirai.errors import (
    ClusterError,
    DistributedError,
    FusionRuleError,
    InfeasibleError,
    InputError,
    MoiraiError,
    MoiraiWarning,
    OverMemoryWarning,
    PlacerOptionError,
    PlanError,
    ProblemError,
    TraceError,
    TrainingModeWarning,
)
from moirai.placers import place, placers
from moirai.problem import Plan, Problem
from moirai.simulate import Timeline, simulate
from moirai.trace import trace

__all__ = [
    "Cluster",
    "ClusterError",
    "CompiledModel",
    "Device",
    "DistributedError",
    "FusionRuleError",
    "InfeasibleError",
    "InputError",
    "MoiraiError",
    "MoiraiWarning",
    "OverMemoryWarning",
    "Plan",
    "PlacerOptionError",
    "PlanError",
    "Problem",
    "ProblemError",
    "Timeline",
    "TraceError",
    "TrainingModeWarning",
    "coarsen",
    "compile",
    "demo",
    "load",
    "lower_bound",
    "place",
    "placers",
    "simulate",
    "trace",
]
