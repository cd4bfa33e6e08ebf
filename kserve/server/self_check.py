"""Startup checks: template, tokenizer, reasoning split and tool parser agree; one constrained request runs end to end.

Both use K2's tool-call format. A mismatched parser would fail quietly, so a mismatch refuses to serve instead
(`--skip-self-check` turns this off). Details: docs/server.md, 'Startup self-check'.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kserve.chat import HistoryReasoning, parse_tool_output
from kserve.chat.markers import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
)
from kserve.server.context import ServingContext
from kserve.server.thinking import ThinkingSwitch, has_thinking_switch, reasoning_mode

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


_REASONING = "The user wants the weather; call the tool."
LIVE_THINK_END_BIAS = 100.0  # on `</think>` in the live request: reasoning ends at the first token


class SelfCheckError(RuntimeError):
    pass


def run_self_check(ctx: ServingContext) -> None:
    tokenizer, template = ctx.tokenizer, ctx.template
    dialect = template.dialect
    markers = [SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END]
    if dialect.starts_in_reasoning():
        markers.append(THINK_END)  # where reasoning ends, and where the grammar takes over
    for marker in markers:
        ids = tokenizer.encode(marker, allow_special_tokens=True)
        if len(ids) != 1 or tokenizer.decode(ids, skip_special_tokens=False) != marker:
            raise SelfCheckError(f"tokenizer does not map {marker} to one special token that decodes back: {ids}")
    for thinking in (None, False) if has_thinking_switch(dialect) else (None,):
        _check_tool_call_turn(ctx, ThinkingSwitch(thinking=thinking))
    logger.info("self-check passed: template %s (%s), tokenizer, reasoning split and tool parser agree",
                template.origin, dialect.name)


def _check_tool_call_turn(ctx: ServingContext, switch: ThinkingSwitch) -> None:
    """The template's own assistant turn (reasoning where it shows any, then one call), generated after its own
    generation prompt, reads back as that reasoning and that call."""
    template = ctx.template
    call = _call()
    assistant: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
    if template.dialect.history_reasoning is not HistoryReasoning.NONE:
        assistant["reasoning_content"] = _REASONING
    kwargs = switch.template_kwargs()
    prompt = template.render([_user()], _tools(), add_generation_prompt=True, **kwargs)
    history = template.render([_user(), assistant], _tools(), add_generation_prompt=False, **kwargs)
    where = f"(thinking={switch.thinking})" if switch.thinking is not None else ""
    if not history.startswith(prompt):
        raise SelfCheckError(f"the chat template's generation prompt is not a prefix of the rendered assistant turn "
                             f"{where}".rstrip())
    # What the model generates: the turn up to its stop token (the engine keeps stop tokens out of the text).
    generated = history[len(prompt):].removesuffix(template.dialect.eos_token)
    mode = reasoning_mode(template.dialect, switch, ctx.settings.enable_reasoning)
    reasoning, text = mode.split(generated)
    if mode.parse and _REASONING in generated and reasoning != _REASONING:
        raise SelfCheckError(f"reasoning split read {reasoning!r} from the template's own turn {generated!r} "
                             f"{where}; expected {_REASONING!r}")
    parsed = parse_tool_output(text, _tools())
    got = [(c.id, c.name, json.loads(c.arguments) if c.valid_json else c.arguments) for c in parsed.calls]
    want = [(call["id"], "get_weather", {"city": "Paris"})]
    if got != want or (mode.parse and parsed.content.strip()):
        raise SelfCheckError(f"tool parser read {got} and content {parsed.content!r} from the template's own "
                             f"tool-call turn {generated!r} {where}; expected {want} and no content")


def _live_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object",
                       "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["unit"], "additionalProperties": False}}}]


def live_request(model: str, think_end_id: int | None = None) -> dict[str, Any]:
    """The live self-check's request body; fresh each call, since request handling keeps references into it.
    With `think_end_id` (a prompt that opens reasoning), reasoning ends at once."""
    body: dict[str, Any] = {"model": model, "messages": [_user()], "tools": _live_tools(), "tool_choice": "required",
                            "parallel_tool_calls": False, "temperature": 0, "max_tokens": 64}
    if think_end_id is not None:
        body["logit_bias"] = {str(think_end_id): LIVE_THINK_END_BIAS}
    return body


async def run_live_self_check(ctx: ServingContext) -> None:
    """One internal tool_choice=required request through template, tokenizer, grammar, engine and parser.

    It must come back as one parsed call to the declared tool with schema-valid arguments; otherwise the
    server refuses to start and names the stage that failed. Skipped under --guided-decoding off, where
    nothing forces a model (the tiny random one in particular) to call a tool.
    """
    import jsonschema

    from kserve.server.guided import AfterReasoning
    from kserve.server.protocol import ChatCompletionRequest
    from kserve.server.serving_chat import prepare_chat

    if ctx.grammar is None:
        logger.info("live self-check skipped: guided decoding is off")
        return
    think_end_id = ctx.tokenizer.special_ids.get(THINK_END) if ctx.template.dialect.starts_in_reasoning() else None
    raw = live_request(ctx.model_name, think_end_id)
    try:
        prep = await prepare_chat(ctx, ChatCompletionRequest.model_validate(raw), raw)
    except Exception as exc:
        raise SelfCheckError(f"self-check failed at the template/tokenizer/grammar stage: {exc}") from exc
    if prep.params.guided is None:
        raise SelfCheckError("self-check failed at the grammar stage: tool_choice=required was not constrained")
    if think_end_id is not None and not isinstance(prep.params.guided, AfterReasoning):
        raise SelfCheckError("self-check failed at the grammar stage: the prompt opens reasoning but the grammar "
                             "does not wait for it to end")
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
    _, answer = prep.reasoning.split(text)
    parsed = parse_tool_output(answer, tools)
    schema = tools[0]["function"]["parameters"]
    try:
        (call,) = parsed.calls
        if call.name != "get_weather" or not call.valid_json:
            raise ValueError(f"parsed {call.name!r} with arguments {call.arguments!r}")
        jsonschema.validate(json.loads(call.arguments), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        raise SelfCheckError(f"self-check failed at the parser stage: {exc}; model output {text!r}") from exc
    logger.info("live self-check passed: %s(%s)", call.name, call.arguments)
