"""kserve's model against transformers' DeepseekV3ForCausalLM with the same dequantized weights (fp32, CPU).

The exact-parity tests load with weights="dequantized"; the FP8 path (the default) is compared at the end."""

import pytest
import torch

from kserve.model import ForwardBatch, KimiK2ForCausalLM, kv_cache_bytes_per_token, load_model

pytest.importorskip("transformers")
from kserve.model.hf_reference import build_hf_reference  # noqa: E402

BLOCK = 16


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def empty_cache(model: KimiK2ForCausalLM, num_blocks: int = 32) -> torch.Tensor:
    c = model.config
    return torch.zeros(c.num_hidden_layers, num_blocks, BLOCK, c.kv_cache_dim)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1792, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def k2(tiny_k2_dir):
    return load_model(tiny_k2_dir, weights="dequantized"), build_hf_reference(tiny_k2_dir)


@pytest.mark.parametrize("variant", ["k2", "v3", "k25"])
def test_prefill_parity(variant, request):
    model_dir = request.getfixturevalue(f"tiny_{variant}_dir")
    model, hf = load_model(model_dir, weights="dequantized"), build_hf_reference(model_dir)
    if variant == "v3":
        assert model.config.n_group > 1 and model.config.topk_group > 1
    ids = prompt(45, seed=1)
    logits = model.compute_logits(model(ids, ForwardBatch.contiguous([45], [45], BLOCK), empty_cache(model)))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    err = max_rel_err(logits, ref)
    print(f"{variant} prefill max rel err {err:.3e}")
    assert logits.dtype == torch.float32 and logits.shape == (45, model.config.vocab_size)
    assert err <= 1e-4


@pytest.mark.parametrize(("variant", "weights"), [("k2", "dequantized"), ("v3", "dequantized"), ("k25", "quantized")])
def test_decode_parity_32_steps(variant, weights, request):
    """K2.6's INT4 experts run packed (W4A16: activations are not quantized, so in fp32 they compute what
    transformers computes on the dequantized weights)."""
    model_dir = request.getfixturevalue(f"tiny_{variant}_dir")
    model, hf = load_model(model_dir, weights=weights), build_hf_reference(model_dir)
    if variant == "k25":
        assert model.model.layers[1].mlp.experts.gate_up_proj_packed.dtype == torch.int32
    ids = prompt(20, seed=2)
    cache = empty_cache(model)
    logits = model.compute_logits(model(ids, ForwardBatch.contiguous([20], [20], BLOCK), cache))[-1]
    from transformers import DynamicCache

    hf_cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        ref = hf(ids[None], cache=hf_cache, use_cache=True).logits[0, -1]
    ours_tokens, ref_tokens, worst = [], [], 0.0
    for step in range(32):
        worst = max(worst, max_rel_err(logits, ref))
        tok, ref_tok = int(logits.argmax()), int(ref.argmax())
        ours_tokens.append(tok)
        ref_tokens.append(ref_tok)
        ctx = 21 + step
        batch = ForwardBatch.contiguous([1], [ctx], BLOCK)
        assert batch.is_decode_only
        logits = model.compute_logits(model(torch.tensor([tok]), batch, cache))[0]
        with torch.no_grad():
            ref = hf(torch.tensor([[ref_tok]]), cache=hf_cache, use_cache=True).logits[0, -1]
    print(f"{variant} decode max rel err over 32 steps {worst:.3e}; tokens {ours_tokens}")
    assert ours_tokens == ref_tokens
    assert len(set(ours_tokens)) > 1  # not a degenerate constant stream
    assert worst <= 1e-4


def test_naive_and_absorbed_paths_agree(k2):
    """The last token of a sequence computed by the naive (prefill) path and by the absorbed (decode) path."""
    model, _ = k2
    ids = prompt(30, seed=3)
    cache_a = empty_cache(model)
    naive = model.compute_logits(model(ids, ForwardBatch.contiguous([30], [30], BLOCK), cache_a))[-1]
    cache_b = empty_cache(model)
    model(ids[:29], ForwardBatch.contiguous([29], [29], BLOCK), cache_b)
    absorbed = model.compute_logits(model(ids[29:], ForwardBatch.contiguous([1], [30], BLOCK), cache_b))[0]
    err = max_rel_err(absorbed, naive)
    print(f"naive vs absorbed max rel err {err:.3e}")
    assert err <= 1e-5
    torch.testing.assert_close(cache_a, cache_b, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_and_mixed_batch_match_single_sequences(k2):
    model, _ = k2
    a, b = prompt(37, seed=4), prompt(12, seed=5)
    # reference: each sequence alone, in one prefill
    ref_a = model.compute_logits(model(a, ForwardBatch.contiguous([37], [37], BLOCK), empty_cache(model)))
    ref_b = model.compute_logits(model(b, ForwardBatch.contiguous([12], [12], BLOCK), empty_cache(model)))
    # sequence a in chunks of 16, 16, 5 sharing one cache (as with chunked prefill / prefix-cache hits)
    cache = empty_cache(model)
    chunks = []
    for start, end in [(0, 16), (16, 32), (32, 37)]:
        batch = ForwardBatch.contiguous([end - start], [end], BLOCK)
        chunks.append(model.compute_logits(model(a[start:end], batch, cache)))
    assert max_rel_err(torch.cat(chunks), ref_a) <= 1e-5
    # a mixed batch: a's last token decodes while b prefills, blocks interleaved in a shared cache
    cache = empty_cache(model)
    model(a[:36], ForwardBatch.contiguous([36], [36], BLOCK, first_block=0), cache)
    batch = ForwardBatch.contiguous([1, 12], [37, 12], BLOCK, first_block=0)
    # contiguous() gives b the blocks after a's: a's table matches the one used for its prefill
    mixed = model.compute_logits(model(torch.cat([a[36:], b]), batch, cache))
    assert max_rel_err(mixed[0], ref_a[-1]) <= 1e-5
    assert max_rel_err(mixed[1:], ref_b) <= 1e-5


def test_kv_cache_bytes_per_token(k2):
    model, _ = k2
    c = model.config
    assert kv_cache_bytes_per_token(c, torch.bfloat16) == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    assert kv_cache_bytes_per_token(c, torch.float32) == 2 * kv_cache_bytes_per_token(c, torch.bfloat16)


def test_bf16_model_runs_close_to_fp32(k2, tiny_k2_dir):
    model32, _ = k2
    model16 = load_model(tiny_k2_dir, dtype=torch.bfloat16, weights="dequantized")
    ids = prompt(10, seed=6)
    cache16 = torch.zeros(model16.config.num_hidden_layers, 4, BLOCK, model16.config.kv_cache_dim, dtype=torch.bfloat16)
    l16 = model16.compute_logits(model16(ids, ForwardBatch.contiguous([10], [10], BLOCK), cache16))
    l32 = model32.compute_logits(model32(ids, ForwardBatch.contiguous([10], [10], BLOCK), empty_cache(model32)))
    assert l16.dtype == torch.float32
    # bf16 can flip a near-tie expert choice for a token, so compare per-row directions, not max error
    cos = torch.nn.functional.cosine_similarity(l16, l32, dim=-1)
    assert cos.median() > 0.99 and cos.min() > 0.8


def test_mismatched_batch_is_rejected(k2):
    model, _ = k2
    with pytest.raises(ValueError, match="input ids"):
        model(prompt(5), ForwardBatch.contiguous([4], [4], BLOCK), empty_cache(model))
    with pytest.raises(ValueError, match="kv_cache shape"):
        model(prompt(4), ForwardBatch.contiguous([4], [4], BLOCK), torch.zeros(1, 4, BLOCK, 7))


def test_fp8_path_against_transformers_fp32(k2, tiny_k2_dir):
    """The default FP8 path (FP8 weights, activations quantized per token in 1x128 groups) against
    transformers' fp32 model on the dequantized weights: only the activation quantization differs.

    The tiny model is random, so its hidden states are far from a trained model's and errors grow
    through the 4 layers (each w8a8 linear is ~2.5% off in relative norm, and the random router flips
    near-tied experts); the bounds are loose on purpose and the numbers are printed."""
    dense, hf = k2
    fp8 = load_model(tiny_k2_dir)
    assert fp8.model.layers[1].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert nbytes(fp8) < nbytes(dense)
    rel_errs, cosines, agree, total = [], [], 0, 0
    for seed in range(4):
        ids = prompt(24, seed=10 + seed)
        logits = fp8.compute_logits(fp8(ids, ForwardBatch.contiguous([24], [24], BLOCK), empty_cache(fp8)))
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        rel_errs.append(((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).median().item())
        cosines.append(torch.nn.functional.cosine_similarity(logits, ref, dim=-1).median().item())
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += ids.shape[0]
    print(
        f"fp8 vs transformers fp32: median per-row relative logit error {sum(rel_errs) / 4:.3e}, "
        f"median cosine {sum(cosines) / 4:.4f}, greedy agreement {agree}/{total} = {agree / total:.2%}"
    )
    assert max(rel_errs) < 0.6 and min(cosines) > 0.8
    assert agree / total >= 0.5
