"""Engine core on the toy paged model: batching, prefix cache, preemption, accounting, stops."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_toy import TOY_VOCAB, CharTokenizer, make_toy_engine, run_to_completion

from kserve.engine.sampling_params import SamplingParams


def prompts(count: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TOY_VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def generate(engine, token_lists, params) -> list[list[int]]:
    for i, toks in enumerate(token_lists):
        engine.add_request(f"r{i}", toks, params if not isinstance(params, list) else params[i])
    outs = run_to_completion(engine)
    return [outs[f"r{i}"].token_ids for i in range(len(token_lists))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_batched_equals_alone_with_chunking() -> None:
    ps = prompts(16)
    together = generate(make_toy_engine(max_num_batched_tokens=64), ps, GREEDY)
    for i, p in enumerate(ps):
        alone = generate(make_toy_engine(), [p], GREEDY)[0]
        assert together[i] == alone, i
    assert all(len(t) == 12 for t in together)


def test_preemption_recomputes_and_matches_large_cache() -> None:
    ps = prompts(8, seed=3, lo=10, hi=30)
    big = make_toy_engine(num_kv_blocks=512)
    expected = generate(big, ps, GREEDY)
    small = make_toy_engine(num_kv_blocks=24)  # 96 token slots: nowhere near all 8 at once
    got = generate(small, ps, GREEDY)
    assert got == expected
    stats = small.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_preemption_without_prefix_cache() -> None:
    ps = prompts(6, seed=4, lo=10, hi=30)
    expected = generate(make_toy_engine(), ps, GREEDY)
    small = make_toy_engine(num_kv_blocks=20, enable_prefix_caching=False)
    assert generate(small, ps, GREEDY) == expected
    assert small.stats().num_preemptions > 0


def test_prefix_cache_computes_only_new_tokens() -> None:
    engine = make_toy_engine(block_size=4)
    shared = prompts(1, seed=5, lo=200, hi=200)[0]
    first = shared + [5, 6, 7]
    second = shared + [9, 10, 11, 12, 13]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("a", first, params)
    out_a = run_to_completion(engine)["a"]
    before = engine.runner.model.tokens_computed
    hits_before = engine.stats().prefix_cache_hit_tokens
    engine.add_request("b", second, params)
    out_b = run_to_completion(engine)["b"]
    computed = engine.runner.model.tokens_computed - before
    assert engine.stats().prefix_cache_hit_tokens - hits_before == 200
    assert out_b.num_cached_tokens == 200
    # 5 new prompt tokens + 4 decode steps (the 5th token needs no forward)
    assert computed == 5 + 4
    fresh = make_toy_engine(block_size=4)
    assert generate(fresh, [second], params)[0] == out_b.token_ids
    assert out_a.token_ids == generate(make_toy_engine(block_size=4), [first], params)[0]


def test_abort_everywhere_returns_blocks() -> None:
    engine = make_toy_engine(num_kv_blocks=40, max_num_batched_tokens=16)
    baseline = engine.stats()
    for i, p in enumerate(prompts(10, seed=6, lo=10, hi=40)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for step in range(6):
        engine.step()
    assert engine.stats().kv_blocks_used > 0
    for i in range(0, 10, 2):
        assert engine.abort_request(f"r{i}").output().outputs[0].finish_reason == "abort"
    run_to_completion(engine)
    end = engine.stats()
    assert end.kv_blocks_used == baseline.kv_blocks_used == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_n_completions_share_prompt_blocks() -> None:
    engine = make_toy_engine(block_size=4)
    p = prompts(1, seed=7, lo=41, hi=41)[0]
    # temperature 2: the toy model is peaked enough at 1.0 that three seeds can agree by chance
    params = SamplingParams(n=3, temperature=2.0, seed=11, max_tokens=6, ignore_eos=True)
    engine.add_request("r", p, params)
    out = run_to_completion(engine)["r"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct derived seeds
    stats = engine.stats()
    # siblings hit the 10 full blocks (40 tokens) the first completion cached
    assert stats.prefix_cache_hit_tokens == 2 * 40
    assert stats.kv_blocks_used == 0


def test_seed_reproducible_alone_or_batched() -> None:
    p = prompts(1, seed=8)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = generate(make_toy_engine(), [p], seeded)[0]
    others = prompts(7, seed=9)
    mix = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)] * 7 + [seeded]
    batched = generate(make_toy_engine(max_num_batched_tokens=32), others + [p], mix)[-1]
    assert batched == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True)
    assert generate(make_toy_engine(), [p], other_seed)[0] != alone


def test_stop_string_across_tokens_is_cut_and_never_streamed() -> None:
    engine = make_toy_engine(tokenizer=CharTokenizer())
    p = prompts(1, seed=10)[0]
    free = generate(engine, [p], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    text = "".join(chr(t) for t in free if t > 2)
    stop = text[5:8]  # spans three tokens
    assert len(stop) == 3 and text.find(stop) == 5
    engine.add_request("s", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]))
    streamed = []
    while engine.has_unfinished():
        for req in engine.step():
            streamed.append(req.output().outputs[0].text)
    final = req.output().outputs[0]
    assert final.text == text[:5]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert all(stop[0] not in s[5:] for s in streamed)
    assert all(final.text.startswith(s) for s in streamed)

    engine.add_request("t", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                              stop=[stop], include_stop_str_in_output=True))
    assert run_to_completion(engine)["t"].text == text[:8]


def test_stop_token_and_min_tokens() -> None:
    engine = make_toy_engine(tokenizer=CharTokenizer())
    p = prompts(1, seed=12)[0]
    free = generate(engine, [p], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    stop_tok = free[3]
    engine.add_request("a", p, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_tok]))
    out = run_to_completion(engine)["a"].outputs[0]
    first = free.index(stop_tok)
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    # logit_bias makes the EOS id (1) the greedy choice; min_tokens holds it off
    bias = {1: 1e4}
    engine.add_request("b", p, SamplingParams(temperature=0.0, max_tokens=8, logit_bias=bias))
    assert run_to_completion(engine)["b"].token_ids == [1]
    engine.add_request("c", p, SamplingParams(temperature=0.0, max_tokens=8, logit_bias=bias, min_tokens=3))
    got = run_to_completion(engine)["c"].outputs[0]
    assert len(got.token_ids) == 4 and got.token_ids[-1] == 1 and 1 not in got.token_ids[:3]
    engine.add_request("d", p, SamplingParams(temperature=0.0, max_tokens=5, logit_bias=bias, ignore_eos=True))
    got = run_to_completion(engine)["d"].outputs[0]
    assert got.token_ids == [1] * 5 and got.finish_reason == "length"


def test_bad_requests_are_rejected_cleanly() -> None:
    engine = make_toy_engine(num_kv_blocks=8, block_size=4)  # max_model_len 32
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("x", [5] * 40, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("y", [], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("z", [TOY_VOCAB + 5], GREEDY)
    engine.add_request("ok", [5] * 20, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    out = run_to_completion(engine)["ok"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_extreme_seeds_are_folded_and_reproducible() -> None:
    # seed + i * stride used to overflow int64 in the sampler and fail every request in the step
    engine = make_toy_engine()
    p = prompts(1, seed=9)[0]
    for rid, seed in (("max", 2**63 - 1), ("neg", -(2**63)), ("minus1", -1)):
        engine.add_request(rid, p, SamplingParams(n=2, seed=seed, max_tokens=6, ignore_eos=True))
    engine.add_request("plain", p, GREEDY)
    outs = run_to_completion(engine)
    for rid in ("max", "neg", "minus1", "plain"):
        assert all(o.finish_reason == "length" for o in outs[rid].outputs), rid
    again = make_toy_engine()
    again.add_request("max", p, SamplingParams(n=2, seed=2**63 - 1, max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in run_to_completion(again)["max"].outputs] == [
        o.token_ids for o in outs["max"].outputs
    ]
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=1.5)


def test_sampling_params_that_would_fail_in_the_sampler_are_refused_up_front() -> None:
    for bias in ({"x": 1.0}, {5: float("nan")}, {5: "1"}, {True: 1.0}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bias)
    SamplingParams(logit_bias={5: -100, 6: 2.5})


def test_a_row_that_fails_to_sample_fails_only_its_request() -> None:
    ps = prompts(3, seed=4)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logit_bias={7: 0.5})
    expected = generate(make_toy_engine(), ps[1:], [sampled, GREEDY])
    engine = make_toy_engine()
    broken = engine.add_request("broken", ps[0], SamplingParams(temperature=1.0, max_tokens=5))
    broken.seqs[0].seed = 2**80  # no int64 holds it: the batched sampler call raises
    engine.add_request("r0", ps[1], sampled)
    engine.add_request("r1", ps[2], GREEDY)
    outs = run_to_completion(engine)
    assert broken.error is not None and broken.finished
    # the neighbours were sampled row by row from untouched logits: the same tokens as without it
    assert [outs["r0"].token_ids, outs["r1"].token_ids] == expected
    assert engine.block_manager.num_used_blocks == 0


class HoldsLastCharDetokenizer:
    """Holds each piece's last character until the next call, as a detokenizer waiting on UTF-8 does."""

    def __init__(self, tok: CharTokenizer) -> None:
        self.tok, self.pending = tok, ""

    def add(self, token_ids: list[int]) -> str:
        text = self.pending + self.tok.decode(token_ids)
        self.pending = text[-1:]
        return text[:-1]

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


class HoldingTokenizer(CharTokenizer):
    def detokenizer(self, skip_special_tokens: bool = False) -> HoldsLastCharDetokenizer:
        return HoldsLastCharDetokenizer(self)


class ForceTokens:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __call__(self, output_token_ids, logits):
        forced = torch.full_like(logits, float("-inf"))
        forced[self.tokens[len(output_token_ids)]] = 0.0
        return forced


def test_stop_string_completed_by_the_final_flush_is_a_stop() -> None:
    engine = make_toy_engine(tokenizer=HoldingTokenizer())
    text = "xyab"
    params = SamplingParams(temperature=0.0, max_tokens=len(text), stop=["ab"],
                            logits_processors=[ForceTokens([ord(c) for c in text])])
    engine.add_request("r", prompts(1)[0], params)
    out = run_to_completion(engine)["r"].outputs[0]
    assert out.text == "xy"
    assert out.finish_reason == "stop" and out.stop_reason == "ab"


def test_refused_prompts_raise_prompt_rejected() -> None:
    from kserve.engine.errors import PromptRejected

    engine = make_toy_engine(num_kv_blocks=8, block_size=4)  # max_model_len 32
    for ids, params in (
        ([5] * 40, GREEDY), ([], GREEDY), ([TOY_VOCAB], GREEDY), ([-1], GREEDY), (["5"], GREEDY),
        ([5, 6], SamplingParams(prompt_logprobs=1)),
    ):
        with pytest.raises(PromptRejected):
            engine.validate_prompt(ids, params)
        with pytest.raises(PromptRejected):
            engine.add_request("x", ids, params)
    assert not engine.has_unfinished()
    engine.validate_prompt([5] * 31, GREEDY)  # the longest prompt that still leaves room for a token
