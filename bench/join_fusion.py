"""Fusing into a join: milp's predicted latency with the default fusion rules and with none (issue 24).

Run: ``python -m bench.join_fusion [--time-limit-s 20]``.

Two models: issue 24's two branches of four ``Linear(2048)`` joined by an add (batch 128) on two CPUs with the
default links, and the zoo's small evoformer (whose gates, a linear and a sigmoid beside the attention, are fused into
the multiplication that joins them) on the moirai-inter-server preset. Each is compiled with ``placer="milp"``
(analytic costs) under the default rules and under none; the table gives the groups placed, the predicted latency,
the gap to the coarsened problem's bound and, where the plan's report has one, the gap to the bound of the ops
ungrouped (``report.unfused_lower_bound_s``). Run it on two checkouts to compare their coarsening.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import moirai
from bench.models import build
from moirai.frontend.coarsen import RuleSet

NO_RULES = RuleSet((), ("none",))


class TwoBranches(nn.Module):
    """Two branches of ``depth`` linears of ``width`` features, joined by an add."""

    def __init__(self, width: int = 2048, depth: int = 4) -> None:
        super().__init__()
        self.a = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))
        self.b = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit-s", type=float, default=20.0, help="milp's budget per plan")
    args = parser.parse_args()
    torch.manual_seed(0)
    evoformer, evoformer_args, evoformer_kwargs = build("evoformer", "small")
    cases = [
        ("two branches", TwoBranches().eval(), (torch.randn(128, 2048),), {}, ["cpu", "cpu"]),
        ("evoformer small", evoformer, evoformer_args, evoformer_kwargs, moirai.Cluster.preset("moirai-inter-server")),
    ]
    table = Table(title=f"milp ({args.time_limit_s:g} s), default fusion rules against none")
    for column in ("model", "rules", "groups", "predicted", "gap", "gap vs unfused"):
        table.add_column(column, justify="left" if column in ("model", "rules") else "right")
    for name, model, inputs, kwargs, devices in cases:
        for rules_name, rules in (("default", "default"), ("none", NO_RULES)):
            compiled = moirai.compile(
                model,
                devices,
                inputs,
                kwargs,
                placer="milp",
                fusion_rules=rules,
                calibration="none",
                progress=False,
                time_limit_s=args.time_limit_s,
            )
            plan = compiled.plan
            unfused_s = getattr(plan.report, "unfused_lower_bound_s", None)
            unfused_gap = "-" if unfused_s is None else f"{(plan.objective_s - unfused_s) / plan.objective_s:.1%}"
            table.add_row(
                name,
                rules_name,
                str(len(compiled.graph.nodes)),
                f"{plan.objective_s * 1e3:.2f} ms",
                f"{plan.gap:.1%}" if plan.gap is not None else "-",
                unfused_gap,
            )
    Console(width=100).print(table)


if __name__ == "__main__":
    main()
