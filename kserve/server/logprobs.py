"""Engine logprobs (`TokenLogprob`) in the two OpenAI shapes: chat `content[]` and legacy completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kserve.engine.outputs import TokenLogprob
from kserve.server.protocol import CompletionLogprobs, TokenLogprobEntry, TopLogprob


def token_text(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob], top_n: int) -> list[TokenLogprobEntry]:
    out: list[TokenLogprobEntry] = []
    for entry in entries:
        text, raw = token_text(tokenizer, entry.token_id)
        top: list[TopLogprob] = []
        for tid, lp in sorted(entry.top.items(), key=lambda kv: -kv[1])[:top_n]:
            t_text, t_raw = token_text(tokenizer, tid)
            top.append(TopLogprob(token=t_text, logprob=lp, bytes=t_raw))
        out.append(TokenLogprobEntry(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top))
    return out


def completion_logprobs(
    tokenizer: Any, entries: Sequence[TokenLogprob], top_n: int, text_offset: int
) -> CompletionLogprobs:
    """Legacy shape; `text_offset` is where the first token's text starts in the returned text."""
    result = CompletionLogprobs()
    offset = text_offset
    for entry in entries:
        text, _ = token_text(tokenizer, entry.token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry.logprob)
        top = sorted(entry.top.items(), key=lambda kv: -kv[1])[:top_n]
        result.top_logprobs.append({token_text(tokenizer, tid)[0]: lp for tid, lp in top})
        result.text_offset.append(offset)
        offset += len(text)
    return result
