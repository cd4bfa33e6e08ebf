"""The checkpoint loader: bad checkpoints fail naming the tensor; skipped tensors; TP shards;
FP8 kept as FP8 by default; bytes read per rank; the router bias bit-exact."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kserve.distributed import ParallelState
from kserve.model import CheckpointError, load_model

KV_A = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
EXPERT_UP = "model.layers.1.mlp.experts.3.up_proj.weight"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (works for float8, which torch.equal does not take on CPU)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def index(model_dir: Path) -> dict:
    return json.loads((model_dir / "model.safetensors.index.json").read_text())


def edit_shard(model_dir: Path, name: str, edit) -> str:
    """Apply `edit(tensors)` to the shard holding `name`; returns the shard file name."""
    file = index(model_dir)["weight_map"][name]
    tensors = load_file(str(model_dir / file))
    edit(tensors)
    save_file(tensors, str(model_dir / file), metadata={"format": "pt"})
    return file


def drop_from_index(model_dir: Path, name: str) -> None:
    idx = index(model_dir)
    del idx["weight_map"][name]
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(idx))


def test_missing_tensor_names_tensor_and_index(tiny_k2_dir, tmp_path):
    d = copy_dir(tiny_k2_dir, tmp_path / "m")
    edit_shard(d, EXPERT_UP, lambda t: t.pop(EXPERT_UP))
    drop_from_index(d, EXPERT_UP)
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj\.weight.*missing.*model\.safetensors\.index\.json"):
        load_model(d)


def test_tensor_missing_from_its_shard_names_the_shard(tiny_k2_dir, tmp_path):
    d = copy_dir(tiny_k2_dir, tmp_path / "m")
    file = edit_shard(d, EXPERT_UP, lambda t: t.pop(EXPERT_UP))
    with pytest.raises(CheckpointError, match=rf"experts\.3\.up_proj\.weight.*missing from .*{file}"):
        load_model(d)


def test_wrong_shape_names_tensor_file_and_shapes(tiny_k2_dir, tmp_path):
    d = copy_dir(tiny_k2_dir, tmp_path / "m")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    rows, cols = load_file(str(d / index(d)["weight_map"][name]))[name].shape
    file = edit_shard(d, name, lambda t: t.__setitem__(name, t[name][:-1].contiguous()))
    with pytest.raises(CheckpointError, match=rf"kv_b_proj\.weight.*{file}.*shape \[{rows - 1}, {cols}\], expected \[{rows}, {cols}\]"):
        load_model(d)


def test_missing_scale_names_the_scale_and_weight(tiny_k2_dir, tmp_path):
    d = copy_dir(tiny_k2_dir, tmp_path / "m")
    scale = KV_A + "_scale_inv"
    edit_shard(d, scale, lambda t: t.pop(scale))
    drop_from_index(d, scale)
    with pytest.raises(CheckpointError, match=r"kv_a_proj_with_mqa\.weight_scale_inv.*missing"):
        load_model(d)


def test_wrong_scale_shape_is_reported(tiny_k2_dir, tmp_path):
    d = copy_dir(tiny_k2_dir, tmp_path / "m")
    scale = KV_A + "_scale_inv"
    rows, cols = load_file(str(d / index(d)["weight_map"][scale]))[scale].shape
    assert rows > 1  # kv_lora_rank + rope rows end in a ragged block, which has its own scale row
    edit_shard(d, scale, lambda t: t.__setitem__(scale, t[scale][:1].contiguous()))
    with pytest.raises(CheckpointError, match=rf"kv_a_proj_with_mqa\.weight_scale_inv.*shape \[1, {cols}\], expected \[{rows}, {cols}\]"):
        load_model(d)


def test_unquantized_weight_where_fp8_expected_is_reported(tiny_k2_dir, tmp_path):
    d = copy_dir(tiny_k2_dir, tmp_path / "m")
    edit_shard(d, KV_A, lambda t: t.__setitem__(KV_A, t[KV_A].to(torch.bfloat16)))
    with pytest.raises(CheckpointError, match=r"kv_a_proj_with_mqa\.weight.*dtype torch\.bfloat16"):
        load_model(d)


def test_rotary_inv_freq_and_mtp_layers_are_skipped(tiny_k2_dir, tmp_path):
    d = copy_dir(tiny_k2_dir, tmp_path / "m")
    extra = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16, dtype=torch.bfloat16),
        "model.layers.4.embed_tokens.weight": torch.ones(4, 4, dtype=torch.bfloat16),  # an MTP layer
    }
    save_file(extra, str(d / "model-extra.safetensors"), metadata={"format": "pt"})
    idx = index(d)
    idx["weight_map"].update({k: "model-extra.safetensors" for k in extra})
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    base, got = load_model(tiny_k2_dir), load_model(d)
    for (n1, p1), (n2, p2) in zip(base.named_parameters(), got.named_parameters()):
        assert n1 == n2 and same_bits(p1, p2)


def test_dequantized_weights_are_the_dequantized_checkpoint(tiny_k2_dir):
    from kserve.kernels.fp8_dequant import dequantize_blocks_torch

    model = load_model(tiny_k2_dir, weights="dequantized")
    file = index(tiny_k2_dir)["weight_map"][EXPERT_UP]
    shard = load_file(str(tiny_k2_dir / file))
    want = dequantize_blocks_torch(shard[EXPERT_UP], shard[EXPERT_UP + "_scale_inv"])
    inter = model.config.moe_intermediate_size
    got = model.model.layers[1].mlp.experts.gate_up_proj[3, inter:]
    assert torch.equal(got, want)
    kv_a = index(tiny_k2_dir)["weight_map"][KV_A]
    shard = load_file(str(tiny_k2_dir / kv_a))
    assert torch.equal(
        model.model.layers[2].self_attn.kv_a_proj_with_mqa.weight,
        dequantize_blocks_torch(shard[KV_A], shard[KV_A + "_scale_inv"]),
    )
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().min() > 0


def test_tensor_parallel_shards_slice_the_full_weights(tiny_k2_dir):
    full = load_model(tiny_k2_dir, weights="dequantized")
    c = full.config
    for rank in range(2):
        part = load_model(tiny_k2_dir, parallel=ParallelState(tp_rank=rank, tp_size=2), weights="dequantized")
        fa, pa = full.model.layers[1].self_attn, part.model.layers[1].self_attn
        rows = c.num_attention_heads // 2 * c.qk_head_dim
        assert torch.equal(pa.q_b_proj.weight, fa.q_b_proj.weight[rank * rows : (rank + 1) * rows])
        cols = c.num_attention_heads // 2 * c.v_head_dim
        assert torch.equal(pa.o_proj.weight, fa.o_proj.weight[:, rank * cols : (rank + 1) * cols])
        assert torch.equal(pa.q_a_proj.weight, fa.q_a_proj.weight)
        e = c.n_routed_experts // 2
        assert part.model.layers[1].mlp.experts.gate_up_proj.shape[0] == e
        assert torch.equal(part.model.layers[1].mlp.experts.down_proj, full.model.layers[1].mlp.experts.down_proj[rank * e : (rank + 1) * e])


def test_fp8_tensor_parallel_shards_are_checkpoint_slices(tiny_k2_dir):
    full = load_model(tiny_k2_dir, weights="dequantized")
    c = full.config
    for rank in range(2):
        part = load_model(tiny_k2_dir, parallel=ParallelState(tp_rank=rank, tp_size=2))
        fa, pa = full.model.layers[1].self_attn, part.model.layers[1].self_attn
        assert pa.q_b_proj.weight.dtype == torch.float8_e4m3fn
        rows = c.num_attention_heads // 2 * c.qk_head_dim
        assert torch.equal(pa.q_b_proj.dense_weight(), fa.q_b_proj.weight[rank * rows : (rank + 1) * rows])
        cols = c.num_attention_heads // 2 * c.v_head_dim
        assert torch.equal(pa.o_proj.dense_weight(), fa.o_proj.weight[:, rank * cols : (rank + 1) * cols])
        # the shared expert's 128-wide intermediate splits into 64-wide shards: still FP8, zero-padded
        # in front to the checkpoint's block grid on rank 1
        shared = part.model.layers[1].mlp.shared_experts.down_proj
        half = c.moe_intermediate_size // 2
        assert shared.quantized and shared.weight.dtype == torch.float8_e4m3fn
        assert shared.weight.shape[1] == half + (rank * half) % 128
        assert torch.equal(shared.dense_weight(), full.model.layers[1].mlp.shared_experts.down_proj.weight[:, rank * half : (rank + 1) * half])
