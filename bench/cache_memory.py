"""Where a split LLM's KV cache takes memory: the calling process and a serving rank, against the cache's size.

Run: ``python -m bench.cache_memory [--layers 8] [--hidden 256] [--slots 8] [--max-seq-len 8192]`` (Linux: reads
``/proc``).

A Llama-style model from a config with random weights is compiled with ``compile_lm`` on two logical CPU devices
(round robin, so each device holds half the layers and half the cache). The table gives the cache's bytes, the
calling process's resident memory added by ``compile_lm`` (it traces the whole step, every layer's cache with it),
rank 1's load payload (``load_bytes``) and the resident memory of rank 1's process after the server has generated
(its peak too), then the calling process after a local ``generate`` and rank 1's payload then (a cache a local
``generate`` has written is state: the blocks it wrote travel). [Note: zeros where they are used] in
moirai/runtime/zero_pages.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import LlamaConfig, LlamaForCausalLM

import moirai
from moirai.runtime.protocol import load_bytes
from moirai.runtime.rank_processes import started_ranks


def _resident_gb(pid: int | str = "self") -> tuple[float, float]:
    """The process's resident memory now and at its peak, GB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1e6, int(fields["VmHWM"].split()[0]) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    options = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=options.hidden, intermediate_size=2 * options.hidden, num_hidden_layers=options.layers,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=1000, max_position_embeddings=options.max_seq_len,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    before_gb, _ = _resident_gb()
    lm = moirai.compile_lm(
        model, ["cpu", "cpu"], max_batch_size=options.slots, max_seq_len=options.max_seq_len, placer="round_robin",
        progress=False,
    )  # fmt: skip
    compiled_gb, _ = _resident_gb()
    cache_gb = lm.cache.total_bytes / 1e9
    payload_gb = load_bytes(lm.compiled.program, 1) / 1e9
    prompt = torch.randint(0, config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with lm.server() as server:
        served = server.generate(prompt, max_new_tokens=8)
        ranks = [_resident_gb(pid) for pid in (rank.pid for rank in started_ranks())]
    rank_gb, rank_peak_gb = max(ranks) if ranks else (float("nan"), float("nan"))
    local = lm.generate(prompt, max_new_tokens=8)
    local_gb, _ = _resident_gb()
    payload_after_local_gb = load_bytes(lm.compiled.program, 1) / 1e9  # the cache a local generate wrote
    table = Table(title=f"KV cache {cache_gb:.2f} GB ({options.layers} layers, {options.slots} slots x "
                  f"{options.max_seq_len} tokens), half of it on each of two CPU devices")  # fmt: skip
    for column in ("what", "GB"):
        table.add_column(column)
    rows = {
        "calling process: added by compile_lm": compiled_gb - before_gb,
        "rank 1: load payload": payload_gb,
        "rank 1: resident after serving": rank_gb,
        "rank 1: peak resident": rank_peak_gb,
        "calling process: added after a local generate": local_gb - before_gb,
        "rank 1: load payload after a local generate": payload_after_local_gb,
    }
    for what, value in rows.items():
        table.add_row(what, f"{value:.3f}")
    console = Console()
    console.print(table)
    console.print(f"served tokens equal the local run's: {torch.equal(served, local)}")


if __name__ == "__main__":
    main()
