"""One assistant turn of a prepared chat request, whole or as a stream of deltas, in no wire format.

The Anthropic Messages and OpenAI Responses endpoints drive the engine through here: the same engine call,
reasoning split, tool parser (streaming and whole), call checks, finish reasons and metrics as chat
completions; each endpoint only writes the result in its own wire shape. Always one choice (n = 1).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kserve.chat import ToolCall as ParsedToolCall
from kserve.engine.outputs import TokenLogprob
from kserve.server.context import ServingContext
from kserve.server.logprobs import VisibleTokens
from kserve.server.outcome import unfinished
from kserve.server.protocol import ChatDelta, ToolCallDeltaOut
from kserve.server.serving_chat import (
    NO_ARGUMENTS,
    ChoiceStream,
    PreparedChat,
    engine_generate,
    generate_whole,
    parse_choice,
)


@dataclass
class TurnUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass
class FinishedTurn:
    """The whole turn: reasoning (None unless split out), visible text, parsed calls, and how it ended."""

    reasoning: str | None
    content: str
    calls: list[ParsedToolCall]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    stop_sequence: str | None  # the stop string that ended it, if one did
    usage: TurnUsage
    logprobs: list[TokenLogprob] | None = None  # the visible text's tokens, when the request asked for logprobs

    def arguments(self, call: ParsedToolCall) -> str:
        return call.arguments or NO_ARGUMENTS


@dataclass
class TurnDelta:
    """New reasoning text, visible text and tool-call pieces, in that order within the delta (and in the output)."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDeltaOut] = field(default_factory=list)  # header (id, name) once, then arguments
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the tokens of `content`, when asked for

    @classmethod
    def of(cls, delta: ChatDelta) -> TurnDelta:
        return cls(delta.reasoning_content or "", delta.content or "", list(delta.tool_calls or []))

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.calls)


TurnEvent = TurnDelta | FinishedTurn


def _stop_sequence(output: Any) -> str | None:
    return output.stop_reason if output.finish_reason == "stop" and isinstance(output.stop_reason, str) else None


def _usage(prep: PreparedChat, final: Any) -> TurnUsage:
    return TurnUsage(len(prep.prompt_ids), len(final.outputs[0].token_ids), final.num_cached_tokens or 0)


def _record(ctx: ServingContext, usage: TurnUsage, first_token: float | None, start: float) -> None:
    ctx.metrics.count_tokens(usage.prompt_tokens, usage.completion_tokens)
    ctx.metrics.observe_latency(first_token, time.monotonic() - start)


async def run_turn(ctx: ServingContext, prep: PreparedChat, request: Any) -> FinishedTurn:
    """Generate to the end (aborting if the client goes away) and parse the output as chat completions does."""
    start = time.monotonic()
    final, first_token = await generate_whole(ctx, prep, request)
    output = final.outputs[0]
    reasoning, text, calls, finish = parse_choice(ctx, prep, output)
    usage = _usage(prep, final)
    _record(ctx, usage, first_token, start)
    logprobs = None
    if prep.req.logprobs:
        visible = VisibleTokens(ctx.tokenizer)
        visible.extend(output.logprobs or [])
        logprobs = visible.take(text)
    return FinishedTurn(reasoning, text, calls, finish, _stop_sequence(output), usage, logprobs)


async def stream_turn(ctx: ServingContext, prep: PreparedChat) -> AsyncIterator[TurnEvent]:
    """TurnDeltas, then the FinishedTurn (whose text is the deltas joined).

    Errors are raised (APIError for aborted generations); closing the iterator early aborts the engine request.
    """
    state = ChoiceStream.start(ctx, prep, 0)
    start = time.monotonic()
    first_token: float | None = None
    final = None
    reasoning: list[str] = []
    content: list[str] = []
    visible = VisibleTokens(ctx.tokenizer) if prep.req.logprobs else None
    logprobs: list[TokenLogprob] = []
    try:
        async for out in engine_generate(ctx, prep):
            final = out
            output = out.outputs[0]
            if first_token is None and output.token_ids:
                first_token = time.monotonic() - start
            finished = output.finish_reason is not None
            new_text, state.text_sent = output.text[state.text_sent:], len(output.text)
            # In output order: one engine step may add text after a call, which must not jump ahead of it.
            if visible is not None:
                visible.extend(output.logprobs or [])
            for piece in state.advance_in_order(new_text, final=finished):
                delta = TurnDelta.of(piece)
                reasoning.append(delta.reasoning)
                content.append(delta.content)
                if visible is not None and delta.content:
                    delta.logprobs = visible.take(delta.content)
                    logprobs += delta.logprobs
                yield delta
            if finished:
                calls, finish = state.finish(ctx, prep, output.finish_reason)
                usage = _usage(prep, out)
                _record(ctx, usage, first_token, start)
                saw_reasoning = state.reasoning_parser is not None and state.reasoning_parser.saw_reasoning
                yield FinishedTurn("".join(reasoning) if saw_reasoning else None, "".join(content), calls, finish,
                                   _stop_sequence(output), usage, logprobs if visible is not None else None)
                return
        raise unfinished()
    finally:
        if final is None or not final.finished:
            await ctx.abort(prep.request_id)
