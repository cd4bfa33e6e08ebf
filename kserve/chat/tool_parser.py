"""Kimi K2 tool-call parser: one incremental state machine used for both whole outputs and streams.

Calls sit in ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>`` sections of an assistant turn;
content is the text outside them, and arguments are passed through raw. The decisions on malformed output are
tested in tests/test_tool_parser*.py. Details: docs/chat.md, 'Tool-call parser'.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum

from kserve.chat.markers import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_BEGIN_ALIAS,
    SECTION_END,
    SECTION_END_ALIAS,
    TOOL_MARKERS,
    PartialMarkerMatcher,
)

_MARKER_RE = re.compile("|".join(re.escape(m) for m in sorted(TOOL_MARKERS, key=len, reverse=True)))
_HEADER_RE = re.compile(r"(?P<name>.+):(?P<idx>\d+)", re.DOTALL)
_FUNCTIONS_PREFIX = "functions."
_PARTIAL_MARKER = PartialMarkerMatcher(TOOL_MARKERS)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str
    index: int
    valid_json: bool
    known_tool: bool | None
    complete: bool = True


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    # Where the piece comes in the output: after this many characters of its StreamDelta's content (a delta of
    # several tokens can hold content, a call and more content; ``content`` alone does not say which came first).
    offset: int = 0


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ToolParseResult:
    content: str
    calls: list[ToolCall]
    section_opened: bool


def tool_names(tools) -> set[str] | None:
    """Function names declared in an OpenAI ``tools`` list (None when no list was given)."""
    if tools is None:
        return None
    names = set()
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def resolve_header(header: str, declared: set[str] | None) -> tuple[str, str] | None:
    """(id, name) for a call header, or None when no name can be recovered."""
    call_id = header.strip()
    if not call_id:
        return None
    rest = call_id[len(_FUNCTIONS_PREFIX):] if call_id.startswith(_FUNCTIONS_PREFIX) else call_id
    match = _HEADER_RE.fullmatch(rest)
    if match:
        return call_id, match["name"]
    if rest.isdigit() and declared is not None and len(declared) == 1:
        return call_id, next(iter(declared))  # K2.5-style bare counter with a single declared tool
    return None


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class _State(Enum):
    CONTENT = "content"
    SECTION = "section"  # inside a section, between calls
    HEADER = "header"  # after CALL_BEGIN, before ARGUMENT_BEGIN
    ARGS = "args"
    SKIP_ARGS = "skip_args"  # arguments of a call whose header didn't resolve


class StreamingToolParser:
    """Feed text deltas; get content deltas and tool-call deltas. Work is linear in the output length."""

    def __init__(self, tools=None):
        self._declared = tool_names(tools)
        self._state = _State.CONTENT
        self._pending = ""  # unprocessed tail that could start a marker
        self._header: list[str] = []
        self._ws_hold: list[str] = []  # trailing whitespace of the current arguments, emitted if more text follows
        self._args_started = False
        self._call: ToolCall | None = None
        self._args: list[str] = []
        self.calls: list[ToolCall] = []
        self.section_opened = False
        self._out: StreamDelta = StreamDelta()

    # -- public -----------------------------------------------------------------------------------------
    def feed(self, text_delta: str) -> StreamDelta:
        self._out = StreamDelta()
        text = self._pending + text_delta
        pos = 0
        while True:
            match = _MARKER_RE.search(text, pos)
            if match is None:
                break
            self._plain(text[pos : match.start()])
            self._marker(match.group())
            pos = match.end()
        hold = _PARTIAL_MARKER.suffix_len(text, pos)
        self._plain(text[pos : len(text) - hold])
        self._pending = text[len(text) - hold :]
        return self._take()

    def finish(self) -> StreamDelta:
        self._out = StreamDelta()
        text, self._pending = self._pending, ""
        self._plain(text)
        if self._state is _State.ARGS:
            self._close_call(complete=False)
        self._state = _State.CONTENT
        return self._take()

    # -- internals --------------------------------------------------------------------------------------
    def _take(self) -> StreamDelta:
        out = self._out
        merged: list[ToolCallDelta] = []
        for d in out.tool_calls:
            if merged and merged[-1].index == d.index and d.id is None:
                merged[-1].arguments += d.arguments
            else:
                merged.append(d)
        out.tool_calls = merged
        return out

    def _plain(self, text: str) -> None:
        if not text:
            return
        state = self._state
        if state is _State.CONTENT:
            self._out.content += text
        elif state is _State.HEADER:
            self._header.append(text)
        elif state is _State.ARGS:
            self._args_text(text)
        # SECTION / SKIP_ARGS: dropped

    def _args_text(self, text: str) -> None:
        if not self._args_started:
            text = text.lstrip()
            if not text:
                return
            self._args_started = True
        stripped = text.rstrip()
        if not stripped:
            self._ws_hold.append(text)
            return
        piece = "".join(self._ws_hold) + stripped
        self._ws_hold = [text[len(stripped):]] if len(stripped) < len(text) else []
        self._args.append(piece)
        self._out.tool_calls.append(ToolCallDelta(index=self._call.index, arguments=piece,
                                                  offset=len(self._out.content)))

    def _marker(self, marker: str) -> None:
        state = self._state
        if marker in (SECTION_BEGIN, SECTION_BEGIN_ALIAS):
            self._leave_call()
            self.section_opened = True
            self._state = _State.SECTION
        elif marker in (SECTION_END, SECTION_END_ALIAS):
            self._leave_call()
            self._state = _State.CONTENT
        elif marker == CALL_BEGIN:
            self._leave_call()
            self.section_opened = True
            self._header = []
            self._state = _State.HEADER
        elif marker == ARGUMENT_BEGIN:
            if state is _State.HEADER:
                self._open_call("".join(self._header))
        elif marker == CALL_END:
            if state in (_State.HEADER, _State.ARGS, _State.SKIP_ARGS):
                if state is _State.ARGS:
                    self._close_call(complete=True)
                self._state = _State.SECTION

    def _leave_call(self) -> None:
        if self._state is _State.ARGS:
            self._close_call(complete=False)

    def _open_call(self, header: str) -> None:
        resolved = resolve_header(header, self._declared)
        if resolved is None:
            self._state = _State.SKIP_ARGS
            return
        call_id, name = resolved
        known = None if self._declared is None else name in self._declared
        self._call = ToolCall(id=call_id, name=name, arguments="", index=len(self.calls),
                              valid_json=False, known_tool=known)
        self._args = []
        self._ws_hold = []
        self._args_started = False
        self._out.tool_calls.append(ToolCallDelta(index=self._call.index, id=call_id, name=name,
                                                  offset=len(self._out.content)))
        self._state = _State.ARGS

    def _close_call(self, complete: bool) -> None:
        call = self._call
        call.arguments = "".join(self._args)
        call.valid_json = _is_json_object(call.arguments)
        call.complete = complete
        self.calls.append(call)
        self._call = None
        self._args = []
        self._ws_hold = []
        self._state = _State.SECTION


def parse_tool_output(text: str, tools=None) -> ToolParseResult:
    """Parse a whole K2 output: content, tool calls, and whether a tool-call section was opened."""
    parser = StreamingToolParser(tools)
    content = parser.feed(text).content + parser.finish().content
    return ToolParseResult(content=content, calls=parser.calls, section_opened=parser.section_opened)


def parse_tool_calls(text: str, tools=None) -> tuple[str, list[ToolCall]]:
    """(content, calls) for a whole K2 output; see ``parse_tool_output`` for the section flag."""
    result = parse_tool_output(text, tools)
    return result.content, result.calls
