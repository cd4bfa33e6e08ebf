"""Dynamic tools: function tools declared inside a system message (``{"role": "system", "tools": [...]}``).

Moonshot's extension (the Kimi Vendor Verifier's ``test_dynamic_tools.py``): ``expand_dynamic_tools`` rewrites each
such message, before any renderer sees it, into a system message named ``tool_declare`` whose content is the
dialect's declaration body; ``check_dynamic_tools`` checks them. Details: docs/conformance.md, 'Dynamic tools'.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kserve.chat.builtin_renderer import tool_declaration_text
from kserve.chat.dialect import ChatDialect, prepare_tools

TOOLS_KEY = "tools"
DECLARATION_TURN_NAME = "tool_declare"
MAX_DYNAMIC_TOOL_NAME_LENGTH = 256
# Moonshot's rule for dynamic tool names: a letter or '_' first, then letters, digits, '_', '-' or '.', at most 256
# characters. Letters of any script, as the request-level rule allows (Kimi's own tool names may be Chinese).
DYNAMIC_TOOL_NAME_RE = re.compile(r"[^\W\d][\w.\-]*")
# The roles that may declare tools: system, and `developer` (OpenAI's newer name for it, which some dialects render
# under its own name) so that the rule does not depend on the dialect.
DYNAMIC_TOOL_ROLES = frozenset({"system", "developer"})
DECLARATION_TURN_ROLE = "system"


class DynamicToolError(ValueError):
    """A dynamic-tools declaration that breaks the contract; ``param`` names the field, ``code`` the kind."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class DeclaredTool:
    """One dynamic tool as the client sent it, and where (``messages[i].tools[j]``)."""

    where: str
    name: str
    tool: dict[str, Any]


def declares_tools(message: Any) -> bool:
    """Whether ``message`` declares at least one dynamic tool (a non-empty ``tools`` list)."""
    return isinstance(message, dict) and isinstance(message.get(TOOLS_KEY), list) and bool(message[TOOLS_KEY])


def dynamic_tool_name_problem(name: str) -> str | None:
    """Why ``name`` breaks Moonshot's dynamic tool-name rule, or None."""
    if not name:
        return "is empty"
    if len(name) > MAX_DYNAMIC_TOOL_NAME_LENGTH:
        return f"is {len(name)} characters long (at most {MAX_DYNAMIC_TOOL_NAME_LENGTH})"
    if not DYNAMIC_TOOL_NAME_RE.fullmatch(name):
        return "must start with a letter or '_' and hold only letters, digits, '_', '-' and '.'"
    return None


def _content_is_empty(content: Any) -> bool:
    if content is None or content == "":
        return True
    if isinstance(content, list):  # a list of text parts that says nothing
        return all(isinstance(p, dict) and p.get("type") == "text" and not p.get("text") for p in content)
    return False


def _check_tool(tool: Any, where: str) -> str:
    """The tool's name, once its shape is checked."""
    if not isinstance(tool, dict):
        raise DynamicToolError(f"{where} must be an object, got {_json_type(tool)}", where, "invalid_type")
    if "type" not in tool:
        raise DynamicToolError(f"{where} is missing 'type' (must be 'function')", f"{where}.type",
                               "missing_required_parameter")
    if tool["type"] != "function":
        raise DynamicToolError(f"{where}.type must be 'function', got {tool['type']!r}", f"{where}.type")
    if "function" not in tool:
        raise DynamicToolError(f"{where} is missing 'function'", f"{where}.function", "missing_required_parameter")
    function = tool["function"]
    if not isinstance(function, dict):
        raise DynamicToolError(f"{where}.function must be an object, got {_json_type(function)}",
                               f"{where}.function", "invalid_type")
    if "name" not in function:
        raise DynamicToolError(f"{where}.function is missing 'name'", f"{where}.function.name",
                               "missing_required_parameter")
    name = function["name"]
    if not isinstance(name, str):
        raise DynamicToolError(f"{where}.function.name must be a string, got {_json_type(name)}",
                               f"{where}.function.name", "invalid_type")
    problem = dynamic_tool_name_problem(name)
    if problem is not None:
        raise DynamicToolError(f"{where}.function.name {_clipped(name)!r} {problem}", f"{where}.function.name",
                               "invalid_tool_name")
    for key, kinds, label in (("description", (str,), "a string"), ("parameters", (dict,), "an object"),
                              ("strict", (bool,), "a boolean")):
        value = function.get(key)
        if value is not None and not isinstance(value, kinds):
            raise DynamicToolError(f"{where}.function.{key} must be {label}, got {_json_type(value)}",
                                   f"{where}.function.{key}", "invalid_type")
    return name


def check_dynamic_tools(messages: list[dict], request_tool_names: Iterable[str] = ()) -> list[DeclaredTool]:
    """The dynamic tools of ``messages`` (roles already resolved), in order; DynamicToolError for the first problem.

    Only system (or developer) messages may declare tools, with empty or absent content; every tool is an object of
    ``type`` ``function`` whose ``function`` has a valid ``name``; no name is declared twice in a message, across
    messages, or in a message and the request's ``tools`` (``request_tool_names``). An empty ``tools`` array declares
    nothing.
    """
    first_seen: dict[str, str] = {name: "the request's 'tools'" for name in request_tool_names}
    declared: list[DeclaredTool] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get(TOOLS_KEY) is None:
            continue
        where = f"messages[{i}].tools"
        role = message.get("role")
        if role not in DYNAMIC_TOOL_ROLES:
            raise DynamicToolError(f"messages[{i}]: only system messages may declare 'tools' (this is a {role!r} "
                                   "message)", where)
        tools = message[TOOLS_KEY]
        if not isinstance(tools, list):
            raise DynamicToolError(f"{where} must be an array of tools, got {_json_type(tools)}", where,
                                   "invalid_type")
        if tools and not _content_is_empty(message.get("content")):
            raise DynamicToolError(f"messages[{i}]: a system message that declares 'tools' must have empty or "
                                   "absent 'content'", f"messages[{i}].content")
        for j, tool in enumerate(tools):
            tool_where = f"{where}[{j}]"
            name = _check_tool(tool, tool_where)
            if name in first_seen:
                raise DynamicToolError(f"{tool_where}: tool name {name!r} is already declared in "
                                       f"{first_seen[name]}", f"{tool_where}.function.name", "duplicate_tool")
            first_seen[name] = where
            declared.append(DeclaredTool(tool_where, name, tool))
    return declared


def declaration_turn(dialect: ChatDialect, tools: list[dict]) -> dict[str, Any]:
    """The system message that renders as ``tools``' ``tool_declare`` turn in ``dialect``'s declaration format."""
    body = tool_declaration_text(dialect, prepare_tools(dialect, tools))
    return {"role": DECLARATION_TURN_ROLE, "name": DECLARATION_TURN_NAME, "content": body or ""}


def expand_dynamic_tools(dialect: ChatDialect, messages: list[dict]) -> list[dict]:
    """``messages`` with each tool-declaring system message replaced by its ``tool_declare`` turn (see module doc);
    the list itself when none declares tools. A ``tools`` key holding null or ``[]`` is dropped."""
    if not any(isinstance(m, dict) and TOOLS_KEY in m for m in messages):
        return messages
    out: list[dict] = []
    for message in messages:
        if not isinstance(message, dict) or TOOLS_KEY not in message:
            out.append(message)
        elif declares_tools(message):
            if message.get("role") not in DYNAMIC_TOOL_ROLES:
                raise ValueError(f"only system messages may declare 'tools', not a {message.get('role')!r} message")
            out.append(declaration_turn(dialect, message[TOOLS_KEY]))
        elif message[TOOLS_KEY] in (None, []):
            out.append({key: value for key, value in message.items() if key != TOOLS_KEY})
        else:
            raise ValueError(f"a message's 'tools' must be an array, got {_json_type(message[TOOLS_KEY])}")
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _clipped(name: str, limit: int = 40) -> str:
    return name if len(name) <= limit else name[:limit] + "..."
