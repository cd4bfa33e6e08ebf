"""Chat templates: the built-in renderer or a jinja template, and injection-safe prompt encoding.

A ``ChatTemplate`` knows its ``ChatDialect`` (detected from the template's text, K2-Instruct without one): the built-in
renderer follows it, and a jinja template gets what Moonshot's tokenizer wrapper gives it (deep-sorted tools,
``tools_ts_str``, ``thinking`` / ``preserve_thinking``), so both give the official bytes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kserve.chat.builtin_renderer import render_prepared
from kserve.chat.dialect import ChatDialect, PreparedTools, detect_dialect, dialect_named, prepare_tools
from kserve.chat.dynamic_tools import expand_dynamic_tools
from kserve.chat.jinja_renderer import compile_template, render_jinja

logger = logging.getLogger(__name__)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather information",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
    },
}

# Conversations rendered both ways at load time (thinking on and off) to detect a template that drifts from the
# built-in format of its dialect.
SELF_CHECK_CONVERSATIONS: tuple[tuple[list[dict], list | None, bool], ...] = (
    ([{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "What is 1+1?"}], None, True),
    (
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "Weather in Beijing?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Beijing"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": '{"weather": "Sunny"}'},
        ],
        [_WEATHER_TOOL],
        True,
    ),
    (
        [
            {"role": "system", "content": "a"},
            {"role": "user", "name": "alice", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello"},
            {"role": "system", "content": "last system"},
        ],
        None,
        False,
    ),
    ([{"role": "user", "content": "no system prompt given"}], None, True),
    (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "add"},
            {"role": "user", "content": "Weather in Beijing?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "call the tool",
                "tool_calls": [
                    {"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Beijing"}}}
                ],
            },
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
        ],
        [_WEATHER_TOOL],
        True,
    ),
)


# Stands in for a continued message's text: outside the private-use block _pick_sentinels draws from, and with no
# control-token first character, so hiding control tokens leaves it as it is.
_CONTINUE_MARK = "\U000F0000continue\U000F0001"


def _alias_reasoning_fields(messages: list[dict]) -> list[dict]:
    """Like HF: fill ``reasoning_content`` (and ``thinking``) from whichever reasoning field a message has."""
    out = []
    for message in messages:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _translate_strings(obj: Any, table: dict[int, str]) -> Any:
    """Copy of ``obj`` with ``str.translate(table)`` applied to every string (dict keys included)."""
    if isinstance(obj, str):
        return obj.translate(table)
    if isinstance(obj, dict):
        return {_translate_strings(k, table): _translate_strings(v, table) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_translate_strings(v, table) for v in obj]
    return obj


def _pick_sentinels(text: str, count: int) -> list[str]:
    """``count`` private-use characters that don't occur in ``text``."""
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in text)
    out = [ch for _, ch in zip(range(count), free)]
    if len(out) < count:
        raise ValueError("cannot find free private-use characters to mark client text")
    return out


def first_difference(a: str, b: str) -> int | None:
    """Index of the first differing character, or None when equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _resolve_dialect(dialect: ChatDialect | str | None, source: str | None) -> ChatDialect:
    if isinstance(dialect, str):
        return dialect_named(dialect)
    return detect_dialect(source) if dialect is None else dialect


@dataclass
class ChatTemplate:
    """A prompt renderer: the built-in format of ``dialect`` (``source is None``) or a jinja template.

    ``dialect`` defaults to the one detected from ``source`` (K2-Instruct's without a template); the engine and server
    read thinking defaults, the reasoning parser's start state and the EOS token from it.
    """

    source: str | None = None
    origin: str = "builtin"
    # A ChatDialect or its name; None: detected from source. Always a ChatDialect after construction.
    dialect: ChatDialect | str | None = None
    _compiled: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.dialect = _resolve_dialect(self.dialect, self.source)
        if self.source is not None:
            self._compiled = compile_template(self.source)

    @property
    def is_builtin(self) -> bool:
        return self.source is None

    @classmethod
    def load(cls, model_dir: str | Path | None = None, template_path: str | Path | None = None, *,
             dialect: ChatDialect | str | None = None) -> ChatTemplate:
        """The model's template (``chat_template.jinja``, then ``tokenizer_config.json``) or the built-in renderer.

        ``dialect`` is the generation of a model that ships no template (its family's, decided at load); a
        shipped template's own text decides otherwise.
        """
        template = cls._from_files(model_dir, template_path)
        if dialect is not None and template.is_builtin:
            template.dialect = _resolve_dialect(dialect, None)
        if not template.is_builtin:
            template.check_against_builtin()
        return template

    @classmethod
    def _from_files(cls, model_dir, template_path) -> ChatTemplate:
        if template_path is not None:
            path = Path(template_path)
            return cls(source=path.read_text(encoding="utf-8"), origin=str(path))
        if model_dir is None:
            return cls()
        model_dir = Path(model_dir)
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.exists():
            return cls(source=jinja_file.read_text(encoding="utf-8"), origin=str(jinja_file))
        config_file = model_dir / "tokenizer_config.json"
        if config_file.exists():
            config = json.loads(config_file.read_text(encoding="utf-8"))
            source = config.get("chat_template")
            if isinstance(source, list):  # [{"name": ..., "template": ...}]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
            if isinstance(source, str):
                return cls(source=source, origin=f"{config_file}:chat_template")
        return cls()

    def check_against_builtin(self) -> str | None:
        """Render the self-check conversations both ways; log one warning at the first difference."""
        builtin = ChatTemplate(dialect=self.dialect)
        for index, (messages, tools, add_gen) in enumerate(SELF_CHECK_CONVERSATIONS):
            for thinking in (True, False):
                ours = builtin.render(messages, tools, add_gen, thinking=thinking)
                try:
                    theirs = self.render(messages, tools, add_gen, thinking=thinking)
                except Exception as exc:  # a template that can't render our checks is worth one warning too
                    message = f"chat template {self.origin} failed on self-check conversation {index}: {exc}"
                    logger.warning(message)
                    return message
                pos = first_difference(ours, theirs)
                if pos is not None:
                    message = (
                        f"chat template {self.origin} differs from the built-in {self.dialect.name} format on "
                        f"self-check conversation {index} (thinking={thinking}) at character {pos}: template "
                        f"{theirs[pos:pos + 40]!r} vs built-in {ours[pos:pos + 40]!r}"
                    )
                    logger.warning(message)
                    return message
        return None

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True, *,
               thinking: bool | None = None, preserve_thinking: bool | None = None) -> str:
        """The prompt text. ``thinking`` / ``preserve_thinking`` are the chat_template_kwargs Kimi templates read;
        None takes the dialect's default (True / False, as Moonshot's wrapper). A system message carrying ``tools``
        (dynamic tools) renders as a ``tool_declare`` turn where it sits (kserve.chat.dynamic_tools)."""
        return self._render_prepared(expand_dynamic_tools(self.dialect, messages), prepare_tools(self.dialect, tools),
                                     add_generation_prompt, thinking, preserve_thinking)

    def _render_prepared(self, messages: list[dict], prepared: PreparedTools, add_generation_prompt: bool,
                         thinking: bool | None, preserve_thinking: bool | None) -> str:
        dialect = self.dialect
        thinking = dialect.thinking_default if thinking is None else thinking
        preserve_thinking = dialect.preserve_thinking_default if preserve_thinking is None else preserve_thinking
        if self.is_builtin:
            return render_prepared(dialect, messages, prepared, add_generation_prompt, thinking, preserve_thinking)
        if dialect.aliases_reasoning_fields:
            messages = _alias_reasoning_fields(messages)
        kwargs: dict[str, Any] = {"thinking": thinking, "preserve_thinking": preserve_thinking}
        if prepared.typescript is not None:
            kwargs["tools_ts_str"] = prepared.typescript
        return render_jinja(self._compiled, messages, prepared.tools or None, add_generation_prompt, **kwargs)

    def _render_for_encoding(self, messages: list[dict], prepared: PreparedTools, add_generation_prompt: bool,
                             thinking: bool | None, preserve_thinking: bool | None, continue_final: bool) -> str:
        if not continue_final:
            return self._render_prepared(messages, prepared, add_generation_prompt, thinking, preserve_thinking)
        # The whole conversation as history, cut where the final message's text begins, then that text.
        final = messages[-1]
        held = self._render_prepared([*messages[:-1], {**final, "content": _CONTINUE_MARK}], prepared, False,
                                     thinking, preserve_thinking)
        if held.count(_CONTINUE_MARK) != 1:
            raise ValueError("the chat template does not write the final message's text once, so it cannot be "
                             "continued")
        return held[: held.index(_CONTINUE_MARK)] + (final.get("content") or "")

    def encode(self, tokenizer, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
               legacy: bool = False, *, thinking: bool | None = None,
               preserve_thinking: bool | None = None, continue_final: bool = False) -> list[int]:
        """Prompt ids: template control tokens become single ids; client text never does.

        ``continue_final``: the prompt ends inside the final (assistant) message, after its text, as the template
        writes that turn in history: the reply continues it (vLLM's continue_final_message, Anthropic's prefill).

        Client strings are rendered a second time with the first character of every control token (``<``, ``[``)
        replaced by an unused private-use character, so every control-token string left in that render was written
        by the template. The real render is split at those positions; the text between is encoded with special
        tokens treated as text. Tools are prepared (sorted, TypeScript-encoded) once, before that replacement, so
        both renders declare them in the same order and the whole declaration counts as client text. Dynamic tools
        become their ``tool_declare`` turns the same way, once, before the replacement (their bodies are client text).
        """
        messages = expand_dynamic_tools(self.dialect, messages)
        prepared = prepare_tools(self.dialect, tools)
        text = self._render_for_encoding(messages, prepared, add_generation_prompt, thinking, preserve_thinking,
                                         continue_final)
        if legacy:
            return tokenizer.encode(text, allow_special_tokens=True)
        starts = sorted({token[0] for token in tokenizer.special_ids})
        sentinels = _pick_sentinels(text, len(starts))
        hide = {ord(c): s for c, s in zip(starts, sentinels)}
        unhide = {ord(s): c for c, s in zip(starts, sentinels)}
        marked = self._render_for_encoding(_translate_strings(messages, hide),
                                           prepared.translated(lambda value: _translate_strings(value, hide)),
                                           add_generation_prompt, thinking, preserve_thinking, continue_final)
        if len(marked) != len(text) or marked.translate(unhide) != text:
            raise ValueError(f"chat template {self.origin} transforms client text; cannot separate control tokens")
        ids: list[int] = []
        pos = 0
        for match in tokenizer.special_token_regex.finditer(marked):
            ids.extend(tokenizer.encode(text[pos:match.start()], allow_special_tokens=False))
            ids.append(tokenizer.special_ids[match.group()])
            pos = match.end()
        ids.extend(tokenizer.encode(text[pos:], allow_special_tokens=False))
        return ids


def render_prompt(messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                  template: str | ChatTemplate | None = None, *, dialect: ChatDialect | str | None = None,
                  thinking: bool | None = None, preserve_thinking: bool | None = None) -> str:
    """Render a chat prompt: the built-in format (of ``dialect``, K2-Instruct's by default) when ``template`` is
    None, else the given jinja template."""
    if template is None:
        template = ChatTemplate(dialect=dialect)
    elif isinstance(template, str):
        template = ChatTemplate(source=template, origin="<string>", dialect=dialect)
    return template.render(messages, tools, add_generation_prompt, thinking=thinking,
                           preserve_thinking=preserve_thinking)
