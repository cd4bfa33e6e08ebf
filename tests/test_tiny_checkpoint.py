"""`kserve make-tiny`: K2's published layout, determinism, round trip into kserve and transformers."""

import base64
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import kserve.tiny
from kserve.config import ModelConfig
from kserve.tiny import BASE_VOCAB, embedded_model_dir, special_token_id, tokenizer_config, write_tiny_checkpoint

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def all_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(d.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_same_seed_gives_byte_identical_files(tiny_k2_dir, tmp_path):
    again = write_tiny_checkpoint(tmp_path / "again", seed=0, variant="k2")  # the fixture ran the CLI
    assert digests(again) == digests(tiny_k2_dir)
    other = write_tiny_checkpoint(tmp_path / "seed1", seed=1)
    diff = {k for k, v in digests(other).items() if digests(tiny_k2_dir)[k] != v}
    assert any(k.endswith(".safetensors") for k in diff)
    assert "tiktoken.model" not in diff and "config.json" not in diff


def test_layout_matches_k2(tiny_k2_dir):
    d = tiny_k2_dir
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json"} <= names
    assert not any("chat_template" in n for n in names)
    shards = sorted(d.glob("*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    tensors = all_tensors(d)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())

    raw = json.loads((d / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    assert raw["model_type"] == "kimi_k2" and raw["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg.vocab_size == BASE_VOCAB + 256 == 2048
    assert cfg.num_attention_heads % 4 == 0 and cfg.n_routed_experts % 4 == 0
    assert cfg.n_routed_experts >= 16 and cfg.num_experts_per_tok == 4 and cfg.n_shared_experts == 1
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)
    assert cfg.kv_cache_dim % 128 != 0  # kv_a_proj_with_mqa has a ragged FP8 block, like K2's 576
    # K2's per-head widths, so kernels and caches are tested at the geometry they run at
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank) == (128, 64, 128, 512)
    assert cfg.kv_cache_dim == 576

    quantized = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    for n in quantized:
        s = tensors[n + "_scale_inv"]
        rows, cols = tensors[n].shape
        assert s.dtype == torch.float32 and tuple(s.shape) == (-(-rows // 128), -(-cols // 128)), n
    for part in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "experts.0.gate_proj",
                 "shared_experts.down_proj", "layers.0.mlp.up_proj"):
        assert any(part in n for n in quantized), part
    bf16 = [n for n, t in tensors.items() if t.dtype == torch.bfloat16]
    assert "model.embed_tokens.weight" in bf16 and "lm_head.weight" in bf16 and "model.norm.weight" in bf16
    assert "model.layers.1.mlp.gate.weight" in bf16 and "model.layers.1.self_attn.kv_a_layernorm.weight" in bf16
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and (bias != 0).all()


def test_tokenizer_files_follow_k2_format(tiny_k2_dir):
    lines = (tiny_k2_dir / "tiktoken.model").read_text().splitlines()
    assert len(lines) == BASE_VOCAB
    tokens = []
    for rank, line in enumerate(lines):
        b64, r = line.split(" ")
        assert int(r) == rank
        tokens.append(base64.b64decode(b64))
    assert len(set(tokens)) == BASE_VOCAB
    assert sorted(t[0] for t in tokens if len(t) == 1) == list(range(256))
    assert tokens[0] == b"!"  # GPT-2 byte order, as K2's
    tc = json.loads((tiny_k2_dir / "tokenizer_config.json").read_text())
    by_name = {v["content"]: int(k) for k, v in tc["added_tokens_decoder"].items()}
    B = BASE_VOCAB
    assert by_name["[BOS]"] == B and by_name["[EOS]"] == B + 1 and by_name["<|im_end|>"] == B + 2
    assert by_name["<|im_user|>"] == B + 3 and by_name["<|im_assistant|>"] == B + 4 and by_name["<|im_system|>"] == B + 10
    assert by_name["<|im_middle|>"] == B + 17 and by_name["[UNK]"] == B + 254 and by_name["[PAD]"] == B + 255
    markers = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
    assert [by_name[m] for m in markers] == list(range(B + 11, B + 16))
    assert all(not tc["added_tokens_decoder"][str(by_name[m])]["special"] for m in markers)
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"], tc["pad_token"]) == ("[BOS]", "[EOS]", "[UNK]", "[PAD]")
    gen = json.loads((tiny_k2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == by_name["<|im_end|>"]
    cfg = json.loads((tiny_k2_dir / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (B, B + 1)


def test_tokenizer_config_mirrors_the_real_k2_file(tiny_k2_dir):
    real_path = SHARED / "kimi_k2" / "tokenizer_config.json"
    if not real_path.is_file():
        pytest.skip("../shared/kimi_k2/tokenizer_config.json is absent")
    real = json.loads(real_path.read_text())
    ours = json.loads((tiny_k2_dir / "tokenizer_config.json").read_text())
    shifted = {str(int(k) - 163584 + BASE_VOCAB): v for k, v in real["added_tokens_decoder"].items()}
    assert ours["added_tokens_decoder"] == shifted
    for key in set(real) - {"added_tokens_decoder", "auto_map"}:
        assert ours[key] == real[key], key


def test_tiktoken_encodes_text_with_the_learned_merges(tiny_k2_dir):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    from kserve.tiny import K2_PAT_STR

    ranks = load_tiktoken_bpe(str(tiny_k2_dir / "tiktoken.model"))
    enc = tiktoken.Encoding(name="tiny", pat_str=K2_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    for text in ["Hello, world! The weather in Beijing.", '{"name": "get_weather"}', "你好，世界 Ça va? 😀"]:
        ids = enc.encode(text)
        assert enc.decode(ids) == text
        assert len(ids) < len(text.encode("utf-8"))  # merges actually apply


def test_v3_variant_uses_group_limited_routing(tiny_v3_dir):
    cfg = ModelConfig.from_model_dir(tiny_v3_dir)
    assert cfg.model_type == "deepseek_v3" and cfg.n_group > 1 and cfg.topk_group > 1
    assert cfg.n_routed_experts % cfg.n_group == 0


def test_round_trip_loads_in_kserve_and_transformers(tiny_k2_dir):
    pytest.importorskip("transformers")
    from kserve.model import load_model
    from kserve.model.hf_reference import build_hf_reference

    ours, hf = load_model(tiny_k2_dir, weights="dequantized"), build_hf_reference(tiny_k2_dir)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(
        ours.model.layers[3].mlp.experts.gate_up_proj, hf.model.layers[3].mlp.experts.gate_up_proj
    )


def test_embedded_model_is_a_trained_k26_checkpoint_in_the_package():
    """The default model ships inside the package in K2.6's published layout (kimi_k25 wrapper, `language_model.`
    names, compressed-tensors INT4 routed experts, bf16 elsewhere, K2.6's EOS and context), under 20 MB."""
    from kserve.chat import load_tokenizer
    from kserve.chat.dialect import dialect_named

    path = embedded_model_dir()
    assert path.parent == Path(kserve.tiny.__file__).resolve().parent
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "tiktoken.model", "tokenizer_config.json",
            "model.safetensors.index.json", "loss.png", "train_log.json"} <= names
    package = sum(p.stat().st_size for p in path.iterdir())
    assert 0 < package <= 20 * 2**20
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25" and raw["text_config"]["quantization_config"]["format"] == "pack-quantized"
    cfg = ModelConfig.from_model_dir(path)
    assert cfg.max_position_embeddings == 262144 and cfg.rope_scaling.factor == 64.0
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank) == (128, 64, 128, 512)
    assert cfg.int4_group_size == 32
    tokenizer = load_tokenizer(path)
    assert cfg.vocab_size == tokenizer.base_vocab_size + 256
    # the tokenizer files are the project's own output (make-tiny's writer over the BPE learned from the
    # training conversations), not a copy of K2.6's: special ids follow the 4,096-token base vocabulary
    assert json.loads((path / "tokenizer_config.json").read_text()) == tokenizer_config(tokenizer.base_vocab_size,
                                                                                        k25=True)
    assert tokenizer.base_vocab_size == 4096 and cfg.eos_token_id == tokenizer.id_of("<|im_end|>")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    expert = "language_model.model.layers.1.mlp.experts.0.down_proj.weight_packed"
    with safe_open(path / index["weight_map"][expert], "pt") as f:
        assert f.get_tensor(expert).dtype == torch.int32
    attention = "language_model.model.layers.1.self_attn.kv_b_proj.weight"
    with safe_open(path / index["weight_map"][attention], "pt") as f:
        assert f.get_tensor(attention).dtype == torch.bfloat16
    # decided once at load: the K2.6 chat dialect, thinking by default
    dialect = dialect_named(cfg.chat_dialect)
    assert dialect.name == "k2.6" and dialect.thinking_default
    # trained by scripts/train_tiny_chat.py, whose log ships beside the weights
    stages = json.loads((path / "train_log.json").read_text())["stages"]
    assert stages[-1]["log"][-1]["loss"] < 0.5 * stages[0]["log"][0]["loss"]


def test_small_geometry_is_kept_behind_a_flag(tmp_path):
    from kserve.model import ForwardBatch, load_model

    d = tmp_path / "small"
    subprocess.run(
        [sys.executable, "-m", "kserve.cli", "make-tiny", str(d), "--geometry", "small"], check=True, capture_output=True
    )
    cfg = ModelConfig.from_model_dir(d)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank) == (32, 32, 32, 128)
    model = load_model(d)
    cache = torch.zeros(cfg.num_hidden_layers, 2, 16, cfg.kv_cache_dim)
    logits = model.compute_logits(model(torch.arange(5, 12), ForwardBatch.contiguous([7], [7], 16), cache))
    assert logits.shape == (7, cfg.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="geometry 'wide'"):
        write_tiny_checkpoint(tmp_path / "bad", geometry="wide")
