"""`kserve serve` with no model directory: serves the embedded tiny model, says where it listens, gets ready."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kserve_serve_embedded_tiny_model(tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    env = dict(os.environ, KSERVE_API_KEY="from-env")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kserve.cli", "serve", "--port", str(port), "--served-model-name", "tiny-cli",
             "--max-model-len", "512"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    try:
        start = time.monotonic()
        ready = None
        while time.monotonic() - start < 120:
            assert proc.poll() is None, log.read_text()
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if resp.status_code == 200:
                ready = time.monotonic() - start
                break
            assert resp.status_code == 503 and "error" in resp.json()
            time.sleep(0.1)
        assert ready is not None, log.read_text()
        text = log.read_text()
        assert f"http://127.0.0.1:{port}" in text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="from-env", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-cli"]
        resp = client.chat.completions.create(model="tiny-cli", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3)
        assert resp.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0).models.list()
        print(f"kserve serve ready in {ready:.1f}s")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# A template that writes tool calls as plain JSON: the startup self-check's tool parser cannot read it back.
DRIFTED_TEMPLATE = (
    "{% for m in messages %}<|im_{{ 'user' if m.role == 'user' else 'assistant' }}|>{{ m.role }}<|im_middle|>"
    "{{ m.content or '' }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def test_kserve_serve_exits_nonzero_when_the_self_check_fails(tmp_path, tiny_k2_dir):
    model_dir = tmp_path / "drifted-model"
    shutil.copytree(tiny_k2_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(DRIFTED_TEMPLATE)
    proc = subprocess.run(
        [sys.executable, "-m", "kserve.cli", "serve", str(model_dir), "--port", str(_free_port()),
         "--max-model-len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180, check=False,
    )
    assert proc.returncode != 0, proc.stdout
    assert "startup failed at the self-check stage" in proc.stdout, proc.stdout
    assert "tool parser" in proc.stdout  # the self-check's own reason


def test_serve_flags_reach_the_settings(monkeypatch):
    from kserve.cli import build_parser
    from kserve.server.launch import settings_from_args

    monkeypatch.setenv("KSERVE_API_KEY", "env-key")
    args = build_parser().parse_args([
        "serve", "/models/k2", "--host", "0.0.0.0", "--port", "9001", "--served-model-name", "k2",
        "--max-model-len", "4096", "--chat-template", "t.jinja", "--guided-decoding", "off", "--tool-grammar", "off",
        "--skip-self-check", "--enable-reasoning", "--legacy-prompt-encoding", "--max-request-bytes", "1000",
        "--max-concurrent-requests", "7", "--no-prefix-caching", "--block-size", "32", "--tp", "2",
    ])
    s = settings_from_args(args)
    assert (s.host, s.port, s.served_model_name, s.chat_template) == ("0.0.0.0", 9001, "k2", "t.jinja")
    assert s.api_key == "env-key"  # no --api-key: the environment's
    assert (s.guided_decoding, s.tool_grammar, s.skip_self_check) == (False, False, True)
    assert (s.enable_reasoning, s.legacy_prompt_encoding) == (True, True)
    assert (s.max_request_bytes, s.max_concurrent_requests) == (1000, 7)
    e = s.engine
    assert (e.model, e.max_model_len, e.enable_prefix_caching, e.block_size, e.tensor_parallel_size) == \
        ("/models/k2", 4096, False, 32, 2)
    assert settings_from_args(build_parser().parse_args(["serve", "--api-key", "flag"])).api_key == "flag"


def test_drain_timeout_reaches_uvicorns_graceful_shutdown():
    from kserve.cli import build_parser
    from kserve.server.launch import _uvicorn_config, settings_from_args

    default = settings_from_args(build_parser().parse_args(["serve"]))
    assert _uvicorn_config(default, None).timeout_graceful_shutdown == 30.0
    custom = settings_from_args(build_parser().parse_args(["serve", "--drain-timeout", "2.5"]))
    assert _uvicorn_config(custom, None).timeout_graceful_shutdown == 2.5


def test_keep_alive_timeout_reaches_uvicorn():
    from kserve.cli import build_parser
    from kserve.server.launch import _uvicorn_config, settings_from_args

    default = settings_from_args(build_parser().parse_args(["serve"]))
    assert _uvicorn_config(default, None).timeout_keep_alive == 75.0
    custom = settings_from_args(build_parser().parse_args(["serve", "--keep-alive-timeout", "9"]))
    assert _uvicorn_config(custom, None).timeout_keep_alive == 9.0
