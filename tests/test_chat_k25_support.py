"""Shared helpers for the K2.5-family chat tests (no tests here): ../shared/kimi_k25, its goldens, a tokenizer dir,
Moonshot's own TypeScript encoder (imported from ../shared as a test oracle, never copied), strategies."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import strategies as st
from test_chat_support import SHARED, messages_strategy, texts, tools_lists

K25_DIR = SHARED / "kimi_k25"
K25_TOKENIZER = K25_DIR / "tokenizer"
K25_TEMPLATES = K25_DIR / "templates"
GOLDENS = K25_DIR / "goldens" / "public.jsonl"
TS_GOLDENS = K25_DIR / "goldens" / "ts_declarations.jsonl"
TEMPLATE_NAMES = ("k2-thinking", "k2.5", "k2.6", "k2.7-code")


def require_k25(path: Path = K25_DIR) -> Path:
    if not path.exists():
        pytest.skip(f"shared K2.5 reference files not available ({path})")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in require_k25(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def template_source(name: str) -> str:
    return require_k25(K25_TEMPLATES / name / "chat_template.jinja").read_text(encoding="utf-8")


def tiktoken_model_file() -> Path:
    """The BPE file; the shared copy may be stored as a link (a short file holding the real file's relative path)."""
    path = require_k25(K25_TOKENIZER / "tiktoken.model")
    if path.stat().st_size < 1024:
        path = (path.parent / path.read_text(encoding="utf-8").strip()).resolve()
    return require_k25(path)


def make_model_dir(directory: Path, template: str | None = None) -> Path:
    """A model directory kserve can load: K2.6's tokenizer files, plus ``template`` as chat_template.jinja."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiktoken.model").symlink_to(tiktoken_model_file())
    (directory / "tokenizer_config.json").write_bytes((K25_TOKENIZER / "tokenizer_config.json").read_bytes())
    if template is not None:
        (directory / "chat_template.jinja").write_text(template_source(template), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def k25_tokenizer(tmp_path_factory):
    from kserve.chat import load_tokenizer

    return load_tokenizer(make_model_dir(tmp_path_factory.mktemp("k25_tokenizer")))


@functools.cache
def official_typescript_encoder():
    """Moonshot's ``encode_tools_to_typescript_style``, loaded from ../shared for differential tests."""
    path = require_k25(K25_TOKENIZER / "tool_declaration_ts.py")
    spec = importlib.util.spec_from_file_location("moonshot_tool_declaration_ts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.encode_tools_to_typescript_style


def sort_keys(value):
    """The wrapper's deep sort, written independently of kserve's."""
    if isinstance(value, dict):
        return {k: sort_keys(value[k]) for k in sorted(value)}
    return [sort_keys(v) for v in value] if isinstance(value, list) else value


def official_render(source: str, messages, tools, add_generation_prompt: bool, thinking: bool,
                    preserve_thinking: bool) -> str:
    """What Moonshot's wrapper renders: deep-sorted tools, its own TypeScript encoder (None on failure), then the
    template in transformers' jinja environment, called as transformers 4.57 (what the goldens came from) calls it.
    (transformers 5 also copies `reasoning` / `thinking` into `reasoning_content` first; 4.57 does not.)"""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    if not hasattr(utils, "_compile_jinja_template"):
        pytest.skip("transformers has no _compile_jinja_template")
    tools = sort_keys(tools)
    kwargs = {"thinking": thinking, "preserve_thinking": preserve_thinking}
    if tools:
        with contextlib.suppress(Exception):  # the wrapper's own fallback: no tools_ts_str
            kwargs["tools_ts_str"] = official_typescript_encoder()(tools)
    compiled = utils._compile_jinja_template(source)
    return compiled.render(messages=json.loads(json.dumps(messages)), tools=tools, documents=None,
                           add_generation_prompt=add_generation_prompt, **kwargs)


@st.composite
def k25_conversations(draw):
    """test_chat_support's conversations plus what K2.5-family templates read: `reasoning` next to or instead of
    `reasoning_content`, null reasoning, image / video parts."""
    messages = draw(messages_strategy())
    for message in messages:
        if message["role"] == "assistant":
            choice = draw(st.integers(0, 5))
            if choice == 0:
                message["reasoning"] = draw(st.one_of(texts, st.none()))
            elif choice == 1:
                message["reasoning_content"] = None
        elif message["role"] == "user" and isinstance(message.get("content"), list) and draw(st.booleans()):
            kind = draw(st.sampled_from(["image", "image_url", "video_url"]))
            message["content"].append({"type": kind, kind: {"url": "data:,"}})
    tools = draw(tools_lists())
    return messages, tools, draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
