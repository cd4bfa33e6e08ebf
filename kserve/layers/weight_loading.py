"""The one shape-checked copy every parameter's weight loader ends in."""

from __future__ import annotations

import torch


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str = "tensor") -> None:
    """Copy `loaded` into `target` (a parameter or a view of one), refusing a shape mismatch by name."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: loaded shape {tuple(loaded.shape)} != parameter shape {tuple(target.shape)}")
    target.copy_(loaded)
