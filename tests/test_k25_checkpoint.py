"""K2.6's published layout: the kimi_k25 wrapper config, compressed-tensors INT4 routed experts, the
`language_model.` prefix, the refusals of other quantizations, make-tiny's files, memory and the plan."""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kserve.config import ModelConfig
from kserve.kernels.int4_pack import pack_int4, unpack_int4
from kserve.model import load_model
from kserve.model.memory_plan import build_meta_model, tensor_bytes

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
K26_CONFIG = SHARED / "kimi_k25" / "tokenizer" / "config.json"


@pytest.fixture(scope="module")
def k26_raw() -> dict:
    if not K26_CONFIG.is_file():
        pytest.skip(f"K2.6's config.json is not at {K26_CONFIG} (../shared/ absent)")
    return json.loads(K26_CONFIG.read_text())


def test_k26_config_reads_the_text_model(k26_raw):
    c = ModelConfig.from_dict(k26_raw)
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.moe_intermediate_size) == (7168, 61, 384, 2048)
    assert c.int4_group_size == 32 and c.fp8_block is None
    assert c.weight_prefix == "language_model."
    assert c.eos_token_id == 163586  # <|im_end|>, from the wrapper
    assert c.max_position_embeddings == 262144 and c.rope_scaling.factor == 64.0


def test_k2_thinking_style_config_loads_the_same_way(k26_raw):
    """K2-Thinking: model_type kimi_k2 at the top, the same INT4 quantization_config, no prefix."""
    raw = dict(k26_raw["text_config"], model_type="kimi_k2")
    c = ModelConfig.from_dict(raw)
    assert c.int4_group_size == 32 and c.weight_prefix == ""


def _with_weights(**changes):
    def mutate(q: dict) -> None:
        q["config_groups"]["group_0"]["weights"].update(changes)

    return mutate


def _set(key, value):
    def mutate(q: dict) -> None:
        q[key] = value

    return mutate


def _nvfp4_modelopt(q: dict) -> None:
    q.clear()
    q.update(quant_method="modelopt", quant_algo="NVFP4", group_size=16)


def _mxfp4_quark(q: dict) -> None:
    q.clear()
    q.update(quant_method="quark", export={"kv_cache_group": []}, global_quant_config={"weight": {"dtype": "fp4"}})


def _activations(q: dict) -> None:
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token"}


def _attention_quantized(q: dict) -> None:
    q["ignore"] = ["lm_head"]


def _fp8_block_64(q: dict) -> None:
    q.clear()
    q.update(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[64, 64])


def _without_num_bits(q: dict) -> None:
    del q["config_groups"]["group_0"]["weights"]["num_bits"]


REFUSALS = [
    ("group size 64", _with_weights(group_size=64), "group_size", "64"),
    ("no num_bits", _without_num_bits, "num_bits", "None"),
    ("asymmetric with zero points", _with_weights(symmetric=False), "symmetric", "False"),
    ("8-bit weights", _with_weights(num_bits=8), "num_bits", "8"),
    ("channel strategy", _with_weights(strategy="channel"), "strategy", "channel"),
    ("nvfp4 compressed-tensors", _set("format", "nvfp4-pack-quantized"), "format", "nvfp4-pack-quantized"),
    ("mxfp4 compressed-tensors", _set("format", "mxfp4-pack-quantized"), "format", "mxfp4-pack-quantized"),
    ("NVIDIA modelopt nvfp4", _nvfp4_modelopt, "quant_method", "modelopt"),
    ("AMD quark mxfp4", _mxfp4_quark, "quant_method", "quark"),
    ("activation quantization", _activations, "input_activations", "num_bits"),
    ("INT4 attention", _attention_quantized, "ignore", "self_attn"),
    ("FP8 blocks of 64", _fp8_block_64, "weight_block_size", "64"),
]


@pytest.mark.parametrize(("case", "mutate", "field", "value"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_other_quantizations_are_refused_naming_field_and_value(k26_raw, case, mutate, field, value):
    raw = copy.deepcopy(k26_raw)
    mutate(raw["text_config"]["quantization_config"])
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dict(raw)
    message = str(info.value)
    assert field in message and value in message, message
    assert "supported" in message or "supports" in message, message


def test_a_refused_checkpoint_fails_at_load_with_the_reason(tiny_k25_dir, tmp_path):
    import shutil

    bad = shutil.copytree(tiny_k25_dir, tmp_path / "bad")
    raw = json.loads((bad / "config.json").read_text())
    raw["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="group_size = 128"):
        load_model(bad)


def _index(model_dir: Path) -> dict[str, str]:
    return json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]


def _tensor(model_dir: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(model_dir / _index(model_dir)[name]), framework="pt") as f:
        return f.get_tensor(name)


def test_make_tiny_k25_writes_k26s_layout(tiny_k25_dir):
    raw = json.loads((tiny_k25_dir / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25" and raw["architectures"] == ["KimiK25ForConditionalGeneration"]
    text = raw["text_config"]
    quant = text["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "pack-quantized"
    assert quant["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "vision_config" in raw
    names = _index(tiny_k25_dir)
    vision = [n for n in names if n.startswith(("vision_tower.", "mm_projector."))]
    assert vision and all(n.startswith("language_model.") for n in names if n not in vision)
    assert not any(n.endswith("_scale_inv") for n in names)  # no FP8 anywhere
    inter, hidden = text["moe_intermediate_size"], text["hidden_size"]
    expert = "language_model.model.layers.1.mlp.experts.5.down_proj"
    packed = _tensor(tiny_k25_dir, expert + ".weight_packed")
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (hidden, inter // 8)
    scale = _tensor(tiny_k25_dir, expert + ".weight_scale")
    assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (hidden, inter // 32)
    assert _tensor(tiny_k25_dir, expert + ".weight_shape").tolist() == [hidden, inter]
    shared = _tensor(tiny_k25_dir, "language_model.model.layers.1.mlp.shared_experts.down_proj.weight")
    assert shared.dtype == torch.bfloat16
    # K2.6's EOS: <|im_end|> in config.json and generation_config.json, a special token of the tokenizer
    from kserve.chat import load_tokenizer

    tok = load_tokenizer(tiny_k25_dir)
    gen = json.loads((tiny_k25_dir / "generation_config.json").read_text())
    assert raw["eos_token_id"] == gen["eos_token_id"] == text["eos_token_id"] == tok.im_end_id
    specials = json.loads((tiny_k25_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {"<|media_pad|>", "<think>", "</think>"} <= {t["content"] for t in specials.values()}


def test_packing_is_compressed_tensors_byte_for_byte(tiny_k25_dir):
    helpers = pytest.importorskip(
        "compressed_tensors.compressors.pack_quantized.helpers", reason="compressed-tensors is not installed"
    )
    packed = _tensor(tiny_k25_dir, "language_model.model.layers.2.mlp.experts.0.gate_proj.weight_packed")
    values = unpack_int4(packed)
    assert values.min() >= -8 and values.max() <= 7 and values.unique().numel() > 8
    theirs = helpers.pack_to_int32(values, 4, packed_dim=1)
    assert theirs.dtype == torch.int32 and torch.equal(theirs, packed)
    assert torch.equal(pack_int4(values), packed)
    assert torch.equal(helpers.unpack_from_int32(packed, 4, torch.Size(values.shape), packed_dim=1), values)


def test_int4_experts_stay_packed_in_memory(tiny_k25_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kserve.model.loader"):
        model = load_model(tiny_k25_dir, dtype=torch.float32)
    assert any("skipping 35 vision tensors" in r.getMessage() for r in caplog.records)
    c = model.config
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj_packed.dtype == torch.int32 and experts.down_proj_scale.dtype == torch.bfloat16
    assert not hasattr(experts, "gate_up_proj")
    per_expert = 3 * c.moe_intermediate_size * c.hidden_size  # values
    held = sum(p.numel() * p.element_size() for p in experts.parameters())
    assert held == c.n_routed_experts * per_expert * (4 / 8 + 2 / 32)  # half a byte a value + a bf16 scale per 32
    dense = load_model(tiny_k25_dir, dtype=torch.bfloat16, weights="dequantized").model.layers[1].mlp.experts
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.parameters())
    print(f"routed experts of one layer: {held:,} B packed vs {dense_bytes:,} B in bf16")
    assert dense_bytes / held == pytest.approx(2 / (0.5 + 2 / 32))  # 3.56x: not 4x because of the scales


def _k26_rank0_parameter_bytes(c: ModelConfig, tp: int) -> int:
    """K2.6's rank-0 parameters at TP `tp`, counted by hand from the published shapes."""
    bf16, fp32 = 2, 4
    h, heads = c.hidden_size, c.num_attention_heads // tp
    attention = (
        c.q_lora_rank * h + c.q_lora_rank + heads * c.qk_head_dim * c.q_lora_rank
        + c.kv_cache_dim * h + c.kv_lora_rank
        + heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank + h * heads * c.v_head_dim
    ) * bf16
    norms = 2 * h * bf16
    dense_mlp = 3 * h * (c.intermediate_size // tp) * bf16
    router = c.n_routed_experts * h * fp32 + c.n_routed_experts * fp32
    routed = (c.n_routed_experts // tp) * 3 * c.moe_intermediate_size * h * (0.5 + bf16 / 32)
    shared = 3 * h * (c.moe_intermediate_size * c.n_shared_experts // tp) * bf16
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    layers = c.num_hidden_layers * (attention + norms) + c.first_k_dense_replace * dense_mlp
    layers += moe_layers * (router + routed + shared)
    vocab = 2 * (c.vocab_size // tp) * h * bf16 + h * bf16  # embedding and LM head shards, final norm
    return int(layers + vocab)


def test_kserve_plan_counts_k26_int4_bytes_as_stored(k26_raw):
    out = subprocess.run(
        [sys.executable, "-m", "kserve.cli", "plan", str(K26_CONFIG), "--tp", "8", "--gpu-memory-gib", "140", "--json"],
        check=True, capture_output=True, text=True,
    )
    plan = json.loads(out.stdout)
    config = ModelConfig.from_dict(k26_raw)
    meta = build_meta_model(config, 8, 0)
    assert plan["weights_per_rank_bytes"] == tensor_bytes(meta)
    params = sum(p.numel() * p.element_size() for p in meta.parameters())
    assert params == _k26_rank0_parameter_bytes(config, 8)
    gib = plan["weights_per_rank_bytes"] / 2**30
    print(f"K2.6 TP8: {gib:.2f} GiB per rank, {plan['kv_tokens']:,} KV tokens, "
          f"{plan['concurrent_seqs_at_max_model_len']} sequences of {plan['max_model_len']:,}")
    assert 68 < gib < 74  # about 71 GiB, against K2-Instruct FP8's 121
    assert plan["fits"] and plan["concurrent_seqs_at_max_model_len"] >= 2


def test_each_rank_reads_only_its_own_packed_experts(tiny_k25_dir):
    from kserve.distributed import ParallelState

    full = load_model(tiny_k25_dir)
    part = load_model(tiny_k25_dir, parallel=ParallelState(tp_rank=1, tp_size=2))
    ours, whole = part.model.layers[2].mlp.experts, full.model.layers[2].mlp.experts
    assert ours.first_expert == 8 and ours.num_local == 8
    for name in ("gate_up_proj_packed", "down_proj_packed", "gate_up_proj_scale", "down_proj_scale"):
        assert torch.equal(getattr(ours, name), getattr(whole, name)[8:16]), name
    expert_bytes = lambda m: sum(  # noqa: E731
        p.numel() * p.element_size() for n, p in m.named_parameters() if ".experts." in n
    )
    assert expert_bytes(part) * 2 == expert_bytes(full)
    assert part.load_report.bytes_split > 0 and part.load_report.bytes_read < full.load_report.bytes_read


def test_int64_weight_shapes_load_as_compressed_tensors_writes_them(tiny_k25_dir, tmp_path):
    """compressed-tensors stores `weight_shape` as int64 (make-tiny writes int32, as K2.6's files do)."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(tiny_k25_dir, tmp_path / "i64")
    for shard in copy.glob("*.safetensors"):
        tensors = load_file(str(shard))
        save_file({k: v.long() if k.endswith(".weight_shape") else v for k, v in tensors.items()}, str(shard))
    assert _tensor(copy, "language_model.model.layers.1.mlp.experts.0.up_proj.weight_shape").dtype == torch.int64
    ours, theirs = load_model(copy), load_model(tiny_k25_dir)
    assert torch.equal(ours.model.layers[1].mlp.experts.gate_up_proj_packed,
                       theirs.model.layers[1].mlp.experts.gate_up_proj_packed)


def test_every_family_chat_dialect_names_a_dialect(k26_raw):
    from kserve.chat.dialect import dialect_named
    from kserve.config import CHAT_DIALECT_K2, CHAT_DIALECT_K2_THINKING, CHAT_DIALECT_KIMI_K25

    for name in (CHAT_DIALECT_K2, CHAT_DIALECT_K2_THINKING, CHAT_DIALECT_KIMI_K25):
        assert dialect_named(name).name == name
    assert ModelConfig.from_dict(k26_raw).chat_dialect == CHAT_DIALECT_KIMI_K25
    assert ModelConfig.from_dict(dict(k26_raw["text_config"], model_type="kimi_k2")).chat_dialect == "k2-thinking"
