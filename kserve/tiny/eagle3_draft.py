"""A tiny random EAGLE-3 draft (`LlamaForCausalLMEagle3` layout) for a tiny target: what the tests speculate with."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def write_tiny_eagle3_draft(dir: str | os.PathLike, target_dir: str | os.PathLike, seed: int = 0,
                            draft_vocab_size: int = 512) -> Path:
    """A one-layer draft sized for the target at `target_dir`: its hidden size, its vocabulary (a draft
    vocabulary of `draft_vocab_size` ids mapped through `d2t`), bf16 safetensors and config.json."""
    from safetensors.torch import save_file

    from kserve.config import ModelConfig

    target = ModelConfig.from_model_dir(target_dir)
    hidden, heads, kv_heads, head_dim, inter = target.hidden_size, 4, 2, 32, 2 * target.hidden_size
    draft_vocab = min(draft_vocab_size, target.vocab_size)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab, "target_hidden_size": hidden,
        "torch_dtype": "bfloat16",
    }
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)

    # a draft vocabulary of the target's most common ids: here, evenly spread ids
    draft_ids = torch.linspace(0, target.vocab_size - 1, draft_vocab).round().long()
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": draft_ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True),
    }
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"))
    return out
