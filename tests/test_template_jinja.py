"""Jinja path: identical to transformers' own rendering for every shared template; load-time drift warning."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from test_chat_support import K2_DIR, TEMPLATES_DIR, conversations, require_shared

from kserve.chat import ChatTemplate, render_prompt


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    files = sorted(require_shared(TEMPLATES_DIR).glob("*.jinja"))
    assert len(files) >= 5
    return {f.name: f.read_text(encoding="utf-8") for f in files}


def _sort_keys(value):
    if isinstance(value, dict):
        return {k: _sort_keys(value[k]) for k in sorted(value)}
    return [_sort_keys(v) for v in value] if isinstance(value, list) else value


@pytest.fixture(scope="module")
def hf_render():
    utils = pytest.importorskip("transformers.utils.chat_template_utils")

    def render(source, messages, tools, add_gen):
        # Moonshot's wrapper deep-sorts tools for the templates of K2-Thinking on (their dialect says so).
        if tools and ChatTemplate(source=source).dialect.sorts_tools:
            tools = _sort_keys(tools)
        rendered, _ = utils.render_jinja_template(
            conversations=[messages], tools=tools, chat_template=source, add_generation_prompt=add_gen
        )
        return rendered[0]

    return render


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # both sides must fail the same way on conversations a template rejects
        return ("error", type(exc).__name__)


@pytest.fixture(scope="module")
def compiled(templates) -> dict[str, ChatTemplate]:
    return {name: ChatTemplate(source=source, origin=name) for name, source in templates.items()}


@settings(max_examples=300, deadline=None)
@given(conversation=conversations)
def test_matches_transformers_for_every_template(templates, compiled, hf_render, conversation):
    messages, tools, add_gen = conversation
    for name, source in templates.items():
        ours = _outcome(lambda: compiled[name].render(messages, tools, add_gen))
        theirs = _outcome(lambda: hf_render(source, json.loads(json.dumps(messages)), tools, add_gen))
        assert ours == theirs, name


def test_matches_transformers_on_real_requests(templates, hf_render):
    files = sorted((TEMPLATES_DIR.parent.parent / "conformance").glob("kvv_samples_*.jsonl"))
    requests = [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not requests:
        pytest.skip("no kvv samples in ../shared/conformance")
    for request in requests:
        for name, source in templates.items():
            ours = _outcome(lambda: render_prompt(request["messages"], request.get("tools"), True, template=source))
            theirs = _outcome(lambda: hf_render(source, request["messages"], request.get("tools"), True))
            assert ours == theirs, name


def test_load_prefers_template_file_and_warns_once_on_drift(tmp_path, caplog):
    (tmp_path / "chat_template.jinja").write_text((require_shared(TEMPLATES_DIR) / "v3-2025-08-11.jinja").read_text())
    with caplog.at_level(logging.WARNING, logger="kserve.chat.template"):
        template = ChatTemplate.load(tmp_path)
    assert not template.is_builtin
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "at character" in warnings[0].getMessage()


def test_load_without_template_uses_builtin(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text((K2_DIR / "tokenizer_config.json").read_text()
                                                    if K2_DIR.exists() else "{}")
    assert ChatTemplate.load(tmp_path).is_builtin
    assert ChatTemplate.load(None).is_builtin


def test_load_reads_tokenizer_config_chat_template_and_explicit_path(tmp_path, caplog):
    source = "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    with caplog.at_level(logging.WARNING, logger="kserve.chat.template"):
        template = ChatTemplate.load(tmp_path)
    assert template.render([{"role": "user", "content": "x"}]) == "<|im_user|>x<|im_end|>"
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    explicit = tmp_path / "t.jinja"
    explicit.write_text("{{ messages | length }}")
    assert ChatTemplate.load(tmp_path, explicit).render([{"role": "user", "content": "x"}]) == "1"


def test_matching_template_logs_no_warning(tmp_path, caplog):
    # A jinja transcription of the built-in format (contiguous turns) must pass the self-check silently.
    source = (require_shared(TEMPLATES_DIR) / "v4-reconstructed.jinja").read_text().replace(
        "Moonshot AI.<|im_end|>\n  {% endif %}", "Moonshot AI.<|im_end|>\n  {%- endif %}")
    path = tmp_path / "fixed.jinja"
    path.write_text(source)
    with caplog.at_level(logging.WARNING, logger="kserve.chat.template"):
        template = ChatTemplate.load(template_path=path)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert template.render([{"role": "user", "content": "hi"}]) == render_prompt([{"role": "user", "content": "hi"}])


def test_hf_semantics_tojson_and_raise_exception():
    out = render_prompt([{"role": "user", "content": "<b>é</b>"}],
                        template="{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=1) | length > 0 }}")
    assert out == '{"role": "user", "content": "<b>é</b>"}|True'
    with pytest.raises(Exception, match="nope"):
        render_prompt([], template="{{ raise_exception('nope') }}")
    assert render_prompt([], template="{% generation %}g{% endgeneration %}{{ strftime_now('%Y') | length }}") == "g4"


def test_template_sandbox_blocks_attribute_escape():
    with pytest.raises(Exception):
        render_prompt([], template="{{ ''.__class__.__mro__[1].__subclasses__() }}")


