"""Property-based fuzzing of /v1/chat/completions, /v1/completions, /v1/messages and /v1/responses bodies (hypothesis).

Bodies mix well-formed fields with wrong types, out-of-range numbers (2**63, -1, NaN, Infinity), odd
strings and unknown keys, streaming and not. Properties: no response is a 5xx (nor an in-band 5xx error on
a stream), and every 4xx is in its API's shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`
(chat, completions, responses) or Anthropic's `{"type": "error", "error": {"type", "message"}}` (messages),
with a non-empty message. Generation stays short (max_tokens is either small or invalid) so a run is bounded.

Without --base-url it starts `kserve serve` (embedded tiny model, user defaults) on 127.0.0.1 and stops it.

    python benchmarks/fuzz_harness.py --examples 600 --out-json fuzz.json
    python benchmarks/fuzz_harness.py --examples 40            # CI size

Prints a JSON report (statuses, failures with the body that caused them); exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness_server import ServerProcess, report_and_exit_status

SPECIAL_NUMBERS = [0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30, 0.5, -0.5, 1e308, float("nan"), float("inf"),
                   float("-inf"), 3, 20, 21, 100]
junk = st.recursive(
    st.none() | st.booleans() | st.sampled_from(SPECIAL_NUMBERS) | st.integers() | st.floats()
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
small_int = st.integers(min_value=1, max_value=6)
unit = st.floats(min_value=0, max_value=1, allow_nan=False)



def noisy(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(good, good, good, junk)


def clean(good: st.SearchStrategy) -> st.SearchStrategy:
    return good


# Fields that are valid alone but refused in combinations a clean body should not need (stream_options
# without stream, suffix, best_of != n, echo with logprobs, top_logprobs without logprobs, tool turns).
NOISY_ONLY = frozenset({"stream_options", "suffix", "best_of", "echo", "top_logprobs", "tool_calls", "tool_call_id",
                        "name", "unknown_field"})


def only_noisy(field: Any, fields: dict[str, st.SearchStrategy]) -> dict[str, st.SearchStrategy]:
    return fields if field is noisy else {k: v for k, v in fields.items() if k not in NOISY_ONLY}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}
# max_tokens is small, or invalid: never a large valid budget, nor null (= the whole context), so the run stays short
bad_max_tokens = st.sampled_from([0, -5, "8", 2.5, [1], -(2**63)])


def max_tokens_for(field: Any) -> st.SearchStrategy:
    return small_int if field is clean else st.one_of(small_int, small_int, bad_max_tokens)
model = st.sampled_from(["MODEL"] * 9 + ["gpt-x"])


def sampling(field: Any) -> dict[str, st.SearchStrategy]:
    return {
        "temperature": field(st.floats(min_value=0, max_value=2)), "top_p": field(st.floats(min_value=0.01, max_value=1)),
        "top_k": field(st.integers(-1, 50)), "min_p": field(unit), "n": field(st.integers(1, 3)),
        "seed": field(st.integers(-(2**63), 2**63 - 1)), "presence_penalty": field(st.floats(-2, 2)),
        "frequency_penalty": field(st.floats(-2, 2)), "repetition_penalty": field(st.floats(0.5, 2)),
        "min_tokens": field(st.integers(0, 1)),
        "stop": field(st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3)),
        "logit_bias": field(st.dictionaries(st.integers(0, 2000 if field is clean else 3000).map(str),
                                            st.floats(-100, 100), max_size=3)),
        "ignore_eos": field(st.booleans()), "stream": st.booleans(), "user": field(st.text(max_size=5)),
        "unknown_field": junk,
    }


def chat_bodies(field: Any) -> st.SearchStrategy:
    message = st.fixed_dictionaries(
        {"role": field(st.sampled_from(["user"] * 4 + ["system", "assistant", "developer"]
                                       + (["tool", "robot"] if field is noisy else []))),
         "content": field(st.text(max_size=40) | st.just([{"type": "text", "text": "hi"}]))},
        optional=only_noisy(field, {
            "name": field(st.text(max_size=8)), "tool_call_id": field(st.text(max_size=8)),
            "tool_calls": field(st.just([{"id": "c1", "type": "function",
                                          "function": {"name": "lookup", "arguments": '{"a": 1}'}}]))}),
    )
    return st.fixed_dictionaries(
        {"model": model, "max_tokens": max_tokens_for(field), "messages": field(st.lists(message, min_size=1, max_size=3))},
        optional=only_noisy(field, {**sampling(field), "logprobs": field(st.booleans()),
                  "top_logprobs": field(st.integers(0, 5)),
                  "tools": field(st.just([TOOL])),
                  "tool_choice": field(st.sampled_from(["auto", "none", "required",
                                                        {"type": "function", "function": {"name": "lookup"}}])),
                  "response_format": field(st.sampled_from([{"type": "json_object"}, {"type": "text"},
                                                            {"type": "json_schema",
                                                             "json_schema": {"name": "x", "schema": SCHEMA}}])),
                  "parallel_tool_calls": field(st.booleans()), "max_completion_tokens": max_tokens_for(field),
                  "stream_options": field(st.just({"include_usage": True}))}),
    )


def completion_bodies(field: Any) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"model": model, "max_tokens": max_tokens_for(field),
         "prompt": field(st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 2000 if field is clean else 3000), min_size=1, max_size=5)
                         | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3))},
        optional=only_noisy(field, {
            **sampling(field), "logprobs": field(st.integers(0, 5)), "echo": field(st.booleans()),
            "best_of": field(st.integers(1, 3)), "suffix": field(st.text(max_size=3)),
            "skip_special_tokens": field(st.booleans()), "stream_options": field(st.just({"include_usage": True}))}),
    )


ANTHROPIC_TOOL = {"name": "lookup", "input_schema": SCHEMA}


def messages_bodies(field: Any) -> st.SearchStrategy:
    block = st.sampled_from([{"type": "text", "text": "hi"}, {"type": "text", "text": ""}]
                            + ([{"type": "tool_result", "tool_use_id": "x", "content": "1"}, {"type": "image"},
                                {"type": "robot"}] if field is noisy else []))
    message = st.fixed_dictionaries({
        "role": field(st.sampled_from(["user"] * 4 + (["assistant", "system"] if field is noisy else []))),
        "content": field(st.text(max_size=40) | st.lists(block, min_size=1, max_size=2)),
    })
    return st.fixed_dictionaries(
        {"model": model, "max_tokens": max_tokens_for(field), "messages": field(st.lists(message, min_size=1, max_size=2))},
        optional={
            "system": field(st.text(max_size=20) | st.just([{"type": "text", "text": "be brief"}])),
            "temperature": field(st.floats(min_value=0, max_value=1)), "top_p": field(st.floats(min_value=0.01, max_value=1)),
            "top_k": field(st.integers(1, 50)), "stop_sequences": field(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
            "stream": st.booleans(), "metadata": field(st.just({"user_id": "u"})),
            "tools": field(st.just([ANTHROPIC_TOOL])),
            "tool_choice": field(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                                  {"type": "tool", "name": "lookup"}])),
            **({"unknown_field": junk} if field is noisy else {}),
        },
    )


def responses_bodies(field: Any) -> st.SearchStrategy:
    item = st.sampled_from([{"type": "message", "role": "user", "content": "hi"},
                            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
                           + ([{"type": "function_call_output", "call_id": "x", "output": "1"}, {"type": "robot"}]
                              if field is noisy else []))
    return st.fixed_dictionaries(
        {"model": model, "max_output_tokens": max_tokens_for(field),
         "input": field(st.text(min_size=1, max_size=40) | st.lists(item, min_size=1, max_size=2))},
        optional={
            "instructions": field(st.text(max_size=20)), "temperature": field(st.floats(min_value=0, max_value=2)),
            "top_p": field(st.floats(min_value=0.01, max_value=1)), "stream": st.booleans(),
            "store": field(st.booleans()), "parallel_tool_calls": field(st.booleans()),
            "tools": field(st.just([{"type": "function", "name": "lookup", "parameters": SCHEMA}])),
            "tool_choice": field(st.sampled_from(["auto", "none", "required", {"type": "function", "name": "lookup"}])),
            "text": field(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                                           {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}])),
            **({"unknown_field": junk} if field is noisy else {}),
        },
    )


# Half the bodies are clean (every field plausible), half noisy (each field sometimes junk).
bodies = st.one_of(
    chat_bodies(clean).map(lambda b: ("/v1/chat/completions", b)),
    chat_bodies(noisy).map(lambda b: ("/v1/chat/completions", b)),
    completion_bodies(clean).map(lambda b: ("/v1/completions", b)),
    completion_bodies(noisy).map(lambda b: ("/v1/completions", b)),
    messages_bodies(clean).map(lambda b: ("/v1/messages", b)),
    messages_bodies(noisy).map(lambda b: ("/v1/messages", b)),
    responses_bodies(clean).map(lambda b: ("/v1/responses", b)),
    responses_bodies(noisy).map(lambda b: ("/v1/responses", b)),
)


def in_band_server_error(path: str, event: dict[str, Any]) -> Any:
    """A stream event that reports a server-side failure, in the endpoint's own wire format (else None)."""
    if path == "/v1/messages":
        err = event.get("error") if event.get("type") == "error" else None
        return err if err and err.get("type") in ("api_error", "overloaded_error") else None
    if path == "/v1/responses":
        if event.get("type") == "error" and event.get("code") in ("internal_error", "engine_dead", "request_failed"):
            return event
        return None
    err = event.get("error")
    return err if err and err.get("type") in ("server_error", "service_unavailable") else None


def error_shape_ok(path: str, text: str) -> bool:
    try:
        body = json.loads(text)
        if path == "/v1/messages":
            error = body["error"]
            return body["type"] == "error" and set(error) == {"type", "message"} \
                and isinstance(error["message"], str) and bool(error["message"]) and isinstance(error["type"], str)
        error = body["error"]
        return set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str) \
            and bool(error["message"]) and isinstance(error["type"], str)
    except (ValueError, KeyError, TypeError):
        return False


class Fuzzer:
    def __init__(self, base_url: str, model: str, timeout: float) -> None:
        self.base_url, self.model = base_url, model
        self.client = httpx.Client(base_url=base_url, timeout=timeout)
        self.statuses: Counter[str] = Counter()
        self.failures: list[dict[str, Any]] = []

    def check(self, path: str, body: dict[str, Any]) -> None:
        if body.get("model") == "MODEL":
            body["model"] = self.model
        payload = json.dumps(body, allow_nan=True)  # NaN/Infinity as Python's json writes them
        problem = None
        try:
            if body.get("stream") is True:
                with self.client.stream("POST", path, content=payload,
                                        headers={"Content-Type": "application/json"}) as resp:
                    status = resp.status_code
                    if status == 200:
                        for line in resp.iter_lines():
                            if line.startswith("data: {"):
                                err = in_band_server_error(path, json.loads(line[6:]))
                                if err:
                                    problem = f"in-band server error: {err}"
                        text = ""
                    else:
                        text = resp.read().decode()
            else:
                resp = self.client.post(path, content=payload, headers={"Content-Type": "application/json"})
                status, text = resp.status_code, resp.text
        except httpx.HTTPError as exc:
            status, problem = -1, f"transport error: {type(exc).__name__}: {exc}"
            text = ""
        self.statuses[f"{path} {status}"] += 1
        if problem is None and status >= 500:
            problem = f"status {status}: {text[:300]}"
        if problem is None and 400 <= status < 500 and not error_shape_ok(path, text):
            problem = f"4xx not in the API's error shape: {text[:300]}"
        if problem is not None:  # recorded, not raised: the run goes on and reports every failure it meets
            self.failures.append({"path": path, "body": payload[:2000], "problem": problem})


def run(fuzzer: Fuzzer, examples: int, seed_value: int) -> None:
    common = settings(max_examples=examples, deadline=None, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))

    @seed(seed_value)
    @common
    @given(bodies)
    def prop(case: tuple[str, dict[str, Any]]) -> None:
        fuzzer.check(*case)

    prop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--out-json", default=None)
    args = parser.parse_args(argv)
    server = None if args.base_url else ServerProcess()
    base = args.base_url or server.base_url
    started = time.monotonic()
    try:
        if server is not None:
            server.wait_ready()
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        fuzzer = Fuzzer(base, model, args.timeout)
        run(fuzzer, args.examples, args.seed)
        health = httpx.get(base + "/health", timeout=10).status_code
    finally:
        if server is not None:
            server.stop()
    problems = fuzzer.failures + ([] if health == 200 else [{"problem": f"/health is {health} after fuzzing"}])
    report = {"harness": "fuzz", "requests": sum(fuzzer.statuses.values()), "seconds": round(time.monotonic() - started),
              "statuses": dict(sorted(fuzzer.statuses.items())), "failures": problems[:20], "ok": not problems}
    return report_and_exit_status(report, args.out_json)


if __name__ == "__main__":
    sys.exit(main())
