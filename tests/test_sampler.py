"""Sampler: each feature against a direct computation of what it should do."""

from __future__ import annotations

import math

import pytest
import torch
from test_engine_sampler_helpers import EvenOnly

from kserve.engine.logits_process import TokenConstraint, TypicalLogitsProcessor
from kserve.engine.sampler import Sampler, seeded_exponential
from kserve.engine.sampling_params import SamplingParams
from kserve.engine.sequence import Sequence
from kserve.engine.token_bitmask import (
    apply_token_bitmask,
    new_bitmask,
    set_allowed,
    unpack_bitmask,
)

EOS = 3


def seq(params: SamplingParams, prompt=(7, 8), output=(), sid: int = 0) -> Sequence:
    s = Sequence(sid, f"r{sid}", 0, list(prompt), params, sid)
    s.token_ids.extend(output)
    s.seed = 1000 + sid  # the engine gives every sequence its own seed
    return s


def frequencies(logits_row: torch.Tensor, params: SamplingParams, rows: int = 20000) -> torch.Tensor:
    """Empirical distribution of one draw from each of `rows` differently seeded sequences."""
    sampler = Sampler([EOS], "cpu")
    seqs = [seq(params, sid=i) for i in range(rows)]
    out = sampler.sample(logits_row.expand(rows, -1).clone(), seqs).token_ids
    return torch.bincount(torch.tensor(out), minlength=logits_row.shape[0]).float() / rows


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    seqs = [seq(SamplingParams(temperature=0.0), sid=i) for i in range(5)]
    assert Sampler([EOS], "cpu").sample(logits, seqs).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=0.5), torch.softmax(LOGITS / 0.5, -1)),
        (SamplingParams(top_k=2), torch.tensor([0.5, 0.3, 0, 0]) / 0.8),
        (SamplingParams(top_p=0.7), torch.tensor([0.5, 0.3, 0, 0]) / 0.8),
        (SamplingParams(top_p=0.85), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95),
        (SamplingParams(min_p=0.5), torch.tensor([0.5, 0.3, 0, 0]) / 0.8),
    ],
)
def test_sampling_distribution(params: SamplingParams, expected: torch.Tensor) -> None:
    got = frequencies(LOGITS, params)
    torch.testing.assert_close(got, expected.float(), atol=0.015, rtol=0)


def test_seeded_noise_is_exponential_and_position_dependent() -> None:
    noise = seeded_exponential(torch.tensor([1, 2**40 + 1]), torch.tensor([0, 0]), 50000)
    assert abs(noise.mean().item() - 1.0) < 0.02 and abs(noise.var().item() - 1.0) < 0.05
    assert not torch.equal(noise[0], noise[1])  # the high seed bits matter
    again = seeded_exponential(torch.tensor([1, 1]), torch.tensor([0, 1]), 50000)
    assert torch.equal(again[0], noise[0]) and not torch.equal(again[0], again[1])


def test_mixed_batch_rows_keep_their_own_settings() -> None:
    logits = LOGITS.expand(4, -1).clone()
    seqs = [seq(SamplingParams(temperature=0.0), sid=0), seq(SamplingParams(top_k=1), sid=1),
            seq(SamplingParams(temperature=1.0, logit_bias={2: 100.0}), sid=2),
            seq(SamplingParams(temperature=0.0, logit_bias={3: 100.0}), sid=3)]
    assert Sampler([EOS], "cpu").sample(logits, seqs).token_ids == [0, 0, 2, 3]


def test_top_k_top_p_partial_and_full_sort_agree() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)) * 3
    small = [SamplingParams(top_k=k, top_p=p) for k, p in [(5, 1.0), (40, 0.8), (1, 0.5)]]
    mixed = small + [SamplingParams(top_p=0.7), SamplingParams(), SamplingParams(temperature=0.0)]
    from kserve.engine.sampler import _top_k_top_p

    got_small = _top_k_top_p(logits[:3], [seq(p, sid=i) for i, p in enumerate(small)])  # topk path
    got_full = _top_k_top_p(logits, [seq(p, sid=i) for i, p in enumerate(mixed)])  # sort path
    torch.testing.assert_close(got_small, got_full[:3])
    assert torch.equal(got_full[4:], logits[4:])  # rows that did not ask are untouched
    kept = torch.isfinite(got_full)
    assert kept[0].sum() == 5 and kept[2].sum() == 1
    probs = torch.softmax(logits[3], -1)
    top = probs.sort(descending=True).values
    n = int((top.cumsum(0) - top < 0.7).sum())
    assert kept[3].sum() == n


def test_penalties_match_formula() -> None:
    vocab = 12
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 3
    prompt, output = [1, 2, 2], [2, 5, 5, 5, 9]
    params = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.5)
    expected = logits[0].clone()
    for t in set(prompt + output):
        expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
    for t in set(output):
        expected[t] -= 0.3 * output.count(t) + 0.7
    s = seq(params, prompt, output)
    work = logits.clone()
    Sampler([EOS], "cpu")._apply_penalties(work, [0], [s])
    torch.testing.assert_close(work[0], expected)


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    seqs = [seq(SamplingParams(temperature=0.0, logprobs=3, logit_bias={4: 50.0}), sid=0),
            seq(SamplingParams(temperature=0.0), sid=1)]
    out = Sampler([EOS], "cpu").sample(logits.clone(), seqs)
    ref = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp.token_id == 4 == out.token_ids[0]
    assert math.isclose(lp.logprob, ref[4].item(), rel_tol=1e-5)
    top = ref.topk(3)
    assert list(lp.top) == top.indices.tolist()
    assert out.logprobs[1] is None


def test_seeded_rows_ignore_batch_composition() -> None:
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=99)
    runs = []
    for batch in (1, 5):
        sampler = Sampler([EOS], "cpu")
        s = seq(p)
        s.seed = 99
        others = [seq(SamplingParams(temperature=1.0), sid=i + 1 + batch) for i in range(batch - 1)]
        tokens = []
        for _ in range(5):
            tokens.append(sampler.sample(logits.expand(batch, -1).clone(), others + [s]).token_ids[-1])
            s.token_ids.append(tokens[-1])
        runs.append(tokens)
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1


def test_bitmask_roundtrip_and_apply() -> None:
    vocab = 70
    mask = new_bitmask(2, vocab)
    set_allowed(mask, 0, [0, 31, 32, 69])
    allowed = unpack_bitmask(mask, vocab)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert allowed[1].all()
    logits = torch.zeros(3, vocab)
    apply_token_bitmask(logits, mask, torch.tensor([2, 0]))
    assert torch.isinf(logits[2]).sum() == vocab - 4 and not torch.isinf(logits[0:2]).any()


def test_constraint_masks_only_constrained_rows_and_forces_stop() -> None:
    vocab = 64
    assert isinstance(EvenOnly(vocab), TokenConstraint)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    logits[:, 1::2] += 10  # odd tokens would win without the constraint
    a, b, c = seq(SamplingParams(temperature=1.0), sid=0), seq(SamplingParams(temperature=0.0), sid=1), seq(SamplingParams(temperature=0.0), sid=2)
    a.constraint, c.constraint = EvenOnly(vocab), EvenOnly(vocab, limit=0)
    out = Sampler([EOS], "cpu").sample(logits.clone(), [a, b, c]).token_ids
    assert out[0] % 2 == 0
    assert out[1] == logits[1].argmax().item() and out[1] % 2 == 1
    assert out[2] == EOS


def test_typical_processor_matches_definition() -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(4))
    out = TypicalLogitsProcessor(mass=0.5)([], logits.clone())
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    entropy = -(p * logp).sum()
    order = sorted(range(40), key=lambda t: abs(-logp[t].item() - entropy.item()))
    kept, mass = set(), 0.0
    for t in order:
        kept.add(t)
        mass += p[t].item()
        if mass >= 0.5:
            break
    assert set(torch.isfinite(out).nonzero().flatten().tolist()) == kept
    assert 1 < len(kept) < 40


def test_seeded_noise_is_strictly_positive_so_masked_tokens_never_win():
    # Noise 0 would make a masked token's probability 0 / 0 = NaN, which argmax picks.
    from kserve.engine.sampler import seeded_exponential

    # 32 x 2**20 draws: with 24-bit uniforms about two of them used to round to u = 1.0.
    seeds = torch.arange(32, dtype=torch.int64) * 7919
    noise = seeded_exponential(seeds, torch.arange(32, dtype=torch.int64), 1 << 20)
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())


@pytest.mark.parametrize("temperature", [4.8e-87, 1e-30, 5e-6])
def test_a_vanishing_temperature_is_greedy_and_respects_the_mask(temperature) -> None:
    # Dividing by such a temperature overflows the logits to +-inf; softmax then gives NaN and the
    # row used to sample a token the grammar had masked (the fuzz harness found it: a 503 abort).
    vocab = 64
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5))
    logits[:, 1::2] += 10  # odd tokens would win without the constraint
    a = seq(SamplingParams(temperature=temperature, top_p=0.7, min_p=0.95), sid=0)
    b = seq(SamplingParams(temperature=temperature), sid=1)
    a.constraint = EvenOnly(vocab)
    out = Sampler([EOS], "cpu").sample(logits.clone(), [a, b]).token_ids
    even = logits[0].clone()
    even[1::2] = float("-inf")
    assert out == [even.argmax().item(), logits[1].argmax().item()]
