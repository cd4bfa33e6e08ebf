"""Tensor/expert parallel state, passed explicitly (no module globals)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelState:
    """Where this process sits in the tensor-parallel group.

    `group` is a torch.distributed process group (NCCL on GPU, gloo on CPU) or None for a
    single process, in which case every collective is the identity.

    `collectives=False` (see `without_collectives`) makes every collective a local stand-in that
    returns a tensor of the right shape without talking to other ranks: rank 0 uses it to run a
    memory-profiling forward alone; its numbers are meaningless.
    """

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    collectives: bool = True

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad parallel state: rank {self.tp_rank} of {self.tp_size}")

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    def without_collectives(self) -> ParallelState:
        return dataclasses.replace(self, collectives=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place and return it."""
        if self.tp_size == 1 or not self.collectives:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of `x` over the group, in place."""
        if self.tp_size == 1 or not self.collectives:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` [..., n] along the last dimension, in rank order: [..., n * tp_size]."""
        if self.tp_size == 1:
            return x
        if not self.collectives:
            return x.repeat(*([1] * (x.dim() - 1)), self.tp_size)
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def shard_range(self, total: int, what: str = "") -> tuple[int, int]:
        """This rank's [start, end) of `total` items split evenly (`what` names them in the error)."""
        if total % self.tp_size:
            label = f"{what} = {total}" if what else str(total)
            raise ValueError(f"{label} is not divisible by tensor-parallel size {self.tp_size}")
        per = total // self.tp_size
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def padded_shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of `ceil(total / tp_size)` rows per rank; the last ranks may reach past `total`
        (their extra rows are padding)."""
        per = -(-total // self.tp_size)
        return self.tp_rank * per, (self.tp_rank + 1) * per
