"""Typed model and engine configuration. Bottom of the import graph: imports nothing from kserve."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters as they appear under `rope_scaling` in config.json."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    type: str = "yarn"


@dataclass(frozen=True)
class QuantConfig:
    """FP8 block quantization, as in config.json's `quantization_config`."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        # Everything FP8 here (checkpoint scales, the block-FP8 GEMM, the fused MoE) is 128x128 e4m3.
        if tuple(self.weight_block_size) != (128, 128):
            raise ValueError(
                f"quantization_config.weight_block_size {list(self.weight_block_size)} is not supported: "
                "kserve runs block FP8 with 128x128 blocks only"
            )
        if self.quant_method != "fp8" or self.fmt != "e4m3":
            raise ValueError(
                f"quantization_config quant_method={self.quant_method!r} fmt={self.fmt!r} is not supported: "
                "expected quant_method 'fp8', fmt 'e4m3'"
            )
        if self.activation_scheme != "dynamic":
            raise ValueError(
                f"quantization_config.activation_scheme {self.activation_scheme!r} is not supported: expected 'dynamic'"
            )


def yarn_mscale(scale: float, mscale: float) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a DeepSeek-V3 / Kimi K2 config.json that defines the computation."""

    model_type: str = "kimi_k2"
    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.827
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163585
    num_nextn_predict_layers: int = 0
    torch_dtype: str = "bfloat16"
    quantization_config: QuantConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values stored per token per layer in the latent cache: c_kv then the roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type", "kimi_k2")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in raw.items() if k in known}
        rope = raw.get("rope_scaling")
        if rope:
            rope = dict(rope)
            rope.setdefault("type", rope.pop("rope_type", "yarn"))
            rope_known = {f.name for f in fields(RopeScaling)}
            kwargs["rope_scaling"] = RopeScaling(**{k: v for k, v in rope.items() if k in rope_known})
        else:
            kwargs["rope_scaling"] = None
        quant = raw.get("quantization_config")
        if quant:
            q_known = {f.name for f in fields(QuantConfig)}
            q = {k: v for k, v in quant.items() if k in q_known}
            if "weight_block_size" in q:
                q["weight_block_size"] = tuple(q["weight_block_size"])
            kwargs["quantization_config"] = QuantConfig(**q)
        else:
            kwargs["quantization_config"] = None
        return cls(**kwargs)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))


@dataclass
class EngineConfig:
    """Knobs for the serving engine; defaults suit the CPU tiny model."""

    model: str | None = None  # model directory; None = the embedded tiny model
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # per-step token budget for chunked prefill
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = size from memory
    # vLLM's meaning: the share of the accelerator's TOTAL memory this engine may use for weights,
    # activations (measured by a profiling forward) and the KV cache together.
    gpu_memory_utilization: float = 0.9
    # KV cache budget on CPU (no profiling there): 1.25 GiB holds the embedded model's whole 131,072-token context
    kv_cache_cpu_bytes: int = 5 << 28
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype; "fp8" = float8_e4m3fn latents with a scale
    enforce_eager: bool = False  # True = never capture CUDA graphs
    enable_prefix_caching: bool = True
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
