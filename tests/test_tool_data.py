"""The synthetic tool-use data behind the embedded chat model (scripts/gen_tool_data.py): K2.6's format,
a reasoning sentence before every answer and call, held-out phrasings never trained on."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from gen_tool_data import generate
from tool_data_pool import (
    AGENT_PERSONAS_HELDOUT,
    AGENT_PERSONAS_TRAIN,
    AGENT_RULES_HELDOUT,
    AGENT_RULES_TRAIN,
    CLOSERS_HELDOUT,
    CLOSERS_TRAIN,
    ECHO_WRAPPERS_TRAIN,
    OPENERS_HELDOUT,
    OPENERS_TRAIN,
    PLAIN_CHATS,
    PLAIN_QUESTION_CHATS_TRAIN,
    QUESTIONS_TRAIN,
    TWO_TASK_JOINERS_TRAIN,
    WRAPPERS_HELDOUT,
    WRAPPERS_TRAIN,
    build_tools,
    phrasing,
)
from gen_tool_data import fill
from train_tiny_chat import FakeInt4, data_options, encode_conversation, learn_corpus_ranks, parser

RECIPE = parser().parse_args(["--out", "unused"])  # the embedded model's training arguments

from kserve.chat import parse_tool_output, render_prompt


def test_pool_has_sixty_varied_tools_with_the_common_agent_ones():
    tools = build_tools()
    names = {t.name for t in tools}
    assert len(tools) >= 60 and len(names) == len(tools)
    for must in ("web_search", "fetch_url", "get_weather", "calculator", "read_file", "write_file", "send_email"):
        assert must in names
    kinds = json.dumps([t.parameters for t in tools])
    for kind in ('"enum"', '"array"', '"integer"', '"number"', '"boolean"', '"object", "properties"'):
        assert kind in kinds


def test_same_seed_same_data_and_other_seed_differs():
    assert generate(3, 40) == generate(3, 40)
    assert generate(3, 40) != generate(4, 40)


@pytest.mark.parametrize("split", ["heldout", "fresh"])
def test_unseen_phrasings_are_never_used_for_training(split):
    style = phrasing(split)
    wrappers, joiners, chats, openers, closers = style.wrappers, style.joiners, style.plain, style.openers, style.closers
    assert not set(WRAPPERS_TRAIN) & set(wrappers)
    assert not set(TWO_TASK_JOINERS_TRAIN) & set(joiners)
    # A training plain chat must not be a held-out chat, opener or closer either ("Much obliged." once was).
    train_chats = {ask.lower() for asks, *_ in PLAIN_CHATS for ask in asks}
    heldout_words = {ask.lower() for asks, *_ in chats for ask in asks}
    heldout_words |= {w.strip().lower() for w in openers + closers} - {""}
    assert not train_chats & heldout_words
    for train, heldout in ((OPENERS_TRAIN, openers), (CLOSERS_TRAIN, closers),
                           (AGENT_PERSONAS_TRAIN, AGENT_PERSONAS_HELDOUT), (AGENT_RULES_TRAIN, AGENT_RULES_HELDOUT)):
        assert not (set(train) - {""}) & set(heldout)
        assert set(heldout) - {""}


@pytest.mark.parametrize("split", ["heldout", "fresh"])
def test_no_heldout_request_or_agent_prompt_appears_in_the_training_data(split):
    """The evaluation's conversations (seed 1) against the start of the shipped model's training data (seed 0):
    no user message and no agent system prompt in common, and every held-out tool request uses a held-out
    wrapper or joiner."""
    train = generate(0, 4000, "train", **data_options(RECIPE))
    heldout = generate(1, 400, split)

    def said(rows, role):
        return {m["content"] for r in rows for m in r["messages"] if m["role"] == role}

    assert not said(train, "user") & said(heldout, "user")
    agent_prompts = {p for p in said(heldout, "system") if "# Rules" in p}
    assert agent_prompts and not agent_prompts & said(train, "system")
    wrappers, joiners = phrasing(split).wrappers, phrasing(split).joiners
    heldout_shapes = [w.split("{")[0] or w.split("}")[-1] for w in wrappers]
    joins = [j.split("{a}")[1].split("{b}")[0] for j in joiners]
    for row in heldout:
        if row["expect"]["kind"] == "tool_calls":
            request = row["messages"][row["eval_turn"] - 1]["content"]
            assert any(shape in request for shape in heldout_shapes + joins), request


def test_tool_requests_asked_as_questions_are_training_only_and_the_thought_restates_a_task():
    """"What's the time in Tokyo?" opens as a plain chat does. Such requests are in the training data only
    (the evaluation splits have no questions and no context sentences), and their thought restates the tool's
    first intent, so it still reads "The request is to ..."."""
    for split in ("heldout", "fresh", "bare"):
        assert not phrasing(split).questions and not phrasing(split).context
    tools = {t.name: t for t in build_tools()}
    assert set(QUESTIONS_TRAIN) <= set(tools) and len(QUESTIONS_TRAIN) >= 30
    asked = 0
    single = [r for r in generate(0, 1500) if r["expect"]["kind"] == "tool_calls" and len(r["expect"]["calls"]) == 1]
    for row in single:
        call = row["expect"]["calls"][0]
        request = row["messages"][row["eval_turn"] - 1]["content"]
        intents = {fill(i, call["arguments"]).lower() for i in tools[call["name"]].intents}
        questions = [fill(q, call["arguments"]) for q in QUESTIONS_TRAIN.get(call["name"], ())]
        questions = [q for q in questions if q.rstrip("?.").lower() not in intents]  # "How do I get from ...?"
        if any(q in request for q in questions):
            asked += 1
            if row["thinking"]:
                task = fill(tools[call["name"]].intents[0], call["arguments"])
                assert row["messages"][row["eval_turn"]]["reasoning_content"].startswith(f"The request is to {task},")
    assert 0.1 < asked / len(single) < 0.3
    heldout = [m["content"] for r in generate(1, 400, "heldout") for m in r["messages"] if m["role"] == "user"]
    stems = {q.split("{")[0] for qs in QUESTIONS_TRAIN.values() for q in qs} - {""}
    openers = tuple(w.strip() + " " for w in OPENERS_HELDOUT if w.strip())
    for message in heldout:
        body = next((message[len(o):] for o in openers if message.startswith(o)), message)
        assert not any(body.startswith(stem) for stem in stems if len(stem) > 12), message


def test_most_tool_results_come_without_a_name_as_openai_clients_send_them():
    """K2.6's template heads a result with the message's `name`, else with "tool"; the OpenAI SDK sends no name.
    Most training results have none, so the answer's thought reads the tool from "## Return of <call id>";
    the evaluation splits keep theirs (their requests stay byte for byte as before)."""
    rows = [r for r in generate(0, 600) if r["expect"]["kind"] == "tool_calls"]
    results = [m for r in rows for m in r["messages"] if m["role"] == "tool"]
    assert 0.55 < sum("name" not in m for m in results) / len(results) < 0.85
    for row in rows:
        named = ["name" in m for m in row["messages"] if m["role"] == "tool"]
        assert len(set(named)) == 1  # one client, one habit
        if not named[0]:
            assert "<|im_system|>tool<|im_middle|>## Return of functions." in row["text"]
        if row["thinking"]:
            called = " and ".join(c["name"] for c in row["expect"]["calls"])
            assert row["messages"][-1]["reasoning_content"] == f"I have the result of {called}, so I will answer."
    for split in ("heldout", "fresh", "bare"):
        assert all("name" in m for r in generate(1, 100, split) for m in r["messages"] if m["role"] == "tool")


def test_echo_requests_quote_random_words_that_the_answer_copies():
    """The training-only echo requests: the answer is the words the request asks to repeat, the thought quotes
    the request, no tool is called; the held-out split has none, and without them the data is as before."""
    rows = generate(0, 400, echo_share=0.25)
    shapes = [w.split("{text}") for w in ECHO_WRAPPERS_TRAIN]

    def echoed(row):
        answer = row["messages"][-1]["content"]
        return any(f"{before}{answer}{after}" in row["messages"][-2]["content"] for before, after in shapes)

    echo = [r for r in rows if r["expect"]["kind"] == "text" and echoed(r)]
    assert 60 <= len(echo) <= 140
    assert len({r["messages"][-1]["content"] for r in echo}) == len(echo)  # random words, never a fixed set
    for row in echo:
        assert "tool_calls" not in row["messages"][-1]
        if row["thinking"]:
            assert f'"{row["messages"][-2]["content"]}"' in row["messages"][-1]["reasoning_content"]
    assert not any(echoed(r) for r in generate(0, 400) if r["expect"]["kind"] == "text")
    with pytest.raises(ValueError):
        generate(1, 10, "heldout", echo_share=0.1)


def test_every_answer_and_call_starts_with_one_reasoning_sentence_unless_thinking_is_off():
    rows = generate(0, 200)
    assert 0.7 < sum(r["thinking"] for r in rows) / len(rows) < 0.95
    for row in rows:
        for start, end in row["spans"]:
            turn = row["text"][start:end]
            before = row["text"][:start]
            if row["thinking"]:
                assert before.endswith("<|im_middle|><think>")
                reasoning, rest = turn.split("</think>", 1)
                # one sentence: what the user wants, then ", so I will" and what the turn does
                assert reasoning.count(", so I will ") == 1 and reasoning.endswith(".") and len(reasoning) < 400
                if rest.startswith("<|tool_calls_section_begin|>"):
                    names = [c.name for c in parse_tool_output(rest[: -len("<|im_end|>")]).calls]
                    assert reasoning.startswith("The request is to") and all(n in reasoning for n in names)
            else:
                assert before.endswith("<think></think>") and "</think>" not in turn


def test_training_weights_the_assistant_turns_their_arguments_and_their_choices(tiny_k25_dir):
    from kserve.chat import load_tokenizer

    tokenizer = load_tokenizer(tiny_k25_dir)  # K2.6's: <think> and </think> are control tokens
    rows = generate(0, 60)
    for row in rows:
        ids, weights = encode_conversation(tokenizer, row["text"], row["spans"], arguments_weight=3.0,
                                           choice_weight=2.0)
        # encoded piece by piece, yet the same ids as the whole conversation
        assert ids == tokenizer.encode(row["text"], allow_special_tokens=True)
        learned = "".join(tokenizer.decode([i]) for i, w in zip(ids, weights) if w > 0)
        assert learned == "".join(row["text"][a:b] for a, b in row["spans"])
        arguments = "".join(tokenizer.decode([i]) for i, w in zip(ids, weights) if w == 3.0)
        calls = [c for m in row["messages"] for c in m.get("tool_calls") or []]
        assert arguments == "".join(c["function"]["arguments"] for c in calls)
        choices = [tokenizer.decode([i]) for i, w in zip(ids, weights) if w == 2.0]
        opening = [row["text"][a:b].split("</think>")[-1] for a, b in row["spans"]]
        assert len([t for t in choices if t == "<|tool_calls_section_begin|>"]) == sum(
            turn.startswith("<|tool_calls_section_begin|>") for turn in opening)
        reasonings = [row["text"][a:b].split("</think>")[0] + "</think>" for a, b in row["spans"] if row["thinking"]]
        assert all(r in "".join(choices) for r in reasonings)
        assert "".join(choices).count("functions.") == len(calls)
        assert choices.count("<|tool_calls_section_end|>") == sum(bool(m.get("tool_calls")) for m in row["messages"])


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_calls_are_schema_valid_and_render_as_k26_parses_them(split):
    rows = generate(0, 150, split)
    assert {r["expect"]["kind"] for r in rows} == {"tool_calls", "text"}
    by_name = {t.name: t for t in build_tools()}
    for row in rows:
        # the text is the server's K2.6 prompt for the last assistant turn (TypeScript tools, <think> prefill
        # or <think></think> with thinking off), then that turn; the spans cut it exactly at assistant turns
        prompt = render_prompt(row["messages"][:-1], row["tools"] or None, add_generation_prompt=True,
                               dialect="k2.6", thinking=row["thinking"])
        assert row["text"].startswith(prompt) and row["spans"][-1] == [len(prompt), len(row["text"])]
        if row["tools"]:
            assert "namespace functions {" in row["text"]
        assistants = [m for m in row["messages"] if m["role"] == "assistant"]
        # an earlier small-talk answer keeps no reasoning in K2.6's history: context, not a span
        assert len(row["spans"]) == len(assistants) - (row["thinking"] and sum(
            not m.get("tool_calls") for m in assistants[:-1]))
        for (start, end), message in zip(row["spans"][::-1], assistants[::-1]):
            turn = row["text"][start:end]
            assert turn.endswith("<|im_end|>")
            if message.get("tool_calls"):
                parsed = parse_tool_output(turn.split("</think>")[-1][: -len("<|im_end|>")])
                assert [c.name for c in parsed.calls] == [c["function"]["name"] for c in message["tool_calls"]]
        if row["expect"]["kind"] == "tool_calls":
            declared = {t["function"]["name"] for t in row["tools"]}
            for call in row["expect"]["calls"]:
                assert call["name"] in declared
                jsonschema.validate(call["arguments"], by_name[call["name"]].parameters)
                # every argument value the call carries is named in the user's request
                user = row["messages"][row["eval_turn"] - 1]["content"]
                for value in call["arguments"].values():
                    for leaf in value if isinstance(value, list) else [value]:
                        if isinstance(leaf, dict):
                            continue
                        if not isinstance(leaf, bool):
                            assert str(leaf) in user, (leaf, user)


def test_the_embedded_models_tokenizer_is_learned_from_these_conversations():
    """The shipped tiktoken.model is the project's own output, rebuilt here byte for byte: the BPE that
    train_tiny_chat.py's defaults learn from the first training conversations (seed 0), not K2's file."""
    from kserve.tiny import embedded_model_dir, tiktoken_model_text

    convos = generate(RECIPE.seed, RECIPE.bpe_conversations, "train", **data_options(RECIPE))
    ranks = learn_corpus_ranks(convos, RECIPE.vocab)
    assert (embedded_model_dir() / "tiktoken.model").read_text() == tiktoken_model_text(ranks)


def test_experts_train_on_the_int4_values_the_checkpoint_will_hold():
    """The fake quantization in training gives exactly the weights the INT4 export dequantizes to, and passes
    the gradient straight through."""
    import torch

    from kserve.kernels.int4_pack import dequantize_int4, pack_int4, quantize_int4_groups

    weight = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(0), requires_grad=True)
    faked = FakeInt4(32)(weight)
    for e in range(3):
        q, scale = quantize_int4_groups(weight[e].detach(), 32)
        assert torch.equal(faked[e].detach(), dequantize_int4(pack_int4(q), scale, 32, torch.float32))
    assert not torch.equal(faked.detach(), weight.detach())
    faked.sum().backward()
    assert torch.equal(weight.grad, torch.ones_like(weight))


def test_a_planted_loop_is_untrained_and_the_thought_resumes_after_it():
    """train_tiny_chat.py --repeat-break-share: a loop of the span just before a point in a reasoning
    sentence (whole 0-2 times, then in part) goes in untrained; without it the sequence is the original one,
    and the token after it is one the loop's span did not continue with."""
    import random

    from train_tiny_chat import IGNORED, break_a_repeat

    think, end = 90, 91
    ids = [1, 2, think, 10, 11, 12, 13, 14, 15, 16, end, 20, 3, think, end, 21]  # a second turn thinks nothing
    weights = [0.0, 0.0, 3.0] + [3.0] * 7 + [3.0, 1.0, 0.0, 3.0, 3.0, 1.0]
    for seed in range(40):
        new_ids, new_weights = break_a_repeat(ids, weights, think, end, random.Random(seed))
        loop = [i for i, w in enumerate(new_weights) if w == IGNORED]
        assert loop and loop == list(range(loop[0], loop[-1] + 1))
        first, after = loop[0], loop[-1] + 1
        assert [t for t, w in zip(new_ids, new_weights) if w != IGNORED] == ids
        assert [w for w in new_weights if w != IGNORED] == weights
        assert ids.index(think) < first and after < new_ids.index(end)  # inside the reasoning sentence
        planted = new_ids[first:after]
        spans = [ids[first - k: first] for k in range(2, 7) if first - k > ids.index(think)]
        span = next(s for s in spans if planted == (s * 3)[: len(planted)] and len(planted) % len(s))
        assert new_ids[after] == ids[first] != span[len(planted) % len(span)]
    no_thought = ([1, 2, think, end, 20], [0.0, 0.0, 3.0, 3.0, 1.0])
    assert break_a_repeat(*no_thought, think, end, random.Random(0)) == no_thought


def test_unlikelihood_is_minus_log_one_minus_p_over_earlier_tokens_but_the_right_one():
    import math

    import torch

    from train_tiny_chat import unlikelihood

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (2, 9), generator=gen)
    logits = torch.randn(2 * 8, 7, generator=gen)
    trained = torch.rand(2 * 8, generator=gen) < 0.6
    expected = 0.0
    for n in trained.nonzero().flatten().tolist():
        row, pos = divmod(n, 8)
        p = torch.softmax(logits[n], -1)
        for token in set(ids[row, : pos + 1].tolist()) - {ids[row, pos + 1].item()}:
            expected -= math.log(1 - p[token].item())
    assert math.isclose(unlikelihood(logits, ids, trained).item(), expected, rel_tol=1e-5)


def test_bare_split_asks_with_the_request_alone():
    """eval_tool_calls.py --bare: each request is the task itself, capitalized, with no opener, wrapper words
    or closer, and every conversation is a tool request."""
    wrapped = {w.split("{")[0] for w in WRAPPERS_TRAIN + WRAPPERS_HELDOUT} | set(OPENERS_TRAIN + OPENERS_HELDOUT)
    wrapped -= {""}
    rows = generate(1, 40, "bare", plain_share=0.0, agent_share=0.0)
    assert all(row["expect"]["kind"] == "tool_calls" for row in rows)
    for row in rows:
        request = row["messages"][row["eval_turn"] - 1]["content"]
        assert request[0].isupper() and not any(request.startswith(w) for w in wrapped), request
        assert not any(request.endswith(c) for c in set(CLOSERS_TRAIN + CLOSERS_HELDOUT) - {""}), request


def test_answer_rows_send_the_results_as_the_openai_sdk_does_and_expect_the_final_sentence():
    """eval_tool_calls.py --answers: a held-out tool conversation up to its results, none carrying `name`,
    so the prompt heads each result "tool"; the expected text is the conversation's final answer."""
    from eval_tool_calls import answer_rows

    rows = generate(1, 30, "heldout", plain_share=0.0)
    cut = answer_rows(rows)
    assert len(cut) == 30 and all("name" in m for r in rows for m in r["messages"] if m["role"] == "tool")
    for row, original in zip(cut, rows):
        prompt = row["messages"][: row["eval_turn"]]
        assert prompt[-1]["role"] == "tool" and not any("name" in m for m in prompt if m["role"] == "tool")
        assert row["expect"] == {"kind": "text", "content": original["messages"][-1]["content"]}
        rendered = render_prompt(prompt, row["tools"], dialect="k2.6")
        assert "<|im_system|>tool<|im_middle|>## Return of functions." in rendered


def test_noise_words_keep_the_unseen_splits_words_unseen_and_are_training_only():
    """`--noise-share` (0.15 in the recipe): the noise never holds a word of a `heldout` or `fresh` phrasing other
    than a request's first word, nor a value; the unseen splits refuse it; a noisy plain chat carries a noise word."""
    import tool_data_pool as pool

    noise = set(pool.noise_vocabulary())
    verbs = {i.split()[0] for t in build_tools() for i in t.intents}
    unseen = " ".join(pool.WRAPPERS_HELDOUT + pool.WRAPPERS_FRESH + pool.OPENERS_HELDOUT + pool.OPENERS_FRESH
                      + pool.CLOSERS_HELDOUT + pool.CLOSERS_FRESH + pool.TWO_TASK_JOINERS_HELDOUT
                      + pool.TWO_TASK_JOINERS_FRESH)
    unseen_words = {w.lower() for w in re.findall(r"[A-Za-z]+", unseen)}
    assert noise & unseen_words <= verbs and verbs <= noise
    values = {w.lower() for v in pool.CITIES + pool.NAMES + pool.FOODS + pool.WORDS for w in v.split()}
    assert not noise & values
    assert RECIPE.noise_share == 0.15
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", noise_share=0.15)
    noisy = [c for c in generate(0, 40, "train", noise_share=1.0) if c["expect"]["kind"] == "text"]
    greetings = {g for chats in PLAIN_CHATS for g in chats[0]}
    assert noisy and all(c["messages"][-2]["content"] not in greetings for c in noisy)


def test_tail_words_are_training_joiner_words_only_and_never_reach_the_thought():
    """`--tail-share` (off in the recipe): a one-task request may end in a training joiner's word that is no word
    of an unseen split's phrasing; the unseen splits refuse it, and the thought restates the task without it."""
    import tool_data_pool as pool

    tail = set(pool.tail_words())
    unseen = " ".join(pool.WRAPPERS_HELDOUT + pool.WRAPPERS_FRESH + pool.CLOSERS_HELDOUT + pool.CLOSERS_FRESH
                      + pool.TWO_TASK_JOINERS_HELDOUT + pool.TWO_TASK_JOINERS_FRESH)
    joiners = " ".join(pool.TWO_TASK_JOINERS_TRAIN)
    assert tail and tail <= {w.lower() for w in re.findall(r"[A-Za-z]+", joiners)}
    assert not tail & {w.lower() for w in re.findall(r"[A-Za-z]+", unseen)}
    assert RECIPE.tail_share == 0.0
    with pytest.raises(ValueError):
        generate(1, 2, "fresh", tail_share=0.15)
    tailed = 0
    for row in generate(0, 200, "train", plain_share=0.0, tail_share=1.0):
        calls = [m for m in row["messages"] if m.get("tool_calls")]
        if len(calls[0]["tool_calls"]) != 1 or "reasoning_content" not in calls[0]:
            continue
        thought = calls[0]["reasoning_content"]
        task = re.match(r"The request is to (.*), so I will call", thought)
        user = row["messages"][row["messages"].index(calls[0]) - 1]["content"]
        ends = re.findall(re.escape(task.group(1)) + r",? (\w+)", user) if task else []
        if any(word in tail for word in ends):
            tailed += 1
            assert not any(f" {word}," in thought or f" {word}." in thought for word in tail), thought
    assert tailed > 20


def _thoughts_and_requests(rows: list[dict], n_calls: int) -> list[tuple[str, str]]:
    """(thought, request in lower case) of each row whose first tool turn makes `n_calls` calls after a thought."""
    out = []
    for row in rows:
        turn = next(m for m in row["messages"] if m.get("tool_calls"))
        if len(turn["tool_calls"]) == n_calls and "reasoning_content" in turn:
            user = row["messages"][row["messages"].index(turn) - 1]["content"]
            out.append((turn["reasoning_content"], user.lower()))
    return out


def test_link_words_alone_join_two_tasks_and_share_no_word_with_an_unseen_split_or_a_task():
    """`--link-share` (0.25 in the recipe, inline): a two-task request's tasks may be joined by a separator and noise
    words alone. No link word is a request's verb, a training joiner's word or a word of an unseen split's
    phrasing; the unseen splits refuse it; the thought still restates both tasks. With `--link-inline` no full
    stop stands between the tasks."""
    import tool_data_pool as pool

    links = set(pool.link_words())
    unseen = " ".join(pool.WRAPPERS_HELDOUT + pool.WRAPPERS_FRESH + pool.OPENERS_HELDOUT + pool.OPENERS_FRESH
                      + pool.CLOSERS_HELDOUT + pool.CLOSERS_FRESH + pool.TWO_TASK_JOINERS_HELDOUT
                      + pool.TWO_TASK_JOINERS_FRESH + TWO_TASK_JOINERS_TRAIN)
    verbs = {i.split()[0] for t in build_tools() for i in t.intents}
    assert len(links) > 100
    assert not links & ({w.lower() for w in re.findall(r"[A-Za-z]+", unseen)} | verbs)
    assert RECIPE.link_share == 0.25 and RECIPE.link_inline is True
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", link_share=0.25)
    for inline, separator in ((False, r"\. |, |; | "), (True, r", |; | ")):
        pairs = _thoughts_and_requests(generate(0, 300, "train", plain_share=0.0, link_share=1.0,
                                                link_inline=inline), 2)
        for thought, user in pairs:
            first, second = (t.lower() for t in re.match(r"The request is to (.*) and to (.*), so I", thought).groups())
            between = user[user.index(first) + len(first): user.index(second, user.index(first) + len(first))]
            assert re.fullmatch(f"({separator})([a-z]+ ){{0,2}}", between), (between, user)
            assert {w for w in between.split() if w.strip(".,;")} <= links, (between, user)
        assert len(pairs) > 20


def test_thinking_share_sets_how_many_training_conversations_think_and_the_rest_render_thinking_off():
    """`--thinking-share` (0.6 in the recipe): that share of the training conversations carry a thought in every
    assistant turn; the rest carry none and render each assistant turn after an empty `<think></think>`, as a
    thinking-off request is prompted. The conversations themselves are the same at any share."""
    assert RECIPE.thinking_share == 0.6
    for share in (0.85, 0.6):
        rows = generate(0, 600, "train", thinking_share=share)
        thinking = [r for r in rows if r["thinking"]]
        assert abs(len(thinking) / len(rows) - share) < 0.06, (share, len(thinking))
        for row in rows:
            turns = [m for m in row["messages"] if m["role"] == "assistant"]
            assert all(("reasoning_content" in m) == row["thinking"] for m in turns), row["messages"]
            assert (row["text"].count("<think></think>") == len(turns)) != row["thinking"], row["text"]
    fewer = generate(0, 100, "train", thinking_share=0.6)
    more = generate(0, 100, "train", thinking_share=0.85)
    assert [r["expect"] for r in fewer] == [r["expect"] for r in more]


def test_link_tails_follow_one_task_with_link_words_and_no_second_call():
    """`--link-tail-share` (off in the recipe): a one-task request's task may be followed by a separator and
    link words with no second task; the unseen splits refuse it, and the thought and the call stay one task."""
    import tool_data_pool as pool

    links = set(pool.link_words())
    assert RECIPE.link_tail_share == 0.0
    with pytest.raises(ValueError):
        generate(1, 2, "fresh", link_tail_share=0.25)
    tailed = 0
    for thought, user in _thoughts_and_requests(generate(0, 200, "train", plain_share=0.0, link_tail_share=1.0), 1):
        task = re.match(r"The request is to (.*), so I will call (\w+)\.$", thought)
        assert task and " and to " not in task.group(1), thought
        after = re.match(r"([.,;]? )([a-z]+)( [a-z]+)?[.?]", user.split(task.group(1).lower(), 1)[-1])
        if after and {w for w in after.group(0).strip(".,;? ").split()} <= links:
            tailed += 1
    assert tailed > 60


def test_history_puts_whole_earlier_exchanges_before_the_request_with_ids_counted_across_them():
    """`--history-share` (0.02 in the recipe) and `eval_tool_calls.py --long`: earlier exchanges go before the
    request, their call ids count on across the conversation as kserve rewrites them, every called tool stays
    declared, the evaluated turn is still the one expected, and most prompts run past the 1,024 tokens a
    conversation usually has."""
    from kserve.chat import load_tokenizer, normalize_tool_call_ids

    assert RECIPE.history_share == 0.02 and RECIPE.max_len == 3072
    tokenizer = load_tokenizer(Path(__file__).resolve().parents[1] / "kserve" / "tiny" / "tiny-k26-chat")
    rows = generate(3, 24, "heldout", history_share=1.0)
    lengths = []
    for row in rows:
        messages = row["messages"]
        assert sum(m["role"] == "user" for m in messages) >= 3
        ids = [c["id"] for m in messages for c in m.get("tool_calls", [])]
        assert ids == [f"functions.{c['function']['name']}:{i}"
                       for i, c in enumerate(c for m in messages for c in m.get("tool_calls", []))]
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                assert m["tool_call_id"] in [c["id"] for n in messages[:i] for c in n.get("tool_calls", [])]
        declared = {t["function"]["name"] for t in row["tools"]}
        assert {c["function"]["name"] for m in messages for c in m.get("tool_calls", [])} <= declared
        turn = messages[row["eval_turn"]]
        assert turn["role"] == "assistant" and messages[row["eval_turn"] - 1]["role"] == "user"
        if row["expect"]["kind"] == "tool_calls":
            assert [c["function"]["name"] for c in turn["tool_calls"]] == [c["name"] for c in row["expect"]["calls"]]
        else:
            assert turn["content"] == row["expect"]["content"] and turn is messages[-1]
        prompt = render_prompt(messages[: row["eval_turn"]], row["tools"], add_generation_prompt=True,
                               dialect="k2.6", thinking=row["thinking"])
        lengths.append(len(tokenizer.encode(prompt, allow_special_tokens=True)))
    assert sorted(lengths)[len(lengths) // 2] > 1024 and max(lengths) < 3072, lengths
    # a tool result points at its own call when two exchanges both numbered theirs from 0
    twice = [message for _ in range(2) for message in (
        {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.f:0", "type": "function",
                                                             "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "1"})]
    assert [m.get("tool_call_id") for m in normalize_tool_call_ids(twice)] == [None, "functions.f:0", None, "functions.f:1"]


def test_question_chats_are_training_small_talk_opening_as_tool_questions_do_and_never_calling():
    """`--question-chats` (on in the recipe): small talk asked the way tool questions are ("What's new?"),
    answered with no call; none of it is an unseen split's chat, opener or closer, and the unseen splits refuse it."""
    assert RECIPE.question_chats is True
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", question_chats=True)
    asks = {ask for chats, *_ in PLAIN_QUESTION_CHATS_TRAIN for ask in chats}
    unseen = set()
    for split in ("heldout", "fresh"):
        style = phrasing(split)
        unseen |= {ask.lower() for chats, *_ in style.plain for ask in chats}
        unseen |= {w.strip().lower() for w in style.openers + style.closers} - {""}
    assert not {a.lower() for a in asks} & unseen
    assert not asks & {ask for chats, *_ in PLAIN_CHATS for ask in chats}
    question_openings = {q.split()[0].lower() for questions in QUESTIONS_TRAIN.values() for q in questions}
    assert all({w.lower() for w in ask.split()[:2]} & question_openings for ask in asks)

    def question_rows(rows):
        return [r for r in rows if r["messages"][r["eval_turn"] - 1]["content"] in asks]

    assert not question_rows(generate(0, 400))
    rows = question_rows(generate(0, 400, question_chats=True))
    assert len(rows) >= 4 and any(r["tools"] for r in rows)
    for row in rows:
        turn = row["messages"][row["eval_turn"]]
        assert row["expect"]["kind"] == "text" and not turn.get("tool_calls")
        assert turn["content"] == row["expect"]["content"]
        assert "needs no tool" in turn.get("reasoning_content", "") or not row["thinking"]


def test_question_chat_weight_draws_the_question_chats_that_many_times_as_often():
    """`--question-chat-weight N` lists the question chats N times among the plain chats (1 in the recipe, whose
    data the shipped tokenizer is rebuilt from, above); a weight without the question chats is refused."""
    assert RECIPE.question_chat_weight == 1
    for bad in ({"question_chat_weight": 0, "question_chats": True}, {"question_chat_weight": 2}):
        with pytest.raises(ValueError):
            generate(0, 2, **bad)
    asks = {ask for chats, *_ in PLAIN_QUESTION_CHATS_TRAIN for ask in chats}

    def question_share(weight):
        rows = [r for r in generate(0, 3000, question_chats=True, question_chat_weight=weight)
                if r["expect"]["kind"] == "text"]
        return sum(r["messages"][r["eval_turn"] - 1]["content"] in asks for r in rows) / len(rows)

    once, thrice = question_share(1), question_share(3)
    assert 0.02 < once < 0.15 and 2.2 * once < thrice < 3.5 * once


def test_made_up_cities_replace_pool_cities_in_the_request_and_the_call_and_never_name_a_probe_city():
    """`--made-up-city-share` (0 in the recipe, so the rebuilt tokenizer pins its data): a request's pool city is a
    made-up name, asked for and called with, the same in the thought; no name is a pool city or one of the
    unseen-city probe's, so `--unseen-weather` still measures cities never trained on. Training only."""
    import random

    import tool_data_pool
    from eval_tool_calls import UNSEEN_WEATHER_CITIES
    from tool_data_pool import made_up_city

    assert RECIPE.made_up_city_share == 0.0
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", made_up_city_share=0.5)
    rng = random.Random(0)
    names = {made_up_city(rng) for _ in range(20000)}
    assert len(names) > 5000 and all(name.isalpha() and name.istitle() for name in names)
    assert not names & set(tool_data_pool.CITIES) and not names & set(UNSEEN_WEATHER_CITIES)

    def cities(share):
        found = []
        for row in generate(0, 400, "train", made_up_city_share=share, weather_share=0.1):
            request = row["messages"][row["eval_turn"] - 1]["content"]
            for call in row["messages"][row["eval_turn"]].get("tool_calls") or []:
                city = json.loads(call["function"]["arguments"]).get("city")
                if city:
                    assert city in request and city in row["messages"][row["eval_turn"]].get("reasoning_content", city)
                    found.append(city)
        return found

    assert all(city in tool_data_pool.CITIES for city in cities(0.0))
    half = cities(0.5)
    made_up = [city for city in half if city not in tool_data_pool.CITIES]
    assert len(half) > 40 and 0.3 < len(made_up) / len(half) < 0.7
    assert all(re.fullmatch(r"[BDFGKLMNPRTVZ][aeiou]([bdfgklmnprtvz][aeiou]){1,2}[lnr]?", city) for city in made_up)


def test_world_cities_replace_pool_cities_and_none_is_a_city_the_evaluation_asks_about():
    """`--world-city-share` (0 in the recipe): a request's pool city is a real city outside the pool, asked for,
    thought about and called with; none of WORLD_CITIES is a pool city, one of the unseen-city probe's, or named
    anywhere in the evaluation script, so every evaluation still asks about cities it never trained on."""
    import dataclasses
    import random

    import eval_tool_calls
    import tool_data_pool
    from tool_data_pool import WORLD_CITIES, cities_beyond_pool, phrasing

    assert RECIPE.world_city_share == 0.0
    with pytest.raises(ValueError):
        generate(1, 2, "fresh", world_city_share=0.5)
    evaluation = Path(eval_tool_calls.__file__).read_text()
    assert len(set(WORLD_CITIES)) == len(WORLD_CITIES) > 100
    assert not set(WORLD_CITIES) & (set(tool_data_pool.CITIES) | set(eval_tool_calls.UNSEEN_WEATHER_CITIES))
    assert not [city for city in WORLD_CITIES if city in evaluation]

    style = dataclasses.replace(phrasing("train"), world_city_share=0.5)
    swapped = [cities_beyond_pool(random.Random(n), {"city": "Paris", "days": 3}, style) for n in range(400)]
    assert all(args["days"] == 3 and args["city"] in ("Paris",) + WORLD_CITIES for args in swapped)
    assert 0.4 < sum(args["city"] != "Paris" for args in swapped) / 400 < 0.6

    found = []
    for row in generate(0, 400, "train", world_city_share=0.5, weather_share=0.1):
        request = row["messages"][row["eval_turn"] - 1]["content"]
        for call in row["messages"][row["eval_turn"]].get("tool_calls") or []:
            for value in json.loads(call["function"]["arguments"]).values():
                if value in WORLD_CITIES:
                    assert value in request
                    assert value in row["messages"][row["eval_turn"]].get("reasoning_content", value)
                    found.append(value)
    assert len(set(found)) > 20


def test_world_cities_in_the_weather_questions_leave_every_other_request_alone():
    """`--weather-world-city-share` (0 in the recipe): only the `--weather-share` questions take a real city outside
    the pool, asked for, thought about and called with; every other request keeps its pool city."""
    from tool_data_pool import CITIES, WORLD_CITIES, WEATHER_QUESTIONS_PLAIN_TRAIN, WEATHER_QUESTIONS_TRAIN

    assert RECIPE.weather_world_city_share == 0.0
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", weather_world_city_share=0.5)
    with pytest.raises(ValueError):
        generate(1, 2, "train", weather_world_city_share=0.5)  # no weather questions to put them in
    shapes = [q.split("{city}")[0] for q in WEATHER_QUESTIONS_TRAIN + WEATHER_QUESTIONS_PLAIN_TRAIN]
    world, pool_weather, elsewhere = [], 0, 0
    for row in generate(0, 600, "train", weather_share=0.3, weather_plain=True, weather_world_city_share=0.5):
        request = row["messages"][row["eval_turn"] - 1]["content"]
        calls = row["messages"][row["eval_turn"]].get("tool_calls") or []
        asked_as_question = any(shape and shape in request for shape in shapes)
        for call in calls:
            for value in json.loads(call["function"]["arguments"]).values():
                if value in WORLD_CITIES:
                    assert len(calls) == 1 and call["function"]["name"] == "get_weather" and asked_as_question
                    assert value in request
                    assert value in row["messages"][row["eval_turn"]].get("reasoning_content", value)
                    world.append(value)
                elif value in CITIES and call["function"]["name"] == "get_weather" and asked_as_question:
                    pool_weather += 1
                elif value in CITIES:
                    elsewhere += 1
    assert len(set(world)) > 20 and pool_weather > 20 and elsewhere > 20
    assert 0.35 < len(world) / (len(world) + pool_weather) < 0.65


def test_chat_probe_holds_plain_chats_no_split_or_noise_has_each_with_tools_declared():
    """`eval_tool_calls.py --chats`: 40 plain chats found in no training, `heldout` or `fresh` phrasing (chats,
    openers, closers, wrappers, questions), each alone with 1 to 4 tools declared and no call expected."""
    import tool_data_pool as pool
    from gen_tool_data import probe_chats

    said = set()

    def walk(value):
        if isinstance(value, str):
            said.add(value.strip().lower())
        elif isinstance(value, (tuple, list, dict)):
            for item in value.values() if isinstance(value, dict) else value:
                walk(item)

    for name in dir(pool):
        if name.isupper() and name != "PLAIN_CHATS_PROBE":
            walk(getattr(pool, name))
    rows = probe_chats(1)
    assert len(rows) == len(set(pool.PLAIN_CHATS_PROBE)) == 40
    assert not {c.lower() for c in pool.PLAIN_CHATS_PROBE} & said
    train_users = {m["content"] for r in generate(0, 2000, question_chats=True) for m in r["messages"]
                   if m["role"] == "user"}
    assert not set(pool.PLAIN_CHATS_PROBE) & train_users
    for row in rows:
        assert [m["role"] for m in row["messages"]] == ["user"] and row["eval_turn"] == 1
        assert 1 <= len(row["tools"]) <= 4 and row["expect"]["kind"] == "text"
    assert probe_chats(1) == rows and probe_chats(2) != rows


def test_weather_probe_asks_for_training_cities_weather_with_only_get_weather_declared():
    """`eval_tool_calls.py --weather`: six weather questions, each naming a training city, with `get_weather`
    alone declared, each expecting exactly one call with that city; the first is the README's question."""
    from eval_tool_calls import WEATHER_PROBE, weather_rows
    from tool_data_pool import CITIES

    rows = weather_rows()
    assert len({text for text, _ in WEATHER_PROBE}) == len(rows) == 6
    assert WEATHER_PROBE[0][0] == "What's the weather like in Paris today?"
    for (text, city), row in zip(WEATHER_PROBE, rows):
        assert city in CITIES and f" {city}" in text and "weather" in text
        assert row["messages"] == [{"role": "user", "content": text}] and row["eval_turn"] == 1
        assert [t["function"]["name"] for t in row["tools"]] == ["get_weather"]
        assert row["tools"][0]["function"]["parameters"]["required"] == ["city"]
        assert row["expect"] == {"kind": "tool_calls", "calls": [{"name": "get_weather", "arguments": {"city": city}}]}


def test_unseen_weather_probe_asks_about_cities_no_split_or_training_conversation_names():
    """`eval_tool_calls.py --unseen-weather`: 24 plain weather questions about six cities outside the training
    pool, `get_weather` alone declared. No pool of the data generator names them, so no conversation of any
    split or training option can."""
    import gen_tool_data
    import tool_data_pool
    from eval_tool_calls import UNSEEN_WEATHER_CITIES, UNSEEN_WEATHER_PROBE, weather_rows

    rows = weather_rows(UNSEEN_WEATHER_PROBE)
    assert len({text for text, _ in UNSEEN_WEATHER_PROBE}) == len(rows) == 24
    assert not set(UNSEEN_WEATHER_CITIES) & set(tool_data_pool.CITIES)
    sources = "".join(Path(m.__file__).read_text() for m in (gen_tool_data, tool_data_pool)).lower()
    assert "paris" in sources and not [city for city in UNSEEN_WEATHER_CITIES if city.lower() in sources]
    for (text, city), row in zip(UNSEEN_WEATHER_PROBE, rows):
        assert city in text and "weather" in text
        assert [t["function"]["name"] for t in row["tools"]] == ["get_weather"]
        assert row["expect"]["calls"] == [{"name": "get_weather", "arguments": {"city": city}}]


def test_weather_share_asks_for_the_weather_as_users_first_do_in_training_only():
    """`--weather-share` (0.01 in the recipe): that share of the training conversations asks for one `get_weather`
    call with a WEATHER_QUESTIONS_TRAIN question, the city copied; no unseen split holds those questions."""
    from tool_data_pool import CITIES, WEATHER_QUESTIONS_TRAIN

    assert RECIPE.weather_share == 0.01
    with pytest.raises(ValueError):
        generate(1, 2, "fresh", weather_share=0.5)
    asked = {q.format(city=c): c for q in WEATHER_QUESTIONS_TRAIN for c in CITIES}

    def weather_rows(rows):
        return [r for r in rows if any(r["messages"][r["eval_turn"] - 1]["content"].endswith(ask) or
                                       f"{ask} " in r["messages"][r["eval_turn"] - 1]["content"] for ask in asked)]

    for split in ("heldout", "fresh"):
        assert not weather_rows(generate(1, 300, split))
    rows = weather_rows(generate(0, 300, weather_share=0.2))
    assert len(rows) >= 40
    for row in rows:
        ask = next(a for a in asked if a in row["messages"][row["eval_turn"] - 1]["content"])
        assert [call["name"] for call in row["expect"]["calls"]] == ["get_weather"]
        assert row["expect"]["calls"][0]["arguments"]["city"] == asked[ask]
        turn = row["messages"][row["eval_turn"]]
        assert [c["function"]["name"] for c in turn["tool_calls"]] == ["get_weather"]
        assert not row["thinking"] or f"weather in {asked[ask]}" in turn["reasoning_content"]


def test_weather_plain_adds_the_plainest_weather_questions_in_training_only():
    """`--weather-plain` (on in the recipe): the `--weather-share` questions include "What is the weather in
    {city}?" and its kin, each with a `get_weather` call for the city; without it they come only as the rare tool
    questions of QUESTIONS_TRAIN, and no unseen split asks "What is the weather in {city}?"."""
    from tool_data_pool import CITIES, WEATHER_QUESTIONS_PLAIN_TRAIN

    assert RECIPE.weather_plain is True
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", weather_plain=True)
    plain = {q.format(city=c): c for q in WEATHER_QUESTIONS_PLAIN_TRAIN for c in CITIES}

    def asked(rows):
        return [(r, next(a for a in plain if a in r["messages"][r["eval_turn"] - 1]["content"])) for r in rows
                if any(a in r["messages"][r["eval_turn"] - 1]["content"] for a in plain)]

    share = dict(weather_share=0.3, plain_share=0.0)
    before = len(asked(generate(0, 300, **share)))
    rows = asked(generate(0, 300, weather_plain=True, **share))
    assert len(rows) >= 20 and len(rows) > 2 * before
    for row, ask in rows:
        assert [call["name"] for call in row["expect"]["calls"]] == ["get_weather"]
        assert row["expect"]["calls"][0]["arguments"]["city"] == plain[ask]
    plainest = {WEATHER_QUESTIONS_PLAIN_TRAIN[0].format(city=c) for c in CITIES}
    for split in ("heldout", "fresh"):
        assert not [r for r in generate(1, 300, split)
                    if any(q in r["messages"][r["eval_turn"] - 1]["content"] for q in plainest)]


def test_thanks_closers_end_training_requests_with_the_chats_that_thank_and_still_call():
    """`--thanks-closer-share` (0.1 in the recipe): a training request may end in a plain chat that thanks
    ("Appreciate it."), which alone gets "You're welcome!"; the request still gets its calls. The chats are
    training's own, none an unseen split's closer or chat."""
    assert RECIPE.thanks_closer_share == 0.1
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", thanks_closer_share=0.5)
    thanks = {ask for asks, _, topic in PLAIN_CHATS if topic == "thanks me" for ask in asks}
    assert len(thanks) >= 10
    for split in ("heldout", "fresh"):
        style = phrasing(split)
        assert not {c.strip() for c in style.closers} & thanks
        assert not {ask for asks, *_ in style.plain for ask in asks} & thanks
    closers = {c.strip() for c in phrasing("train").closers}

    def thanked(rows):
        return [r for r in rows if r["expect"]["kind"] == "tool_calls" and any(
            r["messages"][r["eval_turn"] - 1]["content"].endswith(" " + t) for t in thanks - closers)]

    assert not thanked(generate(0, 300))
    rows = thanked(generate(0, 300, thanks_closer_share=0.5))
    assert len(rows) >= 40
    for row in rows:
        turn = row["messages"][row["eval_turn"]]
        assert [c["function"]["name"] for c in turn["tool_calls"]] == [c["name"] for c in row["expect"]["calls"]]


def test_help_me_to_keeps_help_me_from_opening_a_task_in_training_only():
    """`--help-me-to` (on in the recipe): the training wrapper "Help me {intent}." becomes "Help me to
    {intent}.", so no training request has "Help me" straight before a task, as the held-out "Help me out and"
    does; the thoughts and calls are those without it."""
    assert RECIPE.help_me_to is True
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", help_me_to=True)

    def help_me(rows, pattern):
        return [r for r in rows if re.search(pattern, r["messages"][r["eval_turn"] - 1]["content"] or "")]

    plain, changed = generate(0, 2000, plain_share=0.0), generate(0, 2000, plain_share=0.0, help_me_to=True)
    assert help_me(plain, r"\bHelp me (?!to )") and not help_me(plain, r"\bHelp me to ")
    assert not help_me(changed, r"\bHelp me (?!to )")
    assert len(help_me(changed, r"\bHelp me to ")) == len(help_me(plain, r"\bHelp me "))
    for before, after in zip(plain, changed):
        assert before["expect"] == after["expect"]
        assert before["messages"][before["eval_turn"]] == after["messages"][after["eval_turn"]]


def test_composed_chats_are_training_small_talk_in_no_unseen_chats_words_and_never_call():
    """`--composed-chats` (on in the recipe): greetings, thanks and goodbyes composed from parts join the plain
    chats; no composed chat is an unseen split's or the probe's chat, and no part brings in a word of theirs that
    the listed training chats lack, so `--chats` still measures unseen small talk."""
    from tool_data_pool import PLAIN_CHATS_FRESH, PLAIN_CHATS_HELDOUT, PLAIN_CHATS_PROBE, composed_small_talk

    def words(texts):
        return {w.lower() for t in texts for w in re.findall(r"[A-Za-z']+", t)}

    assert RECIPE.composed_chats is True
    with pytest.raises(ValueError):
        generate(1, 2, "fresh", composed_chats=True)
    composed = {ask: (answer, topic) for asks, answer, topic in composed_small_talk() for ask in asks}
    listed = [ask for chats in (PLAIN_CHATS, PLAIN_QUESTION_CHATS_TRAIN) for asks, *_ in chats for ask in asks]
    unseen = list(PLAIN_CHATS_PROBE) + [ask for chats in (PLAIN_CHATS_HELDOUT, PLAIN_CHATS_FRESH)
                                        for asks, *_ in chats for ask in asks]
    frames = [f.strip() for split in ("heldout", "fresh") for f in phrasing(split).openers + phrasing(split).closers]
    assert len(composed) > 2000
    assert not (words(composed) - words(listed)) & words(unseen)
    assert not {w.lower().strip(" .!?") for w in composed} & {w.lower().strip(" .!?") for w in unseen + frames}
    assert "Hey pal, quick hello." in composed and composed["Thanks again. That helps."][1] == "thanks me"

    def composed_only(rows):
        return [r for r in rows if r["expect"]["kind"] == "text"
                and r["messages"][r["eval_turn"] - 1]["content"] in set(composed) - set(listed)]

    assert not composed_only(generate(0, 300, plain_share=1.0))
    rows = composed_only(generate(0, 300, plain_share=1.0, composed_chats=True))
    assert len(rows) >= 20
    for row in rows:
        answer, topic = composed[row["messages"][row["eval_turn"] - 1]["content"]]
        turn = row["messages"][row["eval_turn"]]
        assert row["expect"] == {"kind": "text", "content": answer} and not turn.get("tool_calls")
        assert not row["thinking"] or f"The user {topic}," in turn["reasoning_content"]


def test_unserved_requests_frame_chores_no_tool_does_as_tool_requests_are_and_never_call():
    """`--unserved-requests` (on in the recipe): chores no tool does, in the training wrappers as the recipe
    frames tool requests ("Help me to ..." under `--help-me-to`), join the plain chats and get a plain refusal,
    so a tool request's frame alone never means a call; no chore is asked by a tool request."""
    from tool_data_pool import UNSERVED_TASKS_TRAIN, unserved_chores

    assert RECIPE.unserved_requests is True
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", unserved_requests=True)
    (asks, answer, topic), = unserved_chores(WRAPPERS_TRAIN)
    assert len(asks) == len(set(WRAPPERS_TRAIN)) * len(UNSERVED_TASKS_TRAIN)
    assert "Please mow the lawn." in asks and "Kindly mow the lawn." not in asks

    def asked(rows):
        return [r for r in rows if r["messages"][r["eval_turn"] - 1]["content"] in chores]

    chores = set(unserved_chores(tuple(w.replace("Help me {", "Help me to {") for w in WRAPPERS_TRAIN))[0][0])
    assert "Help me to fix my bike." in chores and "Help me fix my bike." not in chores
    assert not asked(generate(0, 400, plain_share=1.0, help_me_to=True))
    rows = asked(generate(0, 400, plain_share=1.0, help_me_to=True, unserved_requests=True))
    assert len(rows) >= 8
    for row in rows:
        turn = row["messages"][row["eval_turn"]]
        assert row["expect"] == {"kind": "text", "content": answer} and not turn.get("tool_calls")
        assert not row["thinking"] or f"The user {topic}," in turn["reasoning_content"]
    requests = [r["messages"][r["eval_turn"] - 1]["content"] for r in generate(0, 2000, plain_share=0.0)]
    assert not [q for q in requests if any(task in q for task in UNSERVED_TASKS_TRAIN)]


def test_chores_beside_weather_declare_get_weather_with_every_chore_and_leave_other_chats_alone():
    """`--chores-beside-weather` (on in the recipe): every chore of `--unserved-requests` declares `get_weather`,
    alone or among up to eight tools, and is still refused; the other plain chats declare tools as before."""
    from tool_data_pool import unserved_chores

    assert RECIPE.chores_beside_weather is True
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", chores_beside_weather=True)
    with pytest.raises(ValueError):
        generate(1, 2, chores_beside_weather=True)
    (asks, answer, _), = unserved_chores(WRAPPERS_TRAIN)
    chores = set(asks)
    rows = generate(0, 600, plain_share=1.0, unserved_requests=True, chores_beside_weather=True, agent_share=0.3)
    chore_rows = [r for r in rows if r["messages"][r["eval_turn"] - 1]["content"] in chores]
    others = [r for r in rows if r not in chore_rows]
    assert len(chore_rows) >= 8 and len(others) >= 300

    def names(row):
        return [t["function"]["name"] for t in row["tools"]]

    for row in chore_rows:
        assert "get_weather" in names(row) and 1 <= len(row["tools"]) <= 8
        assert row["expect"] == {"kind": "text", "content": answer}
        assert not row["messages"][row["eval_turn"]].get("tool_calls")
    assert {len(r["tools"]) for r in chore_rows} > {1}  # not always alone
    assert sum("get_weather" in names(r) for r in others) < 0.3 * len(others)
    assert sum(not r["tools"] for r in others) > 0.2 * len(others)


def test_chore_probe_asks_unseen_chores_bare_and_in_unseen_wrappers_with_only_get_weather_declared():
    """`eval_tool_calls.py --chores`: 24 requests for chores no tool does, each of 12 chores bare and in one
    wrapper of an unseen split, `get_weather` alone declared, answered without a call; no chore is one of
    training's `--unserved-requests` chores."""
    from eval_tool_calls import CHORE_PROBE_TASKS, chore_rows
    from tool_data_pool import UNSERVED_TASKS_TRAIN, WRAPPERS_FRESH

    rows = chore_rows()
    asks = [row["messages"][0]["content"] for row in rows]
    assert len(set(asks)) == len(rows) == 24 and "Fill in the form." in asks
    assert not {task for task in CHORE_PROBE_TASKS for trained in UNSERVED_TASKS_TRAIN if task in trained}
    for row in rows:
        assert [t["function"]["name"] for t in row["tools"]] == ["get_weather"]
        assert row["expect"] == {"kind": "text", "content": None}
    assert asks[0::2] == [f"{task[0].upper()}{task[1:]}." for task in CHORE_PROBE_TASKS]
    wrapped = asks[1::2]
    frames = WRAPPERS_HELDOUT + WRAPPERS_FRESH
    assert all(any(ask == f.format(intent=task) for f in frames) for ask, task in zip(wrapped, CHORE_PROBE_TASKS))
    assert not set(frames) & set(WRAPPERS_TRAIN)


def test_joiner_probe_requests_hold_both_tasks_around_the_joiner_and_declare_their_two_tools():
    """`eval_tool_calls.py --joiners`: each bare request is the first task, the joiner's words, the second task,
    and expects the two calls in that order with only their two tools declared."""
    from eval_tool_calls import JOINER_PROBE
    from gen_tool_data import two_task_requests

    tools = {t.name: t for t in build_tools()}
    for joiner in JOINER_PROBE:
        rows = two_task_requests(1, 12, joiner)
        assert len({r["messages"][0]["content"] for r in rows}) == 12
        _, _, tail = joiner.partition("{a}")
        middle = tail.split("{")[0]
        for row in rows:
            text = row["messages"][0]["content"]
            calls = row["expect"]["calls"]
            assert len(calls) == 2 and calls[0]["name"] != calls[1]["name"]
            assert [t["function"]["name"] for t in row["tools"]] == [c["name"] for c in calls]
            assert middle in text and text.endswith(".") and row["eval_turn"] == 1
            first, second = text[: text.index(middle)], text[text.index(middle) + len(middle):]
            for part, call in ((first, calls[0]), (second, calls[1])):
                assert any(fill(i, call["arguments"]).lower() in part.lower() for i in tools[call["name"]].intents), (
                    part, call)


def test_composed_closers_end_requests_with_composed_sign_offs_that_no_unseen_split_holds():
    """`--composed-closers` (off in the recipe): a request's thanks closer may be a composed thanks or goodbye
    ("Bye pal, off I go."); the request still gets its calls only, and no sign-off is an unseen split's closer
    or chat, so `heldout`'s " Much obliged." stays unseen."""
    from tool_data_pool import CLOSERS_FRESH, PLAIN_CHATS_FRESH, PLAIN_CHATS_HELDOUT, PLAIN_CHATS_PROBE, \
        composed_sign_offs

    assert RECIPE.composed_closers is False
    with pytest.raises(ValueError):
        generate(1, 2, "heldout", composed_closers=True)
    with pytest.raises(ValueError):
        generate(1, 2, composed_closers=True)
    sign_offs = composed_sign_offs()
    unseen = {c.strip() for c in CLOSERS_HELDOUT + CLOSERS_FRESH} | {
        ask for asks, *_ in PLAIN_CHATS_HELDOUT + PLAIN_CHATS_FRESH + PLAIN_CHATS_PROBE for ask in asks}
    assert len(sign_offs) > 500 and not unseen & set(sign_offs)
    listed = {ask for asks, _, topic in PLAIN_CHATS if topic == "thanks me" for ask in asks}
    new = tuple(s for s in sign_offs if s not in listed and " " + s not in CLOSERS_TRAIN)

    def closed(rows):
        return [r for r in rows if r["messages"][r["eval_turn"] - 1]["content"].endswith(tuple(" " + s for s in new))]

    rows = generate(0, 400, plain_share=0.0, thanks_closer_share=1.0, composed_closers=True)
    assert len(closed(rows)) > 0.5 * len(rows)
    for row in closed(rows):
        assert row["expect"]["kind"] == "tool_calls" and 1 <= len(row["expect"]["calls"]) <= 2
    assert not closed(generate(0, 400, plain_share=0.0, thanks_closer_share=1.0))
