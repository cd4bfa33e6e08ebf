"""``kserve render [MODEL_DIR] [--ids] [--chat-template F] [--legacy-prompt-encoding] < request.json``."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from kserve.chat.template import ChatTemplate
from kserve.chat.tokenizer import load_tokenizer
from kserve.chat.tool_ids import normalize_tool_call_ids


def run_render(args, stdin: TextIO, stdout: TextIO) -> int:
    """Print the exact prompt (and with ``--ids`` its token ids) for an OpenAI chat request read from stdin."""
    try:
        request = json.loads(stdin.read())
    except json.JSONDecodeError as exc:
        print(f"error: request is not valid JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        print("error: request must be a JSON object with a 'messages' list", file=sys.stderr)
        return 2
    model_dir = args.model_dir  # the cli fills in the embedded model's directory
    template = ChatTemplate.load(model_dir, getattr(args, "chat_template", None))
    messages = normalize_tool_call_ids(request["messages"])
    tools = request.get("tools") or None
    add_generation_prompt = bool(request.get("add_generation_prompt", True))
    try:
        prompt = template.render(messages, tools, add_generation_prompt)
    except Exception as exc:
        print(f"error: cannot render the request: {exc}", file=sys.stderr)
        return 2
    stdout.write(prompt + "\n")
    if getattr(args, "ids", False):
        tokenizer = load_tokenizer(model_dir)
        ids = template.encode(tokenizer, messages, tools, add_generation_prompt,
                              legacy=bool(getattr(args, "legacy_prompt_encoding", False)))
        stdout.write(json.dumps(ids) + "\n")
    return 0
