"""From request fields to grammar-masked decoding: which requests are constrained, compiled off the loop.

`response_format` and `tool_choice` (`required`, a named function, `auto`) become a grammar. Under thinking it
applies only after the model's `</think>` (`AfterReasoning`). Details: docs/server.md, 'Guided decoding'.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kserve.chat.grammar import CompiledGrammar, GrammarError, GrammarSpec
from kserve.chat.markers import THINK_BEGIN, THINK_END, TOOL_MARKER_TOKENS
from kserve.server.errors import bad_request
from kserve.server.protocol import ResponseFormat

if TYPE_CHECKING:  # pragma: no cover
    import torch


def grammar_spec(
    response_format: ResponseFormat | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict,
    parallel_tool_calls: bool | None,
    *,
    guided_decoding: bool,
    tool_grammar: bool,
) -> GrammarSpec | None:
    """The constraint for this request, or None. Inputs are already validated."""
    if not guided_decoding:
        return None
    parallel = parallel_tool_calls is not False
    answer = _answer_schema(response_format)
    if tools and tool_choice != "none":
        if tool_choice == "required":
            return GrammarSpec.tools(tools, "required", parallel)
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            return GrammarSpec.tools([t for t in tools if t["function"]["name"] == name], "forced")
        # The model may call or answer: an answer follows the response format, a call its tool's schema.
        if answer is not None or tool_grammar or any(t["function"].get("strict") for t in tools):
            return GrammarSpec.tools(tools, "auto", parallel, answer=answer)
    if answer is None:
        return None
    return GrammarSpec.json_object() if response_format.type == "json_object" else GrammarSpec.json_schema(answer)


def with_default_strict(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """`tools` with `strict: true` where a function leaves it unset."""
    if not tools:
        return tools
    return [{**tool, "function": {"strict": True, **tool["function"]}} for tool in tools]


def _answer_schema(response_format: ResponseFormat | None) -> dict[str, Any] | bool | None:
    if response_format is None:
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.type == "json_schema" and response_format.json_schema is not None:
        return response_format.json_schema.schema_
    return None


async def compile_grammar(compiler: Any, spec: GrammarSpec | None) -> CompiledGrammar | None:
    """Compile in a worker thread (xgrammar releases the GIL); a schema it cannot handle is a 400."""
    if spec is None or compiler is None:
        return None
    parts = [(spec, "response_format" if spec.kind != "tools" else "tools")]
    if spec.kind == "tools" and spec.answer is not None:  # name the field whose schema fails
        parts.insert(0, (GrammarSpec.json_schema(json.loads(spec.answer)), "response_format"))
    for part, param in parts:
        try:
            compiled = await asyncio.to_thread(compiler.compile, part)
        except GrammarError as exc:
            raise bad_request(str(exc), param, "invalid_schema") from None
    return compiled


class _AfterReasoningMatcher:
    """One sequence's constraint (the engine's TokenConstraint): free reasoning, `</think>`, then the grammar.

    When the model opens `<think>` itself (K2-Thinking), the first token may be `<think>` or the grammar's own."""

    def __init__(self, guided: AfterReasoning) -> None:
        self._guided = guided
        self._grammar = guided.grammar.make_constraint()
        self._reasoning_tokens = 0  # accepted while reasoning, `<think>` / `</think>` included
        self._grammar_tokens = 0  # accepted by the grammar since
        self._opening = guided.think_begin_id is not None  # nothing generated yet; `<think>` may come first
        self._reasoning = not self._opening

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._reasoning:
            bitmask[row] = self._guided.reasoning_row(bitmask.shape[1])
            return
        self._grammar.fill_bitmask(bitmask, row)
        if self._opening:
            word, bit = divmod(self._guided.think_begin_id, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32 keeping the bit pattern

    def accept_token(self, token_id: int) -> bool:
        if self._opening:
            self._opening = False
            if token_id == self._guided.think_begin_id:
                self._reasoning, self._reasoning_tokens = True, 1
                return True
            accepted = self._grammar.accept_token(token_id)
            self._grammar_tokens += int(accepted)
            self._opening = not accepted
            return accepted
        if not self._reasoning:
            accepted = self._grammar.accept_token(token_id)
            self._grammar_tokens += int(accepted)
            return accepted
        if token_id in self._guided.masked_while_reasoning:
            return False
        self._reasoning_tokens += 1
        self._reasoning = token_id != self._guided.think_end_id
        return True

    def rollback(self, num_tokens: int) -> None:
        undo_grammar = min(num_tokens, self._grammar_tokens)
        self._grammar.rollback(undo_grammar)
        self._grammar_tokens -= undo_grammar
        undo_reasoning = min(num_tokens - undo_grammar, self._reasoning_tokens)
        if undo_reasoning:  # back before `</think>`: reasoning again
            self._reasoning_tokens -= undo_reasoning
            self._reasoning = True
        if self._guided.think_begin_id is not None and self._reasoning_tokens == self._grammar_tokens == 0:
            self._opening, self._reasoning = True, False  # back before the first token

    def is_terminated(self) -> bool:
        return not self._reasoning and not self._opening and self._grammar.is_terminated()


class AfterReasoning:
    """A compiled grammar that starts after the reasoning: what `SamplingParams.guided` holds under thinking."""

    def __init__(self, grammar: CompiledGrammar, think_end_id: int, masked_while_reasoning: Iterable[int],
                 think_begin_id: int | None = None) -> None:
        self.grammar = grammar
        self.think_end_id = think_end_id
        self.think_begin_id = think_begin_id  # set when the model, not the prompt, opens the reasoning
        self.masked_while_reasoning = frozenset(masked_while_reasoning) - {think_end_id}
        self._rows: dict[int, torch.Tensor] = {}  # bitmask width -> the reasoning row

    @property
    def spec(self) -> GrammarSpec:
        return self.grammar.spec

    def reasoning_row(self, width: int) -> torch.Tensor:
        """A bitmask row allowing every token but the masked ones (computed once per width)."""
        row = self._rows.get(width)
        if row is None:
            import torch

            words = [0xFFFFFFFF] * width
            for token_id in self.masked_while_reasoning:
                if token_id < 32 * width:
                    words[token_id // 32] &= ~(1 << (token_id % 32)) & 0xFFFFFFFF
            # int32 keeping the bit pattern (bit 31 is the sign bit)
            row = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
            self._rows[width] = row
        return row

    def make_constraint(self) -> _AfterReasoningMatcher:
        return _AfterReasoningMatcher(self)


def after_reasoning(grammar: CompiledGrammar | None, tokenizer: Any, starts_in_reasoning: bool,
                    model_opens_reasoning: bool = False) -> CompiledGrammar | AfterReasoning | None:
    """`grammar` as the request needs it: after the reasoning when its output starts inside `<think>`, or may
    start by opening it (`model_opens_reasoning`, K2-Thinking).

    A tokenizer without a single `</think>` token cannot say where reasoning ends: the grammar then applies from
    the first token (the reasoning parser ends reasoning at the tool-call section it opens).
    """
    think_end_id = tokenizer.special_ids.get(THINK_END)
    think_begin_id = tokenizer.special_ids.get(THINK_BEGIN)
    opens = model_opens_reasoning and not starts_in_reasoning and think_begin_id is not None
    if grammar is None or not (starts_in_reasoning or opens) or think_end_id is None:
        return grammar
    masked = [*tokenizer.stop_token_ids,
              *(tokenizer.special_ids[m] for m in TOOL_MARKER_TOKENS if m in tokenizer.special_ids)]
    if THINK_BEGIN in tokenizer.special_ids:  # reasoning is already open
        masked.append(tokenizer.special_ids[THINK_BEGIN])
    return AfterReasoning(grammar, think_end_id, masked, think_begin_id if opens else None)
