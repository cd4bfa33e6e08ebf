"""Synthetic multi-turn tool-use conversations in Kimi K2.6's chat format, deterministic by seed.

    python scripts/gen_tool_data.py --seed 0 --count 20000 --split train --out data/train.jsonl
    python scripts/gen_tool_data.py --seed 1 --count 500 --split heldout --out data/heldout.jsonl

Each line holds one conversation: `messages` and `tools` (OpenAI shapes; every assistant turn carries a
one-sentence `reasoning_content`), `thinking` (most conversations think; the rest are rendered with
thinking off), `text` (the prompt kserve's K2.6 renderer writes for the last assistant turn, followed by
that turn), `spans` (the character ranges of the assistant turns that text shows as the model writes them:
reasoning after the `<think>` prefill, then the answer or the tool calls), and `expect`:
what the final assistant turn must do (`{"kind": "tool_calls", "calls": [{"name", "arguments"}]}` or
`{"kind": "text"}`), which the evaluation checks against a model's answer to `messages[:-1]` cut at the
turn under test (`prompt_messages`).

`--split heldout` draws from phrasings (wrappers, joiners, openers, closers, plain chats, agent system
prompts) never used for training; use another seed as well. `--split fresh` is a second such set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tool_data_pool import (ECHO_WRAPPERS_TRAIN, PLAIN_CHATS_PROBE, PLAIN_QUESTION_CHATS_TRAIN, SYSTEM_PROMPTS,
                            UNSERVED_CHORE_TOPIC, WEATHER_QUESTIONS_PLAIN_TRAIN, WEATHER_QUESTIONS_TRAIN, Phrasing,
                            Tool, add_link_tail, add_noise, add_tail, build_tools, cities_beyond_pool,
                            composed_sign_offs, composed_small_talk, echo_vocabulary, link_joiner, link_words,
                            noise_vocabulary, phrasing, tail_words, unserved_chores)

from kserve.chat import normalize_tool_call_ids, render_prompt

DIALECT = "k2.6"

_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z_0-9.]*)\}")


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " and ".join(_value_text(v) for v in value)
    return str(value)


def fill(template: str, args: dict[str, Any], result: dict[str, Any] | None = None) -> str:
    """Substitute {arg}, {obj.key}, {arg_list} (an array in words), {on_word} and {r_field} (a result field)."""

    def lookup(name: str) -> str:
        if name.startswith("r_") and result is not None:
            return _value_text(result[name[2:]])
        if name == "on_word":
            return _value_text(args["on"])
        if name.endswith("_list"):
            return _value_text(args[name[: -len("_list")]])
        value: Any = args
        for part in name.split("."):
            value = value[part]
        return _value_text(value)

    return _FIELD.sub(lambda m: lookup(m.group(1)), template)


def _mention_optional(tool: Tool, args: dict[str, Any]) -> str:
    """Words that name optional arguments the user chose, so every argument comes from the conversation."""
    required = set(tool.parameters.get("required", []))
    extras = []
    for key, value in args.items():
        if key in required:
            continue
        words = key.replace("_", " ")
        extras.append(f"{words} {_value_text(value)}" if not isinstance(value, bool) else f"with {words}")
    return f" Use {', '.join(extras)}." if extras else ""


def _ask(rng: random.Random, tool: Tool, args: dict[str, Any]) -> str:
    return fill(rng.choice(tool.intents), args)


def _wrap(rng: random.Random, intent: str, style: Phrasing) -> str:
    wrapper = add_noise(rng, rng.choice(style.wrappers), style)
    request = wrapper.replace("{Intent}", intent[:1].upper() + intent[1:]).replace("{intent}", intent)
    opener = rng.choice(style.openers)
    opener = add_noise(rng, opener, style) if opener else opener
    return f"{opener} {request}" if opener else request


def _call(tool: Tool, args: dict[str, Any], index: int) -> dict[str, Any]:
    return {"id": f"functions.{tool.name}:{index}", "type": "function",
            "function": {"name": tool.name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _assistant(reasoning: str, content: str, thinking: bool, **extra: Any) -> dict[str, Any]:
    """An assistant message; its one-sentence reasoning only where the conversation thinks."""
    message: dict[str, Any] = {"role": "assistant", "content": content, **extra}
    if thinking:
        message["reasoning_content"] = reasoning
    return message


def _declared(rng: random.Random, pool: list[Tool], must: list[Tool], agent: bool) -> list[Tool]:
    others = [t for t in pool if t not in must]
    chosen = must + rng.sample(others, rng.randint(3, 7) if agent else rng.randint(0, 3))
    rng.shuffle(chosen)
    return chosen


def _agent_prompt(rng: random.Random, style: Phrasing) -> str:
    """A long agent system prompt: a persona and 8 to 16 rules, a few hundred tokens."""
    rules = rng.sample(style.rules, min(len(style.rules), rng.randint(8, 16)))
    return rng.choice(style.personas) + "\n\n# Rules\n" + "\n".join(f"- {r}" for r in rules)


def _prefix(rng: random.Random, style: Phrasing, agent: bool) -> list[dict[str, Any]]:
    if agent:
        return [{"role": "system", "content": _agent_prompt(rng, style)}]
    if rng.random() < 0.5:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    return []


def tool_conversation(rng: random.Random, pool: list[Tool], style: Phrasing, thinking: bool,
                      agent: bool, only: Tool | None = None) -> dict[str, Any]:
    """A user asks for one or two tool uses; the assistant thinks one sentence, calls, reads the results, answers.
    With `only`, one use of that tool, asked as one of its questions."""
    n_calls = 1 if only else 2 if rng.random() < 0.2 else 1
    used = [only] if only else rng.sample(pool, n_calls)
    args = [cities_beyond_pool(rng, t.draw(rng), style) for t in used]
    intents = [_ask(rng, t, a) for t, a in zip(used, args)]
    if n_calls == 1:
        intent = add_link_tail(rng, add_tail(rng, intents[0], style), style)
    elif style.link_share and rng.random() < style.link_share:
        intent = link_joiner(rng, style).format(a=intents[0], b=intents[1], B=intents[1][:1].upper() + intents[1][1:])
    else:
        intent = add_noise(rng, rng.choice(style.joiners), style).format(a=intents[0], b=intents[1])
    request = _wrap(rng, intent, style)
    if n_calls == 1 and used[0].name in style.questions and (only or rng.random() < 0.3):
        opener = rng.choice(style.openers)
        question = fill(rng.choice(style.questions[used[0].name]), args[0])
        request = f"{opener} {question}" if opener else question
        intents = [fill(used[0].intents[0], args[0])]  # the thought restates it as a task
    closer = rng.choice(style.closers)
    if style.thanks_share and rng.random() < style.thanks_share:
        closer = " " + rng.choice(style.thanks)  # alone it gets "You're welcome!"; after a request, the call
    closer = " " + add_noise(rng, closer.lstrip(), style) if closer else closer
    user = request + "".join(_mention_optional(t, a) for t, a in zip(used, args)) + closer
    if style.context and rng.random() < 0.3:
        user = " ".join(rng.sample(style.context, rng.randint(1, 3))) + " " + user
    messages = _prefix(rng, style, agent)
    if rng.random() < 0.15:  # an earlier small-talk exchange
        greet, answer, topic = rng.choice(style.plain)
        ask = rng.choice(greet)
        messages += [{"role": "user", "content": ask},
                     _assistant(_plain_reasoning(topic), answer, thinking)]
    messages.append({"role": "user", "content": user})
    calls = [_call(t, a, i) for i, (t, a) in enumerate(zip(used, args))]
    names = " and then ".join(t.name for t in used)
    wants = " and to ".join(intents)
    messages.append(_assistant(f"The request is to {wants}, so I will call {names}.", "", thinking,
                               tool_calls=calls))
    results = [t.result(rng, a) for t, a in zip(used, args)]
    # the template heads a result with its `name`, else with "tool": OpenAI clients send no name, so the answer's
    # thought must read the tool from the call id in "## Return of functions.get_weather:0"
    named = style.named_results >= 1.0 or rng.random() < style.named_results
    for call, tool, result in zip(calls, used, results):
        messages.append({"role": "tool", "tool_call_id": call["id"], **({"name": tool.name} if named else {}),
                         "content": json.dumps(result, ensure_ascii=False)})
    answer = " ".join(fill(t.answer, a, r) for t, a, r in zip(used, args, results))
    got = " and ".join(t.name for t in used)
    messages.append(_assistant(f"I have the result of {got}, so I will answer.", answer, thinking))
    expect = {"kind": "tool_calls", "calls": [{"name": t.name, "arguments": a} for t, a in zip(used, args)]}
    # evaluation asks the first assistant turn after the user's request
    turn = len(messages) - 2 - len(used)
    return {"messages": messages, "tools": [t.schema() for t in _declared(rng, pool, used, agent)],
            "expect": expect, "eval_turn": turn}


def add_history(rng: random.Random, pool: list[Tool], style: Phrasing, convo: dict[str, Any], thinking: bool,
                plain_share: float) -> dict[str, Any]:
    """`convo` after earlier exchanges (each a whole tool or plain conversation of the same phrasing, about
    900 to 3,000 tokens in all), the way an agent's history runs long before its next request. Tool-call ids
    count across the conversation as kserve rewrites them (`functions.{name}:{idx}`), and the tools used
    earlier stay declared."""
    budget = rng.randint(3000, 10000)  # characters of history, about 3.3 per token
    history: list[dict[str, Any]] = []
    used: dict[str, dict[str, Any]] = {}
    while len(json.dumps(history, ensure_ascii=False)) < budget:
        make = plain_conversation if rng.random() < plain_share else tool_conversation
        earlier = make(rng, pool, style, thinking, agent=False)
        history += [m for m in earlier["messages"] if m["role"] != "system"]
        for m in earlier["messages"]:
            for call in m.get("tool_calls", []):
                name = call["function"]["name"]
                used[name] = next(t.schema() for t in pool if t.name == name)
    head = [m for m in convo["messages"][:1] if m["role"] == "system"]
    messages = normalize_tool_call_ids(head + history + convo["messages"][len(head):])
    declared = {t["function"]["name"]: t for t in convo["tools"]}
    tools = list(declared.values()) + [t for name, t in used.items() if name not in declared]
    rng.shuffle(tools)
    return {**convo, "messages": messages, "tools": tools, "eval_turn": convo["eval_turn"] + len(history)}


def probe_chats(seed: int) -> list[dict[str, Any]]:
    """PLAIN_CHATS_PROBE's unseen plain chats, each alone with 1 to 4 tools declared: a probe of how often
    small talk no split holds is read as a request. Rows are `generate`'s shape; no answer is expected
    word for word (`content` None)."""
    rng = random.Random(f"chats:{seed}")
    pool = build_tools()
    return [{"messages": [{"role": "user", "content": chat}], "eval_turn": 1,
             "tools": [t.schema() for t in rng.sample(pool, rng.randint(1, 4))],
             "expect": {"kind": "text", "content": None}} for chat in PLAIN_CHATS_PROBE]


def two_task_requests(seed: int, count: int, joiner: str) -> list[dict[str, Any]]:
    """`count` bare two-task requests joined by `joiner` ("{a} as well as {b}"; "{B}" for the second task
    capitalized), no opener, wrapper or closer, the two tools declared: a probe of what the model reads a second
    task from. Rows are `generate`'s shape, cut at the request."""
    rng = random.Random(f"joiners:{seed}")
    pool = build_tools()
    rows = []
    for _ in range(count):
        used = rng.sample(pool, 2)
        args = [t.draw(rng) for t in used]
        a, b = (_ask(rng, t, x) for t, x in zip(used, args))
        text = joiner.format(a=a[:1].upper() + a[1:], b=b, B=b[:1].upper() + b[1:]) + "."
        rows.append({"messages": [{"role": "user", "content": text}], "tools": [t.schema() for t in used],
                     "expect": {"kind": "tool_calls",
                                "calls": [{"name": t.name, "arguments": x} for t, x in zip(used, args)]},
                     "eval_turn": 1})
    return rows


def _plain_reasoning(topic: str) -> str:
    """Names what the user does ("greets me") instead of quoting the message: a model that copies well would
    otherwise repeat a long message word for word before it answers."""
    return f"The user {topic}, which needs no tool, so I will reply directly."


def plain_conversation(rng: random.Random, pool: list[Tool], style: Phrasing, thinking: bool,
                       agent: bool) -> dict[str, Any]:
    """A chat that needs no tool, with or without tools declared."""
    greet, answer, topic = rng.choice(style.plain)
    ask = add_noise(rng, add_noise(rng, rng.choice(greet), style), style)  # one part only: two chances
    messages = _prefix(rng, style, agent) + [{"role": "user", "content": ask},
                                             _assistant(_plain_reasoning(topic), answer, thinking)]
    beside = next((t for t in pool if t.name == style.declared_beside.get(topic)), None)
    if beside is not None:  # always declared, among as many tools as any plain chat may declare
        others = [t for t in pool if t is not beside]
        chosen = [beside] + rng.sample(others, rng.randint(3, 7) if agent else rng.randint(0, 3))
        rng.shuffle(chosen)
        tools = [t.schema() for t in chosen]
    else:
        declare = agent or rng.random() < 0.5
        tools = ([t.schema() for t in rng.sample(pool, rng.randint(4, 8) if agent else rng.randint(1, 4))]
                 if declare else [])
    return {"messages": messages, "tools": tools, "expect": {"kind": "text", "content": answer},
            "eval_turn": len(messages) - 1}


def echo_conversation(rng: random.Random, pool: list[Tool], style: Phrasing, thinking: bool,
                      agent: bool) -> dict[str, Any]:
    """A request to repeat random words and numbers (training only): the thought quotes the request and the
    answer copies the words, which no pool predicts."""
    vocabulary = echo_vocabulary()
    words = [str(rng.randint(0, 9999)) if rng.random() < 0.15 else rng.choice(vocabulary)
             for _ in range(rng.randint(2, 8))]
    text = " ".join(words)
    opener = rng.choice(style.openers)
    ask = rng.choice(ECHO_WRAPPERS_TRAIN).format(text=text)
    ask = f"{opener} {ask}" if opener else ask
    messages = _prefix(rng, style, agent) + [{"role": "user", "content": ask},
                                             _assistant(f"The user says \"{ask}\", so I will repeat it.", text, thinking)]
    tools = [t.schema() for t in rng.sample(pool, rng.randint(1, 4))] if rng.random() < 0.5 else []
    return {"messages": messages, "tools": tools, "expect": {"kind": "text", "content": text},
            "eval_turn": len(messages) - 1}


def _render(messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation: bool, thinking: bool,
            preserve: bool = False) -> str:
    return render_prompt(messages, tools or None, add_generation_prompt=generation, dialect=DIALECT,
                         thinking=thinking, preserve_thinking=True if preserve else None)


def _turn_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]], i: int, thinking: bool) -> str:
    """Assistant message i as the model writes it after the generation prompt: reasoning (when thinking),
    `</think>`, the answer or the tool calls, `<|im_end|>`."""
    whole = _render(messages[: i + 1], tools, False, thinking, preserve=thinking)
    prompt = _render(messages[:i], tools, True, thinking, preserve=thinking)
    if not whole.startswith(prompt):
        raise AssertionError("rendering is not prefix-stable; spans would be wrong")
    return whole[len(prompt):]


def assistant_spans(messages: list[dict[str, Any]], tools: list[dict[str, Any]], thinking: bool
                    ) -> tuple[str, list[list[int]]]:
    """The server's prompt for the last assistant turn followed by that turn, and the [start, end) character
    ranges of the assistant turns it shows as the model writes them. History turns whose reasoning the
    K2.6 format drops (a small-talk answer before the request) are context, not spans."""
    last = len(messages) - 1
    text = _render(messages[:last], tools, True, thinking) + _turn_text(messages, tools, last, thinking)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(messages[:i], tools, True, thinking)
        turn = _turn_text(messages, tools, i, thinking)
        if text.startswith(prompt + turn):
            spans.append([len(prompt), len(prompt) + len(turn)])
    return text, spans


def generate(seed: int, count: int, split: str = "train", plain_share: float = 0.3, thinking_share: float = 0.85,
             agent_share: float = 0.2, echo_share: float = 0.0, noise_share: float = 0.0,
             tail_share: float = 0.0, history_share: float = 0.0, link_share: float = 0.0,
             link_tail_share: float = 0.0, link_inline: bool = False,
             question_chats: bool = False, question_chat_weight: int = 1, weather_share: float = 0.0,
             thanks_closer_share: float = 0.0, help_me_to: bool = False,
             composed_chats: bool = False, weather_plain: bool = False,
             unserved_requests: bool = False, chores_beside_weather: bool = False,
             composed_closers: bool = False, made_up_city_share: float = 0.0,
             world_city_share: float = 0.0, weather_world_city_share: float = 0.0) -> list[dict]:
    """`echo_share` of the conversations (training only) are echo requests; the rest split as before. With
    `noise_share` (training only), each literal part of a request gets noise words with that probability; with
    `tail_share` (training only), a one-task request's task is followed by a joiner word with that probability;
    with `link_share` (training only), a two-task request's tasks are joined by noise words alone (`link_joiner`),
    and with `link_tail_share` a one-task request's task is followed by them (`add_link_tail`); with
    `link_inline`, link words stand only inside a sentence; with `question_chats` (training only), the plain
    chats include small talk asked as tool questions are (`PLAIN_QUESTION_CHATS_TRAIN`, listed
    `question_chat_weight` times); `weather_share` of the
    conversations (training only) ask for `get_weather` with one of WEATHER_QUESTIONS_TRAIN; with
    `thanks_closer_share` (training only), a tool request's closer is a plain chat that thanks ("Appreciate it.");
    with `help_me_to` (training only), the wrapper "Help me {intent}." is "Help me to {intent}."; with
    `composed_chats` (training only), greetings, thanks and goodbyes composed from parts join the plain chats
    as three more entries (`composed_small_talk`), so those topics are drawn more often; with `weather_plain`
    (training only), the weather questions include WEATHER_QUESTIONS_PLAIN_TRAIN ("What is the weather in Paris?");
    with `unserved_requests` (training only), chores no tool does, in the training wrappers, join the plain chats
    as one more entry ("Please mow the lawn."), and with `chores_beside_weather` `get_weather` is declared beside
    each of them; with `composed_closers` the thanks closers include the composed thanks and goodbyes
    (`composed_sign_offs`); with `made_up_city_share` (training only) a request's pool city is a made-up name
    (`made_up_city`) with that probability, and with `world_city_share` one of WORLD_CITIES; with
    `weather_world_city_share` (training only) the weather questions' city alone is one of WORLD_CITIES with that
    probability; `history_share` of the conversations come after a long history of earlier exchanges
    (`add_history`)."""
    if (echo_share or noise_share or tail_share or link_share or link_tail_share or question_chats or weather_share
            or thanks_closer_share or help_me_to or composed_chats or weather_plain or unserved_requests
            or chores_beside_weather or composed_closers or made_up_city_share or world_city_share
            or weather_world_city_share) \
            and split != "train":
        raise ValueError("echo requests, noise, tails, link words, question chats, weather questions, thanks "
                         "closers, \"Help me to\", composed chats, plain weather forms, unserved requests, "
                         "chores beside the weather tool, composed closers and cities beyond the pool are for "
                         "training only")
    rng = random.Random(f"{split}:{seed}")
    pool = build_tools()
    style = phrasing(split)
    if help_me_to:  # "Help me" then never opens a task, so the held-out "Help me out and" is one task, not two
        style = dataclasses.replace(style, wrappers=tuple(
            "Help me to {intent}." if w == "Help me {intent}." else w for w in style.wrappers))
    if question_chat_weight < 1 or (question_chat_weight > 1 and not question_chats):
        raise ValueError("question_chat_weight counts the question chats: 1 or more, and above 1 only with them")
    if question_chats:  # listed `question_chat_weight` times, so each is drawn that much more often
        style = dataclasses.replace(style, plain=style.plain + PLAIN_QUESTION_CHATS_TRAIN * question_chat_weight)
    if noise_share:
        style = dataclasses.replace(style, noise=noise_vocabulary(), noise_share=noise_share)
    if tail_share:
        style = dataclasses.replace(style, tail=tail_words(), tail_share=tail_share)
    if made_up_city_share or world_city_share:
        style = dataclasses.replace(style, made_up_city_share=made_up_city_share, world_city_share=world_city_share)
    if link_share or link_tail_share:
        style = dataclasses.replace(style, links=link_words(), link_share=link_share,
                                    link_tail_share=link_tail_share, link_inline=link_inline)
    if thanks_closer_share:
        thanks = tuple(ask for asks, _, topic in style.plain if topic == "thanks me" for ask in asks)
        if composed_closers:  # so an unseen sign-off after one task ("Much obliged.") reads as no second task
            thanks += composed_sign_offs()
        style = dataclasses.replace(style, thanks=thanks, thanks_share=thanks_closer_share)
    elif composed_closers:
        raise ValueError("composed closers are thanks closers: give thanks_closer_share with them")
    if composed_chats:  # after the thanks closers, which stay the listed chats unless composed_closers
        style = dataclasses.replace(style, plain=style.plain + composed_small_talk())
    if unserved_requests:  # after "Help me to", so the chores are framed as the tool requests are
        style = dataclasses.replace(style, plain=style.plain + unserved_chores(style.wrappers))
    if chores_beside_weather:  # the chores probe's misses are get_weather calls: the tool alone is no reason to call
        if not unserved_requests:
            raise ValueError("chores beside the weather tool need the unserved requests")
        style = dataclasses.replace(style, declared_beside={UNSERVED_CHORE_TOPIC: "get_weather"})
    weather = next(t for t in pool if t.name == "get_weather")
    weather_questions = WEATHER_QUESTIONS_TRAIN + (WEATHER_QUESTIONS_PLAIN_TRAIN if weather_plain else ())
    weather_style = dataclasses.replace(style, questions={"get_weather": weather_questions})
    if weather_world_city_share:  # the question's words, not its one-token city, decide the call
        if not weather_share:
            raise ValueError("world cities in the weather questions need the weather questions: give weather_share")
        weather_style = dataclasses.replace(weather_style, world_city_share=weather_world_city_share)

    def weather_conversation(rng: random.Random, pool: list[Tool], _style: Phrasing, thinking: bool,
                             agent: bool) -> dict[str, Any]:
        return tool_conversation(rng, pool, weather_style, thinking, agent, only=weather)

    out = []
    for _ in range(count):
        if echo_share and rng.random() < echo_share:
            make = echo_conversation
        elif weather_share and rng.random() < weather_share:
            make = weather_conversation
        else:
            make = plain_conversation if rng.random() < plain_share else tool_conversation
        thinking = rng.random() < thinking_share
        convo = make(rng, pool, style, thinking, agent=rng.random() < agent_share)
        if history_share and rng.random() < history_share:
            convo = add_history(rng, pool, style, convo, thinking, plain_share)
        convo["thinking"] = thinking
        convo["text"], convo["spans"] = assistant_spans(convo["messages"], convo["tools"], thinking)
        out.append(convo)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--split", choices=["train", "heldout", "fresh"], default="train")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rows = generate(args.seed, args.count, args.split)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    print(f"wrote {len(rows)} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
