"""Continuous batching: which sequences run this step, and how many of their tokens.

Running sequences first (decodes, then unfinished prefills), then waiting ones in arrival order, chunked to fit
`max_num_batched_tokens`; when blocks run out, the newest running sequence is preempted and later recomputed.
Details: docs/engine.md, 'Scheduler'.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from kserve.engine.block_manager import BlockManager
from kserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens the model computes for it this step, drafts included
    num_draft_tokens: int = 0  # speculative drafts after its last token (seq.draft_token_ids[:n])

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so the step samples a new one."""
        real = self.num_new_tokens - self.num_draft_tokens
        return self.seq.num_computed_tokens + real == len(self.seq.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.seq.draft_token_ids[: self.num_draft_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self._serials = itertools.count()  # stamps scheduled sequences in order: least recent = lowest
        self._budget_ran_out = False  # last step left running sequences unscheduled

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # Decodes first, then chunks of prefills already under way.
        pending: list[Sequence] = []
        prefilling: list[Sequence] = []
        for seq in self.running:
            (pending if len(seq.token_ids) - seq.num_computed_tokens == 1 else prefilling).append(seq)
        pending += prefilling
        if self._budget_ran_out:  # least recently run first: round-robin while the budget is short
            pending.sort(key=_last_scheduled)
        self._budget_ran_out = False
        bm = self.block_manager
        for seq in pending:
            if budget == 0:
                self._budget_ran_out = True
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            num_draft = 0
            if num_new == 1 and seq.draft_token_ids:  # a decode with drafts to verify, if they fit
                num_draft = min(len(seq.draft_token_ids), budget - 1)
                if num_draft and not bm.append_slots(seq, 1 + num_draft):
                    num_draft = 0  # no room for the drafts: decode plainly rather than preempt for them
                num_new += num_draft
            while not bm.append_slots(seq, num_new):
                victim = self.running[-1]
                if victim.seq_id in scheduled_ids:
                    item = next(s for s in out.scheduled if s.seq is victim)
                    out.scheduled.remove(item)
                    scheduled_ids.discard(victim.seq_id)
                    budget += item.num_new_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            out.scheduled.append(ScheduledSeq(seq, num_new, num_draft))
            scheduled_ids.add(seq.seq_id)
            seq.last_scheduled_step = next(self._serials)
            budget -= num_new

        if out.preempted:
            return out  # memory is short: admit nothing new this step

        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.wait_for is not None and not _prompt_ready(seq.wait_for):
                # n > 1 sibling: wait until the first completion's prompt is in the prefix cache.
                skipped.append(self.waiting.popleft())
                continue
            cached = self.block_manager.match_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * self.block_manager.block_size, budget)
            if not self.block_manager.can_allocate(seq, cached, num_new):
                break
            self.waiting.popleft()
            seq.wait_for = None
            self.block_manager.allocate(seq, cached, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            seq.last_scheduled_step = next(self._serials)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return out

    def finish_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts after the model ran `out`, and cache full blocks. Drafts count
        only once accepted (`accept_drafts`)."""
        for item in out.scheduled:
            self._advance(item.seq, item.num_new_tokens - item.num_draft_tokens)

    def accept_drafts(self, seq: Sequence, accepted: int) -> None:
        """After a verify step: the first `accepted` drafts are now the sequence's tokens and their latents
        are in the cache; blocks that only rejected drafts used go back to the pool."""
        seq.draft_token_ids = []
        if seq.is_finished:
            return
        self._advance(seq, accepted)
        bm = self.block_manager
        keep = bm.blocks_needed(len(seq.token_ids))
        if len(seq.block_table) > keep:
            bm.release_tail(seq, keep)

    def _advance(self, seq: Sequence, count: int) -> None:
        bs = self.block_manager.block_size
        before = seq.num_computed_tokens
        seq.num_computed_tokens = before + count
        if seq.num_computed_tokens // bs != before // bs:  # a block filled up
            self.block_manager.register_computed(seq)

    def remove_finished(self, candidates: list[Sequence]) -> list[Sequence]:
        """Free the finished sequences among `candidates` (those that just got a token)."""
        done = [s for s in candidates if s.is_finished]
        if done:
            self.running = [s for s in self.running if not s.is_finished]
            for seq in done:
                self.block_manager.free(seq)
        return done

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop sequences wherever they are; their blocks go back to the pool."""
        ids = {s.seq_id for s in seqs}
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING or seq.block_table:
                self.block_manager.free(seq)
        self.running = [s for s in self.running if s.seq_id not in ids]
        self.waiting = deque(s for s in self.waiting if s.seq_id not in ids)
        for seq in self.waiting:
            if seq.wait_for is not None and seq.wait_for.seq_id in ids:
                seq.wait_for = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _last_scheduled(seq: Sequence) -> int:
    return seq.last_scheduled_step


def _prompt_ready(parent: Sequence) -> bool:
    return parent.is_finished or parent.num_computed_tokens >= parent.num_prompt_tokens
