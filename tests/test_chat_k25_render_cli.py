"""`kserve render MODEL_DIR --jsonl [--ids]` over every golden: one request per line in, {prompt, ids} per line out,
each line's add_generation_prompt and chat_template_kwargs honoured.

The model directory is built in tmp_path from ../shared/kimi_k25: K2.6's tiktoken.model and tokenizer_config.json
plus the golden's template as chat_template.jinja (ChatTemplate.load reads that file first). Golden ids are Moonshot's
special-text-allowed encode, so they are compared with `--legacy-prompt-encoding`; the default safe ids must equal
them too, since no public golden has special-token text in client strings.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys

import pytest
from test_chat_k25_support import GOLDENS, TEMPLATE_NAMES, make_model_dir, read_jsonl

from kserve.chat.render_cli import run_render


def _line(golden: dict) -> str:
    kwargs = dict(golden["kwargs"])
    request = {"model": "kimi", "messages": golden["messages"],
               "add_generation_prompt": kwargs.pop("add_generation_prompt"), "chat_template_kwargs": kwargs}
    if golden["tools"] is not None:
        request["tools"] = golden["tools"]
    return json.dumps(request, ensure_ascii=False)


def _run(model_dir, stdin: str, *, ids=True, legacy=False, jsonl=True) -> tuple[int, str]:
    args = argparse.Namespace(model_dir=str(model_dir), ids=ids, jsonl=jsonl, chat_template=None,
                              legacy_prompt_encoding=legacy)
    out = io.StringIO()
    return run_render(args, io.StringIO(stdin), out), out.getvalue()


@pytest.mark.parametrize("template", TEMPLATE_NAMES)
def test_jsonl_over_the_goldens(tmp_path, template):
    goldens = [g for g in read_jsonl(GOLDENS) if g["template"] == template]
    model_dir = make_model_dir(tmp_path / template, template)
    stdin = "\n".join(_line(g) for g in goldens) + "\n\n"  # a blank line is skipped
    for legacy in (True, False):
        rc, out = _run(model_dir, stdin, legacy=legacy)
        rows = [json.loads(line) for line in out.splitlines()]
        assert rc == 0 and len(rows) == len(goldens)
        for golden, row in zip(goldens, rows):
            assert row == {"prompt": golden["text"], "ids": golden["ids"]}, golden["id"]


def test_jsonl_without_ids_and_bad_lines(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "k2.6")
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"thinking": False}})
    lines = [good, "{not json", json.dumps({"messages": [], "chat_template_kwargs": {"enable_thinking": True}}),
             json.dumps({"messages": [], "chat_template_kwargs": {"thinking": "no"}}), good]
    rc, out = _run(model_dir, "\n".join(lines), ids=False)
    rows = [json.loads(line) for line in out.splitlines()]
    assert rc == 2 and len(rows) == 5
    assert rows[0] == rows[4] == {"prompt": "<|im_user|>user<|im_middle|>hi<|im_end|>"
                                            "<|im_assistant|>assistant<|im_middle|><think></think>"}
    assert "not valid JSON" in rows[1]["error"] and "enable_thinking" in rows[2]["error"]
    assert "true or false" in rows[3]["error"]


def test_single_request_mode_honours_chat_template_kwargs(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "k2.5")
    request = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"thinking": False}}
    rc, out = _run(model_dir, json.dumps(request), ids=False, jsonl=False)
    assert rc == 0 and out.endswith("<|im_assistant|>assistant<|im_middle|><think></think>\n")


def test_cli_flag(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "k2.7-code")
    request = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
    done = subprocess.run([sys.executable, "-m", "kserve.cli", "render", str(model_dir), "--jsonl", "--ids"],
                          input=json.dumps(request) + "\n", capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["prompt"] == "<|im_user|>user<|im_middle|>hi<|im_end|>" and row["ids"][0] == 163587
