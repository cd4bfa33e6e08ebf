"""The offline LLM API: prompt forms, parameter lists, n > 1, logprobs, errors."""

from __future__ import annotations

import pytest
from test_engine_toy import CharTokenizer, make_toy_engine

from kserve import LLM, SamplingParams


def toy_llm(**knobs) -> LLM:
    return LLM.from_engine(make_toy_engine(tokenizer=CharTokenizer(), **knobs))


GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_prompt_forms_agree() -> None:
    llm = toy_llm()
    text = "hello world"
    ids = [ord(c) for c in text]
    single = llm.generate(text, GREEDY, use_tqdm=False)
    as_list = llm.generate([text, "abc"], GREEDY, use_tqdm=False)
    as_ids = llm.generate([ids], GREEDY, use_tqdm=False)
    one_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    assert len(single) == 1 and len(as_list) == 2
    assert single[0].token_ids == as_list[0].token_ids == as_ids[0].token_ids == one_ids[0].token_ids
    assert single[0].prompt == text and single[0].prompt_token_ids == ids
    assert as_ids[0].prompt is None
    assert single[0].text == "".join(chr(t) for t in single[0].token_ids if t > 2)


def test_per_prompt_params_and_order() -> None:
    llm = toy_llm()
    outs = llm.generate(["aaa", "bbb", "ccc"], [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
                                                 for k in (3, 1, 2)], use_tqdm=True)
    assert [len(o.token_ids) for o in outs] == [3, 1, 2]
    with pytest.raises(ValueError, match="SamplingParams for"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_n_and_logprobs() -> None:
    llm = toy_llm()
    out = llm.generate("xyz", SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=4, logprobs=2,
                                             ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and out.text == out.outputs[0].text
    for completion in out.outputs:
        assert len(completion.logprobs) == 4
        for tok, lp in zip(completion.token_ids, completion.logprobs):
            assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 2
            assert max(lp.top.values()) >= lp.logprob - 1e-6


def test_errors_leave_the_engine_clean() -> None:
    llm = toy_llm(num_kv_blocks=8)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["ok prompt", "x" * 100], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.stats().kv_blocks_used == 0
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(no_such_knob=1)


def test_default_model_smoke() -> None:
    llm = LLM(num_kv_blocks=64, dtype="float32", device="cpu")
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3 and isinstance(out.text, str)
    assert llm.engine.max_model_len == 64 * 16
