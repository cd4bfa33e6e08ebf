"""Per-step CPU overhead of the engine at batch 256: scheduler, batch building, sampler, detokenizer.

The model forward is replaced by a stub that returns fixed logits, so what is timed is everything
the engine does around the model in a decode step. Uses the embedded tiny model's tokenizer and
vocabulary unless --tokenizer names another (../shared/kimi_k2: K2's 163840; on a CPU "device" the sampler's math over
that vocabulary then shows up here too, while on a GPU it is device time).

    python benchmarks/bench_scheduler.py [--batch 256] [--steps 200] [--mixed]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from dataclasses import replace

import torch

from kserve.config import EngineConfig
from kserve.engine.llm_engine import LLMEngine
from kserve.engine.sampling_params import SamplingParams


class FixedLogitsModel:
    """Stands in for the model: no compute, the same random logits every step."""

    def __init__(self, config, batch: int, seed: int = 0) -> None:
        self.config = config
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(batch, config.vocab_size, generator=g) * 4

    def __call__(self, input_ids, batch, kv_cache):
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


def timed(obj, name: str, totals: dict) -> None:
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[name] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer dir with its vocabulary size, e.g. ../shared/kimi_k2 for K2's 163840")
    ap.add_argument("--mixed", action="store_true", help="half the rows sample with top_p/top_k, seeds, stop strings")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kserve.chat import load_tokenizer
    from kserve.config import ModelConfig
    from kserve.tiny import embedded_model_dir

    model_dir = embedded_model_dir()
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    config = ModelConfig.from_model_dir(args.tokenizer or model_dir)
    # a one-layer, narrow cache: the stub never reads it
    config = replace(config, num_hidden_layers=1, kv_lora_rank=4, qk_rope_head_dim=4)
    tokens_per_seq = args.prompt_len + args.steps + 24
    engine_config = EngineConfig(block_size=16, num_kv_blocks=args.batch * (tokens_per_seq // 16 + 2),
                                 max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len)
    engine = LLMEngine(FixedLogitsModel(config, args.batch), config, tokenizer, engine_config, model_dir)

    rng = random.Random(0)
    text_vocab = min(config.vocab_size, tokenizer.vocab_size) - 300  # ordinary (non-special) ids
    for i in range(args.batch):
        prompt = [rng.randrange(1, text_vocab) for _ in range(args.prompt_len)]
        if args.mixed and i % 2:
            params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, max_tokens=args.steps + 20,
                                    ignore_eos=True, stop=["never appears\u2603"], logprobs=2)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # every prompt prefills in this one step
    assert all(s.num_computed_tokens == s.num_prompt_tokens for s in engine.scheduler.running)

    totals: dict[str, float] = defaultdict(float)
    timed(engine.scheduler, "schedule", totals)
    timed(engine.runner, "prepare", totals)
    timed(engine.runner, "execute", totals)
    timed(engine.sampler, "sample", totals)
    timed(engine.output_processor, "append_token", totals)
    for _ in range(5):
        engine.step()
    totals.clear()
    step_s = snapshot_s = 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        changed = engine.step()
        t1 = time.perf_counter()
        for request in changed:  # what the async engine hands the server after each step
            request.output()
        t2 = time.perf_counter()
        step_s += t1 - t0
        snapshot_s += t2 - t1
    per_step_ms = 1e3 * step_s / args.steps
    assert len(engine.scheduler.running) == args.batch
    print(f"batch {args.batch}, vocab {config.vocab_size}, {'mixed' if args.mixed else 'greedy'} sampling, "
          f"{args.steps} decode steps, {torch.get_num_threads()} torch thread(s)")
    print(f"engine step overhead (scheduler + batch building + sampler + detokenize/stop): "
          f"{per_step_ms:.2f} ms/step (target < 2 ms)")
    print(f"  + streaming snapshots (RequestOutput per request, async engine only): "
          f"{1e3 * snapshot_s / args.steps:.2f} ms/step")
    for name, label in [("schedule", "scheduler"), ("prepare", "step inputs (host lists)"),
                        ("execute", "ForwardBatch tensors + stub"),
                        ("sample", "sampler"), ("append_token", "detokenizer + stop checks")]:
        print(f"  {label:28s} {1e3 * totals[name] / args.steps:7.3f} ms/step")


if __name__ == "__main__":
    main()
