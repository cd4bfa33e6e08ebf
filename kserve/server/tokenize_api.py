"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes.

`/tokenize` takes either a completion `prompt` (encoded as `/v1/completions` encodes it: K2's special tokens
recognized) or chat `messages` (+ `tools`, `add_generation_prompt`, `continue_final_message`, and the thinking
switch: `chat_template_kwargs` `thinking` / `preserve_thinking` or Moonshot's `thinking` field), checked and
rendered exactly as `/v1/chat/completions` renders them, and answers `{"count", "max_model_len", "tokens"}`
(+ `token_strs`). An image counts as its placeholder tokens (each image's `<|media_pad|>` repeated, as the engine
gets the prompt): images are fetched and decoded to know their sizes, and refused as chat completions refuses them.
"""

from __future__ import annotations

from typing import Any

from kserve.server.chat_request import render_chat, rendered_prompt
from kserve.server.context import ServingContext
from kserve.server.errors import bad_request
from kserve.server.protocol import ChatCompletionRequest, StrictRequest


class TokenizeRequest(StrictRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool | None = None  # unset: true, unless continue_final_message
    chat_template_kwargs: dict[str, Any] | None = None  # read by the chat rendering, as chat completions reads it
    return_token_strs: bool = False


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[int]


async def tokenize(ctx: ServingContext, req: TokenizeRequest, raw: dict[str, Any]) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
    if req.model is not None:
        ctx.check_model(req.model)
    if req.prompt is not None:
        ids = ctx.tokenizer.encode(req.prompt, allow_special_tokens=True)
    else:
        # The chat request body as /v1/chat/completions would get it: same checks, same rendering.
        body = {**raw, "model": ctx.model_name}
        for field in ("prompt", "return_token_strs"):
            body.pop(field, None)
        rendered = render_chat(ctx, ChatCompletionRequest.model_validate(body), body, generating=False)
        ids = await rendered_prompt(ctx, rendered)  # each image's placeholder tokens counted
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [ctx.tokenizer.token_bytes(i).decode("utf-8", "replace") for i in ids]
    return out


def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict[str, Any]:
    if req.model is not None:
        ctx.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"'tokens' holds ids outside [0, {ctx.vocab_size}): {bad[:5]}", "tokens", "invalid_token_id")
    return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}
