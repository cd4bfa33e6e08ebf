"""The engine on the real model code (embedded tiny K2.6 checkpoint, fp32, CPU).

Batch invariance, prefix caching, preemption, block accounting, seeds and stop strings, each
checked against the same requests run alone / with a large cache / without the prefix cache.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kserve.config import EngineConfig
from kserve.engine.llm import LLM
from kserve.engine.llm_engine import LLMEngine
from kserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    from kserve.chat import load_tokenizer
    from kserve.model import load_model
    from kserve.tiny import embedded_model_dir

    model_dir = Path(embedded_model_dir())
    # Dequantized weights: these tests compare different batchings token for token, and on the FP8
    # path a one-ulp difference between batch shapes (BLAS blocking) can move an activation across
    # an e4m3 rounding boundary, which a random tiny model amplifies into a different greedy token.
    model = load_model(model_dir, device="cpu", dtype=torch.float32, weights="dequantized")
    return model, load_tokenizer(model_dir), model_dir


def make_llm(tiny, **knobs) -> LLM:
    model, tokenizer, model_dir = tiny
    knobs.setdefault("num_kv_blocks", 256)
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", **knobs)
    return LLM.from_engine(LLMEngine(model, model.config, tokenizer, config, model_dir))


def random_prompts(count: int, lo: int, hi: int, seed: int, vocab: int = 1700) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def token_ids(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_batch_invariance_16_requests(tiny) -> None:
    prompts = random_prompts(16, 3, 60, seed=0)
    llm = make_llm(tiny, max_num_batched_tokens=256)
    together = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone_llm = make_llm(tiny)
    for i, p in enumerate(prompts):
        assert alone_llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids == together[i], i
    assert llm.engine.stats().kv_blocks_used == 0


def test_prefix_cache_200_tokens(tiny) -> None:
    shared = random_prompts(1, 200, 200, seed=1)[0]
    a, b = shared + [11, 12, 13], shared + [21, 22, 23, 24]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = make_llm(tiny, block_size=8)
    llm.generate([a], params, use_tqdm=False)
    before = llm.engine.stats()
    out = llm.generate([b], params, use_tqdm=False)[0]
    after = llm.engine.stats()
    assert out.num_cached_tokens == 200
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 200
    assert after.prefix_cache_miss_tokens - before.prefix_cache_miss_tokens == 4
    uncached = make_llm(tiny, block_size=8, enable_prefix_caching=False)
    assert uncached.generate([b], params, use_tqdm=False)[0].token_ids == out.token_ids


def test_preemption_small_cache_same_outputs_and_accounting(tiny) -> None:
    prompts = random_prompts(6, 20, 40, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = token_ids(make_llm(tiny).generate(prompts, params, use_tqdm=False))
    small = make_llm(tiny, num_kv_blocks=12, block_size=8)  # 96 slots for ~6 * 46 tokens
    got = token_ids(small.generate(prompts, params, use_tqdm=False))
    assert got == expected
    stats = small.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_abort_mid_flight_returns_blocks(tiny) -> None:
    llm = make_llm(tiny, max_num_batched_tokens=64)
    engine = llm.engine
    for i, p in enumerate(random_prompts(5, 30, 90, seed=3)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().kv_blocks_used > 0 and engine.stats().num_waiting > 0
    for i in range(5):
        engine.abort_request(f"r{i}")
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()


def test_seeds_alone_and_batched(tiny) -> None:
    p = random_prompts(1, 10, 10, seed=4)[0]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = make_llm(tiny).generate([p], seeded, use_tqdm=False)[0].token_ids
    others = random_prompts(5, 5, 40, seed=5)
    params = [SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)] * 5 + [seeded]
    batched = make_llm(tiny, max_num_batched_tokens=48).generate(others + [p], params, use_tqdm=False)[-1]
    assert batched.token_ids == alone
    other = make_llm(tiny).generate([p], SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert other[0].token_ids != alone


def test_stop_string_spanning_tokens_real_tokenizer(tiny) -> None:
    llm = make_llm(tiny)
    tokenizer = llm.tokenizer
    prompt = "Once upon a time"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    # a stop string from the last char of token k through the first char of token k+2
    ids, text = free.token_ids, free.text
    ends = [len(tokenizer.decode(ids[:j], skip_special_tokens=True)) for j in range(len(ids) + 1)]
    clean = [text.startswith(tokenizer.decode(ids[:j], skip_special_tokens=True)) for j in range(len(ids) + 1)]
    k = next(
        k for k in range(1, len(ids) - 3)
        if all(clean[k : k + 4]) and all(ends[j + 1] > ends[j] for j in range(k, k + 3))
    )
    stop = text[ends[k + 1] - 1 : ends[k + 2] + 1]
    assert len(stop) >= 3
    first = text.find(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert out.text == text[:first]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_chat_uses_template_and_stops_on_stop_tokens(tiny) -> None:
    llm = make_llm(tiny)
    _, tokenizer, _ = tiny
    im_end = tokenizer.im_end_id
    assert set(tokenizer.stop_token_ids) <= set(llm.engine.eos_token_ids)
    conv = [{"role": "user", "content": "Hello!"}]
    outs = llm.chat([conv, conv], SamplingParams(temperature=0.0, max_tokens=6, logit_bias={im_end: 1e3}), use_tqdm=False)
    for out in outs:
        assert out.prompt_token_ids[-1] != im_end and im_end in out.prompt_token_ids
        assert out.token_ids == [im_end] and out.text == "" and out.outputs[0].finish_reason == "stop"


def test_json_schema_grammar_through_the_constraint_hook(tiny) -> None:
    import json

    from kserve.chat.grammar import GrammarCompiler, GrammarSpec

    model, tokenizer, _ = tiny
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["red", "green"]}},
              "required": ["ok", "c"], "additionalProperties": False}  # bounded: a random model can finish it
    guided = GrammarCompiler(tokenizer, model.config.vocab_size).compile(GrammarSpec.json_schema(schema))
    llm = make_llm(tiny, num_kv_blocks=12, block_size=8)  # small cache: preemption must keep matcher state
    prompts = ["Answer in JSON:", "JSON please", "Reply with an object"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=80, guided=guided), use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        assert set(value) == {"ok", "c"} and isinstance(value["ok"], bool) and value["c"] in ("red", "green")
        assert completion.token_ids[-1] in llm.engine.eos_token_ids
    free = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert not free.text.startswith('{"')  # the grammar, not the model, made these JSON
    assert llm.engine.stats().kv_blocks_used == 0
