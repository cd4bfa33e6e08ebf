"""What the engine returns for a request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # top-k alternatives, token id -> logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    # Convenience for n == 1 callers (LLM.generate returns one RequestOutput per prompt).
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


@dataclass
class CompletionDelta:
    """What one completion gained since the last delta: new visible text (as pieces, joined on read),
    new token ids, new logprobs (only of tokens whose text is shown), and how it ended."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def merge(self, later: CompletionDelta) -> None:
        self.text_parts.extend(later.text_parts)
        self.token_ids.extend(later.token_ids)
        if later.logprobs:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


@dataclass
class RequestDelta:
    """One request's news since its last delta; deltas merge, so a slow reader gets one, not many."""

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool = False
    num_cached_tokens: int = 0

    def merge(self, later: RequestDelta) -> None:
        for mine, theirs in zip(self.outputs, later.outputs):
            mine.merge(theirs)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens


class OutputAccumulator:
    """Rebuilds cumulative `RequestOutput`s from deltas. Token id and logprob lists are appended to
    in place (no copy per delta); each snapshot gets the text as it stands."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int,
                 with_logprobs: bool) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.completions = [
            CompletionOutput(index=i, text="", token_ids=[], logprobs=[] if with_logprobs else None)
            for i in range(n)
        ]

    def apply(self, delta: RequestDelta) -> RequestOutput:
        for part in delta.outputs:
            done = self.completions[part.index]
            if part.text_parts:
                done.text += "".join(part.text_parts)
            done.token_ids.extend(part.token_ids)
            if part.logprobs and done.logprobs is not None:
                done.logprobs.extend(part.logprobs)
            if part.finish_reason is not None:
                done.finish_reason, done.stop_reason = part.finish_reason, part.stop_reason
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
                for c in self.completions
            ],
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
        )
