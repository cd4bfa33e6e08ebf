"""Engine logprobs (`TokenLogprob`) in the OpenAI shapes: chat `content[]` (also Responses' `output_text`) and
legacy completions; and which generated tokens spell the visible text, for Responses."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from kserve.chat.markers import THINK_END
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


class VisibleTokens:
    """Picks the tokens that spell a turn's visible text out of all it generated (reasoning, `</think>`, call
    markers and EOS are not part of Responses' `output_text`). Feed it the growing logprob list, then each new
    piece of the visible text: the first piece is found after the first `</think>`, each later one must follow
    it in the tokens' text (text after a tool call does not, and gets none)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._entries: list[TokenLogprob] = []
        self._spelled = ""  # the tokens' text so far
        self._ends: list[int] = []  # where each token's text ends in it
        self._taken = 0
        self._end: int | None = None  # where the visible text so far ends in it; None before the first piece
        self._lost = False  # the visible text stopped following the tokens' text

    def extend(self, entries: Sequence[TokenLogprob]) -> None:
        for entry in entries[len(self._entries):]:
            self._entries.append(entry)
            self._spelled += self._decoder.decode(self._tokenizer.token_bytes(entry.token_id))
            self._ends.append(len(self._spelled))

    def take(self, piece: str) -> list[TokenLogprob]:
        """The entries, not taken before, of the tokens that spell `piece`, the visible text's next piece."""
        if not piece or self._lost:
            return []
        if self._end is None:
            after = self._spelled.find(THINK_END)
            start = self._spelled.find(piece, after + len(THINK_END) if after >= 0 else 0)
        else:
            start = self._end if self._spelled.startswith(piece, self._end) else -1
        if start < 0:
            self._lost = True
            return []
        self._end = start + len(piece)
        out: list[TokenLogprob] = []
        for i in range(self._taken, len(self._entries)):
            if (self._ends[i - 1] if i else 0) >= self._end:
                break
            if self._ends[i] > start:
                out.append(self._entries[i])
            self._taken = i + 1
        return out
