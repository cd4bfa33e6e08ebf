"""Startup checks: the chat template, tokenizer and tool parser agree on K2's tool-call format, and one
constrained request goes through the whole stack.

A parser that does not match the model's format fails quietly (control tokens in `content`, empty
`tool_calls`), so a mismatch refuses to serve instead; `--skip-self-check` turns this off.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kserve.chat import parse_tool_output
from kserve.chat.markers import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
)
from kserve.server.context import ServingContext

logger = logging.getLogger("kserve.server")

def _tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _call() -> dict[str, Any]:
    return {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _user() -> dict[str, Any]:
    return {"role": "user", "content": "Weather in Paris?"}


class SelfCheckError(RuntimeError):
    pass


def run_self_check(ctx: ServingContext) -> None:
    tokenizer, template = ctx.tokenizer, ctx.template
    for marker in (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END):
        ids = tokenizer.encode(marker, allow_special_tokens=True)
        if len(ids) != 1 or tokenizer.decode(ids, skip_special_tokens=False) != marker:
            raise SelfCheckError(f"tokenizer does not map {marker} to one special token that decodes back: {ids}")
    call = _call()
    prompt = template.render([_user()], _tools(), add_generation_prompt=True)
    history = template.render([_user(), {"role": "assistant", "content": "", "tool_calls": [call]}], _tools(),
                              add_generation_prompt=False)
    if not history.startswith(prompt):
        raise SelfCheckError("the chat template's generation prompt is not a prefix of the rendered assistant turn")
    generated = history[len(prompt):]
    parsed = parse_tool_output(generated, _tools())
    got = [(c.id, c.name, json.loads(c.arguments) if c.valid_json else c.arguments) for c in parsed.calls]
    want = [(call["id"], "get_weather", {"city": "Paris"})]
    if got != want:
        raise SelfCheckError(f"tool parser read {got} from the template's own tool-call turn {generated!r}; "
                             f"expected {want}")
    logger.info("self-check passed: template %s, tokenizer and tool parser agree", template.origin)


def _live_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object",
                       "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["unit"], "additionalProperties": False}}}]


def live_request(model: str) -> dict[str, Any]:
    """The live self-check's request body; fresh each call, since request handling keeps references into it."""
    return {"model": model, "messages": [_user()], "tools": _live_tools(), "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0, "max_tokens": 64}


async def run_live_self_check(ctx: ServingContext) -> None:
    """One internal tool_choice=required request through template, tokenizer, grammar, engine and parser.

    It must come back as one parsed call to the declared tool with schema-valid arguments; otherwise the
    server refuses to start and names the stage that failed. Skipped under --guided-decoding off, where
    nothing forces a model (the tiny random one in particular) to call a tool.
    """
    import jsonschema

    from kserve.server.protocol import ChatCompletionRequest
    from kserve.server.serving_chat import prepare_chat

    if ctx.grammar is None:
        logger.info("live self-check skipped: guided decoding is off")
        return
    raw = live_request(ctx.model_name)
    try:
        prep = await prepare_chat(ctx, ChatCompletionRequest.model_validate(raw), raw)
    except Exception as exc:
        raise SelfCheckError(f"self-check failed at the template/tokenizer/grammar stage: {exc}") from exc
    if prep.params.guided is None:
        raise SelfCheckError("self-check failed at the grammar stage: tool_choice=required was not constrained")
    final = None
    try:
        async for out in ctx.engine.generate(f"self-check-{prep.request_id}", prep.prompt_ids, prep.params):
            final = out
    except Exception as exc:
        raise SelfCheckError(f"self-check failed at the engine stage: {exc}") from exc
    if final is None or not final.finished or final.outputs[0].finish_reason != "stop":
        reason = None if final is None else final.outputs[0].finish_reason
        raise SelfCheckError(f"self-check failed at the engine stage: generation ended with {reason!r}, "
                             "not a stop token after the grammar completed")
    text = final.outputs[0].text
    tools = _live_tools()
    parsed = parse_tool_output(text, tools)
    schema = tools[0]["function"]["parameters"]
    try:
        (call,) = parsed.calls
        if call.name != "get_weather" or not call.valid_json:
            raise ValueError(f"parsed {call.name!r} with arguments {call.arguments!r}")
        jsonschema.validate(json.loads(call.arguments), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        raise SelfCheckError(f"self-check failed at the parser stage: {exc}; model output {text!r}") from exc
    logger.info("live self-check passed: %s(%s)", call.name, call.arguments)
