"""Grammar construction for K2 (kserve.chat.grammar) checked token by token with xgrammar's matcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_chat_support import SHARED, real_tokenizer

from kserve.chat.grammar import GrammarCompiler, GrammarError, GrammarSpec
from kserve.chat.markers import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END

SCHEMAS_DIR = SHARED / "conformance" / "json_schemas"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get-time.now", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def k2():
    tok = real_tokenizer()
    return tok, GrammarCompiler(tok, model_vocab_size=163840)


def call_text(name: str, idx: int, args: str) -> str:
    return f"{CALL_BEGIN}functions.{name}:{idx}{ARGUMENT_BEGIN}{args}{CALL_END}"


def run(tok, compiled, text: str, *, special: bool = True, stop: bool = True) -> tuple[bool, bool]:
    """Feed text's tokens (then <|im_end|>); returns (all accepted, terminated)."""
    matcher = compiled.make_constraint()
    ids = tok.encode(text, allow_special_tokens=special)
    if stop:
        ids = ids + [tok.im_end_id]
    ok = all(matcher.accept_token(t) for t in ids)
    return ok, matcher.is_terminated()


def test_required_accepts_k2_calls_as_single_marker_tokens(k2):
    tok, compiler = k2
    g = compiler.compile(GrammarSpec.tools([WEATHER, CLOCK], "required"))
    one = SECTION_BEGIN + call_text("get_weather", 0, '{"city": "Paris"}') + SECTION_END
    two = SECTION_BEGIN + call_text("get_weather", 0, '{"city":"A"}') + call_text("get-time.now", 1, "{}") + SECTION_END
    assert run(tok, g, one) == (True, True)
    assert run(tok, g, two) == (True, True)
    # The same bytes spelled as ordinary text tokens are not a tool call.
    assert run(tok, g, one, special=False)[0] is False
    # Nothing may precede the section, and a section must hold at least one call.
    assert run(tok, g, "hi" + one)[0] is False
    assert run(tok, g, SECTION_BEGIN + SECTION_END)[0] is False


def test_required_binds_names_and_arguments(k2):
    tok, compiler = k2
    g = compiler.compile(GrammarSpec.tools([WEATHER], "required"))
    assert run(tok, g, SECTION_BEGIN + call_text("get_time", 0, "{}") + SECTION_END)[0] is False
    assert run(tok, g, SECTION_BEGIN + call_text("get_weather", 0, '{"town": "x"}') + SECTION_END)[0] is False
    assert run(tok, g, SECTION_BEGIN + call_text("get_weather", 0, '{"city": 3}') + SECTION_END)[0] is False


def test_tool_arguments_hold_no_key_their_schema_does_not_list(k2):
    """Every tool's listed objects are closed, strict or not, as vLLM and SGLang compile schemas: an open key's
    free string let the embedded model run a forced call to the context's end (docs/server.md). Free-form objects,
    `additionalProperties` given, and `patternProperties` (which xgrammar's strict mode would refuse) stay open."""
    tok, compiler = k2

    def accepts(function, arguments):
        tool = {"type": "function", "function": function}
        text = SECTION_BEGIN + call_text(function["name"], 0, arguments) + SECTION_END
        return run(tok, compiler.compile(GrammarSpec.tools([tool], "required")), text)[0]

    for strict in ({}, {"strict": True}, {"strict": False}):
        weather = {**WEATHER["function"], **strict}
        assert accepts(weather, '{"city": "Paris"}')
        assert not accepts(weather, '{"city": "Paris", "unit": "C"}')
    nested = {"name": "nested_tool", "parameters": {"type": "object", "properties": {
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}}}}}
    assert accepts(nested, '{"location": {"lat": 1.5, "lon": 2}}')
    assert not accepts(nested, '{"location": {"lat": 1.5}, "note": "x"}')
    assert not accepts(nested, '{"location": {"lat": 1.5, "alt": 3}}')
    assert accepts({"name": "log", "parameters": {"type": "object"}}, '{"level": "info"}')
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert accepts({"name": "f", "parameters": {**listed, "additionalProperties": True}}, '{"a": 1, "b": [2]}')
    assert accepts({"name": "f", "parameters": {**listed, "additionalProperties": {"type": "string"}}},
                   '{"a": 1, "b": "x"}')
    assert not accepts({"name": "f", "parameters": {**listed, "additionalProperties": {"type": "string"}}},
                       '{"a": 1, "b": 2}')
    patterned = {"name": "f", "parameters": {**listed, "patternProperties": {"^x": {"type": "integer"}}}}
    assert accepts(patterned, '{"a": 1, "x1": 2}')


def test_a_response_format_schema_is_closed_too(k2):
    """One rule for every schema the grammar binds: a non-strict `json_schema` response format admits no
    unlisted key either."""
    tok, compiler = k2
    g = compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}}))
    assert run(tok, g, '{"n": 3}') == (True, True)
    assert run(tok, g, '{"n": 3, "m": 4}')[0] is False
    assert run(tok, compiler.compile(GrammarSpec.json_object()), '{"m": {"k": [1]}}') == (True, True)


def test_a_number_has_at_most_twenty_digits_in_each_run(k2):
    """A forced call's number could otherwise grow digit by digit to the context's end (the sixty-third
    run did, docs/embedded_model.md); a string's `pattern` keeps its own repetition."""
    tok, compiler = k2
    schema = {"type": "object", "properties": {
        "n": {"type": "number"}, "i": {"type": "integer"}, "m": {"type": "integer", "minimum": 5},
        "code": {"type": "string", "pattern": "^[0-9]+$"}}}
    g = compiler.compile(GrammarSpec.json_schema(schema))
    for value in ("1" * 20, "-" + "9" * 20 + "." + "5" * 20 + "e+" + "1" * 20, "0.5", "1e3"):
        assert run(tok, g, '{"n": %s}' % value) == (True, True), value
    for field in ("n", "i", "m"):
        assert run(tok, g, '{"%s": %s}' % (field, "1" * 20)) == (True, True)
        assert run(tok, g, '{"%s": %s}' % (field, "1" * 21))[0] is False
    assert run(tok, g, '{"n": 1.%s}' % ("2" * 21))[0] is False
    assert run(tok, g, '{"code": "%s"}' % ("7" * 40)) == (True, True)


def test_marker_token_cannot_hide_inside_a_json_string(k2):
    tok, compiler = k2
    g = compiler.compile(GrammarSpec.tools([WEATHER], "required"))
    matcher = g.make_constraint()
    prefix = tok.encode(SECTION_BEGIN + CALL_BEGIN + "functions.get_weather:0" + ARGUMENT_BEGIN + '{"city": "Pa')
    assert all(matcher.accept_token(t) for t in prefix)
    assert not matcher.accept_token(tok.special_ids[CALL_END])
    assert not matcher.accept_token(tok.im_end_id)


def test_forced_allows_exactly_one_call_to_the_named_tool(k2):
    tok, compiler = k2
    g = compiler.compile(GrammarSpec.tools([CLOCK], "forced"))
    assert run(tok, g, SECTION_BEGIN + call_text("get-time.now", 0, "{}") + SECTION_END) == (True, True)
    two = SECTION_BEGIN + call_text("get-time.now", 0, "{}") + call_text("get-time.now", 1, "{}") + SECTION_END
    assert run(tok, g, two)[0] is False


def test_auto_leaves_text_free_and_binds_sections(k2):
    tok, compiler = k2
    g = compiler.compile(GrammarSpec.tools([WEATHER], "auto"))
    assert run(tok, g, "Just text, {not json} <b>ok</b>") == (True, True)
    good = "Let me check. " + SECTION_BEGIN + call_text("get_weather", 0, '{"city": "Oslo"}') + SECTION_END
    assert run(tok, g, good) == (True, True)
    # The turn ends with the section: no second section, no text after it.
    assert run(tok, g, good + SECTION_BEGIN + call_text("get_weather", 1, '{"city": "Rome"}') + SECTION_END)[0] is False
    assert run(tok, g, good + "more")[0] is False
    assert run(tok, g, "x" + SECTION_BEGIN + call_text("nope", 0, "{}") + SECTION_END)[0] is False
    # A call marker outside a section, or a section that never closes, is not allowed.
    assert run(tok, g, call_text("get_weather", 0, '{"city": "Oslo"}'))[0] is False
    open_section = SECTION_BEGIN + call_text("get_weather", 0, '{"city": "Oslo"}')
    assert run(tok, g, open_section, stop=False) == (True, False)
    assert run(tok, g, open_section)[0] is False  # cannot stop before the section ends


def test_auto_with_an_answer_schema_allows_a_section_or_that_json(k2):
    """tools with tool_choice auto beside a response format: call, or answer in the format, never free text."""
    tok, compiler = k2
    answer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    g = compiler.compile(GrammarSpec.tools([WEATHER], "auto", answer=answer))
    section = SECTION_BEGIN + call_text("get_weather", 0, '{"city": "Oslo"}') + SECTION_END
    assert run(tok, g, section) == (True, True)
    assert run(tok, g, '{"n": 3}') == (True, True)
    assert run(tok, g, "Just text")[0] is False
    assert run(tok, g, '{"n": "3"}')[0] is False
    assert run(tok, g, '{"n": 3}' + section)[0] is False  # one or the other
    assert run(tok, g, SECTION_BEGIN + call_text("get_weather", 0, '{"town": "x"}') + SECTION_END)[0] is False
    with pytest.raises(GrammarError):
        GrammarSpec.tools([WEATHER], "required", answer=answer)


def test_turn_markers_are_never_allowed(k2):
    tok, compiler = k2
    g = compiler.compile(GrammarSpec.tools([WEATHER], "auto"))
    matcher = g.make_constraint()
    assert not matcher.accept_token(tok.special_ids["<|im_system|>"])
    assert not matcher.accept_token(tok.special_ids["<|im_user|>"])


def test_json_schema_and_json_object(k2):
    tok, compiler = k2
    g = compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    assert run(tok, g, '{"n":12}') == (True, True)
    assert run(tok, g, '{"n":"12"}')[0] is False
    obj = compiler.compile(GrammarSpec.json_object())
    assert run(tok, obj, '{"a":[1,2,{"b":null}]}') == (True, True)
    assert run(tok, obj, "[1]")[0] is False


def test_arguments_follow_the_schema_s_property_order_not_the_alphabet(k2):
    """xgrammar binds properties in the order the schema lists them, as OpenAI's structured outputs write them;
    a spec that sorted its schema's keys forced `{"from_unit": ...}` before `"value"` and pushed a model that
    writes the schema's order off its own arguments (docs/embedded_model.md, the sixty-third run)."""
    tok, compiler = k2
    convert = {"type": "function", "function": {"name": "unit_convert", "parameters": {
        "type": "object", "properties": {"value": {"type": "number"}, "from_unit": {"type": "string"},
                                         "to_unit": {"type": "string"}},
        "required": ["value", "from_unit", "to_unit"]}}}
    in_order = '{"value": 164, "from_unit": "kg", "to_unit": "pounds"}'
    for spec in (GrammarSpec.tools([convert], "required"), GrammarSpec.tools([convert], "auto")):
        assert run(tok, compiler.compile(spec), SECTION_BEGIN + call_text("unit_convert", 0, in_order) + SECTION_END) \
            == (True, True)
    answer = compiler.compile(GrammarSpec.json_schema(convert["function"]["parameters"]))
    assert run(tok, answer, in_order) == (True, True)
    assert run(tok, answer, '{"from_unit": "kg", "to_unit": "pounds", "value": 164}')[0] is False


def test_compiled_grammars_are_cached_by_spec(k2):
    _, compiler = k2
    a = compiler.compile(GrammarSpec.tools([WEATHER], "required"))
    b = compiler.compile(GrammarSpec.tools([json.loads(json.dumps(WEATHER))], "required"))
    assert a is b
    assert compiler.compile(GrammarSpec.tools([WEATHER], "auto")) is not a


def test_rollback_restores_state(k2):
    tok, compiler = k2
    g = compiler.compile(GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}}))
    m = g.make_constraint()
    ids = tok.encode("[1,2")
    assert all(m.accept_token(t) for t in ids)
    m.rollback(len(ids))
    assert all(m.accept_token(t) for t in tok.encode("[3]"))
    assert m.accept_token(tok.im_end_id) and m.is_terminated()


def test_invalid_schema_is_a_grammar_error(k2):
    _, compiler = k2
    with pytest.raises(GrammarError):
        compiler.compile(GrammarSpec.json_schema({"type": "string", "minLength": 10**12}))
    with pytest.raises(GrammarError):
        GrammarSpec.tools([{"type": "function", "function": {"parameters": {}}}], "required")


def test_every_conformance_schema_compiles_or_is_refused_cleanly(k2):
    if not SCHEMAS_DIR.is_dir():
        pytest.skip("../shared/conformance/json_schemas is absent")
    _, compiler = k2
    compiled, refused = 0, []
    for path in sorted(SCHEMAS_DIR.glob("*.jsonl")):
        for i, line in enumerate(path.read_text().splitlines()):
            schema = json.loads(line)
            for spec in (GrammarSpec.json_schema(schema), GrammarSpec.tools([{"type": "function", "function": {"name": "f", "parameters": schema}}], "required")):
                try:
                    compiler.compile(spec)
                    compiled += 1
                except GrammarError:
                    refused.append((path.name, i, spec.kind))
    assert compiled + len(refused) == 2 * 212
    # xgrammar refuses minLength beyond int32 in TestRangeConstraints; everything else compiles.
    assert len(refused) <= 2, refused


def test_tiny_tokenizer_vocab_is_padded_to_the_model(tiny_k2_dir: Path):
    from kserve.chat import load_tokenizer
    from kserve.config import ModelConfig

    tok = load_tokenizer(tiny_k2_dir)
    cfg = ModelConfig.from_model_dir(tiny_k2_dir)
    compiler = GrammarCompiler(tok, cfg.vocab_size)
    assert compiler.tokenizer_info.vocab_size == cfg.vocab_size
    assert sorted(compiler.tokenizer_info.stop_token_ids) == sorted(tok.stop_token_ids)
    g = compiler.compile(GrammarSpec.tools([WEATHER], "required"))
    assert run(tok, g, SECTION_BEGIN + call_text("get_weather", 0, '{"city": "Rome"}') + SECTION_END) == (True, True)


def test_length_bounded_strings_stay_strict_json(k2):
    # xgrammar's own string rules admit raw control characters (maxLength) and surrogates; ours must not.
    tok, compiler = k2
    byte_ids = {tok.token_bytes(i)[0]: i for i in range(tok.base_vocab_size) if len(tok.token_bytes(i)) == 1}
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]}
    for spec in (GrammarSpec.json_schema(schema),
                 GrammarSpec.tools([{"type": "function", "function": {"name": "f", "parameters": schema}}], "required")):
        g = compiler.compile(spec)
        prefix = "" if spec.kind == "json_schema" else SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARGUMENT_BEGIN
        assert run(tok, g, prefix + '{"s":"a\x13b"}', stop=False)[0] is False
        ok, _ = run(tok, g, prefix + '{"s": "ab"}', stop=False)
        assert ok
        # A UTF-16 surrogate spelled in UTF-8 bytes (ED A0 80) is no character either.
        m = g.make_constraint()
        assert all(m.accept_token(t) for t in tok.encode(prefix + '{"s":"'))
        assert not all(m.accept_token(byte_ids[b]) for b in (0xED, 0xA0, 0x80))
