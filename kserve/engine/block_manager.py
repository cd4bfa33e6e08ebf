"""Paged latent-KV blocks with prefix caching.

Computed full blocks are found by a chained hash, then checked against their tokens and parent, so a match is
always the whole prefix; freed blocks stay cached, in LRU order, until reused.
Details: docs/engine.md, 'Prefix cache'.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count

from kserve.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    # Set while the block is in the prefix cache: its registration's serial, its parent block's
    # serial (None for a sequence's first block) and its own tokens.
    serial: int | None = None
    parent_serial: int | None = None
    token_ids: tuple[int, ...] = field(default=())

    def holds(self, parent_serial: int | None, token_ids: tuple[int, ...]) -> bool:
        return self.parent_serial == parent_serial and self.token_ids == token_ids

    def clear_hash(self) -> None:
        self.hash, self.serial, self.parent_serial, self.token_ids = None, None, None, ()


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


def block_key(seq: Sequence, index: int, block_size: int) -> tuple:
    """What block `index` of a sequence caches: its token ids, plus the content hashes of any image whose
    placeholders it holds."""
    start = index * block_size
    tokens = tuple(seq.token_ids[start : start + block_size])
    return tokens + seq.image_keys(start, start + block_size) if seq.images else tokens


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # seq_id -> (hash, serial) of the cached block holding each of its computed full blocks
        self.seq_chains: dict[int, list[tuple[int, int]]] = {}
        self._serials = count()
        self.prefix_hit_tokens = 0
        self.prefix_miss_tokens = 0

    # ----------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq`, never covering its last token.

        The last token is always recomputed so that the step produces logits for it.
        """
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        parent: int | None = None
        parent_serial: int | None = None
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = block_key(seq, i, bs)
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or not self.blocks[block_id].holds(parent_serial, tokens):
                break
            matched.append(block_id)
            parent, parent_serial = h, self.blocks[block_id].serial
        return matched

    def can_allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        new_blocks = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        cached_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return new_blocks <= self.num_free_blocks - cached_free

    # ----------------------------------------------------------------------------- mutations
    def allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        """Give a waiting sequence its cached prefix blocks plus room for `num_new_tokens`."""
        assert not seq.block_table, "allocate() is for sequences that hold no blocks"
        chain: list[tuple[int, int]] = []
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1
            assert block.hash is not None and block.serial is not None
            chain.append((block.hash, block.serial))
        seq.block_table = list(cached)
        self.seq_chains[seq.seq_id] = chain
        num_cached_tokens = len(cached) * self.block_size
        seq.num_computed_tokens = num_cached_tokens
        if not self.append_slots(seq, num_new_tokens):
            raise RuntimeError("allocate() called without can_allocate()")
        if not seq.admitted_once:
            seq.admitted_once = True
            seq.num_cached_tokens = min(num_cached_tokens, seq.num_prompt_tokens)
            self.prefix_hit_tokens += num_cached_tokens
            self.prefix_miss_tokens += seq.num_tokens - num_cached_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones; False if full."""
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self.free_ids):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Put the sequence's newly computed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        chain = self.seq_chains.setdefault(seq.seq_id, [])
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent, parent_serial = chain[-1] if chain else (None, None)
        for i in range(len(chain), num_full):
            tokens = block_key(seq, i, bs)
            h = chain_hash(parent, tokens)
            block = self.blocks[seq.block_table[i]]
            existing = self.hash_to_block.get(h)
            if existing is None:
                self._register(block, h, parent_serial, tokens)
                cached = block
            else:
                cached = self.blocks[existing]
                if not cached.holds(parent_serial, tokens):
                    # A different prefix owns this hash (a collision): cache no more of this
                    # sequence; a later call retries from here.
                    return
                # else this block or another already caches exactly this prefix; a duplicate stays private
            assert cached.serial is not None
            chain.append((h, cached.serial))
            parent, parent_serial = h, cached.serial

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Blocks keep their hashes until they are reused."""
        # Free the tail first so that the LRU evicts a prefix's last blocks before its first ones.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is None:
                    # Uncached blocks are reused first: they are worth nothing.
                    self.free_ids[block_id] = None
                    self.free_ids.move_to_end(block_id, last=False)
                else:
                    self.free_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.seq_chains.pop(seq.seq_id, None)

    def release_tail(self, seq: Sequence, keep: int) -> None:
        """Give back the sequence's blocks after its first `keep` (room reserved for drafts that were
        rejected: never registered in the prefix cache, so reused first)."""
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, "a draft block must be private and uncached"
            self.free_ids[block.block_id] = None
            self.free_ids.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.hash is not None and block.ref_count == 0:
                del self.hash_to_block[block.hash]
                block.clear_hash()

    # ----------------------------------------------------------------------------- internals
    def _take_free_block(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.clear_hash()
        block.ref_count = 1
        return block_id

    def _register(self, block: Block, h: int, parent_serial: int | None, tokens: tuple[int, ...]) -> None:
        block.hash, block.serial = h, next(self._serials)
        block.parent_serial, block.token_ids = parent_serial, tokens
        self.hash_to_block[h] = block.block_id
