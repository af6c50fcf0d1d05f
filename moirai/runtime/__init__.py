"""Run a split program: all parts in one process, or one process per device with torch.distributed."""

from moirai.runtime import orphans  # noqa: F401  (first: a spawned rank watches rank 0 while importing torch)
from moirai.runtime.distributed import DistributedRunner, run_distributed, run_rank, serve_rank
from moirai.runtime.local import run_local
from moirai.runtime.server import Server

__all__ = ["DistributedRunner", "Server", "run_distributed", "run_local", "run_rank", "serve_rank"]
