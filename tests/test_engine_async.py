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
