"""What a view and an embedding lookup cost: the analytic model against measured profiles on this CPU.

Run: ``python -m bench.view_and_lookup_costs [--vocab 32000] [--dim 1024] [--tokens 16] [--rounds 3]``.

A small language model with a tied embedding (the head multiplies by the table's transpose, ``aten.numpy_T``, a
view) is traced per op. For the lookup, the view and the head it prints the bytes each op reads and writes under
the old rule (every input and the output: the whole table for the lookup, twice the table for the view) and the
current one (:func:`moirai.frontend.graph.build_op_graph`: a view moves nothing, a lookup the rows it gathers), the
analytic times both give on the detected CPU (one thread's share of its peak) and the time every op takes measured
inside runs of the whole graph (:func:`moirai.cluster.cost.profile_nodes`, thread CPU time, median over rounds of
fresh profiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from moirai.cluster.cost import analytic_compute_s, node_dtypes, profile_nodes
from moirai.cluster.devices import Cluster
from moirai.frontend.graph import _nbytes, build_op_graph
from moirai.frontend.trace import trace


class TiedLM(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.mix(self.embed(ids))) @ self.embed.weight.T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = TiedLM(args.vocab, args.dim).eval()
    ids = torch.randint(0, args.vocab, (1, args.tokens))
    traced = trace(model, (ids,))
    graph = build_op_graph(traced)
    detected = Cluster.detect().devices[0]
    share = 1 / max(1, os.cpu_count() or 1)  # one thread of the detected CPU's cores
    device = dataclasses.replace(detected, peak_flops=detected.peak_flops * share)
    cluster = Cluster.from_links([device], [])
    analytic = analytic_compute_s(graph, cluster, node_dtypes(graph, traced))[:, 0]
    fx_nodes = {n.name: n for n in traced.graph_module.graph.nodes}
    old_bytes = [
        float(sum(_nbytes(i.meta.get("val")) for i in fx_nodes[n.name].all_input_nodes))
        + _nbytes(fx_nodes[n.name].meta.get("val"))
        for n in graph.nodes
    ]
    old_graph = dataclasses.replace(
        graph,
        nodes=tuple(dataclasses.replace(n, bytes_moved=b) for n, b in zip(graph.nodes, old_bytes, strict=True)),
    )
    old_analytic = analytic_compute_s(old_graph, cluster, node_dtypes(graph, traced))[:, 0]
    measured = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="moirai-profiles-") as cache_dir:
            measured.append(
                profile_nodes(graph, traced, "cpu", cache_dir=cache_dir, progress=False, clock=time.thread_time)
            )
    measured_s = [statistics.median(m[i] for m in measured) for i in range(len(graph.nodes))]
    table = Table(title=f"TiedLM vocab {args.vocab} x dim {args.dim}, {args.tokens} tokens, 1 thread")
    for column in ("op", "bytes old rule", "bytes now", "analytic old", "analytic now", "measured"):
        table.add_column(column, justify="left" if column == "op" else "right")
    for i, node in enumerate(graph.nodes):
        table.add_row(
            node.targets[0],
            f"{old_bytes[i] / 1e6:.2f} MB",
            f"{node.bytes_moved / 1e6:.2f} MB",
            f"{old_analytic[i] * 1e3:.3f} ms",
            f"{analytic[i] * 1e3:.3f} ms",
            f"{measured_s[i] * 1e3:.3f} ms",
        )
    table.add_row(
        "total",
        "",
        "",
        f"{old_analytic.sum() * 1e3:.3f} ms",
        f"{analytic.sum() * 1e3:.3f} ms",
        f"{sum(measured_s) * 1e3:.3f} ms",
    )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
