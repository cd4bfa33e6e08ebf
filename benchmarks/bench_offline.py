"""Offline throughput: kserve's LLM.generate vs transformers' generate on the same tiny checkpoint.

256 prompts with input lengths uniform in [32, 512] tokens and output lengths uniform in [32, 256]
(ignore_eos, greedy). transformers runs a random subsample of the same requests one at a time
(its `generate` has no per-request output length inside a batch), half before and half after
kserve; both sides are reported in output tokens per second, and the ratio compares those rates.

    python benchmarks/bench_offline.py [--num-prompts 256] [--hf-prompts 8]

`--batch-invariant` also runs the same requests through a second engine with `batch_invariant=True` and
reports its throughput as a ratio to the default engine's (`--repeats N`: N alternating runs of each,
medians; `--hf-prompts 0` skips transformers). `--dtype bfloat16` runs both engines in bf16.

    python benchmarks/bench_offline.py --batch-invariant --hf-prompts 0 [--dtype bfloat16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def make_requests(num: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(10, vocab) for _ in range(rng.randint(32, 512))], rng.randint(32, 256))
        for _ in range(num)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the embedded tiny model)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--hf-prompts", type=int, default=8, help="requests transformers runs (subsample)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-invariant", action="store_true",
                    help="also measure LLM(batch_invariant=True) on the same requests, as a ratio to the default")
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs of each engine (medians)")
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="per engine (default: from kv_cache_cpu_bytes)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kserve.engine.llm import LLM
    from kserve.engine.sampling_params import SamplingParams
    from kserve.model.hf_reference import build_hf_reference

    knobs = {"dtype": args.dtype, "device": "cpu", "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.num_kv_blocks:
        knobs["num_kv_blocks"] = args.num_kv_blocks
    llm = LLM(args.model, **knobs)
    vocab = llm.engine.model_config.vocab_size
    requests = make_requests(args.num_prompts, args.seed, vocab - 300)
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for _, out in requests]

    sub = random.Random(args.seed + 1).sample(range(len(requests)), min(args.hf_prompts, len(requests)))
    hf = build_hf_reference(llm.engine.model_dir).eval() if sub else None
    hf_new: dict[int, list[int]] = {}
    hf_s = 0.0

    def run_hf(indices: list[int]) -> None:
        nonlocal hf_s
        with torch.inference_mode():
            for i in indices:
                prompt, out_len = requests[i]
                ids = torch.tensor([prompt])
                t0 = time.perf_counter()
                gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                  min_new_tokens=out_len, do_sample=False, pad_token_id=0)
                hf_s += time.perf_counter() - t0
                hf_new[i] = gen[0, len(prompt):].tolist()

    # transformers runs half its share before kserve and half after, so that a machine whose load
    # drifts during the run does not favour either side
    run_hf(sub[: len(sub) // 2])

    def run_kserve(engine: LLM, label: str) -> tuple[float, float, list]:
        """(output tokens per wall second, per CPU second of this process, outputs)."""
        engine.generate([requests[0][0][:32]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        result = engine.generate([p for p, _ in requests], params, use_tqdm=True)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = sum(len(o.token_ids) for o in result)
        assert tokens == sum(out for _, out in requests)
        stats = engine.engine.stats()
        print(f"kserve{label} ({args.dtype}): {len(requests)} requests, {tokens} output tokens in {seconds:.1f} s "
              f"= {tokens / seconds:.1f} tok/s, {cpu:.1f} CPU s (preemptions {stats.num_preemptions}, "
              f"kv blocks {stats.kv_blocks_total})")
        return tokens / seconds, tokens / cpu, result

    invariant = LLM(args.model, batch_invariant=True, **knobs) if args.batch_invariant else None
    default_rates: list[tuple[float, float]] = []
    ratios: list[tuple[float, float]] = []
    invariant_outs: list = []
    for _ in range(max(1, args.repeats)):  # alternating, so that load drifting during the run favours neither
        rate, cpu_rate, outs = run_kserve(llm, "")
        default_rates.append((rate, cpu_rate))
        if invariant is not None:
            inv_rate, inv_cpu_rate, invariant_outs = run_kserve(invariant, " batch-invariant")
            ratios.append((inv_rate / rate, inv_cpu_rate / cpu_rate))
    kserve_rate = statistics.median(r for r, _ in default_rates)
    if invariant is not None:
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs, invariant_outs))
        wall = statistics.median(r for r, _ in ratios)
        cpu = statistics.median(c for _, c in ratios)
        print(f"batch-invariant / default throughput ({args.dtype}, {torch.get_num_threads()} threads, median of "
              f"{len(ratios)} back-to-back pairs): {wall:.2f}x wall clock, {cpu:.2f}x per CPU second "
              f"(greedy outputs identical to the default's: {same}/{len(requests)})")

    run_hf(sub[len(sub) // 2 :])
    if not hf_new:
        return
    hf_tokens = sum(len(v) for v in hf_new.values())
    agree = 0  # greedy tokens equal to kserve's up to the first difference
    for i, new in hf_new.items():
        for a, b in zip(new, outs[i].token_ids):
            if a != b:
                break
            agree += 1
    hf_rate = hf_tokens / hf_s
    print(f"transformers generate: {len(sub)} requests (batch 1), {hf_tokens} output tokens in "
          f"{hf_s:.1f} s = {hf_rate:.1f} tok/s; leading greedy tokens equal to kserve's: {agree}/{hf_tokens}")
    print(f"throughput ratio kserve / transformers: {kserve_rate / hf_rate:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
