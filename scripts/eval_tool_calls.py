"""How often a served model calls the right tool with the right arguments, on held-out conversations.

    python scripts/eval_tool_calls.py [MODEL_DIR] --count 200 --seed 1 [--thinking off] [--split fresh]
        [--base-url URL] [--json out.json]

Without --base-url it starts `kserve serve MODEL_DIR` in this process on 127.0.0.1 with the defaults a
user gets (tool_choice auto, default tool grammar). Each held-out conversation (scripts/gen_tool_data.py,
split `heldout`, phrasings never used in training; `--split fresh` draws a second such set instead) is cut
before the assistant turn under test and sent through the official `openai` client, greedy, with the
model's default thinking mode (`--thinking off` sends `chat_template_kwargs: {"thinking": false}`). Reported:
- tool_call_rate: share of tool requests answered with finish_reason tool_calls naming the expected tools;
- exact_args_rate: share of tool requests whose calls also carry exactly the expected arguments;
- plain_stop_rate: share of plain chats answered with text ending in `stop` within 64 tokens (reasoning
  included); plain_exact_rate: of those, the share whose text is exactly the expected answer.

`--echo N` also sends N training-style requests to repeat random words (gen_tool_data.py's echo requests)
and reports echo_copy_rate, the share answered with exactly those words: a direct probe of copying.
`--loops` also sends LOOP_PROBE's 20 requests unlike the training data (lower-case cities, a dynamic tool
declaration, small talk and tasks it never saw), greedy with a 128-token cap, and reports loop_probe: how
many run to the cap, which for this model means a loop.
`--bare N` also sends N bare tool requests ("What's the weather like in Paris today?", no opener, wrapper or
closer; split `bare`), which the held-out split never has, and reports bare_tool_call_rate and
bare_exact_args_rate: a short request that opens like a plain chat is where these models answer in text.
`--answers N` also sends N held-out tool conversations cut before the final answer, their tool results
without `name` as the `openai` SDK sends them, and reports answer_stop_rate (text ending in `stop`) and
answer_exact_rate (exactly the expected sentence): the turn that reads a result.
`--long N` also sends N held-out conversations after several earlier exchanges (`add_history`: about 900 to
3,000 tokens of prompt, as agents send) and reports long_tool_call_rate, long_exact_args_rate and
long_plain_stop_rate.
`--joiners N` also sends N bare two-task requests for each of JOINER_PROBE's joiners (training's, the held-out
one, and unseen ones, two bare sentences among them) and reports joiner_probe: the share with both calls, per
joiner.
`--chats` also sends PLAIN_CHATS_PROBE's 40 plain chats that no split holds, each with 1 to 4 tools declared,
and reports chat_probe_stop_rate (text ending in `stop`) and the chats missed.
`--weather` also sends WEATHER_PROBE's six weather questions with only `get_weather` declared and reports
weather_probe_rate (the call with exactly the city) and the questions missed: history draws read some of them
as small talk. `--unseen-weather` sends UNSEEN_WEATHER_PROBE's 24 questions about cities outside the training
pool and reports unseen_weather_call_rate (`get_weather` called, whatever the city) and the questions missed.
`--chores` sends CHORE_PROBE_TASKS' 12 chores no tool does, bare and in the unseen splits' wrappers, with only
`get_weather` declared, and reports chore_probe_stop_rate (text ending in `stop`, no call) and the chores missed.
`--forced N` sends "use the tool" with `tool_choice` `required` N times (seeds 0 to N - 1, default sampling,
400 tokens) for each of FORCED_PROBE's three one-tool schemas, and reports forced_probe: per schema, how many
runs reach the cap (the vendor suite's nested-schema case is the first; its pass is one draw of this).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_tool_data import generate, probe_chats, two_task_requests
from tool_data_pool import WRAPPERS_FRESH, WRAPPERS_HELDOUT


def score(client: Any, model: str, rows: list[dict[str, Any]], thinking: bool | None = None,
          text_max_tokens: int = 64, max_failures: int = 10) -> dict[str, Any]:
    tool_rows = [r for r in rows if r["expect"]["kind"] == "tool_calls"]
    plain_rows = [r for r in rows if r["expect"]["kind"] == "text"]
    right_tool = exact = plain_stop = plain_exact = 0
    failures: list[dict[str, Any]] = []
    for row in rows:
        prompt = row["messages"][: row["eval_turn"]]
        kwargs: dict[str, Any] = {"tools": row["tools"], "tool_choice": "auto"} if row["tools"] else {}
        if thinking is not None:
            kwargs["extra_body"] = {"chat_template_kwargs": {"thinking": thinking}}
        max_tokens = text_max_tokens if row["expect"]["kind"] == "text" else 256
        resp = client.chat.completions.create(model=model, messages=prompt, temperature=0.0, max_tokens=max_tokens,
                                              **kwargs)
        choice = resp.choices[0]
        if row["expect"]["kind"] == "text":
            ok = choice.finish_reason == "stop" and not choice.message.tool_calls
            plain_stop += ok
            plain_exact += ok and (choice.message.content or "").strip() == row["expect"]["content"]
        else:
            calls = choice.message.tool_calls or []
            want = row["expect"]["calls"]
            names = [c.function.name for c in calls]
            names_ok = choice.finish_reason == "tool_calls" and names == [w["name"] for w in want]
            right_tool += names_ok
            args_ok = False
            if names_ok:
                try:
                    args_ok = [json.loads(c.function.arguments) for c in calls] == [w["arguments"] for w in want]
                except json.JSONDecodeError:
                    args_ok = False
            exact += args_ok
            ok = args_ok
        if not ok and len(failures) < max_failures:
            failures.append({"prompt": prompt[-1]["content"], "expect": row["expect"],
                             "got": {"finish_reason": choice.finish_reason, "content": choice.message.content,
                                     "reasoning": getattr(choice.message, "reasoning_content", None),
                                     "tool_calls": [c.model_dump() for c in choice.message.tool_calls or []]}})
    return {
        "tool_requests": len(tool_rows),
        "plain_requests": len(plain_rows),
        "tool_call_rate": right_tool / max(1, len(tool_rows)),
        "exact_args_rate": exact / max(1, len(tool_rows)),
        "plain_stop_rate": plain_stop / max(1, len(plain_rows)),
        "plain_exact_rate": plain_exact / max(1, len(plain_rows)),
        "failures": failures,
    }


def answer_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool conversations cut before their final answer, each result without the tool's `name` (K2.6's
    template then heads it "tool"), expecting the answer's text."""
    cut = []
    for row in rows:
        if row["expect"]["kind"] != "tool_calls":
            continue
        messages = [{k: v for k, v in m.items() if not (m["role"] == "tool" and k == "name")}
                    for m in row["messages"]]
        cut.append({**row, "messages": messages, "eval_turn": len(messages) - 1,
                    "expect": {"kind": "text", "content": messages[-1]["content"]}})
    return cut


def _tool(name: str, description: str, param: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}


WEATHER = _tool("get_weather", "Get the weather of a city.", "city")
TIME = _tool("get_time", "Get the local time of a city.", "city")
SEARCH = _tool("web_search", "Search the web.", "query")
# training-style weather questions, each a training city (docs/embedded_model.md, thirty-ninth run)
WEATHER_PROBE = (("What's the weather like in Paris today?", "Paris"),
                 ("What is the weather like in Paris today?", "Paris"),
                 ("What's the weather like in Tokyo?", "Tokyo"), ("What is the weather like in Berlin?", "Berlin"),
                 ("How's the weather in Oslo today?", "Oslo"), ("How's the weather in Madrid?", "Madrid"))


def weather_rows(probe: tuple[tuple[str, str], ...] = WEATHER_PROBE) -> list[dict[str, Any]]:
    """A weather probe as rows for `score`: the question alone, `get_weather` alone declared, one call expected."""
    return [{"messages": [{"role": "user", "content": text}], "tools": [WEATHER], "eval_turn": 1,
             "expect": {"kind": "tool_calls", "calls": [{"name": "get_weather", "arguments": {"city": city}}]}}
            for text, city in probe]


# plain weather questions about cities outside the training pool, the way users first ask; the forty-ninth run
# read them as small talk while passing WEATHER_PROBE (docs/embedded_model.md). Scored on the call, not the city,
# which the model cannot be expected to copy.
UNSEEN_WEATHER_CITIES = ("Beijing", "Shanghai", "Chicago", "Moscow", "Seattle", "Vienna")
UNSEEN_WEATHER_FORMS = ("What is the weather in {city}?", "what is the weather in {city}?",
                        "What's the weather in {city}?", "How is the weather in {city}?")
UNSEEN_WEATHER_PROBE = tuple((form.format(city=city), city) for form in UNSEEN_WEATHER_FORMS
                             for city in UNSEEN_WEATHER_CITIES)


# chores no tool does (none of training's `--unserved-requests` chores), bare and in the unseen splits' wrappers,
# `get_weather` alone declared as a grammar test asks "Fill in the form.": history draws call it for them
# (docs/embedded_model.md, fifty-fifth run).
CHORE_PROBE_TASKS = ("fill in the form", "clean the windows", "sort my socks", "feed the fish", "fix the door",
                     "wash my car", "make the bed", "bake bread", "sew a button", "trim the hedge",
                     "empty the dishwasher", "carry the boxes")


def chore_rows() -> list[dict[str, Any]]:
    """CHORE_PROBE_TASKS as rows for `score`: each chore bare ("Fill in the form.") and in one unseen wrapper, no
    answer expected word for word."""
    wrappers = WRAPPERS_HELDOUT + WRAPPERS_FRESH
    asks = []
    for i, task in enumerate(CHORE_PROBE_TASKS):
        asks += [f"{task[0].upper()}{task[1:]}.", wrappers[i % len(wrappers)].format(intent=task)]
    return [{"messages": [{"role": "user", "content": ask}], "tools": [WEATHER], "eval_turn": 1,
             "expect": {"kind": "text", "content": None}} for ask in asks]


# (user message, request tools, tools declared in a system message instead)
LOOP_PROBE: tuple[tuple[str, tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]], ...] = (
    ("what is the weather in beijing?", (), (WEATHER,)), ("what is the weather in beijing?", (), (WEATHER, TIME)),
    ("what is the weather in beijing?", (WEATHER,), ()), ("weather in tokyo pls", (WEATHER, TIME), ()),
    ("is it raining in london right now?", (WEATHER, TIME, SEARCH), ()),
    ("tell me the weather for new york city", (WEATHER,), ()),
    ("What's the temperature in Berlin?", (WEATHER, SEARCH), ()), ("what time is it in oslo", (WEATHER, TIME), ()),
    ("search the web for the best pizza in naples", (WEATHER, SEARCH), ()),
    ("Yo, what's up?", (WEATHER, TIME), ()), ("Howdy!", (WEATHER,), ()),
    ("Thanks a lot! That's all for today.", (WEATHER, SEARCH), ()), ("ok cool", (WEATHER,), ()),
    ("你好。", (), ()), ("用一句话介绍北京。", (), ()),
    ("Write a haiku about the sea.", (), ()), ("What is 2+2?", (), ()),
    ("Tell me about yourself in detail.", (), ()), ("hello hello hello", (), ()),
    ("I have been working on a project for my team at work and we need to plan the next steps carefully, so please "
     "think about what we should do first and tell me.", (), ()),
)


def loop_probe(client: Any, model: str) -> int:
    """How many LOOP_PROBE requests run to the 128-token cap, greedy."""
    capped = 0
    for text, tools, dynamic in LOOP_PROBE:
        messages = ([{"role": "system", "content": "", "tools": list(dynamic)}] if dynamic else []) + [
            {"role": "user", "content": text}]
        kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
        resp = client.chat.completions.create(model=model, messages=messages, temperature=0.0, max_tokens=128,
                                              **kwargs)
        capped += resp.choices[0].finish_reason == "length"
    return capped


# The vendor suite's forced calls (tool_choice required, "use the tool"): a model that reads the request as
# needing no tool is made to call anyway, and a free string it opens can run to the cap.
FORCED_PROBE = {
    "nested numbers": {"type": "object", "properties": {"location": {"type": "object", "properties": {
        "lat": {"type": "number"}, "lon": {"type": "number"}}}}},
    "one string": {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]},
    "list of strings": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
                        "required": ["tags"]},
}


def forced_probe(client: Any, model: str, samples: int, thinking: bool | None = None) -> dict[str, str]:
    """Per FORCED_PROBE schema, how many of `samples` forced calls (seeds 0 to samples - 1, the server's default
    sampling, 400 tokens) run to the cap: the vendor suite's pass is one draw of this."""
    extra = {} if thinking is None else {"chat_template_kwargs": {"thinking": thinking}}
    capped = {}
    for shape, schema in FORCED_PROBE.items():
        tool = {"type": "function", "function": {"name": "probe_tool", "description": f"A tool taking {shape}.",
                                                 "parameters": schema}}
        runs = [client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "use the tool"}], tools=[tool], tool_choice="required",
            max_tokens=400, seed=seed, extra_body=extra).choices[0].finish_reason for seed in range(samples)]
        capped[shape] = f"{runs.count('length')} of {samples} at the cap"
    return capped


# training's " and " and " plus ", a noise word before " and ", the held-out " as well as ", and joiners no split has
JOINER_PROBE = ("{a} and {b}", "{a} plus {b}", "{a} okay and {b}", "{a} as well as {b}", "{a}, as well as {b}",
                "{a} along with {b}", "{a} window {b}", "{a}. As well as that, {b}", "{a}. {B}")


def main(argv: list[str] | None = None) -> int:
    import openai

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", nargs="?", default=None, help="default: the embedded model")
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--base-url", default=None, help="a running server's base URL (loopback)")
    p.add_argument("--thinking", choices=["default", "on", "off"], default="default",
                   help="the chat template's thinking switch (default: the model's own default)")
    p.add_argument("--split", choices=["heldout", "fresh"], default="heldout",
                   help="which unseen phrasings to ask with (the goals are on heldout)")
    p.add_argument("--echo", type=int, default=0, help="also probe copying with this many echo requests")
    p.add_argument("--loops", action="store_true", help="also count greedy loops on LOOP_PROBE's requests")
    p.add_argument("--forced", type=int, default=0,
                   help="also send each FORCED_PROBE forced call this many times, sampled, and count runs to the cap")
    p.add_argument("--bare", type=int, default=0, help="also send this many bare tool requests")
    p.add_argument("--answers", type=int, default=0,
                   help="also send this many held-out tool conversations for their final answer")
    p.add_argument("--long", type=int, default=0,
                   help="also send this many held-out conversations after long histories (about 900 to 3,000 tokens)")
    p.add_argument("--joiners", type=int, default=0,
                   help="also send this many bare two-task requests for each of JOINER_PROBE's joiners")
    p.add_argument("--chats", action="store_true", help="also send PLAIN_CHATS_PROBE's unseen plain chats")
    p.add_argument("--weather", action="store_true", help="also send WEATHER_PROBE's weather questions")
    p.add_argument("--unseen-weather", action="store_true",
                   help="also send UNSEEN_WEATHER_PROBE's weather questions about cities outside the training pool")
    p.add_argument("--chores", action="store_true", help="also send CHORE_PROBE_TASKS' chores no tool does")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)

    rows = generate(args.seed, args.count, args.split)
    server = None
    base_url = args.base_url
    if base_url is None:
        from kserve.config import EngineConfig
        from kserve.server.context import ServerSettings
        from kserve.server.launch import BackgroundServer

        server = BackgroundServer(ServerSettings(port=0, engine=EngineConfig(model=args.model_dir))).start()
        base_url = server.base_url
    try:
        client = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        thinking = {"default": None, "on": True, "off": False}[args.thinking]
        result = score(client, model, rows, thinking)
        if args.echo:
            echoes = generate(args.seed, args.echo, "train", echo_share=1.0)
            result["echo_copy_rate"] = score(client, model, echoes, thinking, text_max_tokens=160)["plain_exact_rate"]
        if args.bare:
            bare_rows = generate(args.seed, args.bare, "bare", plain_share=0.0, agent_share=0.0)
            bare = score(client, model, bare_rows, thinking)
            result["bare_tool_call_rate"] = bare["tool_call_rate"]
            result["bare_exact_args_rate"] = bare["exact_args_rate"]
        if args.answers:
            answers = score(client, model, answer_rows(generate(args.seed, args.answers, args.split, plain_share=0.0)),
                            thinking)
            result["answer_stop_rate"] = answers["plain_stop_rate"]
            result["answer_exact_rate"] = answers["plain_exact_rate"]
        if args.long:
            long = score(client, model, generate(args.seed, args.long, args.split, history_share=1.0), thinking)
            result["long_tool_call_rate"] = long["tool_call_rate"]
            result["long_exact_args_rate"] = long["exact_args_rate"]
            result["long_plain_stop_rate"] = long["plain_stop_rate"]
        if args.joiners:
            result["joiner_probe"] = {j: score(client, model, two_task_requests(args.seed, args.joiners, j),
                                               thinking)["tool_call_rate"] for j in JOINER_PROBE}
        if args.chats:
            chat_rows = probe_chats(args.seed)
            chats = score(client, model, chat_rows, thinking, max_failures=len(chat_rows))
            result["chat_probe_stop_rate"] = chats["plain_stop_rate"]
            result["chat_probe_misses"] = [f["prompt"] for f in chats["failures"]]
        if args.weather:
            weather = score(client, model, weather_rows(), thinking, max_failures=len(WEATHER_PROBE))
            result["weather_probe_rate"] = weather["exact_args_rate"]
            result["weather_probe_misses"] = [f["prompt"] for f in weather["failures"]]
        if args.unseen_weather:
            unseen = score(client, model, weather_rows(UNSEEN_WEATHER_PROBE), thinking,
                           max_failures=len(UNSEEN_WEATHER_PROBE))
            result["unseen_weather_call_rate"] = unseen["tool_call_rate"]
            result["unseen_weather_misses"] = [
                f["prompt"] for f in unseen["failures"]
                if [c["function"]["name"] for c in f["got"]["tool_calls"]] != ["get_weather"]]
        if args.chores:
            chore_probe = score(client, model, chore_rows(), thinking, max_failures=2 * len(CHORE_PROBE_TASKS))
            result["chore_probe_stop_rate"] = chore_probe["plain_stop_rate"]
            result["chore_probe_misses"] = [f["prompt"] for f in chore_probe["failures"]]
        if args.loops:
            result["loop_probe"] = f"{loop_probe(client, model)} of {len(LOOP_PROBE)} at the cap"
        if args.forced:
            result["forced_probe"] = forced_probe(client, model, args.forced, thinking)
    finally:
        if server is not None:
            server.stop()
    summary = {k: v for k, v in result.items() if k != "failures"}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
