"""The contract between the model runner and the model: one step's metadata, built once per step.

A step's `num_tokens` new tokens are laid out sequence by sequence. The first `num_decode_seqs` sequences have one
new token each and take the absorbed MLA path; every later one is a "prefill" sequence, all of them in one varlen
attention call described by `prefill`, or, when each adds a few tokens to a cached prefix (a speculative verify),
as absorbed rows, one per query token. The runner builds everything here from host (scheduler) data; the model
never reads a device tensor back on the host. Positions, cache slots, context chunks and DCP: docs/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kserve.distributed import ContextParallelGroup

# Largest block-diagonal prefill mask (query tokens x context tokens) built for the SDPA fallback.
DENSE_MASK_MAX_ELEMENTS = 1 << 20
# Most cached context positions a prefill step decompresses through kv_b_proj at once (EngineConfig's default).
DEFAULT_CONTEXT_CHUNK_TOKENS = 8192
# Prefill sequences that each add at most this many tokens to a cached prefix attend as absorbed decode rows:
# reading the latents per query row costs less than decompressing every context through kv_b_proj.
ROW_QUERY_MAX_LEN = 16


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
class ContextChunk:
    """Cached positions [start, end) of prefill sequence `seq`: this rank's cache slots for the positions it
    holds (under DCP group rank r: start + r, start + r + dcp, ...), padded with the scratch slot to
    ceil((end - start) / dcp) entries so every group rank gathers the same count."""

    seq: int
    start: int
    end: int
    slots: torch.Tensor  # int64


def local_slots(slots: np.ndarray, block_size: int, dcp: ContextParallelGroup | None, scratch_slot: int) -> np.ndarray:
    """Global slots (virtual blocks of block_size * dcp tokens) -> this rank's cache slots; a token
    another group rank holds goes to `scratch_slot`."""
    if dcp is None:
        return slots
    virtual = block_size * dcp.size
    block, offset = np.divmod(slots, virtual)
    local = block * block_size + offset // dcp.size
    return np.where(offset % dcp.size == dcp.rank, local, scratch_slot)


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
    # None: one gather and one attention call over every context (the fields above). Otherwise the
    # chunked path: per sequence, its new tokens causally, then these chunks of its cached prefix.
    context_chunks: tuple[ContextChunk, ...] | None = None
    # Or the absorbed rows: query j of sequence i as a decode row over sequence i's blocks seeing
    # context_lens[i] - query_lens[i] + j + 1 positions ([num_tokens, max_blocks] int32, [num_tokens] int32).
    row_block_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None

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
    # decode context parallelism: block_tables/context_lens/slot_mapping are already this rank's
    context_parallel: ContextParallelGroup | None = None

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
        context_chunk_tokens: int = DEFAULT_CONTEXT_CHUNK_TOKENS,
        context_parallel: ContextParallelGroup | None = None,
        scratch_slot: int | None = None,
        row_query_max_len: int = ROW_QUERY_MAX_LEN,
    ) -> ForwardBatch:
        """All of a step's metadata from host lists (block table rows may differ in length).

        Under `context_parallel` the positions, slots and block tables are global (see the module doc)
        and `scratch_slot` takes the writes of tokens that other group ranks hold."""
        dcp = context_parallel
        num_seqs = len(query_lens)
        if not num_seqs or len(context_lens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError(
                f"query_lens ({len(query_lens)}), context_lens ({len(context_lens)}) and block_tables "
                f"({len(block_tables)}) must name the same, non-zero number of sequences"
            )
        num_tokens = sum(query_lens)
        if len(positions) != num_tokens or len(slots) != num_tokens:
            raise ValueError(f"{len(positions)} positions and {len(slots)} slots for {num_tokens} query tokens")
        if context_chunk_tokens < 1:
            raise ValueError(f"context_chunk_tokens must be positive, got {context_chunk_tokens}")
        if dcp is not None and scratch_slot is None:
            raise ValueError("decode context parallelism needs a scratch slot for the tokens other ranks hold")
        table_block = block_size * (dcp.size if dcp is not None else 1)  # tokens per block-table entry
        for i, (q, c) in enumerate(zip(query_lens, context_lens)):
            if q < 1 or c < q or len(block_tables[i]) * table_block < c:
                raise ValueError(
                    f"sequence {i}: query_len {q}, context_len {c} and {len(block_tables[i])} blocks of "
                    f"{table_block} do not fit together"
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
            cu_q_dev, cu_k_dev = dev(cu_q), dev(cu_k)
            common = {"token_start": int(query_start[num_decode]), "query_lens": p_query, "context_lens": p_context,
                      "cu_seqlens_q": cu_q_dev, "cu_seqlens_k": cu_k_dev}
            no_slots = dev(np.zeros(0, dtype=np.int64))
            if dcp is None and all(q <= row_query_max_len and c > q for q, c in zip(p_query, p_context)):
                row_seq, row_context = [], []
                for i, q, c in zip(rows, p_query, p_context):
                    row_seq += [i] * q
                    row_context += range(c - q + 1, c + 1)
                prefill = PrefillMetadata(
                    **common, context_slots=no_slots, row_block_tables=dev(table_array[row_seq]),
                    row_context_lens=dev(np.asarray(row_context, dtype=np.int32)),
                )
            elif dcp is not None or sum(p_context) > context_chunk_tokens:
                chunks = _context_chunks(
                    [table_array[i] for i in rows], p_query, p_context, block_size, context_chunk_tokens, dcp,
                    scratch_slot if scratch_slot is not None else 0, dev,
                )
                prefill = PrefillMetadata(**common, context_slots=no_slots, context_chunks=chunks)
            else:
                offsets = np.arange(block_size, dtype=np.int64)
                context_slots = np.concatenate(
                    [
                        (table_array[i, : -(-context_lens[i] // block_size)].astype(np.int64)[:, None] * block_size
                         + offsets).ravel()[: context_lens[i]]
                        for i in rows
                    ]
                )
                dense = len(p_query) > 1 and sum(p_query) * sum(p_context) <= DENSE_MASK_MAX_ELEMENTS
                prefill = PrefillMetadata(
                    **common, context_slots=dev(context_slots),
                    dense_mask=block_causal_mask(p_query, p_context, cu_q_dev, cu_k_dev) if dense else None,
                )
        slot_array = np.asarray(slots, dtype=np.int64)
        context_array = np.asarray(context_lens, dtype=np.int32)
        if dcp is not None:
            slot_array = local_slots(slot_array, block_size, dcp, scratch_slot)
            context_array = np.maximum(0, -(-(context_array - dcp.rank) // dcp.size)).astype(np.int32)
        return cls(
            positions=dev(np.asarray(positions, dtype=np.int64)),
            slot_mapping=dev(slot_array),
            block_tables=dev(table_array),
            context_lens=dev(context_array),
            query_start_loc=dev(query_start),
            query_lens=list(query_lens),
            context_lens_host=list(context_lens),
            block_size=block_size,
            num_decode_seqs=num_decode,
            prefill=prefill,
            kv_scale=kv_scale,
            context_parallel=dcp,
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
        context_chunk_tokens: int = DEFAULT_CONTEXT_CHUNK_TOKENS,
        row_query_max_len: int = ROW_QUERY_MAX_LEN,
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
            context_chunk_tokens=context_chunk_tokens,
            row_query_max_len=row_query_max_len,
        )


def _context_chunks(
    tables: list[np.ndarray],
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    block_size: int,
    chunk_tokens: int,
    dcp: ContextParallelGroup | None,
    scratch_slot: int,
    dev,
) -> tuple[ContextChunk, ...]:
    """The cached prefix of each prefill sequence cut into chunks of at most `chunk_tokens` positions (a
    multiple of the DCP size), with this rank's slots for each; one host-to-device copy for all of them."""
    size, rank = (dcp.size, dcp.rank) if dcp is not None else (1, 0)
    step = max(size, chunk_tokens // size * size)
    plan, pieces = [], []
    for seq, (table, q, c) in enumerate(zip(tables, query_lens, context_lens)):
        for start in range(0, c - q, step):
            end = min(c - q, start + step)
            count = -(-(end - start) // size)
            positions = start + rank + size * np.arange(count, dtype=np.int64)
            local = positions // size  # this rank's index of each position it holds
            entry = np.minimum(local // block_size, len(table) - 1)  # padding positions may run past the table
            slots = table[entry].astype(np.int64) * block_size + local % block_size
            pieces.append(np.where(positions < end, slots, scratch_slot))
            plan.append((seq, start, end, count))
    if not plan:
        return ()
    all_slots = dev(np.concatenate(pieces))
    chunks, offset = [], 0
    for seq, start, end, count in plan:
        chunks.append(ContextChunk(seq, start, end, all_slots[offset : offset + count]))
        offset += count
    return tuple(chunks)
