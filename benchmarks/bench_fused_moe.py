"""CPU speed of the loop-free torch fused MoE against the per-expert Python loop it replaces.

The baseline is the loop RoutedExperts.forward ran before fused_moe existed (one `unique().tolist()`
per layer, one `where` + two linears per hit expert; FP8 experts dequantized one at a time). Both run
in the same process on the same inputs, interleaved; each time is the best of all repetitions (the
least disturbed by other load on a shared machine) and the ratio is baseline time / fused time (> 1 means
fused_moe_torch is faster). Usage: python benchmarks/bench_fused_moe.py [--reps N] [--threads N]
[--filter TEXT]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kserve.kernels.fp8_dequant import dequantize_blocks, quantize_blocks_torch
from kserve.kernels.fused_moe import fused_moe_torch


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: int
    dtype: torch.dtype
    fp8: bool


def per_expert_loop(x, w13, w2, weights, ids, first_expert, w13_scale=None, w2_scale=None, block=(128, 128)):
    out = torch.zeros_like(x)
    local_ids = ids - first_expert
    for e in torch.unique(local_ids).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        token_idx, slot = torch.where(local_ids == e)
        if w13_scale is None:
            w_gate_up, w_down = w13[e], w2[e]
        else:
            w_gate_up = dequantize_blocks(w13[e], w13_scale[e], block, x.dtype)
            w_down = dequantize_blocks(w2[e], w2_scale[e], block, x.dtype)
        gate, up = F.linear(x[token_idx], w_gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down)
        out.index_put_((token_idx,), y * weights[token_idx, slot, None].to(y.dtype), accumulate=True)
    return out


def make_inputs(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    e, h, i = case.experts, case.hidden, case.inter
    x = torch.randn(case.tokens, h, generator=gen).to(case.dtype)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    scores = torch.randn(case.tokens, e, generator=gen)
    weights, ids = scores.sigmoid().topk(case.top_k, dim=-1)
    if not case.fp8:
        return x, w13.to(case.dtype), w2.to(case.dtype), weights, ids, None, None
    q13, s13 = zip(*(quantize_blocks_torch(w) for w in w13))
    q2, s2 = zip(*(quantize_blocks_torch(w) for w in w2))
    return x, torch.stack(q13), torch.stack(q2), weights, ids, torch.stack(s13), torch.stack(s2)


def timed(fn, reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def run(case: Case, reps: int) -> dict:
    x, w13, w2, weights, ids, s13, s2 = make_inputs(case)
    args = (x, w13, w2, weights, ids, 0, s13, s2)
    loop_times, fused_times = [], []
    for _ in range(3):  # interleave, so load from other processes hits both alike
        loop_times += timed(lambda: per_expert_loop(*args), reps)
        fused_times += timed(lambda: fused_moe_torch(*args), reps)
    loop_t, fused_t = min(loop_times), min(fused_times)
    err = (per_expert_loop(*args).float() - fused_moe_torch(*args).float()).abs().max().item()
    return {"loop_ms": loop_t * 1e3, "fused_ms": fused_t * 1e3, "ratio": loop_t / fused_t, "max_abs_diff": err}


CASES = [
    Case(f"{geom} {dt_name}{' fp8' if fp8 else ''} T={t}", e, k, h, i, t, dt, fp8)
    for geom, e, k, h, i in (("tiny", 16, 4, 256, 128), ("h2048", 16, 4, 2048, 1024), ("h2048-e64", 64, 6, 2048, 1408))
    for dt_name, dt, fp8 in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False), ("fp32", torch.float32, True))
    for t in (1, 64)
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--filter", default="", help="run only cases whose name contains this")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{'case':32s} {'loop ms':>9s} {'fused ms':>9s} {'ratio':>6s} {'max|diff|':>10s}")
    for case in CASES:
        if args.filter not in case.name:
            continue
        r = run(case, args.reps)
        print(f"{case.name:32s} {r['loop_ms']:9.3f} {r['fused_ms']:9.3f} {r['ratio']:6.2f} {r['max_abs_diff']:10.2e}", flush=True)


if __name__ == "__main__":
    main()
