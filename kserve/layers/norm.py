"""RMSNorm, computed in fp32 and cast back before the weight (as DeepSeek-V3 and transformers do)."""

from __future__ import annotations

import torch
from torch import nn

from kserve.kernels.rmsnorm import rms_norm
from kserve.layers.weight_loading import copy_checked


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, loaded, "norm weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
