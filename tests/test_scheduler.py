"""Scheduler policy: token budget, chunked prefill, decode-first, FCFS, max_num_seqs, preemption."""

from __future__ import annotations

from kserve.engine.block_manager import BlockManager
from kserve.engine.sampling_params import SamplingParams
from kserve.engine.scheduler import Scheduler
from kserve.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 64, budget: int = 16, max_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), max_seqs, budget)


def add(s: Scheduler, sid: int, n: int) -> Sequence:
    seq = Sequence(sid, f"r{sid}", 0, list(range(100 * sid, 100 * sid + n)), SamplingParams(), sid)
    s.add(seq)
    return seq


def step(s: Scheduler) -> dict[int, int]:
    """One scheduled step with a fake model that samples token 7 wherever a chunk completes."""
    out = s.schedule()
    sampling = [item.seq for item in out.scheduled if item.samples]
    s.finish_step(out)
    for seq in sampling:
        seq.token_ids.append(7)
    return {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}


def test_chunked_prefill_respects_budget_and_fcfs() -> None:
    s = make(budget=16)
    add(s, 0, 30)
    add(s, 1, 5)
    assert step(s) == {0: 16}
    assert step(s) == {0: 14, 1: 2}  # the rest of 0's prompt, then 1 starts in the leftover budget
    assert step(s) == {0: 1, 1: 3}  # 0 decodes first, 1 finishes its prompt
    assert step(s) == {0: 1, 1: 1}


def test_decodes_go_before_unfinished_prefills() -> None:
    s = make(budget=8)
    a = add(s, 0, 3)
    step(s)  # a prefilled
    b = add(s, 1, 40)
    step(s)
    for _ in range(3):
        got = step(s)
        assert got[a.seq_id] == 1 and got[b.seq_id] == 7


def test_max_num_seqs() -> None:
    s = make(budget=100, max_seqs=2)
    for i in range(4):
        add(s, i, 3)
    assert set(step(s)) == {0, 1}
    assert len(s.waiting) == 2


def test_preempts_latest_and_requeues_it_first() -> None:
    s = make(num_blocks=4, budget=64)  # 16 token slots
    add(s, 0, 7)
    b = add(s, 1, 7)  # 2 blocks each, all 4 used after the prompts
    step(s)
    assert s.block_manager.num_free_blocks == 0
    got = step(s)  # both decode at position 7, still inside their second block
    assert got == {0: 1, 1: 1}
    got = step(s)  # now both need a new block: b (latest) is preempted for a
    assert got == {0: 1}
    assert b.status is SequenceStatus.WAITING and s.waiting[0] is b and b.block_table == []
    assert s.num_preemptions == 1 and b.num_tokens == 9  # its generated tokens are kept


def test_abort_frees_blocks_wherever_the_sequence_is() -> None:
    s = make(num_blocks=8, budget=8)
    a, b = add(s, 0, 20), add(s, 1, 4)
    step(s)
    s.abort([a, b])
    assert s.block_manager.num_free_blocks == 8 and not s.running and not s.waiting
