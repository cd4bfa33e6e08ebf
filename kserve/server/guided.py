"""From request fields to grammar-masked decoding: which requests are constrained, compiled off the loop.

- `response_format` `json_object` / `json_schema` (strict or not): the output is one JSON value.
- `tool_choice` `required`: one tool-call section of calls to the request's tools, nothing else.
- `tool_choice` naming a function: exactly one call to it.
- `tool_choice` `auto`: free text, but an opened section may only call the request's tools with
  arguments matching their schemas (`--tool-grammar off` lifts this, except for `strict: true` tools).
- `tool_choice` `none`, or `--guided-decoding off`: unconstrained.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kserve.chat.grammar import CompiledGrammar, GrammarError, GrammarSpec
from kserve.server.errors import bad_request
from kserve.server.protocol import ResponseFormat


def grammar_spec(
    response_format: ResponseFormat | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict,
    parallel_tool_calls: bool | None,
    *,
    guided_decoding: bool,
    tool_grammar: bool,
) -> GrammarSpec | None:
    """The constraint for this request, or None. Inputs are already validated."""
    if not guided_decoding:
        return None
    parallel = parallel_tool_calls is not False
    if tools and tool_choice != "none":
        if tool_choice == "required":
            return GrammarSpec.tools(tools, "required", parallel)
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            return GrammarSpec.tools([t for t in tools if t["function"]["name"] == name], "forced")
        if tool_grammar or any(t["function"].get("strict") for t in tools):
            return GrammarSpec.tools(tools, "auto", parallel)
    if response_format is not None:
        if response_format.type == "json_object":
            return GrammarSpec.json_object()
        if response_format.type == "json_schema" and response_format.json_schema is not None:
            return GrammarSpec.json_schema(response_format.json_schema.schema_)
    return None


async def compile_grammar(compiler: Any, spec: GrammarSpec | None) -> CompiledGrammar | None:
    """Compile in a worker thread (xgrammar releases the GIL); a schema it cannot handle is a 400."""
    if spec is None or compiler is None:
        return None
    try:
        return await asyncio.to_thread(compiler.compile, spec)
    except GrammarError as exc:
        param = "response_format" if spec.kind != "tools" else "tools"
        raise bad_request(str(exc), param, "invalid_schema") from None
