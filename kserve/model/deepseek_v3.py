"""Kimi K2 / DeepSeek-V3 in one file: MLA attention over a paged latent cache, noaux_tc MoE.

Parameter names follow the checkpoint (`model.layers.N.self_attn.q_a_proj.weight`, ...), except
that routed experts are stacked per layer (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
"""

from __future__ import annotations

import torch
from torch import nn

from kserve.config import ModelConfig
from kserve.distributed import ParallelState
from kserve.kernels import dense_gemm
from kserve.kernels.mla_decode import mla_decode
from kserve.layers.embedding import LMHead, VocabEmbedding
from kserve.layers.linear import ColumnParallelLinear, LatentUpProjection, ReplicatedLinear, RowParallelLinear
from kserve.layers.mla_attention import (
    as_cached,
    attention_with_lse,
    gather_heads,
    merge_attention_states,
    merge_context_parallel,
    read_latents,
    varlen_causal_attention,
    write_latents,
)
from kserve.layers.mlp import GatedMLP
from kserve.layers.moe import DeepseekMoE
from kserve.layers.norm import RMSNorm
from kserve.layers.rotary import RopeAngles, YarnRotaryEmbedding
from kserve.model.forward_batch import ForwardBatch

# "quantized": FP8 and INT4 tensors stay as the checkpoint stores them; "dequantized": every weight in the
# model dtype (references, parity tests).
WEIGHT_MODES = ("quantized", "dequantized")
# DeepSeek's reference and transformers build the two latent norms with the default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention, heads split over tensor-parallel ranks.

    Prefill-like sequences (query_len > 1) decompress their cached context through kv_b_proj
    ("naive" path), in bounded chunks merged by log-sum-exp when the batch says so; decode sequences
    (query_len == 1) absorb W_UK into the query and W_UV into the output and attend over the latents
    directly ("absorbed" path). Under decode context parallelism each rank attends the group's heads
    over the tokens it holds and the group merges the results (kserve/layers/mla_attention.py).
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        if config.num_attention_heads % parallel.tp_size:
            raise ValueError(
                f"num_attention_heads = {config.num_attention_heads} heads do not split over "
                f"tensor-parallel size {parallel.tp_size}"
            )
        self.num_heads = config.num_attention_heads // parallel.tp_size
        self.qk_nope = config.qk_nope_head_dim
        self.qk_rope = config.qk_rope_head_dim
        self.v_head = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.softmax_scale
        # Batch-invariant mode (set_batch_invariant): every query token, prefill ones included, attends in the
        # absorbed form, one row per token (kserve/layers/mla_attention.py absorbed_attention_batch_invariant).
        self.batch_invariant = False
        heads = config.num_attention_heads
        kw = {"dtype": dtype, "device": device}
        lin = dict(kw, quant_block=quant_block)
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * config.qk_head_dim, parallel, **lin)
        else:
            self.q_a_proj = ReplicatedLinear(config.hidden_size, config.q_lora_rank, **lin)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * config.qk_head_dim, parallel, **lin)
        self.kv_a_proj_with_mqa = ReplicatedLinear(config.hidden_size, config.kv_cache_dim, **lin)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS, **kw)
        # Dequantized at load even from an FP8 checkpoint (as vLLM does): the absorbed decode path
        # needs W_UK / W_UV as dense matrices, and kv_b_proj is ~0.05% of K2's weights.
        self.kv_b_proj = LatentUpProjection(config.kv_lora_rank, heads, self.qk_nope, self.v_head, parallel, **kw)
        self.o_proj = RowParallelLinear(heads * self.v_head, config.hidden_size, parallel, **lin)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.qk_nope + self.qk_rope)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rope: RopeAngles,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self._queries(x)
        q_nope, q_pe = q.split([self.qk_nope, self.qk_rope], dim=-1)
        q_pe = rope.rotate(q_pe)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        k_pe = rope.rotate(kv[:, self.kv_lora_rank :])
        latents = torch.cat([c_kv, k_pe], dim=-1)
        write_latents(cache, batch.slot_mapping, latents, batch.kv_scale)

        # decode rows first, then prefill rows: the split is host ints from the runner
        num_decode = batch.num_decode_seqs
        parts = []
        if num_decode:
            tables, lens = batch.block_tables[:num_decode], batch.context_lens[:num_decode]
            parts.append(self._absorbed(q_nope[:num_decode], q_pe[:num_decode], tables, lens, batch, cache))
        if batch.prefill is not None:
            start = batch.prefill.token_start
            if batch.prefill.row_block_tables is not None:  # a few tokens after a cached prefix: a verify
                tables, lens = batch.prefill.row_block_tables, batch.prefill.row_context_lens
                parts.append(self._absorbed(q_nope[start:], q_pe[start:], tables, lens, batch, cache))
            elif batch.prefill.context_chunks is None:
                parts.append(self._naive(q_nope[start:], q_pe[start:], batch, cache))
            else:
                parts.append(self._naive_chunked(q_nope[start:], q_pe[start:], latents[start:], batch, cache))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head))

    def _absorbed(self, q_nope, q_pe, tables, lens, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        """Decode rows [D] at once through the paged decode kernel, row d over block table tables[d] and
        its first lens[d] positions: [D, H, v_head]."""
        w_uk, w_uv = self.kv_b_proj.absorption_weights()
        dcp = batch.context_parallel
        if self.batch_invariant and dcp is None:
            from kserve.layers.mla_attention import absorbed_attention_batch_invariant

            return absorbed_attention_batch_invariant(
                q_nope, q_pe, w_uk, w_uv, cache, tables, lens, self.scale, batch.kv_scale
            )
        q_lat = dense_gemm.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [D, H, C]
        if dcp is None:
            o_lat = mla_decode(q_lat, q_pe, cache, tables, lens, self.scale, batch.kv_scale)
        else:  # the group's heads over this rank's tokens, then an exact merge across the group
            query = gather_heads(torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1), dcp)
            o_lat, lse = mla_decode(
                query[..., : self.kv_lora_rank], query[..., self.kv_lora_rank :], cache, tables, lens,
                self.scale, batch.kv_scale, return_lse=True,
            )
            o_lat = merge_context_parallel(o_lat, lse, dcp)
        return dense_gemm.bmm(o_lat.to(w_uv.dtype).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _decompress(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [S, C + R] -> keys [S, H, nope + rope] and values [S, H, v_head] through kv_b_proj."""
        c_kv, k_pe = latents[:, : self.kv_lora_rank], latents[:, self.kv_lora_rank :]
        kv = self.kv_b_proj(c_kv)  # every head's keys, then every head's values
        keys = self.num_heads * self.qk_nope
        k_nope = kv[:, :keys].view(latents.shape[0], self.num_heads, self.qk_nope)
        v = kv[:, keys:].view(latents.shape[0], self.num_heads, self.v_head)
        return torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1), v

    def _naive(self, q_nope, q_pe, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        """All prefill sequences at once: one gather of their contexts, one kv_b_proj, one varlen attention.
        Batch-invariant mode: each query token as its own row of the absorbed attention."""
        prefill = batch.prefill
        if self.batch_invariant and batch.context_parallel is None:
            from kserve.layers.mla_attention import absorbed_attention_batch_invariant, prefill_rows

            w_uk, w_uv = self.kv_b_proj.absorption_weights()
            row_table, row_context = prefill_rows(prefill.query_lens, prefill.context_lens)
            lens = torch.tensor(row_context, dtype=torch.int32).to(q_nope.device, non_blocking=True)
            return absorbed_attention_batch_invariant(
                q_nope, q_pe, w_uk, w_uv, cache, batch.block_tables[batch.num_decode_seqs :], lens, self.scale,
                batch.kv_scale, row_table=row_table, row_context=row_context,
            )
        latents = read_latents(cache, prefill.context_slots, q_nope.dtype, batch.kv_scale)
        k, v = self._decompress(latents)
        qry = torch.cat([q_nope, q_pe], dim=-1)
        return varlen_causal_attention(
            qry, k, v, prefill.query_lens, prefill.context_lens, prefill.cu_seqlens_q, prefill.cu_seqlens_k, self.scale,
            prefill.dense_mask,
        )

    def _naive_chunked(self, q_nope, q_pe, new_latents, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        """Prefill sequences one by one: the new tokens causally from this step's latents (as the cache holds
        them), then each chunk of the cached prefix (gathered from the group under DCP), merged by LSE.
        Batch-invariant mode (without DCP): as `_naive`'s, which walks any context in bounded tiles."""
        prefill = batch.prefill
        dcp = batch.context_parallel
        if self.batch_invariant and dcp is None:
            return self._naive(q_nope, q_pe, batch, cache)
        qry = torch.cat([q_nope, q_pe], dim=-1)
        new_latents = as_cached(new_latents, cache.dtype, batch.kv_scale)
        out = qry.new_empty(qry.shape[0], self.num_heads, self.v_head)
        start = 0
        for seq, q_len in enumerate(prefill.query_lens):
            queries = qry[start : start + q_len]
            k, v = self._decompress(new_latents[start : start + q_len])
            seq_out, seq_lse = attention_with_lse(queries, k, v, self.scale, causal=True)
            del k, v
            for chunk in prefill.context_chunks:
                if chunk.seq != seq:
                    continue
                rows = read_latents(cache, chunk.slots, qry.dtype, batch.kv_scale)
                if dcp is not None:  # group rank r holds positions start + r, start + r + dcp, ...
                    rows = dcp.all_gather(rows).transpose(0, 1).reshape(-1, rows.shape[-1])[: chunk.end - chunk.start]
                k, v = self._decompress(rows)
                chunk_out, chunk_lse = attention_with_lse(queries, k, v, self.scale, causal=False)
                del k, v
                seq_out, seq_lse = merge_attention_states(seq_out, seq_lse, chunk_out, chunk_lse)
            out[start : start + q_len] = seq_out.to(out.dtype)
            start += q_len
        return out


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_block: tuple[int, int] | None = None,
        int4_group: int | None = None,
    ):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        qkw = dict(kw, quant_block=quant_block)
        self.self_attn = MLAttention(config, parallel, **qkw)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_idx):
            self.mlp = DeepseekMoE(config, parallel, int4_group=int4_group, **qkw)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, parallel, **qkw)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(self, hidden, batch, cache, rope: RopeAngles) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), batch, cache, rope)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekV3Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_block: tuple[int, int] | None = None,
        int4_group: int | None = None,
    ):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, parallel, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, parallel, quant_block=quant_block, int4_group=int4_group, **kw)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.rotary_emb = YarnRotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, device=device)

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, aux_layers: tuple[int, ...] = (),
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(input_ids)
        if images is not None:  # image embeddings replace their placeholders' token embeddings
            rows, embeds = images
            hidden = hidden.index_copy(0, rows, embeds.to(hidden.dtype))
        aux = []
        rope = self.rotary_emb.angles(batch.positions, hidden.dtype)  # every layer rotates by the same angles
        for index, (layer, cache) in enumerate(zip(self.layers, kv_cache)):
            if index in aux_layers:  # the residual stream entering this layer (EAGLE-3's auxiliary states)
                aux.extend([hidden] * aux_layers.count(index))
            hidden = layer(hidden, batch, cache, rope)
        if not aux_layers:
            return self.norm(hidden)
        by_layer = dict(zip(sorted(aux_layers), aux))
        return self.norm(hidden), torch.cat([by_layer[i] for i in aux_layers], dim=-1)


class KimiK2ForCausalLM(nn.Module):
    """`model(input_ids [T], batch, kv_cache [L, blocks, block_size, kv_cache_dim])` -> final-normed hidden [T, H].

    `weights="quantized"` (default) stores an FP8 checkpoint's FP8 tensors as float8_e4m3fn with their fp32
    scales (kv_b_proj excepted, see MLAttention) and INT4 experts packed with their bf16 group scales;
    `weights="dequantized"` stores every weight in `dtype`.
    Construction checks that the tensor-parallel size divides what it must split (naming the number).
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        weights: str = "quantized",
    ):
        super().__init__()
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
        parallel = parallel if parallel is not None else ParallelState()  # None: one process
        check_tensor_parallel(config, parallel.tp_size)
        self.config = config
        self.parallel = parallel
        self.weights = weights
        stored = weights == "quantized"
        self.model = DeepseekV3Model(
            config, parallel, dtype=dtype, device=device,
            quant_block=config.fp8_block if stored else None,
            int4_group=config.int4_group_size if stored else None,
        )
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, parallel, dtype=dtype, device=device)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, aux_layers: tuple[int, ...] = (),
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final-normed hidden [T, H]; with `aux_layers`, also the residual stream entering each of those layers,
        concatenated in that order [T, len(aux_layers) * H] (what an EAGLE-3 draft reads). `images`: (rows,
        embeddings) that replace those rows' token embeddings (a multimodal prompt's image placeholders)."""
        if kv_cache.shape[0] != self.config.num_hidden_layers or kv_cache.shape[-1] != self.config.kv_cache_dim:
            raise ValueError(
                f"kv_cache shape {tuple(kv_cache.shape)} does not fit {self.config.num_hidden_layers} layers "
                f"x kv_cache_dim {self.config.kv_cache_dim}"
            )
        if input_ids.shape[0] != sum(batch.query_lens) or batch.num_tokens != input_ids.shape[0]:
            raise ValueError(
                f"{input_ids.shape[0]} input ids but the batch has {sum(batch.query_lens)} query tokens "
                f"and {batch.num_tokens} positions"
            )
        if kv_cache.shape[2] != batch.block_size:
            raise ValueError(f"kv_cache block size {kv_cache.shape[2]} != batch block size {batch.block_size}")
        return self.model(input_ids, batch, kv_cache, aux_layers, images)

    def set_batch_invariant(self, enabled: bool) -> None:
        """Switch every module that has a batch-invariant mode (a `batch_invariant` attribute) into or out of
        it: then a row's results do not depend on the other rows of the batch. Set once, before serving."""
        for module in self.modules():
            if hasattr(module, "batch_invariant"):
                module.batch_invariant = enabled

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab_size]. Under tensor parallelism this all-gathers the vocabulary
        shards, so every rank must call it for the same rows."""
        return self.lm_head(hidden)


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError naming the config field when `tp_size` does not divide what it splits."""
    if tp_size < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp_size}")
    splits = {
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": (
            config.intermediate_size if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)) else 0
        ),
    }
    if config.n_routed_experts:
        splits["n_routed_experts"] = config.n_routed_experts
        splits["moe_intermediate_size * n_shared_experts"] = config.moe_intermediate_size * config.n_shared_experts
    for field, value in splits.items():
        if value % tp_size:
            raise ValueError(f"{field} = {value} is not divisible by tensor-parallel size {tp_size}")


def kv_cache_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of latent cache per token over all layers (on every tensor-parallel rank that holds the token:
    all of them, or one rank of each decode-context-parallel group);
    `dtype` is the cache's (torch.float8_e4m3fn for the FP8 cache: one byte per value, one global scale)."""
    return config.num_hidden_layers * config.kv_cache_dim * torch.empty((), dtype=dtype).element_size()
