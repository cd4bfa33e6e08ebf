"""Image preprocessing of Kimi K2.5 / K2.6 / K2.7-Code: decode, resize, normalize, patchify, count placeholders.

The rules are those of Moonshot's processor for kimi_k25 (its `media_proc_cfg` in preprocessor_config.json;
vLLM's KimiK25FusedVisionProcessor computes the same). Errors are ValueErrors with a message fit for an API
response: `ImageDecodeError`, `UnsupportedImageFormatError`, `ImageTooLargeError`. The steps, the limits and
placeholder counts against vLLM's: docs/vision.md.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Pillow's own bomb guard raises above 2 x Image.MAX_IMAGE_PIXELS; vLLM's default limit is the same number.
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970
DEFAULT_MAX_IMAGE_BYTES = 64 * 1024 * 1024
# Still-image formats decoded in-process by Pillow (Pillow's JPEG opener also reads MPO, as many phones write).
DEFAULT_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
MEDIA_PAD_TOKEN = "<|media_pad|>"
MEDIA_PAD_TOKEN_ID = 163605
IMAGE_PROMPT = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


class ImageInputError(ValueError):
    """An image that cannot be used; the message says why."""


class ImageDecodeError(ImageInputError):
    """Not decodable: not an image, corrupt or truncated data, bad base64."""


class UnsupportedImageFormatError(ImageInputError):
    """An image format outside the allow-list."""


class ImageTooLargeError(ImageInputError):
    """More pixels (or bytes) than the configured limit."""


@dataclass(frozen=True)
class ImageProcConfig:
    """Moonshot's `media_proc_cfg` for images (K2.5/K2.6 values) plus decode limits."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS
    alpha_background: tuple[int, int, int] | None = (255, 255, 255)
    exif_transpose: bool = True
    _lut: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.fixed_output_tokens is not None:
            # Moonshot's processor then reports a fixed count that the tower's output does not follow.
            raise ValueError("media_proc_cfg.fixed_output_tokens is not supported (K2.5/K2.6 leave it null)")
        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"media_proc_cfg.{name} must be positive, got {getattr(self, name)}")
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std_inv = 1.0 / np.asarray(self.image_std, dtype=np.float32)
        values = np.arange(256, dtype=np.float32)[:, None]
        # uint8 value -> normalized float32, per channel: the same float32 arithmetic as Moonshot's normalize
        object.__setattr__(self, "_lut", ((values / 255.0 - mean[None, :]) * std_inv[None, :]).astype(np.float32))

    @property
    def factor(self) -> int:
        """Padded sizes are multiples of this many pixels (patch x merge kernel)."""
        return self.patch_size * self.merge_kernel_size

    @classmethod
    def from_media_proc_cfg(cls, cfg: dict[str, Any], **overrides: Any) -> ImageProcConfig:
        """From preprocessor_config.json's `media_proc_cfg` (unknown keys, such as the video ones, ignored)."""
        merge = cfg.get("merge_kernel_size", 2)
        if isinstance(merge, (list, tuple)):
            if len(set(merge)) != 1:
                raise ValueError(f"media_proc_cfg.merge_kernel_size {merge} is not square")
            merge = merge[0]
        kwargs: dict[str, Any] = {"merge_kernel_size": int(merge)}
        for key in ("patch_size", "in_patch_limit", "patch_limit_on_one_side"):
            if cfg.get(key) is not None:
                kwargs[key] = int(cfg[key])
        for key in ("image_mean", "image_std"):
            if cfg.get(key) is not None:
                kwargs[key] = tuple(float(v) for v in cfg[key])
        if "fixed_output_tokens" in cfg:
            kwargs["fixed_output_tokens"] = cfg["fixed_output_tokens"]
        return cls(**{**kwargs, **overrides})

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **overrides: Any) -> ImageProcConfig:
        """preprocessor_config.json's `media_proc_cfg` when the directory has one; otherwise K2.6's values
        with patch and merge sizes from config.json's vision_config."""
        model_dir = Path(model_dir)
        pre = model_dir / "preprocessor_config.json"
        if pre.is_file():
            raw = json.loads(pre.read_text())
            return cls.from_media_proc_cfg(raw.get("media_proc_cfg", raw), **overrides)
        kwargs: dict[str, Any] = {}
        cfg_path = model_dir / "config.json"
        if cfg_path.is_file():
            vision = json.loads(cfg_path.read_text()).get("vision_config") or {}
            if "patch_size" in vision:
                kwargs["patch_size"] = int(vision["patch_size"])
            merge = vision.get("merge_kernel_size")
            if merge:
                kwargs["merge_kernel_size"] = int(merge[0] if isinstance(merge, (list, tuple)) else merge)
        return cls(**{**kwargs, **overrides})

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [..., 3] -> float32 [..., 3]."""
        lut = self._lut
        return np.stack([lut[pixels[..., c], c] for c in range(3)], axis=-1)


DEFAULT_CONFIG = ImageProcConfig()


@dataclass(frozen=True)
class ResizePlan:
    """How an image of `width` x `height` pixels is resized and padded."""

    width: int
    height: int
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    patch_size: int
    merge_kernel_size: int

    @property
    def grid_h(self) -> int:
        return (self.new_height + self.pad_height) // self.patch_size

    @property
    def grid_w(self) -> int:
        return (self.new_width + self.pad_width) // self.patch_size

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return (1, self.grid_h, self.grid_w)

    @property
    def num_patches(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def num_tokens(self) -> int:
        k = self.merge_kernel_size
        return (self.grid_h // k) * (self.grid_w // k)


def plan_resize(width: int, height: int, cfg: ImageProcConfig = DEFAULT_CONFIG) -> ResizePlan:
    """Moonshot's navit resize: the largest size within the patch limits (never larger than the original),
    then padding to multiples of patch x merge kernel."""
    if width < 1 or height < 1:
        raise ImageDecodeError(f"image has no pixels ({width}x{height})")
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    patches = max(1.0, width // p) * max(1.0, height // p)
    scale = min(1.0, math.sqrt(cfg.in_patch_limit / patches), side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    f = cfg.factor
    return ResizePlan(width, height, new_w, new_h, (f - new_w % f) % f, (f - new_h % f) % f, p, cfg.merge_kernel_size)


def num_placeholder_tokens(width: int, height: int, cfg: ImageProcConfig = DEFAULT_CONFIG) -> int:
    """How many `<|media_pad|>` tokens (= tower embeddings) an image of width x height pixels (after EXIF
    orientation) takes: (padded grid_h / 2) * (padded grid_w / 2)."""
    return plan_resize(width, height, cfg).num_tokens


# ---------------------------------------------------------------------------------------------------------
# decoding

_DATA_URL = re.compile(r"^data:(?P<mime>[\w/+.-]*)(?P<params>(;[\w=.+-]+)*?)(?P<b64>;base64)?,", re.IGNORECASE)
_MAGIC = (
    (b"%PDF", "PDF"),
    (b"%!PS", "PostScript/EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
)


def _sniff_format(data: bytes) -> str | None:
    """A name for common non-allowed formats Pillow may not identify (for the error message)."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        if brand in (b"heic", b"heix", b"hevc", b"hevx", b"mif1", b"msf1", b"heim", b"heis"):
            return "HEIC/HEIF"
        if brand in (b"avif", b"avis"):
            return "AVIF"
        return f"ISO media ({brand.decode('latin-1')})"
    head = data[:512].lstrip().lower()
    if head.startswith((b"<?xml", b"<svg")) or b"<svg" in head:
        return "SVG"
    return None


def image_bytes(
    data: bytes | bytearray | memoryview | str | os.PathLike, cfg: ImageProcConfig = DEFAULT_CONFIG
) -> bytes:
    """The encoded image from raw bytes, a `data:` URL, a bare base64 string or a file path."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
    elif isinstance(data, os.PathLike):
        path = Path(data)
        size = path.stat().st_size
        if size > cfg.max_image_bytes:
            raise ImageTooLargeError(f"image file is {size} bytes; the limit is {cfg.max_image_bytes}")
        raw = path.read_bytes()
    elif isinstance(data, str):
        text = data.strip()
        m = _DATA_URL.match(text)
        if m is not None:
            if not m.group("b64"):
                raise ImageDecodeError("a data: URL image must be base64-encoded (';base64,')")
            mime = m.group("mime").lower()
            if mime and not mime.startswith("image/"):
                raise UnsupportedImageFormatError(f"data: URL has media type {mime!r}, not an image")
            text = text[m.end():]
        if len(text) * 3 // 4 > cfg.max_image_bytes:
            raise ImageTooLargeError(f"image is about {len(text) * 3 // 4} bytes; the limit is {cfg.max_image_bytes}")
        try:
            raw = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageDecodeError(f"image is not valid base64: {e}") from None
    else:
        raise TypeError(
            f"an image must be bytes, a data: URL / base64 str, a path or a PIL image, not {type(data).__name__}"
        )
    if len(raw) > cfg.max_image_bytes:
        raise ImageTooLargeError(f"image is {len(raw)} bytes; the limit is {cfg.max_image_bytes}")
    if not raw:
        raise ImageDecodeError("image data is empty")
    return raw


def _check_pixels(width: int, height: int, cfg: ImageProcConfig) -> None:
    if width < 1 or height < 1:
        raise ImageDecodeError(f"image has no pixels ({width}x{height})")
    if width * height > cfg.max_image_pixels:
        raise ImageTooLargeError(
            f"image is {width}x{height} = {width * height} pixels; the limit is {cfg.max_image_pixels} pixels"
        )


def _to_rgb(image, cfg: ImageProcConfig):
    from PIL import Image

    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if cfg.alpha_background is not None and has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, tuple(cfg.alpha_background))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")  # as Moonshot's processor and vLLM do, for every other mode


def decode_image(data: Any, cfg: ImageProcConfig = DEFAULT_CONFIG):
    """An RGB PIL image from bytes, a data: URL / base64 str, a path or a PIL image (see the module doc).
    Raises ImageDecodeError, UnsupportedImageFormatError or ImageTooLargeError (all ValueErrors)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(data, Image.Image):
        _check_pixels(*data.size, cfg)
        image = data
    else:
        raw = image_bytes(data, cfg)
        Image.init()
        allowed = tuple(f.upper() for f in cfg.formats if f.upper() in Image.OPEN)
        try:
            image = Image.open(io.BytesIO(raw), formats=allowed)
        except Image.DecompressionBombError as e:
            raise ImageTooLargeError(f"image is too large to decode: {e}") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as first:
            fmt = None
            try:  # identify the header only (no decoding) to say which format was refused
                with Image.open(io.BytesIO(raw)) as other:
                    fmt = other.format
            except Exception:  # noqa: BLE001 -- any failure means "not identified"
                fmt = None
            fmt = fmt or _sniff_format(raw)
            if fmt is not None and fmt.upper() not in allowed + ("MPO",):
                raise UnsupportedImageFormatError(
                    f"image format {fmt} is not supported; send one of {', '.join(cfg.formats)}"
                ) from None
            raise ImageDecodeError(f"cannot decode the image: {first}") from None
        _check_pixels(*image.size, cfg)
    try:  # decode the pixels now (a lazily opened PIL image given by the caller too)
        image.load()
    except Image.DecompressionBombError as e:
        raise ImageTooLargeError(f"image is too large to decode: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        msg = str(e)
        if "truncated" in msg.lower():
            raise ImageDecodeError(f"image data is truncated ({image.format}): {msg}") from None
        raise ImageDecodeError(f"cannot decode the {image.format} image: {msg}") from None
    if cfg.exif_transpose:
        # a broken EXIF block leaves the pixels as stored (as vLLM does)
        with contextlib.suppress(Exception):
            image = ImageOps.exif_transpose(image)
    try:
        return _to_rgb(image, cfg)
    except (OSError, ValueError) as e:
        raise ImageDecodeError(f"cannot convert the {image.mode} image to RGB: {e}") from None


# ---------------------------------------------------------------------------------------------------------
# preprocessing


@dataclass(frozen=True)
class PreprocessedImage:
    """One image ready for the tower: `pixel_values` [grid_h * grid_w, 3, p, p] float32, `grid_thw`
    (1, grid_h, grid_w), `num_tokens` placeholders."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    plan: ResizePlan

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


def resize_and_pad(image, plan: ResizePlan) -> np.ndarray:
    """uint8 [new_h + pad_h, new_w + pad_w, 3]: bicubic resize, black padding right and bottom."""
    from PIL import Image

    resized = np.asarray(image.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC))
    return np.pad(resized, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)), mode="constant", constant_values=0)


def patchify(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """[H, W, C] -> [H/p * W/p, C, p, p], patches row-major."""
    h, w, c = pixels.shape
    p = patch_size
    grid = pixels.reshape(h // p, p, w // p, p, c)
    return np.ascontiguousarray(grid.transpose(0, 2, 4, 1, 3)).reshape(-1, c, p, p)


def preprocess_image(image: Any, cfg: ImageProcConfig = DEFAULT_CONFIG) -> PreprocessedImage:
    """Decode (unless already an RGB PIL image is given), resize, pad, normalize and patchify one image."""
    rgb = decode_image(image, cfg)
    plan = plan_resize(rgb.width, rgb.height, cfg)
    pixels = cfg.normalize(resize_and_pad(rgb, plan))
    patches = torch.from_numpy(patchify(pixels, cfg.patch_size))
    return PreprocessedImage(patches, plan.grid_thw, plan)


def preprocess_images(
    images: Sequence[Any], cfg: ImageProcConfig = DEFAULT_CONFIG
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Several images, for one tower call: pixel_values [sum patches, 3, p, p] (images in order),
    grid_thws [n, 3] int64 and the placeholder count of each image."""
    done = [preprocess_image(im, cfg) for im in images]
    p = cfg.patch_size
    pixel_values = torch.cat([d.pixel_values for d in done]) if done else torch.zeros(0, 3, p, p)
    grids = torch.tensor([d.grid_thw for d in done], dtype=torch.int64).reshape(-1, 3)
    return pixel_values, grids, [d.num_tokens for d in done]


def expand_media_placeholders(
    token_ids: Sequence[int], num_tokens: Sequence[int], media_pad_id: int = MEDIA_PAD_TOKEN_ID
) -> list[int]:
    """Replace the i-th `<|media_pad|>` of a rendered prompt by num_tokens[i] copies of it. The number of
    media_pad tokens must equal the number of images."""
    found = sum(1 for t in token_ids if t == media_pad_id)
    if found != len(num_tokens):
        raise ValueError(f"the prompt has {found} image placeholders ({MEDIA_PAD_TOKEN}) for {len(num_tokens)} images")
    out: list[int] = []
    counts = iter(num_tokens)
    for t in token_ids:
        if t == media_pad_id:
            out.extend([media_pad_id] * next(counts))
        else:
            out.append(t)
    return out
