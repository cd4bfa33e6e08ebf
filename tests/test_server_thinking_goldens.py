"""Every K2-Thinking / K2.5 / K2.6 / K2.7-Code golden (../shared/kimi_k25/goldens/public.jsonl), sent to a live
server's `/tokenize` with its `chat_template_kwargs` and `add_generation_prompt`, comes back as the golden's ids.

The served model is a tiny random K2.6-layout checkpoint written with K2's real BPE ranks (the shared
tiktoken.model), so its vocabulary has K2's size and ids (163,840 x 256 embeddings: about 2.3 GB resident for the
test process, a few seconds to start), and each golden's template is copied into a model directory as
chat_template.jinja; one server runs at a time. Per golden, by design of the server rather than of the template:

- special-token text typed by the client (`</think>` inside a user message, say) matches Moonshot's `encode` only
  under `--legacy-prompt-encoding`; the default server keeps it as text (injection-safe), so those goldens go to a
  legacy-encoding server, and the default one is checked to give the same text with no such special ids;
- an image part's URL is replaced by a real 28x28 PNG (the goldens carry a stand-in that does not decode); the
  server expands the image's one `<|media_pad|>` into its placeholder tokens, which are collapsed back to one
  before comparing. Video parts are refused (400, `unsupported_content`);
- tools that are not function tools (`{"type": "_plugin", ...}`) are refused (400): chat completions takes
  function tools only.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_chat_k25_support import GOLDENS, read_jsonl, template_source, tiktoken_model_file

from kserve.config import EngineConfig
from kserve.server.launch import BackgroundServer

if not GOLDENS.exists():
    pytest.skip(f"shared K2.5 goldens not available ({GOLDENS})", allow_module_level=True)

from live_server import running_server

TEXT_PARTS = {"text"}


def _goldens() -> list[dict[str, Any]]:
    return sorted(read_jsonl(GOLDENS), key=lambda g: g["template"])  # one server start per template


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


IMAGE_PARTS = {"image_url"}
MEDIA_PAD = 163605


def tiny_png() -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (10, 200, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def with_real_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The golden's messages with each image part's URL replaced by a decodable PNG."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{**part, "image_url": {**part["image_url"], "url": tiny_png()}}
                       if part.get("type") in IMAGE_PARTS else part for part in content]
            message = {**message, "content": content}
        out.append(message)
    return out


def collapse_media(ids: list[int]) -> list[int]:
    """Each run of <|media_pad|> back to the template's single placeholder."""
    return [t for i, t in enumerate(ids) if not (t == MEDIA_PAD and i and ids[i - 1] == MEDIA_PAD)]


def refused_part(golden: dict[str, Any]) -> tuple[str, str] | None:
    """(param, code) of the 400 the server answers for a golden it refuses by design, or None."""
    for i, message in enumerate(golden["messages"]):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") not in TEXT_PARTS | IMAGE_PARTS:
                return f"messages[{i}].content[{j}].type", "unsupported_content"
    for i, tool in enumerate(golden["tools"] or []):
        if tool.get("type") != "function" or "function" not in tool:
            return f"tools[{i}].function", "missing_required_parameter"
    return None


def k2_ranks() -> tuple[bytes, ...]:
    """K2's BPE tokens in rank order, read from the shared tiktoken.model (`<base64> <rank>` lines)."""
    pairs = sorted((int(rank), base64.b64decode(token))
                   for token, rank in (line.split() for line in tiktoken_model_file().read_bytes().splitlines()
                                       if line.strip()))
    assert [rank for rank, _ in pairs] == list(range(len(pairs)))
    return tuple(token for _, token in pairs)


@pytest.fixture(scope="module")
def real_vocab_model(tmp_path_factory) -> Path:
    from kserve.tiny.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("k25_real_vocab") / "weights", variant="k25",
                                 ranks=k2_ranks())


class TemplateServers:
    """One live server at a time, for a template and an encoding; switching stops the previous one."""

    def __init__(self, weights: Path, root: Path) -> None:
        self.weights, self.root = weights, root
        self.key: tuple[str, bool] | None = None
        self.running: Any = None
        self.server: BackgroundServer | None = None

    def model_dir(self, template: str) -> Path:
        directory = self.root / template
        if not directory.exists():
            directory.mkdir()
            for file in self.weights.iterdir():
                (directory / file.name).symlink_to(file)
            (directory / "chat_template.jinja").write_text(template_source(template), encoding="utf-8")
        return directory

    def get(self, template: str, legacy: bool = False) -> BackgroundServer:
        if self.key != (template, legacy):
            self.close()
            self.running = running_server(EngineConfig(model=str(self.model_dir(template))),
                                          legacy_prompt_encoding=legacy)
            self.server = self.running.__enter__()
            self.key = (template, legacy)
        assert self.server is not None
        return self.server

    def close(self) -> None:
        if self.running is not None:
            self.running.__exit__(None, None, None)
            self.running = self.server = self.key = None


@pytest.fixture(scope="module")
def servers(real_vocab_model, tmp_path_factory) -> Iterator[TemplateServers]:
    pool = TemplateServers(real_vocab_model, tmp_path_factory.mktemp("k25_templates"))
    yield pool
    pool.close()


def tokenize(server: BackgroundServer, golden: dict[str, Any]) -> httpx.Response:
    kwargs = dict(golden["kwargs"])
    body: dict[str, Any] = {"messages": with_real_images(golden["messages"]),
                            "add_generation_prompt": kwargs.pop("add_generation_prompt"),
                            "chat_template_kwargs": kwargs, "return_token_strs": True}
    if golden["tools"] is not None:
        body["tools"] = golden["tools"]
    return httpx.post(server.base_url + "/tokenize", json=body, timeout=120)


@pytest.mark.parametrize("golden", _goldens(), ids=lambda g: g["id"])
def test_every_golden_is_byte_exact_through_tokenize(servers, golden):
    server = servers.get(golden["template"])
    context = server.app.state.server.context
    assert context.vocab_size == 163840 and context.template.dialect.name == golden["template"]
    resp = tokenize(server, golden)
    refused = refused_part(golden)
    if refused is not None:
        assert resp.status_code == 400, resp.text
        assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == refused
        return
    assert resp.status_code == 200, resp.text
    tokens = collapse_media(resp.json()["tokens"])
    tokenizer = context.tokenizer
    typed_specials = any(tokenizer.special_token_regex.search(s) for s in _strings([golden["messages"],
                                                                                     golden["tools"]]))
    if not typed_specials:
        assert tokens == golden["ids"]
        return
    # Injection-safe by default: the same text, with the client's special-token text kept as text.
    assert tokenizer.decode(tokens) == golden["text"] and tokens != golden["ids"]
    legacy = tokenize(servers.get(golden["template"], legacy=True), golden)
    assert legacy.status_code == 200 and collapse_media(legacy.json()["tokens"]) == golden["ids"]
