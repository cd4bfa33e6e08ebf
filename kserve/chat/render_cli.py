"""``kserve render [MODEL_DIR] [--ids] [--jsonl] [--chat-template F] [--legacy-prompt-encoding] < request(s)``.

Without ``--jsonl``: one OpenAI chat request on stdin; prints the prompt, then (``--ids``) its token ids. With
``--jsonl``: one request per line; one JSON object per line, ``{"prompt"}`` (+ ``"ids"``) or ``{"error"}``.
Each request's ``add_generation_prompt`` and ``chat_template_kwargs`` (``thinking``, ``preserve_thinking``) apply.
A system message may declare ``tools`` of its own (dynamic tools): it renders as a ``tool_declare`` turn in place.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kserve.chat.dynamic_tools import DynamicToolError, check_dynamic_tools
from kserve.chat.template import ChatTemplate
from kserve.chat.tokenizer import load_tokenizer
from kserve.chat.tool_ids import normalize_tool_call_ids
from kserve.chat.tool_parser import tool_names
from kserve.config import ModelConfig

# The chat_template_kwargs Kimi templates read; both are booleans.
TEMPLATE_KWARGS = ("thinking", "preserve_thinking")


class RequestError(ValueError):
    """A request that cannot be rendered; the message says why."""


@dataclass(frozen=True)
class RenderRequest:
    messages: list[dict]
    tools: list | None
    add_generation_prompt: bool
    template_kwargs: dict[str, bool]


def parse_request(text: str) -> RenderRequest:
    try:
        request = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"request is not valid JSON: {exc}") from None
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        raise RequestError("request must be a JSON object with a 'messages' list")
    kwargs = request.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object")
    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise RequestError(f"unsupported chat_template_kwargs {unknown}; supported: {list(TEMPLATE_KWARGS)}")
    for key, value in kwargs.items():
        if not isinstance(value, bool):
            raise RequestError(f"chat_template_kwargs.{key} must be true or false")
    tools = request.get("tools") or None
    try:  # system messages may declare tools of their own (kserve.chat.dynamic_tools): the server's checks
        check_dynamic_tools(request["messages"], (tool_names(tools) or ()) if isinstance(tools, list) else ())
    except DynamicToolError as exc:
        raise RequestError(str(exc)) from None
    return RenderRequest(
        messages=normalize_tool_call_ids(request["messages"]),
        tools=tools,
        add_generation_prompt=bool(request.get("add_generation_prompt", True)),
        template_kwargs=dict(kwargs),
    )


def _render(template: ChatTemplate, request: RenderRequest) -> str:
    try:
        return template.render(request.messages, request.tools, request.add_generation_prompt,
                               **request.template_kwargs)
    except Exception as exc:  # a template can fail in many ways (jinja errors, raise_exception); report, don't crash
        raise RequestError(f"cannot render the request: {exc}") from None


def _encode(template: ChatTemplate, tokenizer: Any, request: RenderRequest, legacy: bool) -> list[int]:
    return template.encode(tokenizer, request.messages, request.tools, request.add_generation_prompt,
                           legacy=legacy, **request.template_kwargs)


def _family_dialect(model_dir) -> str | None:
    """The checkpoint family's chat dialect (used when it ships no template), from its config.json."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    return ModelConfig.from_model_dir(model_dir).chat_dialect


def run_render(args, stdin: TextIO, stdout: TextIO) -> int:
    """Print the exact prompt (and with ``--ids`` its token ids) for the chat request(s) read from stdin."""
    model_dir = args.model_dir  # the cli fills in the embedded model's directory
    if getattr(args, "jsonl", False):
        return _run_jsonl(args, model_dir, stdin, stdout)
    try:
        request = parse_request(stdin.read())
        template = ChatTemplate.load(model_dir, getattr(args, "chat_template", None),
                                     dialect=_family_dialect(model_dir))
        prompt = _render(template, request)
        ids = None
        if getattr(args, "ids", False):
            ids = _encode(template, load_tokenizer(model_dir), request,
                          bool(getattr(args, "legacy_prompt_encoding", False)))
    except (RequestError, ValueError, TypeError, KeyError, RecursionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stdout.write(prompt + "\n")
    if ids is not None:
        stdout.write(json.dumps(ids) + "\n")
    return 0


def _run_jsonl(args, model_dir, stdin: TextIO, stdout: TextIO) -> int:
    """One output line per non-blank input line; a failed line gives ``{"error"}`` and the exit status 2."""
    template = ChatTemplate.load(model_dir, getattr(args, "chat_template", None), dialect=_family_dialect(model_dir))
    want_ids = bool(getattr(args, "ids", False))
    tokenizer = load_tokenizer(model_dir) if want_ids else None
    legacy = bool(getattr(args, "legacy_prompt_encoding", False))
    status = 0
    for line in stdin:
        if not line.strip():
            continue
        try:
            request = parse_request(line)
            result: dict[str, Any] = {"prompt": _render(template, request)}
            if want_ids:
                result["ids"] = _encode(template, tokenizer, request, legacy)
        except (RequestError, ValueError, TypeError, KeyError, RecursionError) as exc:
            result, status = {"error": str(exc)}, 2
        stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
    return status
