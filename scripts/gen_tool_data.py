"""Synthetic multi-turn tool-use conversations in Kimi K2's chat format, deterministic by seed.

    python scripts/gen_tool_data.py --seed 0 --count 20000 --split train --out data/train.jsonl
    python scripts/gen_tool_data.py --seed 1 --count 500 --split heldout --out data/heldout.jsonl

Each line holds one conversation: `messages` and `tools` (OpenAI shapes), `text` (the whole
conversation rendered by kserve's chat layer, exactly as the server would render it), `spans` (the
character ranges of the assistant turns, the only text a model is trained to produce), and `expect`:
what the final assistant turn must do (`{"kind": "tool_calls", "calls": [{"name", "arguments"}]}` or
`{"kind": "text"}`), which the evaluation checks against a model's answer to `messages[:-1]` cut at the
turn under test (`prompt_messages`).

`--split heldout` draws from phrasings never used for training; use another seed as well.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tool_data_pool import SYSTEM_PROMPTS, Phrasing, Tool, build_tools, phrasing

from kserve.chat import render_prompt

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
    wrapper = rng.choice(style.wrappers)
    return wrapper.replace("{Intent}", intent[:1].upper() + intent[1:]).replace("{intent}", intent)


def _call(tool: Tool, args: dict[str, Any], index: int) -> dict[str, Any]:
    return {"id": f"functions.{tool.name}:{index}", "type": "function",
            "function": {"name": tool.name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _think(text: str, thinking: bool) -> str:
    return f"<think>{text}</think>" if thinking else ""


def _declared(rng: random.Random, pool: list[Tool], must: list[Tool]) -> list[Tool]:
    others = [t for t in pool if t not in must]
    chosen = must + rng.sample(others, rng.randint(0, 3))
    rng.shuffle(chosen)
    return chosen


def _prefix(rng: random.Random) -> list[dict[str, Any]]:
    if rng.random() < 0.5:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    return []


def tool_conversation(rng: random.Random, pool: list[Tool], style: Phrasing, thinking: bool) -> dict[str, Any]:
    """A user asks for one or two tool uses; the assistant calls, reads the results, answers."""
    n_calls = 2 if rng.random() < 0.2 else 1
    used = rng.sample(pool, n_calls)
    args = [t.draw(rng) for t in used]
    intents = [_ask(rng, t, a) for t, a in zip(used, args)]
    intent = intents[0] if n_calls == 1 else rng.choice(style.joiners).format(a=intents[0], b=intents[1])
    user = _wrap(rng, intent, style) + "".join(_mention_optional(t, a) for t, a in zip(used, args))
    messages = _prefix(rng)
    if rng.random() < 0.15:  # an earlier small-talk exchange
        greet, answer = rng.choice(style.plain)
        messages += [{"role": "user", "content": rng.choice(greet)}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": user})
    calls = [_call(t, a, i) for i, (t, a) in enumerate(zip(used, args))]
    names = " and ".join(t.name for t in used)
    messages.append({"role": "assistant", "content": _think(f"The user wants {names}; I call it with their values.", thinking),
                     "tool_calls": calls})
    results = [t.result(rng, a) for t, a in zip(used, args)]
    for call, tool, result in zip(calls, used, results):
        messages.append({"role": "tool", "tool_call_id": call["id"], "name": tool.name,
                         "content": json.dumps(result, ensure_ascii=False)})
    answer = " ".join(fill(t.answer, a, r) for t, a, r in zip(used, args, results))
    messages.append({"role": "assistant", "content": _think("I have the results.", thinking) + answer})
    expect = {"kind": "tool_calls", "calls": [{"name": t.name, "arguments": a} for t, a in zip(used, args)]}
    # evaluation asks the first assistant turn after the user's request
    turn = len(messages) - 2 - len(used)
    return {"messages": messages, "tools": [t.schema() for t in _declared(rng, pool, used)],
            "expect": expect, "eval_turn": turn}


def plain_conversation(rng: random.Random, pool: list[Tool], style: Phrasing, thinking: bool) -> dict[str, Any]:
    """A chat that needs no tool, with or without tools declared."""
    greet, answer = rng.choice(style.plain)
    messages = _prefix(rng) + [{"role": "user", "content": rng.choice(greet)},
                               {"role": "assistant", "content": _think("No tool is needed.", thinking) + answer}]
    tools = [t.schema() for t in rng.sample(pool, rng.randint(1, 4))] if rng.random() < 0.5 else []
    return {"messages": messages, "tools": tools, "expect": {"kind": "text", "content": answer},
            "eval_turn": len(messages) - 1}


def assistant_spans(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> tuple[str, list[list[int]]]:
    """The rendered conversation and the [start, end) character ranges of its assistant turns (body + <|im_end|>)."""
    text = render_prompt(messages, tools or None, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render_prompt(messages[:i], tools or None, add_generation_prompt=True))
        end = len(render_prompt(messages[: i + 1], tools or None, add_generation_prompt=False))
        if not text.startswith(render_prompt(messages[: i + 1], tools or None, add_generation_prompt=False)):
            raise AssertionError("rendering is not prefix-stable; spans would be wrong")
        spans.append([start, end])
    return text, spans


def generate(seed: int, count: int, split: str = "train", thinking: bool = False, plain_share: float = 0.3) -> list[dict]:
    rng = random.Random(f"{split}:{seed}")
    pool = build_tools()
    style = phrasing(split)
    out = []
    for _ in range(count):
        make = plain_conversation if rng.random() < plain_share else tool_conversation
        convo = make(rng, pool, style, thinking)
        convo["text"], convo["spans"] = assistant_spans(convo["messages"], convo["tools"])
        out.append(convo)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--split", choices=["train", "heldout"], default="train")
    p.add_argument("--thinking", action="store_true", help="prefix assistant turns with <think> reasoning")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rows = generate(args.seed, args.count, args.split, args.thinking)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    print(f"wrote {len(rows)} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
