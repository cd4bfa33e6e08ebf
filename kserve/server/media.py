"""Images in chat requests: where they sit, fetching (allow-listed hosts only), decoding, placeholder expansion.

Every API turns its image parts into chat `image_url` parts; the template writes one `<|media_pad|>` per image, and
after tokenization `expand` replaces the i-th by the run of placeholder ids the engine expects for image i.
Details: docs/server.md, 'Images'.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from kserve.server.context import ServingContext
from kserve.server.errors import APIError, bad_request

logger = logging.getLogger("kserve.server")

IMAGE_PART_TYPE = "image_url"  # the chat content part every API's image becomes
WHERE_KEY = "kserve_where"  # the part's location in the request as its API names it (error messages)
IMAGE_DETAILS = ("auto", "low", "high")
MAX_REDIRECTS = 3
_DATA_URL = re.compile(r"^data:(?P<mime>[^,;]*)(?P<params>(?:;[^,;]*)*),", re.IGNORECASE)


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: its URL (`data:` or http(s)) and where it was given."""

    url: str
    where: str  # e.g. "messages[0].content[1]", "messages.0.content.1", "input[0].content[1]"

    @property
    def param(self) -> str:
        return self.where

    @property
    def is_remote(self) -> bool:
        return self.url[:5].lower() != "data:"


@dataclass(frozen=True)
class LoadedImage:
    ref: ImageRef
    num_tokens: int
    size: tuple[int, int]  # (width, height) after EXIF orientation
    engine_input: Any = None  # kserve.engine.multimodal.ImageInput; None when only counting


# ----------------------------------------------------------------------------- support and collection


def images_unsupported_reason(ctx: ServingContext) -> str | None:
    """Why this server takes no images, or None when it does."""
    llm = ctx.llm_engine
    if getattr(llm, "supports_images", False):
        return None
    return getattr(llm, "images_unsupported_reason", None) or "this model takes text only"


def require_image_support(ctx: ServingContext, where: str, what: str, param: str | None = None) -> None:
    """A 400 (`unsupported_content`) for an image at `where` when the model cannot take images."""
    reason = images_unsupported_reason(ctx)
    if reason is not None:
        raise bad_request(f"{where}: {what} is not supported here: {reason}", param, "unsupported_content")


def image_part(url: Any, where: str, detail: Any = None) -> dict[str, Any]:
    """The chat content part for an image given at `where` (Anthropic and Responses translations)."""
    image_url: dict[str, Any] = {"url": url}
    if detail is not None:
        image_url["detail"] = detail
    return {"type": IMAGE_PART_TYPE, "image_url": image_url, WHERE_KEY: where}


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == IMAGE_PART_TYPE


def _check_url(ctx: ServingContext, url: Any, where: str) -> str:
    param = where
    if not isinstance(url, str) or not url.strip():
        raise bad_request(f"{where}: an image needs a non-empty string URL (a data: URL or an http(s) URL)", param,
                          "invalid_image_url")
    url = url.strip()
    if url[:5].lower() == "data:":
        m = _DATA_URL.match(url)
        if m is None:
            raise bad_request(f"{where}: bad data URL: expected 'data:image/<format>;base64,<data>'", param,
                              "invalid_image_url")
        mime = m.group("mime").lower()
        if mime and not mime.startswith("image/"):
            raise bad_request(f"{where}: the data URL has media type {mime!r}, not an image", param,
                              "unsupported_image_format")
        if ";base64" not in m.group("params").lower():
            raise bad_request(f"{where}: bad data URL: an image data URL must be base64-encoded "
                              "('data:image/<format>;base64,<data>')", param, "invalid_image_url")
        return url
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        shown = url if len(url) <= 80 else url[:77] + "..."
        raise bad_request(f"{where}: unsupported image URL {shown!r}: send a data: URL (base64) or an http(s) URL",
                          param, "invalid_image_url")
    check_domain(ctx, url, where)
    return url


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").rstrip(".").lower()


def check_domain(ctx: ServingContext, url: str, where: str) -> None:
    allowed = {d.strip().rstrip(".").lower() for d in ctx.settings.allowed_media_domains or [] if d.strip()}
    host = _host(url)
    if host in allowed:
        return
    if not allowed:
        raise bad_request(f"{where}: image URLs are not fetched by this server (it was started without "
                          "--allowed-media-domains); send the image as a data: URL", where, "media_domain_not_allowed")
    raise bad_request(f"{where}: the image URL's host {host!r} is not in --allowed-media-domains "
                      f"({', '.join(sorted(allowed))}; hosts match exactly, subdomains are not included)", where,
                      "media_domain_not_allowed")


def collect_images(ctx: ServingContext, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """The messages with every image part reduced to a bare one (what the template needs to write its
    placeholder), and the images in prompt order. Raises a 400 when the model takes no images, when there are
    more than the server's limit, or for a bad URL, a bad `detail` or a URL from a host not allowed."""
    found: list[tuple[dict[str, Any], str]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if is_image_part(part):
                found.append((part, part.get(WHERE_KEY) or f"messages[{i}].content[{j}]"))
    if not found:
        return messages, []
    first_where = found[0][1]
    require_image_support(ctx, first_where, "content part type 'image_url'", f"{first_where}.type")
    limit = ctx.settings.max_images_per_request
    if len(found) > limit:
        raise bad_request(f"the request has {len(found)} images; this server takes at most {limit} per request "
                          "(the whole conversation counted)", "messages", "too_many_images")
    refs: list[ImageRef] = []
    for part, where in found:
        image_url = part.get("image_url")
        detail = None
        if isinstance(image_url, dict):
            url, detail = image_url.get("url"), image_url.get("detail")
        else:
            url = image_url  # a bare string, as some clients send it
        if detail is not None and detail not in IMAGE_DETAILS:
            raise bad_request(f"{where}: image detail must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r}",
                              where, "invalid_value")
        refs.append(ImageRef(_check_url(ctx, url, where), where))
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            message = {**message, "content": [_bare_part() if is_image_part(p) else p for p in content]}
        out.append(message)
    return out, refs


def _bare_part() -> dict[str, Any]:
    """What the template sees in place of an image: enough for every dialect's test of "is an image part"."""
    return {"type": IMAGE_PART_TYPE, "image_url": {"url": ""}}


def check_rendered(ctx: ServingContext, prompt_ids: list[int], refs: list[ImageRef]) -> None:
    """The template wrote one `<|media_pad|>` per image (a custom template may drop or repeat them)."""
    if not refs:
        return
    pad = media_pad_id(ctx)
    written = sum(1 for t in prompt_ids if t == pad)
    if written != len(refs):
        raise bad_request(f"the chat template wrote {written} image placeholders (<|media_pad|>) for "
                          f"{len(refs)} images; it must write exactly one per image", "messages",
                          "image_placeholder_mismatch")


def media_pad_id(ctx: ServingContext) -> int:
    pad = getattr(ctx.llm_engine, "media_placeholder_token_id", None)
    if pad is None:
        pad = ctx.tokenizer.special_ids.get("<|media_pad|>")
    if pad is None:
        raise APIError(500, "this model has no <|media_pad|> token", code="internal_error")
    return int(pad)


# ----------------------------------------------------------------------------- fetching


async def fetch(ctx: ServingContext, ref: ImageRef) -> bytes:
    """The bytes at an allowed http(s) URL: within the time and size limits, redirects followed only to the
    same host."""
    import httpx

    settings = ctx.settings
    limit = settings.media_fetch_max_bytes
    timeout = settings.media_fetch_timeout_s
    url = ref.url
    where = ref.where
    try:
        async with asyncio.timeout(timeout), httpx.AsyncClient(follow_redirects=False, timeout=timeout) as client:
            for _ in range(MAX_REDIRECTS + 1):
                async with client.stream("GET", url, headers={"Accept": "image/*"}) as resp:
                    if resp.is_redirect:
                        target = urljoin(url, resp.headers.get("location", ""))
                        if urlsplit(target).scheme.lower() not in ("http", "https") or _host(target) != _host(url):
                            raise bad_request(f"{where}: the image URL redirects to {target!r}, another host; "
                                              "redirects are followed only within the same host", where,
                                              "media_redirect_refused")
                        url = target
                        continue
                    if resp.status_code != 200:
                        raise bad_request(f"{where}: fetching the image failed: HTTP {resp.status_code} from "
                                          f"{_host(url)}", where, "media_fetch_failed")
                    declared = resp.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > limit:
                        raise _too_big(where, limit)
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in resp.aiter_bytes():
                        size += len(chunk)
                        if size > limit:
                            raise _too_big(where, limit)
                        chunks.append(chunk)
                    return b"".join(chunks)
            raise bad_request(f"{where}: the image URL redirects more than {MAX_REDIRECTS} times", where,
                              "media_fetch_failed")
    except TimeoutError:
        raise bad_request(f"{where}: fetching the image took longer than {timeout:g} s", where,
                          "media_fetch_timeout") from None
    except httpx.HTTPError as exc:
        raise bad_request(f"{where}: fetching the image failed: {type(exc).__name__}: {exc}", where,
                          "media_fetch_failed") from None


def _too_big(where: str, limit: int) -> APIError:
    return bad_request(f"{where}: the image at this URL is larger than the server's limit of {limit} bytes", where,
                       "image_too_large")


# ----------------------------------------------------------------------------- decoding


_ERROR_CODES = (("ImageTooLargeError", "image_too_large"), ("UnsupportedImageFormatError", "unsupported_image_format"),
                ("ImageDecodeError", "invalid_image"))


_PIL_UNIDENTIFIED = re.compile(r"cannot identify image file <[^>]*>")


def image_error(ref: ImageRef, exc: Exception) -> APIError:
    names = {cls.__name__ for cls in type(exc).__mro__}
    code = next((code for name, code in _ERROR_CODES if name in names), "invalid_image")
    # Pillow names the in-memory file object (with its address); say what it means instead
    message = _PIL_UNIDENTIFIED.sub("the data is not an image in a known format", str(exc))
    return bad_request(f"{ref.where}: {message}", ref.param, code)


def _image_config(ctx: ServingContext) -> Any:
    from kserve.model.vision_preprocess import DEFAULT_CONFIG

    return getattr(ctx.llm_engine, "image_config", None) or DEFAULT_CONFIG


def _decode(ref: ImageRef, data: bytes | str, cfg: Any, preprocess: bool) -> LoadedImage:
    from kserve.model.vision_preprocess import ImageInputError, decode_image, num_placeholder_tokens, preprocess_image

    try:
        if preprocess:
            from kserve.engine.multimodal import ImageInput

            done = preprocess_image(data, cfg)  # and hashed here too: both are CPU work off the event loop
            return LoadedImage(ref, done.num_tokens, (done.plan.width, done.plan.height),
                               ImageInput.from_preprocessed(done))
        image = decode_image(data, cfg)
        return LoadedImage(ref, num_placeholder_tokens(image.width, image.height, cfg), image.size)
    except ImageInputError as exc:
        raise image_error(ref, exc) from None


async def _load(ctx: ServingContext, ref: ImageRef, cfg: Any, preprocess: bool) -> LoadedImage:
    data: bytes | str = await fetch(ctx, ref) if ref.is_remote else ref.url
    return await asyncio.to_thread(_decode, ref, data, cfg, preprocess)


async def load_images(ctx: ServingContext, refs: list[ImageRef], *, preprocess: bool = True) -> list[LoadedImage]:
    """Fetch and decode every image (concurrently, decoding in worker threads); the first failure is the 400.
    `preprocess=False` only decodes, to count placeholders (/tokenize, count_tokens)."""
    if not refs:
        return []
    cfg = _image_config(ctx)
    tasks = [asyncio.ensure_future(_load(ctx, ref, cfg, preprocess)) for ref in refs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def expand(ctx: ServingContext, prompt_ids: list[int], loaded: list[LoadedImage]) -> list[int]:
    """The prompt with image i's `<|media_pad|>` repeated as many times as it has placeholder tokens."""
    if not loaded:
        return prompt_ids
    from kserve.model.vision_preprocess import expand_media_placeholders

    try:
        return expand_media_placeholders(prompt_ids, [image.num_tokens for image in loaded], media_pad_id(ctx))
    except ValueError as exc:  # check_rendered ran first; a backstop
        raise bad_request(str(exc), "messages", "image_placeholder_mismatch") from None


def check_context(ctx: ServingContext, prompt_ids: list[int], loaded: list[LoadedImage]) -> None:
    """A 400 naming the images' share when their placeholders make the prompt too long for the context."""
    if not loaded or len(prompt_ids) < ctx.max_model_len:
        return
    image_tokens = sum(image.num_tokens for image in loaded)
    each = "; ".join(f"{image.ref.where}: {image.size[0]}x{image.size[1]} px -> {image.num_tokens} tokens"
                     for image in loaded)
    raise APIError(400, f"the prompt is {len(prompt_ids)} tokens, {image_tokens} of them for {len(loaded)} "
                        f"image{'s' if len(loaded) != 1 else ''} ({each}); with at least one generated token that "
                        f"exceeds the model's context of {ctx.max_model_len} tokens; send fewer or smaller images "
                        "or a shorter conversation", param="messages", code="context_length_exceeded")


def image_inputs(loaded: list[LoadedImage]) -> list[Any]:
    """What the engine takes (kserve.engine.multimodal.ImageInput), in order."""
    return [image.engine_input for image in loaded]


async def prompt_with_images(ctx: ServingContext, prompt_ids: list[int], refs: list[ImageRef], *,
                             preprocess: bool = True) -> tuple[list[int], list[LoadedImage]]:
    """The expanded prompt ids and the loaded images (none: the prompt as it is)."""
    if not refs:
        return prompt_ids, []
    loaded = await load_images(ctx, refs, preprocess=preprocess)
    return expand(ctx, prompt_ids, loaded), loaded
