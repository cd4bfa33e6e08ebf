"""One generated completion's state: its tokens, its cache blocks and its progress."""

from __future__ import annotations

from enum import Enum, IntFlag, auto
from typing import Any

from kserve.engine.outputs import TokenLogprob
from kserve.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Needs(IntFlag):
    """Which optional sampler steps a sequence's parameters ask for (fixed for its lifetime)."""

    NOTHING = 0
    RANDOM = auto()  # not greedy (see SamplingParams.greedy)
    TOP_K_TOP_P = auto()
    MIN_P = auto()
    LOGIT_BIAS = auto()
    PENALTIES = auto()
    MIN_TOKENS = auto()
    PROCESSORS = auto()
    LOGPROBS = auto()

    @classmethod
    def of(cls, params: SamplingParams) -> Needs:
        needs = cls.NOTHING
        if not params.greedy:
            needs |= cls.RANDOM
            if params.top_k not in (-1, 0, None) or params.top_p < 1.0:
                needs |= cls.TOP_K_TOP_P
            if params.min_p > 0.0:
                needs |= cls.MIN_P
        if params.logit_bias:
            needs |= cls.LOGIT_BIAS
        if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
            needs |= cls.PENALTIES
        if params.min_tokens > 0:
            needs |= cls.MIN_TOKENS
        if params.logits_processors:
            needs |= cls.PROCESSORS
        if params.logprobs is not None:
            needs |= cls.LOGPROBS
        return needs


class Sequence:
    """A prompt plus the tokens generated for it so far.

    `num_computed_tokens` counts the leading tokens whose latent KV is in the cache; the scheduler
    feeds the model the tokens after it. Preemption resets it to 0 (recompute) but keeps every
    generated token, so nothing already emitted is lost.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: int,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # completion index within the request (n > 1)
        self.params = params
        self.arrival = arrival  # FCFS order
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.admitted_once = False
        # n > 1: siblings wait until this sequence's prompt is in the prefix cache, then share it.
        self.wait_for: Sequence | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.needs = Needs.of(params)
        self.seed = 0  # this completion's sampling seed (from params.seed, else drawn by the engine)
        self.constraint: Any = None  # kserve.engine.logits_process.TokenConstraint
        # Text state, owned by kserve.engine.output_processor.
        self.detokenizer: Any = None
        self.text = ""  # all decoded text so far (may end with a held-back stop-string prefix)
        self.visible_len = 0  # chars of `text` safe to show while running
        # With logprobs: len(text) after each output token, and how many logprobs are safe to show
        # (a token's logprob is shown with its text, so none of a stop string that gets cut).
        self.token_text_ends: list[int] = []
        self.num_released_logprobs = 0
        # What the server has been sent already (Request.take_delta): chars, output tokens, logprobs.
        self.sent_chars = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.last_scheduled_step = -1  # the scheduler's serial when this last ran (orders round-robin)
        # speculative decoding: tokens a proposer suggests after the last one, verified next step
        self.draft_token_ids: list[int] = []
        # images (kserve/engine/multimodal.py): their placeholder runs (start, length) in the prompt, and the
        # tower's embeddings [sum of lengths, hidden], computed once before the first prefill and kept
        self.images: list[Any] = []
        self.image_spans: list[tuple[int, int]] = []
        self.image_embeds: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def image_keys(self, start: int, end: int) -> tuple[str, ...]:
        """Content hashes of the images whose placeholders overlap positions [start, end): part of the
        prefix-cache key of a block, so two different images never share a cached block."""
        return tuple(image.content_hash for image, (first, length) in zip(self.images, self.image_spans)
                     if first < end and first + length > start)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def visible_text(self) -> str:
        return self.text if self.is_finished else self.text[: self.visible_len]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
