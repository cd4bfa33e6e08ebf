"""Typed model and engine configuration. Bottom of the import graph: imports nothing from kserve."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

SUPPORTED_MODEL_TYPES = ("kimi_k2", "deepseek_v3", "kimi_k25")
# Multimodal wrappers whose text model sits under `text_config` and whose text tensors carry a prefix.
_WRAPPER_TEXT_PREFIX = MappingProxyType({"kimi_k25": "language_model."})
# The chat dialect (kserve.chat.dialect) of a checkpoint that ships no template: K2.5 / K2.6 / K2.7-Code share
# the kimi_k25 wrapper (K2.6's format stands for them), K2-Thinking is kimi_k2 with INT4 experts.
CHAT_DIALECT_KIMI_K25 = "k2.6"
CHAT_DIALECT_K2_THINKING = "k2-thinking"
CHAT_DIALECT_K2 = "k2"
VISION_TENSOR_PREFIXES = ("vision_tower.", "mm_projector.")
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
    """FP8 block quantization, as in config.json's `quantization_config` (K2-Instruct, DeepSeek-V3)."""

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


# Module names a K2 INT4 checkpoint must keep in bf16 (its `ignore` list has to match each): kserve runs INT4
# on routed experts only.
_BF16_MODULE_EXAMPLES = (
    "lm_head",
    "model.layers.1.self_attn.q_a_proj",
    "model.layers.1.self_attn.kv_b_proj",
    "model.layers.1.mlp.shared_experts.down_proj",
    "model.layers.0.mlp.gate_proj",
)
_INT4_MODULE_EXAMPLE = "model.layers.1.mlp.experts.0.gate_proj"
INT4_GROUP_SIZE = 32
SUPPORTED_QUANTIZATION = (
    "FP8 e4m3 in 128x128 blocks (quant_method 'fp8'), or compressed-tensors 'pack-quantized' INT4 "
    f"routed experts (4-bit symmetric int weights, strategy 'group', group_size {INT4_GROUP_SIZE}, no activation "
    "quantization)"
)


@dataclass(frozen=True)
class Int4ExpertQuant:
    """compressed-tensors `pack-quantized` W4A16 routed experts (K2-Thinking, K2.5, K2.6, K2.7-Code).

    Everything else stays bf16. Built only through `from_compressed_tensors`, which refuses any other scheme."""

    group_size: int = INT4_GROUP_SIZE
    ignore: tuple[str, ...] = ()

    @staticmethod
    def _refuse(field_name: str, value: Any, expected: str) -> ValueError:
        return ValueError(
            f"quantization_config.{field_name} = {value!r} is not supported (expected {expected}); "
            f"kserve supports {SUPPORTED_QUANTIZATION}"
        )

    @classmethod
    def from_compressed_tensors(cls, raw: dict[str, Any]) -> "Int4ExpertQuant":
        fmt = raw.get("format")
        if fmt != "pack-quantized":
            raise cls._refuse("format", fmt, "'pack-quantized'")
        groups = raw.get("config_groups") or {}
        if len(groups) != 1:
            raise cls._refuse("config_groups", sorted(groups), "exactly one group")
        (name, group), = groups.items()
        where = f"config_groups.{name}"
        weights = group.get("weights") or {}
        for key, expected in (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group"),
                              ("group_size", INT4_GROUP_SIZE), ("dynamic", False)):
            if weights.get(key) != expected and not (key == "dynamic" and key not in weights):
                raise cls._refuse(f"{where}.weights.{key}", weights.get(key), repr(expected))
        if weights.get("actorder"):
            raise cls._refuse(f"{where}.weights.actorder", weights["actorder"], "null (no activation reordering)")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise cls._refuse(f"{where}.{key}", group[key], "null (weight-only W4A16)")
        if raw.get("kv_cache_scheme"):
            raise cls._refuse("kv_cache_scheme", raw["kv_cache_scheme"], "null")
        quant = cls(group_size=INT4_GROUP_SIZE, ignore=tuple(raw.get("ignore") or ()))
        kept = [m for m in _BF16_MODULE_EXAMPLES if not quant.ignores(m)]
        if kept or quant.ignores(_INT4_MODULE_EXAMPLE):
            raise cls._refuse(
                "ignore", list(quant.ignore),
                "a list that keeps attention, shared experts, dense MLPs and lm_head in bf16 and quantizes routed "
                f"experts (it {'quantizes ' + kept[0] if kept else 'leaves the routed experts unquantized'})",
            )
        return quant

    def ignores(self, module: str) -> bool:
        """compressed-tensors' matching: `re:` patterns by re.match, other entries by exact name."""
        return any(
            re.match(p[3:], module) if p.startswith("re:") else p == module for p in self.ignore
        )


def parse_quantization_config(raw: dict[str, Any] | None) -> QuantConfig | Int4ExpertQuant | None:
    """The checkpoint's quantization, or a ValueError naming the field and value and what is supported."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return Int4ExpertQuant.from_compressed_tensors(raw)
    if method in ("fp8", None):  # early DeepSeek-V3 configs name no method
        q_known = {f.name for f in fields(QuantConfig)}
        q = {k: v for k, v in raw.items() if k in q_known}
        if "weight_block_size" in q:
            q["weight_block_size"] = tuple(q["weight_block_size"])
        return QuantConfig(**q)
    raise ValueError(
        f"quantization_config.quant_method = {method!r} is not supported; kserve supports {SUPPORTED_QUANTIZATION}"
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
    quantization_config: QuantConfig | Int4ExpertQuant | None = None
    # Where the text model's tensors sit in the checkpoint ("language_model." in a kimi_k25 wrapper).
    weight_prefix: str = ""
    # The family member's chat format when the checkpoint ships no chat template (a shipped one decides itself).
    chat_dialect: str = CHAT_DIALECT_K2
    # A multimodal wrapper's vision tower (its `vision_config`) and the token id each image embedding replaces.
    vision_config: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    media_placeholder_token_id: int | None = None

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The FP8 weight block when the checkpoint is block FP8, else None."""
        q = self.quantization_config
        return tuple(q.weight_block_size) if isinstance(q, QuantConfig) else None

    @property
    def int4_group_size(self) -> int | None:
        """The INT4 group of the routed experts when they are pack-quantized INT4, else None."""
        q = self.quantization_config
        return q.group_size if isinstance(q, Int4ExpertQuant) else None

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
        """A K2 / DeepSeek-V3 config.json, or a kimi_k25 wrapper's: its text model from `text_config`, the
        quantization config wherever it sits, EOS from the wrapper (K2.6: <|im_end|>)."""
        model_type = raw.get("model_type", "kimi_k2")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        weight_prefix = _WRAPPER_TEXT_PREFIX.get(model_type, "")
        vision = {"vision_config": raw.get("vision_config"),
                  "media_placeholder_token_id": raw.get("media_placeholder_token_id")}
        if weight_prefix:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"a {model_type} config.json needs its text model under 'text_config'")
            quant = text.get("quantization_config") or raw.get("quantization_config")
            wrapper_keys = ("eos_token_id", "bos_token_id", "tie_word_embeddings")
            raw = {**text, **{k: raw[k] for k in wrapper_keys if k in raw}, "model_type": model_type}
        else:
            quant = raw.get("quantization_config")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in raw.items() if k in known}
        if "torch_dtype" not in raw and isinstance(raw.get("dtype"), str):  # transformers >= 4.56 writes `dtype`
            kwargs["torch_dtype"] = raw["dtype"]
        rope = raw.get("rope_scaling")
        if rope:
            rope = dict(rope)
            rope.setdefault("type", rope.pop("rope_type", "yarn"))
            rope_known = {f.name for f in fields(RopeScaling)}
            kwargs["rope_scaling"] = RopeScaling(**{k: v for k, v in rope.items() if k in rope_known})
        else:
            kwargs["rope_scaling"] = None
        kwargs["quantization_config"] = parse_quantization_config(quant)
        kwargs["weight_prefix"] = weight_prefix
        if weight_prefix:
            kwargs["chat_dialect"] = CHAT_DIALECT_KIMI_K25
            kwargs.update(vision)
        elif isinstance(kwargs["quantization_config"], Int4ExpertQuant):
            kwargs["chat_dialect"] = CHAT_DIALECT_K2_THINKING
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
    # decode context parallelism: shard the KV cache by token over groups of this many tensor-parallel ranks
    decode_context_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # per-step token budget for chunked prefill
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = size from memory
    # vLLM's meaning: the share of the accelerator's TOTAL memory this engine may use for weights,
    # activations (measured by a profiling forward) and the KV cache together.
    gpu_memory_utilization: float = 0.9
    # KV cache budget on CPU (no profiling there): 1.25 GiB, 131,072 tokens of the embedded model (half its context)
    kv_cache_cpu_bytes: int = 5 << 28
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype; "fp8" = float8_e4m3fn latents with a scale
    # most cached context positions one prefill decompresses at once (longer contexts go in chunks)
    context_chunk_tokens: int = 8192
    enforce_eager: bool = False  # True = never capture CUDA graphs
    # True = a request's logits do not depend on its batch (fixed reduction orders; slower)
    batch_invariant: bool = False
    # speculative decoding, vLLM's keys: {"method": "ngram" | "eagle3", "num_speculative_tokens": k, ...}
    # (a JSON string or a dict; kserve/engine/speculative.py)
    speculative_config: Any = None
    # True = do not load a multimodal checkpoint's vision tower (saves its memory; image requests get a 400)
    language_model_only: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check_context_parallel(self.tensor_parallel_size, self.decode_context_parallel_size)
        if self.context_chunk_tokens < 1:
            raise ValueError(f"context_chunk_tokens must be positive, got {self.context_chunk_tokens}")


def check_context_parallel(tp_size: int, dcp_size: int) -> None:
    """Raise ValueError naming both sizes when decode context parallelism cannot run on this layout."""
    if dcp_size < 1:
        raise ValueError(f"--decode-context-parallel-size must be at least 1, got {dcp_size}")
    if dcp_size > 1 and tp_size == 1:
        raise ValueError(
            f"--decode-context-parallel-size {dcp_size} needs tensor parallelism: it shards the KV cache over "
            f"the tensor-parallel ranks, and --tensor-parallel-size is {tp_size}"
        )
    if tp_size % dcp_size:
        raise ValueError(
            f"--decode-context-parallel-size {dcp_size} does not divide --tensor-parallel-size {tp_size}"
        )
