"""Streaming with multi-token deltas: every way of grouping an output's tokens into engine steps streams the same.

Speculative decoding appends several tokens to a sequence in one engine step, so the server's streaming path sees a
text delta of several tokens at once (a marker, its neighbours and a partial UTF-8 character may all arrive together,
or a marker's text may arrive one token at a time). Each realistic model output below is encoded with the real K2 /
K2.6 tokenizer and replayed through the server's own streaming path -- the engine's ``OutputProcessor`` (incremental
detokenizer, end-of-turn token) and ``ChoiceStream`` (reasoning parser, then tool parser, then tool-call deltas) --
grouping the tokens into steps in every way (all 2^(n-1) groupings of an output of n <= 14 tokens; for longer ones
every single cut point, every fixed step size 1..8 and 200 seeded random groupings). Each replay must give what the
whole-output parse (``parse_choice``, as a non-streaming response) gives: the same reasoning, content and calls, no
call lost, no marker text in content or reasoning, and well-formed tool-call deltas (the header -- id and name -- once
and first, then the arguments in order, indices in order and never reused; a call is done once the next begins).
The Anthropic Messages and Responses streams, written from the same deltas in output order (``stream_turn``), must
give the content blocks / output items of the one-token-per-step replay, whatever the grouping.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from test_chat_k25_support import make_model_dir
from test_chat_support import AB, CB, CE, SB, SE, real_tokenizer

from kserve.chat import load_tokenizer
from kserve.chat.dialect import K2, K2_6, K2_THINKING
from kserve.chat.markers import THINK_BEGIN, THINK_END, TOOL_MARKERS
from kserve.engine.output_processor import OutputProcessor
from kserve.engine.outputs import CompletionOutput
from kserve.engine.sampling_params import SamplingParams
from kserve.engine.sequence import Sequence
from kserve.server.anthropic_messages import _ContentBlocks, tool_use_id
from kserve.server.chat_turn import TurnDelta
from kserve.server.openai_responses import _EventWriter
from kserve.server.outcome import finish_reason
from kserve.server.serving_chat import NO_ARGUMENTS, ChoiceStream, PreparedChat, parse_choice
from kserve.server.thinking import ThinkingSwitch, reasoning_mode, think_end_is_skipped

EXHAUSTIVE_MAX_TOKENS = 14
FIXED_STEP_SIZES = range(1, 9)
RANDOM_GROUPINGS = 200

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
NEWS = {"type": "function", "function": {"name": "get_news", "parameters": {
    "type": "object", "properties": {"topic": {"type": "string"}}}}}
RENDER = {"type": "function", "function": {"name": "render_page", "parameters": {"type": "object"}}}
LIST_FILES = {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object"}}}
F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def call(header: str, arguments: str, sep: str = "") -> str:
    return f"{CB}{sep}{header}{sep}{AB}{sep}{arguments}{sep}{CE}"


# Arguments whose text looks like markers without being them (the real markers are single tokens, so the text
# `<|tool_call_end|` encodes as ordinary pieces) and whose emoji / CJK / math letters encode as partial-byte tokens.
TRICKY_ARGS = ('{"html": "<div>a <| b</div>", "note": "not the end: <|tool_call_end| nor <|tool_calls_section_end", '
               '"raw": "<|tool_call_argument_begin <|tool_call_begi <|im_end <|", "emoji": "🦜🧑‍🚀🌦️", '
               '"cjk": "北京 天气 龘", "math": "𝔘𝔫𝔦"}')


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "k2": K2's tokenizer; "k2.6": K2.6's
    dialect: object  # ChatDialect
    enable_reasoning: bool  # --enable-reasoning
    text: str  # the generated text, before the end-of-turn token
    tools: list | None
    calls: int  # tool calls the output holds (none may be lost)
    cut_by_length: bool = False  # ends at max_tokens (no end-of-turn token)
    max_calls: int | None = None  # 1: parallel_tool_calls=false (later calls are dropped)


CASES = [
    # --- K2-Instruct / K2-Thinking (K2's tokenizer: `<think>` is three ordinary tokens)
    Case("k2_plain_short", "k2", K2, False, "Hi! 你好 🦜 — ok.", None, 0),
    Case("k2_plain_with_tools", "k2", K2, False,
         "Sure. Some HTML: <div class=\"x\">a <| b</div>, a pipe <|not a marker|> and 天气🌦️ 𝔘𝔫𝔦.\n"
         "```python\nprint('<|tool_call')  # <|tool_calls_section_begin\n```\nDone.", [WEATHER], 0),
    Case("k2_short_call", "k2", K2, False, SB + call("f:0", '{"k":"€"}') + SE, [F], 1),  # short: every grouping
    Case("k2thinking_reasoning_content", "k2", K2_THINKING, True,
         "<think>The user says hello in Chinese (你好). A short answer will do; no tools needed. "
         "Note </thi is not the end.</think>你好！How can I help today? 🦜", None, 0),
    Case("k2thinking_reasoning_short", "k2", K2_THINKING, True, "<think>hm 🤔</think>Yes.", None, 0),
    Case("k2thinking_reasoning_call", "k2", K2_THINKING, True,
         "<think>I need the weather for 北京, so I call get_weather.</think>"
         + SB + call("functions.get_weather:0", '{"city": "北京"}') + SE, [WEATHER], 1),
    Case("k2_content_call_trailing", "k2", K2, False,
         "Let me check the weather in Beijing first. "
         + SB + call("functions.get_weather:0", '{"city": "Beijing", "unit": "celsius"}') + SE
         + "I will report back once I have it.", [WEATHER], 1),
    Case("k2_two_calls", "k2", K2, False,
         "Checking both. " + SB + call("functions.get_weather:0", '{"city": "Beijing"}', sep="\n")
         + " " + call("functions.get_news:1", '{"topic": "weather in 上海"}') + SE, [WEATHER, NEWS], 2),
    Case("k2_two_calls_parallel_off", "k2", K2, False,
         SB + call("functions.get_weather:0", '{"city": "Lima"}') + call("functions.get_news:1", '{"topic": "Lima"}')
         + SE + "Both requested.", [WEATHER, NEWS], 1, max_calls=1),
    Case("k2_no_argument_call_then_call", "k2", K2, False,  # the first call's arguments are empty: "{}"
         SB + call("functions.list_files:0", "") + call("functions.get_weather:1", '{"city": "Oslo"}') + SE,
         [LIST_FILES, WEATHER], 2),
    Case("k2_marker_like_utf8_args", "k2", K2, False,
         "Rendering 🖥️: " + SB + call("functions.render_page:0", TRICKY_ARGS) + SE, [RENDER], 1),
    Case("k2_call_cut_by_length", "k2", K2, False,
         "One moment. " + SB + call("functions.get_weather:0", '{"city": "北京 🌦️", "unit": "cel')[: -len(CE)],
         [WEATHER], 1, cut_by_length=True),
    # --- K2.6 (prefills `<think>`: the output starts in reasoning; `<think>` / `</think>` are single tokens)
    Case("k26_reasoning_content_short", "k2.6", K2_6, False, "Greet back.</think>Hi! 👋", None, 0),
    Case("k26_reasoning_call_short", "k2.6", K2_6, False, "ok" + THINK_END + SB + call("functions.f:0", "{}") + SE,
         [F], 1),
    Case("k26_reasoning_content", "k2.6", K2_6, False,
         "The user asks for a haiku about 秋 (autumn). Keep it 5-7-5; a <|tool_calls_section_begin is not needed."
         "</think>Crisp leaves drift and fall 🍂\n紅葉 whispers to the wind\nautumn says goodbye", None, 0),
    Case("k26_reasoning_call", "k2.6", K2_6, False,
         "The user wants Beijing's weather (北京). I should call get_weather.</think>"
         + SB + call("functions.get_weather:0", '{"city": "北京"}') + SE, [WEATHER], 1),
    Case("k26_reasoning_two_calls_tricky", "k2.6", K2_6, False,
         "Two lookups, then render; mind the 🧑‍🚀 emoji.</think>On it. "
         + SB + call("functions.get_weather:0", '{"city": "東京", "unit": "celsius"}')
         + call("functions.render_page:1", TRICKY_ARGS[:-1] + ', "tags": "<think> and </think> are just text here"}')
         + SE + " (calls sent)", [WEATHER, RENDER], 2),
    Case("k26_reasoning_into_section", "k2.6", K2_6, False,  # no </think>: the section start ends the reasoning
         "Weather first, 直接调用." + SB + call("functions.get_weather:0", '{"city": "Paris"}') + SE,
         [WEATHER], 1),
]


class _NullMetrics:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


CTX = SimpleNamespace(metrics=_NullMetrics())  # what parse_choice / ChoiceStream.finish read of the context


@dataclass
class Prepared:
    case: Case
    tokenizer: object
    ids: list[int]
    prep: PreparedChat
    skip_special_tokens: bool
    text: str
    whole: tuple  # parse_choice's (reasoning, content, calls, finish)


def prepare(case: Case, tokenizer) -> Prepared:
    # As prepare_chat does: how the output splits, and which special tokens the text keeps.
    mode = reasoning_mode(case.dialect, ThinkingSwitch(), case.enable_reasoning)
    parse_tools = bool(case.tools)
    skip = not (parse_tools or (mode.parse and think_end_is_skipped(tokenizer)))
    prep = PreparedChat(request_id="chatcmpl-multitoken", req=None, prompt_ids=[], params=None, tools=case.tools,
                        parse_tools=parse_tools, top_logprobs=0, max_calls=case.max_calls, reasoning=mode)
    generated = tokenizer.encode(case.text)
    assert tokenizer.decode(generated) == case.text
    text = tokenizer.decode(generated, skip_special_tokens=skip)
    ids = generated if case.cut_by_length else generated + [tokenizer.im_end_id]
    final = CompletionOutput(0, text, ids, finish_reason="length" if case.cut_by_length else "stop")
    return Prepared(case, tokenizer, ids, prep, skip, text, parse_choice(CTX, prep, final))


def groupings(n: int) -> list[tuple[int, ...]]:
    """Ways to cut n tokens into engine steps, as the step end positions (each ends with n)."""
    if n <= EXHAUSTIVE_MAX_TOKENS:
        return [tuple(i + 1 for i in range(n - 1) if mask >> i & 1) + (n,) for mask in range(1 << (n - 1))]
    ways = {(cut, n) for cut in range(1, n)}
    ways |= {tuple(range(size, n, size)) + (n,) for size in FIXED_STEP_SIZES}
    rng = random.Random(n)
    while len(ways) < n - 1 + len(FIXED_STEP_SIZES) + RANDOM_GROUPINGS:
        top = rng.choice((2, 3, 5, 8, 16))
        ends, at = [], 0
        while at < n:
            at = min(n, at + rng.randint(1, top))
            ends.append(at)
        ways.add(tuple(ends))
    return sorted(ways)


@dataclass
class Streamed:
    text: str
    reasoning: str
    content: str
    deltas: list  # the ChatDeltas chat completions sends (empty ones are not sent)
    ordered: list  # the ChatDeltas stream_turn sends (Anthropic Messages, Responses), in output order
    calls: list  # ChoiceStream.finish's calls
    finish: str


def replay(p: Prepared, ends: tuple[int, ...], checked: bool = False) -> Streamed:
    """One engine step per group: its tokens appended as the engine does, then the streams advanced with the new
    visible text, as stream_chat (`advance`) and stream_turn (`advance_in_order`) do."""
    tokenizer = p.tokenizer
    params = SamplingParams(max_tokens=len(p.ids) if p.case.cut_by_length else None,
                            skip_special_tokens=p.skip_special_tokens)
    seq = Sequence(0, p.prep.request_id, 0, [], params, 0)
    processor = OutputProcessor(tokenizer, tokenizer.stop_token_ids, 1 << 30)
    processor.start(seq)
    chat, turn = ChoiceStream.start(CTX, p.prep, 0), ChoiceStream.start(CTX, p.prep, 0)
    reasoning, content, deltas, ordered = [], [], [], []
    start = 0
    for end in ends:
        assert not seq.is_finished
        for token_id in p.ids[start:end]:
            processor.append_token(seq, token_id, None)
        start = end
        text = seq.visible_text
        delta = chat.advance(text[chat.text_sent:], final=seq.is_finished)
        chat.text_sent = len(text)
        reasoning.append(delta.reasoning_content or "")
        content.append(delta.content or "")
        if not (delta.content is None and delta.reasoning_content is None and delta.tool_calls is None):
            deltas.append(delta)
        ordered += turn.advance_in_order(text[turn.text_sent:], final=seq.is_finished)
        turn.text_sent = len(text)
    assert seq.is_finished
    if checked:
        calls, finish = chat.finish(CTX, p.prep, seq.finish_reason)
    else:  # what finish gives, without its (slow, logging-only) schema checks of the calls
        calls, finish = chat.calls(), finish_reason(seq.finish_reason, bool(chat.calls()))
    assert [(c.id, c.arguments) for c in turn.calls()] == [(c.id, c.arguments) for c in calls]
    return Streamed(seq.text, "".join(reasoning), "".join(content), deltas, ordered, calls, finish)


def streamed_calls(deltas) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call from the tool-call deltas, checking they are well-formed."""
    calls: list[list[str]] = []
    for delta in deltas:
        for d in delta.tool_calls or ():
            if d.id is not None:  # a header: once per call, calls in order, id and name complete
                assert d.index == len(calls), f"call header {d.index} after {len(calls)} calls"
                assert d.type == "function" and d.id and d.function.name
                calls.append([d.id, d.function.name, d.function.arguments or ""])
            else:  # arguments only, for the latest call (whose header was sent; earlier calls are done)
                assert d.index < len(calls), f"arguments for call {d.index} before its header"
                assert d.index == len(calls) - 1, f"arguments for call {d.index} after call {len(calls) - 1} began"
                assert d.function.name is None and d.type is None
                assert d.function.arguments, "an empty arguments delta"
                calls[d.index][2] += d.function.arguments
    return [tuple(c) for c in calls]


def check(p: Prepared, s: Streamed, reference: Streamed | None = None) -> None:
    """`s` streams what the whole-output parse gives; with a reference replay (one token per step), the Anthropic
    blocks and Responses items are also the reference's: how the tokens were grouped into steps does not show."""
    reasoning, content, calls, finish = p.whole
    assert s.text == p.text
    assert s.reasoning == (reasoning or "")
    assert s.content == content
    expected = [(c.id, c.name, c.arguments or NO_ARGUMENTS) for c in calls]
    assert len(expected) == p.case.calls, "the whole-output parse lost a call"
    assert streamed_calls(s.deltas) == expected
    assert [(c.id, c.name, c.arguments, c.complete) for c in s.calls] == \
        [(c.id, c.name, c.arguments, c.complete) for c in calls]
    assert s.finish == finish
    for marker in TOOL_MARKERS if p.prep.parse_tools else ():
        assert marker not in s.content
    if p.prep.reasoning.parse:
        assert THINK_END not in s.reasoning and THINK_END not in s.content
        assert THINK_BEGIN not in s.reasoning and THINK_BEGIN not in s.content
    assert "\ufffd" not in s.reasoning + s.content, "a partial UTF-8 character leaked"
    # stream_turn's deltas: the same pieces, each delta in output order (reasoning, then content, then calls).
    assert "".join(d.reasoning_content or "" for d in s.ordered) == s.reasoning
    assert "".join(d.content or "" for d in s.ordered) == s.content
    assert streamed_calls(s.ordered) == expected
    blocks, items = anthropic_blocks(s.ordered), responses_items(s.ordered)
    if reference is None:
        assert joined(blocks) == (s.reasoning, s.content, [(tool_use_id(i), n, a) for i, n, a in expected])
        assert joined(items) == (s.reasoning, s.content, expected)
    else:
        assert blocks == anthropic_blocks(reference.ordered)
        assert items == responses_items(reference.ordered)


def anthropic_blocks(deltas) -> list[tuple]:
    """The content blocks an Anthropic client builds from the stream: (type, [id, name,] text or input JSON)."""
    writer, blocks = _ContentBlocks(), []
    for event in [event for delta in deltas for event in writer.feed(TurnDelta.of(delta))] + writer.close():
        data = json.loads(event.split("data: ", 1)[1])
        if data["type"] == "content_block_start":
            block = data["content_block"]
            assert data["index"] == len(blocks)
            blocks.append([block["type"], block["id"], block["name"], ""] if block["type"] == "tool_use"
                          else [block["type"], ""])
        elif data["type"] == "content_block_delta":
            assert data["index"] == len(blocks) - 1
            delta = data["delta"]
            blocks[-1][-1] += delta.get("thinking") or delta.get("text") or delta.get("partial_json")
    return [tuple(b) for b in blocks]


def responses_items(deltas) -> list[tuple]:
    """The output items the Responses stream closes: (type, [call_id, name,] text or arguments)."""
    writer = _EventWriter()
    for delta in deltas:
        writer.feed(TurnDelta.of(delta))
    writer.close("completed")
    items = []
    for item in writer.output:
        if item["type"] == "function_call":
            items.append(("function_call", item["call_id"], item["name"], item["arguments"]))
        else:
            items.append((item["type"], "".join(part["text"] for part in item["content"])))
    return items


def joined(blocks) -> tuple[str, str, list]:
    """(reasoning, text, calls) of Anthropic blocks or Responses items."""
    reasoning = "".join(b[1] for b in blocks if b[0] in ("thinking", "reasoning"))
    text = "".join(b[1] for b in blocks if b[0] in ("text", "message"))
    return reasoning, text, [b[1:] for b in blocks if b[0] in ("tool_use", "function_call")]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """model -> its real tokenizer, loaded on first use (a test skips when ../shared lacks that model's files)."""
    loaded = {}

    def get(model: str):
        if model not in loaded:
            loaded[model] = real_tokenizer() if model == "k2" else \
                load_tokenizer(make_model_dir(tmp_path_factory.mktemp("k26_tokenizer")))
        return loaded[model]

    return get


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_grouping_of_the_tokens_streams_the_whole_parse(case, tokenizers):
    p = prepare(case, tokenizers(case.model))
    ways = groupings(len(p.ids))
    if len(p.ids) <= EXHAUSTIVE_MAX_TOKENS:
        assert len(ways) == 2 ** (len(p.ids) - 1)
    reference = replay(p, tuple(range(1, len(p.ids) + 1)), checked=True)  # one token per step: no speculation
    check(p, reference)
    for ends in ways:
        try:
            check(p, replay(p, ends), reference)
        except AssertionError as exc:
            steps = [p.tokenizer.decode(p.ids[a:b]) for a, b in zip((0,) + ends, ends)]
            raise AssertionError(f"{case.name}: steps {steps!r}: {exc}") from exc


def test_the_cases_exercise_what_they_claim(tokenizers):
    """Short outputs are replayed exhaustively; the UTF-8 cases hold tokens that are only part of a character;
    the K2 cases spell `<think>` in several tokens, the K2.6 ones as one."""
    exhaustive = [c.name for c in CASES if len(prepare(c, tokenizers(c.model)).ids) <= EXHAUSTIVE_MAX_TOKENS]
    assert {"k2_plain_short", "k2_short_call", "k26_reasoning_content_short", "k26_reasoning_call_short"} <= \
        set(exhaustive)
    for name in ("k2_marker_like_utf8_args", "k26_reasoning_two_calls_tricky"):
        case = next(c for c in CASES if c.name == name)
        tok = tokenizers(case.model)
        pieces = [tok.token_bytes(i) for i in tok.encode(case.text)]
        partial = [b for b in pieces if _not_utf8(b)]
        assert len(partial) >= 4, name
    assert len(tokenizers("k2").encode(THINK_BEGIN)) > 1
    assert len(tokenizers("k2.6").encode(THINK_BEGIN)) == len(tokenizers("k2.6").encode(THINK_END)) == 1


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
