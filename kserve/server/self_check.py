"""Startup check that the chat template, tokenizer and tool parser agree on K2's tool-call format.

A parser that does not match the model's format fails quietly (control tokens in `content`, empty
`tool_calls`), so a mismatch refuses to serve instead; `--skip-self-check` turns this off.
"""

from __future__ import annotations

import json
import logging

from kserve.chat import parse_tool_output
from kserve.chat.markers import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END
from kserve.server.context import ServingContext

logger = logging.getLogger("kserve.server")

_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
_CALL = {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
_USER = {"role": "user", "content": "Weather in Paris?"}


class SelfCheckError(RuntimeError):
    pass


def run_self_check(ctx: ServingContext) -> None:
    tokenizer, template = ctx.tokenizer, ctx.template
    for marker in (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END):
        ids = tokenizer.encode(marker, allow_special_tokens=True)
        if len(ids) != 1 or tokenizer.decode(ids, skip_special_tokens=False) != marker:
            raise SelfCheckError(f"tokenizer does not map {marker} to one special token that decodes back: {ids}")
    prompt = template.render([_USER], _TOOLS, add_generation_prompt=True)
    history = template.render([_USER, {"role": "assistant", "content": "", "tool_calls": [_CALL]}], _TOOLS,
                              add_generation_prompt=False)
    if not history.startswith(prompt):
        raise SelfCheckError("the chat template's generation prompt is not a prefix of the rendered assistant turn")
    generated = history[len(prompt):]
    parsed = parse_tool_output(generated, _TOOLS)
    got = [(c.id, c.name, json.loads(c.arguments) if c.valid_json else c.arguments) for c in parsed.calls]
    want = [(_CALL["id"], "get_weather", {"city": "Paris"})]
    if got != want:
        raise SelfCheckError(f"tool parser read {got} from the template's own tool-call turn {generated!r}; "
                             f"expected {want}")
    logger.info("self-check passed: template %s, tokenizer and tool parser agree", template.origin)
