"""Extension points through the whole engine: per-request logits processors and token constraints."""

from __future__ import annotations

import torch
from test_engine_sampler_helpers import EvenOnlyGuide
from test_engine_toy import TOY_VOCAB, CharTokenizer, make_toy_engine

from kserve.engine.llm import LLM
from kserve.engine.logits_process import TypicalLogitsProcessor
from kserve.engine.sampling_params import SamplingParams

PROMPT = [10, 20, 30, 40, 50]


class BanTokens:
    """A user-defined decoding rule: never emit these tokens."""

    def __init__(self, banned: list[int]) -> None:
        self.banned = banned
        self.calls = 0

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        logits[self.banned] = float("-inf")
        return logits


def test_logits_processor_changes_only_its_request() -> None:
    llm = LLM.from_engine(make_toy_engine())
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    ban = BanTokens(sorted(set(free.token_ids)))
    outs = llm.generate(
        [PROMPT, PROMPT],
        [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logits_processors=[ban]),
         SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)],
        use_tqdm=False,
    )
    assert not set(outs[0].token_ids) & set(ban.banned)
    assert outs[1].token_ids == free.token_ids
    assert ban.calls == 10


def test_typical_sampling_runs_in_the_engine() -> None:
    llm = LLM.from_engine(make_toy_engine())
    typical = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True,
                             logits_processors=[TypicalLogitsProcessor(mass=0.2)])
    out = llm.generate([PROMPT], typical, use_tqdm=False)[0]
    assert len(out.token_ids) == 20
    # with a small mass, every sampled token is within the processor's kept set: re-check each step
    engine = make_toy_engine()
    seen = []

    class Recorder:
        def __call__(self, output_token_ids, logits):
            kept = torch.isfinite(TypicalLogitsProcessor(mass=0.2)(output_token_ids, logits.clone()))
            seen.append(kept)
            return logits

    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True,
                            logits_processors=[Recorder(), TypicalLogitsProcessor(mass=0.2)])
    again = LLM.from_engine(engine).generate([PROMPT], params, use_tqdm=False)[0]
    assert again.token_ids == out.token_ids
    assert all(kept[t] for kept, t in zip(seen, again.token_ids))
    assert any(kept.sum() < TOY_VOCAB // 2 for kept in seen)


def test_guided_constraint_advances_and_terminates() -> None:
    engine = make_toy_engine(num_kv_blocks=16)  # small: forces preemption with 4 requests
    guide = EvenOnlyGuide(limit=7)
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30, guided=guide, stop_token_ids=[1])
    outs = llm.generate([PROMPT * 3] * 4, params, use_tqdm=False)
    for out, constraint in zip(outs, guide.made):
        toks = out.token_ids
        assert all(t % 2 == 0 for t in toks[:7])
        # terminated after 7 accepted tokens: the next token is forced to a stop token
        assert len(toks) == 8 and toks[-1] == 1 and out.outputs[0].finish_reason == "stop"
        assert constraint.accepted == toks[:7]  # preemption did not replay tokens into it
    assert engine.stats().num_preemptions > 0


def test_terminated_constraint_without_stop_tokens_finishes() -> None:
    guide = EvenOnlyGuide(limit=3)
    out = LLM.from_engine(make_toy_engine()).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=30, guided=guide), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 3 and all(t % 2 == 0 for t in out.token_ids)
    assert out.outputs[0].finish_reason == "stop"


def test_terminated_constraint_stops_even_with_ignore_eos() -> None:
    engine = make_toy_engine(tokenizer=CharTokenizer())  # declares stop tokens 1 and 2
    guide = EvenOnlyGuide(limit=2)
    out = LLM.from_engine(engine).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=30, guided=guide, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.token_ids[-1] == 1 and len(out.token_ids) == 3 and out.outputs[0].finish_reason == "stop"


class AllowsAllRejectsOnAccept:
    """A buggy constraint: its bitmask allows every token, but it rejects the token it is given."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1

    def accept_token(self, token_id: int) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


class BuggyGuide:
    def make_constraint(self) -> AllowsAllRejectsOnAccept:
        return AllowsAllRejectsOnAccept()


def test_token_rejected_by_the_constraint_aborts_never_stops() -> None:
    out = LLM.from_engine(make_toy_engine(tokenizer=CharTokenizer())).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=30, guided=BuggyGuide()), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 1
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].stop_reason is None
