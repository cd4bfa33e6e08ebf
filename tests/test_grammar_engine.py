"""Grammar-masked decoding through the engine on the tiny random model (temperature 1.0)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kserve import LLM, SamplingParams
from kserve.chat import parse_tool_output
from kserve.chat.grammar import GrammarCompiler, GrammarSpec
from kserve.chat.markers import TOOL_MARKER_TOKENS as TOOL_MARKERS

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set-mode.v2", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
        "required": ["on", "level"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def llm(tiny_k2_dir):
    return LLM(tiny_k2_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def compiler(llm):
    return GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size)


def prompts(llm, n):
    return [llm.tokenizer.encode(f"Request {i}: call a tool.") for i in range(n)]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_use_single_marker_tokens_and_valid_arguments(llm, compiler, parallel):
    tok = llm.tokenizer
    guided = compiler.compile(GrammarSpec.tools(TOOLS, "required", parallel_tool_calls=parallel))
    outs = llm.generate(prompts(llm, 12),
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=160, skip_special_tokens=False,
                                        guided=guided) for i in range(12)], use_tqdm=False)
    marker_ids = {tok.special_ids[m] for m in TOOL_MARKERS}
    finished = 0
    for out in outs:
        ids = out.token_ids
        # Every marker in the text comes from a single special id, never from spelled-out text tokens.
        for t in ids:
            if t not in marker_ids and t not in tok.stop_token_ids:
                assert "<|" not in tok.decode([t]), (t, tok.decode([t]))
        assert ids[0] == tok.special_ids["<|tool_calls_section_begin|>"]
        text = out.outputs[0].text
        assert sum(text.count(m) for m in TOOL_MARKERS) == sum(1 for t in ids if t in marker_ids)
        if out.outputs[0].finish_reason == "length":
            continue
        finished += 1
        parsed = parse_tool_output(text, TOOLS)
        assert parsed.calls, text
        for call in parsed.calls:
            assert call.name in SCHEMAS
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if not parallel:
        # One call with short arguments fits easily; a random model may chain many parallel calls.
        assert finished >= 8, f"only {finished}/12 single calls finished inside max_tokens"


def test_json_schema_output_validates(llm, compiler):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["ok", "n"], "additionalProperties": False}
    guided = compiler.compile(GrammarSpec.json_schema(schema))
    outs = llm.generate(prompts(llm, 8), [SamplingParams(temperature=1.0, seed=i, max_tokens=64, guided=guided)
                                          for i in range(8)], use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_unconstrained_rows_are_unaffected_by_constrained_neighbours(llm, compiler):
    """The same eight rows, the last four with and without a grammar: the first four must not change.

    The reference keeps the batch's shape: a batch of another size takes other GEMM blockings on the CPU,
    which moves fp32 logits by ~1e-6 and can flip a sample (batch invariance is its own mode)."""
    guided = compiler.compile(GrammarSpec.json_object())
    plain = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24) for i in range(4)]
    neighbours = [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(4)]
    unguided = llm.generate(prompts(llm, 8), plain + neighbours, use_tqdm=False)
    mixed = llm.generate(prompts(llm, 8), plain + [SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                                                                  guided=guided) for i in range(4)], use_tqdm=False)
    assert [o.outputs[0].text for o in mixed[4:]] != [o.outputs[0].text for o in unguided[4:]]  # the grammar bit
    assert [o.token_ids for o in unguided[:4]] == [o.token_ids for o in mixed[:4]]
