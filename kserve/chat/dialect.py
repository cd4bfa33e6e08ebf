"""Chat dialects: what differs between the Kimi K2 generations' prompt formats, as data.

One frozen ``ChatDialect`` per generation (K2-Instruct, K2-Thinking, K2.5, K2.6, K2.7-Code) holds every rendering
difference (default system prompt, tool declaration format, generation prefill, which assistant turns keep their
reasoning, image placeholders...); the built-in renderer reads only these fields. ``detect_dialect`` tells a shipped
template's generation from features of its text, and ``prepare_tools`` does what Moonshot's tokenizer wrapper does to
tools before any template sees them (deep sort, TypeScript declarations with a JSON fallback).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kserve.chat.markers import DEFAULT_SYSTEM_PROMPT, IM_END, THINK_BEGIN, THINK_END
from kserve.chat.tool_declaration_ts import deep_sorted, encode_tools_typescript

logger = logging.getLogger(__name__)


class ToolDeclarationFormat(str, Enum):
    """How the ``tool_declare`` turn writes the tools."""

    JSON = "json"  # compact JSON, keys in the client's order (K2-Instruct)
    JSON_SORTED = "json-sorted"  # compact JSON of deep-sorted tools (K2-Thinking as on Hugging Face today)
    JSON_SORTED_SPACED = "json-sorted-spaced"  # `tojson()` with spaces, deep-sorted (the K2-Thinking copy in goldens)
    TYPESCRIPT = "typescript"  # `tools_ts_str`; compact deep-sorted JSON when that encoding fails (K2.5 on)


class HistoryReasoning(str, Enum):
    """Which assistant turns of the conversation show their reasoning."""

    NONE = "none"  # no <think> block at all (K2-Instruct)
    # Turns up to and including the last assistant answer without tool calls get an empty <think></think>; later
    # ones (the current agent turn) keep theirs.
    DROP_BEFORE_LAST_ANSWER = "drop-before-last-answer"
    PRESERVE = "preserve"  # every assistant turn keeps its reasoning (K2.7-Code)


@dataclass(frozen=True)
class ChatDialect:
    """One generation's prompt format. Every field is a difference some generation has."""

    name: str
    # Injected as a system turn (after the tool declaration) when the first message is not a system message.
    default_system_prompt: str | None
    # Whether that injection also happens for an empty conversation (the K2-Thinking template checks length == 0).
    default_system_without_messages: bool
    tool_declaration: ToolDeclarationFormat
    # Written after `<|im_assistant|>assistant<|im_middle|>` by add_generation_prompt, thinking on / off.
    generation_prefill: str
    generation_prefill_without_thinking: str
    # The model reasons whatever `thinking` says; the template ignores thinking=False.
    always_thinks: bool
    history_reasoning: HistoryReasoning
    # preserve_thinking=True keeps every turn's reasoning (and stops thinking=False blanking the current turn's).
    honours_preserve_thinking: bool
    # thinking=False writes <think></think> for the assistant turns that would otherwise keep reasoning.
    blanks_reasoning_without_thinking: bool
    # Message keys read for reasoning, first present wins (a present null prints as null_text).
    reasoning_fields: tuple[str, ...]
    # Content parts: which `type`s (or, for the K2 family, which keys) make an image, and what is written for one.
    image_part_types: tuple[str, ...]
    image_part_keys: tuple[str, ...]
    image_placeholder: str
    video_part_types: tuple[str, ...]
    video_placeholder: str
    eos_token: str  # the token that ends a generated assistant turn
    # How a present-but-null field prints: "" in kserve's K2 format, "None" where Moonshot's jinja template prints it.
    null_text: str
    # Fill reasoning_content from `reasoning` / `thinking` before a jinja template sees the messages (kserve's K2
    # behaviour); the thinking generations get the messages exactly as sent, as Moonshot's wrapper does.
    aliases_reasoning_fields: bool
    # The wrapper's defaults for the chat_template_kwargs.
    thinking_default: bool = True
    preserve_thinking_default: bool = False

    @property
    def sorts_tools(self) -> bool:
        """Whether tools are deep-sorted before rendering (Moonshot's wrapper from K2-Thinking on)."""
        return self.tool_declaration is not ToolDeclarationFormat.JSON

    def prefill(self, thinking: bool | None = None) -> str:
        """What the generation prompt ends with after the assistant header."""
        thinking = self.thinking_default if thinking is None else thinking
        if thinking is False and not self.always_thinks:
            return self.generation_prefill_without_thinking
        return self.generation_prefill

    def starts_in_reasoning(self, thinking: bool | None = None) -> bool:
        """Whether generated text begins inside a reasoning block (the prompt already opened ``<think>``)."""
        return self.prefill(thinking).endswith(THINK_BEGIN)

    def model_opens_reasoning(self, thinking: bool | None = None) -> bool:
        """Whether the model itself writes ``<think>`` first (it always thinks, and the prompt did not open it)."""
        return self.always_thinks and not self.starts_in_reasoning(thinking)


_K2_MEDIA = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>\n"
_K25_MEDIA = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
_K25_VIDEO = "<|kimi_k25_video_placeholder|>\n"

K2 = ChatDialect(
    name="k2",
    default_system_prompt=DEFAULT_SYSTEM_PROMPT,
    default_system_without_messages=False,
    tool_declaration=ToolDeclarationFormat.JSON,
    generation_prefill="",
    generation_prefill_without_thinking="",
    always_thinks=False,
    history_reasoning=HistoryReasoning.NONE,
    honours_preserve_thinking=False,
    blanks_reasoning_without_thinking=False,
    reasoning_fields=(),
    image_part_types=("image",),
    image_part_keys=("image", "image_url"),
    image_placeholder=_K2_MEDIA,
    video_part_types=(),
    video_placeholder="",
    eos_token=IM_END,
    null_text="",
    aliases_reasoning_fields=True,
)
K2_THINKING = dataclasses.replace(
    K2,
    name="k2-thinking",
    default_system_without_messages=True,
    tool_declaration=ToolDeclarationFormat.JSON_SORTED_SPACED,
    always_thinks=True,  # the model opens <think> itself; the template has no prefill and no thinking switch
    history_reasoning=HistoryReasoning.DROP_BEFORE_LAST_ANSWER,
    reasoning_fields=("reasoning_content",),
    null_text="None",
    aliases_reasoning_fields=False,
)
K2_5 = dataclasses.replace(
    K2_THINKING,
    name="k2.5",
    default_system_prompt=None,
    default_system_without_messages=False,
    tool_declaration=ToolDeclarationFormat.TYPESCRIPT,
    generation_prefill=THINK_BEGIN,
    generation_prefill_without_thinking=THINK_BEGIN + THINK_END,
    always_thinks=False,
    blanks_reasoning_without_thinking=True,
    image_part_types=("image", "image_url"),
    image_part_keys=(),
    image_placeholder=_K25_MEDIA,
    video_part_types=("video", "video_url"),
    video_placeholder=_K25_VIDEO,
)
K2_6 = dataclasses.replace(
    K2_5,
    name="k2.6",
    honours_preserve_thinking=True,
    reasoning_fields=("reasoning", "reasoning_content"),
)
K2_7_CODE = dataclasses.replace(
    K2_6,
    name="k2.7-code",
    generation_prefill_without_thinking=THINK_BEGIN,
    always_thinks=True,
    history_reasoning=HistoryReasoning.PRESERVE,
    honours_preserve_thinking=False,
    blanks_reasoning_without_thinking=False,
)

DIALECTS: tuple[ChatDialect, ...] = (K2, K2_THINKING, K2_5, K2_6, K2_7_CODE)


def dialect_named(name: str) -> ChatDialect:
    """The dialect called ``name`` (``k2``, ``k2-thinking``, ``k2.5``, ``k2.6``, ``k2.7-code``)."""
    for dialect in DIALECTS:
        if dialect.name == name:
            return dialect
    raise ValueError(f"unknown chat dialect {name!r}; known: {', '.join(d.name for d in DIALECTS)}")


# Features of a template's text. A literal default system turn, and the JSON spacing of the tool declaration.
_LITERAL_SYSTEM_TURN = re.compile(r"<\|im_system\|>system<\|im_middle\|>([^{}<>]*)<\|im_end\|>")
_COMPACT_TOOLS_JSON = re.compile(r"tools\s*\|\s*tojson\(\s*separators")


def detect_dialect(template_text: str | None) -> ChatDialect:
    """The generation a chat template renders, from features of its text ("k2" for no template or K2-Instruct's).

    ``tools_ts_str`` marks K2.5 on; among those, one that never writes an empty ``<think></think>`` keeps every
    turn's reasoning (K2.7-Code), and one that reads ``preserve_thinking`` is K2.6. Without TypeScript tools, a
    template that writes ``reasoning_content`` in ``<think>`` blocks is K2-Thinking. The default system prompt and
    (for K2-Thinking) the JSON spacing are then read from the template itself.
    """
    if template_text is None:
        return K2
    if "tools_ts_str" in template_text:
        if THINK_BEGIN + THINK_END not in template_text:
            dialect = K2_7_CODE
        elif "preserve_thinking" in template_text:
            dialect = K2_6
        else:
            dialect = K2_5
    elif "reasoning_content" in template_text and THINK_BEGIN in template_text:
        compact = _COMPACT_TOOLS_JSON.search(template_text) is not None
        dialect = dataclasses.replace(K2_THINKING, tool_declaration=ToolDeclarationFormat.JSON_SORTED
                                      if compact else ToolDeclarationFormat.JSON_SORTED_SPACED)
    else:
        return K2
    system_turn = _LITERAL_SYSTEM_TURN.search(template_text)
    refined = dataclasses.replace(dialect, default_system_prompt=system_turn.group(1) if system_turn else None)
    return next((known for known in DIALECTS if known == refined), refined)  # the named constant when it is one


@dataclass(frozen=True)
class PreparedTools:
    """Tools as the template sees them: deep-sorted where the dialect sorts, plus their TypeScript declaration."""

    tools: list | None
    typescript: str | None = None  # None: not a TypeScript dialect, no tools, or the encoding failed

    def translated(self, translate: Callable[[Any], Any]) -> PreparedTools:
        """Both forms passed through ``translate`` (a string mapper applied after sorting, so order is kept)."""
        return PreparedTools(translate(self.tools), None if self.typescript is None else translate(self.typescript))


def prepare_tools(dialect: ChatDialect, tools: list | None) -> PreparedTools:
    """What Moonshot's wrapper does before rendering: deep-sort, then encode TypeScript (JSON if that fails)."""
    if dialect.sorts_tools:
        tools = deep_sorted(tools)
    typescript = None
    if dialect.tool_declaration is ToolDeclarationFormat.TYPESCRIPT and tools:
        try:
            typescript = encode_tools_typescript(tools)
        except Exception as exc:  # the wrapper falls back to JSON on any failure of the encoder, so do we
            logger.debug("tool declarations fall back to compact JSON: %s", exc)
    return PreparedTools(tools, typescript)
