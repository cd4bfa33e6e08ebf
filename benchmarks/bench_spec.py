"""Speculative decoding on the embedded model: acceptance and speed against plain decoding, in one run.

Two request kinds, rendered with the model's chat template (greedy):
- "copy": answers that repeat the prompt: tool calls whose arguments quote a long path or sentence from
  the user's message, and "repeat after me" requests;
- "fresh": plain questions whose answers quote nothing.
Each kind runs at batch 1 and 8, plain and with `--speculative-config` (n-gram by default), on fresh
engines; the table gives output tokens per second, the ratio to plain decoding, the acceptance rate and
the mean accepted length (tokens per verify step per sequence). Outputs are checked equal.

    python benchmarks/bench_spec.py [--spec '{"method": "ngram", "num_speculative_tokens": 3}'] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import time

from kserve.engine.llm import LLM
from kserve.engine.sampling_params import SamplingParams

SEARCH = {"type": "function", "function": {
    "name": "search_files", "description": "Search the repository for a pattern.",
    "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                   "required": ["pattern"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

COPY = [
    ("Search for 'class StreamingToolParser' in kserve/chat/tool_parser_helpers/streaming/.", [SEARCH]),
    ("Find 'def schedule_waiting_requests_in_order' under src/engine/scheduling/policies/.", [SEARCH]),
    ("Repeat after me exactly: the quick brown fox jumps over the lazy dog near the river bank.", []),
    ("What's the weather in Llanfairpwllgwyngyll, Wales?", [WEATHER]),
    ("Repeat after me exactly: one two three four five six seven eight nine ten.", []),
    ("Search for 'TODO(kserve): remove this fallback' in benchmarks/gpu_check_helpers/.", [SEARCH]),
    ("Repeat after me exactly: kserve serves Kimi K2 with an OpenAI-compatible API.", []),
    ("Look for 'raise RankLostError' inside kserve/engine/tensor_parallel_workers/.", [SEARCH]),
]
FRESH = [
    ("Say hello in one short sentence.", []),
    ("What is a good name for a cat?", []),
    ("Tell me something about the sea.", []),
    ("How are you today?", []),
    ("Give me a tip for writing tests.", []),
    ("What should I cook tonight?", []),
    ("Name a colour you like.", []),
    ("Describe the morning in a few words.", []),
]


def run(model: str | None, dtype: str, spec: dict | None, chats: list, batch: int, max_tokens: int) -> dict:
    with LLM(model, dtype=dtype, speculative_config=spec) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        llm.chat([[{"role": "user", "content": "warm up"}]], params, use_tqdm=False)
        outputs, tokens, start = [], 0, time.perf_counter()
        for first in range(0, len(chats), batch):
            results = _batched(llm, chats[first : first + batch], params)
            outputs += [r.outputs[0].token_ids for r in results]
            tokens += sum(len(r.outputs[0].token_ids) for r in results)
        seconds = time.perf_counter() - start
        stats = llm.engine.stats().spec_decode
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "outputs": outputs,
            "acceptance": stats.acceptance_rate if stats else None,
            "mean_accepted_length": stats.mean_accepted_length if stats else None}


def _batched(llm: LLM, group: list, params: SamplingParams) -> list:
    """A batch of conversations that may declare different tools: rendered one by one, run together."""
    from kserve.chat import ChatTemplate

    template = ChatTemplate.load(llm.engine.model_dir, dialect=llm.engine.model_config.chat_dialect)
    prompts = [template.encode(llm.tokenizer, [{"role": "user", "content": text}], tools=tools or None)
               for text, tools in group]
    return llm.generate(prompts, params, use_tqdm=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the embedded tiny model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    spec = json.loads(args.spec)
    rows = []
    for kind, chats in (("copy", COPY), ("fresh", FRESH)):
        for batch in (1, 8):
            plain = run(args.model, args.dtype, None, chats, batch, args.max_tokens)
            fast = run(args.model, args.dtype, spec, chats, batch, args.max_tokens)
            rows.append({"kind": kind, "batch": batch, "plain_tok_s": plain["tok_s"], "spec_tok_s": fast["tok_s"],
                         "ratio": fast["tok_s"] / plain["tok_s"], "acceptance": fast["acceptance"],
                         "mean_accepted_length": fast["mean_accepted_length"],
                         "same_output": plain["outputs"] == fast["outputs"]})
    print(f"speculative decoding {spec['method']} k={spec['num_speculative_tokens']}, {args.dtype}, greedy, "
          f"max_tokens {args.max_tokens}")
    print("kind  | batch | plain tok/s | spec tok/s | ratio | acceptance | mean accepted length | same output")
    for r in rows:
        print(f"{r['kind']:5s} | {r['batch']:5d} | {r['plain_tok_s']:11.1f} | {r['spec_tok_s']:10.1f} | "
              f"{r['ratio']:5.2f} | {r['acceptance']:10.2f} | {r['mean_accepted_length']:20.2f} | {r['same_output']}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
