"""Pydantic models of OpenAI Responses request bodies (`POST /v1/responses`).

Input items stay plain dicts here: `openai_responses` checks them one by one so an error can name the item
(`input[3].call_id`). Unknown fields are ignored; fields this server does not implement are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import Field

from kserve.server.protocol import MAX_TOP_LOGPROBS, StrictRequest

# The one `include` value this server acts on; others (encrypted reasoning, tool sources) name data it never has.
INCLUDE_OUTPUT_LOGPROBS = "message.output_text.logprobs"

UNSUPPORTED_RESPONSES_FIELDS: Mapping[str, str] = MappingProxyType({
    "background": "background responses are not supported",
    "conversation": "conversation objects are not supported; chain responses with 'previous_response_id'",
    "prompt": "stored prompt templates are not supported",
})


class ResponsesTool(StrictRequest):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictRequest):
    type: str
    name: str | None = None


class TextFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictRequest):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(StrictRequest):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(StrictRequest):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)  # calls after this many are dropped
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False
