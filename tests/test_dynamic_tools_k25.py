"""Dynamic tools in a K2.5+ dialect: TypeScript declarations (with the JSON fallback), Moonshot's jinja templates
against the built-in renderer, and the server over a tiny random k25 checkpoint (the K2.6 dialect, no template):
the same request contract as test_dynamic_tools.py, and calls under thinking on and off.

The tiny model is random: every tool call below is the grammar's doing, so the calls use argument-free tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kserve.chat import ChatTemplate, encode_tools_typescript, load_tokenizer
from kserve.chat.dialect import K2_6, dialect_named, prepare_tools
from kserve.chat.markers import SECTION_BEGIN, THINK_END, TOOL_MARKER_TOKENS
from kserve.config import EngineConfig

pytest.importorskip("openai")  # live_server imports the SDK
from live_server import running_server  # noqa: E402
from test_dynamic_tools import (  # noqa: E402
    REJECTED,
    USER,
    WEATHER,
    assert_openai_error,
    dynamic,
    fn,
    post_chat,
    tokenize,
)

K25_TEMPLATES = Path(__file__).resolve().parents[1].parent / "shared" / "kimi_k25" / "templates"
PING = {"type": "function", "function": {"name": "ping", "description": "Ping the host.",
                                         "parameters": {"type": "object", "properties": {},
                                                        "additionalProperties": False}}}
PONG = {"type": "function", "function": {"name": "pong", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}
# A schema the TypeScript encoding refuses (an enum value of the wrong type): the declaration falls back to JSON.
NOT_TYPESCRIPT = fn("odd", parameters={"type": "object", "properties": {"a": {"type": "string", "enum": [1]}}})
THINKING_OFF = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def k25_server(tiny_k25_dir):
    with running_server(EngineConfig(model=str(tiny_k25_dir))) as srv:
        yield srv


@pytest.fixture(scope="module")
def k25_ctx(k25_server):
    return k25_server.app.state.server.context


# ----------------------------------------------------------------------------- chat layer


def test_dynamic_declaration_is_the_request_levels_typescript():
    template = ChatTemplate(dialect=K2_6)
    prompt = template.render([USER, dynamic(WEATHER)], thinking=False)
    typescript = encode_tools_typescript(prepare_tools(K2_6, [WEATHER]).tools)
    assert typescript.startswith("# Tools") and "type get_weather = (_: {" in typescript
    assert prompt == ("<|im_user|>user<|im_middle|>what is the weather in beijing?<|im_end|>"
                      f"<|im_system|>tool_declare<|im_middle|>{typescript}<|im_end|>"
                      "<|im_assistant|>assistant<|im_middle|><think></think>")
    assert f"<|im_system|>tool_declare<|im_middle|>{typescript}<|im_end|>" in template.render([USER], [WEATHER])


def test_typescript_failure_falls_back_to_compact_sorted_json_as_the_request_level_does():
    template = ChatTemplate(dialect=K2_6)
    fallback = json.dumps(prepare_tools(K2_6, [NOT_TYPESCRIPT]).tools, ensure_ascii=False, separators=(",", ":"))
    assert f"tool_declare<|im_middle|>{fallback}<|im_end|>" in template.render([dynamic(NOT_TYPESCRIPT), USER])
    assert f"tool_declare<|im_middle|>{fallback}<|im_end|>" in template.render([USER], [NOT_TYPESCRIPT])


@pytest.mark.parametrize("generation", ["k2-thinking", "k2.5", "k2.6", "k2.7-code"])
def test_moonshot_templates_render_dynamic_tools_as_the_builtin_renderer(generation, tiny_k25_dir):
    path = K25_TEMPLATES / generation / "chat_template.jinja"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    jinja = ChatTemplate(source=path.read_text(encoding="utf-8"), origin=str(path))
    builtin = ChatTemplate(dialect=jinja.dialect)
    assert jinja.dialect.name.startswith(generation)
    tokenizer = load_tokenizer(tiny_k25_dir)
    history = [{"role": "assistant", "content": "", "reasoning_content": "look it up",
                "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                "function": {"name": "get_weather", "arguments": "{\"city\": \"Beijing\"}"}}]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    conversations = [
        ([{"role": "system", "content": "s"}, USER, dynamic(WEATHER, NOT_TYPESCRIPT)], [PING]),
        ([dynamic(PING), USER, *history, dynamic(PONG)], None),
        ([USER, {"role": "assistant", "content": "4"}, dynamic(WEATHER), USER], [PING]),
    ]
    for messages, tools in conversations:
        for thinking in (True, False):
            assert jinja.render(messages, tools, thinking=thinking) == builtin.render(messages, tools,
                                                                                      thinking=thinking)
            assert (jinja.encode(tokenizer, messages, tools, thinking=thinking)
                    == builtin.encode(tokenizer, messages, tools, thinking=thinking))


def test_every_dialect_declares_dynamic_tools_in_its_request_level_format():
    for name in ("k2", "k2-thinking", "k2.5", "k2.6", "k2.7-code"):
        template = ChatTemplate(dialect=dialect_named(name))
        request_level = template.render([USER], [WEATHER]).split("<|im_end|>")[0]
        dynamic_turn = template.render([dynamic(WEATHER), USER]).split("<|im_end|>")[0]
        assert dynamic_turn == request_level, name


# ----------------------------------------------------------------------------- server (k2.6 dialect)


def test_the_server_speaks_the_k26_dialect(k25_ctx):
    assert k25_ctx.template.is_builtin and k25_ctx.template.dialect.name == "k2.6"


@pytest.mark.parametrize("stream", [False, True], ids=["nostream", "stream"])
@pytest.mark.parametrize("case_id,fields,param,code", REJECTED, ids=[c[0] for c in REJECTED])
def test_contract_violations_are_openai_shaped_400s(k25_server, case_id, fields, param, code, stream):
    status, body = post_chat(k25_server, fields, stream=stream, max_tokens=4)
    assert_openai_error(status, body, param, code)


def test_tokenize_renders_the_typescript_declaration(k25_server, k25_ctx):
    fields = {"messages": [USER, dynamic(WEATHER)], **THINKING_OFF}
    resp = tokenize(k25_server, fields)
    assert resp.status_code == 200, resp.text
    expected = k25_ctx.template.encode(k25_ctx.tokenizer, [USER, dynamic(WEATHER)], thinking=False)
    assert resp.json()["tokens"] == expected
    assert "namespace functions" in k25_ctx.tokenizer.decode(expected, skip_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True], ids=["nostream", "stream"])
@pytest.mark.parametrize("thinking", [False, True], ids=["thinking_off", "thinking_on"])
def test_required_with_only_dynamic_tools_calls_one(k25_server, k25_ctx, stream, thinking):
    # One call (parallel_tool_calls false), so that the random model's turn ends well within max_tokens.
    fields: dict[str, Any] = {"messages": [USER, dynamic(PING, PONG)], "tool_choice": "required",
                              "parallel_tool_calls": False}
    if stream:
        fields["stream_options"] = {"include_usage": True}
    if thinking:  # the random model must end its reasoning; the grammar starts after `</think>`
        fields["logit_bias"] = {str(k25_ctx.tokenizer.special_ids[THINK_END]): 100.0}
    else:
        fields.update(THINKING_OFF)
    status, out = post_chat(k25_server, fields, stream=stream, temperature=0, max_tokens=48)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] in {"ping", "pong"} and json.loads(call["function"]["arguments"]) == {}
    if stream:
        rendered = {key: fields[key] for key in ("messages", "thinking") if key in fields}
        assert out["usage"]["prompt_tokens"] == tokenize(k25_server, rendered).json()["count"]


@pytest.mark.parametrize("stream", [False, True], ids=["nostream", "stream"])
def test_markers_are_masked_without_tools_while_reasoning_too(k25_server, k25_ctx, stream):
    bias = {str(k25_ctx.tokenizer.special_ids[SECTION_BEGIN]): 100.0}
    status, out = post_chat(k25_server, {"messages": [USER], "logit_bias": bias}, stream=stream, temperature=0,
                            max_tokens=12)
    assert status == 200, out
    choice = out["choices"][0]
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] in ("stop", "length")
    text = json.dumps(out.get("chunks") or choice["message"])
    assert not any(marker in text for marker in TOOL_MARKER_TOKENS)
