"""Speculative decoding (n-gram prompt lookup and EAGLE-3 drafts): the output is plain decoding's, token for token.

Exactness tests run on a dequantized copy of the tiny checkpoint: on the FP8 path activations are rounded to
e4m3 per token and a verify step is a different batch shape, which can flip a rounding (see docs/engine.md's
note on batch dependence; `--batch-invariant` removes it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kserve.engine.llm import LLM
from kserve.engine.sampling_params import SamplingParams
from kserve.engine.speculative import NgramProposer, SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def dense_tiny_dir(tiny_k2_dir, tmp_path_factory):
    from kserve.model.loader import write_dequantized_checkpoint

    return write_dequantized_checkpoint(tiny_k2_dir, tmp_path_factory.mktemp("dense") / "k2")


@pytest.fixture(scope="module")
def draft_dir(dense_tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft") / "eagle3"
    subprocess.run([sys.executable, "-m", "kserve.cli", "make-tiny", str(out), "--eagle3-draft-for",
                    str(dense_tiny_dir)], check=True, capture_output=True)
    return out


def _prompts() -> list[list[int]]:
    """Prompts that copy (a repeated span, as tool arguments and quotes do) and prompts that do not."""
    base = [5 + (7 * i) % 300 for i in range(40)]
    return [base + base[:10], base + [1, 2, 3], [9] * 30, base[::-1] + base[::-1][:20], [11, 12] * 16,
            list(range(100, 137)), base[:7] * 5]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=9, max_tokens=20, repetition_penalty=1.2,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12),
        SamplingParams(temperature=1.0, seed=1, max_tokens=16, min_p=0.05, ignore_eos=True),
    ]


def _same(plain, speculative) -> None:
    for a, b in zip(plain, speculative, strict=True):
        assert a.token_ids == b.token_ids
        assert a.text == b.text and a.finish_reason == b.finish_reason
        if a.logprobs is not None:
            assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert list(x.top) == list(y.top)


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_speculation_gives_plain_decoding_tokens(method, dense_tiny_dir, draft_dir) -> None:
    """Greedy and seeded sampling, logprobs, penalties, min_tokens, top-k/top-p/min-p: identical outputs;
    drafts were proposed (and for n-gram accepted) and no cache block is left behind."""
    knobs = {"dtype": "float32", "num_kv_blocks": 96, "max_num_batched_tokens": 64}
    prompts, params = _prompts(), _params()
    # every prompt with two of the parameter sets, all in one batch
    prompts, params = prompts + prompts, params + params[3:] + params[:3]
    with LLM(str(dense_tiny_dir), **knobs) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    spec = NGRAM if method == "ngram" else {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": 3}
    with LLM(str(dense_tiny_dir), speculative_config=spec, **knobs) as llm:
        speculative = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
    _same([o.outputs[0] for o in plain], [o.outputs[0] for o in speculative])
    assert stats.spec_decode.num_draft_tokens > 0
    if method == "ngram":
        assert stats.spec_decode.num_accepted_tokens > 0 and stats.spec_decode.mean_accepted_length > 1
    assert stats.kv_blocks_used == 0  # finished sequences and rejected drafts gave every block back


def test_stop_strings_cut_inside_an_accepted_draft(dense_tiny_dir) -> None:
    """A stop string that ends inside a run of accepted drafts ends the output there, as plain decoding does."""
    knobs = {"dtype": "float32", "num_kv_blocks": 64}
    prompt = [[11, 12] * 16]
    with LLM(str(dense_tiny_dir), **knobs) as llm:
        reference = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0]
        stop = reference.text[len(reference.text) // 2 : len(reference.text) // 2 + 3]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
        plain = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    with LLM(str(dense_tiny_dir), speculative_config=NGRAM, **knobs) as llm:
        speculative = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert stop and plain.finish_reason == "stop"
    _same([plain], [speculative])


def test_ngram_proposer_looks_up_the_latest_match() -> None:
    from kserve.engine.sequence import Sequence

    proposer = NgramProposer(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 2, "prompt_lookup_max": 3}))
    seq = Sequence(0, "r", 0, [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], SamplingParams(), 0)
    assert proposer.propose(seq, 10) == [7, 8, 5]  # the later "1 2 3" wins
    assert proposer.propose(seq, 2) == [7, 8]  # never past the room left
    assert proposer.propose(Sequence(1, "r", 0, [4, 5, 6, 7], SamplingParams(), 0), 5) == []


@pytest.mark.parametrize(("value", "words"), [
    ("{not json", "not valid JSON"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, 'needs "model"'),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown keys ['bogus']"),
])
def test_bad_speculative_configs_are_named(value, words) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.parse(value)


def test_mla_eagle3_drafts_are_refused(draft_dir, tmp_path, dense_tiny_dir) -> None:
    import shutil

    mla = tmp_path / "mla-draft"
    shutil.copytree(draft_dir, mla)
    config = json.loads((mla / "config.json").read_text())
    config.update(architectures=["Eagle3DeepseekV2ForCausalLM"], kv_lora_rank=512)
    (mla / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MLA attention"):
        LLM(str(dense_tiny_dir), dtype="float32", num_kv_blocks=16,
            speculative_config={"method": "eagle3", "model": str(mla), "num_speculative_tokens": 2})


def test_serve_refuses_bad_speculative_config_at_start() -> None:
    result = subprocess.run([sys.executable, "-m", "kserve.cli", "serve", "--port", "0", "--speculative-config",
                             '{"method": "ngram"}'], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "num_speculative_tokens" in result.stderr and "Traceback" not in result.stderr


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_files", "description": "Search the repository for a pattern.",
    "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                   "required": ["pattern"]}}}
CHATS = [
    ("What's the weather like in Paris today?", [WEATHER], "auto"),
    ("Is it raining in Tokyo right now? Use celsius.", [WEATHER], "required"),
    ("Find every TODO under src/server in the repo.", [WEATHER, SEARCH], "required"),
    ("Search for 'def main' in scripts/, then tell me about it.", [SEARCH], {"type": "function",
                                                                          "function": {"name": "search_files"}}),
    ("Say hello in one short sentence.", [], None),
    ("Repeat after me exactly: the quick brown fox jumps over the lazy dog.", [], None),
]


def _chat(client, model: str, text: str, tools: list, choice, stream: bool) -> dict:
    kwargs = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 64}
    if tools:
        kwargs.update(tools=tools, tool_choice=choice)
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in message.message.tool_calls or []]
        return {"content": message.message.content or "", "calls": calls, "finish": message.finish_reason}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def test_served_tool_calls_and_streams_match_plain_decoding(server, ctx) -> None:
    """The embedded model served with n-gram speculation: grammar-forced and automatic tool calls, plain chats,
    streamed and not, give what the default server gives; /metrics reports the drafts."""
    from live_server import openai_client, running_server

    from kserve.config import EngineConfig

    plain = openai_client(server)
    expected = [_chat(plain, ctx.model_name, *chat, stream=False) for chat in CHATS]
    assert any(e["calls"] for e in expected)
    with running_server(EngineConfig(speculative_config=NGRAM)) as spec_server:
        client = openai_client(spec_server)
        for chat, want in zip(CHATS, expected):
            for stream in (False, True):
                assert _chat(client, ctx.model_name, *chat, stream=stream) == want, (chat[0], stream)
        import httpx

        metrics = httpx.get(f"{spec_server.base_url}/metrics").text
        stats = spec_server.app.state.server.context.engine.engine.stats().spec_decode
    assert stats.num_draft_tokens > 0
    assert f"kserve_spec_decode_num_draft_tokens_total {stats.num_draft_tokens}" in metrics
    assert "kserve_spec_decode_acceptance_rate" in metrics


class _FourTokens:
    """A logits processor that leaves four tokens: a small vocabulary for a statistical test."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def __call__(self, output_ids, row):
        import torch

        masked = torch.full_like(row, float("-inf"))
        masked[self.allowed] = row[self.allowed]
        return masked


def test_sampled_distribution_is_the_targets(dense_tiny_dir) -> None:
    """Temperature 1 over a four-token vocabulary: the second token of each completion comes out of a verify step
    (the n-gram proposer drafts from the repeating prompt). Its frequencies, given the first token, match the
    target's probabilities (chi-square, 3 degrees of freedom), and drafts were accepted along the way."""
    import math

    allowed = [40, 41, 42, 43]
    prompt = [40, 41, 40, 41, 40, 41, 40]
    runs = 600
    knobs = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 256}
    with LLM(str(dense_tiny_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                       "prompt_lookup_min": 1, "prompt_lookup_max": 2}, **knobs) as llm:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, logits_processors=[_FourTokens(allowed)])
                  for s in range(runs)]
        outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * runs, params, use_tqdm=False)]
        stats = llm.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0
    first = max(allowed, key=lambda t: sum(o[0] == t for o in outs))
    seconds = [o[1] for o in outs if o[0] == first]
    # the target's exact distribution after that first token, from the model itself
    import torch

    from kserve.model import ForwardBatch, load_model

    model = load_model(dense_tiny_dir, weights="dequantized")
    ids = torch.tensor(prompt + [first])
    cache = torch.zeros(model.config.num_hidden_layers, 2, 16, model.config.kv_cache_dim)
    logits = model.compute_logits(model(ids, ForwardBatch.contiguous([len(ids)], [len(ids)], 16), cache))[-1]
    probs = dict(zip(allowed, torch.softmax(logits[allowed], dim=-1).tolist()))
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4)
    chi2 = sum((sum(s == t for s in seconds) - len(seconds) * p) ** 2 / (len(seconds) * p)
               for t, p in probs.items() if p > 0)
    assert len(seconds) >= 100
    assert chi2 < 16.27, (chi2, probs, len(seconds))  # p = 0.001 at 3 degrees of freedom


def test_speculation_on_fp8_weights_is_exact_in_batch_invariant_mode(tiny_k2_dir) -> None:
    """On the FP8 path a verify step is another batch shape, which can flip an e4m3 rounding; with
    --batch-invariant every query token computes the same bits either way, so n-gram speculation gives
    plain decoding's tokens on the FP8 checkpoint too."""
    knobs = {"dtype": "float32", "num_kv_blocks": 96, "batch_invariant": True}
    prompts, params = _prompts()[:4], _params()[:4]
    with LLM(str(tiny_k2_dir), **knobs) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(tiny_k2_dir), speculative_config=NGRAM, **knobs) as llm:
        speculative = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
    _same([o.outputs[0] for o in plain], [o.outputs[0] for o in speculative])
    assert stats.spec_decode.num_accepted_tokens > 0


def test_eagle3_draft_state_is_dropped_for_aborted_and_finished_requests(dense_tiny_dir, draft_dir) -> None:
    with LLM(str(dense_tiny_dir), dtype="float32", num_kv_blocks=32,
             speculative_config={"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": 2}) as llm:
        engine = llm.engine
        engine.add_request("kept", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        engine.add_request("cut", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        for _ in range(3):
            engine.step()
        assert len(engine.proposer.caches) == 2
        engine.abort_request("cut")
        while engine.has_unfinished():
            engine.step()
        assert engine.proposer.caches == {}
