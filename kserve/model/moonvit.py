"""MoonViT, the vision tower of Kimi K2.5 / K2.6 / K2.7-Code, and its patch-merger projector.

An image whose padded patch grid is h x w patches becomes (h/2)*(w/2) embeddings of the text width, one per
`<|media_pad|>` placeholder token (see kserve.model.vision_preprocess). `KimiVisionModel.state_dict()` keys are
exactly the checkpoint's `vision_tower.*` / `mm_projector.*` names (no renaming, `wqkv` stays fused). Plain torch
with `scaled_dot_product_attention` (CPU or GPU, float32 or bfloat16); the tower is not split across
tensor-parallel ranks and nothing here communicates. Architecture, math and the checks against vLLM: docs/vision.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kserve.config import VISION_TENSOR_PREFIXES

logger = logging.getLogger("kserve.model.moonvit")

GridTHW = tuple[int, int, int]
CosSin = tuple[torch.Tensor, torch.Tensor]

_SUPPORTED = {
    "pos_emb_type": ("divided_fixed",),
    "merge_type": ("sd2_tpool",),
    "mm_projector_type": ("patchmerger",),
    "video_attn_type": ("spatial_temporal",),
    "hidden_act": ("gelu_pytorch_tanh",),
    "projector_hidden_act": ("gelu",),
}


@dataclass(frozen=True)
class VisionConfig:
    """A kimi_k25 `vision_config`. Defaults are K2.5/K2.6's published values."""

    patch_size: int = 14
    hidden_size: int = 1152  # vt_hidden_size
    intermediate_size: int = 4304  # vt_intermediate_size
    num_attention_heads: int = 16  # vt_num_attention_heads
    num_hidden_layers: int = 27  # vt_num_hidden_layers
    pos_emb_height: int = 64  # init_pos_emb_height: rows of the learned position table
    pos_emb_width: int = 64
    pos_emb_time: int = 4  # the most frames one video chunk may have
    pos_emb_type: str = "divided_fixed"
    merge_kernel_size: tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    video_attn_type: str = "spatial_temporal"
    hidden_act: str = "gelu_pytorch_tanh"  # the tower's MLP (not in config.json; MoonViT's fixed choice)
    mm_projector_type: str = "patchmerger"
    mm_hidden_size: int = 1152  # the projector's per-patch input width (= hidden_size)
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    layer_norm_eps: float = 1e-5  # the tower's LayerNorms (torch's default, as in MoonViT)
    rope_theta: float = 10000.0
    rope_max_grid: tuple[int, int] = (512, 512)  # MoonViT's 2D rotary table: at most 512 x 512 patches
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key, allowed in _SUPPORTED.items():
            value = getattr(self, key)
            if value not in allowed:
                raise ValueError(f"vision_config {key}={value!r} is not supported; expected one of {allowed}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision_config hidden size {self.hidden_size} is not divisible by {self.num_attention_heads} heads"
            )
        if self.head_dim % 4:
            raise ValueError(f"MoonViT's 2D rotary embedding needs head_dim % 4 == 0, got {self.head_dim}")
        if self.mm_hidden_size != self.hidden_size:
            raise ValueError(
                f"vision_config mm_hidden_size {self.mm_hidden_size} != vt_hidden_size {self.hidden_size}: "
                "the patchmerger projector takes the tower's output"
            )
        if len(self.merge_kernel_size) != 2:
            raise ValueError(f"merge_kernel_size must be [kh, kw], got {list(self.merge_kernel_size)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merged_hidden_size(self) -> int:
        """The projector's input: kh*kw patch vectors side by side."""
        return self.hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_dict(cls, vision_config: dict[str, Any], text_hidden_size: int | None = None) -> VisionConfig:
        """Read a `vision_config` in Moonshot's published keys (`vt_hidden_size`, `init_pos_emb_height`, ...)
        or in transformers' (`hidden_size`, `pos_emb_height`, ...); Moonshot's keys win when both are there.
        `text_hidden_size` (the text model's hidden size) is used when the dict has no `text_hidden_size`."""
        d = dict(vision_config)

        def pick(*keys: str, default: Any = None) -> Any:
            for k in keys:
                if d.get(k) is not None:
                    return d[k]
            return default

        base = cls()
        hidden = int(pick("vt_hidden_size", "hidden_size", default=base.hidden_size))
        text_hidden = pick("text_hidden_size", default=text_hidden_size)
        if text_hidden is None:
            text_hidden = base.text_hidden_size
        kwargs: dict[str, Any] = {
            "patch_size": int(pick("patch_size", default=base.patch_size)),
            "hidden_size": hidden,
            "intermediate_size": int(pick("vt_intermediate_size", "intermediate_size", default=base.intermediate_size)),
            "num_attention_heads": int(
                pick("vt_num_attention_heads", "num_attention_heads", default=base.num_attention_heads)
            ),
            "num_hidden_layers": int(pick("vt_num_hidden_layers", "num_hidden_layers", default=base.num_hidden_layers)),
            "pos_emb_height": int(pick("init_pos_emb_height", "pos_emb_height", default=base.pos_emb_height)),
            "pos_emb_width": int(pick("init_pos_emb_width", "pos_emb_width", default=base.pos_emb_width)),
            "pos_emb_time": int(pick("init_pos_emb_time", "pos_emb_time", default=base.pos_emb_time)),
            "pos_emb_type": pick("pos_emb_type", default=base.pos_emb_type),
            "merge_kernel_size": tuple(int(k) for k in pick("merge_kernel_size", default=base.merge_kernel_size)),
            "merge_type": pick("merge_type", default=base.merge_type),
            "video_attn_type": pick("video_attn_type", default=base.video_attn_type),
            "hidden_act": pick("hidden_act", default=base.hidden_act),
            "mm_projector_type": pick("mm_projector_type", default=base.mm_projector_type),
            "mm_hidden_size": int(pick("mm_hidden_size", default=hidden)),
            "projector_hidden_act": pick("projector_hidden_act", default=base.projector_hidden_act),
            "projector_ln_eps": float(pick("projector_ln_eps", default=base.projector_ln_eps)),
            "text_hidden_size": int(text_hidden),
        }
        theta = (d.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            kwargs["rope_theta"] = float(theta)
        known = {
            "vt_hidden_size", "hidden_size", "vt_intermediate_size", "intermediate_size", "vt_num_attention_heads",
            "num_attention_heads", "vt_num_hidden_layers", "num_hidden_layers", "init_pos_emb_height",
            "pos_emb_height", "init_pos_emb_width", "pos_emb_width", "init_pos_emb_time", "pos_emb_time",
            "rope_parameters", *kwargs,
        }
        kwargs["extra"] = {k: v for k, v in d.items() if k not in known}
        return cls(**kwargs)

    @classmethod
    def from_model_config(cls, raw: dict[str, Any]) -> VisionConfig:
        """From a whole kimi_k25 config.json (its `vision_config`; the text width from `text_config`)."""
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError(  # noqa: TRY004 -- a config problem, reported like the others
                f"config.json (model_type {raw.get('model_type')!r}) has no vision_config: not a multimodal "
                "kimi_k25 checkpoint"
            )
        text_hidden = (raw.get("text_config") or {}).get("hidden_size")
        return cls.from_dict(vision, text_hidden_size=text_hidden)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> VisionConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_model_config(json.loads(path.read_text()))


# ---------------------------------------------------------------------------------------------------------
# grid helpers


def normalize_grids(grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> list[GridTHW]:
    """[[t, h, w], ...] as a list of int triples (from a [N, 3] tensor or nested sequences)."""
    rows = grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else list(grid_thws)
    out = []
    for row in rows:
        if len(row) != 3:
            raise ValueError(f"a grid must be [t, h, w], got {row}")
        out.append((int(row[0]), int(row[1]), int(row[2])))
    return out


def num_merged_tokens(grid_thw: Sequence[int], merge_kernel_size: Sequence[int] = (2, 2)) -> int:
    """Embeddings (= placeholder tokens) the tower gives one item of patch grid [t, h, w]: frames are pooled,
    each kh x kw block of patches becomes one."""
    _, h, w = grid_thw
    kh, kw = merge_kernel_size
    return (h // kh) * (w // kw)


def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Fixed sin-cos embedding [len(positions), dim] (first half sin, second half cos), base 10000, computed
    in float64 and returned as float32 (the frame embedding of video chunks)."""
    half = dim // 2
    omega = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


# ---------------------------------------------------------------------------------------------------------
# modules (named as in the checkpoint)


class DividedFixedPosEmb(nn.Module):
    """`patch_embed.pos_emb`: a learned [H0, W0, D] table, bicubically resized (align_corners=False, like
    torch's F.interpolate default) to the image's h x w patch grid, plus a fixed sin-cos embedding of the frame
    index for video chunks (t > 1). The resize runs in float32 whatever the model dtype."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int):
        super().__init__()
        self.num_frames = num_frames
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(height, width, dim))

    def grid_embedding(self, t: int, h: int, w: int) -> torch.Tensor:
        """[t*h*w, D] float32, frame-major then row-major like the patches."""
        if t < 1 or t > self.num_frames:
            raise ValueError(f"a vision item has {t} frames; MoonViT takes 1 to {self.num_frames}")
        table = self.weight.float()
        if (h, w) == tuple(table.shape[:2]):
            emb = table.reshape(h * w, self.dim)
        else:
            resized = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)
            emb = resized[0].permute(1, 2, 0).reshape(h * w, self.dim)
        if t == 1:
            return emb
        frames = sincos_1d(self.dim, torch.arange(t)).to(emb.device)
        return (emb[None] + frames[:, None, :]).reshape(t * h * w, self.dim)


class PatchEmbed(nn.Module):
    """`patch_embed`: `proj` (Conv2d 3->D, kernel = stride = patch, applied to single patches, i.e. one GEMM)
    and `pos_emb`."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p, bias=True)
        self.pos_emb = DividedFixedPosEmb(cfg.pos_emb_height, cfg.pos_emb_width, cfg.pos_emb_time, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grids: list[GridTHW]) -> torch.Tensor:
        n = pixel_values.shape[0]
        w = self.proj.weight
        x = F.linear(pixel_values.reshape(n, -1).to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)
        pos = torch.cat([self.pos_emb.grid_embedding(*g) for g in grids]) if grids else x.new_zeros(0, x.shape[1])
        return x + pos.to(x.dtype)


class VisionMLP(nn.Module):
    """`mlp`: fc0 -> tanh-GELU -> fc1."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=True)
        self.fc1 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


def rope_2d_cos_sin(h: int, w: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """cos and sin [h*w, head_dim/2] (float32) of MoonViT's 2D rotary embedding: head_dim/4 frequencies
    theta^(-4j/head_dim); rotation pair 2j turns by col * f_j, pair 2j+1 by row * f_j."""
    idx = torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float()
    freqs = 1.0 / (theta ** (idx / head_dim))
    rows = torch.arange(h, device=device).float().repeat_interleave(w)
    cols = torch.arange(w, device=device).float().repeat(h)
    angles = torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1).reshape(h * w, head_dim // 2)
    return angles.cos(), angles.sin()


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x [L, heads, head_dim] by the angle of pair i, in float32."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(x.shape).to(x.dtype)


class EncoderBlock(nn.Module):
    """One pre-norm MoonViT block (`encoder.blocks.N`)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.norm0 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.wqkv = nn.Linear(d, 3 * d, bias=True)  # rows: q (heads x head_dim), then k, then v
        self.wo = nn.Linear(d, d, bias=True)
        self.mlp = VisionMLP(d, cfg.intermediate_size)

    def attention(self, x: torch.Tensor, lengths: list[int], rope: list[CosSin]) -> torch.Tensor:
        qkv = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        outs = []
        for seq, (cos, sin) in zip(qkv.split(lengths), rope):
            q = apply_rope_pairs(seq[:, 0], cos, sin)
            k = apply_rope_pairs(seq[:, 1], cos, sin)
            v = seq[:, 2]
            # full attention among this item's patches only; [1, heads, L, head_dim]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=self.head_dim**-0.5
            )
            outs.append(o[0].transpose(0, 1).reshape(seq.shape[0], -1))
        return self.wo(torch.cat(outs) if outs else x.new_zeros(0, x.shape[1]))

    def forward(self, x: torch.Tensor, lengths: list[int], rope: list[CosSin]) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), lengths, rope)
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    """`encoder`: the blocks and `final_layernorm`."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, grids: list[GridTHW]) -> torch.Tensor:
        cfg = self.cfg
        rope = []
        for t, h, w in grids:
            cos, sin = rope_2d_cos_sin(h, w, cfg.head_dim, cfg.rope_theta, x.device)
            rope.append((cos.repeat(t, 1), sin.repeat(t, 1)))  # every frame of a chunk gets the same 2D positions
        lengths = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, lengths, rope)
        return self.final_layernorm(x)


class MoonViT(nn.Module):
    """`vision_tower`: patches [P, 3, p, p] + grids -> merged patch groups [sum(h/kh * w/kw), kh*kw, D]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)

    def check_grids(self, pixel_values: torch.Tensor, grids: list[GridTHW]) -> None:
        cfg = self.cfg
        p = cfg.patch_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [num_patches, 3, {p}, {p}], got {list(pixel_values.shape)}")
        kh, kw = cfg.merge_kernel_size
        max_h, max_w = cfg.rope_max_grid
        for t, h, w in grids:
            if h <= 0 or w <= 0 or h % kh or w % kw:
                raise ValueError(f"grid [t={t}, h={h}, w={w}]: h and w must be positive multiples of {kh} and {kw}")
            if h > max_h or w > max_w:
                raise ValueError(f"grid [t={t}, h={h}, w={w}] exceeds MoonViT's {max_h} x {max_w} patches")
        total = sum(t * h * w for t, h, w in grids)
        if total != pixel_values.shape[0]:
            raise ValueError(
                f"grids {[list(g) for g in grids]} hold {total} patches, pixel_values has {pixel_values.shape[0]}"
            )

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        grids = normalize_grids(grid_thws)
        self.check_grids(pixel_values, grids)
        x = self.patch_embed(pixel_values, grids)
        x = self.encoder(x, grids)
        return sd2_tpool_merge(x, grids, self.cfg.merge_kernel_size)


def sd2_tpool_merge(x: torch.Tensor, grids: list[GridTHW], merge_kernel_size: Sequence[int]) -> torch.Tensor:
    """"sd2_tpool": per item, the mean over frames, then each kh x kw block of patches (row-major blocks, each
    block's patches row-major) as one group: [sum(h/kh * w/kw), kh*kw, D]."""
    kh, kw = merge_kernel_size
    out = []
    for seq, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids):
        v = seq.view(t, h // kh, kh, w // kw, kw, seq.shape[-1]).mean(dim=0)
        out.append(v.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, seq.shape[-1]))
    return torch.cat(out) if out else x.new_zeros(0, kh * kw, x.shape[-1])


class PatchMergerProjector(nn.Module):
    """`mm_projector` (patchmerger): `pre_norm` LayerNorm per patch vector, the kh*kw vectors concatenated,
    `proj.0` Linear -> exact GELU -> `proj.2` Linear to the text width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        merged = cfg.merged_hidden_size
        self.pre_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.projector_ln_eps)
        self.proj = nn.Sequential(
            nn.Linear(merged, merged, bias=True), nn.GELU(), nn.Linear(merged, cfg.text_hidden_size, bias=True)
        )

    def forward(self, groups: torch.Tensor) -> torch.Tensor:
        x = self.pre_norm(groups.to(self.pre_norm.weight.dtype))
        return self.proj(x.reshape(groups.shape[0], -1))


class KimiVisionModel(nn.Module):
    """`vision_tower` + `mm_projector`; `state_dict()` names = the checkpoint's tensor names."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.vision_tower = MoonViT(cfg)
        self.mm_projector = PatchMergerProjector(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.mm_projector.pre_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.mm_projector.pre_norm.weight.device

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """Patches [P, 3, p, p] of one or more items (in order) and their grids [[t, h, w], ...] ->
        embeddings [sum of num_merged_tokens, text_hidden_size] in the model dtype, items in order."""
        return self.mm_projector(self.vision_tower(pixel_values.to(self.device), grid_thws))


@torch.inference_mode()
def embed_images(
    model: KimiVisionModel, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """The embeddings of each item: a list of [num_merged_tokens(grid), text_hidden_size] tensors, one per
    grid, which replace that item's `<|media_pad|>` placeholder tokens in order."""
    grids = normalize_grids(grid_thws)
    out = model(pixel_values, grids)
    return list(out.split([num_merged_tokens(g, model.config.merge_kernel_size) for g in grids]))


# ---------------------------------------------------------------------------------------------------------
# loading


def vision_weight_names(weight_map: dict[str, str]) -> list[str]:
    return sorted(n for n in weight_map if n.startswith(VISION_TENSOR_PREFIXES))


def load_vision_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    config: VisionConfig | None = None,
) -> KimiVisionModel:
    """Build `KimiVisionModel` from a kimi_k25 checkpoint directory: the config from config.json's
    `vision_config`, every `vision_tower.*` / `mm_projector.*` tensor read from its shard (shape and dtype
    checked; bf16/fp16/fp32 accepted and converted to `dtype`). A tensor missing from the checkpoint, or a
    vision tensor the model does not have, is a CheckpointError. Call it on every rank that encodes images:
    the tower is replicated, not split."""
    from kserve.model.loader import CheckpointError, ShardReader, read_weight_map

    model_dir = Path(model_dir)
    cfg = config or VisionConfig.from_model_dir(model_dir)
    weight_map = read_weight_map(model_dir)
    present = vision_weight_names(weight_map)
    with torch.device("meta"):
        model = KimiVisionModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.state_dict())
    missing = sorted(set(params) - set(present))
    unexpected = sorted(set(present) - set(params))
    if missing:
        raise CheckpointError(
            f"{len(missing)} vision tensors are missing from {model_dir}: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else "")
        )
    if unexpected:
        raise CheckpointError(
            f"{model_dir} has {len(unexpected)} vision tensors the MoonViT of this vision_config does not: "
            f"{', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else "")
        )
    by_shard: dict[str, list[str]] = {}
    for name in present:
        by_shard.setdefault(weight_map[name], []).append(name)
    dense = (torch.bfloat16, torch.float16, torch.float32)
    with torch.no_grad():
        for names in by_shard.values():
            with contextlib.ExitStack() as stack:
                reader = ShardReader(model_dir, weight_map, stack)
                for name in names:
                    target = params[name]
                    target.copy_(reader.read(name, tuple(target.shape), dense, "vision tensor"))
    model.requires_grad_(False)
    logger.info("loaded %d vision tensors (%s) from %s", len(present), cfg_summary(cfg), model_dir)
    return model.eval()


def cfg_summary(cfg: VisionConfig) -> str:
    return (
        f"MoonViT {cfg.num_hidden_layers} layers x {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
        f"projector -> {cfg.text_hidden_size}"
    )


def init_random_weights(model: KimiVisionModel, seed: int = 0) -> KimiVisionModel:
    """Random weights of sensible scale (tests, cost estimates at the real width); returns the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pos_emb.weight"):
                values = torch.randn(p.shape, generator=gen)
            elif p.ndim == 1:
                is_norm_scale = "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight")
                values = (1.0 if is_norm_scale else 0.0) + 0.02 * torch.randn(p.shape, generator=gen)
            else:
                fan_in = math.prod(p.shape[1:])
                values = torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)
            p.copy_(values)
    return model
