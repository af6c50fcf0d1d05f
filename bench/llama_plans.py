"""Plans for Llama-7B and Llama-13B over the Moirai paper's two clusters: milp against HEFT and the other baselines.

Run: ``python bench/llama_plans.py [--time-limit 60] [--sequence-length 512] [--cut-bound 600]``. Each model is
Hugging Face's ``LlamaForCausalLM`` built from the published configuration (fp16, on the meta device: planning needs
shapes only), traced with a prompt of ``--sequence-length`` tokens, coarsened by the default fusion rules and priced
by the analytic cost model on ``moirai-inter-server`` and ``moirai-intra-server`` (the paper's Table III); every
plan is judged by the simulator (latency). ``--cut-bound`` adds the cut-task bound
(:mod:`moirai.planning.solve.segment_bound`, within that many seconds of MILP time): how far from the optimum the
plans are, which the critical-path bound does not tell. Values are simulated, so a run gives the same numbers on any
machine but for milp, whose search depends on how much the machine computes within its time limit.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from moirai.cluster.cost import build_problem
from moirai.cluster.devices import Cluster
from moirai.frontend.coarsen import coarsen
from moirai.frontend.graph import build_op_graph
from moirai.frontend.trace import trace
from moirai.planning.objective import as_objective
from moirai.planning.placers import place
from moirai.planning.solve.segment_bound import segment_lower_bound

CONFIGS = {
    "Llama-7B": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32},
    "Llama-13B": {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40},
}
CLUSTERS = ("moirai-inter-server", "moirai-intra-server")
BASELINES = ("heft", "getf", "m_sct", "contiguous", "pieces")


def llama_graph(name: str, sequence_length: int):  # noqa: ANN201
    config = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=2048, use_cache=False, **CONFIGS[name])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.float16).eval()
    input_ids = torch.zeros(1, sequence_length, dtype=torch.long, device="meta")
    traced = trace(model, (), {"input_ids": input_ids, "use_cache": False})
    return coarsen(build_op_graph(traced), rules="default").graph


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", dest="time_limit_s", type=float, default=60.0, help="milp's time limit (s)")
    parser.add_argument("--sequence-length", type=int, default=512, help="the prompt's tokens")
    parser.add_argument(
        "--cut-bound", type=float, default=0.0, metavar="SECONDS", help="add the cut-task bound, with this MILP time"
    )
    options = parser.parse_args()
    table = Table(title=f"Llama plans, latency of a {options.sequence_length}-token prompt (simulated)")
    for column in (
        "model",
        "groups",
        "cluster",
        *BASELINES,
        "milp ms",
        "milp / best other",
        "bound ms",
        *(("cut bound ms", "milp / cut bound") if options.cut_bound else ()),
        "milp s",
        "stopped",
    ):
        table.add_column(column, justify="left" if column in ("model", "cluster", "stopped") else "right")
    for name in CONFIGS:
        graph = llama_graph(name, options.sequence_length)
        for cluster in CLUSTERS:
            problem = build_problem(graph, Cluster.preset(cluster))
            values = {placer: place(problem, placer, objective="latency").objective_s for placer in BASELINES}
            started = time.perf_counter()
            milp = place(problem, "milp", objective="latency", time_limit_s=options.time_limit_s)
            milp_s = time.perf_counter() - started
            best_other = min(values.values())
            cut_bound = segment_lower_bound(problem, options.cut_bound).bound_s if options.cut_bound else None
            table.add_row(
                name,
                str(problem.num_tasks),
                cluster,
                *(f"{values[p] * 1e3:.1f}" for p in BASELINES),
                f"{milp.objective_s * 1e3:.1f}",
                f"{milp.objective_s / best_other:.3f}",
                f"{as_objective('latency').lower_bound_s(problem) * 1e3:.1f}",
                *((f"{cut_bound * 1e3:.1f}", f"{milp.objective_s / cut_bound:.4f}") if cut_bound else ()),
                f"{milp_s:.0f}",
                milp.report.stop_reason.value if milp.report.stop_reason else "",
            )
            print(f"{name} on {cluster} done", flush=True)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
