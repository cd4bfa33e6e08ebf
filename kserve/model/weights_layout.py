"""The tensors a Kimi K2 / DeepSeek-V3 checkpoint holds, derived from its config.

One source of truth for the loader (what to expect) and the tiny-checkpoint writer (what to write).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kserve.config import ModelConfig
from kserve.kernels.int4_pack import packed_shape

FP8 = "fp8"  # float8_e4m3fn weight with an fp32 `<name>_scale_inv` of [ceil(out/B0), ceil(in/B1)]
# compressed-tensors pack-quantized: `<module>.weight_packed` int32 [out, in/8], `<module>.weight_scale` bf16
# [out, in/G] and `<module>.weight_shape` int32 [2] = [out, in] (kserve.kernels.int4_pack)
INT4 = "int4"
BF16 = "bf16"
FP32 = "fp32"
# A routed expert's projection: (layer's experts module, expert id, gate|up|down).
EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight(?:_packed)?$")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor, named without the checkpoint's `weight_prefix`. `shape` is the stored shape
    (for INT4 the packed one); `logical_shape` the weight's [out, in]."""

    name: str
    shape: tuple[int, ...]
    kind: str  # FP8, INT4, BF16 or FP32
    logical_shape: tuple[int, ...] = ()

    @property
    def scale_name(self) -> str:
        if self.kind == INT4:
            return self.name.removesuffix("_packed") + "_scale"
        return self.name + "_scale_inv"

    @property
    def shape_name(self) -> str:
        """INT4 only: the tensor recording the unpacked [out, in]."""
        return self.name.removesuffix("_packed") + "_shape"


def checkpoint_tensors(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor the model needs, in checkpoint order (scales are implied by FP8 specs)."""
    c = config
    linear = FP8 if c.fp8_block is not None else BF16
    expert_kind = INT4 if c.int4_group_size is not None else linear
    specs = [TensorSpec("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), BF16)]

    def lin(name: str, out: int, inp: int, kind: str = linear) -> None:
        if kind == INT4:
            specs.append(TensorSpec(name + ".weight_packed", packed_shape(out, inp), INT4, (out, inp)))
        else:
            specs.append(TensorSpec(name + ".weight", (out, inp), kind, (out, inp)))

    def mlp(prefix: str, inter: int, kind: str = linear) -> None:
        lin(prefix + ".gate_proj", inter, c.hidden_size, kind)
        lin(prefix + ".up_proj", inter, c.hidden_size, kind)
        lin(prefix + ".down_proj", c.hidden_size, inter, kind)

    heads = c.num_attention_heads
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        specs.append(TensorSpec(f"{p}.input_layernorm.weight", (c.hidden_size,), BF16))
        specs.append(TensorSpec(f"{p}.post_attention_layernorm.weight", (c.hidden_size,), BF16))
        a = f"{p}.self_attn"
        if c.q_lora_rank is None:
            lin(f"{a}.q_proj", heads * c.qk_head_dim, c.hidden_size)
        else:
            lin(f"{a}.q_a_proj", c.q_lora_rank, c.hidden_size)
            specs.append(TensorSpec(f"{a}.q_a_layernorm.weight", (c.q_lora_rank,), BF16))
            lin(f"{a}.q_b_proj", heads * c.qk_head_dim, c.q_lora_rank)
        lin(f"{a}.kv_a_proj_with_mqa", c.kv_cache_dim, c.hidden_size)
        specs.append(TensorSpec(f"{a}.kv_a_layernorm.weight", (c.kv_lora_rank,), BF16))
        lin(f"{a}.kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        lin(f"{a}.o_proj", c.hidden_size, heads * c.v_head_dim)
        if c.is_moe_layer(i):
            specs.append(TensorSpec(f"{p}.mlp.gate.weight", (c.n_routed_experts, c.hidden_size), BF16))
            specs.append(TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (c.n_routed_experts,), FP32))
            for e in range(c.n_routed_experts):
                mlp(f"{p}.mlp.experts.{e}", c.moe_intermediate_size, expert_kind)
            if c.n_shared_experts:
                mlp(f"{p}.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
        else:
            mlp(f"{p}.mlp", c.intermediate_size)
    specs.append(TensorSpec("model.norm.weight", (c.hidden_size,), BF16))
    specs.append(TensorSpec("lm_head.weight", (c.vocab_size, c.hidden_size), BF16))
    return specs


def layer_index(name: str) -> int | None:
    """N for `model.layers.N.*`, else None."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None
