"""Grammar-masked decode against unmasked decode at batch 32, per engine step, same process.

Runs the same 32 prompts twice on the embedded tiny model (temperature 1.0, fixed seeds): once free,
once each request constrained by a JSON schema through xgrammar. Only decode steps with the full
batch are timed, so the ratio is the per-step cost of filling and applying the grammar bitmask.
With --tools the constraint is K2's tool-call grammar (tool_choice=required) instead.

    python benchmarks/bench_grammar.py [--batch 32] [--steps 48] [--tools] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kserve.chat.grammar import GrammarCompiler, GrammarSpec
from kserve.config import EngineConfig
from kserve.engine.llm_engine import LLMEngine
from kserve.engine.sampling_params import SamplingParams

# At least 100 notes: the grammar cannot complete, so every request stays live for the whole run.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
                                                     "minItems": 100}}, "required": ["notes"]}
TOOLS = [{"type": "function", "function": {"name": "log_notes", "parameters": SCHEMA}}]


def timed_steps(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], batch: int) -> list[float]:
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", ids, p)
    times: list[float] = []
    while engine.has_unfinished():
        running = engine.stats().num_running
        start = time.perf_counter()
        engine.step()
        if running == batch:
            times.append(time.perf_counter() - start)
    return times[1:]  # the first full step still prefills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--tools", action="store_true")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    engine = LLMEngine.from_config(EngineConfig(model=args.model, dtype="float32", device="cpu"))
    tok = engine.tokenizer
    compiler = GrammarCompiler(tok, engine.model_config.vocab_size)
    spec = GrammarSpec.tools(TOOLS, "required") if args.tools else GrammarSpec.json_schema(SCHEMA)
    guided = compiler.compile(spec)
    prompts = [tok.encode(f"Note {i}: write something.") for i in range(args.batch)]

    def params(grammar) -> list[SamplingParams]:
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=args.steps, ignore_eos=grammar is None,
                               skip_special_tokens=False, guided=grammar) for i in range(args.batch)]

    timed_steps(engine, prompts, params(None), args.batch)  # warm-up
    free, masked = [], []
    for _ in range(2):  # alternate, so load changes on a shared machine hit both alike
        free += timed_steps(engine, prompts, params(None), args.batch)
        masked += timed_steps(engine, prompts, params(guided), args.batch)
    free_ms, masked_ms = statistics.median(free) * 1e3, statistics.median(masked) * 1e3
    print(json.dumps({
        "batch": args.batch, "grammar": spec.kind, "free_step_ms": round(free_ms, 3),
        "masked_step_ms": round(masked_ms, 3), "ratio": round(masked_ms / free_ms, 3),
        "free_steps": len(free), "masked_steps": len(masked),
    }))


if __name__ == "__main__":
    main()
