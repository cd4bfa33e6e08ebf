"""Which tools a chat request may call, and what it may not emit without any.

`callable_tools`: the request's `tools` plus system (or developer) messages' dynamic tools, one set for all uses.
`tool_marker_ban`: without callable tools (or with `tool_choice: "none"`) and without a grammar, the tool-call
markers are masked. Details: docs/conformance.md, 'Dynamic tools' and 'No tools, no tool calls'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kserve.chat.dynamic_tools import DynamicToolError, check_dynamic_tools
from kserve.chat.markers import TOOL_MARKER_TOKENS
from kserve.server.errors import bad_request
from kserve.server.validation import schema_problem

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kserve.server.context import ServingContext

BITS_PER_WORD = 32


def callable_tools(messages: list[dict[str, Any]], request_tools: list[dict[str, Any]] | None
                   ) -> list[dict[str, Any]] | None:
    """Every tool the model may call: `request_tools` (already checked), then the messages' dynamic tools in order.

    A 400 naming the message for a dynamic declaration that breaks the contract (see `check_dynamic_tools`) or a
    `parameters` that is not a usable JSON schema (the request-level tools' rule). None when there are none.
    """
    request_names = [t["function"]["name"] for t in request_tools or []]
    try:
        declared = check_dynamic_tools(messages, request_names)
    except DynamicToolError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from None
    for tool in declared:
        params = tool.tool["function"].get("parameters")
        if params is not None:
            problem = schema_problem(params, f"{tool.where}.function.parameters of tool {tool.name!r}")
            if problem is not None:
                raise bad_request(problem, f"{tool.where}.function.parameters", "invalid_tool_schema")
    tools = [*(request_tools or []), *(t.tool for t in declared)]
    return tools or None


class _BannedTokenMatcher:
    """One sequence's constraint (the engine's TokenConstraint): every token allowed but the banned ones."""

    def __init__(self, banned: BannedTokens) -> None:
        self._banned = banned

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self._banned.allowed_row(bitmask.shape[1])

    def accept_token(self, token_id: int) -> bool:
        return token_id not in self._banned.token_ids

    def rollback(self, num_tokens: int) -> None:
        pass  # stateless

    def is_terminated(self) -> bool:
        return False  # never forces a stop: the request ends as it would unconstrained


class BannedTokens:
    """`SamplingParams.guided` for a request that may never emit `token_ids` (and is otherwise free)."""

    def __init__(self, token_ids: Iterable[int]) -> None:
        self.token_ids = frozenset(token_ids)
        self._rows: dict[int, torch.Tensor] = {}  # bitmask width -> the allowed row (built once per width)

    def allowed_row(self, width: int) -> torch.Tensor:
        row = self._rows.get(width)
        if row is None:
            import torch

            words: dict[int, int] = {}
            for token_id in self.token_ids:
                if token_id < BITS_PER_WORD * width:
                    word = token_id // BITS_PER_WORD
                    words[word] = words.get(word, 0xFFFFFFFF) & ~(1 << (token_id % BITS_PER_WORD))
            row = torch.full((width,), -1, dtype=torch.int32)
            for word, bits in words.items():
                row[word] = bits - (1 << 32) if bits >= 1 << 31 else bits  # int32 keeping the bit pattern
            self._rows[width] = row
        return row

    def make_constraint(self) -> _BannedTokenMatcher:
        return _BannedTokenMatcher(self)


def tool_marker_ban(ctx: ServingContext, parse_tools: bool, guided: Any) -> Any:
    """What `SamplingParams.guided` should be: `guided` when there is one (a grammar already places the markers,
    and masks them where it does not), else the marker ban for a request without callable tools."""
    settings = ctx.settings
    if guided is not None or parse_tools or not (settings.tool_grammar and settings.guided_decoding):
        return guided
    return BannedTokens(ctx.tokenizer.special_ids[m] for m in TOOL_MARKER_TOKENS if m in ctx.tokenizer.special_ids)
