"""Memory planning: what one tensor-parallel rank holds, and how much KV cache fits beside it.

Weights come from a `meta`-device build of the engine's own model; the KV budget is the engine's arithmetic
(`kv_cache_budget_bytes`), with estimated activations and a fixed overhead reserve for what only a GPU measures.
Details: docs/memory.md, 'Memory planning'.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kserve.config import ModelConfig, check_context_parallel
from kserve.distributed import ParallelState
from kserve.model.forward_batch import DEFAULT_CONTEXT_CHUNK_TOKENS

GIB = 1 << 30
DEFAULT_OVERHEAD_BYTES = 2 * GIB
_FP8_BLOCK = 128


def kv_cache_budget_bytes(
    total_bytes: int, gpu_memory_utilization: float, weights_bytes: int, activation_bytes: int, overhead_bytes: int
) -> int:
    """Bytes left for the KV cache (negative when the rest already does not fit)."""
    return int(total_bytes * gpu_memory_utilization) - weights_bytes - activation_bytes - overhead_bytes


def kv_blocks_for_budget(budget_bytes: int, bytes_per_token: int, block_size: int, reserved_blocks: int = 0) -> int:
    """Whole cache blocks in `budget_bytes`, less `reserved_blocks` (the runner's scratch block); >= 0."""
    return max(0, budget_bytes // (bytes_per_token * block_size) - reserved_blocks)


def kv_cache_dtype_for(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")


def build_meta_model(
    config: ModelConfig, tp_size: int = 1, tp_rank: int = 0, dtype: torch.dtype = torch.bfloat16, weights: str = "quantized"
):
    """The engine's model for one rank, on the meta device (no memory, no data)."""
    from kserve.model.deepseek_v3 import KimiK2ForCausalLM

    with torch.device("meta"):
        return KimiK2ForCausalLM(config, ParallelState(tp_rank, tp_size), dtype=dtype, device="meta", weights=weights)


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (each storage counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _rank_signature(config: ModelConfig, tp_size: int, rank: int) -> tuple:
    """What makes one rank's shapes differ from another's: where its shards start within a 128
    block (padding) and how many real vocabulary rows it holds. Ranks with equal signatures hold
    equal bytes, so the plan builds one model per distinct signature."""
    p = ParallelState(rank, tp_size)
    splits = [
        config.num_attention_heads * config.qk_head_dim,
        config.num_attention_heads * config.v_head_dim,
        config.intermediate_size,
        config.moe_intermediate_size * config.n_shared_experts,
    ]
    offsets = tuple(p.shard_range(n)[0] % _FP8_BLOCK if n % tp_size == 0 else None for n in splits)
    start, end = p.padded_shard_range(config.vocab_size)
    return offsets, max(0, min(end, config.vocab_size) - start)


def weights_bytes_per_rank(
    config: ModelConfig, tp_size: int, dtype: torch.dtype = torch.bfloat16, weights: str = "quantized"
) -> list[int]:
    """Parameter + buffer bytes of every rank's model, from meta builds (one per distinct rank shape)."""
    by_signature: dict[tuple, int] = {}
    out = []
    for rank in range(tp_size):
        sig = _rank_signature(config, tp_size, rank)
        if sig not in by_signature:
            by_signature[sig] = tensor_bytes(build_meta_model(config, tp_size, rank, dtype, weights))
        out.append(by_signature[sig])
    return out


def estimate_activation_bytes(
    config: ModelConfig,
    tp_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: torch.dtype,
    context_chunk_tokens: int = DEFAULT_CONTEXT_CHUNK_TOKENS,
) -> int:
    """A planning estimate of one rank's peak activation memory for a step of `max_num_batched_tokens`
    tokens in one prefill over a long cached context: the engine measures the real figure.

    Counted: a dozen hidden-sized fp32 temporaries per token (residual, norms, the fp32 copy the
    activation quantizer makes, the all-reduce buffer); attention's per-rank queries and outputs, and
    the kv_b_proj decompression of at most max(chunk, context_chunk_tokens) context tokens (longer
    contexts go in chunks of that many, merged by log-sum-exp); the MoE's worst case of every routed
    pair on this rank (fp32 per-pair outputs and the gate/up intermediate); eager attention scores for
    the chunk; and the LM head's logits for up to `max_num_seqs` rows, local plus gathered, in fp32.
    """
    t = max_num_batched_tokens
    c = config
    a = torch.empty((), dtype=dtype).element_size()
    heads = c.num_attention_heads // tp_size
    hidden = 12 * t * c.hidden_size * 4
    decompressed = max(t, context_chunk_tokens)
    attention = heads * a * 2 * (
        t * (c.qk_head_dim + c.v_head_dim) + decompressed * (c.qk_head_dim + c.qk_nope_head_dim + c.v_head_dim)
    )
    scores = heads * t * t * 4
    pairs = t * c.num_experts_per_tok
    moe = pairs * (c.hidden_size * 4 + 3 * c.moe_intermediate_size * a) if c.n_routed_experts else 0
    dense = t * 3 * (c.intermediate_size // tp_size) * a
    rows = min(max_num_seqs, t)
    logits = rows * c.vocab_size * 4 * 3
    return hidden + attention + scores + max(moe, dense) + logits


@dataclass
class MemoryPlan:
    model: str
    tp_size: int
    decode_context_parallel_size: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_batched_tokens: int
    kv_cache_dtype: str
    weights_per_rank_bytes: int  # rank 0
    weights_max_rank_bytes: int
    activation_reserve_bytes: int
    overhead_bytes: int
    kv_cache_bytes: int  # per rank
    kv_bytes_per_token: int  # on the rank that holds the token
    kv_tokens: int  # per decode-context-parallel group (all ranks when it is 1)
    concurrent_seqs_at_max_model_len: int
    fits: bool
    why: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def format_text(self) -> str:
        g = lambda n: f"{n / GIB:,.2f} GiB"
        lines = [
            f"model                      {self.model}",
            f"tensor parallel            {self.tp_size} ranks",
            f"decode context parallel    {self.decode_context_parallel_size}"
            + (" (each rank holds 1/%d of every sequence's cache)" % self.decode_context_parallel_size
               if self.decode_context_parallel_size > 1 else " (every rank holds every token's latent)"),
            (
                f"GPU memory                 {g(self.gpu_memory_bytes)} x {self.gpu_memory_utilization} usable"
                f" = {g(int(self.gpu_memory_bytes * self.gpu_memory_utilization))}"
            ),
            f"weights per rank           {g(self.weights_per_rank_bytes)} ({self.weights_per_rank_bytes:,} B, rank 0)",
        ]
        if self.weights_max_rank_bytes != self.weights_per_rank_bytes:
            lines.append(f"weights, largest rank      {g(self.weights_max_rank_bytes)}")
        lines += [
            f"activation reserve         {g(self.activation_reserve_bytes)} (estimate at {self.max_num_batched_tokens} batched tokens)",
            f"overhead reserve           {g(self.overhead_bytes)} (CUDA context, NCCL, workspaces, CUDA graphs)",
            f"KV cache                   {g(max(0, self.kv_cache_bytes))} per rank",
            f"KV bytes per token         {self.kv_bytes_per_token:,} ({self.kv_cache_dtype})",
            f"KV tokens                  {self.kv_tokens:,}",
            f"full-length sequences      {self.concurrent_seqs_at_max_model_len} (of {self.max_model_len:,} tokens)",
            f"fits                       {'yes' if self.fits else 'no'}: {self.why}",
        ]
        return "\n".join(lines)


def plan_memory(
    config: ModelConfig,
    tp_size: int,
    gpu_memory_bytes: int,
    *,
    model_name: str = "",
    max_model_len: int | None = None,
    kv_cache_dtype: str = "auto",
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
    decode_context_parallel_size: int = 1,
    context_chunk_tokens: int = DEFAULT_CONTEXT_CHUNK_TOKENS,
) -> MemoryPlan:
    """Under decode context parallelism each rank's cache holds 1/dcp of every sequence, so the same bytes
    per rank hold dcp times the tokens."""
    from kserve.model.deepseek_v3 import check_tensor_parallel, kv_cache_bytes_per_token

    check_tensor_parallel(config, tp_size)
    check_context_parallel(tp_size, decode_context_parallel_size)
    max_model_len = max_model_len or config.max_position_embeddings
    per_rank = weights_bytes_per_rank(config, tp_size, dtype)
    weights = max(per_rank)
    activation = estimate_activation_bytes(
        config, tp_size, max_num_batched_tokens, max_num_seqs, dtype, context_chunk_tokens
    )
    budget = kv_cache_budget_bytes(gpu_memory_bytes, gpu_memory_utilization, weights, activation, overhead_bytes)
    per_token = kv_cache_bytes_per_token(config, kv_cache_dtype_for(kv_cache_dtype, dtype))
    blocks = kv_blocks_for_budget(budget, per_token, block_size, reserved_blocks=1)
    tokens = blocks * block_size * decode_context_parallel_size
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    if weights > usable:
        fits, why = False, (
            f"the weights alone ({weights / GIB:.2f} GiB per rank) exceed the usable "
            f"{usable / GIB:.2f} GiB: use more ranks or a larger GPU"
        )
    elif budget <= 0 or tokens == 0:
        fits, why = False, (
            f"weights {weights / GIB:.2f} + activations {activation / GIB:.2f} + overhead {overhead_bytes / GIB:.2f} GiB "
            f"leave no room for the KV cache in {usable / GIB:.2f} GiB"
        )
    elif tokens < max_model_len:
        fp8_hint = "" if kv_cache_dtype == "fp8" else "use --kv-cache-dtype fp8, "
        fits, why = False, (
            f"the KV cache holds {tokens:,} tokens, fewer than one {max_model_len:,}-token sequence: lower "
            f"--max-model-len, {fp8_hint}raise --gpu-memory-utilization or use more ranks"
        )
    else:
        fits, why = True, f"{tokens // max_model_len} sequence(s) of {max_model_len:,} tokens fit in the KV cache"
    return MemoryPlan(
        model=model_name,
        tp_size=tp_size,
        decode_context_parallel_size=decode_context_parallel_size,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_dtype=kv_cache_dtype,
        weights_per_rank_bytes=per_rank[0],
        weights_max_rank_bytes=weights,
        activation_reserve_bytes=activation,
        overhead_bytes=overhead_bytes,
        kv_cache_bytes=budget,
        kv_bytes_per_token=per_token,
        kv_tokens=tokens,
        concurrent_seqs_at_max_model_len=tokens // max_model_len,
        fits=fits,
        why=why,
    )


def load_plan_config(path: str | Path) -> ModelConfig:
    """A model directory (its config.json) or a config.json file itself."""
    path = Path(path)
    if path.is_dir():
        return ModelConfig.from_model_dir(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is neither a model directory nor a config file")
    return ModelConfig.from_dict(json.loads(path.read_text()))


__all__ = [
    "DEFAULT_OVERHEAD_BYTES",
    "MemoryPlan",
    "build_meta_model",
    "estimate_activation_bytes",
    "kv_blocks_for_budget",
    "kv_cache_budget_bytes",
    "load_plan_config",
    "plan_memory",
    "tensor_bytes",
    "weights_bytes_per_rank",
]
