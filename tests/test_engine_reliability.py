"""Engine reliability (issue 13): step failures and death, total sampling, no starvation, deltas.

Each test here fails on the engine as it was before the fix it covers.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from test_engine_toy import TOY_VOCAB, CharTokenizer, make_toy_engine, run_to_completion

from kserve.engine.async_engine import AsyncLLMEngine
from kserve.engine.block_manager import BlockManager
from kserve.engine.errors import EngineDeadError, RequestFailedError
from kserve.engine.faults import STEP_FAULTS_KEY, StepFaults
from kserve.engine.sampler import Sampler, seeded_exponential
from kserve.engine.sampling_params import SamplingParams
from kserve.engine.scheduler import Scheduler
from kserve.engine.sequence import Sequence
from kserve.engine.token_bitmask import set_allowed

EOS = 1  # CharTokenizer's first stop token


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TOY_VOCAB) for _ in range(n)]


def faulty_engine(faults: StepFaults, **knobs):
    return make_toy_engine(tokenizer=CharTokenizer(), extra={STEP_FAULTS_KEY: faults}, **knobs)


LONG = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


# ----------------------------------------------------------------------------- health


def test_failed_steps_are_retried_invisibly() -> None:
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=12)
    clean = make_toy_engine(tokenizer=CharTokenizer())
    clean.add_request("a", prompt(1), params)
    expected = run_to_completion(clean)["a"]

    faults = StepFaults(fail_steps=1, armed=False)
    engine = faulty_engine(faults)
    engine.add_request("a", prompt(1), params)
    engine.step()
    engine.step()
    faults.armed = True
    assert engine.step() == [] and engine.consecutive_step_failures == 1
    out = run_to_completion(engine)["a"]
    assert faults.failed == 1 and engine.consecutive_step_failures == 0
    assert out.token_ids == expected.token_ids and out.text == expected.text
    assert engine.block_manager.num_used_blocks == 0


def test_consecutive_failed_steps_kill_the_engine() -> None:
    engine = faulty_engine(StepFaults())  # every step fails
    engine.add_request("a", prompt(1), SHORT)
    assert engine.step() == [] and engine.step() == []
    with pytest.raises(EngineDeadError, match="3 failed steps in a row"):
        engine.step()


def test_a_request_that_breaks_every_step_fails_alone() -> None:
    engine = make_toy_engine(tokenizer=CharTokenizer())
    run = engine.runner.run

    def breaks_on_poison(scheduled):
        if any(item.seq.request_id == "poison" for item in scheduled):
            raise RuntimeError("this prompt crashes the forward")
        return run(scheduled)

    engine.runner.run = breaks_on_poison
    engine.add_request("poison", prompt(1), SHORT)
    changed = []
    for _ in range(4):
        changed += engine.step()
    (failed,) = [r for r in changed if r.request_id == "poison"]
    assert isinstance(failed.error, RequestFailedError) and "crashes the forward" in str(failed.error)
    assert engine.consecutive_step_failures == 0 and not engine.requests  # the probe ran and is gone
    for again in range(3):  # poisoned requests one after another never add up to a dead engine
        engine.add_request("poison", prompt(again), SHORT)
        assert isinstance(run_collecting_errors(engine)["poison"], RequestFailedError)
    engine.add_request("ok", prompt(2), SHORT)
    out = run_to_completion(engine)
    assert len(out["ok"].token_ids) == 4
    assert engine.block_manager.num_used_blocks == 0


def run_collecting_errors(engine, max_steps: int = 1000) -> dict:
    errors = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for request in engine.step():
            if request.finished:
                errors[request.request_id] = request.error
    assert not engine.has_unfinished()
    return errors


def test_a_fatal_error_kills_the_engine_at_once() -> None:
    engine = faulty_engine(StepFaults(fatal=True))
    engine.add_request("a", prompt(1), SHORT)
    with pytest.raises(EngineDeadError, match="fatal"):
        engine.step()


def test_failing_requests_never_kill_the_engine() -> None:
    class Explodes:
        def __call__(self, output_token_ids, logits):
            raise RuntimeError("processor bug")

    engine = make_toy_engine()
    for i in range(10):  # far more than max_consecutive_step_failures, one after another
        engine.add_request(f"bad{i}", prompt(i), SamplingParams(logits_processors=[Explodes()]))
        (failed,) = engine.step()
        assert "processor bug" in str(failed.error)
    engine.add_request("ok", prompt(3), SHORT)
    assert len(run_to_completion(engine)["ok"].token_ids) == 4


def test_async_engine_dies_after_repeated_step_failures_and_says_so() -> None:
    async def main() -> None:
        faults = StepFaults(armed=False)
        engine = AsyncLLMEngine(faulty_engine(faults))
        await engine.start()
        try:
            seen = 0

            async def stream() -> None:
                nonlocal seen
                async for _ in engine.generate("held", prompt(1), SamplingParams(temperature=0.0, max_tokens=10_000,
                                                                                  ignore_eos=True)):
                    seen += 1
                    if seen == 3:
                        faults.armed = True

            with pytest.raises(EngineDeadError, match="3 failed steps in a row"):
                await asyncio.wait_for(stream(), timeout=30)
            assert not engine.healthy() and isinstance(engine.fatal_error, EngineDeadError)
            with pytest.raises(EngineDeadError):  # at once
                await asyncio.wait_for(_drain(engine, "after", prompt(5), SHORT), timeout=1)
        finally:
            await asyncio.wait_for(engine.shutdown(), timeout=30)

    asyncio.run(main())


async def _drain(engine: AsyncLLMEngine, rid: str, ids: list[int], params: SamplingParams) -> list:
    return [o async for o in engine.generate(rid, ids, params)]


# ----------------------------------------------------------------------------- sampling is total


class StopOnly:
    """A grammar that is complete from the start: only a stop token may follow (like `{}` after `}`)."""

    def __init__(self) -> None:
        self.done = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        set_allowed(bitmask, row, [EOS])

    def accept_token(self, token_id: int) -> bool:
        self.done = token_id == EOS
        return self.done

    def rollback(self, num_tokens: int) -> None:
        self.done = False

    def is_terminated(self) -> bool:
        return self.done


class StopOnlyGuide:
    def make_constraint(self) -> StopOnly:
        return StopOnly()


def test_stop_wins_over_min_tokens_when_the_grammar_allows_only_stop() -> None:
    engine = make_toy_engine(tokenizer=CharTokenizer())
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, min_tokens=20, max_tokens=30, guided=StopOnlyGuide(), seed=1)
        engine.add_request(f"t{temperature}", prompt(4), params)
    for rid, out in run_to_completion(engine).items():
        assert out.outputs[0].finish_reason == "stop", rid
        assert out.token_ids == [EOS], rid


def test_a_row_with_no_allowed_token_fails_alone_never_samples() -> None:
    def ban_all(output_token_ids, logits):
        return torch.full_like(logits, float("-inf"))

    def seq(params: SamplingParams, sid: int) -> Sequence:
        s = Sequence(sid, f"r{sid}", 0, [5, 6], params, sid)
        s.seed = sid
        return s

    sampler = Sampler([EOS], "cpu")
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seqs = [seq(SamplingParams(temperature=t, logits_processors=[ban_all]), 0) for t in (0.0,)]
    seqs += [seq(SamplingParams(temperature=1.0, logits_processors=[ban_all]), 1), seq(SamplingParams(), 2)]
    out = sampler.sample(logits, seqs)
    assert set(out.errors) == {0, 1}
    assert all("no token is allowed" in str(e) for e in out.errors.values())
    assert 2 not in out.errors and 0 <= out.token_ids[2] < 50


def test_seeds_differing_only_in_high_bits_sample_differently() -> None:
    for low in (1, 12345, 2**31 - 1):
        noise = seeded_exponential(torch.tensor([low, low << 32, (low << 32) | low]), torch.zeros(3, dtype=torch.int64),
                                   1000)
        assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    swapped = seeded_exponential(torch.tensor([(7 << 32) | 9, (9 << 32) | 7]), torch.zeros(2, dtype=torch.int64), 1000)
    assert not torch.equal(swapped[0], swapped[1])


def test_huge_top_k_means_no_top_k() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))

    def draw(top_k: int) -> list[int]:
        s = Sequence(0, "r", 0, [5], SamplingParams(temperature=1.0, top_k=top_k), 0)
        s.seed = 77
        return Sampler([EOS], "cpu").sample(logits.clone(), [s]).token_ids

    assert draw(2**63) == draw(10**30) == draw(-1)  # 2**63 overflowed int64 in the sampler


# ----------------------------------------------------------------------------- scheduler


def test_budget_below_running_count_still_advances_every_sequence() -> None:
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    seqs = [Sequence(i, f"r{i}", 0, [10 + i], SamplingParams(), i) for i in range(5)]
    for s in seqs:
        scheduler.add(s)
    for step in range(31):
        if step == 1:  # all five are running now; from here the budget covers two decodes a step
            assert len(scheduler.running) == 5
            scheduler.max_num_batched_tokens = 2
        out = scheduler.schedule()
        sampling = [item.seq for item in out.scheduled if item.samples]
        scheduler.finish_step(out)
        for seq in sampling:
            seq.token_ids.append(7)
    generated = [s.num_output_tokens for s in seqs]
    assert min(generated) >= 10, generated  # 30 steps x 2 tokens over 5 sequences: about 12 each
    assert max(generated) - min(generated) <= 2, generated


# ----------------------------------------------------------------------------- deltas


def test_take_delta_carries_only_news() -> None:
    engine = make_toy_engine(tokenizer=CharTokenizer())
    request = engine.add_request("a", prompt(1), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    total_tokens, text = [], ""
    while not request.finished:
        engine.step()
        delta = request.take_delta()
        (part,) = delta.outputs
        assert len(part.token_ids) <= 1  # never the whole output again
        total_tokens += part.token_ids
        text += "".join(part.text_parts)
    final = request.output()
    assert total_tokens == final.token_ids and text == final.text and len(total_tokens) == 40


def test_a_slow_reader_gets_merged_deltas_and_the_same_output() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=2)
    offline = make_toy_engine(tokenizer=CharTokenizer())
    offline.add_request("r", prompt(3), params)
    expected = run_to_completion(offline)["r"]

    async def main() -> None:
        engine = AsyncLLMEngine(make_toy_engine(tokenizer=CharTokenizer()))
        await engine.start()
        try:
            snapshots = 0
            final = None
            async for out in engine.generate("r", prompt(3), params):
                snapshots += 1
                final = out
                await asyncio.sleep(0.05)  # a slow client: the engine keeps stepping meanwhile
            assert snapshots < 30, snapshots  # 60 steps arrived as far fewer, merged, snapshots
            assert final.token_ids == expected.token_ids and final.text == expected.text
            assert [lp.token_id for lp in final.logprobs] == [lp.token_id for lp in expected.logprobs]
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_streamed_logprobs_leave_out_a_cut_stop_string() -> None:
    # CharTokenizer: one char per token. Force the text "abXYZ" with a stop string "XYZ".
    forced = [ord(c) for c in "abXYZcd"]

    class Force:
        def __call__(self, output_token_ids, logits):
            out = torch.full_like(logits, -50.0)
            out[forced[min(len(output_token_ids), len(forced) - 1)]] = 50.0
            return out

    params = SamplingParams(temperature=0.0, max_tokens=20, stop=["XYZ"], logprobs=0, logits_processors=[Force()])
    offline = make_toy_engine(tokenizer=CharTokenizer())
    offline.add_request("r", prompt(1), params)
    final = run_to_completion(offline)["r"]
    assert final.text == "ab" and final.outputs[0].stop_reason == "XYZ"
    assert [lp.token_id for lp in final.logprobs] == forced[:2]  # X, Y, Z were cut with their text

    async def main() -> None:
        engine = AsyncLLMEngine(make_toy_engine(tokenizer=CharTokenizer()))
        await engine.start()
        try:
            streamed, sent = [], 0
            async for out in engine.generate("r", prompt(1), params):
                streamed += out.logprobs[sent:]
                sent = len(out.logprobs)
            assert [lp.token_id for lp in streamed] == forced[:2]
        finally:
            await engine.shutdown()

    asyncio.run(main())
