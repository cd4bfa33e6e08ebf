"""Tensor/expert parallel state, passed explicitly (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelState:
    """Where this process sits in the tensor-parallel group.

    `group` is a torch.distributed process group (NCCL on GPU, gloo on CPU) or None for a
    single process, in which case every collective is the identity.
    """

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad parallel state: rank {self.tp_rank} of {self.tp_size}")

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place and return it."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def shard_range(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of `total` items split evenly."""
        if total % self.tp_size:
            raise ValueError(f"{total} is not divisible by tensor-parallel size {self.tp_size}")
        per = total // self.tp_size
        return self.tp_rank * per, (self.tp_rank + 1) * per
