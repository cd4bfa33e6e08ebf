"""Batch-invariant mode (`LLM(batch_invariant=True)`, `--batch-invariant`): a request's logits, logprobs and
greedy tokens do not depend on the batch or on its place in it.

Layer and kernel level: the default CPU GEMM is batch-variant and `linear_rows` is not; the invariant FP8
linear, fused MoE (FP8, dense, INT4) and MLA decode give bit-identical rows whatever the other rows are,
and stay close to the default paths; the Triton launches of the mode (FP8 GEMM, fused MoE, W4A16, MLA decode)
are checked the same way in the interpreter (TRITON_INTERPRET=1, set in conftest).
Engine level: tiny FP8 (K2) and INT4 (K2.6) checkpoints, a request alone and in batches of 1, 3, 17 and 40
other requests at several positions (also in bf16, with an FP8 KV cache and at tensor-parallel size 2),
under another chunking of its prefill, prefix-cache hits, preemption and seeded sampling; and the default
mode, which does differ in such a case.
"""

from __future__ import annotations

import functools

import random

import pytest
import torch
import torch.nn.functional as F

from kserve.kernels import batch_invariant as bi
from kserve.kernels.fp8_dequant import quantize_blocks_torch
from kserve.kernels.fp8_gemm import (
    batch_invariant_tiles,
    fp8_block_linear,
    w8a8_block_matmul_triton,
)
from kserve.kernels.fused_moe import fused_moe, fused_moe_torch, fused_moe_triton
from kserve.kernels.fused_moe_w4a16 import (
    fused_moe_w4a16,
    fused_moe_w4a16_torch,
    fused_moe_w4a16_triton,
)
from kserve.kernels.int4_pack import pack_int4, quantize_int4_groups
from kserve.kernels.mla_decode import (
    BATCH_INVARIANT_NUM_SPLITS,
    mla_decode_batch_invariant,
    mla_decode_torch,
    mla_decode_triton,
)
from kserve.kernels.triton_support import triton_available

# Batch sizes around the target row (the others) and the target's positions: alone, small batches, and
# batches over several of the mode's row tiles (16 rows on the CPU: 18 rows take two, 41 take three).
LAYOUTS = [(0, 0), (1, 0), (1, 1), (3, 2), (17, 0), (17, 9), (17, 17), (40, 0), (40, 23), (40, 40)]


def row_in_batches(fn, target, make_other, layouts=LAYOUTS, seed=0):
    """fn(list of rows) -> list of outputs per row; returns the target's output in every layout."""
    rng = random.Random(seed)
    results = []
    for others, position in layouts:
        rows = [make_other(rng) for _ in range(others)]
        rows.insert(position, target)
        results.append(fn(rows)[position])
    return results


def all_equal(results) -> bool:
    return all(torch.equal(r, results[0]) for r in results[1:])


# --- dense GEMMs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(256, 576), (192, 1536), (512, 256)])
def test_linear_rows_is_batch_invariant_where_the_plain_gemm_is_not(dtype, k, n):
    gen = torch.Generator().manual_seed(k + n)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    target = torch.randn(k, generator=gen).to(dtype)

    def other(rng):
        return torch.randn(k, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))).to(dtype)

    def plain(rows):
        return F.linear(torch.stack(rows), weight)

    def invariant(rows):
        return bi.linear_rows(torch.stack(rows), weight)

    got = row_in_batches(invariant, target, other)
    assert all_equal(got)
    plain_rows = row_in_batches(plain, target, other)
    if dtype == torch.float32:  # MKL's fp32 GEMM changes kernel with M (already between M = 1 and M = 2)
        assert not all_equal(plain_rows), "the plain fp32 GEMM was expected to be batch-variant here"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0], plain_rows[0], rtol=tol, atol=tol)


def test_bmm_rows_matches_bmm_and_is_batch_invariant():
    gen = torch.Generator().manual_seed(3)
    heads, k, n = 8, 128, 512
    w = torch.randn(heads, k, n, generator=gen) / k**0.5
    target = torch.randn(heads, k, generator=gen)

    def other(rng):
        return torch.randn(heads, k, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))

    got = row_in_batches(lambda rows: bi.bmm_rows(torch.stack(rows), w), target, other)
    assert all_equal(got)
    want = torch.bmm(target[:, None, :], w)[:, 0]
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


def test_silu_and_sigmoid_do_not_depend_on_the_position():
    """torch's CPU silu / sigmoid compute a vectorized body and a scalar tail differently; the mode's do not."""
    x = torch.randn(37 * 999, generator=torch.Generator().manual_seed(4)) * 4
    for fn, ref in ((bi.silu, F.silu), (bi.sigmoid, torch.sigmoid)):
        full = fn(x)
        for n in (37, 37 * 3, 37 * 17, 37 * 511, 37 * 998):
            for offset in (0, 37, 37 * 5):
                assert torch.equal(fn(x[offset : offset + n].clone()), full[offset : offset + n])
        torch.testing.assert_close(full, ref(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(bi.sum_fixed_order(torch.tensor([[1.0, 2.0, 4.0]]), 1), torch.tensor([7.0]))


# --- FP8 linear --------------------------------------------------------------------------------------------


def fp8_weight(n, k, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    return quantize_blocks_torch(w)


@pytest.mark.parametrize("n,k", [(576, 256), (300, 200)])
def test_fp8_linear_rows_are_batch_invariant(n, k):
    weight, scale = fp8_weight(n, k, seed=n)
    target = torch.randn(k, generator=torch.Generator().manual_seed(5))

    def other(rng):
        return torch.randn(k, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * rng.choice([0.1, 3])

    got = row_in_batches(lambda rows: fp8_block_linear(torch.stack(rows), weight, scale, batch_invariant=True), target, other)
    assert all_equal(got)
    plain = row_in_batches(lambda rows: fp8_block_linear(torch.stack(rows), weight, scale), target, other)
    assert not all_equal(plain), "the default FP8 linear (one addmm over all rows) was expected to vary"
    torch.testing.assert_close(got[0], plain[0], rtol=1e-5, atol=1e-5)


def test_fp8_quantized_matmul_rows_are_batch_invariant():
    """The GEMM on an activation the caller quantized (a row-parallel shard that cuts a 128-wide group)."""
    from kserve.kernels.fp8_gemm import w8a8_block_matmul_quantized
    from kserve.kernels.fp8_quant import quantize_per_token_group_torch

    weight, scale = fp8_weight(256, 384, seed=16)
    target = torch.randn(384, generator=torch.Generator().manual_seed(17))

    def other(rng):
        return torch.randn(384, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))

    def run(matmul):
        def go(rows):
            x_q, x_scale = quantize_per_token_group_torch(torch.stack(rows))
            return matmul(x_q, x_scale, weight, scale)

        return go

    got = row_in_batches(run(functools.partial(w8a8_block_matmul_quantized, batch_invariant=True)), target, other)
    assert all_equal(got)
    plain = row_in_batches(run(w8a8_block_matmul_quantized), target, other)
    torch.testing.assert_close(got[0], plain[0], rtol=1e-5, atol=1e-5)


def triton_or_skip():
    if not triton_available():
        pytest.skip("triton is not installed")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")


def test_fp8_gemm_triton_launch_is_fixed_and_batch_invariant():
    triton_or_skip()
    weight, scale = fp8_weight(200, 256, seed=6)
    container = weight.float()  # the interpreter takes fp32 containers of fp8 values
    target = torch.randn(256, generator=torch.Generator().manual_seed(7))

    def other(rng):
        return torch.randn(256, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))

    def run(rows):
        return w8a8_block_matmul_triton(torch.stack(rows), container, scale, split_k=1, tiles=batch_invariant_tiles())

    got = row_in_batches(run, target, other, layouts=[(0, 0), (3, 1), (17, 17), (40, 21)])
    assert all_equal(got)
    torch.testing.assert_close(got[0], fp8_block_linear(target[None], weight, scale)[0], rtol=1e-5, atol=1e-5)


# --- fused MoE ------------------------------------------------------------------------------------------------


# 71 tokens x 4 slots over 8 experts: about 35 pairs per expert, several row tiles each
MOE_LAYOUTS = [*LAYOUTS, (70, 35)]


def moe_weights(experts, hidden, inter, *, fp8, seed):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    if not fp8:
        return {"w13": w13, "w2": w2}
    q13, s13 = zip(*(quantize_blocks_torch(w) for w in w13))
    q2, s2 = zip(*(quantize_blocks_torch(w) for w in w2))
    return {"w13": torch.stack(q13), "w2": torch.stack(q2), "w13_scale": torch.stack(s13), "w2_scale": torch.stack(s2)}


def int4_weights(experts, hidden, inter, group, seed):
    gen = torch.Generator().manual_seed(seed)

    def quantized(rows, cols):
        q, scale = quantize_int4_groups(torch.randn(experts * rows, cols, generator=gen) / cols**0.5, group)
        return pack_int4(q).view(experts, rows, cols // 8), scale.view(experts, rows, cols // group)

    w13, s13 = quantized(2 * inter, hidden)
    w2, s2 = quantized(hidden, inter)
    return {"w13_packed": w13, "w2_packed": w2, "w13_scale": s13, "w2_scale": s2, "group_size": group}


def moe_token(rng, hidden, experts, top_k, dtype, first_expert=0):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ids = torch.randperm(experts + first_expert, generator=gen)[:top_k].to(torch.int32)
    return torch.randn(hidden, generator=gen).to(dtype), ids, torch.rand(top_k, generator=gen) + 0.1


def moe_runner(fn, weights, first_expert=0):
    def run(tokens):
        x = torch.stack([t[0] for t in tokens])
        ids = torch.stack([t[1] for t in tokens])
        topk = torch.stack([t[2] for t in tokens])
        keys = ("w13", "w2") if "w13" in weights else ("w13_packed", "w2_packed")
        rest = {k: v for k, v in weights.items() if k not in keys}
        return fn(x, weights[keys[0]], weights[keys[1]], topk, ids, first_expert, **rest)

    return run


@pytest.mark.parametrize("fp8,dtype", [(True, torch.float32), (False, torch.float32), (False, torch.bfloat16)])
def test_fused_moe_token_output_is_batch_invariant(fp8, dtype):
    experts, hidden, inter, top_k = 8, 256, 128, 4
    weights = moe_weights(experts, hidden, inter, fp8=fp8, seed=8)
    target = moe_token(random.Random(1), hidden, experts, top_k, dtype)

    def other(rng):
        return moe_token(rng, hidden, experts, top_k, dtype)

    got = row_in_batches(moe_runner(functools.partial(fused_moe, batch_invariant=True), weights), target, other, layouts=MOE_LAYOUTS)
    assert all_equal(got)
    plain = row_in_batches(moe_runner(fused_moe_torch, weights), target, other, layouts=MOE_LAYOUTS)
    if dtype == torch.float32:  # (in bf16 the output's rounding hides the default's last-bit changes here)
        assert not all_equal(plain), "the default fused MoE (strategy and GEMM M from the batch) was expected to vary"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0], plain[0], rtol=tol, atol=tol)


def test_fused_moe_remote_experts_stay_zero_and_rows_stay_invariant():
    """An expert-parallel rank holding experts 4..7 of 8: pairs of other ranks add exactly nothing."""
    experts, hidden, inter, top_k = 4, 256, 128, 2
    weights = moe_weights(experts, hidden, inter, fp8=True, seed=9)
    target = moe_token(random.Random(2), hidden, 4, top_k, torch.float32, first_expert=4)

    def other(rng):
        return moe_token(rng, hidden, 4, top_k, torch.float32, first_expert=4)

    got = row_in_batches(moe_runner(functools.partial(fused_moe, batch_invariant=True), weights, first_expert=4), target, other)
    assert all_equal(got)
    want = moe_runner(fused_moe_torch, weights, first_expert=4)([target])[0]
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_w4a16_token_output_is_batch_invariant(dtype):
    experts, hidden, inter, top_k = 8, 256, 128, 4
    weights = int4_weights(experts, hidden, inter, group=32, seed=10)
    target = moe_token(random.Random(3), hidden, experts, top_k, dtype)

    def other(rng):
        return moe_token(rng, hidden, experts, top_k, dtype)

    got = row_in_batches(moe_runner(functools.partial(fused_moe_w4a16, batch_invariant=True), weights), target, other, layouts=MOE_LAYOUTS)
    assert all_equal(got)
    plain = row_in_batches(moe_runner(fused_moe_w4a16_torch, weights), target, other, layouts=MOE_LAYOUTS)
    if dtype == torch.float32:
        assert not all_equal(plain), "the default W4A16 MoE was expected to vary with the batch"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0], plain[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("fp8", [True, False])
def test_fused_moe_triton_batch_invariant_launch(fp8):
    triton_or_skip()
    experts, hidden, inter, top_k = 4, 128, 128, 2
    weights = moe_weights(experts, hidden, inter, fp8=fp8, seed=11)
    if fp8:  # fp32 containers of the fp8 values for the interpreter
        weights = dict(weights, w13=weights["w13"].float(), w2=weights["w2"].float())
    target = moe_token(random.Random(4), hidden, experts, top_k, torch.float32)

    def other(rng):
        return moe_token(rng, hidden, experts, top_k, torch.float32)

    def run(x, w13, w2, topk, ids, first, **rest):
        return fused_moe_triton(x, w13, w2, topk, ids, first, batch_invariant=True, **rest)

    got = row_in_batches(moe_runner(run, weights), target, other, layouts=[(0, 0), (3, 2), (17, 5), (40, 40)])
    assert all_equal(got)
    torch.testing.assert_close(got[0], moe_runner(fused_moe_torch, weights)([target])[0], rtol=1e-4, atol=1e-4)


def test_fused_moe_w4a16_triton_batch_invariant_launch():
    triton_or_skip()
    experts, hidden, inter, top_k = 4, 128, 64, 2
    weights = int4_weights(experts, hidden, inter, group=32, seed=12)
    target = moe_token(random.Random(5), hidden, experts, top_k, torch.float32)

    def other(rng):
        return moe_token(rng, hidden, experts, top_k, torch.float32)

    def run(x, w13, w2, topk, ids, first, **rest):
        return fused_moe_w4a16_triton(x, w13, w2, topk, ids, first, batch_invariant=True, **rest)

    got = row_in_batches(moe_runner(run, weights), target, other, layouts=[(0, 0), (3, 2), (17, 5), (40, 40)])
    assert all_equal(got)
    want = moe_runner(fused_moe_w4a16_torch, weights)([target])[0]
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)


# --- MLA decode ---------------------------------------------------------------------------------------------

HEADS, LATENT, ROPE, BLOCK = 8, 64, 32, 16


def mla_cache(num_blocks=96, seed=13):
    return torch.randn(num_blocks, BLOCK, LATENT + ROPE, generator=torch.Generator().manual_seed(seed)) * 0.5


def mla_row(rng, num_blocks, max_context=600):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    context = rng.randint(1, max_context)
    table = torch.randperm(num_blocks, generator=gen)[: -(-context // BLOCK)].to(torch.int32)
    return torch.randn(HEADS, LATENT, generator=gen), torch.randn(HEADS, ROPE, generator=gen), table, context


def mla_batch(rows):
    width = max(r[2].shape[0] for r in rows)
    tables = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        tables[i, : r[2].shape[0]] = r[2]
    lens = torch.tensor([r[3] for r in rows], dtype=torch.int32)
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), tables, lens


def test_mla_decode_rows_are_batch_invariant_and_close_to_the_default():
    cache = mla_cache()
    target = mla_row(random.Random(6), cache.shape[0])

    def run(rows):
        q_lat, q_pe, tables, lens = mla_batch(rows)
        return mla_decode_batch_invariant(q_lat, q_pe, cache, tables, lens, 0.2)

    def default(rows, chunk_elements):
        q_lat, q_pe, tables, lens = mla_batch(rows)
        return mla_decode_torch(q_lat, q_pe, cache, tables, lens, 0.2, chunk_elements=chunk_elements)

    def other(rng):
        return mla_row(rng, cache.shape[0])

    got = row_in_batches(run, target, other)
    assert all_equal(got)
    # the default path walks the context in chunks sized by the batch: its merge points move
    plain = row_in_batches(lambda rows: default(rows, 1 << 16), target, other)
    assert not all_equal(plain)
    torch.testing.assert_close(got[0], plain[0], rtol=1e-5, atol=1e-5)


def test_mla_prefill_rows_sharing_a_table_equal_decode_rows():
    """The query tokens of one prefill (one block table, contexts 1..L) give what each gives as a decode row."""
    cache = mla_cache(seed=14)
    rng = random.Random(7)
    length = 300
    table = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(8))[: -(-length // BLOCK)]
    q_lat = torch.randn(length, HEADS, LATENT, generator=torch.Generator().manual_seed(9))
    q_pe = torch.randn(length, HEADS, ROPE, generator=torch.Generator().manual_seed(10))
    contexts = list(range(1, length + 1))
    lens = torch.tensor(contexts, dtype=torch.int32)
    out, lse = mla_decode_batch_invariant(
        q_lat, q_pe, cache, table[None].to(torch.int32), lens, 0.2, return_lse=True,
        row_table=[0] * length, row_context=contexts,
    )
    for pos in (0, 17, 127, 128, 255, 256, 299):
        rows = [mla_row(rng, cache.shape[0]) for _ in range(5)]
        rows.insert(2, (q_lat[pos], q_pe[pos], table[: -(-(pos + 1) // BLOCK)].to(torch.int32), pos + 1))
        q_l, q_p, tables, ctx = mla_batch(rows)
        alone, alone_lse = mla_decode_batch_invariant(q_l, q_p, cache, tables, ctx, 0.2, return_lse=True)
        assert torch.equal(alone[2], out[pos]) and torch.equal(alone_lse[2], lse[pos])
    want = mla_decode_torch(q_lat[-1:], q_pe[-1:], cache, table[None].to(torch.int32), lens[-1:], 0.2)
    torch.testing.assert_close(out[-1:], want, rtol=1e-5, atol=1e-5)


def test_mla_decode_triton_batch_invariant_launch(monkeypatch):
    """The Triton branch (forced on CPU tensors: the interpreter) uses one split count whatever the batch;
    the default launch's split count follows the batch."""
    triton_or_skip()
    import kserve.kernels.mla_decode as mla

    monkeypatch.setattr(mla, "triton_runs", lambda device, fp8=False: True)
    cache = mla_cache(num_blocks=32, seed=15)
    target = mla_row(random.Random(8), cache.shape[0], max_context=200)

    def other(rng):
        return mla_row(rng, cache.shape[0], max_context=200)

    def run(rows):
        q_lat, q_pe, tables, lens = mla_batch(rows)
        return mla_decode_batch_invariant(q_lat, q_pe, cache, tables, lens, 0.2)

    layouts = [(0, 0), (3, 1), (17, 17)]
    got = row_in_batches(run, target, other, layouts=layouts)
    assert all_equal(got)
    q_lat, q_pe, tables, lens = mla_batch([target])
    want = mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.2, num_splits=BATCH_INVARIANT_NUM_SPLITS)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[0], mla_decode_torch(q_lat, q_pe, cache, tables, lens, 0.2)[0], rtol=1e-5, atol=1e-5)


# --- the engine -------------------------------------------------------------------------------------------------

GEN = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 8}


def make_llm(model_dir, **knobs):
    from kserve.engine.llm import LLM

    knobs = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 512, "max_num_batched_tokens": 256, **knobs}
    return LLM(model=str(model_dir), **knobs)


def prompts(seed, count, vocab, lo=4, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 300) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def fingerprint(output):
    """Greedy tokens and every logprob (the chosen one and the top 8) of a completion."""
    completion = output.outputs[0]
    return completion.token_ids, [(lp.token_id, lp.logprob, sorted(lp.top.items())) for lp in completion.logprobs]


def target_in_batches(llm, target, others, params, layouts):
    from kserve.engine.sampling_params import SamplingParams

    results = []
    for count, position in layouts:
        batch = list(others[:count])
        batch.insert(position, target)
        outs = llm.generate(batch, SamplingParams(**params), use_tqdm=False)
        results.append(fingerprint(outs[position]))
    return results


ENGINE_LAYOUTS = [(0, 0), (1, 1), (3, 2), (17, 9), (40, 40)]


@pytest.fixture(scope="module")
def k2_invariant(tiny_k2_dir):
    llm = make_llm(tiny_k2_dir, batch_invariant=True)
    yield llm
    llm.shutdown()


def test_llm_fp8_request_is_batch_invariant(k2_invariant):
    vocab = k2_invariant.engine.model_config.vocab_size
    target, *others = prompts(0, 41, vocab)
    results = target_in_batches(k2_invariant, target, others, GEN, ENGINE_LAYOUTS)
    assert all(r == results[0] for r in results[1:]), "a request's tokens / logprobs changed with its batch"


def test_llm_default_mode_is_batch_variant(tiny_k2_dir, k2_invariant):
    """The same request in the default mode changes its logprobs (here even its greedy tokens: FP8
    activation quantization turns last-bit differences into whole rounding steps) with the batch, so the
    test above can fail."""
    vocab = k2_invariant.engine.model_config.vocab_size
    target, *others = prompts(0, 41, vocab)
    llm = make_llm(tiny_k2_dir)
    try:
        results = target_in_batches(llm, target, others, GEN, [(0, 0), (17, 9), (40, 40)])
    finally:
        llm.shutdown()
    assert any(r != results[0] for r in results[1:]), "the default mode was expected to vary with the batch here"


def test_llm_int4_request_is_batch_invariant_and_close_to_the_default(tiny_k25_dir):
    """INT4 experts (W4A16: no activation quantization), so the two modes can be compared closely: the
    invariant mode's logprobs are the default's up to fp32 rounding (absorbed vs decompressed prefill
    attention, another silu formula, other GEMM blockings)."""
    llm = make_llm(tiny_k25_dir, batch_invariant=True)
    try:
        vocab = llm.engine.model_config.vocab_size
        target, *others = prompts(2, 41, vocab)
        results = target_in_batches(llm, target, others, GEN, [(0, 0), (3, 1), (17, 17), (40, 13)])
    finally:
        llm.shutdown()
    assert all(r == results[0] for r in results[1:])
    default = make_llm(tiny_k25_dir)
    try:
        alone = target_in_batches(default, target, others, GEN, [(0, 0)])[0]
    finally:
        default.shutdown()
    assert alone[0] == results[0][0]
    for (tok, lp, top), (tok_d, lp_d, top_d) in zip(results[0][1], alone[1]):
        assert tok == tok_d and abs(lp - lp_d) < 1e-4
        assert [t for t, _ in top] == [t for t, _ in top_d]


def test_llm_invariant_under_prefill_chunking_and_prefix_cache(tiny_k2_dir, k2_invariant):
    """A long prompt chunked at other boundaries (another token budget), and served partly from the prefix
    cache after a request that shares its start, gives the same logprobs."""
    vocab = k2_invariant.engine.model_config.vocab_size
    (long_prompt,) = prompts(5, 1, vocab, lo=300, hi=300)
    from kserve.engine.sampling_params import SamplingParams

    params = SamplingParams(**GEN)
    want = fingerprint(k2_invariant.generate([long_prompt], params, use_tqdm=False)[0])
    other = make_llm(tiny_k2_dir, batch_invariant=True, max_num_batched_tokens=97)
    try:
        first = other.generate([long_prompt[:200] + [11, 12]], params, use_tqdm=False)  # fills the prefix cache
        got = other.generate([long_prompt], params, use_tqdm=False)[0]
    finally:
        other.shutdown()
    assert got.num_cached_tokens > 0 and first
    assert fingerprint(got) == want


def test_llm_invariant_under_preemption(tiny_k2_dir, k2_invariant):
    """A KV cache too small for the batch: sequences are preempted and recomputed (their decoded tokens go
    through prefill), and the last-admitted request still gets the logprobs it gets alone."""
    from kserve.engine.sampling_params import SamplingParams

    vocab = k2_invariant.engine.model_config.vocab_size
    target, *others = prompts(6, 18, vocab, lo=30, hi=40)
    params = SamplingParams(**dict(GEN, max_tokens=24))
    want = fingerprint(k2_invariant.generate([target], params, use_tqdm=False)[0])
    small = make_llm(tiny_k2_dir, batch_invariant=True, num_kv_blocks=30)
    try:
        got = small.generate([*others, target], params, use_tqdm=False)[-1]
        assert small.engine.stats().num_preemptions > 0
    finally:
        small.shutdown()
    assert fingerprint(got) == want


def test_llm_seeded_sampling_is_batch_invariant(k2_invariant):
    vocab = k2_invariant.engine.model_config.vocab_size
    target, *others = prompts(1, 18, vocab)
    params = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7, "max_tokens": 8, "ignore_eos": True,
              "logprobs": 2}
    results = target_in_batches(k2_invariant, target, others, params, [(0, 0), (5, 3), (17, 17)])
    assert all(r == results[0] for r in results[1:])


@pytest.mark.parametrize("knobs", [{"dtype": "bfloat16"}, {"kv_cache_dtype": "fp8"}], ids=["bf16", "fp8-kv-cache"])
def test_llm_bf16_and_fp8_kv_cache_requests_are_batch_invariant(tiny_k2_dir, knobs):
    llm = make_llm(tiny_k2_dir, batch_invariant=True, **knobs)
    try:
        vocab = llm.engine.model_config.vocab_size
        target, *others = prompts(4, 41, vocab)
        results = target_in_batches(llm, target, others, GEN, [(0, 0), (17, 9), (40, 40)])
    finally:
        llm.shutdown()
    assert all(r == results[0] for r in results[1:])


def test_llm_tensor_parallel_request_is_batch_invariant(tiny_k2_dir):
    """Two gloo ranks: the row-parallel and MoE sums add the ranks' parts in rank order, so a request's
    logprobs stay fixed across batches at TP 2 too."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is unavailable")
    llm = make_llm(tiny_k2_dir, batch_invariant=True, tensor_parallel_size=2, num_kv_blocks=128)
    try:
        vocab = llm.engine.model_config.vocab_size
        target, *others = prompts(3, 18, vocab)
        results = target_in_batches(llm, target, others, dict(GEN, max_tokens=4), [(0, 0), (17, 9)])
    finally:
        llm.shutdown()
    assert results[0] == results[1]


def test_set_batch_invariant_reaches_every_layer_that_has_a_mode(k2_invariant):
    model = k2_invariant.engine.runner.model if hasattr(k2_invariant.engine, "runner") else None
    if model is None:
        pytest.skip("the engine keeps its model elsewhere")
    flags = {type(m).__name__: m.batch_invariant for m in model.modules() if hasattr(m, "batch_invariant")}
    assert {"MLAttention", "ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear", "LMHead", "GatedMLP",
            "NoAuxRouter", "RoutedExperts", "DeepseekMoE"} <= set(flags)
    assert all(flags.values())
