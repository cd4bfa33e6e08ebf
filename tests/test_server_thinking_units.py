"""The thinking switch per request, the reasoning split mode per dialect, and the grammar that waits for the
reasoning to end, without a model (the live behaviour is in test_server_thinking.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_chat_k25_support import k25_tokenizer  # noqa: F401  (fixture)

from kserve.chat.dialect import K2, K2_5, K2_6, K2_7_CODE, K2_THINKING
from kserve.chat.markers import THINK_BEGIN, THINK_END, TOOL_MARKER_TOKENS
from kserve.engine.token_bitmask import new_bitmask, unpack_bitmask
from kserve.server.anthropic_messages import chat_body as anthropic_chat_body
from kserve.server.anthropic_protocol import MessagesRequest
from kserve.server.errors import APIError
from kserve.server.guided import AfterReasoning, after_reasoning
from kserve.server.openai_responses import chat_body as responses_chat_body
from kserve.server.protocol import ChatCompletionRequest
from kserve.server.responses_protocol import ResponsesRequest
from kserve.server.thinking import ReasoningMode, ThinkingSwitch, reasoning_mode, requested_thinking
from kserve.server.validation import ROLE_ALIASES_KEEPING_DEVELOPER, normalize_messages, normalize_tools

USER = {"role": "user", "content": "hi"}


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **fields})


# ----------------------------------------------------------------------------- the switch


@pytest.mark.parametrize(("fields", "want"), [
    ({}, ThinkingSwitch()),
    ({"chat_template_kwargs": {"thinking": False}}, ThinkingSwitch(thinking=False)),
    ({"chat_template_kwargs": {"thinking": True, "preserve_thinking": True}}, ThinkingSwitch(True, True)),
    ({"chat_template_kwargs": {"thinking": None, "enable_thinking": "whatever", "x": [1]}}, ThinkingSwitch()),
    ({"thinking": {"type": "disabled"}}, ThinkingSwitch(thinking=False)),
    ({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking": True}}, ThinkingSwitch(thinking=True)),
])
def test_requested_thinking_reads_both_fields_and_ignores_other_template_kwargs(fields, want):
    assert requested_thinking(_chat(**fields)) == want


@pytest.mark.parametrize(("fields", "param"), [
    ({"chat_template_kwargs": {"thinking": "false"}}, "chat_template_kwargs.thinking"),
    ({"chat_template_kwargs": {"preserve_thinking": 1}}, "chat_template_kwargs.preserve_thinking"),
    ({"thinking": {"type": "disabled"}, "chat_template_kwargs": {"thinking": True}}, "thinking"),
])
def test_requested_thinking_refuses_wrong_types_and_disagreement_with_a_400(fields, param):
    with pytest.raises(APIError) as err:
        requested_thinking(_chat(**fields))
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize(("dialect", "switch", "enable_reasoning", "want"), [
    (K2_6, ThinkingSwitch(), False, ReasoningMode(parse=True, starts_in_reasoning=True)),
    (K2_5, ThinkingSwitch(thinking=True), False, ReasoningMode(True, True)),
    (K2_6, ThinkingSwitch(thinking=False), False, ReasoningMode(False, False)),
    (K2_6, ThinkingSwitch(thinking=False), True, ReasoningMode(False, False)),  # the prompt closed the block
    (K2_7_CODE, ThinkingSwitch(thinking=False), False, ReasoningMode(True, True)),  # always thinks
    (K2, ThinkingSwitch(), False, ReasoningMode(False, False)),
    (K2, ThinkingSwitch(thinking=False), True, ReasoningMode(True, False)),  # no switch: the flag decides
    (K2_THINKING, ThinkingSwitch(), False, ReasoningMode(False, False)),  # the model opens <think> itself
    (K2_THINKING, ThinkingSwitch(thinking=False), True, ReasoningMode(True, False)),
])
def test_reasoning_mode_follows_the_dialects_prefill(dialect, switch, enable_reasoning, want):
    assert reasoning_mode(dialect, switch, enable_reasoning) == want


def test_reasoning_mode_splits_from_the_first_token_when_the_prompt_opened_think():
    starts = ReasoningMode(parse=True, starts_in_reasoning=True)
    assert starts.split("plan</think>answer") == ("plan", "answer")
    assert starts.split("cut short") == ("cut short", "")
    assert ReasoningMode().split("plan</think>answer") == (None, "plan</think>answer")
    parser = starts.parser()
    assert parser is not None and ReasoningMode().parser() is None
    first, second = parser.feed("pl"), parser.feed("an</thi")
    third = parser.feed("nk><|tool_calls_section_begin|>")
    assert (first.reasoning + second.reasoning + third.reasoning, third.content) == \
        ("plan", "<|tool_calls_section_begin|>")


# ----------------------------------------------------------------------------- other APIs' knobs


@pytest.mark.parametrize(("thinking", "want"), [
    ({"type": "enabled", "budget_tokens": 2048}, {"type": "enabled"}),
    ({"type": "disabled"}, {"type": "disabled"}),
    ({"type": "adaptive"}, None),
    (None, None),
])
def test_anthropic_thinking_maps_onto_the_chat_switch(thinking, want):
    body = {"model": "m", "max_tokens": 8, "messages": [USER]}
    if thinking is not None:
        body["thinking"] = thinking
    chat = anthropic_chat_body(MessagesRequest.model_validate(body))
    assert chat.get("thinking") == want
    if want is not None:
        assert requested_thinking(ChatCompletionRequest.model_validate(chat)).thinking == (want["type"] == "enabled")


@pytest.mark.parametrize(("reasoning", "want"), [
    ({"effort": "none"}, {"type": "disabled"}),
    ({"effort": "minimal"}, {"type": "enabled"}),
    ({"effort": "high", "summary": "auto"}, {"type": "enabled"}),
    ({"summary": "auto"}, None),
    (None, None),
])
def test_responses_reasoning_effort_maps_onto_the_chat_switch(reasoning, want):
    body = {"model": "m", "input": "hi"}
    if reasoning is not None:
        body["reasoning"] = reasoning
    chat = responses_chat_body(ResponsesRequest.model_validate(body), [("input", {"type": "message", **USER})])
    assert chat.get("thinking") == want


# ----------------------------------------------------------------------------- messages as the templates get them


def test_reasoning_keys_are_kept_as_sent_null_included_and_developer_keeps_its_role():
    req = _chat(messages=[
        {"role": "developer", "content": "be brief"}, USER,
        {"role": "assistant", "content": "a", "reasoning": "r1", "reasoning_content": None},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "b"}])
    kept = normalize_messages(req.messages, role_aliases=ROLE_ALIASES_KEEPING_DEVELOPER)
    assert kept[0] == {"role": "developer", "content": "be brief"}
    assert kept[2] == {"role": "assistant", "content": "a", "reasoning": "r1", "reasoning_content": None}
    assert kept[4] == {"role": "assistant", "content": "b"}
    assert normalize_messages(req.messages)[0] == {"role": "system", "content": "be brief"}  # kserve's K2 format


def test_tool_names_may_be_written_in_any_script_but_not_hold_separators():
    def tools(name: str) -> list[dict]:
        return [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]

    req = _chat(tools=tools("翻译"))
    assert normalize_tools(req.tools, tools("翻译"))[0]["function"]["name"] == "翻译"
    for bad in ("get weather", "a:b", "x\n", "f" * 65):
        with pytest.raises(APIError) as err:
            normalize_tools(_chat(tools=tools(bad)).tools, tools(bad))
        assert err.value.code == "invalid_tool_name"


# ----------------------------------------------------------------------------- the grammar after the reasoning

VOCAB = 100
STOPS = [90, 91]
MARKER_IDS = {marker: 80 + i for i, marker in enumerate(TOOL_MARKER_TOKENS)}
THINK_IDS = {THINK_BEGIN: 70, THINK_END: 71}


class ScriptedGrammar:
    """A stand-in compiled grammar: its matchers allow only `allowed` and end after `length` tokens."""

    spec = "scripted"

    def __init__(self, allowed: list[int], length: int) -> None:
        self.allowed, self.length = allowed, length
        self.matchers: list[ScriptedMatcher] = []

    def make_constraint(self) -> ScriptedMatcher:
        self.matchers.append(ScriptedMatcher(self))
        return self.matchers[-1]


class ScriptedMatcher:
    def __init__(self, grammar: ScriptedGrammar) -> None:
        self.grammar = grammar
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from kserve.engine.token_bitmask import set_allowed

        set_allowed(bitmask, row, self.grammar.allowed)

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.grammar.allowed:
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.grammar.length


def _tokenizer() -> SimpleNamespace:
    return SimpleNamespace(special_ids={**MARKER_IDS, **THINK_IDS}, stop_token_ids=STOPS)


def _allowed(matcher) -> set[int]:
    bitmask = new_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(unpack_bitmask(bitmask, VOCAB)[0]).flatten().tolist())


def test_reasoning_is_free_but_for_stops_and_tool_markers_then_the_grammar_takes_over():
    grammar = ScriptedGrammar(allowed=[5, 6], length=2)
    guided = after_reasoning(grammar, _tokenizer(), starts_in_reasoning=True)
    assert isinstance(guided, AfterReasoning) and guided.spec == "scripted"
    matcher = guided.make_constraint()
    masked = {*STOPS, *MARKER_IDS.values(), THINK_IDS[THINK_BEGIN]}
    assert _allowed(matcher) == set(range(VOCAB)) - masked
    assert THINK_IDS[THINK_END] in _allowed(matcher)
    for token in (1, 2, 3):  # free reasoning: the grammar sees none of it
        assert matcher.accept_token(token)
    assert not matcher.accept_token(STOPS[0]) and not matcher.is_terminated()
    assert matcher.accept_token(THINK_IDS[THINK_END])
    assert _allowed(matcher) == {5, 6} and grammar.matchers[0].accepted == []
    assert not matcher.accept_token(7)
    assert matcher.accept_token(5) and not matcher.is_terminated()
    assert matcher.accept_token(6) and matcher.is_terminated()
    assert grammar.matchers[0].accepted == [5, 6]


def test_rollback_across_think_end_returns_to_free_reasoning():
    grammar = ScriptedGrammar(allowed=[5], length=3)
    matcher = after_reasoning(grammar, _tokenizer(), starts_in_reasoning=True).make_constraint()
    for token in (1, 2, THINK_IDS[THINK_END], 5):
        assert matcher.accept_token(token)
    matcher.rollback(1)
    assert grammar.matchers[0].accepted == [] and _allowed(matcher) == {5}
    matcher.rollback(2)  # `</think>` and one reasoning token
    assert 1 in _allowed(matcher) and not matcher.is_terminated()
    assert matcher.accept_token(THINK_IDS[THINK_END]) and _allowed(matcher) == {5}


def test_each_sequence_gets_its_own_grammar_state_and_the_reasoning_row_is_built_once_per_width():
    grammar = ScriptedGrammar(allowed=[5], length=1)
    guided = after_reasoning(grammar, _tokenizer(), starts_in_reasoning=True)
    first, second = guided.make_constraint(), guided.make_constraint()
    assert first.accept_token(THINK_IDS[THINK_END]) and first.accept_token(5) and first.is_terminated()
    assert not second.is_terminated() and len(grammar.matchers) == 2
    assert guided.reasoning_row(4) is guided.reasoning_row(4)


def test_the_grammar_applies_from_the_first_token_when_output_does_not_start_in_reasoning():
    grammar = ScriptedGrammar(allowed=[5], length=1)
    assert after_reasoning(grammar, _tokenizer(), starts_in_reasoning=False) is grammar
    assert after_reasoning(None, _tokenizer(), starts_in_reasoning=True) is None
    no_think = SimpleNamespace(special_ids=dict(MARKER_IDS), stop_token_ids=STOPS)
    assert after_reasoning(grammar, no_think, starts_in_reasoning=True) is grammar


def test_when_the_model_opens_think_itself_it_may_reason_first_or_answer_under_the_grammar_at_once():
    """K2-Thinking: an empty prefill, and the model writes `<think>` itself."""
    assert K2_THINKING.model_opens_reasoning() and not K2_6.model_opens_reasoning() and not K2.model_opens_reasoning()
    assert not K2_7_CODE.model_opens_reasoning()  # its prompt opens <think>
    grammar = ScriptedGrammar(allowed=[5, 6], length=2)
    guided = after_reasoning(grammar, _tokenizer(), starts_in_reasoning=False, model_opens_reasoning=True)
    reasons = guided.make_constraint()
    assert _allowed(reasons) == {5, 6, THINK_IDS[THINK_BEGIN]}
    assert not reasons.accept_token(1)  # neither <think> nor the grammar's
    assert reasons.accept_token(THINK_IDS[THINK_BEGIN])
    assert THINK_IDS[THINK_BEGIN] not in _allowed(reasons) and 1 in _allowed(reasons)  # free, not re-opened
    assert reasons.accept_token(1) and reasons.accept_token(THINK_IDS[THINK_END])
    assert _allowed(reasons) == {5, 6} and not reasons.is_terminated()
    assert reasons.accept_token(5) and reasons.accept_token(6) and reasons.is_terminated()
    reasons.rollback(5)  # everything, `<think>` included: the first token is open again
    assert _allowed(reasons) == {5, 6, THINK_IDS[THINK_BEGIN]}
    answers = guided.make_constraint()
    assert answers.accept_token(5) and _allowed(answers) == {5, 6}  # no <think> once the answer began
    answers.rollback(1)
    assert THINK_IDS[THINK_BEGIN] in _allowed(answers)
    assert after_reasoning(grammar, _tokenizer(), starts_in_reasoning=False, model_opens_reasoning=False) is grammar


# ----------------------------------------------------------------------------- the startup self-check


def _self_check_context(tokenizer, template, enable_reasoning: bool = False) -> SimpleNamespace:
    from kserve.server.context import ServerSettings

    return SimpleNamespace(tokenizer=tokenizer, template=template,
                           settings=ServerSettings(enable_reasoning=enable_reasoning))


@pytest.mark.parametrize("enable_reasoning", [False, True])
@pytest.mark.parametrize("source", ["builtin", "jinja"])
def test_self_check_reads_every_dialects_own_reasoning_and_call_back(k25_tokenizer, source,  # noqa: F811
                                                                    enable_reasoning):
    from test_chat_k25_support import TEMPLATE_NAMES, template_source

    from kserve.chat import DIALECTS, ChatTemplate
    from kserve.server.self_check import run_self_check

    templates = ([ChatTemplate(dialect=d) for d in DIALECTS] if source == "builtin"
                 else [ChatTemplate(source=template_source(name), origin=name) for name in TEMPLATE_NAMES])
    for template in templates:
        run_self_check(_self_check_context(k25_tokenizer, template, enable_reasoning))


def test_self_check_refuses_a_thinking_template_whose_reasoning_the_server_would_misread(
        k25_tokenizer):  # noqa: F811
    from test_chat_k25_support import template_source

    from kserve.chat import ChatTemplate
    from kserve.server.self_check import SelfCheckError, run_self_check

    # Reasoning closed by a tag the model's template does not use: it would stay open and swallow the answer.
    drifted = ChatTemplate(source=template_source("k2.6").replace("<think>{{rc}}</think>",
                                                                  "<think>{{rc}}</thought>"),
                           origin="drifted", dialect="k2.6")
    with pytest.raises(SelfCheckError, match="reasoning split"):
        run_self_check(_self_check_context(k25_tokenizer, drifted))
