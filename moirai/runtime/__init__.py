"""Run a split program: all parts in one process, or one process per device with torch.distributed."""

from moirai.runtime.distributed import DistributedRunner, run_distributed, run_rank
from moirai.runtime.local import run_local

__all__ = ["DistributedRunner", "run_distributed", "run_local", "run_rank"]
