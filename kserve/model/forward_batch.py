"""The contract between the model runner and the model: one step's flat batch of tokens.

A step computes `num_tokens` new tokens drawn from `num_seqs` sequences, laid out sequence by
sequence. Sequence i contributes `query_lens[i]` new tokens at positions
`context_lens[i] - query_lens[i] .. context_lens[i] - 1`; the earlier `context_lens[i] - query_lens[i]`
tokens are already in the paged latent cache (prefix-cache hits or earlier prefill chunks).

Each new token's latent (c_kv then roped k_pe, `kv_cache_dim` values) is written to cache slot
`slot_mapping[t]` = block_id * block_size + offset. Attention for sequence i reads its context from
the blocks listed in `block_tables[i]`.

Sequences with query_len == 1 take the absorbed (decode) MLA path; the others take the naive
(prefill) path over their gathered context. Both read the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    context_lens: torch.Tensor  # [B] int32, on device
    query_lens: list[int]  # host copy, per sequence
    context_lens_host: list[int]  # host copy, per sequence
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @classmethod
    def contiguous(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_size: int,
        first_block: int = 0,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """A batch whose sequences own consecutive, disjoint blocks starting at `first_block`.

        For tests and simple callers that manage no block allocator: sequence i owns
        ceil(max_context/block_size) blocks, placed one after another.
        """
        max_blocks = max(-(-c // block_size) for c in context_lens)
        tables, slots, positions = [], [], []
        next_block = first_block
        for q, c in zip(query_lens, context_lens):
            table = list(range(next_block, next_block + max_blocks))
            next_block += max_blocks
            tables.append(table)
            for pos in range(c - q, c):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        return cls(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_lens=list(query_lens),
            context_lens_host=list(context_lens),
            block_size=block_size,
        )
