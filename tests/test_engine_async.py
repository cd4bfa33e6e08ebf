"""AsyncLLMEngine on the toy model: concurrent streams, disconnect/abort, failures, shutdown."""

from __future__ import annotations

import asyncio
import random

import pytest
from test_engine_toy import TOY_VOCAB, CharTokenizer, make_toy_engine, run_to_completion

from kserve.engine.async_engine import AsyncLLMEngine
from kserve.engine.errors import PromptRejected
from kserve.engine.sampling_params import SamplingParams


def prompt(seed: int, n: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TOY_VOCAB) for _ in range(n)]


async def collect(engine: AsyncLLMEngine, rid: str, ids: list[int], params: SamplingParams):
    snaps = []
    async for out in engine.generate(rid, ids, params):
        snaps.append(out)
    return snaps


def test_concurrent_streams_match_offline_and_abort_frees_blocks() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    offline = make_toy_engine(tokenizer=CharTokenizer())
    for i in range(6):
        offline.add_request(f"r{i}", prompt(i), params)
    expected = run_to_completion(offline)

    async def main() -> None:
        engine = AsyncLLMEngine(make_toy_engine(tokenizer=CharTokenizer(), max_num_batched_tokens=32))
        await engine.start()
        try:
            long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)

            async def disconnects_after(n: int, rid: str) -> int:
                count = 0
                async for _ in engine.generate(rid, prompt(100), long):
                    count += 1
                    if count == n:
                        break  # the client went away
                return count

            async def aborted_by_server(rid: str):
                agen = engine.generate(rid, prompt(101), long)
                first = await agen.__anext__()
                await engine.abort(rid)
                rest = [o async for o in agen]
                return first, rest

            results = await asyncio.gather(
                *(collect(engine, f"r{i}", prompt(i), params) for i in range(6)),
                disconnects_after(3, "gone"),
                aborted_by_server("killed"),
            )
            for i in range(6):
                snaps = results[i]
                final = snaps[-1]
                assert final.finished and final.outputs[0].finish_reason == "length"
                assert final.token_ids == expected[f"r{i}"].token_ids
                assert final.text == expected[f"r{i}"].text
                # snapshots are cumulative
                lens = [len(s.token_ids) for s in snaps]
                assert lens == sorted(lens) and all(not s.finished for s in snaps[:-1])
            assert results[6] == 3
            _first, rest = results[7]
            assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
            for _ in range(200):
                stats = engine.stats()
                if stats.num_running == 0 and stats.num_waiting == 0:
                    break
                await asyncio.sleep(0.01)
            assert stats.kv_blocks_used == 0 and stats.num_running == 0
            assert stats.generation_tokens_total >= 6 * 15
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_bad_request_and_failing_request_do_not_stop_the_loop() -> None:
    class Explodes:
        def __call__(self, output_token_ids, logits):
            raise RuntimeError("processor bug")

    async def main() -> None:
        engine = AsyncLLMEngine(make_toy_engine())
        await engine.start()
        try:
            with pytest.raises(PromptRejected, match="maximum context length"):
                engine.validate_prompt([5] * 5000, SamplingParams())  # before any streaming starts
            with pytest.raises(PromptRejected, match="maximum context length"):
                await collect(engine, "big", [5] * 5000, SamplingParams())
            with pytest.raises(PromptRejected, match="vocabulary"):
                await collect(engine, "oov", [TOY_VOCAB + 1], SamplingParams())
            bad, ok = await asyncio.gather(
                collect(engine, "bad", prompt(1), SamplingParams(logits_processors=[Explodes()])),
                collect(engine, "ok", prompt(2), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)),
                return_exceptions=True,
            )
            assert isinstance(bad, RuntimeError) and "processor bug" in str(bad)
            assert ok[-1].finished and len(ok[-1].token_ids) == 4  # same steps, unaffected
            await asyncio.sleep(0.05)
            assert engine.stats().kv_blocks_used == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_event_loop_stays_responsive_while_stepping() -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(make_toy_engine())
        await engine.start()
        try:
            task = asyncio.ensure_future(
                collect(engine, "r", prompt(3), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
            )
            ticks = 0
            while not task.done():
                await asyncio.sleep(0.001)
                ticks += 1
            assert ticks > 5
            assert len((await task)[-1].token_ids) == 200
        finally:
            await engine.shutdown()

    asyncio.run(main())


class FailsOnce:
    """Wraps an engine method so that its `nth` call raises (every call from then on if `sticky`)."""

    def __init__(self, method, nth: int, message: str, sticky: bool = False) -> None:
        self.method, self.nth, self.message, self.sticky, self.calls = method, nth, message, sticky, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.nth or (self.sticky and self.calls > self.nth):
            raise RuntimeError(self.message)
        return self.method(*args, **kwargs)


LONG = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("method", ["stats", "abort_request"])
def test_loop_survives_an_unexpected_error_outside_the_step(method: str) -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(make_toy_engine())
        core = engine.engine
        setattr(core, method, FailsOnce(getattr(core, method), nth=5, message=f"{method} bug"))
        await engine.start()
        try:
            async def held(rid: str) -> None:
                async for _ in engine.generate(rid, prompt(7), LONG):
                    if method == "abort_request":
                        await engine.abort("no-such-request")  # each abort calls abort_request
            results = await asyncio.wait_for(
                asyncio.gather(held("a"), held("b"), return_exceptions=True), timeout=30
            )
            assert all(isinstance(r, RuntimeError) and f"{method} bug" in str(r) for r in results)
            assert engine.healthy() and engine.fatal_error is None
            after = await asyncio.wait_for(collect(engine, "after", prompt(8), SHORT), timeout=30)
            assert after[-1].finished and len(after[-1].token_ids) == 4
            assert core.block_manager.num_used_blocks == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_loop_that_cannot_recover_reports_a_fatal_error() -> None:
    from kserve.engine.errors import EngineDeadError

    async def main() -> None:
        engine = AsyncLLMEngine(make_toy_engine())
        core = engine.engine
        core.stats = FailsOnce(core.stats, nth=2, message="stats bug")
        core.fail_requests = FailsOnce(core.fail_requests, nth=1, message="cannot clean up", sticky=True)
        await engine.start()
        try:
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(collect(engine, "a", prompt(7), LONG), timeout=30)
            assert not engine.healthy()
            assert isinstance(engine.fatal_error, RuntimeError) and "cannot clean up" in str(engine.fatal_error)
            with pytest.raises(EngineDeadError):  # at once, not after a wait
                await asyncio.wait_for(collect(engine, "b", prompt(8), SHORT), timeout=1)
        finally:
            await asyncio.wait_for(engine.shutdown(), timeout=30)

    asyncio.run(main())


def test_loop_gives_up_after_repeated_failures() -> None:
    from kserve.engine.async_engine import MAX_CONSECUTIVE_FAILURES
    from kserve.engine.errors import EngineDeadError

    async def main() -> None:
        engine = AsyncLLMEngine(make_toy_engine())
        engine.engine.stats = FailsOnce(engine.engine.stats, nth=1, message="stats broken", sticky=True)
        await engine.start()
        try:
            errors = []
            for i in range(MAX_CONSECUTIVE_FAILURES + 1):
                with pytest.raises(RuntimeError) as info:
                    await asyncio.wait_for(collect(engine, f"r{i}", prompt(i), SHORT), timeout=30)
                errors.append(info.value)
            assert "stats broken" in str(errors[0]) and isinstance(errors[-1], EngineDeadError)
            assert not engine.healthy()
        finally:
            await asyncio.wait_for(engine.shutdown(), timeout=30)

    asyncio.run(main())
