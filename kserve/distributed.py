"""Tensor/expert parallel state, passed explicitly (no module globals)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kserve.config import check_context_parallel


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


@dataclass(frozen=True)
class ContextParallelGroup:
    """Decode context parallelism: the `size` consecutive tensor-parallel ranks that share one KV cache,
    each holding every `size`-th token of every sequence (token t on group rank t % size).

    `group` is the torch.distributed group of those ranks (the world group when they are all of it).
    `collectives=False` gives local stand-ins of the right shapes (tracing, a lone rank's profile).
    """

    size: int
    rank: int
    group: Any = None
    collectives: bool = True

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad context-parallel state: rank {self.rank} of {self.size}")

    def without_collectives(self) -> ContextParallelGroup:
        return dataclasses.replace(self, collectives=False)

    def local_len(self, length: int) -> int:
        """How many of a sequence's first `length` tokens this rank holds."""
        return max(0, -(-(length - self.rank) // self.size))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every group rank's `x`, stacked in group-rank order: [size, *x.shape]."""
        if not self.collectives:
            return x.unsqueeze(0).expand(self.size, *x.shape).contiguous()
        import torch.distributed as dist

        out = x.new_empty(self.size * x.shape[0], *x.shape[1:])  # gloo wants the parts concatenated on dim 0
        dist.all_gather_single(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` [size, *rest] over the group and return this rank's slice [*rest]."""
        if not self.collectives:
            return x[0].clone()
        import torch.distributed as dist

        out = x.new_empty(x.shape[1:])
        dist.reduce_scatter_single(out, x.reshape(-1, *x.shape[2:]), group=self.group)
        return out


def context_parallel_groups(tp_rank: int, tp_size: int, dcp_size: int) -> ContextParallelGroup | None:
    """This rank's decode-context-parallel group; None when `dcp_size` is 1.

    Every tensor-parallel rank must call this with the same sizes and in the same order (creating
    process groups is collective). Groups are consecutive ranks: [g * dcp_size, (g + 1) * dcp_size).
    """
    check_context_parallel(tp_size, dcp_size)
    if dcp_size == 1:
        return None
    import torch.distributed as dist

    if dcp_size == tp_size:
        return ContextParallelGroup(dcp_size, tp_rank, dist.group.WORLD)
    mine = None
    for first in range(0, tp_size, dcp_size):
        group = dist.new_group(list(range(first, first + dcp_size)))
        if first <= tp_rank < first + dcp_size:
            mine = group
    return ContextParallelGroup(dcp_size, tp_rank % dcp_size, mine)

