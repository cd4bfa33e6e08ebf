"""EAGLE-3 drafts in the published layout (`LlamaForCausalLMEagle3`).

One Llama layer over the target's hidden states proposes argmax drafts; it keeps its own K/V per sequence.
Drafts it cannot run (MLA, RoPE scaling, several layers, no own embedding under TP) are refused by name.
Details: docs/speculative.md, 'The EAGLE-3 draft'.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kserve.engine.sequence import Sequence
from kserve.engine.speculative import SpeculativeConfig


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Eagle3Config:
        arch = (raw.get("architectures") or ["?"])[0]
        if raw.get("kv_lora_rank") or "Deepseek" in arch:
            raise ValueError(f"EAGLE-3 draft {arch!r} uses MLA attention (kv_lora_rank); kserve supports the "
                             "Llama-layer layout (LlamaForCausalLMEagle3) only")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE-3 draft has num_hidden_layers = {raw['num_hidden_layers']}; kserve supports 1")
        scaling = raw.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"EAGLE-3 draft rope_scaling {scaling!r} is not supported (plain RoPE only)")
        heads = raw["num_attention_heads"]
        eagle = raw.get("eagle_config") or {}
        layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 10000.0),
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            aux_layer_ids=tuple(layer_ids) if layer_ids else None,
        )


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's and SpecForge's choice: a low, a middle and a late layer."""
    return (min(2, num_target_layers - 1), num_target_layers // 2, max(0, num_target_layers - 3))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (rotate-half) RoPE on x [n, heads, dim] at `positions` [n]."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = positions.float()[:, None] * inv[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Eagle3Draft(nn.Module):
    """The draft's weights under their checkpoint names (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`)."""

    def __init__(self, config: Eagle3Config, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = c
        kw = {"dtype": dtype, "device": device}
        h, hd = c.hidden_size, c.head_dim
        self.fc = nn.Linear(3 * c.target_hidden_size, h, bias=False, **kw)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = nn.Parameter(torch.ones(h, **kw))
        self.midlayer.hidden_norm = nn.Parameter(torch.ones(h, **kw))
        self.midlayer.post_attention_layernorm = nn.Parameter(torch.ones(h, **kw))
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, c.num_heads * hd, bias=False, **kw)
        attn.k_proj = nn.Linear(2 * h, c.num_kv_heads * hd, bias=False, **kw)
        attn.v_proj = nn.Linear(2 * h, c.num_kv_heads * hd, bias=False, **kw)
        attn.o_proj = nn.Linear(c.num_heads * hd, h, bias=False, **kw)
        self.midlayer.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, c.intermediate_size, bias=False, **kw)
        mlp.up_proj = nn.Linear(h, c.intermediate_size, bias=False, **kw)
        mlp.down_proj = nn.Linear(c.intermediate_size, h, bias=False, **kw)
        self.midlayer.mlp = mlp
        self.norm = nn.Parameter(torch.ones(h, **kw))
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False, **kw)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long, device=device))
        self.embed_tokens: torch.Tensor | None = None  # [target vocab, hidden]: the draft's own or the target's

    def step(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor,
        past_v: torch.Tensor, past_pos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """n new pairs (embedding of token t+1, h_t) at `positions` over a past of K/V at `past_pos`.
        Returns (draft logits [n, draft_vocab] fp32, next h [n, hidden], new k, new v)."""
        c, layer = self.config, self.midlayer
        eps = c.rms_norm_eps
        residual = hidden
        x = torch.cat([_rms(embeds, layer.input_layernorm, eps), _rms(hidden, layer.hidden_norm, eps)], dim=-1)
        n = x.shape[0]
        q = _rope(layer.self_attn.q_proj(x).view(n, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = _rope(layer.self_attn.k_proj(x).view(n, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        v = layer.self_attn.v_proj(x).view(n, c.num_kv_heads, c.head_dim)
        keys, values = torch.cat([past_k, k]), torch.cat([past_v, v])
        key_pos = torch.cat([past_pos, positions])
        mask = key_pos[None, :] <= positions[:, None]  # causal by position (the past may have gaps)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
            scale=1.0 / math.sqrt(c.head_dim), enable_gqa=c.num_heads != c.num_kv_heads,
        ).transpose(0, 1).reshape(n, c.num_heads * c.head_dim)
        residual = residual + layer.self_attn.o_proj(out)
        mlp_in = _rms(residual, layer.post_attention_layernorm, eps)
        residual = residual + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(mlp_in)) * layer.mlp.up_proj(mlp_in))
        logits = self.lm_head(_rms(residual, self.norm, eps)).float()
        return logits, residual, k, v

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def load_eagle3_draft(model_dir: str | Path, *, dtype: torch.dtype, device: torch.device) -> Eagle3Draft:
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"EAGLE-3 draft directory {model_dir} has no config.json")
    config = Eagle3Config.from_dict(json.loads(config_path.read_text()))
    draft = Eagle3Draft(config, dtype=dtype, device=device)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    if not tensors:
        raise ValueError(f"EAGLE-3 draft directory {model_dir} has no .safetensors files")
    params = dict(draft.named_parameters()) | dict(draft.named_buffers())
    for name, value in tensors.items():
        if name == "t2d":
            continue
        if name == "embed_tokens.weight":
            draft.embed_tokens = value.to(device=device, dtype=dtype)
            continue
        key = name.replace(".weight", "") if name.endswith("norm.weight") else name
        if key not in params:
            raise ValueError(f"EAGLE-3 draft tensor {name!r} is not part of the LlamaForCausalLMEagle3 layout")
        target = params[key]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"EAGLE-3 draft tensor {name} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
    missing = [n for n in params if n not in {k.replace(".weight", "") if k.endswith("norm.weight") else k
                                              for k in tensors}]
    if missing:
        raise ValueError(f"EAGLE-3 draft {model_dir} lacks tensors {missing}")
    return draft.eval()


@dataclass
class _DraftCache:
    """One sequence's draft K/V (contiguous), the positions they sit at, and the pending first draft."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    length: int = 0
    next_logits: torch.Tensor | None = None  # the draft's prediction for the token after the last one
    next_hidden: torch.Tensor | None = None
    next_position: int = -1  # len(token_ids) - 1 when next_* are current


class Eagle3Proposer:
    """Keeps every running sequence's draft cache in step with the target; proposes k argmax drafts."""

    def __init__(self, config: SpeculativeConfig, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.k = config.num_speculative_tokens
        self.device = device
        self.draft = load_eagle3_draft(config.model, dtype=dtype, device=device)
        c = self.draft.config
        target = model.config
        if c.target_hidden_size != target.hidden_size:
            raise ValueError(f"EAGLE-3 draft target_hidden_size {c.target_hidden_size} != the model's hidden_size "
                             f"{target.hidden_size}")
        if c.vocab_size != target.vocab_size:
            raise ValueError(f"EAGLE-3 draft vocab_size {c.vocab_size} != the model's vocab_size {target.vocab_size}")
        if self.draft.embed_tokens is None:
            if model.parallel.tp_size > 1:
                raise ValueError("this EAGLE-3 draft has no embed_tokens and shares the target's, which tensor "
                                 "parallelism splits: use a draft that ships embed_tokens.weight, or --tp 1")
            self.draft.embed_tokens = model.model.embed_tokens.weight
        self.aux_layers = c.aux_layer_ids or default_aux_layers(target.num_hidden_layers)
        self.caches: dict[int, _DraftCache] = {}
        self.runner: Any = None  # the engine's ModelRunner, set once it exists

    def _cache(self, seq: Sequence) -> _DraftCache:
        cache = self.caches.get(seq.seq_id)
        if cache is None:
            c = self.draft.config
            dtype = self.draft.fc.weight.dtype
            empty = torch.empty(0, c.num_kv_heads, c.head_dim, dtype=dtype, device=self.device)
            cache = _DraftCache(empty, empty.clone(), torch.empty(0, dtype=torch.long, device=self.device))
            self.caches[seq.seq_id] = cache
        return cache

    @torch.inference_mode()
    def observe(self, scheduled: list, accepted: dict[int, int]) -> None:
        """After a step: feed the draft the pairs (h_t, token t+1) of every position the target computed."""
        aux = self.runner.last_aux_hidden
        starts = self.runner.last_row_starts
        for index, item in enumerate(scheduled):
            seq = item.seq
            if seq.is_finished:
                self.caches.pop(seq.seq_id, None)
                continue
            real = item.num_new_tokens - item.num_draft_tokens + accepted.get(seq.seq_id, 0)
            first = seq.num_computed_tokens - real  # position of the first token computed this step
            cache = self._cache(seq)
            keep = int((cache.pos[: cache.length] < first).sum()) if cache.length else 0
            cache.length = keep  # a recompute (preemption) or rejected speculation: drop what follows
            cache.k, cache.v, cache.pos = cache.k[:keep], cache.v[:keep], cache.pos[:keep]
            positions = torch.arange(first, first + real, device=self.device)
            next_tokens = torch.tensor(seq.token_ids[first + 1 : first + real + 1], device=self.device)
            hidden = self.draft.fc(aux[starts[index] : starts[index] + real].to(self.draft.fc.weight.dtype))
            embeds = self.draft.embed_tokens[next_tokens]
            logits, out, k, v = self.draft.step(embeds, hidden, positions, cache.k, cache.v, cache.pos)
            cache.k, cache.v = torch.cat([cache.k, k]), torch.cat([cache.v, v])
            cache.pos = torch.cat([cache.pos, positions])
            cache.length += real
            cache.next_logits, cache.next_hidden = logits[-1:], out[-1:]
            cache.next_position = first + real  # the draft predicts the token after this position's

    def forget(self, seq_id: int) -> None:
        """An aborted sequence is never scheduled again, so `observe` would not see it finish."""
        self.caches.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        cache = self.caches.get(seq.seq_id)
        count = min(self.k, max_tokens)
        if cache is None or cache.next_logits is None or cache.next_position != len(seq.token_ids) - 1 or count <= 0:
            return []
        token = self.draft.to_target_ids(cache.next_logits.argmax(dim=-1))
        drafts = [token]
        hidden, k, v, pos = cache.next_hidden, cache.k, cache.v, cache.pos
        position = cache.next_position  # the pair (h, first draft) sits at the bonus token's position
        for _ in range(count - 1):  # speculative K/V stay local: the cache keeps only verified positions
            where = torch.tensor([position], device=self.device)
            logits, hidden, nk, nv = self.draft.step(self.draft.embed_tokens[token], hidden, where, k, v, pos)
            k, v, pos = torch.cat([k, nk]), torch.cat([v, nv]), torch.cat([pos, where])
            token = self.draft.to_target_ids(logits.argmax(dim=-1))
            drafts.append(token)
            position += 1
        return torch.cat(drafts).tolist()
