"""Coarsening speed on a synthetic 50,000-op graph, and node/edge counts before and after for the zoo.

The synthetic graph alternates ResNet basic blocks (conv-bn-relu-conv-bn-add-relu with a
residual) and pre-norm transformer blocks (layer norm, q/k/v projections with their reshapes,
SDPA, output projection, residual adds, GELU MLP), the shapes fusion rules meet in practice.

Run: ``python -m bench.coarsen_speed [--ops 50000] [--paper-sizes]``. ``--paper-sizes`` also traces the
zoo's smallest paper size per family (on the meta device) and shows the paper's Table IV counts next to ours.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from bench.models import ZOO, build
from moirai.frontend.coarsen import coarsen, print_coarsening_table
from moirai.frontend.graph import OpEdge, OpGraph, OpNode, build_op_graph
from moirai.frontend.trace import trace

SPEED_TARGET_S = 5.0
TARGET_NODES = 2_000


class _GraphBuilder:
    def __init__(self) -> None:
        self.nodes: list[OpNode] = []
        self.edges: list[OpEdge] = []

    def op(self, target: str, *inputs: int, flops: float = 1e6, tensor_bytes: float = 4096.0) -> int:
        index = len(self.nodes)
        name = f"{target.split('.')[1]}_{index}"
        self.nodes.append(OpNode(name, (target,), (name,), flops, 3 * tensor_bytes, tensor_bytes, frozenset(), 0.0))
        self.edges.extend(OpEdge(i, index, self.nodes[i].name, self.nodes[i].output_bytes) for i in inputs)
        return index

    def resnet_block(self, x: int) -> int:
        y = self.op(
            "aten.relu.default", self.op("aten.batch_norm.default", self.op("aten.conv2d.default", x, flops=5e7))
        )
        y = self.op("aten.batch_norm.default", self.op("aten.conv2d.default", y, flops=5e7))
        return self.op("aten.relu.default", self.op("aten.add.Tensor", y, x))

    def transformer_block(self, x: int) -> int:
        h = self.op("aten.layer_norm.default", x)
        heads = [
            self.op("aten.transpose.int", self.op("aten.view.default", self.op("aten.linear.default", h, flops=2e7)))
            for _ in range(3)
        ]
        attention = self.op("aten.scaled_dot_product_attention.default", *heads, flops=1e7)
        merged = self.op("aten.reshape.default", self.op("aten.transpose.int", attention))
        projected = self.op("aten.dropout.default", self.op("aten.linear.default", merged, flops=2e7))
        x = self.op("aten.add.Tensor", projected, x)
        up = self.op(
            "aten.gelu.default", self.op("aten.linear.default", self.op("aten.layer_norm.default", x), flops=8e7)
        )
        down = self.op("aten.dropout.default", self.op("aten.linear.default", up, flops=8e7))
        return self.op("aten.add.Tensor", down, x)

    def graph(self) -> OpGraph:
        return OpGraph(tuple(self.nodes), tuple(self.edges))


def synthetic_graph(op_count: int) -> OpGraph:
    """About ``op_count`` ops: four ResNet blocks, then four transformer blocks, repeated."""
    builder = _GraphBuilder()
    x = builder.op("aten.conv2d.default")
    while len(builder.nodes) < op_count:
        for _ in range(4):
            x = builder.resnet_block(x)
        for _ in range(4):
            x = builder.transformer_block(x)
    return builder.graph()


def speed_table(op_count: int) -> Table:
    graph = synthetic_graph(op_count)
    table = Table(title=f"Coarsening a synthetic {len(graph.nodes):,}-op graph (target: under {SPEED_TARGET_S:.0f} s)")
    for column in ("stage", "ops", "edges", "coarse ops", "coarse edges", "wall (s)", "CPU (s)"):
        table.add_column(column, justify="left" if column == "stage" else "right", no_wrap=column == "stage")
    for stage, target in (("fusion rules only", None), (f"rules + target {TARGET_NODES:,} nodes", TARGET_NODES)):
        # CPU time too: on a shared machine, wall time also counts other processes' turns.
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        result = coarsen(graph, "default", target_nodes=target)
        wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
        table.add_row(stage, *map(str, (*result.original, *result.coarse)), f"{wall:.2f}", f"{cpu:.2f}")
    return table


def zoo_results(paper_sizes: bool) -> tuple[dict, dict]:
    """Coarsening results for every zoo family (small size, and the smallest paper size if asked)."""
    results, paper_counts = {}, {}
    for name, family in ZOO.items():
        sizes = ["small"] if "small" in family.sizes else []
        if paper_sizes:
            sizes += [size for size, spec in family.sizes.items() if spec.paper_size and spec.paper_ops][:1]
        for size in sizes:
            device = "cpu" if size == "small" else "meta"
            model, args, kwargs = build(name, size, device=device)
            graph = build_op_graph(trace(model, args, kwargs))
            results[f"{name} {size}"] = coarsen(graph, "default")
            paper_counts[f"{name} {size}"] = family.sizes[size].paper_ops
    return results, paper_counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=50_000)
    parser.add_argument("--paper-sizes", action="store_true")
    options = parser.parse_args()
    console = Console()
    console.print(speed_table(options.ops))
    results, paper_counts = zoo_results(options.paper_sizes)
    print_coarsening_table(results, console)
    if options.paper_sizes:
        table = Table(title="Paper Table IV / Fig. 4 op counts (original, coarsened) next to ours")
        for column in ("model", "paper ops", "paper coarsened", "our ops", "our fused ops"):
            table.add_column(column, justify="left" if column == "model" else "right", no_wrap=column == "model")
        for name, counts in paper_counts.items():
            if counts:
                ours = results[name]
                table.add_row(
                    name,
                    str(counts.original),
                    str(counts.coarsened or "-"),
                    str(ours.original.nodes),
                    str(ours.fused.nodes),
                )
        console.print(table)


if __name__ == "__main__":
    main()
