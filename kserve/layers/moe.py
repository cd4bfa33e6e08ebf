"""Mixture of experts as DeepSeek-V3 / Kimi K2 compute it (noaux_tc routing).

Routing: sigmoid scores; the correction bias only selects experts; group-limited top-k when
n_group > 1 (groups ranked by the sum of their top-2 biased scores, others masked with -inf);
weights are the unbiased scores of the chosen experts, renormalized, times routed_scaling_factor.
Experts are expert-parallel: each rank owns n_routed_experts / tp_size whole experts; the routed
and shared partial outputs are summed over ranks with one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve.config import ModelConfig
from kserve.distributed import ParallelState
from kserve.kernels.fp8_dequant import dequantize_blocks, scale_shape
from kserve.layers.mlp import GatedMLP
from kserve.layers.weight_loading import copy_checked

try:  # H3's fused MoE (custom op kserve::fused_moe), when present
    from kserve.kernels.fused_moe import fused_moe as _fused_moe
except ImportError:  # pragma: no cover
    _fused_moe = None


class NoAuxRouter(nn.Module):
    """The `mlp.gate` module: router weight and the selection-only correction bias, both kept in fp32.

    The loader copies the checkpoint's tensors straight into these fp32 parameters (bf16 weight
    widened exactly, fp32 bias bit for bit), never through the model dtype; forward is fp32 too.
    """

    def __init__(self, config: ModelConfig, *, device: torch.device | str):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32, device=device),
            requires_grad=False,
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(config.n_routed_experts, dtype=torch.float32, device=device), requires_grad=False
        )
        for p in (self.weight, self.e_score_correction_bias):
            p.weight_loader = lambda param, loaded: copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (weights [T, top_k] fp32, expert ids [T, top_k])."""
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(t, e)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    """This rank's experts, stacked: gate_up_proj [E_local, 2I, H] (gate rows first), down_proj [E_local, H, I].

    With `quant_block` they hold the checkpoint's float8_e4m3fn values with stacked fp32 scales
    `gate_up_proj_scale_inv` [E_local, 2I/B0, ceil(H/B1)] and `down_proj_scale_inv` [E_local, ceil(H/B0), I/B1]:
    the layout `kserve.kernels.fused_moe` takes. Stacking gate over up keeps each half on its own scale
    rows only when I is a multiple of the block, so that is required. Experts are never split: each
    expert-parallel rank reads and holds whole experts [first_expert, first_expert + E_local).
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.first_expert, last = parallel.shard_range(config.n_routed_experts, "n_routed_experts")
        self.num_local = last - self.first_expert
        inter, hidden = config.moe_intermediate_size, config.hidden_size
        self.intermediate = inter
        self.compute_dtype = dtype
        self.block = tuple(quant_block) if quant_block is not None else None
        if self.block is not None and inter % self.block[0]:
            raise ValueError(
                f"moe_intermediate_size = {inter} is not a multiple of the FP8 block {self.block[0]}: "
                "stacked FP8 experts need whole blocks (load with weights='dequantized')"
            )
        wdtype = torch.float8_e4m3fn if self.block else dtype
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden, dtype=wdtype, device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden, inter, dtype=wdtype, device=device), requires_grad=False)
        params = [self.gate_up_proj, self.down_proj]
        if self.block:
            self.gate_up_proj_scale_inv = nn.Parameter(
                torch.empty(self.num_local, *scale_shape((2 * inter, hidden), self.block), dtype=torch.float32, device=device),
                requires_grad=False,
            )
            self.down_proj_scale_inv = nn.Parameter(
                torch.empty(self.num_local, *scale_shape((hidden, inter), self.block), dtype=torch.float32, device=device),
                requires_grad=False,
            )
            params += [self.gate_up_proj_scale_inv, self.down_proj_scale_inv]
        for p in params:
            p.weight_loader = self.weight_loader

    def owns(self, expert_id: int) -> bool:
        return self.first_expert <= expert_id < self.first_expert + self.num_local

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str) -> None:
        """Store one expert's gate, up or down weight (or its scale) from the checkpoint."""
        if not self.owns(expert_id):
            raise ValueError(f"expert {expert_id} is not on this rank (it holds {self.first_expert}..{self.first_expert + self.num_local - 1})")
        local = expert_id - self.first_expert
        is_scale = param is getattr(self, "gate_up_proj_scale_inv", None) or param is getattr(self, "down_proj_scale_inv", None)
        split = self.intermediate // self.block[0] if is_scale else self.intermediate
        if shard_id == "gate":
            copy_checked(param.data[local, :split], loaded)
        elif shard_id == "up":
            copy_checked(param.data[local, split:], loaded)
        elif shard_id == "down":
            copy_checked(param.data[local], loaded)
        else:
            raise ValueError(f"unknown expert shard {shard_id!r}")

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.block:
            return self.gate_up_proj[e], self.down_proj[e]
        return (
            dequantize_blocks(self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], self.block, self.compute_dtype),
            dequantize_blocks(self.down_proj[e], self.down_proj_scale_inv[e], self.block, self.compute_dtype),
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) over this rank's experts (others give 0).

        One kserve::fused_moe call (Triton on CUDA, loop-free torch elsewhere): no host reads.
        """
        if _fused_moe is None:  # pragma: no cover - only until kernels/fused_moe.py is present
            return self._forward_per_expert(x, weights, ids)
        if self.block:
            return _fused_moe(
                x, self.gate_up_proj, self.down_proj, weights, ids, self.first_expert,
                self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.block,
            )
        return _fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, self.first_expert)

    def _forward_per_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        local_ids = ids - self.first_expert
        for e in torch.unique(local_ids).tolist():
            if not 0 <= e < self.num_local:
                continue
            token_idx, slot = torch.where(local_ids == e)
            w_gate_up, w_down = self._weights(e)
            gate, up = F.linear(x[token_idx], w_gate_up).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w_down)
            out.index_put_((token_idx,), y * weights[token_idx, slot, None].to(y.dtype), accumulate=True)
        return out


class DeepseekMoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.parallel = parallel
        self.gate = NoAuxRouter(config, device=device)
        self.experts = RoutedExperts(config, parallel, dtype=dtype, device=device, quant_block=quant_block)
        self.shared_experts = (
            GatedMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                parallel,
                dtype=dtype,
                device=device,
                reduce_results=False,
                quant_block=quant_block,
            )
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.parallel.all_reduce(out)
