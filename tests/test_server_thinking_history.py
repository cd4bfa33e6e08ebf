"""History round trip under thinking: three agent turns the server generated (reasoning, then a tool call with its
`functions.name:idx` id), each sent back as returned, re-render to the tokens the model produced.

The tiny random K2.6-layout model (built-in k2.6 dialect) is steered only where a random model differs from a
trained one: a logit bias on `</think>` ends its reasoning after a few tokens, the call index is held to K2's own
numbering (a count of the conversation's calls, which the server renumbers history ids to), and the reserved
special tokens, which a trained model never writes, are banned. What is compared:

- the ids of the whole earlier conversation are the next prompt's first ids, unchanged;
- the generated turn appears after them as the same text, with the same special tokens in the same places, and
  the text between them in the tokenizer's own segmentation (a trained model writes that; a random one picks any
  segmentation the grammar allows, e.g. `f` `unctions` for `functions`, so its ids can differ there);
- reasoning is kept in the current agent turn and dropped before the last answer, as the template does.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from live_server import openai_client, running_server

from kserve.chat.markers import ARGUMENT_BEGIN, IM_END, THINK_BEGIN, THINK_END, TOOL_MARKER_TOKENS
from kserve.config import EngineConfig

UNIT_SCHEMA = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": UNIT_SCHEMA}}
THINK_END_BIASES = (8, 10, 6, 12, 4, 14, 100)
AGENT_TURNS = 3


@pytest.fixture(scope="module")
def server(tiny_k25_dir):
    with running_server(EngineConfig(model=str(tiny_k25_dir))) as srv:
        yield srv


@pytest.fixture
def generations(ctx):
    """(prompt ids, generated ids) of every finished engine request, in order (a tap on the real engine)."""
    seen: list[tuple[list[int], list[int]]] = []
    generate = ctx.engine.generate

    async def tap(request_id, prompt_ids, params):
        async for out in generate(request_id, prompt_ids, params):
            if out.finished:
                seen.append((list(prompt_ids), list(out.outputs[0].token_ids)))
            yield out

    ctx.engine.generate = tap
    yield seen
    del ctx.engine.generate


def steering(tokenizer: Any, call_index: int) -> dict[str, float]:
    """The logit bias that makes the random model number its call like K2 and write no reserved tokens."""
    keep = {*(tokenizer.special_ids[m] for m in TOOL_MARKER_TOKENS), *tokenizer.stop_token_ids,
            tokenizer.special_ids[THINK_END]}
    bias = {i: -100.0 for i in range(tokenizer.base_vocab_size, tokenizer.vocab_size)
            if tokenizer.is_special(i) and i not in keep}
    wanted = str(call_index).encode()
    bias.update({i: -100.0 for i in range(tokenizer.base_vocab_size)
                 if tokenizer.token_bytes(i).isdigit() and tokenizer.token_bytes(i) != wanted})
    bias[tokenizer.special_ids[ARGUMENT_BEGIN]] = 100.0  # one digit, then the arguments
    return {str(i): b for i, b in bias.items()}


def canonical(tokenizer: Any, ids: list[int]) -> list[int]:
    """`ids` with the text between special tokens re-encoded in the tokenizer's own segmentation."""
    out: list[int] = []
    run: list[int] = []
    for token in [*ids, None]:
        if token is None or tokenizer.is_special(token):
            out += tokenizer.encode(tokenizer.decode(run), allow_special_tokens=False) if run else []
            run = []
            if token is not None:
                out.append(token)
        else:
            run.append(token)
    return out


def agent_turn(client, ctx, messages: list[dict], index: int) -> Any:
    """One generated tool-call turn (the first `</think>` bias under which it finished with a call)."""
    bias = steering(ctx.tokenizer, index)
    for think_end_bias in THINK_END_BIASES:
        resp = client.chat.completions.create(
            model=ctx.model_name, messages=messages, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=48,
            logit_bias={**bias, str(ctx.tokenizer.special_ids[THINK_END]): think_end_bias})
        if resp.choices[0].finish_reason == "tool_calls":
            return resp
    raise AssertionError(f"agent turn {index} never finished with a tool call")


def test_three_agent_turns_render_back_to_what_the_model_produced(server, ctx, generations):
    client = openai_client(server)
    tok = ctx.tokenizer
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You check the weather."},
                                      {"role": "user", "content": "Weather in Paris, three times?"}]
    turns: list[tuple[list[int], list[int], dict[str, Any]]] = []
    for index in range(AGENT_TURNS):
        resp = agent_turn(client, ctx, messages, index)
        message = resp.choices[0].message.model_dump(exclude_none=True)  # sent back exactly as returned
        (call,) = message["tool_calls"]
        assert call["id"] == f"functions.get_weather:{index}"
        jsonschema.validate(json.loads(call["function"]["arguments"]), UNIT_SCHEMA)
        assert message["reasoning_content"] == message["reasoning"]
        prompt, generated = generations[-1]
        turns.append((prompt, generated, message))
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": f"sunny {index}"}]
    client.chat.completions.create(model=ctx.model_name, messages=messages, tools=[WEATHER], max_tokens=1)
    final_prompt = generations[-1][0]
    assert any(m["reasoning"] for _, _, m in turns), "no turn reasoned before its call; nothing kept to check"

    for prompt, generated, message in turns:
        assert final_prompt[:len(prompt)] == prompt  # the earlier conversation re-renders to the same ids
        assert prompt[-1] == tok.special_ids[THINK_BEGIN]
        stop = generated[-1]
        assert stop in tok.stop_token_ids
        # The template closes the turn with <|im_end|> whichever stop token the engine ended it with.
        produced = canonical(tok, generated[:-1]) + [tok.special_ids[IM_END]]
        assert final_prompt[len(prompt):len(prompt) + len(produced)] == produced
        shown = tok.decode(final_prompt[len(prompt):len(prompt) + len(produced)])
        assert shown == tok.decode(generated[:-1]) + IM_END
        assert shown.startswith(message["reasoning"] + THINK_END)  # the current agent turn keeps its reasoning


def test_reasoning_before_the_last_answer_is_dropped_unless_preserved(server, ctx, generations):
    client = openai_client(server)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "reasoning": "Ask the tool.", "tool_calls": [
                   {"id": "functions.get_weather:0", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
               {"role": "assistant", "content": "Sunny.", "reasoning_content": "Report it."},
               {"role": "user", "content": "Thanks!"}]

    def prompt_text(**fields) -> str:
        client.chat.completions.create(model=ctx.model_name, messages=history, tools=[WEATHER], max_tokens=1,
                                       **fields)
        return ctx.tokenizer.decode(generations[-1][0])

    dropped = prompt_text()
    assert "Ask the tool." not in dropped and "Report it." not in dropped
    assert dropped.count(THINK_BEGIN + THINK_END) == 2 and dropped.endswith(THINK_BEGIN)
    kept = prompt_text(extra_body={"chat_template_kwargs": {"preserve_thinking": True}})
    assert "<think>Ask the tool.</think>" in kept and "<think>Report it.</think>Sunny." in kept
