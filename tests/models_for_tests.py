"""Small models that exercise the splitter, and a helper that assigns ops to devices in contiguous chunks."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moirai.frontend.graph import build_op_graph
from moirai.frontend.trace import TracedModel


def contiguous_assignment(traced: TracedModel, num_devices: int, cuts: list[float] | None = None) -> dict[str, int]:
    """Every op's device: the OpGraph's nodes in graph order cut into ``num_devices`` contiguous chunks.

    ``cuts`` are the chunk boundaries as fractions of the node count (default: equal chunks).
    Ops grouped in one OpGraph node (a multi-output op and its getitems) stay together.
    """
    graph = build_op_graph(traced)
    fractions = np.linspace(0, 1, num_devices + 1)[1:-1] if cuts is None else np.asarray(cuts)
    boundaries = np.round(fractions * len(graph.nodes)).astype(int)
    device_of_node = np.searchsorted(boundaries, np.arange(len(graph.nodes)), side="right")
    return {name: int(device_of_node[i]) for i, node in enumerate(graph.nodes) for name in node.fx_names}


def random_assignment(traced: TracedModel, num_devices: int, seed: int) -> tuple[dict[str, int], list[list[str]]]:
    """A random device for every OpGraph node, and per-device orders from one random topological order."""
    graph = build_op_graph(traced)
    rng = np.random.default_rng(seed)
    device_of_node = rng.integers(num_devices, size=len(graph.nodes))
    dag = graph.to_networkx()
    waiting = {i: dag.in_degree(i) for i in dag}
    ready = [i for i, count in waiting.items() if count == 0]
    device_order: list[list[str]] = [[] for _ in range(num_devices)]
    while ready:
        node = ready.pop(int(rng.integers(len(ready))))
        device_order[device_of_node[node]] += graph.nodes[node].fx_names
        for successor in dag.successors(node):
            waiting[successor] -= 1
            if waiting[successor] == 0:
                ready.append(successor)
    node_device = {name: int(device_of_node[i]) for i, node in enumerate(graph.nodes) for name in node.fx_names}
    return node_device, device_order


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class ResidualBlock(nn.Module):
    """``stem``'s output skips over two layers to the final add."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.inner = nn.Linear(16, 16)
        self.outer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.stem(x))
        return torch.relu(self.outer(torch.relu(self.inner(skip))) + skip)


class KwargsDictOutput(nn.Module):
    """Keyword inputs, and a dict holding a tensor and a tuple of tensors as output."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(8, 12)
        self.decode = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: torch.Tensor) -> dict:
        hidden = torch.tanh(self.encode(x)) * mask
        first, second = hidden.split(6, dim=-1)
        return {"logits": self.decode(hidden) * scale, "parts": (first.sum(-1), second)}


class TiedEmbedding(nn.Module):
    """The embedding matrix is also the output projection (as in language models)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(self.body(self.embedding(tokens)), self.embedding.weight)


class FanOut(nn.Module):
    """``trunk`` feeds two branches and the final add; branch ``left`` reads it twice."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.left = nn.Linear(16, 16)
        self.right = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trunk = torch.sigmoid(self.trunk(x))
        left = self.left(trunk) * trunk
        right = torch.tanh(self.right(trunk))
        return left + right + trunk


class DoublesAndReturns(nn.Module):
    """Reads its input, doubles it in place, returns it and a value computed from both."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x).relu()
        x.mul_(2)
        return x, y + x


TINY_LLAMA_VOCAB = 512


def tiny_llama(layers: int = 2, seed: int = 0, hidden_size: int = 64) -> nn.Module:
    """A Hugging Face Llama of random weights, small enough to trace, split and generate with in seconds."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=TINY_LLAMA_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config).eval()
