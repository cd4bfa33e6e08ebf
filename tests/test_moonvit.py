"""MoonViT + patch-merger projector (kserve.model.moonvit) and image preprocessing (kserve.model.vision_preprocess)
on make-tiny's k25 checkpoint: against a float64 reference written from the published math, against vLLM's own
kimi_k25 modules and processor (run in vLLM's venv, when there is one), placeholder counts, bad images."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import socket
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from kserve.model.loader import CheckpointError, read_weight_map
from kserve.model.moonvit import (
    KimiVisionModel,
    VisionConfig,
    embed_images,
    load_vision_model,
    num_merged_tokens,
)
from kserve.model.vision_preprocess import (
    ImageDecodeError,
    ImageProcConfig,
    ImageTooLargeError,
    UnsupportedImageFormatError,
    decode_image,
    expand_media_placeholders,
    num_placeholder_tokens,
    plan_resize,
    preprocess_image,
    preprocess_images,
)
from kserve.tiny.checkpoint import tiny_vision_config, vision_tensor_shapes

Image = pytest.importorskip("PIL.Image")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
K26_CONFIG = SHARED / "kimi_k25" / "tokenizer" / "config.json"
VLLM_PYTHON = Path(os.environ.get("KSERVE_VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))

# K2.5 / K2.6's published preprocessor_config.json `media_proc_cfg` (the video keys only feed vLLM's processor).
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
}
# (width, height) -> placeholder tokens, worked out by hand from the navit rule (see docs/vision.md)
KNOWN_COUNTS = {
    (1, 1): 1, (28, 28): 1, (100, 50): 8, (224, 224): 64, (1024, 1024): 1369, (1920, 1080): 2691,
    (4000, 3000): 4200, (8000, 100): 1024,
}
COUNT_SIZES = [
    (1, 1), (13, 500), (28, 28), (29, 29), (100, 50), (224, 224), (336, 336), (448, 448), (512, 512), (640, 480),
    (800, 600), (1000, 1000), (1024, 768), (1024, 1024), (1280, 720), (1792, 1792), (1920, 1080), (2048, 2048),
    (2560, 1440), (3000, 3000), (3840, 2160), (4000, 3000), (4096, 4096), (7168, 7168), (10000, 10000),
    (8000, 100), (100, 8000), (20000, 20), (7169, 30), (99999, 3),
]
# Tower inputs: sizes whose patch grids are the 8x8 position table itself (no interpolation), larger and
# landscape (upsampled), tall and narrow (down in one direction, up in the other).
TOWER_IMAGE_SIZES = [(112, 112), (300, 200), (40, 180)]


# ---------------------------------------------------------------------------------------------------------
# images


def _pattern(width: int, height: int, seed: int, channels: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) * 7) % 256], -1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    rgb = ((base + noise) % 256).astype(np.uint8)
    if channels == 4:
        alpha = ((x * 3 + y * 5) % 256).astype(np.uint8)[..., None]
        return np.concatenate([rgb, alpha], axis=-1)
    return rgb


def _encode(image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _rgb_png(width: int, height: int, seed: int = 0) -> bytes:
    return _encode(Image.fromarray(_pattern(width, height, seed)), "PNG")


def _peer_images() -> list[bytes]:
    """RGB PNG, RGBA PNG, a JPEG with EXIF orientation 6 (rotate), greyscale PNG, palette GIF with transparency."""
    rgba = Image.fromarray(_pattern(97, 131, 1, channels=4), "RGBA")
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = _encode(Image.fromarray(_pattern(160, 90, 2)), "JPEG", quality=90, exif=exif.tobytes())
    grey = Image.fromarray(_pattern(333, 77, 3)[..., 0], "L")
    pal = Image.fromarray(_pattern(64, 200, 4)).quantize(colors=16)
    pal.info["transparency"] = 3
    return [_rgb_png(300, 200), _encode(rgba, "PNG"), jpeg, _encode(grey, "PNG"), _encode(pal, "GIF", transparency=3)]


def _tower_inputs() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    return preprocess_images([_rgb_png(w, h, seed=i) for i, (w, h) in enumerate(TOWER_IMAGE_SIZES)])


def _video_chunk() -> tuple[torch.Tensor, torch.Tensor]:
    """Patches of a 2-frame chunk on a 4 x 6 grid (the tower's t > 1 path; kserve preprocesses no video)."""
    gen = torch.Generator().manual_seed(7)
    return torch.rand(2 * 4 * 6, 3, 14, 14, generator=gen) * 2 - 1, torch.tensor([[2, 4, 6]])


# ---------------------------------------------------------------------------------------------------------
# a float64 reference written from the published math (not from kserve's modules)


def _checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    weight_map = read_weight_map(model_dir)
    out = {}
    for name, file in weight_map.items():
        if name.startswith(("vision_tower.", "mm_projector.")):
            with safe_open(str(model_dir / file), framework="pt") as f:
                out[name] = f.get_tensor(name).double()
    return out


def _bicubic_matrix(n_in: int, n_out: int, a: float = -0.75) -> torch.Tensor:
    """[n_out, n_in]: torch's bicubic resampling along one axis (align_corners=False, edge-clamped taps)."""

    def near(x: float) -> float:
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: float) -> float:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        src = (i + 0.5) * n_in / n_out - 0.5
        x0 = math.floor(src)
        t = src - x0
        for tap, weight in zip((-1, 0, 1, 2), (far(t + 1), near(t), near(1 - t), far(2 - t))):
            m[i, min(max(x0 + tap, 0), n_in - 1)] += weight
    return m


def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _reference_embeddings(model_dir: Path, pixel_values: torch.Tensor, grids: list[list[int]]) -> list[torch.Tensor]:
    raw = json.loads((model_dir / "config.json").read_text())
    v = raw["vision_config"]
    w = _checkpoint_tensors(model_dir)
    dim, heads = v["vt_hidden_size"], v["vt_num_attention_heads"]
    hd = dim // heads
    patches = pixel_values.double().reshape(pixel_values.shape[0], -1)
    x_all = patches @ w["vision_tower.patch_embed.proj.weight"].reshape(dim, -1).T
    x_all = x_all + w["vision_tower.patch_embed.proj.bias"]
    table = w["vision_tower.patch_embed.pos_emb.weight"]
    outs, start = [], 0
    for t, h, wd in grids:
        assert t == 1
        x = x_all[start:start + h * wd]
        start += h * wd
        rows_m, cols_m = _bicubic_matrix(table.shape[0], h), _bicubic_matrix(table.shape[1], wd)
        pos = torch.einsum("ih,hwd,jw->ijd", rows_m, table, cols_m)
        x = x + pos.reshape(h * wd, dim)
        freqs = 10000.0 ** (-4.0 * torch.arange(hd // 4, dtype=torch.float64) / hd)
        rows, cols = torch.meshgrid(
            torch.arange(h, dtype=torch.float64), torch.arange(wd, dtype=torch.float64), indexing="ij"
        )
        angles = torch.stack([cols[..., None] * freqs, rows[..., None] * freqs], dim=-1).reshape(h * wd, hd // 2)
        cis = torch.polar(torch.ones_like(angles), angles)[:, None, :]
        n = x.shape[0]
        for i in range(v["vt_num_hidden_layers"]):
            p = f"vision_tower.encoder.blocks.{i}."
            y = _layer_norm(x, w[p + "norm0.weight"], w[p + "norm0.bias"])
            qkv = (y @ w[p + "wqkv.weight"].T + w[p + "wqkv.bias"]).reshape(n, 3, heads, hd)
            q, k, val = qkv[:, 0], qkv[:, 1], qkv[:, 2]
            q, k = (
                torch.view_as_real(torch.view_as_complex(z.reshape(n, heads, hd // 2, 2).contiguous()) * cis)
                .reshape(n, heads, hd) for z in (q, k)
            )
            att = torch.softmax(torch.einsum("lhd,mhd->hlm", q, k) / math.sqrt(hd), dim=-1)
            o = torch.einsum("hlm,mhd->lhd", att, val).reshape(n, dim)
            x = x + o @ w[p + "wo.weight"].T + w[p + "wo.bias"]
            y = _layer_norm(x, w[p + "norm1.weight"], w[p + "norm1.bias"])
            hid = y @ w[p + "mlp.fc0.weight"].T + w[p + "mlp.fc0.bias"]
            hid = 0.5 * hid * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hid + 0.044715 * hid**3)))
            x = x + hid @ w[p + "mlp.fc1.weight"].T + w[p + "mlp.fc1.bias"]
        final = "vision_tower.encoder.final_layernorm."
        x = _layer_norm(x, w[final + "weight"], w[final + "bias"])
        groups = x.reshape(h // 2, 2, wd // 2, 2, dim).permute(0, 2, 1, 3, 4).reshape(-1, 4, dim)
        pj = "mm_projector."
        groups = _layer_norm(groups, w[pj + "pre_norm.weight"], w[pj + "pre_norm.bias"], v["projector_ln_eps"])
        hid = groups.reshape(groups.shape[0], 4 * dim) @ w[pj + "proj.0.weight"].T + w[pj + "proj.0.bias"]
        hid = 0.5 * hid * (1 + torch.erf(hid / math.sqrt(2)))
        outs.append(hid @ w["mm_projector.proj.2.weight"].T + w["mm_projector.proj.2.bias"])
    return outs


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---------------------------------------------------------------------------------------------------------
# vLLM's own modules, in vLLM's venv


_VLLM_SCRIPT = r'''
import json, os, sys, time
import torch


def main(job_path):
    job = torch.load(job_path, weights_only=False)
    out = {"timings": {}}
    t0 = time.time()
    from transformers import Kimi_K25Config
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    context = set_current_vllm_config(VllmConfig())  # held open for the whole run (a dropped one exits)
    context.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method="tcp://127.0.0.1:%d" % job["port"], backend="gloo")
    initialize_model_parallel(1, 1)
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration
    from vllm.model_executor.models.kimi_k25_vit import (
        KimiK25MultiModalProjector, MoonViT3dPretrainedModel, vision_tower_forward)
    from vllm.model_executor.models.utils import AutoWeightsLoader
    out["timings"]["import"] = time.time() - t0

    from safetensors import safe_open
    model_dir = job["model_dir"]
    config = Kimi_K25Config.from_pretrained(model_dir)
    vc = config.vision_config
    out["vision_config"] = [vc.hidden_size, vc.num_hidden_layers, vc.intermediate_size, vc.num_attention_heads]
    index = json.load(open(os.path.join(model_dir, "model.safetensors.index.json")))["weight_map"]
    names = sorted(n for n in index if n.startswith(("vision_tower.", "mm_projector.")))

    def weights():
        for name in names:
            with safe_open(os.path.join(model_dir, index[name]), framework="pt") as f:
                yield name, f.get_tensor(name)

    for dtype in (torch.float32, torch.bfloat16):
        holder = torch.nn.Module()
        # as KimiK25ForConditionalGeneration builds them (cast to the model dtype, then loaded)
        holder.vision_tower = MoonViT3dPretrainedModel(vc, prefix="vision_tower").to(dtype=dtype)
        holder.mm_projector = KimiK25MultiModalProjector(
            vc, out_hidden_size=config.text_config.hidden_size, prefix="mm_projector").to(dtype=dtype)
        mapper = KimiK25ForConditionalGeneration.hf_to_vllm_mapper
        loaded = AutoWeightsLoader(holder).load_weights(weights(), mapper=mapper)
        out.setdefault("not_loaded", {})[str(dtype)] = sorted({n for n, _ in holder.named_parameters()} - set(loaded))
        for module in holder.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
        t = time.time()
        embeds = vision_tower_forward(holder.vision_tower, job["pixel_values"].to(dtype), job["grid_thws"],
                                      holder.mm_projector, use_data_parallel=False)
        out["timings"]["tower_" + str(dtype)] = time.time() - t
        out.setdefault("embeds", {})[str(dtype)] = [e.float().clone() for e in embeds]
        if dtype == torch.float32:  # a 2-frame video chunk: frame embedding, attention over both, frame mean
            video = vision_tower_forward(holder.vision_tower, job["video_pixel_values"], job["video_grid"],
                                         holder.mm_projector, use_data_parallel=False)
            out["video_embeds"] = [e.float().clone() for e in video]

    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.transformers_utils.processors import kimi_k25_vision_fused as fused

    cfg = job["media_proc_cfg"]
    out["counts"] = [fused.navit_resize_image(w, h, cfg["patch_size"], cfg["merge_kernel_size"], cfg["in_patch_limit"],
                                              cfg["patch_limit_on_one_side"], cfg["fixed_output_tokens"])["num_tokens"]
                     for w, h in job["sizes"]]
    proc = fused.KimiK25FusedVisionProcessor(cfg)
    t = time.time()
    medias = [{"type": "image", "image": ImageMediaIO().load_bytes(b).media} for b in job["images"]]
    feats = proc.preprocess(medias, return_tensors="pt")
    out["timings"]["preprocess"] = time.time() - t
    out["image_sizes"] = [list(m["image"].size) for m in medias]
    out["image_counts"] = [proc.media_tokens_calculator(m) for m in medias]
    out["pixel_values"] = feats["pixel_values"]
    out["grid_thws"] = feats["grid_thws"]
    torch.save(out, job["out"])


main(sys.argv[1])
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_out(tiny_k25_dir, tmp_path_factory) -> dict:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"vLLM's venv is not at {VLLM_PYTHON} (set KSERVE_VLLM_PYTHON); the float64 reference still runs")
    work = tmp_path_factory.mktemp("vllm_moonvit")
    pixel_values, grids, _ = _tower_inputs()
    job = {
        "port": _free_port(), "model_dir": str(tiny_k25_dir), "pixel_values": pixel_values, "grid_thws": grids,
        "video_pixel_values": _video_chunk()[0], "video_grid": _video_chunk()[1], "media_proc_cfg": MEDIA_PROC_CFG, "sizes": COUNT_SIZES, "images": _peer_images(), "out": str(work / "out.pt"),
    }
    torch.save(job, work / "job.pt")
    (work / "run.py").write_text(_VLLM_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(NUMBA_CACHE_DIR=str(work / "numba"), VLLM_LOGGING_LEVEL="WARNING", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(VLLM_PYTHON), str(work / "run.py"), str(work / "job.pt")], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        pytest.fail(f"vLLM's reference failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return torch.load(work / "out.pt", weights_only=False)


# ---------------------------------------------------------------------------------------------------------
# tower + projector


@pytest.fixture(scope="module")
def tiny_model(tiny_k25_dir) -> KimiVisionModel:
    return load_vision_model(tiny_k25_dir, dtype=torch.float32)


def test_tiny_checkpoint_holds_the_published_vision_layout(tiny_k25_dir):
    raw = json.loads((tiny_k25_dir / "config.json").read_text())
    names = {n for n in read_weight_map(tiny_k25_dir) if n.startswith(("vision_tower.", "mm_projector."))}
    expected = vision_tensor_shapes(raw["vision_config"])
    assert names == set(expected) and len(names) == 3 + 12 * 2 + 2 + 6
    model = KimiVisionModel(VisionConfig.from_model_config(raw))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected
    for name in ("vision_tower.encoder.blocks.1.wqkv.weight", "mm_projector.proj.2.weight"):
        with safe_open(str(tiny_k25_dir / read_weight_map(tiny_k25_dir)[name]), framework="pt") as f:
            assert f.get_tensor(name).dtype == torch.bfloat16


def test_k26_vision_config_builds_the_real_tower():
    if not K26_CONFIG.is_file():
        pytest.skip(f"K2.6's config.json is not at {K26_CONFIG} (../shared/ absent)")
    raw = json.loads(K26_CONFIG.read_text())
    cfg = VisionConfig.from_model_config(raw)
    sizes = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size)
    assert sizes == (27, 1152, 16, 4304)
    assert (cfg.pos_emb_height, cfg.pos_emb_width, cfg.text_hidden_size, cfg.head_dim) == (64, 64, 7168, 72)
    with torch.device("meta"):
        model = KimiVisionModel(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == vision_tensor_shapes(raw["vision_config"])  # K2.6's 335 vision tensors, by name and shape
    assert len(shapes) == 335
    assert shapes["mm_projector.proj.0.weight"] == (4608, 4608)
    assert shapes["vision_tower.encoder.blocks.26.wqkv.weight"] == (3456, 1152)
    params = sum(math.prod(s) for s in shapes.values())
    assert 0.46e9 < params < 0.48e9
    # the tiny config also carries the sizes under transformers' keys, which must agree with Moonshot's
    tiny = tiny_vision_config(256)
    transformers_keys_only = {k: v for k, v in tiny.items() if not k.startswith("vt_")}
    assert VisionConfig.from_dict(tiny) == VisionConfig.from_dict(transformers_keys_only)


def test_tower_matches_the_published_math_in_float64(tiny_k25_dir, tiny_model):
    pixel_values, grids, counts = _tower_inputs()
    assert grids.tolist() == [[1, 8, 8], [1, 16, 22], [1, 14, 4]] and counts == [16, 88, 14]
    ours = embed_images(tiny_model, pixel_values, grids)
    ref = _reference_embeddings(tiny_k25_dir, pixel_values, grids.tolist())
    assert [o.shape for o in ours] == [(c, 256) for c in counts]
    for o, r in zip(ours, ref):
        assert r.abs().max() > 0.5  # not degenerate
        assert _rel_err(o, r) < 2e-5


def test_images_do_not_attend_across_each_other(tiny_model):
    pixel_values, grids, counts = _tower_inputs()
    together = embed_images(tiny_model, pixel_values, grids)
    per_image = pixel_values.split(grids.prod(-1).tolist())
    alone = [embed_images(tiny_model, pv, [g])[0] for pv, g in zip(per_image, grids.tolist())]
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert [num_merged_tokens(g) for g in grids.tolist()] == counts


def test_tower_matches_vllm(tiny_k25_dir, tiny_model, vllm_out):
    assert vllm_out["vision_config"] == [64, 2, 128, 4]  # vLLM read the tiny sizes, not transformers' defaults
    assert vllm_out["not_loaded"] == {"torch.float32": [], "torch.bfloat16": []}  # every parameter from the file
    pixel_values, grids, counts = _tower_inputs()
    ours = embed_images(tiny_model, pixel_values, grids)
    theirs = vllm_out["embeds"]["torch.float32"]
    assert [t.shape[0] for t in theirs] == counts
    errors = [_rel_err(o, t) for o, t in zip(ours, theirs)]
    print("float32 max relative error vs vLLM per image:", errors)
    assert max(errors) < 1e-5
    video, grid = _video_chunk()
    (ours_video,) = embed_images(tiny_model, video, grid)
    assert ours_video.shape == (6, 256) and _rel_err(ours_video, vllm_out["video_embeds"][0]) < 1e-5
    bf16 = load_vision_model(tiny_k25_dir, dtype=torch.bfloat16)
    ours16 = embed_images(bf16, pixel_values, grids)
    theirs16 = vllm_out["embeds"]["torch.bfloat16"]
    errors16 = [((o.float() - t).norm() / t.norm()).item() for o, t in zip(ours16, theirs16)]
    print("bfloat16 relative (L2) error vs vLLM per image:", errors16)
    # kserve resizes the position table in float32, vLLM in bf16: the 8x8 grid (no resize) agrees more closely
    assert max(errors16) < 0.03 and errors16[0] < 0.01


def test_loader_refuses_a_mismatched_vision_config(tiny_k25_dir):
    cfg = VisionConfig.from_model_dir(tiny_k25_dir)
    deeper = VisionConfig.from_dict({**tiny_vision_config(256), "vt_num_hidden_layers": 3, "num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match="missing.*blocks.2"):
        load_vision_model(tiny_k25_dir, config=deeper)
    shallower = VisionConfig.from_dict({**tiny_vision_config(256), "vt_num_hidden_layers": 1, "num_hidden_layers": 1})
    with pytest.raises(CheckpointError, match="does not.*blocks.1"):
        load_vision_model(tiny_k25_dir, config=shallower)
    wider = VisionConfig.from_dict({**tiny_vision_config(256), "vt_intermediate_size": 256, "intermediate_size": 256})
    with pytest.raises(CheckpointError, match="shape"):
        load_vision_model(tiny_k25_dir, config=wider)
    assert cfg.text_hidden_size == 256 and load_vision_model(tiny_k25_dir).dtype == torch.bfloat16


def test_vision_config_refuses_other_variants():
    for key, value in (("merge_type", "sd2"), ("pos_emb_type", "learned"), ("mm_projector_type", "patchmergerv2")):
        with pytest.raises(ValueError, match=key):
            VisionConfig.from_dict({**tiny_vision_config(256), key: value})


def test_bad_grids_are_refused(tiny_model):
    with pytest.raises(ValueError, match="multiples of 2"):
        tiny_model(torch.zeros(15, 3, 14, 14), [[1, 3, 5]])
    with pytest.raises(ValueError, match="hold 16 patches"):
        tiny_model(torch.zeros(12, 3, 14, 14), [[1, 4, 4]])


# ---------------------------------------------------------------------------------------------------------
# placeholder counts and preprocessing


def test_placeholder_counts():
    for (w, h), n in KNOWN_COUNTS.items():
        assert num_placeholder_tokens(w, h) == n, (w, h)
    for w, h in COUNT_SIZES:
        plan = plan_resize(w, h)
        assert plan.new_width <= w and plan.new_height <= h  # never upscaled
        assert plan.grid_h <= 512 and plan.grid_w <= 512 and plan.grid_h % 2 == plan.grid_w % 2 == 0
        assert (plan.new_width + plan.pad_width) % 28 == 0 and plan.pad_width < 28 and plan.pad_height < 28
        assert num_placeholder_tokens(w, h) == plan.grid_h * plan.grid_w // 4
    assert ImageProcConfig.from_media_proc_cfg(MEDIA_PROC_CFG) == ImageProcConfig()


def test_placeholder_counts_match_vllm(vllm_out):
    ours = [num_placeholder_tokens(w, h) for w, h in COUNT_SIZES]
    rows = [(w, h, a, b) for (w, h), a, b in zip(COUNT_SIZES, ours, vllm_out["counts"])]
    print("placeholders (w, h, kserve, vLLM):", rows)
    assert ours == vllm_out["counts"]


def test_preprocessing_matches_vllm_bit_for_bit(vllm_out):
    images = _peer_images()
    done = [preprocess_image(b) for b in images]
    assert [[d.plan.width, d.plan.height] for d in done] == vllm_out["image_sizes"]  # after EXIF rotation
    assert [d.num_tokens for d in done] == vllm_out["image_counts"]
    assert [list(d.grid_thw) for d in done] == vllm_out["grid_thws"].tolist()
    ours = torch.cat([d.pixel_values for d in done])
    assert ours.dtype == vllm_out["pixel_values"].dtype == torch.float32
    assert torch.equal(ours, vllm_out["pixel_values"])


def test_preprocessing_layout():
    # 28x28: four 14x14 quadrants of distinct colours -> 4 patches in row-major order, [3, 14, 14] each
    img = np.zeros((28, 28, 3), np.uint8)
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]
    for i, c in enumerate(colours):
        img[(i // 2) * 14:(i // 2 + 1) * 14, (i % 2) * 14:(i % 2 + 1) * 14] = c
    d = preprocess_image(Image.fromarray(img))
    assert d.grid_thw == (1, 2, 2) and d.num_tokens == 1 and tuple(d.pixel_values.shape) == (4, 3, 14, 14)
    for i, c in enumerate(colours):
        expect = torch.tensor([v / 255 * 2 - 1 for v in c]).view(3, 1, 1).expand(3, 14, 14)
        torch.testing.assert_close(d.pixel_values[i], expect)
    # 30x20 pads to 56x28: padding (right, bottom) is black, i.e. -1 after normalisation
    d = preprocess_image(Image.fromarray(np.full((20, 30, 3), 200, np.uint8)))
    assert d.grid_thw == (1, 2, 4)
    full = d.pixel_values.view(2, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 56)
    assert torch.all(full[:, 20:, :] == -1) and torch.all(full[:, :, 30:] == -1)
    torch.testing.assert_close(full[:, :20, :30], torch.full((3, 20, 30), 200 / 255 * 2 - 1))
    # large images are scaled down within the patch limits
    big = preprocess_image(Image.fromarray(np.zeros((2160, 3840, 3), np.uint8)))
    assert (big.plan.new_width, big.plan.new_height) == (2392, 1345) and big.num_tokens == 4214
    # RGBA: transparent pixels over white; alpha_background=None drops alpha like Moonshot's convert("RGB")
    rgba = Image.fromarray(np.zeros((28, 28, 4), np.uint8), "RGBA")
    assert torch.all(preprocess_image(rgba).pixel_values == 1.0)
    assert torch.all(preprocess_image(rgba, ImageProcConfig(alpha_background=None)).pixel_values == -1.0)
    # a data: URL decodes like the bytes
    png = _rgb_png(50, 40)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert torch.equal(preprocess_image(url).pixel_values, preprocess_image(png).pixel_values)


def test_expand_media_placeholders():
    pad = 163605
    assert expand_media_placeholders([1, pad, 2, pad, 3], [3, 1]) == [1, pad, pad, pad, 2, pad, 3]
    with pytest.raises(ValueError, match="2 image placeholders"):
        expand_media_placeholders([pad, pad], [4])


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def test_bad_images_raise_named_errors():
    png = _rgb_png(64, 48)
    cases = [
        (b"definitely not an image", ImageDecodeError, "cannot decode"),
        (b"", ImageDecodeError, "empty"),
        (png[: len(png) // 2], ImageDecodeError, "truncated"),
        ("data:image/png;base64,@@@not-base64@@@", ImageDecodeError, "base64"),
        (b"%PDF-1.7\n1 0 obj\n<<>>\nendobj\n", UnsupportedImageFormatError, "PDF"),
        (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', UnsupportedImageFormatError, "SVG"),
        (_encode(Image.fromarray(_pattern(32, 32, 0)), "ICO"), UnsupportedImageFormatError, "ICO"),
        (_encode(Image.fromarray(_pattern(32, 32, 0)), "TGA"), UnsupportedImageFormatError, "TGA"),
        ("data:text/plain;base64,aGVsbG8=", UnsupportedImageFormatError, "text/plain"),
        (_png_header_only(100_000, 100_000), ImageTooLargeError, "pixels|too large"),
    ]
    for data, error, message in cases:
        with pytest.raises(error, match=message):
            preprocess_image(data)
        assert issubclass(error, ValueError)
    small = ImageProcConfig(max_image_pixels=1000, max_image_bytes=10**6)
    with pytest.raises(ImageTooLargeError, match="64x48 = 3072 pixels"):
        decode_image(png, small)
    with pytest.raises(ImageTooLargeError, match="bytes"):
        decode_image(png, ImageProcConfig(max_image_bytes=100))
    with pytest.raises(TypeError):
        decode_image(12345)
