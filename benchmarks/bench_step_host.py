"""Host time per decode step at batch 256 with K2's vocabulary (163840): scheduler, runner step
preparation (host lists, then either the ForwardBatch or the CUDA-graph static-buffer fill), sampler.

The model is a stub (no compute; fixed logits), so what is timed is what the host does around the
forward. On this CPU the sampler's math over 256 x 163840 logits is also host time; on a GPU it is
device time, so it is reported on its own line. Token ids are plain integers: no tokenizer runs
(detokenization is the output processor's, measured by bench_scheduler.py).

    python benchmarks/bench_step_host.py [--batch 256] [--steps 100] [--vocab 163840] [--context 2048]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kserve.config import ModelConfig
from kserve.engine.block_manager import BlockManager
from kserve.engine.model_runner import ModelRunner
from kserve.engine.sampler import Sampler
from kserve.engine.sampling_params import SamplingParams
from kserve.engine.scheduler import Scheduler
from kserve.engine.sequence import Sequence


class StubModel:
    """No compute: hidden rows of zeros, the same random logits every step."""

    def __init__(self, config: ModelConfig, batch: int) -> None:
        self.config = config
        g = torch.Generator().manual_seed(0)
        self.logits = torch.randn(batch, config.vocab_size, generator=g) * 4

    def __call__(self, input_ids, batch, kv_cache):
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--context", type=int, default=2048, help="tokens already in each sequence")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    # one narrow layer: the stub never reads the cache, only its block tables matter
    config = ModelConfig(vocab_size=args.vocab, num_hidden_layers=1, kv_lora_rank=4, qk_rope_head_dim=4,
                         max_position_embeddings=1 << 20)
    bs = args.block_size
    blocks_per_seq = (args.context + args.steps + 8) // bs + 2
    num_blocks = args.batch * blocks_per_seq
    manager = BlockManager(num_blocks, bs, enable_prefix_caching=False)
    scheduler = Scheduler(manager, args.batch, args.batch * args.context)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    seqs = []
    for i in range(args.batch):
        seq = Sequence(i, f"r{i}", 0, [rng.randrange(1, args.vocab) for _ in range(args.context)], params, i)
        seq.seed = i
        scheduler.add(seq)
        seqs.append(seq)
    out = scheduler.schedule()  # admit everything and mark the prompts computed without a forward
    assert len(out.scheduled) == args.batch
    scheduler.finish_step(out)
    for seq in seqs:
        seq.token_ids.append(rng.randrange(1, args.vocab))

    runners = {
        "eager": ModelRunner(StubModel(config, args.batch), config, num_blocks, bs, torch.device("cpu"), torch.float32,
                             max_num_seqs=args.batch, max_model_len=blocks_per_seq * bs),
        "static (CUDA-graph inputs)": ModelRunner(
            StubModel(config, args.batch), config, num_blocks, bs, torch.device("cpu"), torch.float32,
            max_num_seqs=args.batch, max_model_len=blocks_per_seq * bs, static_decode=True,
        ),
    }
    sampler = Sampler([], torch.device("cpu"))
    print(f"batch {args.batch}, vocab {args.vocab}, context {args.context}, block size {bs}, "
          f"{args.steps} decode steps, {torch.get_num_threads()} torch thread(s)")
    times: dict[str, list[float]] = {"schedule": [], "sample": []}
    for name in runners:
        times[name + " prepare"], times[name + " execute"] = [], []
    names = list(runners)
    for step in range(args.steps + 5):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        dt = {"schedule": time.perf_counter() - t0}
        assert len(out.scheduled) == args.batch
        logits = None
        for name in names if step % 2 else names[::-1]:  # alternate which runner goes first
            runner = runners[name]
            t1 = time.perf_counter()
            inputs = runner.prepare(out.scheduled)
            t2 = time.perf_counter()
            logits = runner.execute(inputs)
            t3 = time.perf_counter()
            dt[name + " prepare"], dt[name + " execute"] = t2 - t1, t3 - t2
        t4 = time.perf_counter()
        sampled = sampler.sample(logits, [item.seq for item in out.scheduled])
        dt["sample"] = time.perf_counter() - t4
        scheduler.finish_step(out)
        for item, token in zip(out.scheduled, sampled.token_ids):
            item.seq.token_ids.append(int(token))
        if step >= 5:
            for key, value in dt.items():
                times[key].append(value * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"  scheduler                              {med['schedule']:7.3f} ms/step (median)")
    for name in names:
        host = med["schedule"] + med[name + " prepare"] + med[name + " execute"]
        print(f"  {name} runner:")
        print(f"    prepare (host lists, decodes first)  {med[name + ' prepare']:7.3f} ms")
        print(f"    execute (step metadata + stub)       {med[name + ' execute']:7.3f} ms")
        print(f"    host total with the scheduler        {host:7.3f} ms/step")
    print(f"  sampler over {args.batch} x {args.vocab} logits: {med['sample']:.3f} ms/step (device work on a GPU)")


if __name__ == "__main__":
    main()
