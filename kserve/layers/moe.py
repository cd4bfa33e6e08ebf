"""Mixture of experts as DeepSeek-V3 / Kimi K2 compute it (noaux_tc routing).

The fp32 router picks each token's experts; this rank's whole experts run in one fused-MoE call, and the routed
and shared partial outputs share one all-reduce. Details: docs/model.md, 'Mixture of experts'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve.config import ModelConfig
from kserve.distributed import ParallelState
from kserve.kernels import batch_invariant as bi
from kserve.kernels.fp8_dequant import scale_shape
from kserve.kernels.fused_moe import fused_moe
from kserve.kernels.fused_moe_w4a16 import fused_moe_w4a16
from kserve.kernels.int4_pack import group_scale_shape, packed_shape
from kserve.layers.mlp import GatedMLP
from kserve.layers.weight_loading import copy_checked


class NoAuxRouter(nn.Module):
    """The `mlp.gate` module: router weight and the selection-only correction bias, both kept in fp32.

    The loader copies the checkpoint's tensors straight into these fp32 parameters (bf16 weight
    widened exactly, fp32 bias bit for bit), never through the model dtype; forward is fp32 too.
    """

    def __init__(self, config: ModelConfig, *, device: torch.device | str):
        super().__init__()
        self.batch_invariant = False
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
        if self.batch_invariant:
            scores = bi.sigmoid(bi.linear_rows(x.float(), self.weight))
        else:
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
            total = bi.sum_fixed_order(weights, -1)[:, None] if self.batch_invariant else weights.sum(-1, keepdim=True)
            weights = weights / total
        return weights * self.routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    """This rank's experts, stacked: gate_up [E_local, 2I, H] (gate rows first), down [E_local, H, I], in one of
    three storages, as the checkpoint has them:

    - dense (`gate_up_proj`, `down_proj` in the model dtype);
    - block FP8 (`quant_block`): float8_e4m3fn values plus fp32 `*_scale_inv` [E_local, rows/B0, ceil(cols/B1)],
      the layout `kserve.kernels.fused_moe` takes; gate over up keeps each half on its own scale rows only when
      I is a multiple of the block, so that is required;
    - INT4 (`int4_group`): `gate_up_proj_packed` int32 [E_local, 2I, H/8] and `down_proj_packed` [E_local, H, I/8]
      with bf16 `*_scale` [E_local, rows, cols/G], packed as the checkpoint stores them (kserve.kernels.int4_pack)
      and run by `kserve.kernels.fused_moe_w4a16` without unpacking in memory.

    Experts are never split: each expert-parallel rank reads and holds whole experts
    [first_expert, first_expert + E_local).
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_block: tuple[int, int] | None = None,
        int4_group: int | None = None,
    ):
        super().__init__()
        self.batch_invariant = False
        self.first_expert, last = parallel.shard_range(config.n_routed_experts, "n_routed_experts")
        self.num_local = last - self.first_expert
        inter, hidden = config.moe_intermediate_size, config.hidden_size
        self.intermediate = inter
        self.compute_dtype = dtype
        self.block = tuple(quant_block) if quant_block is not None else None
        self.int4_group = int4_group
        if self.block is not None and inter % self.block[0]:
            raise ValueError(
                f"moe_intermediate_size = {inter} is not a multiple of the FP8 block {self.block[0]}: "
                "stacked FP8 experts need whole blocks (load with weights='dequantized')"
            )

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            p = nn.Parameter(torch.empty(self.num_local, *shape, dtype=dtype, device=device), requires_grad=False)
            p.weight_loader = self.weight_loader
            return p

        # Rows of each stored tensor that belong to the gate half of gate_up (the rest are up's).
        self._gate_rows: dict[str, int] = {}
        if int4_group is not None:
            self.gate_up_proj_packed = param(*packed_shape(2 * inter, hidden), dtype=torch.int32)
            self.down_proj_packed = param(*packed_shape(hidden, inter), dtype=torch.int32)
            self.gate_up_proj_scale = param(*group_scale_shape(2 * inter, hidden, int4_group), dtype=torch.bfloat16)
            self.down_proj_scale = param(*group_scale_shape(hidden, inter, int4_group), dtype=torch.bfloat16)
            self._gate_rows = {"gate_up_proj_packed": inter, "gate_up_proj_scale": inter}
        else:
            wdtype = torch.float8_e4m3fn if self.block else dtype
            self.gate_up_proj = param(2 * inter, hidden, dtype=wdtype)
            self.down_proj = param(hidden, inter, dtype=wdtype)
            self._gate_rows = {"gate_up_proj": inter}
            if self.block:
                self.gate_up_proj_scale_inv = param(*scale_shape((2 * inter, hidden), self.block), dtype=torch.float32)
                self.down_proj_scale_inv = param(*scale_shape((hidden, inter), self.block), dtype=torch.float32)
                self._gate_rows["gate_up_proj_scale_inv"] = inter // self.block[0]

    def owns(self, expert_id: int) -> bool:
        return self.first_expert <= expert_id < self.first_expert + self.num_local

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str) -> None:
        """Store one expert's gate, up or down weight (or its scale) from the checkpoint."""
        if not self.owns(expert_id):
            raise ValueError(f"expert {expert_id} is not on this rank (it holds {self.first_expert}..{self.first_expert + self.num_local - 1})")
        local = expert_id - self.first_expert
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        split = self._gate_rows.get(name)
        if shard_id == "gate" and split is not None:
            copy_checked(param.data[local, :split], loaded)
        elif shard_id == "up" and split is not None:
            copy_checked(param.data[local, split:], loaded)
        elif shard_id == "down" and split is None:
            copy_checked(param.data[local], loaded)
        else:
            raise ValueError(f"expert shard {shard_id!r} does not load into {name}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) over this rank's experts (others give 0).

        One custom-op call (Triton on CUDA, loop-free torch elsewhere): no host reads. The batch-invariant
        mode's torch path reads the expert segment ends on the host.
        """
        if self.int4_group is not None:
            return fused_moe_w4a16(
                x, self.gate_up_proj_packed, self.down_proj_packed, weights, ids, self.first_expert,
                self.gate_up_proj_scale, self.down_proj_scale, self.int4_group, batch_invariant=self.batch_invariant,
            )
        if self.block:
            return fused_moe(
                x, self.gate_up_proj, self.down_proj, weights, ids, self.first_expert,
                self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.block, batch_invariant=self.batch_invariant,
            )
        return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, self.first_expert,
                         batch_invariant=self.batch_invariant)


class DeepseekMoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_block: tuple[int, int] | None = None,
        int4_group: int | None = None,
    ):
        super().__init__()
        self.batch_invariant = False
        self.parallel = parallel
        self.gate = NoAuxRouter(config, device=device)
        self.experts = RoutedExperts(
            config, parallel, dtype=dtype, device=device, quant_block=quant_block, int4_group=int4_group
        )
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
        if self.batch_invariant:
            return bi.all_reduce_fixed_order(self.parallel, out)
        return self.parallel.all_reduce(out)
