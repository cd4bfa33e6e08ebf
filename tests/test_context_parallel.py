"""Decode context parallelism (the KV cache sharded by token over tensor-parallel ranks) and long-context
prefill in bounded chunks: kernels, the merge, the model and the engine over two gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from kserve.config import EngineConfig
from kserve.distributed import ContextParallelGroup
from kserve.kernels.mla_decode import mla_decode_torch, mla_decode_triton
from kserve.layers.mla_attention import attention_with_lse, merge_attention_states, write_latents
from kserve.model import ForwardBatch, load_model
from kserve.model.forward_batch import local_slots, slot_of

C, R = 64, 16  # latent and rope widths of the kernel tests


def _reference_decode(q_lat, q_pe, rows, scale):
    """Plain softmax attention of each head over one sequence's latent rows [S, C + R]: (out [H, C], lse [H])."""
    scores = torch.cat([q_lat, q_pe], dim=-1).double() @ rows.double().T * scale
    return (torch.softmax(scores, dim=-1) @ rows[:, :C].double()).float(), torch.logsumexp(scores, dim=-1).float()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_lse_matches_reference(num_splits) -> None:
    """Triton (interpreter) and torch both return the log-sum-exp the merge needs; empty rows give -inf."""
    gen = torch.Generator().manual_seed(0)
    batch, heads, block = 3, 4, 4
    cache = torch.randn(24, block, C + R, generator=gen)
    tables = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, -1, -1], [8, 9, 10, 11, 12]], dtype=torch.int32)
    lens = torch.tensor([17, 9, 0], dtype=torch.int32)
    q_lat, q_pe = torch.randn(batch, heads, C, generator=gen), torch.randn(batch, heads, R, generator=gen)
    out, lse = mla_decode_torch(q_lat, q_pe, cache, tables, lens, 0.2, return_lse=True)
    tri_out, tri_lse = mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.2, num_splits=num_splits, return_lse=True)
    for b in range(2):
        rows = torch.stack([cache[tables[b, t // block], t % block] for t in range(int(lens[b]))])
        ref_out, ref_lse = _reference_decode(q_lat[b], q_pe[b], rows, 0.2)
        torch.testing.assert_close(out[b], ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b], ref_lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tri_out[b], ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tri_lse[b], ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(lse[2]).all() and torch.isneginf(tri_lse[2]).all()
    assert not out[2].any() and not tri_out[2].any()


@pytest.mark.parametrize("dcp", [2, 3, 4])
def test_sharded_cache_merges_to_whole_attention(dcp) -> None:
    """Each group rank writes the tokens it holds through `local_slots`, decodes over its own share, and the
    LSE merge of the shares equals attention over the whole context (lengths that do not split evenly,
    blocks that span the split, a context shorter than the group)."""
    gen = torch.Generator().manual_seed(dcp)
    block, heads, num_blocks = 4, 3, 12
    virtual = block * dcp
    lengths = [37, 2, 4 * virtual + 1]
    tables = [[5, 0, 7, 2, 9], [3], [1, 4, 6, 8, 10, 11]]
    latents = [torch.randn(n, C + R, generator=gen) for n in lengths]
    q_lat, q_pe = torch.randn(3, heads, C, generator=gen), torch.randn(3, heads, R, generator=gen)
    width = max(map(len, tables))
    table_tensor = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)

    merged_out = merged_lse = None
    for rank in range(dcp):
        group = ContextParallelGroup(dcp, rank, collectives=False)
        cache = torch.zeros(num_blocks + 1, block, C + R)
        scratch = num_blocks * block
        for table, rows in zip(tables, latents):
            slots = torch.tensor([slot_of(table, p, virtual) for p in range(rows.shape[0])]).numpy()
            write_latents(cache, torch.from_numpy(local_slots(slots, block, group, scratch)), rows)
        lens = torch.tensor([group.local_len(n) for n in lengths], dtype=torch.int32)
        out, lse = mla_decode_torch(q_lat, q_pe, cache, table_tensor, lens, 0.3, return_lse=True)
        if merged_out is None:
            merged_out, merged_lse = out, lse
        else:
            merged_out, merged_lse = merge_attention_states(merged_out, merged_lse, out, lse)
    assert sum(ContextParallelGroup(dcp, r).local_len(2) for r in range(dcp)) == 2
    for b, rows in enumerate(latents):
        ref_out, ref_lse = _reference_decode(q_lat[b], q_pe[b], rows, 0.3)
        torch.testing.assert_close(merged_out[b], ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged_lse[b], ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_lse_paths_agree(causal) -> None:
    """The CPU flash kernel (same dtypes) and the tiled torch path (mixed dtypes) give SDPA's output and
    the scores' log-sum-exp."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(300, 4, 24, generator=gen), torch.randn(300, 4, 24, generator=gen)
    v = torch.randn(300, 4, 16, generator=gen)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.2
    if causal:
        scores = scores.masked_fill(torch.ones(300, 300, dtype=torch.bool).triu(1), float("-inf"))
    ref_lse = torch.logsumexp(scores, dim=-1).T
    ref_out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    for out, lse in (attention_with_lse(q, k, v, 0.2, causal), attention_with_lse(q, k, v.double(), 0.2, causal)):
        torch.testing.assert_close(out.float(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_long_context_prefill_in_bounded_chunks(tiny_k2_dir) -> None:
    """A prefill chunk over a cached context 20x the chunk budget: the same logits as one unchunked
    attention, and no layer ever decompresses more than the budget (or the chunk's own new tokens)."""
    model = load_model(tiny_k2_dir, weights="dequantized")
    c, block, budget, new = model.config, 16, 16, 12
    cached = 20 * budget
    ids = torch.randint(0, c.vocab_size, (cached + new,), generator=torch.Generator().manual_seed(3))
    rows_decompressed: list[int] = []
    hooks = [layer.self_attn.kv_b_proj.register_forward_hook(lambda m, i, o: rows_decompressed.append(o.shape[0]))
             for layer in model.model.layers]

    def last_chunk_logits(chunk_tokens: int) -> torch.Tensor:
        cache = torch.zeros(c.num_hidden_layers, 24, block, c.kv_cache_dim)
        model(ids[:cached], ForwardBatch.contiguous([cached], [cached], block), cache)
        rows_decompressed.clear()
        # row_query_max_len=0: 12 new tokens would otherwise attend as absorbed rows (the next test)
        batch = ForwardBatch.contiguous([new], [cached + new], block, context_chunk_tokens=chunk_tokens,
                                        row_query_max_len=0)
        assert (batch.prefill.context_chunks is None) == (chunk_tokens >= cached + new)
        return model.compute_logits(model(ids[cached:], batch, cache))

    try:
        whole = last_chunk_logits(1 << 20)
        assert max(rows_decompressed) == cached + new
        chunked = last_chunk_logits(budget)
        assert max(rows_decompressed) <= max(budget, new)
        assert len(rows_decompressed) == c.num_hidden_layers * (1 + cached // budget)
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(chunked, whole, atol=2e-5, rtol=1e-4)
    assert torch.equal(chunked.argmax(-1), whole.argmax(-1))


def test_a_few_tokens_after_a_cached_prefix_attend_as_absorbed_rows(tiny_k2_dir) -> None:
    """A speculative verify (a few new tokens on each of several cached sequences) takes the absorbed
    decode rows: the logits of the decompressing prefill path, with no context through kv_b_proj. A fresh
    prompt, or more new tokens than ROW_QUERY_MAX_LEN, keeps the prefill path."""
    from kserve.model.forward_batch import ROW_QUERY_MAX_LEN

    model = load_model(tiny_k2_dir, weights="dequantized")
    c, block = model.config, 16
    cached, new = [37, 5, 64], [4, 2, 3]
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, c.vocab_size, (k + n,), generator=gen) for k, n in zip(cached, new)]
    decompressed: list[int] = []
    hooks = [layer.self_attn.kv_b_proj.register_forward_hook(lambda m, i, o: decompressed.append(o.shape[0]))
             for layer in model.model.layers]

    def verify_logits(row_query_max_len: int) -> torch.Tensor:
        cache = torch.zeros(c.num_hidden_layers, 3 * 5, block, c.kv_cache_dim)
        prefix = ForwardBatch.contiguous(cached, cached, block)
        model(torch.cat([x[:k] for x, k in zip(ids, cached)]), prefix, cache)
        decompressed.clear()
        totals = [k + n for k, n in zip(cached, new)]
        batch = ForwardBatch.contiguous(new, totals, block, row_query_max_len=row_query_max_len)
        assert (batch.prefill.row_block_tables is not None) == (row_query_max_len >= max(new))
        return model.compute_logits(model(torch.cat([x[k:] for x, k in zip(ids, cached)]), batch, cache))

    try:
        rows = verify_logits(ROW_QUERY_MAX_LEN)
        assert decompressed == []
        prefill = verify_logits(0)
        assert decompressed
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(rows, prefill, atol=2e-5, rtol=1e-4)
    assert torch.equal(rows.argmax(-1), prefill.argmax(-1))
    assert ForwardBatch.contiguous([4], [4], block).prefill.row_block_tables is None  # a fresh prompt
    too_many = ROW_QUERY_MAX_LEN + 1
    assert ForwardBatch.contiguous([too_many], [too_many + 8], block).prefill.row_block_tables is None


@pytest.mark.parametrize(("tp", "dcp", "words"), [(2, 3, "3 does not divide --tensor-parallel-size 2"),
                                                   (1, 2, "--tensor-parallel-size is 1"),
                                                   (4, 0, "at least 1, got 0")])
def test_bad_context_parallel_sizes_fail_at_start(tp, dcp, words) -> None:
    with pytest.raises(ValueError, match=words):
        EngineConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    result = subprocess.run(
        [sys.executable, "-m", "kserve.cli", "serve", "--tp", str(tp), "-dcp", str(dcp), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert words in result.stderr and "Traceback" not in result.stderr


def test_plan_reports_dcp_capacity() -> None:
    def plan(dcp: int) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "kserve.cli", "plan", "configs/kimi-k2-instruct.json", "--tp", "8",
             "--gpu-memory-gib", "140", "--decode-context-parallel-size", str(dcp), "--json"],
            capture_output=True, text=True, timeout=300, check=True,
        )
        return json.loads(out.stdout)

    one, eight = plan(1), plan(8)
    assert eight["decode_context_parallel_size"] == 8
    assert eight["kv_cache_bytes"] == one["kv_cache_bytes"] > 0  # the same memory per rank ...
    assert eight["kv_tokens"] == 8 * one["kv_tokens"]  # ... holds eight times the tokens
    assert eight["activation_reserve_bytes"] > 0 and eight["overhead_bytes"] > 0
    assert eight["concurrent_seqs_at_max_model_len"] >= one["concurrent_seqs_at_max_model_len"]


@pytest.fixture(scope="module")
def dense_tiny_dir(tiny_k2_dir, tmp_path_factory):
    from kserve.model.loader import write_dequantized_checkpoint

    return write_dequantized_checkpoint(tiny_k2_dir, tmp_path_factory.mktemp("dense") / "k2")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is unavailable")
def test_tp2_dcp2_engine_gives_tp2_greedy_tokens(dense_tiny_dir) -> None:
    """Two gloo ranks, each holding every other token. Prompts share a 70-token prefix (prefix-cache hits)
    and span many 4-token blocks on each rank; the DCP run has half the blocks (the same tokens), so it
    preempts, and a 6-token context chunk makes long prefills gather their context in pieces."""
    from kserve.engine.llm import LLM
    from kserve.engine.sampling_params import SamplingParams

    shared = [7 + (5 * i) % 1700 for i in range(70)]
    prompts = [shared + [11 + 3 * i for i in range(n)] for n in (3, 29, 50)]
    prompts += [[5 + i for i in range(37)], shared + [99, 98, 97], [400]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    knobs = {"model": str(dense_tiny_dir), "dtype": "float32", "device": "cpu", "tensor_parallel_size": 2,
             "max_num_batched_tokens": 32, "block_size": 4}
    with LLM(num_kv_blocks=64, **knobs) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(num_kv_blocks=20, decode_context_parallel_size=2, context_chunk_tokens=6, **knobs) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats()
        assert llm.engine.block_manager.block_size == 8  # a block spans both ranks
    assert got == expected
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.num_preemptions > 0
    assert not dist.is_initialized()
