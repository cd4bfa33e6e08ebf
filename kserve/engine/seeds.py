"""Per-completion sampling seeds derived from a request's seed."""

from __future__ import annotations

from kserve.engine.sampler import SEED_STRIDE

_SEED_MASK = (1 << 63) - 1


def completion_seed(seed: int, index: int) -> int:
    """Completion `index`'s seed, folded into [0, 2**63) so that any int64 seed (negative too) fits."""
    return (seed + index * SEED_STRIDE) & _SEED_MASK
