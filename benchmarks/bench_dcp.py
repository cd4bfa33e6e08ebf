"""Decode context parallelism's cost per decode step on the CPU, per layer, at K2's attention widths.

Ranks are gloo processes on loopback. Each measures, for a batch of decode rows at one context length:
- DCP 1 (the baseline in the same run): this rank's heads over the whole context (`mla_decode`);
- DCP N: the head all-gather, the group's heads over this rank's 1/N of the context (`mla_decode` with
  log-sum-exp), and the merge (LSE all-gather, rescale, reduce-scatter) -- split into its parts.
The tensor-parallel size equals the DCP size here; heads per rank default to K2's at TP 8 (8).

    python benchmarks/bench_dcp.py [--ranks 2] [--batch 1 64] [--context 4096] [--heads 8] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kserve.distributed import ContextParallelGroup
from kserve.kernels.mla_decode import mla_decode
from kserve.layers.mla_attention import gather_heads, merge_context_parallel

LATENT, ROPE, BLOCK = 512, 64, 16


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _rank(rank: int, args: argparse.Namespace, init: str, out_path: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.ranks))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=300))
    group = ContextParallelGroup(args.ranks, rank, dist.group.WORLD)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator().manual_seed(rank)
    results = []
    for batch in args.batch:
        per = -(-args.context // BLOCK)
        cache = (torch.randn(batch * per, BLOCK, LATENT + ROPE, generator=gen) * 0.5).to(dtype)
        tables = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
        q_lat = torch.randn(batch, args.heads, LATENT, generator=gen).to(dtype)
        q_pe = torch.randn(batch, args.heads, ROPE, generator=gen).to(dtype)
        whole = torch.full((batch,), args.context, dtype=torch.int32)
        share = torch.full((batch,), group.local_len(args.context), dtype=torch.int32)
        query = gather_heads(torch.cat([q_lat, q_pe], dim=-1), group)
        partial_out, lse = mla_decode(query[..., :LATENT], query[..., LATENT:], cache, tables, share, 0.1, 1.0, True)

        def dcp_step():
            q = gather_heads(torch.cat([q_lat, q_pe], dim=-1), group)
            o, s = mla_decode(q[..., :LATENT], q[..., LATENT:], cache, tables, share, 0.1, 1.0, True)
            return merge_context_parallel(o, s, group)

        row = {
            "batch": batch,
            "dcp1_ms": _median_ms(lambda: mla_decode(q_lat, q_pe, cache, tables, whole, 0.1, 1.0), args.iters),
            "gather_heads_ms": _median_ms(lambda: gather_heads(torch.cat([q_lat, q_pe], dim=-1), group), args.iters),
            "local_attention_ms": _median_ms(
                lambda: mla_decode(query[..., :LATENT], query[..., LATENT:], cache, tables, share, 0.1, 1.0, True),
                args.iters),
            "merge_ms": _median_ms(lambda: merge_context_parallel(partial_out, lse, group), args.iters),
            "dcp_total_ms": _median_ms(dcp_step, args.iters),
        }
        results.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(args, os.path.join(tmp, "init"), out), nprocs=args.ranks, join=True)
        with open(out) as f:
            results = json.load(f)
    print(f"DCP {args.ranks} vs DCP 1 per layer, {args.heads} heads/rank, context {args.context}, {args.dtype}, "
          f"gloo over loopback, {args.ranks} processes")
    print("batch | DCP 1 ms | DCP: gather heads | local attention | merge | total ms | merge share")
    for r in results:
        print(f"{r['batch']:5d} | {r['dcp1_ms']:8.3f} | {r['gather_heads_ms']:17.3f} | {r['local_attention_ms']:15.3f} "
              f"| {r['merge_ms']:5.3f} | {r['dcp_total_ms']:8.3f} | {r['merge_ms'] / r['dcp_total_ms']:.0%}")
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
