"""A tiny random Kimi K2 checkpoint in Moonshot's published layout (`kserve make-tiny`).

Variants "k2", "v3" and "k25" (K2.6's layout: INT4 experts, a small MoonViT tower); geometry "k2" keeps K2's
attention widths, "small" narrower ones. The same seed writes byte-identical files.
Details: docs/model.md, the `kserve make-tiny` points.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kserve.tiny.bpe import BASE_VOCAB, learn_bpe_ranks
from kserve.tiny.tokenizer_files import (
    NUM_SPECIAL,
    special_token_id,
    tiktoken_model_text,
    tokenizer_config,
)

VARIANTS = ("k2", "v3", "k25")
GEOMETRIES: dict[str, dict[str, int]] = {
    "k2": {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512},
    "small": {"qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "kv_lora_rank": 128},
}


def int4_quantization_config(group_size: int = 32) -> dict[str, Any]:
    """K2.6's `quantization_config`: compressed-tensors pack-quantized INT4 routed experts, the rest bf16."""
    weights = {
        "actorder": None, "block_structure": None, "dynamic": False, "group_size": group_size, "num_bits": 4,
        "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int",
    }
    return {
        "config_groups": {
            "group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"], "weights": weights}
        },
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def tiny_vision_config(text_hidden: int) -> dict[str, Any]:
    """K2.6's `vision_config` keys at tiny sizes (a 2-layer MoonViT of width 64, 4 heads, an 8x8 position
    table), plus the size keys transformers' Kimi_K25VisionConfig reads (`hidden_size`, ...): it ignores
    Moonshot's `vt_*` keys and would otherwise build the real 1152-wide tower (K2.6's own config.json can omit
    them because its sizes are transformers' defaults)."""
    return {
        "hidden_size": 64, "init_pos_emb_height": 8, "init_pos_emb_time": 4, "init_pos_emb_width": 8,
        "intermediate_size": 128, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": 64,
        "mm_projector_type": "patchmerger", "num_attention_heads": 4, "num_hidden_layers": 2, "patch_size": 14,
        "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
        "text_hidden_size": text_hidden, "video_attn_type": "spatial_temporal", "vt_hidden_size": 64,
        "vt_intermediate_size": 128, "vt_num_attention_heads": 4, "vt_num_hidden_layers": 2,
    }


def wrap_k25(text: dict[str, Any], base_vocab: int) -> dict[str, Any]:
    """A kimi_k25 config.json around a text config, as K2.6 publishes it."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "bos_token_id": special_token_id(163584, base_vocab),
        "eos_token_id": special_token_id(163586, base_vocab),
        "media_placeholder_token_id": special_token_id(163605, base_vocab),
        "model_type": "kimi_k25",
        "pad_token_id": special_token_id(163839, base_vocab),
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": False,
        "vision_config": tiny_vision_config(text["hidden_size"]),
    }


def vision_tensor_shapes(vision: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every `vision_tower.*` / `mm_projector.*` tensor of a kimi_k25 checkpoint with its shape, in K2.6's
    published layout (fused `wqkv`, Conv2d patch embedding, [H, W, D] position table, patchmerger `proj.0` /
    `proj.2`), for the sizes of `vision` (a vision_config with Moonshot's keys)."""
    width, patch, inter = vision["vt_hidden_size"], vision["patch_size"], vision["vt_intermediate_size"]
    merged = width * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (width, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (width,),
        "vision_tower.patch_embed.pos_emb.weight": (vision["init_pos_emb_height"], vision["init_pos_emb_width"], width),
    }
    for i in range(vision["vt_num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}."
        shapes.update({
            block + "norm0.weight": (width,), block + "norm0.bias": (width,),
            block + "wqkv.weight": (3 * width, width), block + "wqkv.bias": (3 * width,),
            block + "wo.weight": (width, width), block + "wo.bias": (width,),
            block + "norm1.weight": (width,), block + "norm1.bias": (width,),
            block + "mlp.fc0.weight": (inter, width), block + "mlp.fc0.bias": (inter,),
            block + "mlp.fc1.weight": (width, inter), block + "mlp.fc1.bias": (width,),
        })
    shapes.update({
        "vision_tower.encoder.final_layernorm.weight": (width,),
        "vision_tower.encoder.final_layernorm.bias": (width,),
        "mm_projector.pre_norm.weight": (width,),
        "mm_projector.pre_norm.bias": (width,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (vision["text_hidden_size"], merged),
        "mm_projector.proj.2.bias": (vision["text_hidden_size"],),
    })
    return shapes


def _vision_tensors(vision: dict[str, Any], seed: int) -> dict[str, Any]:
    """A random MoonViT tower and projector (bf16, as K2.6 ships them), drawn from `seed`: norm scales near
    1, biases near 0, weights ~ N(0, 1/fan_in), a unit-variance position table, so activations stay O(1)."""
    import math

    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, shape in vision_tensor_shapes(vision).items():
        noise = torch.randn(shape, generator=gen)
        if name.endswith("pos_emb.weight"):
            t = noise
        elif len(shape) > 1:
            t = noise / math.sqrt(math.prod(shape[1:]))
        elif "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
            t = 1.0 + 0.1 * noise
        else:
            t = 0.1 * noise
        out[name] = t.to(torch.bfloat16)
    return out


def tiny_config(variant: str = "k2", geometry: str = "k2") -> dict[str, Any]:
    """The text model's config.json with K2's keys and tiny sizes. `v3` uses group-limited routing like
    DeepSeek-V3; `k25` is K2.6's text config (INT4 experts, 262,144-token context; `wrap_k25` makes the
    wrapper); `geometry` picks the attention widths (GEOMETRIES)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r}; expected one of {VARIANTS}")
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown tiny geometry {geometry!r}; expected one of {tuple(GEOMETRIES)}")
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": special_token_id(163584),
        "eos_token_id": special_token_id(163585),
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "max_position_embeddings": 131072,  # K2's context and YaRN (4,096 x 32), so it accepts what K2 accepts
        "model_type": "kimi_k2",
        "moe_intermediate_size": 128,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 8,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": 192,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.3",
        "use_cache": True,
        "vocab_size": BASE_VOCAB + NUM_SPECIAL,
    }
    # kv_a_proj_with_mqa's output, kv_lora_rank + qk_rope_head_dim (576 or 160), ends in a ragged FP8 block
    cfg.update(GEOMETRIES[geometry])
    if variant == "v3":
        cfg.update(model_type="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_theta=10000.0,
                   max_position_embeddings=10240)  # = factor x original, as transformers expects
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], beta_fast=32.0, factor=40.0, original_max_position_embeddings=256)
    if variant == "k25":
        cfg.update(quantization_config=int4_quantization_config(), max_position_embeddings=262144, rms_norm_eps=1e-05)
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=64.0)
    return cfg


def _random_weights(config_dict: dict[str, Any], seed: int) -> dict[str, Any]:
    """Checkpoint tensors (FP8 + scales, INT4 packed + scales + shapes, bf16, fp32) drawn from `seed`, in
    checkpoint order, named without a wrapper's prefix."""
    import torch

    from kserve.config import ModelConfig
    from kserve.kernels.fp8_dequant import quantize_blocks_torch
    from kserve.kernels.int4_pack import pack_int4, quantize_int4_groups
    from kserve.model.weights_layout import BF16, FP8, INT4, checkpoint_tensors

    config = ModelConfig.from_dict(config_dict)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for spec in checkpoint_tensors(config):
        name, shape = spec.name, spec.shape
        noise = torch.randn(spec.logical_shape or shape, generator=gen, dtype=torch.float32)
        if name.endswith("e_score_correction_bias"):
            out[name] = (0.05 * noise).float()
        elif len(shape) == 1:  # norms
            out[name] = (1.0 + 0.1 * noise).to(torch.bfloat16)
        elif name == "model.embed_tokens.weight":
            out[name] = noise.to(torch.bfloat16)
        elif name == "lm_head.weight":
            out[name] = (noise * (3.0 / shape[1] ** 0.5)).to(torch.bfloat16)
        elif spec.kind == INT4:  # drawn at the unpacked shape, as the other variants draw their experts
            q, scale = quantize_int4_groups(noise / spec.logical_shape[1] ** 0.5, config.int4_group_size)
            out[name] = pack_int4(q)
            out[spec.scale_name] = scale
            out[spec.shape_name] = torch.tensor(spec.logical_shape, dtype=torch.int32)
        else:
            w = noise / shape[1] ** 0.5
            if spec.kind == FP8:
                q, scale = quantize_blocks_torch(w, config.fp8_block)
                out[name] = q
                out[spec.scale_name] = scale
            else:
                out[name] = w.to(torch.bfloat16 if spec.kind == BF16 else torch.float32)
    return out


def _shard_of(name: str, num_layers: int) -> int:
    """Shard 1: embeddings and the first half of the layers; shard 2: the rest, norm and lm_head."""
    from kserve.model.weights_layout import layer_index

    if name == "model.embed_tokens.weight":
        return 1
    idx = layer_index(name)
    return 1 if idx is not None and idx < num_layers // 2 else 2


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_checkpoint(
    dir: str | os.PathLike,
    seed: int = 0,
    variant: str = "k2",
    config_overrides: dict[str, Any] | None = None,
    geometry: str = "k2",
    ranks: tuple[bytes, ...] | None = None,
) -> Path:
    """Write a complete tiny model directory; returns its path.

    `config_overrides` replaces config.json keys (sizes), e.g. for a larger model in benchmarks.
    `ranks` replaces the embedded-corpus BPE (learn_bpe_ranks()); the vocabulary size and the special
    token ids follow its length.
    """
    from safetensors.torch import save_file

    out_dir = Path(dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = ranks if ranks is not None else learn_bpe_ranks()
    base_vocab = len(ranks)
    k25 = variant == "k25"
    cfg = {**tiny_config(variant, geometry), **(config_overrides or {})}
    # K2.6 stops generation on <|im_end|>; K2-Instruct's config names [EOS].
    eos = special_token_id(163586 if k25 else 163585, base_vocab)
    cfg.update(vocab_size=base_vocab + NUM_SPECIAL, bos_token_id=special_token_id(163584, base_vocab),
               eos_token_id=eos)
    if k25:
        cfg["pad_token_id"] = special_token_id(163839, base_vocab)
    tensors = _random_weights(cfg, seed)
    num_shards = 2
    shards: dict[int, dict[str, Any]] = {i: {} for i in range(1, num_shards + 1)}
    prefix = "language_model." if k25 else ""
    for name, t in tensors.items():
        base = name.removesuffix("_scale_inv")
        shards[_shard_of(base, cfg["num_hidden_layers"])][prefix + name] = t
    top = wrap_k25(cfg, base_vocab) if k25 else cfg
    if k25:
        shards[num_shards].update(_vision_tensors(top["vision_config"], seed))
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in shards.items():
        file = f"model-{i}-of-{num_shards}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        os.chmod(out_dir / file, 0o644)  # safetensors writes through a private temp file
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    _write_json(out_dir / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(out_dir / "config.json", dict(sorted(top.items())))
    _write_json(out_dir / "generation_config.json",
                {"max_length": cfg["max_position_embeddings"], "eos_token_id": special_token_id(163586, base_vocab)})
    (out_dir / "tiktoken.model").write_text(tiktoken_model_text(ranks), encoding="ascii")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(base_vocab, k25=k25))
    return out_dir
