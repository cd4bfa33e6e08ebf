"""The contract between the model runner and the model: one step's metadata, built once per step.

A step computes `num_tokens` new tokens drawn from `num_seqs` sequences, laid out sequence by
sequence. Sequence i contributes `query_lens[i]` new tokens at positions
`context_lens[i] - query_lens[i] .. context_lens[i] - 1`; the earlier `context_lens[i] - query_lens[i]`
tokens are already in the paged latent cache (prefix-cache hits or earlier prefill chunks).

Each new token's latent (c_kv then roped k_pe, `kv_cache_dim` values) is written to cache slot
`slot_mapping[t]` = block_id * block_size + offset. Attention for sequence i reads its context from
the blocks listed in `block_tables[i]`.

Decode/prefill split: the first `num_decode_seqs` sequences have one new token each and take the
absorbed MLA path (rows 0..num_decode_seqs-1 of the flat batch). Every later sequence, whatever its
query length, is a "prefill" sequence: the naive path over its context, all of them in one varlen
attention call described by `prefill`. The model runner orders decodes first, so in an engine step
only prefill chunks follow; a batch built in another order is still correct, only slower.

Everything here is built by the runner from host (scheduler) data; the model reads it and never
reads a device tensor back on the host. Layers do no per-step bookkeeping of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Largest block-diagonal prefill mask (query tokens x context tokens) built for the SDPA fallback.
DENSE_MASK_MAX_ELEMENTS = 1 << 20


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The cache slot of token `position` of a sequence with this block table."""
    return block_table[position // block_size] * block_size + position % block_size


def block_causal_mask(
    query_lens: tuple[int, ...], context_lens: tuple[int, ...], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
) -> torch.Tensor:
    """[sum(query_lens), sum(context_lens)] bool: query j of sequence i sees positions 0..context_lens[i] -
    query_lens[i] + j of its own context and nothing of the others'. Device ops on host-known sizes."""
    device = cu_seqlens_q.device
    num_q, num_k = sum(query_lens), sum(context_lens)
    seqs = torch.arange(len(query_lens), device=device)
    q_lens = torch.tensor(query_lens, device=device)
    k_lens = torch.tensor(context_lens, device=device)
    q_seq = torch.repeat_interleave(seqs, q_lens, output_size=num_q)
    k_seq = torch.repeat_interleave(seqs, k_lens, output_size=num_k)
    q_pos = torch.arange(num_q, device=device) - cu_seqlens_q[q_seq] + (k_lens - q_lens)[q_seq]
    k_pos = torch.arange(num_k, device=device) - cu_seqlens_k[k_seq]
    return (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])


@dataclass(frozen=True)
class PrefillMetadata:
    """The prefill sequences of a step: sequences num_decode_seqs..num_seqs-1, tokens token_start.. of the batch.

    Their contexts (cached prefix plus the new tokens, which the layer writes before attending) are
    read from the paged cache in one gather through `context_slots`, then attended with causal
    masking aligned at the end of each context (query j of sequence i sits at position
    context_lens[i] - query_lens[i] + j).
    """

    token_start: int  # first prefill row of the flat batch
    query_lens: tuple[int, ...]  # host, per prefill sequence
    context_lens: tuple[int, ...]  # host, per prefill sequence
    cu_seqlens_q: torch.Tensor  # [P + 1] int32, query offsets relative to token_start
    cu_seqlens_k: torch.Tensor  # [P + 1] int32, offsets into context_slots
    context_slots: torch.Tensor  # [sum(context_lens)] int64, cache slot of every context position
    # [num_tokens, num_context_tokens] bool, True where a query may attend: the block-diagonal causal
    # mask for one SDPA call over all prefill sequences. Built only for several sequences whose mask
    # stays small (DENSE_MASK_MAX_ELEMENTS); otherwise None and SDPA runs per sequence.
    dense_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_context_tokens(self) -> int:
        return sum(self.context_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens)


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    context_lens: torch.Tensor  # [B] int32, on device
    query_start_loc: torch.Tensor  # [B + 1] int32: cu_seqlens of the queries over all sequences
    query_lens: list[int]  # host copy, per sequence
    context_lens_host: list[int]  # host copy, per sequence
    block_size: int
    num_decode_seqs: int  # leading sequences with one new token each (the absorbed path)
    prefill: PrefillMetadata | None  # the remaining sequences, None when there are none
    # Latents are stored in the cache as latent / kv_scale (one global scale, see
    # layers/mla_attention.py write_latents); readers multiply by it. 1.0 for a model-dtype cache.
    kv_scale: float = 1.0

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.prefill is None

    @classmethod
    def build(
        cls,
        *,
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        kv_scale: float = 1.0,
    ) -> ForwardBatch:
        """All of a step's metadata from host lists (block table rows may differ in length)."""
        num_seqs = len(query_lens)
        if not num_seqs or len(context_lens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError(
                f"query_lens ({len(query_lens)}), context_lens ({len(context_lens)}) and block_tables "
                f"({len(block_tables)}) must name the same, non-zero number of sequences"
            )
        num_tokens = sum(query_lens)
        if len(positions) != num_tokens or len(slots) != num_tokens:
            raise ValueError(f"{len(positions)} positions and {len(slots)} slots for {num_tokens} query tokens")
        for i, (q, c) in enumerate(zip(query_lens, context_lens)):
            if q < 1 or c < q or len(block_tables[i]) * block_size < c:
                raise ValueError(
                    f"sequence {i}: query_len {q}, context_len {c} and {len(block_tables[i])} blocks of "
                    f"{block_size} do not fit together"
                )
        num_decode = 0
        while num_decode < num_seqs and query_lens[num_decode] == 1:
            num_decode += 1

        max_blocks = max(len(t) for t in block_tables)
        table_array = np.full((num_seqs, max_blocks), -1, dtype=np.int32)
        for i, t in enumerate(block_tables):
            table_array[i, : len(t)] = t
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])

        def dev(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        prefill = None
        if num_decode < num_seqs:
            rows = range(num_decode, num_seqs)
            p_query = tuple(query_lens[i] for i in rows)
            p_context = tuple(context_lens[i] for i in rows)
            cu_q = np.zeros(len(p_query) + 1, dtype=np.int32)
            np.cumsum(p_query, out=cu_q[1:])
            cu_k = np.zeros(len(p_context) + 1, dtype=np.int32)
            np.cumsum(p_context, out=cu_k[1:])
            offsets = np.arange(block_size, dtype=np.int64)
            context_slots = np.concatenate(
                [
                    (table_array[i, : -(-context_lens[i] // block_size)].astype(np.int64)[:, None] * block_size + offsets)
                    .ravel()[: context_lens[i]]
                    for i in rows
                ]
            )
            cu_q_dev, cu_k_dev = dev(cu_q), dev(cu_k)
            dense = len(p_query) > 1 and sum(p_query) * sum(p_context) <= DENSE_MASK_MAX_ELEMENTS
            prefill = PrefillMetadata(
                token_start=int(query_start[num_decode]),
                query_lens=p_query,
                context_lens=p_context,
                cu_seqlens_q=cu_q_dev,
                cu_seqlens_k=cu_k_dev,
                context_slots=dev(context_slots),
                dense_mask=block_causal_mask(p_query, p_context, cu_q_dev, cu_k_dev) if dense else None,
            )
        return cls(
            positions=dev(np.asarray(positions, dtype=np.int64)),
            slot_mapping=dev(np.asarray(slots, dtype=np.int64)),
            block_tables=dev(table_array),
            context_lens=dev(np.asarray(context_lens, dtype=np.int32)),
            query_start_loc=dev(query_start),
            query_lens=list(query_lens),
            context_lens_host=list(context_lens),
            block_size=block_size,
            num_decode_seqs=num_decode,
            prefill=prefill,
            kv_scale=kv_scale,
        )

    @classmethod
    def contiguous(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_size: int,
        first_block: int = 0,
        device: torch.device | str = "cpu",
        kv_scale: float = 1.0,
    ) -> ForwardBatch:
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
                slots.append(slot_of(table, pos, block_size))
        return cls.build(
            positions=positions,
            slots=slots,
            block_tables=tables,
            query_lens=query_lens,
            context_lens=context_lens,
            block_size=block_size,
            device=device,
            kv_scale=kv_scale,
        )
