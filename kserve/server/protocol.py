"""Pydantic models of the OpenAI request and response bodies the server speaks.

Requests validate strictly (no string-to-number coercion) and ignore unknown fields; the fields OpenAI
defines that this server does not implement are listed separately and rejected by name. An explicit `null`
for an optional field means its default, as OpenAI's schemas ("integer or null") and vLLM's read it.
"""

from __future__ import annotations

import time
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16
MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20

# Known OpenAI fields this server does not implement: field -> why / what to use instead.
UNSUPPORTED_CHAT_FIELDS: Mapping[str, str] = MappingProxyType({
    "functions": "the legacy 'functions' field is not supported; use 'tools'",
    "function_call": "the legacy 'function_call' field is not supported; use 'tool_choice'",
    "audio": "audio output is not supported by this text-only model",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "built-in web search is not supported",
    # vLLM's extensions: ignoring them would return unconstrained text with a 200
    "guided_json": "vLLM's 'guided_json' is not supported; use 'response_format' (json_schema)",
    "guided_regex": "vLLM's 'guided_regex' is not supported; use 'response_format' (json_schema)",
    "guided_choice": "vLLM's 'guided_choice' is not supported; use 'response_format' with an enum schema",
    "guided_grammar": "vLLM's 'guided_grammar' is not supported; use 'response_format' (json_schema)",
    "structured_outputs": "vLLM's 'structured_outputs' is not supported; use 'response_format' (json_schema)",
})
UNSUPPORTED_COMPLETION_FIELDS: Mapping[str, str] = MappingProxyType({
    "suffix": "'suffix' (insertion) is not supported",
})


def _admits_none(annotation: Any) -> bool:
    return annotation is Any or annotation is None or type(None) in typing.get_args(annotation)


class StrictRequest(BaseModel):
    """A request body part: strict types (no string-to-number coercion), unknown fields ignored, and `null`
    for an optional field whose type has no None (`"n": null`, `"stream": null`) read as the field's default."""
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = {field.alias or name for name, field in cls.model_fields.items()
                     if not field.is_required() and not _admits_none(field.annotation)}
        return {key: value for key, value in data.items() if not (value is None and key in defaulted)}


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----------------------------------------------------------------------------- requests


class ContentPart(StrictRequest):
    type: str
    text: str | None = None
    model_config = ConfigDict(strict=True, extra="allow")


class FunctionCallMessage(StrictRequest):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallMessage(StrictRequest):
    id: str | None = None
    type: str = "function"
    function: FunctionCallMessage


class ChatMessage(StrictRequest):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # what K2.6 / K2.7-Code templates read first (and what this server returns too)
    # Dynamic tools (Moonshot's extension): a system message's own tools. Kept as sent, so that the checks in
    # kserve.chat.dynamic_tools name each problem exactly (a typed field would give pydantic's generic errors).
    tools: Any = None


class FunctionDefinition(StrictRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictRequest):
    type: str = "function"
    function: FunctionDefinition


class ChatToolChoiceFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: str = "function"
    function: ChatToolChoiceFunction


class JsonSchemaFormat(StrictRequest):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ThinkingToggle(StrictRequest):
    """Moonshot's `thinking` body field: the chat template's `thinking` switch (kserve.server.thinking)."""
    type: Literal["enabled", "disabled"]


class StreamOptions(StrictRequest):
    include_usage: bool = False


class SamplingFields(StrictRequest):
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's template arguments; `thinking` / `preserve_thinking` are read, other keys ignored (kserve.server.thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: ThinkingToggle | None = None
    reasoning_effort: str | None = None  # OpenAI's: "none" turns thinking off, any other effort on
    # vLLM's: reply by continuing the final assistant message (Anthropic's prefill), which then needs no new
    # assistant header (add_generation_prompt unset or false). kserve.server.chat_request.
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    # Extension: the manual-parse flow needs K2's tool markers in the text, so they are kept by default.
    skip_special_tokens: bool = False


# ----------------------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprobEntry] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text as reasoning_content (vLLM's newer name; K2.6 templates read it)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Response):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text as reasoning_content
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kserve"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
