"""`POST /v1/completions`: raw prompts (strings or token ids), echo, n, stop and logprobs.

This is K2's manual-parse flow: the client renders the chat template itself, so prompt strings are encoded with
special tokens recognized, and output keeps special tokens (the tool-call markers) unless the client asks
`skip_special_tokens: true`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kserve.engine.errors import PromptRejected
from kserve.server.context import (
    DisconnectWatch,
    ServingContext,
    engine_refused,
    new_request_id,
)
from kserve.server.errors import APIError, bad_request, logged_stream_failure
from kserve.server.logprobs import completion_logprobs
from kserve.server.outcome import client_gone, finish_reason, unfinished, usage_info
from kserve.server.protocol import (
    UNSUPPORTED_COMPLETION_FIELDS,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from kserve.server.sampling import build_sampling_params, fit_max_tokens
from kserve.server.sse import sse_done, sse_error, sse_event
from kserve.server.validation import normalize_stop, reject_unsupported

logger = logging.getLogger("kserve.server")

MAX_CHOICES = 64  # prompts x n per request


@dataclass
class PreparedPrompt:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    params: Any  # SamplingParams


@dataclass
class PreparedCompletion:
    request_id: str
    req: CompletionRequest
    prompts: list[PreparedPrompt]


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("'prompt' must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def prepare_completion(ctx: ServingContext, req: CompletionRequest, raw: dict[str, Any]) -> PreparedCompletion:
    reject_unsupported(raw, UNSUPPORTED_COMPLETION_FIELDS)
    ctx.check_model(req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "'best_of' different from 'n' is not supported", param="best_of",
                       code="unsupported_parameter")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "'echo' together with 'logprobs' is not supported (prompt logprobs are not computed)",
                       param="echo", code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    stop = normalize_stop(req.stop)
    request_id = new_request_id("cmpl")
    prompts: list[PreparedPrompt] = []
    prompt_list = _prompt_list(req.prompt)
    if len(prompt_list) * req.n > MAX_CHOICES:
        raise bad_request(f"{len(prompt_list)} prompts x n={req.n} asks for more than {MAX_CHOICES} completions",
                          "prompt")
    single = len(prompt_list) == 1 and (isinstance(req.prompt, str) or isinstance(req.prompt[0], int))
    for i, prompt in enumerate(prompt_list):
        where = "prompt" if single else f"prompt[{i}]"
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request(f"'{where}' must not be empty", where)
            ids = ctx.tokenizer.encode(prompt, allow_special_tokens=True)
            text = prompt
        else:
            if not prompt:
                raise bad_request(f"'{where}' must not be an empty token list", where)
            bad = [t for t in prompt if not 0 <= t < ctx.vocab_size]
            if bad:
                raise bad_request(f"'{where}' holds token ids outside [0, {ctx.vocab_size}): {bad[:5]}", where,
                                  "invalid_token_id")
            ids = prompt
            text = ctx.tokenizer.decode(ids, skip_special_tokens=False)
        max_tokens = fit_max_tokens(len(ids), req.max_tokens, ctx.max_model_len)
        params = build_sampling_params(req, max_tokens=max_tokens, stop=stop, logprobs=req.logprobs,
                                       skip_special_tokens=req.skip_special_tokens, vocab_size=ctx.vocab_size)
        ctx.validate_prompt(ids, params, where)
        prompts.append(PreparedPrompt(f"{request_id}-{i}", ids, text, params))
    return PreparedCompletion(request_id, req, prompts)


def _usage(prep: PreparedCompletion, finals: list[Any]) -> UsageInfo:
    done = [f for f in finals if f is not None]
    return usage_info(sum(len(p.prompt_ids) for p in prep.prompts), [o for f in done for o in f.outputs],
                      sum(f.num_cached_tokens or 0 for f in done))


async def _merged(ctx: ServingContext, prep: PreparedCompletion) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, snapshot) from all prompts' generations, as they arrive.

    Snapshots are cumulative, so only each prompt's latest is kept until the reader takes it: a slow
    reader (a slow client) holds one snapshot per prompt, never a queue of them.
    """
    latest: dict[int, Any] = {}
    errors: list[BaseException] = []
    wake = asyncio.Event()
    live = len(prep.prompts)

    async def pump(i: int, p: PreparedPrompt) -> None:
        nonlocal live
        try:
            async for out in ctx.engine.generate(p.request_id, p.prompt_ids, p.params):
                latest[i] = out
                wake.set()
        except Exception as exc:  # noqa: BLE001 -- surfaced to the consumer
            errors.append(exc)
        finally:
            live -= 1
            wake.set()

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prep.prompts)]
    finished: set[int] = set()
    try:
        while True:
            await wake.wait()
            wake.clear()
            if errors:
                raise errors[0]
            ready = sorted(latest.items(), key=lambda item: item[0])
            latest.clear()
            for i, out in ready:
                if out.finished:
                    finished.add(i)
                yield i, out
            if live == 0 and not latest:
                return
    finally:
        for task in tasks:
            task.cancel()
        for i, p in enumerate(prep.prompts):
            if i not in finished:
                await ctx.abort(p.request_id)


def _choice(ctx: ServingContext, prep: PreparedCompletion, i: int, output: Any) -> CompletionChoice:
    req, prompt = prep.req, prep.prompts[i]
    prefix = prompt.prompt_text if req.echo else ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(ctx.tokenizer, output.logprobs or [], req.logprobs, len(prefix))
    return CompletionChoice(index=i * req.n + output.index, text=prefix + output.text, logprobs=logprobs,
                            finish_reason=finish_reason(output.finish_reason))


async def run_completion(ctx: ServingContext, prep: PreparedCompletion, request: Any) -> CompletionResponse:
    start = time.monotonic()
    finals: list[Any] = [None] * len(prep.prompts)
    gone = False
    watch = DisconnectWatch(request)
    try:
        async for i, out in _merged(ctx, prep):
            finals[i] = out
            if await watch.gone():
                gone = True
                break
    except PromptRejected as exc:  # prepare_completion validated each prompt; a backstop
        raise engine_refused(exc, "prompt") from None
    if any(f is None or not f.finished for f in finals):
        raise client_gone() if gone else unfinished()
    choices = [_choice(ctx, prep, i, o) for i, f in enumerate(finals) for o in sorted(f.outputs, key=lambda o: o.index)]
    for c in choices:
        ctx.metrics.count_finish(c.finish_reason)
    usage = _usage(prep, finals)
    ctx.metrics.count_tokens(usage.prompt_tokens, usage.completion_tokens)
    ctx.metrics.observe_latency(None, time.monotonic() - start)
    return CompletionResponse(id=prep.request_id, model=ctx.model_name, choices=choices, usage=usage)


async def stream_completion(ctx: ServingContext, prep: PreparedCompletion) -> AsyncIterator[str]:
    req, rid, model, created = prep.req, prep.request_id, ctx.model_name, int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage
                         or ctx.settings.force_include_usage)  # --enable-force-include-usage
    text_sent: dict[int, int] = {}
    tokens_sent: dict[int, int] = {}
    finals: list[Any] = [None] * len(prep.prompts)
    done: set[int] = set()

    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
        return sse_event(CompletionResponse(id=rid, model=model, created=created, choices=[choice]),
                         null_usage=include_usage)

    try:
        if req.echo:
            for i, p in enumerate(prep.prompts):
                for j in range(req.n):
                    yield chunk(i * req.n + j, p.prompt_text)
        async for i, out in _merged(ctx, prep):
            finals[i] = out
            for output in out.outputs:
                index = i * req.n + output.index
                if index in done:
                    continue
                new_text = output.text[text_sent.get(index, 0):]
                offset = text_sent.get(index, 0) + (len(prep.prompts[i].prompt_text) if req.echo else 0)
                logprobs = None
                if req.logprobs is not None:
                    new = (output.logprobs or [])[tokens_sent.get(index, 0):]
                    logprobs = completion_logprobs(ctx.tokenizer, new, req.logprobs, offset)
                text_sent[index] = len(output.text)
                tokens_sent[index] = len(output.logprobs or [])  # only tokens whose text is shown
                if new_text or (logprobs is not None and logprobs.tokens):
                    yield chunk(index, new_text, logprobs)
                if output.finish_reason is not None:
                    done.add(index)
                    finish = finish_reason(output.finish_reason)
                    ctx.metrics.count_finish(finish)
                    yield chunk(index, "", None, finish)
    except APIError as exc:  # the status line is already sent: report in-band, then end the stream
        yield sse_error(exc.body())
        return
    except Exception as exc:  # noqa: BLE001 - whatever fails after the status line is reported in-band
        yield sse_error(logged_stream_failure(exc, rid).body())
        return
    usage = _usage(prep, finals)
    ctx.metrics.count_tokens(usage.prompt_tokens, usage.completion_tokens)
    if include_usage:
        yield sse_event(CompletionResponse(id=rid, model=model, created=created, choices=[], usage=usage))
    yield sse_done()
