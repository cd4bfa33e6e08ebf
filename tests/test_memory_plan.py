"""`kserve plan` and the KV-cache arithmetic: Kimi K2 built on the meta device for rank 0 of 8."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from kserve.cli import main
from kserve.config import ModelConfig
from kserve.model.deepseek_v3 import kv_cache_bytes_per_token
from kserve.model.memory_plan import (
    GIB,
    build_meta_model,
    kv_blocks_for_budget,
    kv_cache_budget_bytes,
    plan_memory,
    tensor_bytes,
)
from kserve.model.weights_layout import FP8, checkpoint_tensors

K2 = Path(__file__).resolve().parents[1] / "configs" / "kimi-k2-instruct.json"


@pytest.fixture(scope="module")
def k2_config() -> ModelConfig:
    return ModelConfig.from_dict(json.loads(K2.read_text()))


@pytest.fixture(scope="module")
def k2_rank0_of_8(k2_config):
    return build_meta_model(k2_config, tp_size=8, tp_rank=0, dtype=torch.bfloat16)


def expected_rank_bytes(config: ModelConfig, tp: int) -> int:
    """Rank 0's parameter bytes, counted from the checkpoint's tensor list (not from the model):
    FP8 tensors 1 byte + fp32 scales, split 1/tp when tensor-parallel, routed experts 1/tp of them;
    kv_b_proj dequantized to bf16; norms, embedding and LM head bf16; the router fp32."""
    replicated = (".q_a_proj.", ".kv_a_proj_with_mqa.")
    total = 0
    for spec in checkpoint_tensors(config):
        n = 1
        for d in spec.shape:
            n *= d
        name = spec.name
        if ".kv_b_proj." in name:
            total += n // tp * 2
        elif spec.kind == FP8:
            rows, cols = spec.shape
            scales = -(-rows // 128) * -(-cols // 128)
            share = 1 if any(r in name for r in replicated) else tp
            total += n // share + scales * 4 // share
        elif ".mlp.gate." in name:
            total += n * 4
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            total += n // tp * 2
        else:
            total += n * 2
    # routed experts: rank 0 holds n_routed_experts / tp of them, the loop above counted them / tp already
    return total


def test_budget_arithmetic_with_numbers():
    # 140 GiB at 0.9 = 126 GiB; minus 121 GiB of weights, 2 GiB of activations, 1 GiB overhead = 2 GiB
    budget = kv_cache_budget_bytes(140 * GIB, 0.9, 121 * GIB, 2 * GIB, 1 * GIB)
    assert budget == 2 * GIB
    assert kv_blocks_for_budget(budget, bytes_per_token=70272, block_size=16) == 2 * GIB // (70272 * 16)
    assert kv_blocks_for_budget(budget, 70272, 16, reserved_blocks=1) == 2 * GIB // (70272 * 16) - 1
    assert kv_blocks_for_budget(-5, 70272, 16) == 0


def test_k2_rank0_of_8_bytes_match_the_plan_and_the_checkpoint_list(k2_config, k2_rank0_of_8):
    model = k2_rank0_of_8
    walked = tensor_bytes(model)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert walked - buffers == expected_rank_bytes(k2_config, 8)
    plan = plan_memory(k2_config, 8, 140 * GIB)
    assert plan.weights_per_rank_bytes == walked == plan.weights_max_rank_bytes
    print(f"K2 rank 0 of 8: {walked:,} B = {walked / GIB:.2f} GiB")
    assert 115 * GIB < walked < 125 * GIB  # ~1 TB of FP8 over 8 ranks


def test_k2_no_fp8_weight_has_a_twin(k2_rank0_of_8):
    model = k2_rank0_of_8
    fp8_modules = 0
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        fp8 = {n for n, t in own.items() if t.dtype == torch.float8_e4m3fn}
        if not fp8:
            continue
        fp8_modules += 1
        others = {n: t.dtype for n, t in own.items() if n not in fp8}
        assert others == {f"{n}_scale_inv": torch.float32 for n in fp8}, name
    assert fp8_modules > 60 * 8
    # every weight the checkpoint stores as FP8 is FP8 here, kv_b_proj (kept dequantized) excepted
    params = dict(model.named_parameters())
    for spec in checkpoint_tensors(model.config):
        if spec.kind != FP8 or ".experts." in spec.name:
            continue
        want = torch.bfloat16 if ".kv_b_proj." in spec.name else torch.float8_e4m3fn
        assert params[spec.name].dtype == want, spec.name
    for layer in model.model.layers[1:]:
        assert layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert layer.mlp.experts.gate_up_proj.shape == (48, 4096, 7168)
    # K2 splits on 128 boundaries at TP 8: no padded shard anywhere
    assert not any(getattr(m, "pad_out", 0) or getattr(m, "pad_in", 0) for m in model.modules())
    assert sum(b.numel() * b.element_size() for b in model.buffers()) < 1 << 20


def test_kserve_plan_cli_json(k2_config, k2_rank0_of_8):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", str(K2), "--tp", "8", "--gpu-memory-gib", "140", "--json", "--kv-cache-dtype", "fp8",
                   "--max-model-len", "8192"])
    assert rc == 0
    plan = json.loads(out.getvalue())
    assert plan["weights_per_rank_bytes"] == tensor_bytes(k2_rank0_of_8)
    assert plan["kv_bytes_per_token"] == 61 * 576 == kv_cache_bytes_per_token(k2_config, torch.float8_e4m3fn)
    assert plan["kv_tokens"] > 8192 and plan["fits"] is True
    assert plan["concurrent_seqs_at_max_model_len"] == plan["kv_tokens"] // 8192
    usable = int(140 * GIB * 0.9)
    assert plan["kv_cache_bytes"] == usable - plan["weights_max_rank_bytes"] - plan["activation_reserve_bytes"] - plan["overhead_bytes"]


def test_plan_explains_what_does_not_fit(k2_config):
    plan = plan_memory(k2_config, 8, 80 * GIB)
    assert not plan.fits and "weights alone" in plan.why and "per rank" in plan.why
    full_context = plan_memory(k2_config, 8, 140 * GIB, kv_cache_dtype="auto")
    assert not full_context.fits and "fewer than one 131,072-token sequence" in full_context.why
    with pytest.raises(ValueError, match="num_attention_heads = 64 .* 7"):
        plan_memory(k2_config, 7, 140 * GIB)


def test_rank0_runs_a_profiling_forward_alone(tiny_k2_dir):
    """The engine profiles memory on rank 0 only: with its collectives stubbed, a rank-0-of-2 model
    (no process group at all) runs a whole step, logits included, with full-size outputs."""
    from kserve.distributed import ParallelState
    from kserve.engine.model_runner import local_collectives
    from kserve.model import ForwardBatch, load_model

    model = load_model(tiny_k2_dir, parallel=ParallelState(0, 2))
    c = model.config
    cache = torch.zeros(c.num_hidden_layers, 2, 16, c.kv_cache_dim)
    with local_collectives(model):
        hidden = model(torch.arange(20), ForwardBatch.contiguous([20], [20], 16), cache)
        logits = model.compute_logits(hidden[-3:])
    assert logits.shape == (3, c.vocab_size) and hidden.shape == (20, c.hidden_size)
    assert all(m.parallel.collectives for m in model.modules() if hasattr(m, "parallel"))


def test_cpu_cache_blocks_from_the_byte_budget():
    from kserve.config import EngineConfig
    from kserve.engine.model_runner import num_kv_blocks_for

    config = EngineConfig(kv_cache_cpu_bytes=1 << 20, block_size=16)
    # 1 MiB / (1000 B x 16) = 65 blocks, one of them the runner's scratch block
    assert num_kv_blocks_for(config, 1000, torch.device("cpu")) == 64
    assert num_kv_blocks_for(EngineConfig(num_kv_blocks=7), 1000, torch.device("cpu")) == 7


def test_k2_splits_on_block_boundaries_at_tp_8_and_16(k2_config):
    """Every rank of K2 at TP 8 and 16 starts each split on a 128 boundary (no padded FP8 shard) and
    holds a whole vocabulary shard."""
    from kserve.model.memory_plan import _rank_signature

    for tp in (8, 16):
        signatures = {_rank_signature(k2_config, tp, rank) for rank in range(tp)}
        assert signatures == {((0, 0, 0, 0), k2_config.vocab_size // tp)}, tp


def test_gpu_block_count_from_a_profile():
    """The CUDA branch's arithmetic, with a measured profile given (no GPU needed)."""
    from kserve.config import EngineConfig
    from kserve.engine.model_runner import (
        CUDA_GRAPH_RESERVE_BYTES,
        MemoryProfile,
        num_kv_blocks_for,
    )

    cuda = torch.device("cuda")
    profile = MemoryProfile(total_bytes=140 * GIB, weights_bytes=121 * GIB, peak_activation_bytes=2 * GIB,
                            non_torch_bytes=GIB)
    eager = EngineConfig(gpu_memory_utilization=0.9, enforce_eager=True, block_size=16)
    assert num_kv_blocks_for(eager, 70272, cuda, profile) == 2 * GIB // (70272 * 16) - 1
    graphs = EngineConfig(gpu_memory_utilization=0.9, block_size=16)
    assert num_kv_blocks_for(graphs, 70272, cuda, profile) == (2 * GIB - CUDA_GRAPH_RESERVE_BYTES) // (70272 * 16) - 1
    with pytest.raises(ValueError, match="no room for the KV cache: 0.85 x 140.00 GiB"):
        num_kv_blocks_for(EngineConfig(gpu_memory_utilization=0.85, enforce_eager=True), 70272, cuda, profile)


def test_profile_memory_runs_its_forward(tiny_k2_dir, monkeypatch):
    """profile_memory's own steps (scratch cache, one prefill of max_num_batched_tokens over a cached
    prefix of one context chunk, the LM head, rank 0 alone under TP) on the CPU, with torch.cuda's
    counters faked."""
    from kserve.config import EngineConfig
    from kserve.distributed import ParallelState
    from kserve.engine import model_runner
    from kserve.model import load_model

    c = ModelConfig.from_model_dir(tiny_k2_dir)
    cache_bytes = c.num_hidden_layers * 4 * 16 * c.kv_cache_dim * 4  # ceil((40 + 24) / 16) blocks, fp32
    counters = iter([1000, 1000 + cache_bytes + 777])  # memory_allocated before, max_memory_allocated after
    fake = {
        "synchronize": lambda *a: None, "empty_cache": lambda: None, "reset_peak_memory_stats": lambda *a: None,
        "memory_allocated": lambda *a: next(counters), "max_memory_allocated": lambda *a: next(counters),
        "mem_get_info": lambda *a: (60_000, 100_000), "memory_reserved": lambda *a: 30_000,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    model = load_model(tiny_k2_dir, parallel=ParallelState(0, 2))
    config = EngineConfig(max_num_batched_tokens=40, max_num_seqs=4, block_size=16, context_chunk_tokens=24)
    profile = model_runner.profile_memory(model, model.config, config, torch.device("cpu"), torch.float32)
    assert profile == model_runner.MemoryProfile(100_000, 1000, 777, 10_000)
