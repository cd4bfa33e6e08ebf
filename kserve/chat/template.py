"""Chat templates: the built-in renderer or a jinja template, and injection-safe prompt encoding."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kserve.chat.builtin_renderer import render_builtin
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

# Conversations rendered both ways at load time to detect a template that drifts from the built-in format.
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
)


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


@dataclass
class ChatTemplate:
    """A prompt renderer: the built-in K2 format (``source is None``) or a jinja template."""

    source: str | None = None
    origin: str = "builtin"
    _compiled: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.source is not None:
            self._compiled = compile_template(self.source)

    @property
    def is_builtin(self) -> bool:
        return self.source is None

    @classmethod
    def load(cls, model_dir: str | Path | None = None, template_path: str | Path | None = None) -> "ChatTemplate":
        template = cls._from_files(model_dir, template_path)
        if not template.is_builtin:
            template.check_against_builtin()
        return template

    @classmethod
    def _from_files(cls, model_dir, template_path) -> "ChatTemplate":
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
        for index, (messages, tools, add_gen) in enumerate(SELF_CHECK_CONVERSATIONS):
            ours = render_builtin(messages, tools, add_gen)
            try:
                theirs = self.render(messages, tools, add_gen)
            except Exception as exc:  # a template that can't render our checks is worth one warning too
                message = f"chat template {self.origin} failed on self-check conversation {index}: {exc}"
                logger.warning(message)
                return message
            pos = first_difference(ours, theirs)
            if pos is not None:
                message = (
                    f"chat template {self.origin} differs from the built-in K2 format on self-check conversation "
                    f"{index} at character {pos}: template {theirs[pos:pos + 40]!r} vs built-in {ours[pos:pos + 40]!r}"
                )
                logger.warning(message)
                return message
        return None

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
        if self.is_builtin:
            return render_builtin(messages, tools, add_generation_prompt)
        return render_jinja(self._compiled, _alias_reasoning_fields(messages), tools or None, add_generation_prompt)

    def encode(self, tokenizer, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
               legacy: bool = False) -> list[int]:
        """Prompt ids: template control tokens become single ids; client text never does.

        Client strings are rendered a second time with the first character of every control token (``<``, ``[``)
        replaced by an unused private-use character, so every control-token string left in that render was written
        by the template. The real render is split at those positions; the text between is encoded with special
        tokens treated as text.
        """
        text = self.render(messages, tools, add_generation_prompt)
        if legacy:
            return tokenizer.encode(text, allow_special_tokens=True)
        starts = sorted({token[0] for token in tokenizer.special_ids})
        sentinels = _pick_sentinels(text, len(starts))
        hide = {ord(c): s for c, s in zip(starts, sentinels)}
        unhide = {ord(s): c for c, s in zip(starts, sentinels)}
        marked = self.render(_translate_strings(messages, hide), _translate_strings(tools, hide), add_generation_prompt)
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
                  template: str | ChatTemplate | None = None) -> str:
    """Render a chat prompt: built-in K2 format when ``template`` is None, else the given jinja template."""
    if template is None:
        return render_builtin(messages, tools, add_generation_prompt)
    if isinstance(template, str):
        template = ChatTemplate(source=template, origin="<string>")
    return template.render(messages, tools, add_generation_prompt)


