"""Plant an induction circuit in a freshly initialized DeepseekV3ForCausalLM, so training starts able to copy
(docs/embedded_model.md): the tiny model never grows one from random weights in its budget.

Residual dimensions are split: ID holds each token's identity (a random unit vector); PREV, what layer 0's
head 0 writes: the previous token's ID, found by a rope-only query peaked one position back; COPY, what layer
1's head 0 writes: the ID of the token that followed an earlier occurrence of the current one (its ID matched
against their PREV). The output embedding reads COPY. Everything else keeps its random initialization, and
training is free to change all of it.
"""

from __future__ import annotations

import torch

ID, PREV, COPY = slice(0, 64), slice(64, 128), slice(128, 192)
CONST = 255  # a residual dimension every token's embedding sets, for the rope-only query
WIDTH = 64


@torch.enable_grad()
def rope_pattern(angles: torch.Tensor, peak_logit: float, window: int = 1024, steps: int = 1500) -> torch.Tensor:
    """Complex weights z (one per rope pair) for logits Re(z * exp(i * angle * distance)) whose softmax over
    distances 0..window puts the most weight on distance 1, with |z| summing to `peak_logit`."""
    distance = torch.arange(window + 1, dtype=torch.float64)
    cos, sin = torch.cos(angles[None] * distance[:, None]), torch.sin(angles[None] * distance[:, None])
    gen = torch.Generator().manual_seed(0)
    re = (torch.randn(len(angles), generator=gen, dtype=torch.float64) * 0.1).requires_grad_()
    im = (torch.randn(len(angles), generator=gen, dtype=torch.float64) * 0.1).requires_grad_()
    opt = torch.optim.Adam([re, im], lr=0.05)

    def logits() -> torch.Tensor:
        return (cos @ re - sin @ im) * peak_logit / (re ** 2 + im ** 2 + 1e-12).sqrt().sum()

    for _ in range(steps):
        s = logits()
        loss = -sum(torch.log_softmax(s[: m + 1], 0)[1] for m in (1, 2, 4, 8, 32, 128, 512, window))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        scale = peak_logit / (re ** 2 + im ** 2).sqrt().sum()
        return torch.complex(re * scale, im * scale)


def _interleave(z: torch.Tensor) -> torch.Tensor:
    """Complex per-pair values in DeepSeek's interleaved rope layout (x0, x1), (x2, x3), ..."""
    return torch.stack([z.real, z.imag], -1).flatten()


@torch.no_grad()
def plant_induction_circuit(model: torch.nn.Module, seed: int = 0, token_bytes: tuple[bytes, ...] = (),
                            match_logit: float = 14.0, prev_logit: float = 14.5, copy_logit: float = 14.0) -> None:
    """`token_bytes`: the tokenizer's tokens by id; a token and the same token with a leading space get one
    identity, so "Paris" in JSON copies " Paris" from the request."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    layer0, layer1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    nope, rope, v_dim, latent = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    eye = torch.eye(WIDTH)

    identity = torch.randn(embed.shape[0], WIDTH, generator=gen)
    identity /= identity.norm(dim=-1, keepdim=True)
    first_of_word: dict[bytes, int] = {}
    for token, text in enumerate(token_bytes):
        word = text[1:] if len(text) > 1 and text.startswith(b" ") else text
        identity[token] = identity[first_of_word.setdefault(word, token)]
    embed[:, ID] = identity
    embed[:, PREV] = 0
    embed[:, COPY] = 0
    embed[:, CONST] = 0.5
    # nothing but the two heads writes PREV or COPY at the start
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[PREV] = 0
        layer.self_attn.o_proj.weight[COPY] = 0
        mlp = layer.mlp
        downs = [mlp.down_proj] if hasattr(mlp, "down_proj") else [mlp.shared_experts.down_proj]
        for d in downs:
            d.weight[PREV] = 0
            d.weight[COPY] = 0
        if hasattr(mlp, "experts") and hasattr(mlp.experts, "down_proj"):
            mlp.experts.down_proj[:, PREV] = 0
            mlp.experts.down_proj[:, COPY] = 0

    # Activations' typical scale after each RMSNorm, measured on random tokens
    half = torch.randint(0, embed.shape[0], (4, 128), generator=gen)
    sample = torch.cat([half, half], 1)  # the second half repeats the first, so the copy is measured sharp
    x0 = model.model.layers[0].input_layernorm(embed[sample])
    const_scale = x0[..., CONST].mean().item()

    # layer 0, head 0: a rope-only query, constant for every token, peaked one position back
    angles = torch.atan2(*reversed(model.model.rotary_emb(x0, torch.arange(2)[None])[:2]))[0, 1, : rope // 2]
    z = rope_pattern(angles.double(), prev_logit / layer0.scaling).to(torch.complex64)
    magnitude = z.abs().sqrt()
    q_rope = torch.where(magnitude > 1e-6, z / magnitude.clamp_min(1e-6), 0)  # q * conj(k) = z, |q| = |k|
    k_rope = torch.complex(magnitude, torch.zeros_like(magnitude))
    layer0.q_a_proj.weight[0] = 0
    layer0.q_a_proj.weight[0, CONST] = 1.0
    q_latent = layer0.q_a_layernorm(layer0.q_a_proj(x0))[..., 0].mean().item()
    qb = layer0.q_b_proj.weight.view(cfg.num_attention_heads, nope + rope, -1)
    qb[0] = 0
    qb[0, nope:, 0] = _interleave(q_rope) / q_latent
    kv_a = layer0.kv_a_proj_with_mqa.weight
    kv_a[latent:] = 0
    kv_a[latent:, CONST] = _interleave(k_rope) / const_scale
    # its value is the token's identity, written to PREV
    kv_a[:WIDTH] = 0
    kv_a[:WIDTH, ID] = eye
    kvb = layer0.kv_b_proj.weight.view(cfg.num_attention_heads, nope + v_dim, -1)
    kvb[0] = 0
    kvb[0, nope: nope + WIDTH, :WIDTH] = eye
    o = layer0.o_proj.weight.view(-1, cfg.num_attention_heads, v_dim)
    o[:, 0] = 0
    o[PREV, 0, :WIDTH] = eye

    # layer 1, head 0: the current token's identity (query) against the previous token's (key); the value is
    # the identity of the token at the matched position, written to COPY
    q_a = layer1.q_a_proj.weight
    q_a[:WIDTH] = 0
    q_a[:WIDTH, ID] = eye
    qb = layer1.q_b_proj.weight.view(cfg.num_attention_heads, nope + rope, -1)
    qb[0] = 0
    qb[0, :WIDTH, :WIDTH] = eye
    kv_a = layer1.kv_a_proj_with_mqa.weight
    kv_a[: 2 * WIDTH] = 0
    kv_a[:WIDTH, PREV] = eye
    kv_a[WIDTH: 2 * WIDTH, ID] = eye
    kvb = layer1.kv_b_proj.weight.view(cfg.num_attention_heads, nope + v_dim, -1)
    kvb[0] = 0
    kvb[0, :WIDTH, :WIDTH] = eye
    kvb[0, nope: nope + WIDTH, WIDTH: 2 * WIDTH] = eye
    o = layer1.o_proj.weight.view(-1, cfg.num_attention_heads, v_dim)
    o[:, 0] = 0
    o[COPY, 0, :WIDTH] = eye
    head[:, COPY] = identity
    calibrate(model, match_logit, copy_logit, sample)


@torch.no_grad()
def calibrate(model: torch.nn.Module, match_logit: float, copy_logit: float, sample: torch.Tensor) -> None:
    """Scale layer 1's query and the output embedding's COPY columns so a perfect match scores `match_logit`
    and a perfect copy `copy_logit`, measured on the model's own activations."""
    cfg = model.config
    layer1 = model.model.layers[1]
    nope = cfg.qk_nope_head_dim
    captured: dict[str, torch.Tensor] = {}
    hooks = [layer1.input_layernorm.register_forward_hook(lambda m, i, out: captured.__setitem__("x1", out)),
             model.model.norm.register_forward_hook(lambda m, i, out: captured.__setitem__("final", out))]
    model(input_ids=sample)
    for h in hooks:
        h.remove()
    attn = layer1.self_attn
    x1 = captured["x1"]
    q = attn.q_a_layernorm(attn.q_a_proj(x1))[..., :WIDTH]
    kv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x1)[..., : cfg.kv_lora_rank])
    match = (q[:, :-1] * kv[:, 1:, :WIDTH]).sum(-1).mean().item()  # position t's key holds token t-1's identity
    qb = attn.q_b_proj.weight.view(cfg.num_attention_heads, nope + cfg.qk_rope_head_dim, -1)
    qb[0, :WIDTH, :WIDTH] *= match_logit / (match * attn.scaling)
    # the copy: COPY of the final norm against the copied token's identity
    copy = captured["final"][:, sample.shape[1] // 2:, COPY].norm(dim=-1).mean().item()
    model.lm_head.weight[:, COPY] *= copy_logit / max(copy, 1e-6)
