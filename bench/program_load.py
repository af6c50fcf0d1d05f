"""What loading a part costs a rank: the program as data (moirai.runtime.program_codec) against the pickle it replaced.

Run: ``python -m bench.program_load [--layers 12] [--width 2048] [--repeats 5]``.

A chain of ``Linear(width, width)`` layers split in two by round robin; rank 1's part (:func:`program_for_rank`) is
encoded to bytes and decoded back, as the driver and the rank do for a load header's payload, and the same part
pickled and unpickled for comparison (the pickle here is the bench's own object, never read from anywhere). Medians
of ``repeats`` after one warm-up; the payload's size and :func:`load_bytes` beside it.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

import moirai
from moirai.runtime.program_codec import decode_program, encode_program
from moirai.runtime.protocol import load_bytes, program_for_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(options.width, options.width) for _ in range(options.layers)])
    example = (torch.randn(2, options.width),)
    compiled = moirai.compile(model.eval(), ["cpu", "cpu"], example, placer="round_robin", progress=False)
    part = program_for_rank(compiled.program, 1)
    ways: dict[str, tuple[Callable, Callable]] = {
        "program_codec (data)": (lambda p: encode_program(p).to_bytes(), lambda b: decode_program(b, "the bench")),
        "pickle (before)": (pickle.dumps, pickle.loads),
    }
    table = Table(title=f"rank 1's part of {options.layers} x Linear({options.width}), median of {options.repeats}")
    for column in ("way", "payload MB", "encode ms", "decode ms"):
        table.add_column(column, justify="right" if column != "way" else "left")
    for way, (encode, decode) in ways.items():
        payload = encode(part)
        decode(payload)  # warm-up
        encode_s, decode_s = [], []
        for _ in range(options.repeats):
            start = time.perf_counter()
            payload = encode(part)
            encoded = time.perf_counter()
            decode(payload)
            encode_s.append(encoded - start)
            decode_s.append(time.perf_counter() - encoded)
        ms = lambda values: f"{statistics.median(values) * 1e3:.0f}"  # noqa: E731
        table.add_row(way, f"{len(payload) / 1e6:.1f}", ms(encode_s), ms(decode_s))
    Console().print(table)
    print(f"load_bytes(program, 1) = {load_bytes(compiled.program, 1) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
