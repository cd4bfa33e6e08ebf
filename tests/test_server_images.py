"""Images through chat completions, Anthropic Messages, Responses and `/tokenize`, on a real uvicorn over the
tiny K2.6-layout checkpoint (random MoonViT tower), through the official `openai` and `anthropic` SDKs.

Checked: each image reaches the engine as its run of placeholder ids (the count of
kserve.model.vision_preprocess) plus its preprocessed pixels, in order; usage, count_tokens and /tokenize
count the placeholders; both prompt renderers (built-in and Moonshot's jinja templates) write one
`<|media_pad|>` per image; remote URLs are fetched only from allowed hosts, within the size and time limits,
never through a redirect to another host; every bad image is a 400 in the API's own shape and the server keeps
serving; a model without a tower (the embedded K2) and `--language-model-only` answer 400.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
PIL_Image = pytest.importorskip("PIL.Image")

from live_server import openai_client, running_server

from kserve.chat import ChatTemplate, load_tokenizer
from kserve.config import EngineConfig
from kserve.engine.multimodal import placeholder_runs
from kserve.model.vision_preprocess import num_placeholder_tokens
from kserve.server.context import ServerSettings, ServingContext
from kserve.server.errors import APIError
from kserve.server.media import check_domain

TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "kimi_k25" / "templates"
MAX_MODEL_LEN = 1024
FETCH_MAX_BYTES = 200_000
FETCH_TIMEOUT_S = 1.0


# ----------------------------------------------------------------------------- images


def png(width: int, height: int, color: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    image = PIL_Image.new("RGB", (width, height), color)
    image.putpixel((0, 0), (0, 255, 0))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def jpeg(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    PIL_Image.new("RGB", (width, height), (10, 120, 200)).save(buf, "JPEG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (no pixel data): a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


SMALL = png(100, 50)  # 8 placeholder tokens
SQUARE = png(224, 224)  # 64
PHOTO = jpeg(640, 480)  # 414
TOO_BIG_FOR_CONTEXT = png(1024, 1024)  # 1369 > MAX_MODEL_LEN
TRUNCATED = SQUARE[: len(SQUARE) // 2]
GARBAGE = b"this is certainly not an image, just some text bytes"
PDF = b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n"


def chat_image(url: str, detail: str | None = None) -> dict[str, Any]:
    image_url: dict[str, Any] = {"url": url}
    if detail is not None:
        image_url["detail"] = detail
    return {"type": "image_url", "image_url": image_url}


def user_with(*parts: dict[str, Any], text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def anthropic_image(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": b64(data)}}


# ----------------------------------------------------------------------------- a local image host


class _ImageHost(BaseHTTPRequestHandler):
    port = 0

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, length: bool = True) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path
        if path == "/square.png":
            self._send(200, SQUARE, {"Content-Type": "image/png"})
        elif path == "/same-host-redirect":
            self._send(302, b"", {"Location": "/square.png"})
        elif path == "/other-host-redirect":
            self._send(302, b"", {"Location": f"http://localhost:{self.server.server_address[1]}/square.png"})
        elif path == "/big.png":
            self._send(200, b"\0" * (FETCH_MAX_BYTES + 1000), {"Content-Type": "image/png"})
        elif path == "/big-unannounced.png":  # no Content-Length: the limit holds while reading
            self._send(200, b"\0" * (FETCH_MAX_BYTES + 1000), {"Content-Type": "image/png"}, length=False)
        elif path == "/slow.png":
            time.sleep(FETCH_TIMEOUT_S + 2)
            self._send(200, SQUARE, {"Content-Type": "image/png"})
        elif path == "/page.html":
            self._send(200, b"<html><body>not an image</body></html>", {"Content-Type": "text/html"})
        else:
            self._send(404, b"not found")


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHost)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


# ----------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def k25(tiny_k25_dir) -> Iterator[Any]:
    engine = EngineConfig(model=str(tiny_k25_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    with running_server(engine, allowed_media_domains=["127.0.0.1"], media_fetch_max_bytes=FETCH_MAX_BYTES,
                        media_fetch_timeout_s=FETCH_TIMEOUT_S, responses_store_size=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def ctx(k25) -> ServingContext:
    return k25.app.state.server.context


@pytest.fixture(scope="module")
def client(k25):
    return openai_client(k25)


@pytest.fixture(scope="module")
def claude(k25):
    return anthropic.Anthropic(base_url=k25.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture
def engine_calls(ctx) -> Iterator[list[tuple[list[int], list | None]]]:
    """(prompt ids, images) of every engine request, in order (a tap, not a stand-in)."""
    seen: list[tuple[list[int], list | None]] = []
    generate = ctx.engine.generate

    def tap(request_id, prompt_ids, params, images=None):
        seen.append((list(prompt_ids), images))
        return generate(request_id, prompt_ids, params, images=images)

    ctx.engine.generate = tap
    yield seen
    del ctx.engine.generate


def pad_id(ctx: ServingContext) -> int:
    return ctx.llm_engine.media_placeholder_token_id


def tokenize(server: Any, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return httpx.post(server.base_url + "/tokenize", json={"messages": messages, **extra}, timeout=120)


def count(server: Any, messages: list[dict[str, Any]]) -> int:
    resp = tokenize(server, messages)
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


def healthy(server: Any) -> None:
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def check_engine_images(ctx: ServingContext, prompt: list[int], images: list | None, counts: list[int]) -> None:
    runs = placeholder_runs(prompt, pad_id(ctx))
    assert [length for _, length in runs] == counts
    assert images is not None and [image.num_tokens for image in images] == counts
    for image in images:
        _, grid_h, grid_w = image.grid_thw
        assert image.pixel_values.shape[0] == grid_h * grid_w and grid_h * grid_w == 4 * image.num_tokens


# ----------------------------------------------------------------------------- rendering


def _k25_templates() -> list[str]:
    return [name for name in ("k2.5", "k2.6", "k2.7-code") if (TEMPLATES / name / "chat_template.jinja").exists()]


@pytest.mark.parametrize("name", _k25_templates())
def test_builtin_and_jinja_write_one_media_pad_per_image_in_order(name, tiny_k25_dir):
    tokenizer = load_tokenizer(str(tiny_k25_dir))
    pad = tokenizer.special_ids["<|media_pad|>"]
    jinja = ChatTemplate(source=(TEMPLATES / name / "chat_template.jinja").read_text(), origin=name)
    builtin = ChatTemplate(dialect=jinja.dialect)
    assert jinja.dialect.name == name
    bare = {"type": "image_url", "image_url": {"url": ""}}
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "one "}, bare, {"type": "text", "text": " two"}, bare]},
        {"role": "assistant", "content": "seen"},
        {"role": "user", "content": [{"type": "image", "image": ""}, {"type": "text", "text": "and this"}]},
    ]
    for thinking in (True, False):
        ours = builtin.encode(tokenizer, messages, thinking=thinking)
        theirs = jinja.encode(tokenizer, messages, thinking=thinking)
        assert ours == theirs
        assert ours.count(pad) == 3
        text = builtin.render(messages, thinking=thinking)
        assert text == jinja.render(messages, thinking=thinking)
        assert text.count("<|media_begin|>image<|media_content|><|media_pad|><|media_end|>") == 3


def test_jinja_template_on_the_live_server_counts_as_the_builtin(k25, ctx, monkeypatch):
    source = TEMPLATES / "k2.6" / "chat_template.jinja"
    if not source.exists():
        pytest.skip("shared K2.6 template not available")
    messages = user_with(chat_image(data_url(SMALL)), chat_image(data_url(SQUARE)))
    builtin = tokenize(k25, messages).json()["tokens"]
    monkeypatch.setattr(ctx, "template", ChatTemplate(source=source.read_text(), origin=str(source)))
    assert tokenize(k25, messages).json()["tokens"] == builtin
    assert [n for _, n in placeholder_runs(builtin, pad_id(ctx))] == [8, 64]


# ----------------------------------------------------------------------------- /tokenize


@pytest.mark.parametrize(("size", "tokens"), [((1, 1), 1), ((100, 50), 8), ((224, 224), 64), ((640, 480), 414)])
def test_tokenize_counts_each_images_placeholders(k25, ctx, size, tokens):
    assert num_placeholder_tokens(*size) == tokens
    text_only = count(k25, user_with())
    one_pad = count(k25, user_with(chat_image(data_url(png(1, 1)))))  # a 1x1 image is one placeholder
    resp = tokenize(k25, user_with(chat_image(data_url(png(*size)))), return_token_strs=True)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["count"] == len(body["tokens"]) == one_pad - 1 + tokens and body["max_model_len"] == MAX_MODEL_LEN
    assert one_pad > text_only + 1  # the placeholder's frame (<|media_begin|>image<|media_content|>...) counts too
    assert [n for _, n in placeholder_runs(body["tokens"], pad_id(ctx))] == [tokens]
    assert {body["token_strs"][i] for i, t in enumerate(body["tokens"]) if t == pad_id(ctx)} == {"<|media_pad|>"}


def test_detail_is_accepted_and_changes_no_count(k25):
    counts = {detail: count(k25, user_with(chat_image(data_url(PHOTO, "image/jpeg"), detail)))
              for detail in (None, "auto", "low", "high")}
    assert len(set(counts.values())) == 1
    resp = tokenize(k25, user_with(chat_image(data_url(PHOTO, "image/jpeg"), "ultra")))
    assert resp.status_code == 400 and "detail" in resp.json()["error"]["message"]


def test_images_keep_their_order(k25, ctx):
    forward = tokenize(k25, user_with(chat_image(data_url(SMALL)), chat_image(data_url(SQUARE)))).json()["tokens"]
    backward = tokenize(k25, user_with(chat_image(data_url(SQUARE)), chat_image(data_url(SMALL)))).json()["tokens"]
    assert [n for _, n in placeholder_runs(forward, pad_id(ctx))] == [8, 64]
    assert [n for _, n in placeholder_runs(backward, pad_id(ctx))] == [64, 8]


# ----------------------------------------------------------------------------- OpenAI chat completions


def test_openai_chat_with_an_image_whole_and_streamed(client, k25, ctx, engine_calls):
    messages = user_with(chat_image(data_url(SMALL), "high"), chat_image(data_url(PHOTO, "image/jpeg")))
    expected = count(k25, messages)
    reply = client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=4, temperature=0)
    assert reply.usage.prompt_tokens == expected
    assert reply.usage.completion_tokens >= 1
    prompt, images = engine_calls[-1]
    assert len(prompt) == expected
    check_engine_images(ctx, prompt, images, [8, 414])

    stream = client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                                 for c in chunks if c.choices)
    whole = reply.choices[0].message
    assert streamed == (whole.content or "")
    assert streamed_reasoning == (getattr(whole, "reasoning_content", None) or "")
    check_engine_images(ctx, *engine_calls[-1], [8, 414])
    healthy(k25)


def test_openai_chat_image_in_history_and_tool_message(client, k25, ctx, engine_calls):
    messages = [
        {"role": "user", "content": [chat_image(data_url(SQUARE)), {"type": "text", "text": "Remember this."}]},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, chat_image(data_url(SMALL))]},
    ]
    reply = client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=2)
    assert reply.usage.prompt_tokens == count(k25, messages)
    check_engine_images(ctx, *engine_calls[-1], [64, 8])


def test_remote_image_from_an_allowed_host(client, k25, ctx, image_host, engine_calls):
    local = count(k25, user_with(chat_image(data_url(SQUARE))))
    for path in ("/square.png", "/same-host-redirect"):
        messages = user_with(chat_image(image_host + path))
        assert count(k25, messages) == local
        reply = client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=2)
        assert reply.usage.prompt_tokens == local
        check_engine_images(ctx, *engine_calls[-1], [64])


def test_the_same_image_gives_the_same_greedy_text(client, ctx):
    messages = user_with(chat_image(data_url(SQUARE)))
    kw = {"model": ctx.model_name, "messages": messages, "max_tokens": 6, "temperature": 0}
    first = client.chat.completions.create(**kw).choices[0].message
    again = client.chat.completions.create(**kw).choices[0].message  # prefix cache keyed on the image's hash
    assert (first.content, getattr(first, "reasoning_content", None)) == \
        (again.content, getattr(again, "reasoning_content", None))


# ----------------------------------------------------------------------------- Anthropic Messages


def test_anthropic_image_blocks_whole_streamed_and_counted(claude, k25, ctx, image_host, engine_calls):
    content = [anthropic_image(SMALL), {"type": "text", "text": "What is this?"},
               {"type": "image", "source": {"type": "url", "url": image_host + "/square.png"}}]
    messages = [{"role": "user", "content": content}]
    counted = claude.messages.count_tokens(model=ctx.model_name, messages=messages).input_tokens
    chat_twin = [{"role": "user", "content": [chat_image(data_url(SMALL)), {"type": "text", "text": "What is this?"},
                                               chat_image(data_url(SQUARE))]}]
    assert counted == count(k25, chat_twin)
    msg = claude.messages.create(model=ctx.model_name, max_tokens=4, messages=messages)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted
    check_engine_images(ctx, *engine_calls[-1], [8, 64])
    with claude.messages.stream(model=ctx.model_name, max_tokens=4, messages=messages) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted
    check_engine_images(ctx, *engine_calls[-1], [8, 64])


def test_anthropic_image_in_a_tool_result(claude, ctx, engine_calls):
    tool = {"name": "snap", "description": "Take a photo", "input_schema": {"type": "object", "properties": {}}}
    messages = [
        {"role": "user", "content": "Take a photo."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "snap", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "here"}, anthropic_image(PHOTO, "image/jpeg")]}]},
    ]
    msg = claude.messages.create(model=ctx.model_name, max_tokens=2, messages=messages, tools=[tool])
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(engine_calls[-1][0])
    check_engine_images(ctx, *engine_calls[-1], [414])


# ----------------------------------------------------------------------------- Responses


def test_responses_input_image_whole_streamed_and_followed_up(client, k25, ctx, engine_calls):
    content = [{"type": "input_text", "text": "Describe it."},
               {"type": "input_image", "image_url": data_url(SQUARE), "detail": "auto"}]
    first = client.responses.create(model=ctx.model_name, input=[{"role": "user", "content": content}],
                                    max_output_tokens=4)
    chat_twin = user_with(chat_image(data_url(SQUARE)), text="Describe it.")
    assert first.usage.input_tokens == count(k25, chat_twin)
    check_engine_images(ctx, *engine_calls[-1], [64])
    with client.responses.stream(model=ctx.model_name, input=[{"role": "user", "content": content}],
                                 max_output_tokens=4) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.input_tokens == first.usage.input_tokens
    follow = client.responses.create(model=ctx.model_name, previous_response_id=first.id, max_output_tokens=2,
                                     input=[{"role": "user", "content": [
                                         {"type": "input_text", "text": "And now?"},
                                         {"type": "input_image", "image_url": data_url(SMALL)}]}])
    check_engine_images(ctx, *engine_calls[-1], [64, 8])  # the stored turn's image comes along
    assert follow.usage.input_tokens == len(engine_calls[-1][0])


# ----------------------------------------------------------------------------- bad input


def _openai_error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def _anthropic_error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


def _post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def _three_apis(server: Any, model: str, url: str, stream: bool = False) -> dict[str, dict[str, Any]]:
    """The error each API answers for an image at `url` (a data: or http(s) URL)."""
    chat = _post(server, "/v1/chat/completions", {"model": model, "max_tokens": 2, "stream": stream,
                                                  "messages": user_with(chat_image(url))})
    if url.startswith("data:") and ";base64," in url:
        mime, _, data = url[5:].partition(";base64,")
        source = {"type": "base64", "media_type": mime if mime in ("image/png", "image/jpeg") else "image/png",
                  "data": data}
    else:
        source = {"type": "url", "url": url}
    messages = _post(server, "/v1/messages", {"model": model, "max_tokens": 2, "stream": stream, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": source}]}]})
    responses = _post(server, "/v1/responses", {"model": model, "max_output_tokens": 2, "stream": stream, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]})
    tokenized = tokenize(server, user_with(chat_image(url)))
    return {"chat": _openai_error(chat), "messages": _anthropic_error(messages),
            "responses": _openai_error(responses), "tokenize": _openai_error(tokenized)}


BAD_IMAGES = [
    # (case, url or bytes, words in every message, OpenAI code)
    ("undecodable", GARBAGE, ["cannot decode"], "invalid_image"),
    ("truncated", TRUNCATED, ["truncated"], "invalid_image"),
    ("unsupported-format", PDF, ["PDF", "not supported"], "unsupported_image_format"),
    ("pixel-bomb-header", png_claiming(100_000, 100_000), ["pixels"], "image_too_large"),
    ("bad-base64", "data:image/png;base64,@@@not-base64@@@", ["base64"], "invalid_image"),
]


@pytest.mark.parametrize(("case", "image", "words", "code"), BAD_IMAGES, ids=[c[0] for c in BAD_IMAGES])
def test_bad_image_is_a_400_in_every_api(k25, ctx, case, image, words, code):
    url = image if isinstance(image, str) else data_url(image)
    errors = _three_apis(k25, ctx.model_name, url)
    for api, error in errors.items():
        assert all(word in error["message"] for word in words), (api, error)
    for api in ("chat", "responses", "tokenize"):
        assert errors[api]["code"] == code, (api, errors[api])
    assert errors["chat"]["param"] == "messages[0].content[1]"
    assert errors["messages"]["message"].startswith("messages.0.content.1:")
    assert errors["responses"]["param"] == "input[0].content[0]"
    healthy(k25)


def test_bad_data_urls(k25, ctx):
    cases = [
        ("data:image/png,aGVsbG8=", "base64-encoded"),
        ("data:image/png;base64", "bad data URL"),
        ("data:text/plain;base64," + b64(b"hello"), "not an image"),
        ("ftp://127.0.0.1/a.png", "unsupported image URL"),
        ("just some words", "unsupported image URL"),
    ]
    for url, words in cases:
        for path, body in (
            ("/v1/chat/completions", {"model": ctx.model_name, "messages": user_with(chat_image(url))}),
            ("/v1/responses", {"model": ctx.model_name, "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}),
        ):
            assert words in _openai_error(_post(k25, path, body))["message"], (url, path)
    bad_sources = [
        ({"type": "base64", "media_type": "image/bmp", "data": b64(SMALL)}, "media_type"),
        ({"type": "base64", "media_type": "image/png"}, "data"),
        ({"type": "file", "file_id": "file_1"}, "Files API"),
        ({"type": "url"}, "url"),
        ({"type": "url", "url": "data:image/png," + b64(SMALL)}, "base64"),
    ]
    for source, words in bad_sources:
        body = {"model": ctx.model_name, "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}]}
        assert words in _anthropic_error(_post(k25, "/v1/messages", body))["message"], source
    no_url = {"model": ctx.model_name, "input": [{"role": "user", "content": [{"type": "input_image"}]}]}
    assert "image_url" in _openai_error(_post(k25, "/v1/responses", no_url))["message"]
    file_id = {"model": ctx.model_name, "input": [{"role": "user", "content": [{"type": "input_image",
                                                                                  "file_id": "file_1"}]}]}
    assert _openai_error(_post(k25, "/v1/responses", file_id))["param"] == "input[0].content[0].file_id"
    healthy(k25)


def test_too_many_images(k25, ctx):
    limit = ServerSettings().max_images_per_request
    tiny = chat_image(data_url(png(1, 1)))
    assert tokenize(k25, user_with(*[tiny] * limit)).status_code == 200
    errors = _openai_error(tokenize(k25, user_with(*[tiny] * (limit + 1))))
    assert errors["code"] == "too_many_images" and f"at most {limit}" in errors["message"]
    chat = _post(k25, "/v1/chat/completions", {"model": ctx.model_name, "messages": user_with(*[tiny] * (limit + 1))})
    assert _openai_error(chat)["code"] == "too_many_images"
    blocks = [anthropic_image(png(1, 1))] * (limit + 1)
    body = {"model": ctx.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": blocks}]}
    assert f"at most {limit}" in _anthropic_error(_post(k25, "/v1/messages", body))["message"]
    healthy(k25)


def test_image_too_large_for_the_context(client, k25, ctx):
    messages = user_with(chat_image(data_url(TOO_BIG_FOR_CONTEXT)))
    assert count(k25, messages) > MAX_MODEL_LEN  # /tokenize counts; generation refuses
    error = _openai_error(_post(k25, "/v1/chat/completions", {"model": ctx.model_name, "messages": messages}))
    assert error["code"] == "context_length_exceeded"
    assert "1024x1024 px -> 1369 tokens" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=ctx.model_name, messages=messages, stream=stream)
    body = {"model": ctx.model_name, "max_tokens": 2,
            "messages": [{"role": "user", "content": [anthropic_image(TOO_BIG_FOR_CONTEXT)]}]}
    assert "1369 tokens" in _anthropic_error(_post(k25, "/v1/messages", body))["message"]
    healthy(k25)


def test_streamed_requests_get_their_400_before_the_stream(k25, ctx):
    errors = _three_apis(k25, ctx.model_name, data_url(TRUNCATED), stream=True)
    assert all("truncated" in error["message"] for error in errors.values())
    healthy(k25)


def test_remote_urls_refused_or_failed(k25, ctx, image_host):
    port = image_host.rsplit(":", 1)[1]
    cases = [
        ("http://example.com/cat.png", "media_domain_not_allowed", ["'example.com'", "--allowed-media-domains"]),
        (f"http://localhost:{port}/square.png", "media_domain_not_allowed", ["'localhost'"]),
        (image_host + "/other-host-redirect", "media_redirect_refused", ["another host"]),
        (image_host + "/big.png", "image_too_large", [str(FETCH_MAX_BYTES)]),
        (image_host + "/big-unannounced.png", "image_too_large", [str(FETCH_MAX_BYTES)]),
        (image_host + "/slow.png", "media_fetch_timeout", ["longer than"]),
        (image_host + "/missing.png", "media_fetch_failed", ["HTTP 404"]),
        (image_host + "/page.html", "invalid_image", ["cannot decode"]),
    ]
    for url, code, words in cases:
        errors = _three_apis(k25, ctx.model_name, url)
        for api, error in errors.items():
            assert all(word in error["message"] for word in words), (url, api, error)
        assert errors["chat"]["code"] == code, (url, errors["chat"])
    healthy(k25)


def test_nothing_is_fetched_by_default(tiny_k25_dir, image_host):
    with running_server(EngineConfig(model=str(tiny_k25_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)) as srv:
        error = _openai_error(tokenize(srv, user_with(chat_image(image_host + "/square.png"))))
        assert error["code"] == "media_domain_not_allowed" and "without --allowed-media-domains" in error["message"]
        assert tokenize(srv, user_with(chat_image(data_url(SQUARE)))).status_code == 200  # data: URLs always work


def test_domain_match_is_exact_and_case_insensitive():
    class Ctx:
        settings = ServerSettings(allowed_media_domains=["Images.Example.com", "cdn.test."])

    check_domain(Ctx(), "https://images.example.com/a.png", "x")  # type: ignore[arg-type]
    check_domain(Ctx(), "http://IMAGES.EXAMPLE.COM.:8080/a.png", "x")  # type: ignore[arg-type]
    check_domain(Ctx(), "https://cdn.test/a.png", "x")  # type: ignore[arg-type]
    for url in ("https://example.com/a.png", "https://evil.images.example.com/a.png",
                "https://images.example.com.evil.org/a.png", "https://user@evil.org/@images.example.com/"):
        with pytest.raises(APIError) as info:
            check_domain(Ctx(), url, "x")  # type: ignore[arg-type]
        assert info.value.code == "media_domain_not_allowed"


def test_settings_from_args_carry_the_allowed_domains():
    from kserve.cli import build_parser
    from kserve.server.launch import settings_from_args

    args = build_parser().parse_args(["serve", "--allowed-media-domains", "a.example", "b.example"])
    assert settings_from_args(args).allowed_media_domains == ["a.example", "b.example"]
    assert settings_from_args(build_parser().parse_args(["serve"])).allowed_media_domains is None


# ----------------------------------------------------------------------------- models without a tower


def _no_tower_errors(server: Any, words: list[str]) -> None:
    model = server.app.state.server.context.model_name
    errors = _three_apis(server, model, data_url(SMALL))
    for api, error in errors.items():
        assert all(word in error["message"] for word in words), (api, error)
    assert errors["chat"]["code"] == "unsupported_content" and errors["chat"]["param"] == "messages[0].content[1].type"
    assert errors["responses"]["code"] == "unsupported_content"
    counted = httpx.post(server.base_url + "/v1/messages/count_tokens", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": [anthropic_image(SMALL)]}]})
    assert all(word in _anthropic_error(counted)["message"] for word in words)
    healthy(server)
    text = _post(server, "/v1/chat/completions", {"model": model, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert text.status_code == 200  # text still works


def test_k2_without_a_tower_refuses_images(tiny_k2_dir):
    engine = EngineConfig(model=str(tiny_k2_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    with running_server(engine) as srv:
        assert not srv.app.state.server.context.llm_engine.supports_images
        _no_tower_errors(srv, ["no vision tower"])


def test_the_embedded_k26_model_has_a_tower():
    with running_server() as srv:  # `kserve serve` with no arguments
        assert srv.app.state.server.context.llm_engine.supports_images


def test_language_model_only_refuses_images(tiny_k25_dir):
    engine = EngineConfig(model=str(tiny_k25_dir), dtype="float32", max_model_len=MAX_MODEL_LEN,
                          language_model_only=True)
    with running_server(engine) as srv:
        _no_tower_errors(srv, ["--language-model-only"])


def test_openai_sdk_gets_bad_request_errors(client, ctx):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=ctx.model_name, max_tokens=2,
                                       messages=user_with(chat_image(data_url(TRUNCATED))))
    assert "truncated" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=ctx.model_name, max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": data_url(GARBAGE)}]}])


def test_anthropic_sdk_gets_bad_request_errors(claude, ctx):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=ctx.model_name, max_tokens=2,
                               messages=[{"role": "user", "content": [anthropic_image(GARBAGE)]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "cannot decode" in info.value.body["error"]["message"]


def test_image_requests_leave_the_engine_idle(k25, ctx):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (ctx.engine.stats().num_running or ctx.engine.stats().num_waiting):
        time.sleep(0.05)
    stats = ctx.engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert json.loads(httpx.get(k25.base_url + "/health", timeout=30).text) is not None
