"""The model runner's step building and decode paths on the tiny K2 model (fp32, CPU).

- ForwardBatch metadata: decode/prefill split, prefill context slots through the block tables.
- A mixed step (a prefill scheduled before a decode) is reordered decodes-first and still returns
  logits in scheduled order, equal to each sequence run alone.
- The padded static-buffer decode path (what CUDA graphs replay) run eagerly on the CPU equals the
  unpadded forward, and padding rows write only the scratch block.
- The FP8 latent cache: float8 storage, a scale that round-trips, logits close to the fp32 cache.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kserve.engine.model_runner import ModelRunner, decode_batch_buckets
from kserve.engine.scheduler import ScheduledSeq
from kserve.layers.mla_attention import varlen_causal_attention
from kserve.model import ForwardBatch, load_model

BLOCK = 16
NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def model(tiny_k2_dir):
    # Dequantized weights (H4): these tests compare paths and batch shapes at 1e-4, and on the FP8 path
    # a one-ulp difference can cross an e4m3 activation rounding that the random model amplifies.
    return load_model(tiny_k2_dir, weights="dequantized")


def make_runner(model, **kw) -> ModelRunner:
    kw.setdefault("static_decode", False)
    return ModelRunner(model, model.config, NUM_BLOCKS, BLOCK, torch.device("cpu"), torch.float32, max_model_len=256, **kw)


def fake_seq(prompt: list[int], blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=list(prompt), num_computed_tokens=0, block_table=list(blocks))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, 1700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(runner: ModelRunner, items: list[ScheduledSeq]) -> torch.Tensor:
    """One step; then advance the fake sequences as the scheduler would."""
    logits = runner.run(items)
    for item in items:
        item.seq.num_computed_tokens += item.num_new_tokens
    return logits


def decode_all(runner: ModelRunner, seqs, logits: torch.Tensor) -> torch.Tensor:
    for seq, row in zip(seqs, logits):
        seq.token_ids.append(int(row.argmax()))
    return run(runner, [ScheduledSeq(s, 1) for s in seqs])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_forward_batch_split_and_context_slots() -> None:
    batch = ForwardBatch.build(
        positions=[20, 4, 5, 6, 0, 1],
        slots=[5 * 4 + 0, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 9 * 4 + 0, 9 * 4 + 1],
        block_tables=[[7, 1, 3, 8, 4, 5], [6, 2], [9]],
        query_lens=[1, 3, 2],
        context_lens=[21, 7, 2],
        block_size=4,
    )
    assert batch.num_decode_seqs == 1 and not batch.is_decode_only
    prefill = batch.prefill
    assert prefill.token_start == 1 and prefill.query_lens == (3, 2) and prefill.context_lens == (7, 2)
    assert prefill.cu_seqlens_q.tolist() == [0, 3, 5] and prefill.cu_seqlens_k.tolist() == [0, 7, 9]
    assert prefill.context_slots.tolist() == [24, 25, 26, 27, 8, 9, 10, 36, 37]
    assert batch.block_tables.tolist() == [[7, 1, 3, 8, 4, 5], [6, 2, -1, -1, -1, -1], [9, -1, -1, -1, -1, -1]]
    assert batch.query_start_loc.tolist() == [0, 1, 4, 6]
    # one SDPA call for both prefills: block-diagonal, causal at the end of each context
    want = torch.zeros(5, 9, dtype=torch.bool)
    for j, pos in enumerate((4, 5, 6)):
        want[j, : pos + 1] = True
    want[3, 7] = True
    want[4, 7:9] = True
    assert torch.equal(prefill.dense_mask, want)
    # a one-token sequence after a prefill goes with the prefills (correct, just not the fast path)
    late = ForwardBatch.contiguous([3, 1], [3, 9], 4)
    assert late.num_decode_seqs == 0 and late.prefill.query_lens == (3, 1)
    with pytest.raises(ValueError, match="sequence 0"):
        ForwardBatch.build(positions=[0], slots=[0], block_tables=[[0]], query_lens=[1], context_lens=[9], block_size=4)


def test_prefill_attention_one_masked_call_equals_per_sequence_calls() -> None:
    query_lens, context_lens = (3, 1, 6), (10, 1, 6)
    batch = ForwardBatch.contiguous([1, *query_lens], [5, *context_lens], 4)
    prefill = batch.prefill
    assert prefill.dense_mask is not None
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(query_lens), 4, 24, generator=g)
    k = torch.randn(sum(context_lens), 4, 24, generator=g)
    v = torch.randn(sum(context_lens), 4, 16, generator=g)
    args = (q, k, v, prefill.query_lens, prefill.context_lens, prefill.cu_seqlens_q, prefill.cu_seqlens_k, 0.2)
    one_call = varlen_causal_attention(*args, prefill.dense_mask)
    per_sequence = varlen_causal_attention(*args)
    torch.testing.assert_close(one_call, per_sequence)
    # each query's output is its own sequence's: perturbing another sequence's keys changes nothing
    k2 = k.clone()
    k2[10:] += 1.0
    torch.testing.assert_close(varlen_causal_attention(q, k2, *args[2:], prefill.dense_mask)[:3], one_call[:3])


def test_decode_buckets() -> None:
    assert decode_batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and decode_batch_buckets(256)[-1] == 256
    assert decode_batch_buckets(6) == [1, 2, 4, 6]
    assert decode_batch_buckets(1) == [1]


def test_mixed_step_is_reordered_and_matches_sequences_alone(model) -> None:
    a_prompt, b_prompt = prompt(12, 1), prompt(21, 2)
    # reference: each alone
    alone = make_runner(model)
    ref_a = run(alone, [ScheduledSeq(fake_seq(a_prompt, [0]), 12)])[0]
    b = fake_seq(b_prompt, [1, 2])
    run(alone, [ScheduledSeq(b, 20)])  # prefill all but the last prompt token
    ref_b = run(alone, [ScheduledSeq(b, 1)])[0]

    runner = make_runner(model)
    b = fake_seq(b_prompt, [3, 4])
    run(runner, [ScheduledSeq(b, 20)])
    a = fake_seq(a_prompt, [5])
    items = [ScheduledSeq(a, 12), ScheduledSeq(b, 1)]  # a prefill scheduled before a decode
    inputs = runner.prepare(items)
    assert inputs.query_lens == [1, 12] and inputs.sample_rows == [12, 0]
    logits = run(runner, items)
    assert rel_err(logits[0], ref_a) <= 1e-5
    assert rel_err(logits[1], ref_b) <= 1e-5


def prefill_three(runner: ModelRunner):
    seqs = [fake_seq(prompt(17, 3), [0, 1]), fake_seq(prompt(5, 4), [2]), fake_seq(prompt(33, 5), [3, 4, 5])]
    logits = run(runner, [ScheduledSeq(s, len(s.token_ids)) for s in seqs])
    return seqs, logits


def test_padded_static_decode_equals_unpadded(model) -> None:
    eager = make_runner(model)
    padded = make_runner(model, static_decode=True, max_num_seqs=8)
    assert padded.decode_buckets == [1, 2, 4, 8] and not padded.graphs  # no CUDA here: same path, eager
    seqs_e, logits_e = prefill_three(eager)
    seqs_p, logits_p = prefill_three(padded)
    torch.testing.assert_close(logits_p, logits_e)
    sizes = []
    run_padded = padded._execute_padded
    padded._execute_padded = lambda inputs, size: sizes.append(size) or run_padded(inputs, size)
    real = slice(0, NUM_BLOCKS)
    for step in range(3):
        # Each step starts both runners from the same cache and tokens: this random model amplifies
        # rounding (batch 3 vs 4 matmul blockings, ~5e-7) by orders of magnitude within a few steps,
        # which would hide what is compared here, the padded step's own arithmetic.
        padded.kv_cache[:, real].copy_(eager.kv_cache[:, real])
        previous = logits_e
        logits_e = decode_all(eager, seqs_e, previous)
        logits_p = decode_all(padded, seqs_p, previous)
        assert logits_p.shape == logits_e.shape == (3, model.config.vocab_size)
        assert rel_err(logits_p, logits_e) <= 1e-4, step
        assert [s.token_ids for s in seqs_p] == [s.token_ids for s in seqs_e]
    assert sizes == [4, 4, 4]
    # padding wrote only the scratch block; the real blocks hold the same latents
    torch.testing.assert_close(padded.kv_cache[:, real], eager.kv_cache[:, real], rtol=1e-4, atol=1e-5)
    assert padded.kv_cache[:, NUM_BLOCKS].abs().sum() > 0 and eager.kv_cache[:, NUM_BLOCKS].abs().sum() == 0
    # a step mixing in a prefill, or wider than the largest bucket, runs unpadded
    decoding = fake_seq(prompt(3, 8), [8])
    decoding.num_computed_tokens = 2
    assert padded.prepare([ScheduledSeq(decoding, 1)]).padded_batch_size == 1
    assert padded.prepare([ScheduledSeq(decoding, 1), ScheduledSeq(fake_seq(prompt(4, 9), [7]), 4)]).padded_batch_size is None
    assert padded.prepare([ScheduledSeq(decoding, 1)] * 9).padded_batch_size is None


def run_steps(runner: ModelRunner, steps: int = 4) -> torch.Tensor:
    """Prefill three sequences, then decode fixed tokens (so two runners see the same inputs)."""
    seqs, logits = prefill_three(runner)
    out = [logits]
    for step in range(steps):
        for i, seq in enumerate(seqs):
            seq.token_ids.append(100 + 37 * step + i)
        out.append(run(runner, [ScheduledSeq(s, 1) for s in seqs]))
    return torch.cat(out)


@pytest.mark.parametrize("kv_scale", [1.0, 4.0])
def test_fp8_latent_cache(model, kv_scale) -> None:
    ref = run_steps(make_runner(model))
    fp8 = make_runner(model, kv_cache_dtype="fp8", kv_scale=kv_scale)
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn
    got = run_steps(fp8)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    print(f"fp8 cache (kv_scale {kv_scale}) vs fp32 cache: median cosine {cos.median():.4f}, min {cos.min():.4f}")
    # e4m3 keeps 3 mantissa bits, and a near-tie expert choice can flip: directions, as for bf16
    assert cos.median() > 0.99 and cos.min() > 0.8
    # the cache holds latent / kv_scale: the stored magnitudes shrink with the scale
    stored = fp8.kv_cache[:, :NUM_BLOCKS].float().abs().max().item()
    ref_cache = make_runner(model)
    run_steps(ref_cache, steps=0)
    assert stored == pytest.approx(ref_cache.kv_cache.abs().max().item() / kv_scale, rel=0.07)


@pytest.mark.parametrize("kv_scale", [1.0, 4.0])
def test_fp8_cache_prefill_and_decode_readers_agree(model, kv_scale) -> None:
    """Both readers dequantize the same stored values: the last token's logits by the prefill path
    (which reads its own new latents back from the cache) and by the decode kernel agree closely."""
    ids = prompt(30, 11)
    whole = make_runner(model, kv_cache_dtype="fp8", kv_scale=kv_scale)
    naive = run(whole, [ScheduledSeq(fake_seq(ids, [0, 1]), 30)])[0]
    split = make_runner(model, kv_cache_dtype="fp8", kv_scale=kv_scale)
    seq = fake_seq(ids, [0, 1])
    run(split, [ScheduledSeq(seq, 29)])
    absorbed = run(split, [ScheduledSeq(seq, 1)])[0]
    err = rel_err(absorbed, naive)
    print(f"fp8 cache (kv_scale {kv_scale}): naive vs absorbed max rel err {err:.3e}")
    assert err <= 1e-4


def test_engine_serves_with_the_fp8_cache(tiny_k2_dir) -> None:
    from kserve.config import EngineConfig
    from kserve.engine.llm import LLM
    from kserve.engine.llm_engine import LLMEngine
    from kserve.engine.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_k2_dir), device="cpu", dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=32)
    engine = LLMEngine.from_config(config)
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    out = LLM.from_engine(engine).generate(
        [prompt(9, 12), prompt(20, 13)], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert [len(o.token_ids) for o in out] == [5, 5]
    assert engine.stats().kv_blocks_used == 0
