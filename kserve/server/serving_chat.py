"""`POST /v1/chat/completions`: prompt rendering, generation, tool-call parsing and validation, SSE."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import referencing.exceptions

from kserve.chat import (
    StreamingReasoningParser,
    StreamingToolParser,
    ToolCallDelta,
    parse_tool_output,
)
from kserve.chat import ToolCall as ParsedToolCall
from kserve.engine.errors import PromptRejected
from kserve.server.chat_request import render_chat
from kserve.server.context import (
    DisconnectWatch,
    ServingContext,
    engine_refused,
    new_request_id,
)
from kserve.server.errors import APIError, logged_stream_failure
from kserve.server.guided import after_reasoning, compile_grammar, grammar_spec, with_default_strict
from kserve.server.logprobs import chat_logprobs
from kserve.server.media import check_context, image_inputs, prompt_with_images
from kserve.server.outcome import client_gone, finish_reason, unfinished, usage_info
from kserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChoiceLogprobs,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDeltaOut,
)
from kserve.server.sampling import build_sampling_params, fit_max_tokens
from kserve.server.sse import sse_done, sse_error, sse_event
from kserve.server.thinking import ReasoningMode, think_end_is_skipped
from kserve.server.tool_contract import tool_marker_ban
from kserve.server.validation import normalize_stop, schema_dialect, tool_schema

logger = logging.getLogger("kserve.server")

NO_ARGUMENTS = "{}"


@dataclass
class PreparedChat:
    request_id: str
    req: ChatCompletionRequest
    prompt_ids: list[int]
    params: Any  # SamplingParams
    tools: list[dict[str, Any]] | None
    parse_tools: bool  # tools were given and tool_choice != "none"
    top_logprobs: int
    max_calls: int | None = None  # 1 under parallel_tool_calls=false: later calls are dropped
    reasoning: ReasoningMode = field(default_factory=ReasoningMode)  # how the output splits into reasoning
    # kserve.engine.multimodal.ImageInput per image, in order; prompt_ids hold each one's run of placeholders
    images: list[Any] | None = None

    def kept(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        return calls if self.max_calls is None else calls[: self.max_calls]


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest, raw: dict[str, Any], *,
                       strict_by_default: bool = False) -> PreparedChat:
    """Everything checked and encoded before generation; `raw` is the body as sent (for fields the model drops).
    `strict_by_default` (Responses) makes a tool without `strict` strict for the grammar; the prompt shows it as
    sent."""
    rendered = render_chat(ctx, req, raw)
    tools, tool_choice = rendered.tools, rendered.tool_choice
    prompt_ids, loaded = await prompt_with_images(ctx, rendered.prompt_ids, rendered.images)
    check_context(ctx, prompt_ids, loaded)  # names the images' share of a prompt they make too long
    images = image_inputs(loaded) or None
    parse_tools = bool(tools) and tool_choice != "none"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = fit_max_tokens(len(prompt_ids), requested, ctx.max_model_len)
    spec = grammar_spec(
        req.response_format, with_default_strict(tools) if strict_by_default else tools, tool_choice,
        req.parallel_tool_calls,
        guided_decoding=ctx.settings.guided_decoding, tool_grammar=ctx.settings.tool_grammar,
    )
    # Under thinking the grammar constrains what follows the reasoning, never the reasoning itself.
    guided = after_reasoning(await compile_grammar(ctx.grammar, spec), ctx.tokenizer,
                             rendered.reasoning.starts_in_reasoning,
                             ctx.template.dialect.model_opens_reasoning(rendered.thinking.thinking))
    guided = tool_marker_ban(ctx, parse_tools, guided)  # no callable tools: the tool-call markers are masked
    top_logprobs = req.top_logprobs or 0
    params = build_sampling_params(
        req, max_tokens=max_tokens, stop=normalize_stop(req.stop),
        logprobs=top_logprobs if req.logprobs else None,
        # K2's tool markers are special tokens; the parser needs them in the text (and `</think>`, where the
        # tokenizer marks it special: K2.5 / K2.6 do not).
        skip_special_tokens=not (parse_tools or (rendered.reasoning.parse and think_end_is_skipped(ctx.tokenizer))),
        vocab_size=ctx.vocab_size, guided=guided,
    )
    ctx.validate_prompt(prompt_ids, params, "messages", images)
    return PreparedChat(new_request_id("chatcmpl"), req, prompt_ids, params, tools, parse_tools, top_logprobs,
                        max_calls=1 if req.parallel_tool_calls is False else None, reasoning=rendered.reasoning,
                        images=images)


def engine_generate(ctx: ServingContext, prep: PreparedChat) -> AsyncIterator[Any]:
    """The engine's output stream for a prepared request (its images passed only when it has some)."""
    if prep.images:
        return ctx.engine.generate(prep.request_id, prep.prompt_ids, prep.params, images=prep.images)
    return ctx.engine.generate(prep.request_id, prep.prompt_ids, prep.params)


# ----------------------------------------------------------------------------- tool-call checks


def check_tool_calls(ctx: ServingContext, request_id: str, calls: list[ParsedToolCall], section_opened: bool,
                     tools: list[dict[str, Any]] | None) -> None:
    """Validate parsed calls on receipt; count and log every problem (the response is returned as parsed)."""
    metrics = ctx.metrics
    if section_opened and not calls:
        metrics.count_tool_problem("empty_tool_calls")
        logger.warning("request %s: tool-call section opened but no call parsed", request_id)
    metrics.count_tool_calls(len(calls))
    schemas = {t["function"]["name"]: tool_schema(t) for t in tools or []}
    for call in calls:
        if call.name not in schemas:
            metrics.count_tool_problem("undeclared_tool")
            logger.warning("request %s: call %s names undeclared tool %r", request_id, call.id, call.name)
            continue
        arguments = call.arguments or NO_ARGUMENTS
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            metrics.count_tool_problem("invalid_json")
            logger.warning("request %s: call %s arguments are not JSON: %s", request_id, call.id, exc)
            continue
        try:
            schema = schemas[call.name]
            schema_dialect(schema)(schema).validate(value)
        except jsonschema.ValidationError as exc:
            metrics.count_tool_problem("schema_invalid")
            logger.warning("request %s: call %s arguments fail %r's schema: %s", request_id, call.id, call.name,
                           exc.message)
        except referencing.exceptions.Unresolvable as exc:  # request checks resolve refs; this is a backstop
            metrics.count_tool_problem("schema_unresolvable")
            logger.warning("request %s: call %s: %r's schema has an unresolvable $ref: %s", request_id, call.id,
                           call.name, exc)


def _tool_call_out(call: ParsedToolCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments or NO_ARGUMENTS))


# ----------------------------------------------------------------------------- non-streaming


async def generate_whole(ctx: ServingContext, prep: PreparedChat, request: Any) -> tuple[Any, float | None]:
    """The finished RequestOutput and seconds to the first token; aborts the engine request if the client goes."""
    start = time.monotonic()
    first_token: float | None = None
    final = None
    gone = False
    watch = DisconnectWatch(request)
    try:
        async for out in engine_generate(ctx, prep):
            if first_token is None and any(o.token_ids for o in out.outputs):
                first_token = time.monotonic() - start
            final = out
            if final.finished:
                break
            if await watch.gone():
                logger.info("request %s: client disconnected; aborting", prep.request_id)
                gone = True
                break
    except PromptRejected as exc:  # prepare_chat validated it; a backstop
        raise engine_refused(exc, "messages") from None
    finally:
        if final is None or not final.finished:
            await ctx.abort(prep.request_id)
    if final is None or not final.finished:
        raise client_gone() if gone else unfinished()
    return final, first_token


async def run_chat(ctx: ServingContext, prep: PreparedChat, request: Any) -> ChatCompletionResponse:
    start = time.monotonic()
    final, first_token = await generate_whole(ctx, prep, request)
    choices = [_chat_choice(ctx, prep, o) for o in sorted(final.outputs, key=lambda o: o.index)]
    usage = usage_info(len(prep.prompt_ids), final.outputs, final.num_cached_tokens)
    ctx.metrics.count_tokens(usage.prompt_tokens, usage.completion_tokens)
    ctx.metrics.observe_latency(first_token, time.monotonic() - start)
    return ChatCompletionResponse(id=prep.request_id, model=ctx.model_name, choices=choices, usage=usage)


def parse_choice(ctx: ServingContext, prep: PreparedChat, output: Any
                 ) -> tuple[str | None, str, list[ParsedToolCall], str]:
    """(reasoning or None, visible text, checked calls, finish reason) of a finished choice; counts the finish."""
    reasoning, text = prep.reasoning.split(output.text)
    calls: list[ParsedToolCall] = []
    if prep.parse_tools:
        parsed = parse_tool_output(text, prep.tools)
        text, calls = parsed.content, prep.kept(parsed.calls)
        check_tool_calls(ctx, prep.request_id, calls, parsed.section_opened, prep.tools)
    finish = finish_reason(output.finish_reason, bool(calls))
    ctx.metrics.count_finish(finish)
    return reasoning, text, calls, finish


def _chat_choice(ctx: ServingContext, prep: PreparedChat, output: Any) -> ChatChoice:
    reasoning, text, calls, finish = parse_choice(ctx, prep, output)
    message = AssistantMessage(
        content=text if (text or not calls) else None,
        reasoning_content=reasoning,
        reasoning=reasoning,
        tool_calls=[_tool_call_out(c) for c in calls] or None,
    )
    logprobs = None
    if prep.req.logprobs:
        logprobs = ChoiceLogprobs(content=chat_logprobs(ctx.tokenizer, output.logprobs or [], prep.top_logprobs))
    return ChatChoice(index=output.index, message=message, logprobs=logprobs, finish_reason=finish)


# ----------------------------------------------------------------------------- streaming


@dataclass
class ChoiceStream:
    """Per-choice streaming state: how much of the cumulative output was already sent, and the parsers."""

    index: int
    tool_parser: StreamingToolParser | None
    reasoning_parser: StreamingReasoningParser | None
    max_calls: int | None = None
    text_sent: int = 0
    tokens_sent: int = 0
    args_sent: dict[int, str] = field(default_factory=dict)  # call index -> arguments streamed so far
    open_call: int | None = None  # the call whose header was streamed last, until something follows it
    done: bool = False

    @classmethod
    def start(cls, ctx: ServingContext, prep: PreparedChat, index: int) -> ChoiceStream:
        return cls(
            index=index,
            tool_parser=StreamingToolParser(prep.tools) if prep.parse_tools else None,
            reasoning_parser=prep.reasoning.parser(),
            max_calls=prep.max_calls,
        )

    def advance(self, new_text: str, final: bool) -> ChatDelta:
        """Content / reasoning / tool-call deltas for `new_text` (plus the parsers' held-back tail if final)."""
        return _chat_deltas(self._pieces(new_text, final), in_order=False)[0]

    def advance_in_order(self, new_text: str, final: bool) -> list[ChatDelta]:
        """What `advance` gives, cut where the output's order needs it: within each delta reasoning comes before
        content and content before tool calls, so text that follows a call (one engine step can hold several
        tokens: the end of a call, the section end, more text) starts the next delta. No empty deltas."""
        return [d for d in _chat_deltas(self._pieces(new_text, final), in_order=True) if not _delta_is_empty(d)]

    def _pieces(self, new_text: str, final: bool) -> list[tuple[str, Any]]:
        """What `new_text` adds, in output order: ("reasoning", text), ("content", text), ("call", ToolCallDelta)."""
        reasoning, content = "", new_text
        if self.reasoning_parser is not None:
            r = self.reasoning_parser.feed(new_text)
            reasoning, content = r.reasoning, r.content
            if final:
                tail = self.reasoning_parser.finish()
                reasoning, content = reasoning + tail.reasoning, content + tail.content
        pieces: list[tuple[str, Any]] = [("reasoning", reasoning)] if reasoning else []
        if self.tool_parser is None:
            self._text(pieces, content)
            return pieces
        parts = [self.tool_parser.feed(content)]
        if final:
            parts.append(self.tool_parser.finish())
        for part in parts:
            at = 0
            for d in part.tool_calls:
                self._text(pieces, part.content[at:d.offset])
                at = max(at, d.offset)
                self._call(pieces, d)
            self._text(pieces, part.content[at:])
        if final:
            self._call_done(pieces)
        return pieces

    def _text(self, pieces: list[tuple[str, Any]], text: str) -> None:
        if text:
            self._call_done(pieces)  # text after a call: the call is over
            pieces.append(("content", text))

    def _call(self, pieces: list[tuple[str, Any]], d: ToolCallDelta) -> None:
        if self.max_calls is not None and d.index >= self.max_calls:
            return
        if d.id is not None:  # the header: id, type and the complete name, exactly once per call
            self._call_done(pieces)
            self.args_sent[d.index] = ""
            self.open_call = d.index
        self.args_sent[d.index] = self.args_sent.get(d.index, "") + d.arguments
        pieces.append(("call", d))

    def _call_done(self, pieces: list[tuple[str, Any]]) -> None:
        """The open call is over: if it streamed no arguments it gets "{}" now, as a whole response has it (and
        before anything that follows, for clients that append arguments to the latest call)."""
        index, self.open_call = self.open_call, None
        if index is not None and not self.args_sent[index]:
            self.args_sent[index] = NO_ARGUMENTS
            pieces.append(("call", ToolCallDelta(index=index, arguments=NO_ARGUMENTS)))

    def calls(self) -> list[ParsedToolCall]:
        calls = self.tool_parser.calls if self.tool_parser is not None else []
        return calls if self.max_calls is None else calls[: self.max_calls]

    def finish(self, ctx: ServingContext, prep: PreparedChat, engine_reason: str) -> tuple[list[ParsedToolCall], str]:
        """The choice's tool calls (checked as whole-response calls are) and its finish reason, counted."""
        calls = self.calls()
        if self.tool_parser is not None:
            check_tool_calls(ctx, prep.request_id, calls, self.tool_parser.section_opened, prep.tools)
        finish = finish_reason(engine_reason, bool(calls))
        ctx.metrics.count_finish(finish)
        return calls, finish


def _chat_deltas(pieces: list[tuple[str, Any]], in_order: bool) -> list[ChatDelta]:
    """The pieces as one ChatDelta, or (in_order) as several that keep their order: reasoning, content, calls."""
    deltas = [ChatDelta()]
    for kind, value in pieces:
        delta = deltas[-1]
        if in_order and kind != "call" and (delta.tool_calls or (kind == "reasoning" and delta.content)):
            delta = ChatDelta()
            deltas.append(delta)
        if kind == "reasoning":
            delta.reasoning_content = delta.reasoning = (delta.reasoning_content or "") + value
        elif kind == "content":
            delta.content = (delta.content or "") + value
        else:
            delta.tool_calls = _add_call_delta(delta.tool_calls or [], value)
    return deltas


def _add_call_delta(calls: list[ToolCallDeltaOut], d: ToolCallDelta) -> list[ToolCallDeltaOut]:
    if d.id is not None:
        calls.append(ToolCallDeltaOut(index=d.index, id=d.id, type="function",
                                      function=FunctionCallDelta(name=d.name, arguments="")))
    if d.arguments:
        if calls and calls[-1].index == d.index:
            calls[-1].function.arguments = (calls[-1].function.arguments or "") + d.arguments
        else:
            calls.append(ToolCallDeltaOut(index=d.index, function=FunctionCallDelta(arguments=d.arguments)))
    return calls


def _delta_is_empty(delta: ChatDelta) -> bool:
    return delta.content is None and delta.reasoning_content is None and delta.tool_calls is None


async def stream_chat(ctx: ServingContext, prep: PreparedChat) -> AsyncIterator[str]:
    """SSE events for one request. Abandoning the iterator (client gone) aborts the engine request."""
    include_usage = bool(prep.req.stream_options and prep.req.stream_options.include_usage
                         or ctx.settings.force_include_usage)  # --enable-force-include-usage
    rid, model, created = prep.request_id, ctx.model_name, int(time.time())

    def chunk(choice: ChatChunkChoice) -> str:
        return sse_event(ChatCompletionChunk(id=rid, model=model, created=created, choices=[choice]),
                         null_usage=include_usage)

    states = [ChoiceStream.start(ctx, prep, i) for i in range(prep.params.n)]
    start = time.monotonic()
    first_token: float | None = None
    final = None
    try:
        for state in states:
            yield chunk(ChatChunkChoice(index=state.index, delta=ChatDelta(role="assistant", content="")))
        async for out in engine_generate(ctx, prep):
            final = out
            for output in out.outputs:
                state = states[output.index]
                if state.done:
                    continue
                if first_token is None and output.token_ids:
                    first_token = time.monotonic() - start
                finished = output.finish_reason is not None
                delta = state.advance(output.text[state.text_sent:], final=finished)
                state.text_sent = len(output.text)
                logprobs = None
                if prep.req.logprobs:
                    new = (output.logprobs or [])[state.tokens_sent:]
                    logprobs = ChoiceLogprobs(content=chat_logprobs(ctx.tokenizer, new, prep.top_logprobs))
                    state.tokens_sent = len(output.logprobs or [])  # only tokens whose text is shown
                if not _delta_is_empty(delta) or (logprobs is not None and logprobs.content):
                    yield chunk(ChatChunkChoice(index=state.index, delta=delta, logprobs=logprobs))
                if finished:
                    state.done = True
                    _, finish = state.finish(ctx, prep, output.finish_reason)
                    final_choice = ChatChunkChoice(index=state.index, delta=ChatDelta(), finish_reason=finish)
                    if include_usage and prep.params.n == 1:
                        # Moonshot's API also puts usage in the last choice; the K2 vendor verifier reads it there.
                        final_choice.usage = usage_info(len(prep.prompt_ids), out.outputs, out.num_cached_tokens)
                    yield chunk(final_choice)
            if out.finished:
                break
    except APIError as exc:  # the status line is already sent: report in-band, then end the stream
        logger.warning("request %s: %s", rid, exc.message)
        yield sse_error(exc.body())
        return
    except Exception as exc:  # noqa: BLE001 - whatever fails after the status line is reported in-band
        yield sse_error(logged_stream_failure(exc, rid).body())
        return
    finally:
        if final is None or not final.finished:
            await ctx.abort(rid)
    if include_usage and final is not None:
        usage = usage_info(len(prep.prompt_ids), final.outputs, final.num_cached_tokens)
        yield sse_event(ChatCompletionChunk(id=rid, model=model, created=created, choices=[], usage=usage))
    if final is not None:
        usage = usage_info(len(prep.prompt_ids), final.outputs, final.num_cached_tokens)
        ctx.metrics.count_tokens(usage.prompt_tokens, usage.completion_tokens)
    ctx.metrics.observe_latency(first_token, time.monotonic() - start)
    yield sse_done()
