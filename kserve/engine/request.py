"""One user request as the engine tracks it: its prompt, sampling parameters and `n` sequences."""

from __future__ import annotations

from kserve.engine.outputs import (
    CompletionDelta,
    CompletionOutput,
    RequestDelta,
    RequestOutput,
)
from kserve.engine.sampling_params import SamplingParams
from kserve.engine.sequence import Sequence, SequenceStatus


class Request:
    """One user request: a prompt and its `n` completions."""

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seqs: list[Sequence] = []
        self.error: BaseException | None = None

    @property
    def finished(self) -> bool:
        for seq in self.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True

    def output(self) -> RequestOutput:
        """A snapshot: each completion's full text, tokens and logprobs so far."""
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.visible_text,
                token_ids=s.output_token_ids,
                logprobs=s.logprobs[: s.num_released_logprobs] if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in self.seqs
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=self.seqs[0].num_cached_tokens if self.seqs else 0,
        )

    def take_delta(self) -> RequestDelta:
        """What changed since the last call (the first call: everything so far); costs only the news."""
        parts = []
        for s in self.seqs:
            end = max(s.visible_len if not s.is_finished else len(s.text), s.sent_chars)
            text = s.text[s.sent_chars : end]
            s.sent_chars = end
            first_new = s.num_prompt_tokens + s.sent_tokens
            tokens = s.token_ids[first_new:]
            s.sent_tokens += len(tokens)
            logprobs = None
            if s.logprobs is not None:
                logprobs = s.logprobs[s.sent_logprobs : s.num_released_logprobs]
                s.sent_logprobs = max(s.sent_logprobs, s.num_released_logprobs)
            parts.append(CompletionDelta(s.index, [text] if text else [], tokens, logprobs,
                                         s.finish_reason, s.stop_reason))
        return RequestDelta(self.request_id, parts, self.finished,
                            self.seqs[0].num_cached_tokens if self.seqs else 0)
