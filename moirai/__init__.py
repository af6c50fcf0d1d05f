"""moirai: split one PyTorch model across heterogeneous devices, placing every op where the model finishes soonest."""

from moirai import demo
from moirai.bounds import lower_bound
from moirai.coarsen import coarsen
from moirai.compile import CompiledModel, compile, load, serve_rank
from moirai.devices import Cluster, Device
from moirai.errors import (
    ClusterError,
    DistributedError,
    FusionRuleError,
    InfeasibleError,
    InputError,
    MoiraiError,
    PlanError,
    ProblemError,
    TraceError,
)
from moirai.placers import place, placers
from moirai.problem import Plan, Problem
from moirai.simulate import Timeline, simulate
from moirai.trace import trace
from moirai.viz import gantt

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
    "Plan",
    "PlanError",
    "Problem",
    "ProblemError",
    "Timeline",
    "TraceError",
    "coarsen",
    "compile",
    "demo",
    "gantt",
    "load",
    "lower_bound",
    "place",
    "placers",
    "serve_rank",
    "simulate",
    "trace",
]
