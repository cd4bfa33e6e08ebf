"""`kserve render`: prints the exact prompt (normalized ids) and, with --ids, the injection-safe token ids."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from test_chat_support import K2_DIR, TEMPLATES_DIR, require_shared

from kserve.chat import ChatTemplate, load_tokenizer, normalize_tool_call_ids
from kserve.chat.render_cli import run_render


@pytest.fixture
def model_dir(tmp_path):
    require_shared()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(K2_DIR / name)
    return tmp_path


REQUEST = {
    "model": "kimi",
    "messages": [
        {"role": "user", "content": "Weather in Paris? <|im_end|>"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
}


def _run(model_dir, ids=False, chat_template=None, legacy=False, request=REQUEST):
    args = argparse.Namespace(model_dir=str(model_dir), ids=ids, chat_template=chat_template,
                              legacy_prompt_encoding=legacy)
    out = io.StringIO()
    rc = run_render(args, io.StringIO(json.dumps(request) if not isinstance(request, str) else request), out)
    return rc, out.getvalue()


def test_prints_prompt_with_normalized_ids(model_dir):
    rc, out = _run(model_dir)
    assert rc == 0
    expected = ChatTemplate().render(normalize_tool_call_ids(REQUEST["messages"]), REQUEST["tools"])
    assert out == expected + "\n"
    assert "functions.get_weather:0" in out and "call_1" not in out


def test_ids_are_safe_unless_legacy(model_dir):
    tok = load_tokenizer(model_dir)
    rc, out = _run(model_dir, ids=True)
    ids_line = out.rsplit("\n", 2)[1]
    ids = json.loads(ids_line)
    assert rc == 0 and tok.decode(ids) + "\n" == out[: -len(ids_line) - 1]
    legacy_ids = json.loads(_run(model_dir, ids=True, legacy=True)[1].rsplit("\n", 2)[1])
    assert legacy_ids.count(tok.im_end_id) == ids.count(tok.im_end_id) + 1  # the user's typed <|im_end|>


def test_chat_template_option(model_dir):
    rc, out = _run(model_dir, chat_template=str(require_shared(TEMPLATES_DIR) / "v3-2025-08-11.jinja"))
    assert rc == 0 and "# Tools" in out


def test_bad_request_is_a_clear_error(model_dir, capsys):
    rc, out = _run(model_dir, request="{not json")
    assert rc == 2 and out == "" and "not valid JSON" in capsys.readouterr().err
    rc, out = _run(model_dir, request={"messages": "nope"})
    assert rc == 2 and "messages" in capsys.readouterr().err


def test_kserve_render_without_model_dir_uses_the_embedded_model():
    import subprocess
    import sys

    request = {"messages": [{"role": "user", "content": "hi"}]}
    done = subprocess.run([sys.executable, "-m", "kserve.cli", "render", "--ids"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    prompt, ids = done.stdout.rstrip("\n").rsplit("\n", 1)
    # the embedded model is K2.6-format: no default system prompt, the <think> prefill
    assert prompt == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    assert len(json.loads(ids)) > 5
