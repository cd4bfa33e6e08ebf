"""Rewrite historical tool-call ids to K2's native ``functions.{name}:{idx}`` shape (as Moonshot's API does)."""

from __future__ import annotations

import copy


def normalize_tool_call_ids(messages: list[dict]) -> list[dict]:
    """New message list whose assistant tool-call ids (and matching ``tool_call_id``s) are ``functions.{name}:{idx}``.

    ``idx`` counts every tool call in the conversation, so the ids are unique even when the client reused ids across
    turns; a tool message refers to the latest assistant call that had its id. The input is left untouched.
    """
    out = copy.deepcopy(messages)
    counter = 0
    renamed: dict[str, str] = {}
    for message in out:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            for call in message["tool_calls"]:
                if not isinstance(call, dict):
                    continue
                function = call.get("function") if isinstance(call.get("function"), dict) else {}
                name = function.get("name") or "tool"
                new_id = f"functions.{name}:{counter}"
                counter += 1
                old_id = call.get("id")
                if isinstance(old_id, str):
                    renamed[old_id] = new_id
                call["id"] = new_id
        elif message.get("role") == "tool":
            old_id = message.get("tool_call_id")
            if isinstance(old_id, str) and old_id in renamed:
                message["tool_call_id"] = renamed[old_id]
    return out
