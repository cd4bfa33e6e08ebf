"""Owns the model and its paged latent KV cache; runs one scheduled step.

The cache is one tensor `[num_layers, num_blocks, block_size, kv_cache_dim]` in the model dtype.
A step's sequences are flattened into `StepInputs` (plain lists, cheap to send to tensor-parallel
workers) and then into one `ForwardBatch` (see kserve/model/forward_batch.py); the model writes each
new token's latent into its slot and attends over the sequence's block table. Only the rows whose
chunk ends at the sequence's last token go through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kserve.config import EngineConfig, ModelConfig
from kserve.engine.scheduler import ScheduledSeq
from kserve.model.forward_batch import ForwardBatch


def num_kv_blocks_for(config: EngineConfig, bytes_per_token: int, device: torch.device) -> int:
    """How many cache blocks fit in the memory the config allows."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    bytes_per_block = bytes_per_token * config.block_size
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = min(free, int(total * config.gpu_memory_utilization) - (total - free))
    else:
        budget = config.kv_cache_cpu_bytes
    return max(1, budget // bytes_per_block)


@dataclass
class StepInputs:
    """One step, host side: what every tensor-parallel rank needs to run the same forward."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]  # padded with -1
    query_lens: list[int]
    context_lens: list[int]
    sample_rows: list[int]  # rows of the flat batch whose logits are sampled


class StepBroadcaster(Protocol):
    """Sends each step to the other tensor-parallel ranks (see tp_workers.py)."""

    def broadcast(self, inputs: StepInputs) -> None: ...


class ModelRunner:
    def __init__(
        self,
        model: Any,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        peers: StepBroadcaster | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.peers = peers
        self.kv_cache = torch.zeros(
            model_config.num_hidden_layers,
            num_blocks,
            block_size,
            model_config.kv_cache_dim,
            dtype=dtype,
            device=device,
        )
        # A CUDA-graph decode path would go here: capture `self.model` for padded decode batch
        # sizes with static input buffers, and replay it from `execute` when every query_len is 1.

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        """Flatten a step's scheduled sequences into StepInputs."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            table = seq.block_table
            if item.num_new_tokens == 1:  # decode: the common case, kept cheap
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                query_lens.append(1)
                context_lens.append(start + 1)
                if start + 1 == len(seq.token_ids):
                    sample_rows.append(len(input_ids) - 1)
                continue
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            if end == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
        max_blocks = max(len(item.seq.block_table) for item in scheduled)
        tables = [item.seq.block_table + [-1] * (max_blocks - len(item.seq.block_table)) for item in scheduled]
        return StepInputs(input_ids, positions, slots, tables, query_lens, context_lens, sample_rows)

    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; return float32 logits for the sampling rows, in scheduled order."""
        inputs = self.prepare(scheduled)
        if self.peers is not None:
            self.peers.broadcast(inputs)
        return self.execute(inputs)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """The forward for StepInputs; every tensor-parallel rank runs exactly this."""
        dev = self.device
        batch = ForwardBatch(
            positions=torch.tensor(inputs.positions, dtype=torch.long).to(dev, non_blocking=True),
            slot_mapping=torch.tensor(inputs.slots, dtype=torch.long).to(dev, non_blocking=True),
            # numpy builds a 2-D int array from nested lists several times faster than torch.tensor
            block_tables=torch.from_numpy(np.array(inputs.block_tables, dtype=np.int32)).to(dev, non_blocking=True),
            context_lens=torch.tensor(inputs.context_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_lens=inputs.query_lens,
            context_lens_host=inputs.context_lens,
            block_size=self.block_size,
        )
        input_ids = torch.tensor(inputs.input_ids, dtype=torch.long).to(dev, non_blocking=True)
        hidden = self.model(input_ids, batch, self.kv_cache)
        if not inputs.sample_rows:
            return torch.empty(0, 0, device=dev)
        rows = torch.tensor(inputs.sample_rows, dtype=torch.long).to(dev, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()
