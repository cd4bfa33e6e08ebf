"""transformers' DeepseekV3ForCausalLM with kserve's dequantized weights, as an independent reference.

transformers 5.x notes (checked against 5.24): rope is applied interleaved (`rope_interleave`),
YaRN comes from `rope_scaling`/`rope_parameters` with the same correction range and mscale as
DeepSeek's reference; the router masks non-selected groups with -inf (older transformers used 0.0,
which differs from DeepSeek-V3 when biased scores can be negative) and adds 1e-20 to the
renormalization denominator. Routed experts are stacked as gate_up_proj [E, 2I, H] (gate rows
first) and down_proj [E, H, I].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kserve.config import ModelConfig
from kserve.model.weights_layout import EXPERT_TENSOR



def hf_config(model_dir: str | Path):
    from transformers import DeepseekV3Config

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if "text_config" in raw:  # a kimi_k25 wrapper: the text model is a plain DeepSeek-V3
        raw = {**raw["text_config"], "eos_token_id": raw.get("eos_token_id")}
    raw = {k: v for k, v in raw.items() if k not in ("quantization_config", "auto_map", "model_type", "architectures")}
    raw["num_mtp_layers"] = 0
    cfg = DeepseekV3Config(**raw)
    cfg._attn_implementation = "eager"
    return cfg


def build_hf_reference(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import DeepseekV3ForCausalLM

    from kserve.model.loader import iter_checkpoint

    config = ModelConfig.from_model_dir(model_dir)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(hf_config(model_dir))
    state: dict[str, torch.Tensor] = {}
    inter = config.moe_intermediate_size
    for spec, tensor in iter_checkpoint(model_dir, config, torch.float32):
        m = EXPERT_TENSOR.match(spec.name)
        if not m:
            state[spec.name] = tensor
            continue
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down":
            key = f"{prefix}.down_proj"
            state.setdefault(key, torch.empty(config.n_routed_experts, config.hidden_size, inter))[e] = tensor
        else:
            key = f"{prefix}.gate_up_proj"
            buf = state.setdefault(key, torch.empty(config.n_routed_experts, 2 * inter, config.hidden_size))
            (buf[e, :inter] if proj == "gate" else buf[e, inter:]).copy_(tensor)
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent rotary buffers were created on meta: rebuild them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    model = model.to(dtype)
    for layer in model.model.layers:  # the router is computed in fp32 by transformers itself
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    return model.eval()
