"""Thinking per request: the switch a request sets on the chat template, and how its output is split.

Every chat-shaped API lands on the same two template arguments, `thinking` and `preserve_thinking` (None: the
dialect's default). A request whose prompt ends inside `<think>` is parsed as reasoning from its first token.
Details: docs/server.md, 'Thinking per request'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kserve.chat import ChatDialect, StreamingReasoningParser, split_reasoning
from kserve.chat.markers import THINK_END
from kserve.server.errors import bad_request
from kserve.server.protocol import ChatCompletionRequest

TEMPLATE_SWITCHES = ("thinking", "preserve_thinking")
NO_REASONING_EFFORT = "none"  # OpenAI's effort for "do not reason"
REASONING_EFFORTS = frozenset({NO_REASONING_EFFORT, "minimal", "low", "medium", "high", "xhigh"})


@dataclass(frozen=True)
class ThinkingSwitch:
    """The chat template's thinking arguments one request sets; None leaves the dialect's default."""

    thinking: bool | None = None
    preserve_thinking: bool | None = None

    def template_kwargs(self) -> dict[str, bool | None]:
        return {"thinking": self.thinking, "preserve_thinking": self.preserve_thinking}


def effort_thinking(effort: str | None, param: str) -> bool | None:
    """OpenAI's reasoning effort as the thinking switch: "none" is off, any other effort on (its size is not
    modelled), unset the default; a 400 naming `param` for an effort OpenAI does not define."""
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"{param} must be one of {sorted(REASONING_EFFORTS)}, got {effort!r}", param)
    return effort != NO_REASONING_EFFORT


def requested_thinking(req: ChatCompletionRequest) -> ThinkingSwitch:
    """The switch a chat request sets through `chat_template_kwargs`, `thinking` and `reasoning_effort`; a 400
    for a non-boolean value or for two of them disagreeing."""
    values: dict[str, bool | None] = {name: None for name in TEMPLATE_SWITCHES}
    for name in TEMPLATE_SWITCHES:
        value: Any = (req.chat_template_kwargs or {}).get(name)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"'chat_template_kwargs.{name}' must be a boolean, got {value!r}",
                              f"chat_template_kwargs.{name}", "invalid_type")
        values[name] = value
    if req.thinking is not None:
        toggled = req.thinking.type == "enabled"
        if values["thinking"] is not None and values["thinking"] != toggled:
            raise bad_request(f"'thinking.type' is {req.thinking.type!r} but 'chat_template_kwargs.thinking' is "
                              f"{str(values['thinking']).lower()}; send one, or make them agree", "thinking")
        values["thinking"] = toggled
    by_effort = effort_thinking(req.reasoning_effort, "reasoning_effort")
    if by_effort is not None:
        if values["thinking"] is not None and values["thinking"] != by_effort:
            raise bad_request(f"'reasoning_effort' {req.reasoning_effort!r} turns thinking "
                              f"{'on' if by_effort else 'off'}, but 'thinking' (or 'chat_template_kwargs.thinking') "
                              "turns it the other way; send one, or make them agree", "reasoning_effort")
        values["thinking"] = by_effort
    return ThinkingSwitch(**values)


def continuing_thinking(dialect: ChatDialect, switch: ThinkingSwitch) -> ThinkingSwitch:
    """The switch for a reply that continues the final assistant message: that text is answer, not reasoning,
    so the turn does not think. Unset, thinking turns off (Anthropic: no `thinking`, no thinking); asked for,
    or on a model that always thinks, it is a 400 (Anthropic refuses prefill under thinking too)."""
    if dialect.always_thinks:
        raise bad_request("this model always reasons before it answers, so a final assistant message cannot be "
                          "continued", "messages")
    if not has_thinking_switch(dialect):
        return switch
    if switch.thinking:
        raise bad_request("a final assistant message can only be continued with thinking off: it is the answer's "
                          "start, not reasoning; turn thinking off ('thinking', 'chat_template_kwargs.thinking' or "
                          "'reasoning_effort') or leave it unset", "thinking")
    return ThinkingSwitch(thinking=False, preserve_thinking=switch.preserve_thinking)


def thinking_body(enabled: bool | None) -> dict[str, Any]:
    """Moonshot's `thinking` body field for a chat body built from another API (empty: the default)."""
    return {} if enabled is None else {"thinking": {"type": "enabled" if enabled else "disabled"}}


@dataclass(frozen=True)
class ReasoningMode:
    """Whether a request's output is split into reasoning and answer, and whether it starts as reasoning."""

    parse: bool = False
    starts_in_reasoning: bool = False

    def parser(self) -> StreamingReasoningParser | None:
        return StreamingReasoningParser(starts_in_reasoning=self.starts_in_reasoning) if self.parse else None

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a whole output; None when not parsing or no reasoning block was seen."""
        if not self.parse:
            return None, text
        return split_reasoning(text, starts_in_reasoning=self.starts_in_reasoning)


def reasoning_mode(dialect: ChatDialect, switch: ThinkingSwitch, enable_reasoning: bool) -> ReasoningMode:
    """How a request's output is split: always when its prompt opened `<think>`, else as `--enable-reasoning` says."""
    starts = dialect.starts_in_reasoning(switch.thinking)
    # thinking=false on a template that honours it: the prompt closed the block, so there is no reasoning to find.
    turned_off = switch.thinking is False and has_thinking_switch(dialect)
    return ReasoningMode(parse=starts or (enable_reasoning and not turned_off), starts_in_reasoning=starts)


def has_thinking_switch(dialect: ChatDialect) -> bool:
    """Whether `thinking` changes this dialect's generation prompt (K2.5, K2.6)."""
    return dialect.prefill(True) != dialect.prefill(False)


def think_end_is_skipped(tokenizer: Any) -> bool:
    """Whether skip_special_tokens would drop `</think>` from the text (then reasoning could never end)."""
    token_id = tokenizer.special_ids.get(THINK_END)
    return token_id is not None and tokenizer.is_skippable(token_id)
