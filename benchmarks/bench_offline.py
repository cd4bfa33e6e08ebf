"""Offline throughput: kserve's LLM.generate vs transformers' generate on the same tiny checkpoint.

256 prompts with input lengths uniform in [32, 512] tokens and output lengths uniform in [32, 256]
(ignore_eos, greedy). transformers runs a random subsample of the same requests one at a time
(its `generate` has no per-request output length inside a batch), half before and half after
kserve; both sides are reported in output tokens per second, and the ratio compares those rates.

    python benchmarks/bench_offline.py [--num-prompts 256] [--hf-prompts 8]
"""

from __future__ import annotations

import argparse
import random
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
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kserve.engine.llm import LLM
    from kserve.engine.sampling_params import SamplingParams
    from kserve.model.hf_reference import build_hf_reference

    llm = LLM(args.model, dtype="float32", device="cpu", max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = llm.engine.model_config.vocab_size
    requests = make_requests(args.num_prompts, args.seed, vocab - 300)
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for _, out in requests]

    hf = build_hf_reference(llm.engine.model_dir).eval()
    sub = random.Random(args.seed + 1).sample(range(len(requests)), min(args.hf_prompts, len(requests)))
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

    llm.generate([requests[0][0][:32]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=True)
    kserve_s = time.perf_counter() - t0
    kserve_tokens = sum(len(o.token_ids) for o in outs)
    assert kserve_tokens == sum(out for _, out in requests)
    kserve_rate = kserve_tokens / kserve_s
    stats = llm.engine.stats()
    print(f"kserve: {len(requests)} requests, {kserve_tokens} output tokens in {kserve_s:.1f} s "
          f"= {kserve_rate:.1f} tok/s (preemptions {stats.num_preemptions}, "
          f"kv blocks {stats.kv_blocks_total})")

    run_hf(sub[len(sub) // 2 :])
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
