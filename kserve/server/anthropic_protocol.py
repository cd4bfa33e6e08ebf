"""Pydantic models of Anthropic Messages request bodies (`/v1/messages`, `/v1/messages/count_tokens`).

Content blocks stay plain dicts here: `anthropic_messages` checks them one by one, so an error can name the
block (`messages.2.content.0`) and say what is wrong with it. Unknown top-level fields are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import Field

from kserve.server.protocol import StrictRequest

# Anthropic fields this server does not implement: field -> why.
UNSUPPORTED_MESSAGES_FIELDS: Mapping[str, str] = MappingProxyType({
    "mcp_servers": "MCP servers are not supported; declare the tools in 'tools'",
    "container": "code-execution containers are not supported",
})


class AnthropicTool(StrictRequest):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" (or absent); Anthropic's server tools are refused
    strict: bool | None = None


class AnthropicToolChoice(StrictRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictRequest):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class JsonOutputFormat(StrictRequest):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictRequest):
    format: JsonOutputFormat | None = None
    effort: str | None = None


class MessageParam(StrictRequest):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(StrictRequest):
    model: str
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's earlier spelling


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False
