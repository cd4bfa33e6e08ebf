"""FP8 checkpoints stay FP8 by default; the router is fp32 and its bias bit-exact; each rank reads
only its slice (and says how much); bad configs fail before anything is read, naming the number."""

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kserve.config import ModelConfig
from kserve.distributed import ParallelState
from kserve.kernels.fp8_dequant import dequantize_blocks_torch
from kserve.model import load_model
from kserve.model.loader import read_weight_map
from kserve.model.memory_plan import build_meta_model


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(read_weight_map(model_dir).values())):
        tensors.update(load_file(str(model_dir / file)))
    return tensors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_default_load_keeps_every_fp8_tensor_fp8(tiny_k2_dir):
    model = load_model(tiny_k2_dir)
    params = dict(model.named_parameters())
    ckpt = checkpoint(tiny_k2_dir)
    inter = model.config.moe_intermediate_size
    fp8_names = [n for n, t in ckpt.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8_names) > 100
    kept = 0
    for name in fp8_names:
        scale = ckpt[name + "_scale_inv"]
        if ".kv_b_proj." in name:  # the documented exception: dequantized at load for the absorbed path,
            # its rows regrouped (every head's key rows, then every head's value rows)
            c = model.config
            per_head = dequantize_blocks_torch(ckpt[name], scale).view(c.num_attention_heads, -1, c.kv_lora_rank)
            keys, values = per_head.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
            assert params[name].dtype == torch.float32
            assert torch.equal(params[name], torch.cat([keys.reshape(-1, c.kv_lora_rank),
                                                        values.reshape(-1, c.kv_lora_rank)]))
            continue
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            e, proj = int(parts[i + 1]), parts[i + 2]
            prefix = ".".join(parts[:i + 1])
            stacked = "down_proj" if proj == "down_proj" else "gate_up_proj"
            w, s = params[f"{prefix}.{stacked}"][e], params[f"{prefix}.{stacked}_scale_inv"][e]
            rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter), "down_proj": slice(None)}[proj]
            srows = {"gate_proj": slice(0, inter // 128), "up_proj": slice(inter // 128, None), "down_proj": slice(None)}[proj]
            w, s = w[rows], s[srows]
        else:
            w, s = params[name], params[name + "_scale_inv"]
        assert same_bits(w, ckpt[name]), name
        assert same_bits(s, scale), name
        kept += 1
    print(f"{kept} FP8 checkpoint tensors are FP8 in the model; kv_b_proj dequantized in {model.config.num_hidden_layers} layers")
    # nothing else in the model holds a copy of an FP8 weight in another dtype
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        if any(t.dtype == torch.float8_e4m3fn for t in own.values()):
            assert {n: t.dtype for n, t in own.items() if t.dtype != torch.float8_e4m3fn} == {
                n: torch.float32 for n in own if n.endswith("scale_inv")
            }, name


def test_router_is_fp32_and_bias_bit_exact_in_a_bf16_model(tiny_k2_dir):
    model = load_model(tiny_k2_dir, dtype=torch.bfloat16)
    ckpt = checkpoint(tiny_k2_dir)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert ckpt[name].dtype == torch.float32
    gate = model.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32 and gate.weight.dtype == torch.float32
    assert same_bits(gate.e_score_correction_bias.data, ckpt[name])
    # the bias has more precision than bf16 holds: rounding it through the model dtype would show
    assert not torch.equal(ckpt[name].to(torch.bfloat16).float(), ckpt[name])
    assert torch.equal(gate.weight, ckpt["model.layers.1.mlp.gate.weight"].float())
    ids, _ = gate(torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16))
    assert ids.dtype == torch.float32


def _tensor_data_bytes(model_dir: Path) -> int:
    """Bytes of tensor data in the shard files (file size less the safetensors header)."""
    total = 0
    for file in set(read_weight_map(model_dir).values()):
        path = model_dir / file
        with open(path, "rb") as f:
            header = struct.unpack("<Q", f.read(8))[0]
        total += path.stat().st_size - 8 - header
    return total


def test_each_rank_reads_only_its_slice(tiny_k2_dir):
    one = load_model(tiny_k2_dir).load_report
    assert one.bytes_read == _tensor_data_bytes(tiny_k2_dir) and one.bytes_split == 0
    ranks = [load_model(tiny_k2_dir, parallel=ParallelState(r, 2)).load_report for r in range(2)]
    whole = ranks[0].bytes_whole
    assert ranks[1].bytes_whole == whole and 0 < whole < one.bytes_read / 2
    split_total = one.bytes_read - whole  # the tensors tensor/expert parallelism splits
    for report in ranks:
        print(f"rank {report.tp_rank}/2 read {report.bytes_read:,} B: {report.bytes_split:,} of the "
              f"{split_total:,} B of split tensors, {report.bytes_whole:,} B replicated")
        # half, up to the scale blocks that straddle two ranks' shards (read by both)
        assert report.bytes_split == pytest.approx(split_total / 2, rel=0.01)


def _config_only(src: Path, dst: Path, edit=None) -> Path:
    """A directory with only config.json (no shards): any read would fail with another message."""
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if edit:
        edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_block_size_other_than_128_fails_naming_it(tiny_k2_dir, tmp_path):
    d = _config_only(tiny_k2_dir, tmp_path / "m", lambda raw: raw["quantization_config"].update(weight_block_size=[64, 64]))
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\]"):
        load_model(d)


def test_tp_size_not_dividing_heads_or_experts_fails_before_reading(tiny_k2_dir, tmp_path):
    d = _config_only(tiny_k2_dir, tmp_path / "m")
    with pytest.raises(ValueError, match=r"num_attention_heads = 8 .*tensor-parallel size 3"):
        load_model(d, parallel=ParallelState(0, 3))
    config = dataclasses.replace(ModelConfig.from_model_dir(tiny_k2_dir), n_routed_experts=12)
    with pytest.raises(ValueError, match=r"n_routed_experts = 12 is not divisible by tensor-parallel size 8"):
        build_meta_model(config, tp_size=8)


def test_unknown_weights_mode_is_rejected(tiny_k2_dir):
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model(tiny_k2_dir, weights="bf16")


def test_fp8_experts_need_whole_blocks(tiny_k2_dir):
    config = dataclasses.replace(ModelConfig.from_model_dir(tiny_k2_dir), moe_intermediate_size=96)
    with pytest.raises(ValueError, match=r"moe_intermediate_size = 96"):
        build_meta_model(config, dtype=torch.float32)
    build_meta_model(config, dtype=torch.float32, weights="dequantized")  # fine without FP8 storage


def test_dequantized_copy_loads_as_the_dequantized_model(tiny_k2_dir, tmp_path):
    from kserve.model.loader import write_dequantized_checkpoint

    copy = write_dequantized_checkpoint(tiny_k2_dir, tmp_path / "dense")
    assert "quantization_config" not in json.loads((copy / "config.json").read_text())
    assert not any(t.dtype == torch.float8_e4m3fn for t in checkpoint(copy).values())
    ref = dict(load_model(tiny_k2_dir, weights="dequantized").named_parameters())
    got = dict(load_model(copy).named_parameters())
    assert ref.keys() == got.keys()
    assert all(torch.equal(got[n], ref[n]) for n in ref)
