"""GPU check: one prepared command that shows whether the CUDA path is right and how close it is to the
hardware's limits, within 8 minutes on one H200.

    python benchmarks/gpu_check.py [--out DIR] [--dry-run]

Stages (each bounded in iterations and in time; a stage or row that cannot run records
"skipped: <reason>" or "error: <message>" and the rest go on):
1. env: GPU, memory, torch / Triton / flash-attn versions; measured device copy bandwidth and bf16
   GEMM rate (the limits the later stages are compared with).
2. correctness: block-FP8 GEMM (and its activation quantization), fused MoE (FP8 and W4A16), MLA decode
   (bf16 and FP8 cache) and prefill attention, each against its torch reference at K2 sizes, with real
   float8_e4m3fn and bf16 tensors.
3. kernel_speed: MLA decode in GB/s against copy bandwidth; the fused MoE for one rank's share of K2
   (48 of 384 experts) against its weight-bytes floor and a per-expert loop; the W4A16 MoE (INT4 experts,
   K2.6's group of 32) against its packed-bytes floor at H200's 4.8 TB/s and against dequantizing the hit
   experts to bf16 and running the bf16 fused MoE; the block-FP8 GEMM against torch._scaled_mm and bf16
   matmul.
4. decode_step: a 4-layer model at K2 width as rank 0 of 8 sees it (random FP8 weights, collectives
   off), at batch 1 / 64 / 256, eager and CUDA graph, against its bandwidth floor.
5. serve_bench: `kserve serve` on the embedded tiny model, concurrency 1 and 16, CUDA graphs on and off.

Writes DIR/gpu_check.json and DIR/gpu_check_kernels.png (when matplotlib is installed) and prints one
table. `--dry-run` runs every stage with small shapes on the CPU (Triton kernels under
TRITON_INTERPRET=1 with fp32 containers of FP8 values), so the script keeps working without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: the env stage reports a missing or broken one
    import torch

    from kserve.config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
K2_CONFIG = REPO_ROOT / "configs" / "kimi-k2-instruct.json"
# K2.6's published vision_config (the tower's shapes; the device machine may not have ../shared)
K26_VISION = {
    "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool", "mm_hidden_size": 1152, "mm_projector_type": "patchmerger", "patch_size": 14,
    "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
    "text_hidden_size": 7168, "video_attn_type": "spatial_temporal", "vt_hidden_size": 1152,
    "vt_intermediate_size": 4304, "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27,
}
STAGES = ("env", "correctness", "kernel_speed", "decode_step", "serve_bench")
# (name, N, K) of K2's FP8 linears as one TP8 rank holds them: attention projections and the dense MLP
K2_INT4_GROUP = 32  # K2-Thinking / K2.5 / K2.6 routed experts: pack-quantized INT4, one bf16 scale per 32 inputs
H200_HBM_GBPS = 4800.0  # nominal HBM3e bandwidth: the W4A16 MoE's packed-bytes floor on the GPU
K2_GEMM_SHAPES = (
    ("q_a_proj", 1536, 7168), ("kv_a_proj_with_mqa", 576, 7168), ("q_b_proj", 1536, 1536),
    ("o_proj", 7168, 1024), ("dense gate_up", 4608, 7168), ("dense down", 7168, 2304),
)


@dataclass
class Plan:
    """Every size and bound of one run; `gpu()` and `dry_run()` are the two plans."""

    dry_run: bool
    device: str
    budgets_s: dict[str, float]  # per stage; rows past the budget are skipped, saying so
    iters: int
    warmup: int
    copy_bytes: int
    gemm_square: int
    # (name, N, K) of one rank of 8's block-FP8 linears
    gemm_shapes: list[tuple[str, int, int]]
    gemm_speed_shapes: list[tuple[str, int, int]]
    gemm_tokens: list[int]
    correct_tokens: list[int]
    moe_experts_local: int
    moe_experts_total: int
    moe_hidden: int
    moe_intermediate: int
    moe_top_k: int
    moe_tokens: list[int]
    mla_heads: int
    mla_latent: int
    mla_rope: int
    mla_block_size: int
    mla_batches: list[int]
    mla_contexts: list[int]
    mla_correct_lens: list[int]
    prefill_heads: int
    prefill_lens: list[tuple[int, int]]  # (query_len, context_len) per sequence
    decode_batches: list[int]
    decode_context: int
    decode_layers: int
    serve_concurrency: list[int]
    serve_prompts: int
    serve_output_len: int
    serve_input_len: int
    serve_startup_timeout_s: float
    rotate_bytes: int  # keep rotating inputs until a timed loop touches this many bytes (defeats L2)
    dcp_size: int = 8  # decode context parallelism: one rank of a group this size
    long_prefill: tuple[int, int, int] = (2048, 131072, 8192)  # (new tokens, cached context, context chunk)

    @staticmethod
    def gpu() -> Plan:
        return Plan(
            dry_run=False, device="cuda",
            # 455 s in all; a stage may overrun its budget by one row
            budgets_s={"env": 20, "correctness": 75, "kernel_speed": 140, "decode_step": 100, "serve_bench": 120},
            iters=20, warmup=3, copy_bytes=1 << 30, gemm_square=8192,
            gemm_shapes=list(K2_GEMM_SHAPES), gemm_tokens=[1, 64, 256], correct_tokens=[1, 64],
            gemm_speed_shapes=list(K2_GEMM_SHAPES),
            moe_experts_local=48, moe_experts_total=384, moe_hidden=7168, moe_intermediate=2048, moe_top_k=8,
            moe_tokens=[1, 64, 256],
            mla_heads=8, mla_latent=512, mla_rope=64, mla_block_size=16,
            mla_batches=[1, 64, 256], mla_contexts=[4096, 32768], mla_correct_lens=[1, 700, 4096, 2500],
            prefill_heads=8, prefill_lens=[(1000, 1000), (3000, 3000), (500, 2500)],
            decode_batches=[1, 64, 256], decode_context=2048, decode_layers=4,
            serve_concurrency=[1, 16], serve_prompts=16, serve_output_len=32, serve_input_len=64,
            serve_startup_timeout_s=120, rotate_bytes=256 << 20,
        )

    @staticmethod
    def dry() -> Plan:
        return Plan(
            dry_run=True, device="cpu",
            # generous: the dry run must reach every code path even on a loaded machine; its sizes bound it
            budgets_s={"env": 120, "correctness": 300, "kernel_speed": 300, "decode_step": 300, "serve_bench": 300},
            iters=1, warmup=1, copy_bytes=8 << 20, gemm_square=256,
            gemm_shapes=[("ragged", 160, 200), ("aligned", 256, 384)],
            gemm_tokens=[4], correct_tokens=[1, 3], gemm_speed_shapes=[("ragged", 160, 200)],
            moe_experts_local=4, moe_experts_total=32, moe_hidden=256, moe_intermediate=128, moe_top_k=4,
            moe_tokens=[4],
            mla_heads=8, mla_latent=64, mla_rope=16, mla_block_size=16,
            mla_batches=[4], mla_contexts=[64], mla_correct_lens=[1, 17, 40],
            prefill_heads=2, prefill_lens=[(5, 5), (9, 9), (3, 12)],
            decode_batches=[1, 4], decode_context=32, decode_layers=4,
            serve_concurrency=[1, 4], serve_prompts=4, serve_output_len=4, serve_input_len=8,
            serve_startup_timeout_s=90, rotate_bytes=0, long_prefill=(8, 320, 16),
        )


@dataclass
class Row:
    """One line of the summary table."""

    stage: str
    item: str
    value: str
    goal: str = ""
    status: str = "ok"  # ok | below goal | fail | error: ... | skipped: ...
    data: dict[str, Any] = field(default_factory=dict)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def spent(self) -> bool:
        return self.left() <= 0


# --- shared helpers ------------------------------------------------------------------------------------


def _torch() -> ModuleType:
    import torch

    return torch


def sync(device: str) -> None:
    if device == "cuda":
        _torch().cuda.synchronize()


def time_ms(calls: list[Callable[[], Any]], plan: Plan, iters: int | None = None) -> float:
    """Mean milliseconds per call, cycling through `calls` (different inputs, so caches do not help)."""
    torch = _torch()
    iters = iters or plan.iters
    for i in range(plan.warmup):
        calls[i % len(calls)]()
    sync(plan.device)
    if plan.device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            calls[i % len(calls)]()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for i in range(iters):
        calls[i % len(calls)]()
    return (time.perf_counter() - t0) * 1e3 / iters


def rotations(plan: Plan, bytes_per_call: int, cap: int = 8) -> int:
    if plan.rotate_bytes <= 0 or bytes_per_call <= 0:
        return 1
    return max(1, min(cap, math.ceil(plan.rotate_bytes / bytes_per_call)))


def fp8_container(plan: Plan) -> torch.dtype:
    """float8_e4m3fn on the GPU; fp32 holding FP8 values in the dry run (the Triton interpreter)."""
    torch = _torch()
    return torch.float32 if plan.dry_run else torch.float8_e4m3fn


def act_dtype(plan: Plan) -> torch.dtype:
    torch = _torch()
    return torch.float32 if plan.dry_run else torch.bfloat16


def random_fp8_weight(shape: tuple[int, ...], plan: Plan, gen: torch.Generator | None = None,
                      container: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block-FP8 weight [..., N, K] and fp32 scales [..., ceil(N/128), ceil(K/128)] with a real
    weight of about unit variance per output (scale ~ 1 / (64 sqrt(K)))."""
    torch = _torch()
    *lead, n, k = shape
    scale_shape = (*lead, -(-n // 128), -(-k // 128))
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=plan.device)
    rows = q.view(-1, n, k)
    for i in range(rows.shape[0]):  # one matrix at a time: bounded fp32 temporaries
        rows[i] = (torch.randn(n, k, device=plan.device, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (0.5 + torch.rand(scale_shape, device=plan.device, generator=gen)) / (64 * math.sqrt(k))
    container = container or fp8_container(plan)
    if container != torch.float8_e4m3fn:
        q = q.float().to(container)
    return q, scale.float()


def random_int4_experts(shape: tuple[int, ...], plan: Plan,
                        gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pack-quantized INT4 weight [..., N, K]: int32 words [..., N, K/8] (any word is eight valid
    nibbles) and bf16 scales [..., N, K/32] giving a real weight of about unit variance per output (uniform
    q in [-8, 7] has a standard deviation of about 4.6)."""
    torch = _torch()
    *lead, n, k = shape
    packed = torch.randint(-(2**31), 2**31, (*lead, n, k // 8), dtype=torch.int32, device=plan.device, generator=gen)
    scale = (0.5 + torch.rand((*lead, n, k // K2_INT4_GROUP), device=plan.device, generator=gen)) / (4.6 * math.sqrt(k))
    return packed, scale.bfloat16()


def rel_error(got, want) -> tuple[float, float]:
    diff = (got.double() - want.double())
    denom = want.double().norm().item() or 1.0
    return diff.norm().item() / denom, diff.abs().max().item()


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        _torch().cuda.empty_cache()


def import_or_skip(module: str, names: list[str]) -> tuple[Any | None, str]:
    """The module when it and every name in it exist; else None and the reason."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a missing or broken kernel module must not stop the check
        return None, f"skipped: {module} not importable ({type(exc).__name__}: {exc})"
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        return None, f"skipped: {module} has no {', '.join(missing)}"
    return mod, ""


def guarded(stage: str, item: str, rows: list[Row], budget: Budget, fn: Callable[[], list[Row]]) -> None:
    """Run one check; a time-out, skip or exception becomes a row, never an abort."""
    if budget.spent():
        rows.append(Row(stage, item, "-", status="skipped: stage time budget spent"))
        return
    try:
        rows.extend(fn())
    except Exception as exc:  # noqa: BLE001 - a failing stage is a row, not the end of the check
        rows.append(Row(stage, item, "-", status=f"error: {type(exc).__name__}: {str(exc)[:300]}"))


# --- stage 1: environment --------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def stage_env(plan: Plan, budget: Budget, limits: dict[str, float]) -> tuple[list[Row], dict[str, Any]]:
    torch = _torch()
    info: dict[str, Any] = {
        "device": plan.device, "torch": torch.__version__, "triton": _version("triton"),
        "flash_attn": _version("flash-attn") or _version("flash_attn"), "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu_name=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count, capability=list(torch.cuda.get_device_capability(0)),
            cuda=torch.version.cuda,
        )
        gpu = f"{props.name}, {info['gpu_memory_gib']} GiB, sm{props.major}{props.minor}"
    else:
        info.update(cpu=platform.machine(), cpu_threads=torch.get_num_threads())
        gpu = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    rows = [
        Row("env", "device", gpu),
        Row("env", "versions", f"torch {info['torch']}, triton {info['triton']}, flash-attn {info['flash_attn']}"),
    ]

    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device).fill_(1)
    dst = torch.empty_like(src)
    ms = time_ms([partial(dst.copy_, src)], plan)
    limits["copy_gbps"] = 2 * plan.copy_bytes / ms / 1e6  # read + write
    rows.append(Row("env", f"copy bandwidth ({plan.copy_bytes >> 20} MiB)", f"{limits['copy_gbps']:.0f} GB/s",
                    data={"gbps": limits["copy_gbps"], "ms": ms}))
    del src, dst

    n = plan.gemm_square
    a = torch.randn(n, n, device=plan.device).bfloat16()
    b = torch.randn(n, n, device=plan.device).bfloat16()
    ms = time_ms([partial(torch.matmul, a, b)], plan)
    limits["bf16_tflops"] = 2 * n**3 / ms / 1e9
    rows.append(Row("env", f"bf16 GEMM {n}^3", f"{limits['bf16_tflops']:.1f} TFLOP/s", data={"tflops": limits["bf16_tflops"]}))
    if plan.device == "cuda":
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            ms = time_ms([lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)], plan)
            limits["fp8_tflops"] = 2 * n**3 / ms / 1e9
            rows.append(Row("env", f"fp8 _scaled_mm {n}^3 (tensor-wise)", f"{limits['fp8_tflops']:.1f} TFLOP/s"))
        except Exception as exc:  # noqa: BLE001 - any _scaled_mm failure means: skip
            rows.append(Row("env", "fp8 _scaled_mm", "-", status=f"skipped: {type(exc).__name__}: {str(exc)[:120]}"))
    del a, b
    release(plan.device)
    info.update(limits)
    return rows, info


# --- stage 2: correctness --------------------------------------------------------------------------------


def _verdict(rel: float, tol: float) -> str:
    return "ok" if rel <= tol else "fail"


def check_fp8_gemm(plan: Plan) -> list[Row]:
    torch = _torch()
    mod, why = import_or_skip("kserve.kernels.fp8_gemm", ["w8a8_block_matmul_torch", "w8a8_block_matmul_triton",
                                                          "quantize_per_token_group_triton"])
    if mod is None:
        return [Row("correctness", "block-FP8 GEMM", "-", status=why)]
    from kserve.kernels.fp8_quant import quantize_per_token_group_torch

    rows = []
    gen = torch.Generator(device=plan.device).manual_seed(0)
    # bf16 output rounding is 2^-9 relative per element; fp32 containers compute the same math exactly.
    tol = 1e-5 if plan.dry_run else 8e-3
    for name, n, k in plan.gemm_shapes:
        w, s = random_fp8_weight((n, k), plan, gen)
        for m in plan.correct_tokens:
            x = (torch.randn(m, k, device=plan.device, generator=gen) * 3).to(act_dtype(plan))
            want = mod.w8a8_block_matmul_torch(x, w, s, out_dtype=torch.float32)
            got = mod.w8a8_block_matmul_triton(x, w, s, out_dtype=act_dtype(plan))
            rel, mx = rel_error(got.float(), want)
            q, qs = mod.quantize_per_token_group_triton(x, out_dtype=fp8_container(plan))
            rq, rqs = quantize_per_token_group_torch(x)
            quant_mismatch = int((q.float() != rq.float()).sum().item() + (qs != rqs).sum().item())
            status = _verdict(rel, tol) if quant_mismatch == 0 else "fail"
            rows.append(Row("correctness", f"fp8 GEMM {name} M={m} N={n} K={k}",
                            f"rel {rel:.2e}, quant mismatches {quant_mismatch}", f"rel <= {tol:g}, 0 mismatches",
                            status, {"rel": rel, "max_abs": mx, "quant_mismatches": quant_mismatch}))
    return rows


def _moe_inputs(plan: Plan, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    torch = _torch()
    e, h, i = plan.moe_experts_local, plan.moe_hidden, plan.moe_intermediate
    w13, s13 = random_fp8_weight((e, 2 * i, h), plan, gen)
    w2, s2 = random_fp8_weight((e, h, i), plan, gen)
    x = torch.randn(tokens, h, device=plan.device, generator=gen).to(act_dtype(plan))
    ids, weights = _routing(plan, tokens, gen)
    return x, w13, s13, w2, s2, ids, weights


def _routing(plan: Plan, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random top-k over all experts (this rank holds the first moe_experts_local)."""
    torch = _torch()
    scores = torch.rand(tokens, plan.moe_experts_total, device=plan.device, generator=gen)
    weights, ids = scores.topk(plan.moe_top_k, dim=-1)
    return ids, (weights / weights.sum(-1, keepdim=True)).float()


def check_fused_moe(plan: Plan) -> list[Row]:
    torch = _torch()
    mod, why = import_or_skip("kserve.kernels.fused_moe", ["fused_moe_torch", "fused_moe_triton"])
    if mod is None:
        return [Row("correctness", "fused MoE", "-", status=why)]
    gen = torch.Generator(device=plan.device).manual_seed(1)
    tokens = plan.correct_tokens[-1]
    x, w13, s13, w2, s2, ids, weights = _moe_inputs(plan, tokens, gen)
    if not bool((ids[0] == 0).any()):
        ids[0, 0] = 0  # at least one pair on this rank
    want = mod.fused_moe_torch(x, w13, w2, weights, ids, 0, s13, s2)
    got = mod.fused_moe_triton(x, w13, w2, weights, ids, 0, s13, s2)
    rel, mx = rel_error(got.float(), want.float())
    tol = 1e-4 if plan.dry_run else 1.5e-2
    local_pairs = int((ids < plan.moe_experts_local).sum().item())
    return [Row("correctness", f"fused MoE T={tokens} E={plan.moe_experts_local}/{plan.moe_experts_total} "
                f"H={plan.moe_hidden} I={plan.moe_intermediate}", f"rel {rel:.2e} ({local_pairs} local pairs)",
                f"rel <= {tol:g}", _verdict(rel, tol), {"rel": rel, "max_abs": mx})]


def check_w4a16_moe(plan: Plan) -> list[Row]:
    torch = _torch()
    mod, why = import_or_skip("kserve.kernels.fused_moe_w4a16", ["fused_moe_w4a16_torch", "fused_moe_w4a16_triton"])
    if mod is None:
        return [Row("correctness", "W4A16 MoE", "-", status=why)]
    gen = torch.Generator(device=plan.device).manual_seed(6)
    tokens = plan.correct_tokens[-1]
    e, h, i = plan.moe_experts_local, plan.moe_hidden, plan.moe_intermediate
    w13, s13 = random_int4_experts((e, 2 * i, h), plan, gen)
    w2, s2 = random_int4_experts((e, h, i), plan, gen)
    x = torch.randn(tokens, h, device=plan.device, generator=gen).to(act_dtype(plan))
    ids, weights = _routing(plan, tokens, gen)
    if not bool((ids[0] < e).any()):
        ids[0, 0] = 0  # at least one pair on this rank
    args = (x, w13, w2, weights, ids, 0, s13, s2, K2_INT4_GROUP)
    want = mod.fused_moe_w4a16_torch(*args)
    got = mod.fused_moe_w4a16_triton(*args)
    rel, mx = rel_error(got.float(), want.float())
    # Both use the exact weights with fp32 sums; on the GPU h and the output are bf16 (2^-9 relative).
    tol = 1e-4 if plan.dry_run else 1e-2
    local_pairs = int((ids < e).sum().item())
    return [Row("correctness", f"W4A16 MoE T={tokens} E={e}/{plan.moe_experts_total} H={h} I={i} "
                f"G={K2_INT4_GROUP}", f"rel {rel:.2e} ({local_pairs} local pairs)", f"rel <= {tol:g}",
                _verdict(rel, tol), {"rel": rel, "max_abs": mx})]


def _mla_cache(plan: Plan, num_blocks: int, fp8: bool, gen: torch.Generator) -> torch.Tensor:
    torch = _torch()
    width = plan.mla_latent + plan.mla_rope
    cache = torch.randn(num_blocks, plan.mla_block_size, width, device=plan.device, generator=gen) * 0.5
    if fp8:
        q = cache.to(torch.float8_e4m3fn)
        return q.float() if plan.dry_run else q
    return cache.to(act_dtype(plan))


def _block_tables(plan: Plan, lens: list[int], num_blocks: int, gen: torch.Generator,
                  offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence gets distinct blocks from a shuffled pool (so reads are really paged)."""
    torch = _torch()
    per = max(1, max(-(-n // plan.mla_block_size) for n in lens))
    perm = torch.randperm(num_blocks, device=plan.device, generator=gen)
    need = per * len(lens)
    if need > num_blocks:
        raise ValueError(f"{need} blocks needed, {num_blocks} allocated")
    start = offset % max(1, num_blocks - need + 1)
    tables = perm[start : start + need].view(len(lens), per).to(torch.int32)
    return tables, torch.tensor(lens, dtype=torch.int32, device=plan.device)


def check_mla_decode(plan: Plan) -> list[Row]:
    torch = _torch()
    mod, why = import_or_skip("kserve.kernels.mla_decode", ["mla_decode_torch", "mla_decode_triton"])
    if mod is None:
        return [Row("correctness", "MLA decode", "-", status=why)]
    gen = torch.Generator(device=plan.device).manual_seed(2)
    lens = plan.mla_correct_lens
    num_blocks = max(-(-n // plan.mla_block_size) for n in lens) * len(lens) * 2
    b, h = len(lens), plan.mla_heads
    q_lat = torch.randn(b, h, plan.mla_latent, device=plan.device, generator=gen).to(act_dtype(plan))
    q_pe = torch.randn(b, h, plan.mla_rope, device=plan.device, generator=gen).to(act_dtype(plan))
    scale = (plan.mla_latent // 4 + plan.mla_rope) ** -0.5
    rows = []
    for fp8 in (False, True):
        cache = _mla_cache(plan, num_blocks, fp8, gen)
        tables, ctx = _block_tables(plan, lens, num_blocks, gen)
        kv_scale = 0.5 if fp8 else 1.0
        want = mod.mla_decode_torch(q_lat, q_pe, cache, tables, ctx, scale, kv_scale)
        got = mod.mla_decode_triton(q_lat, q_pe, cache, tables, ctx, scale, kv_scale)
        rel, mx = rel_error(got.float(), want.float())
        tol = 1e-4 if plan.dry_run else 1e-2
        rows.append(Row("correctness", f"MLA decode {'fp8' if fp8 else 'bf16'} cache B={b} H={h} lens={lens}",
                        f"rel {rel:.2e}", f"rel <= {tol:g}", _verdict(rel, tol), {"rel": rel, "max_abs": mx}))
    return rows


def check_prefill_attention(plan: Plan) -> list[Row]:
    torch = _torch()
    mod, why = import_or_skip("kserve.layers.mla_attention", ["varlen_causal_attention", "causal_attention"])
    if mod is None:
        return [Row("correctness", "prefill attention", "-", status=why)]
    gen = torch.Generator(device=plan.device).manual_seed(3)
    qlens = [q for q, _ in plan.prefill_lens]
    klens = [k for _, k in plan.prefill_lens]
    h, d, dv = plan.prefill_heads, 192, 128
    dt = act_dtype(plan)
    q = torch.randn(sum(qlens), h, d, device=plan.device, generator=gen).to(dt)
    k = torch.randn(sum(klens), h, d, device=plan.device, generator=gen).to(dt)
    v = torch.randn(sum(klens), h, dv, device=plan.device, generator=gen).to(dt)

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=plan.device)

    scale = d**-0.5
    got = mod.varlen_causal_attention(q, k, v, qlens, klens, cu(qlens), cu(klens), scale)
    parts, qs, ks = [], 0, 0
    for ql, kl in zip(qlens, klens, strict=True):
        parts.append(mod.causal_attention(q[qs : qs + ql].float(), k[ks : ks + kl].float(), v[ks : ks + kl].float(), scale))
        qs, ks = qs + ql, ks + kl
    rel, mx = rel_error(got.float(), torch.cat(parts))
    path = "flash-attn" if (plan.device == "cuda" and hasattr(mod, "flash_attn_varlen") and mod.flash_attn_varlen()) else "sdpa"
    tol = 1e-4 if plan.dry_run else 1e-2
    return [Row("correctness", f"prefill attention ({path}) H={h} (q,k)={plan.prefill_lens}", f"rel {rel:.2e}",
                f"rel <= {tol:g}", _verdict(rel, tol), {"rel": rel, "max_abs": mx, "path": path})]


def stage_correctness(plan: Plan, budget: Budget, limits: dict[str, float]) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    for item, fn in (("block-FP8 GEMM", check_fp8_gemm), ("fused MoE", check_fused_moe),
                     ("W4A16 MoE", check_w4a16_moe), ("MLA decode", check_mla_decode),
                     ("prefill attention", check_prefill_attention)):
        guarded("correctness", item, rows, budget, lambda fn=fn: fn(plan))
        release(plan.device)
    return rows, {}


# --- stage 3: kernel speed -------------------------------------------------------------------------------


def speed_mla(plan: Plan, limits: dict[str, float], budget: Budget) -> list[Row]:
    torch = _torch()
    mod, why = import_or_skip("kserve.kernels.mla_decode", ["mla_decode"])
    if mod is None:
        return [Row("kernel_speed", "MLA decode", "-", status=why)]
    gen = torch.Generator(device=plan.device).manual_seed(4)
    width = plan.mla_latent + plan.mla_rope
    most = max(plan.mla_batches) * max(-(-c // plan.mla_block_size) for c in plan.mla_contexts)
    rows = []
    for fp8 in (False, True):
        # The op path takes real caches: bf16 (fp32 in the dry run) or float8_e4m3fn.
        cache = torch.randn(most, plan.mla_block_size, width, device=plan.device, generator=gen).mul_(0.5)
        cache = cache.to(torch.float8_e4m3fn if fp8 else act_dtype(plan))
        elem = cache.element_size()
        for ctx in plan.mla_contexts:
            for b in plan.mla_batches:
                if budget.spent():
                    rows.append(Row("kernel_speed", f"MLA decode B={b} ctx={ctx}", "-", status="skipped: stage time budget spent"))
                    continue
                kv_bytes = b * ctx * width * elem
                reps = min(rotations(plan, kv_bytes), most // (b * -(-ctx // plan.mla_block_size)))
                q_lat = torch.randn(b, plan.mla_heads, plan.mla_latent, device=plan.device, generator=gen).to(act_dtype(plan))
                q_pe = torch.randn(b, plan.mla_heads, plan.mla_rope, device=plan.device, generator=gen).to(act_dtype(plan))
                per = -(-ctx // plan.mla_block_size)
                calls = []
                for r in range(max(1, reps)):
                    tables = torch.arange(r * b * per, (r + 1) * b * per, device=plan.device, dtype=torch.int32).view(b, per)
                    lens = torch.full((b,), ctx, dtype=torch.int32, device=plan.device)
                    calls.append(partial(mod.mla_decode, q_lat, q_pe, cache, tables, lens, 0.1, 1.0))
                ms = time_ms(calls, plan)
                gbps = kv_bytes / ms / 1e6
                frac = gbps / limits["copy_gbps"]
                rows.append(Row("kernel_speed", f"MLA decode {'fp8' if fp8 else 'bf16'} B={b} ctx={ctx}",
                                f"{ms:.3f} ms, {gbps:.0f} GB/s = {frac:.0%} of copy", ">= 70% of copy",
                                "ok" if frac >= 0.7 else "below goal", {"ms": ms, "gbps": gbps, "fraction_of_copy": frac}))
        del cache
        release(plan.device)
    return rows


def speed_dcp_decode(plan: Plan, limits: dict[str, float], budget: Budget) -> list[Row]:
    """Decode context parallelism at one rank of `dcp_size`: the group's heads over 1/dcp of the context
    with log-sum-exp, then the merge (collectives replaced by local stand-ins: NCCL time is not in it),
    against DCP 1 (this rank's heads over the whole context)."""
    torch = _torch()
    mod, why = import_or_skip("kserve.kernels.mla_decode", ["mla_decode"])
    attn, why_attn = import_or_skip("kserve.layers.mla_attention", ["merge_context_parallel"])
    if mod is None or attn is None:
        return [Row("kernel_speed", "DCP decode", "-", status=why or why_attn)]
    from kserve.distributed import ContextParallelGroup

    gen = torch.Generator(device=plan.device).manual_seed(5)
    dcp, ctx, h = plan.dcp_size, max(plan.mla_contexts), plan.mla_heads
    group = ContextParallelGroup(dcp, 0, collectives=False)
    width = plan.mla_latent + plan.mla_rope
    rows = []
    for b in plan.mla_batches:
        if budget.spent():
            rows.append(Row("kernel_speed", f"DCP decode B={b}", "-", status="skipped: stage time budget spent"))
            continue
        per = -(-ctx // plan.mla_block_size)
        cache = torch.randn(b * per, plan.mla_block_size, width, device=plan.device, generator=gen).mul_(0.5)
        cache = cache.to(act_dtype(plan))
        tables = torch.arange(b * per, device=plan.device, dtype=torch.int32).view(b, per)
        q_lat = torch.randn(b, h * dcp, plan.mla_latent, device=plan.device, generator=gen).to(act_dtype(plan))
        q_pe = torch.randn(b, h * dcp, plan.mla_rope, device=plan.device, generator=gen).to(act_dtype(plan))
        full = torch.full((b,), ctx, dtype=torch.int32, device=plan.device)
        share = torch.full((b,), group.local_len(ctx), dtype=torch.int32, device=plan.device)
        base_ms = time_ms([partial(mod.mla_decode, q_lat[:, :h], q_pe[:, :h], cache, tables, full, 0.1, 1.0)], plan)
        local_ms = time_ms([partial(mod.mla_decode, q_lat, q_pe, cache, tables, share, 0.1, 1.0, True)], plan)
        out, lse = mod.mla_decode(q_lat, q_pe, cache, tables, share, 0.1, 1.0, True)
        merge_ms = time_ms([partial(attn.merge_context_parallel, out, lse, group)], plan)
        rows.append(Row("kernel_speed", f"DCP decode 1 rank of {dcp} B={b} ctx={ctx} ({h} heads/rank)",
                        f"local {local_ms:.3f} + merge {merge_ms:.3f} ms vs DCP 1 {base_ms:.3f} ms", "",
                        data={"local_ms": local_ms, "merge_ms": merge_ms, "dcp1_ms": base_ms}))
        del cache
        release(plan.device)
    return rows


def speed_long_prefill(plan: Plan, limits: dict[str, float], budget: Budget) -> list[Row]:
    """One K2 attention layer at rank 0 of 8: a prefill chunk over a long cached context, decompressed in
    bounded context chunks; time and the peak memory above the inputs against the chunk budget."""
    torch = _torch()
    mod, why = import_or_skip("kserve.model.deepseek_v3", ["MLAttention"])
    fb, why_fb = import_or_skip("kserve.model.forward_batch", ["ForwardBatch"])
    if mod is None or fb is None:
        return [Row("kernel_speed", "long-context prefill", "-", status=why or why_fb)]
    from kserve.distributed import ParallelState
    from kserve.layers.rotary import YarnRotaryEmbedding

    new, ctx, chunk = plan.long_prefill
    config = decode_config(plan)
    dtype = act_dtype(plan)
    layer = mod.MLAttention(config, ParallelState(0, 8).without_collectives(), dtype=dtype, device=plan.device)
    fill_random_(layer, seed=9)
    rotary = YarnRotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, device=plan.device)
    block = 16
    gen = torch.Generator(device=plan.device).manual_seed(6)
    cache = torch.randn(-(-(ctx + new) // block), block, config.kv_cache_dim, device=plan.device, generator=gen)
    cache = cache.mul_(0.5).to(dtype)
    batch = fb.ForwardBatch.contiguous([new], [ctx + new], block, device=plan.device, context_chunk_tokens=chunk)
    x = torch.randn(new, config.hidden_size, device=plan.device, generator=gen).to(dtype)
    positions = torch.arange(ctx, ctx + new, device=plan.device)
    run = partial(layer, x, batch, cache, rotary.angles(positions, dtype))
    if plan.device == "cuda":
        sync(plan.device)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.inference_mode():
            run()
        sync(plan.device)
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = float("nan")
    with torch.inference_mode():
        ms = time_ms([run], plan, iters=max(1, plan.iters // 4))
    heads = layer.num_heads
    per_token = heads * (config.qk_head_dim + config.qk_nope_head_dim + config.v_head_dim) * cache.element_size()
    budget_bytes = max(new, chunk) * per_token
    value = f"{ms:.2f} ms/layer, peak {peak / 2**20:.0f} MiB (decompressed budget {budget_bytes / 2**20:.0f} MiB)"
    return [Row("kernel_speed", f"long-context prefill {new} new over {ctx} cached, chunk {chunk}, {heads} heads",
                value, "peak <= 4x budget",
                "ok" if plan.device != "cuda" or peak <= 4 * budget_bytes else "below goal",
                {"ms": ms, "peak_bytes": peak, "budget_bytes": budget_bytes})]


def speed_vision_tower(plan: Plan, limits: dict[str, float], budget: Budget) -> list[Row]:
    """K2.6's MoonViT tower and projector (random weights, real width; toy width in the dry run) on one
    1024x1024 image (64x64 in the dry run): time per image."""
    torch = _torch()
    mod, why = import_or_skip("kserve.model.moonvit", ["KimiVisionModel", "VisionConfig", "init_random_weights"])
    pre, why_pre = import_or_skip("kserve.model.vision_preprocess", ["preprocess_image"])
    if mod is None or pre is None:
        return [Row("kernel_speed", "vision tower", "-", status=why or why_pre)]
    raw = K26_VISION
    if plan.dry_run:
        from kserve.tiny.checkpoint import tiny_vision_config

        raw = tiny_vision_config(256)
    config = mod.VisionConfig.from_dict(raw)
    model = mod.init_random_weights(mod.KimiVisionModel(config)).to(plan.device, act_dtype(plan)).eval()
    side = 64 if plan.dry_run else 1024
    from PIL import Image

    image = pre.preprocess_image(Image.new("RGB", (side, side), (120, 30, 200)))
    pixels = image.pixel_values.to(plan.device, act_dtype(plan))
    with torch.inference_mode():
        ms = time_ms([lambda: model(pixels, [image.grid_thw])], plan, iters=max(1, plan.iters // 4))
    del model
    release(plan.device)
    return [Row("kernel_speed", f"vision tower {side}x{side} ({image.num_tokens} tokens, width {config.hidden_size})",
                f"{ms:.1f} ms per image", "", data={"ms": ms, "tokens": image.num_tokens})]


def _per_expert_loop(x, w13, s13, w2, s2, ids, weights, num_local: int, linear):
    """The baseline the fused kernel replaces: one pair of block-FP8 linears per hit expert."""
    torch = _torch()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if e >= num_local:
            continue
        tok, slot = torch.where(ids == e)
        gate_up = linear(x[tok], w13[e], s13[e])
        gate, up = gate_up.chunk(2, dim=-1)
        y = linear((torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype), w2[e], s2[e])
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(x.dtype)


def speed_moe(plan: Plan, limits: dict[str, float], budget: Budget) -> list[Row]:
    torch = _torch()
    mod, why = import_or_skip("kserve.kernels.fused_moe", ["fused_moe"])
    if mod is None:
        return [Row("kernel_speed", "fused MoE", "-", status=why)]
    from kserve.kernels.fp8_gemm import fp8_block_linear

    gen = torch.Generator(device=plan.device).manual_seed(5)
    e, h, i = plan.moe_experts_local, plan.moe_hidden, plan.moe_intermediate
    container = torch.float8_e4m3fn  # the op path: real fp8 on both devices
    w13, s13 = random_fp8_weight((e, 2 * i, h), plan, gen, container)
    w2, s2 = random_fp8_weight((e, h, i), plan, gen, container)
    expert_bytes = 3 * i * h + (s13[0].numel() + s2[0].numel()) * 4
    rows = []
    for t in plan.moe_tokens:
        if budget.spent():
            rows.append(Row("kernel_speed", f"fused MoE T={t}", "-", status="skipped: stage time budget spent"))
            continue
        x = torch.randn(t, h, device=plan.device, generator=gen).to(act_dtype(plan))
        routings = []
        while len(routings) < rotations(plan, (routings and len(routings[0][2]) or 1) * expert_bytes):
            ids, weights = _routing(plan, t, gen)
            if not bool((ids < e).any()):  # one token's view at this rank can miss it; time at least one expert
                ids[0, 0] = 0
            routings.append((ids, weights, torch.unique(ids[ids < e]).tolist()))
        # different routings per call, so small batches do not find their experts in L2
        hit = sum(len(r[2]) for r in routings) / len(routings)
        floor_ms = hit * expert_bytes / (limits["copy_gbps"] * 1e6)
        ms = time_ms([partial(mod.fused_moe, x, w13, w2, w, ids, 0, s13, s2) for ids, w, _ in routings], plan)
        loop_ms = time_ms([partial(_per_expert_loop, x, w13, s13, w2, s2, ids, w, e, fp8_block_linear)
                           for ids, w, _ in routings], plan, iters=max(1, plan.iters // 4))
        ratio = ms / floor_ms if floor_ms else float("nan")
        rows.append(Row("kernel_speed", f"fused MoE T={t} ({hit:.1f} of {e} local experts hit)",
                        f"{ms:.3f} ms = {ratio:.2f}x weight floor; loop/fused {loop_ms / ms:.2f}x",
                        "near the weight-bytes floor; faster than the loop",
                        "ok" if loop_ms >= ms else "below goal",
                        {"ms": ms, "floor_ms": floor_ms, "x_floor": ratio, "loop_ms": loop_ms, "experts_hit": hit}))
    return rows


def _dequantize_then_dense_moe(x, w13, s13, w2, s2, ids, weights, touched: list[int], dense13, dense2, fused_moe):
    """The baseline the W4A16 kernels replace: dequantize the hit experts' INT4 weights into bf16 buffers,
    then run the bf16 fused MoE (which reads only the hit experts)."""
    from kserve.kernels.int4_pack import dequantize_int4

    for e in touched:
        dense13[e] = dequantize_int4(w13[e], s13[e], K2_INT4_GROUP, dense13.dtype)
        dense2[e] = dequantize_int4(w2[e], s2[e], K2_INT4_GROUP, dense2.dtype)
    return fused_moe(x, dense13, dense2, weights, ids, 0)


def speed_w4a16_moe(plan: Plan, limits: dict[str, float], budget: Budget) -> list[Row]:
    torch = _torch()
    mod, why = import_or_skip("kserve.kernels.fused_moe_w4a16", ["fused_moe_w4a16"])
    dense, dense_why = import_or_skip("kserve.kernels.fused_moe", ["fused_moe"])
    if mod is None or dense is None:
        return [Row("kernel_speed", "W4A16 MoE", "-", status=why or dense_why)]
    gen = torch.Generator(device=plan.device).manual_seed(7)
    e, h, i = plan.moe_experts_local, plan.moe_hidden, plan.moe_intermediate
    w13, s13 = random_int4_experts((e, 2 * i, h), plan, gen)
    w2, s2 = random_int4_experts((e, h, i), plan, gen)
    dense13 = torch.zeros(e, 2 * i, h, dtype=act_dtype(plan), device=plan.device)
    dense2 = torch.zeros(e, h, i, dtype=act_dtype(plan), device=plan.device)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 4 + (s13[0].numel() + s2[0].numel()) * s13.element_size()
    # The floor is the packed bytes of the hit experts at the HBM's nominal rate (measured copy on the CPU).
    peak_gbps = limits["copy_gbps"] if plan.dry_run else H200_HBM_GBPS
    rows = []
    for t in plan.moe_tokens:
        if budget.spent():
            rows.append(Row("kernel_speed", f"W4A16 MoE T={t}", "-", status="skipped: stage time budget spent"))
            continue
        x = torch.randn(t, h, device=plan.device, generator=gen).to(act_dtype(plan))
        routings = []
        while len(routings) < rotations(plan, (routings and len(routings[0][2]) or 1) * expert_bytes):
            ids, weights = _routing(plan, t, gen)
            if not bool((ids < e).any()):
                ids[0, 0] = 0
            routings.append((ids, weights, torch.unique(ids[ids < e]).tolist()))
        hit = sum(len(r[2]) for r in routings) / len(routings)
        floor_ms = hit * expert_bytes / (peak_gbps * 1e6)
        ms = time_ms([partial(mod.fused_moe_w4a16, x, w13, w2, w, ids, 0, s13, s2, K2_INT4_GROUP)
                      for ids, w, _ in routings], plan)
        base_ms = time_ms([partial(_dequantize_then_dense_moe, x, w13, s13, w2, s2, ids, w, touched, dense13, dense2,
                                   dense.fused_moe) for ids, w, touched in routings],
                          plan, iters=max(1, plan.iters // 4))
        ratio = ms / floor_ms if floor_ms else float("nan")
        rows.append(Row("kernel_speed", f"W4A16 MoE T={t} G={K2_INT4_GROUP} ({hit:.1f} of {e} local experts hit)",
                        f"{ms:.3f} ms = {ratio:.2f}x packed floor ({peak_gbps:.0f} GB/s); "
                        f"dequant+bf16/fused {base_ms / ms:.2f}x",
                        "near the packed-bytes floor; faster than dequantize + bf16 MoE",
                        "ok" if base_ms >= ms else "below goal",
                        {"ms": ms, "floor_ms": floor_ms, "x_floor": ratio, "dequant_bf16_ms": base_ms,
                         "experts_hit": hit, "expert_bytes": expert_bytes}))
    del dense13, dense2
    return rows


def scaled_mm_block_layout(xq, xs, wq, ws, want) -> tuple[Callable | None, str]:
    """How to lay out 1x128 activation and 128x128 weight block scales for torch._scaled_mm so that this
    torch/GPU accepts them and reproduces `want` (the layouts it wants differ between versions):
    (scales(xs, ws) -> (scale_a, scale_b), label), or (None, why not)."""
    torch = _torch()
    layouts = {
        "scale_a outer-dim-major, scale_b [K/128, N/128]": lambda a, b: (a.t().contiguous().t(), b.t()),
        "scale_a [M, K/128], scale_b [K/128, N/128]": lambda a, b: (a, b.t()),
        "scale_a outer-dim-major, scale_b contiguous": lambda a, b: (a.t().contiguous().t(), b.t().contiguous()),
    }
    errors = []
    for label, scales in layouts.items():
        sa, sb = scales(xs, ws)
        try:
            got = torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        except Exception as exc:  # noqa: BLE001 - any _scaled_mm failure is recorded
            errors.append(f"{label}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        rel, _ = rel_error(got.float(), want)
        if rel < 2e-2:
            return scales, label
        errors.append(f"{label}: ran but rel error {rel:.2e}")
    return None, " | ".join(errors)


def speed_fp8_gemm(plan: Plan, limits: dict[str, float], budget: Budget) -> list[Row]:
    torch = _torch()
    from kserve.kernels.fp8_gemm import (
        fp8_block_linear,
        w8a8_block_matmul_quantized_triton,
        w8a8_block_matmul_torch,
    )
    from kserve.kernels.fp8_quant import quantize_per_token_group_torch

    gen = torch.Generator(device=plan.device).manual_seed(6)
    rows = []
    dt = torch.bfloat16
    for name, n, k in plan.gemm_speed_shapes:
        w_bytes = n * k
        reps = rotations(plan, w_bytes)
        weights = [random_fp8_weight((n, k), plan, gen, torch.float8_e4m3fn) for _ in range(reps)]
        dense = [(w.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(dt) for w, s in weights]
        for m in plan.gemm_tokens:
            if budget.spent():
                rows.append(Row("kernel_speed", f"fp8 GEMM {name} M={m}", "-", status="skipped: stage time budget spent"))
                continue
            x = torch.randn(m, k, device=plan.device, generator=gen).to(dt)
            data: dict[str, Any] = {}
            full_ms = time_ms([partial(fp8_block_linear, x, w, s) for w, s in weights], plan)
            bf16_ms = time_ms([partial(torch.matmul, x, d.t()) for d in dense], plan)
            data.update(full_ms=full_ms, bf16_ms=bf16_ms)
            value = f"{full_ms:.3f} ms; bf16/fp8 {bf16_ms / full_ms:.2f}x"
            xq, xs = quantize_per_token_group_torch(x)
            if plan.dry_run:  # the interpreter takes fp32 containers of the fp8 values
                gemm_args = [(xq.float(), w.float(), s) for w, s in weights]
            else:
                gemm_args = [(xq, w, s) for w, s in weights]
            gemm_ms = time_ms([partial(w8a8_block_matmul_quantized_triton, a, xs, w, s) for a, w, s in gemm_args], plan)
            data["gemm_only_ms"] = gemm_ms
            want = w8a8_block_matmul_torch(x, weights[0][0], weights[0][1], out_dtype=torch.float32)
            scales, label = scaled_mm_block_layout(xq, xs, weights[0][0], weights[0][1], want)
            if scales is not None:
                laid = [(w, *scales(xs, s)) for w, s in weights]
                sm_calls = [partial(torch._scaled_mm, xq, w.t(), scale_a=a, scale_b=b, out_dtype=dt) for w, a, b in laid]
                data["scaled_mm_mode"] = "block"
                data["scaled_mm_layout"] = label
            else:  # row-wise scales: other math, a speed reference only
                data["scaled_mm_block_error"] = label
                ones_n = torch.ones(1, n, device=plan.device)
                row_scale = xs[:, :1].contiguous()
                sm_calls = [partial(torch._scaled_mm, xq, w.t(), scale_a=row_scale, scale_b=ones_n, out_dtype=dt)
                            for w, _ in weights]
                data["scaled_mm_mode"] = "row-wise: other math, speed reference only"
            try:
                sm_ms = time_ms(sm_calls, plan)
                data["scaled_mm_ms"] = sm_ms
                kind = "block" if data["scaled_mm_mode"] == "block" else "row-wise"
                value += f"; GEMM alone {gemm_ms:.3f} ms, _scaled_mm({kind})/ours {sm_ms / gemm_ms:.2f}x"
            except Exception as exc:  # noqa: BLE001 - any _scaled_mm failure is recorded
                data["scaled_mm_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            gbps = (w_bytes + m * k * 2 + m * n * 2) / full_ms / 1e6
            data["gbps"] = gbps
            value += f"; {gbps:.0f} GB/s"
            rows.append(Row("kernel_speed", f"fp8 GEMM {name} M={m} N={n} K={k}", value,
                            "faster than bf16 matmul", "ok" if bf16_ms >= full_ms else "below goal", data))
        del weights, dense
        release(plan.device)
    return rows


def stage_kernel_speed(plan: Plan, budget: Budget, limits: dict[str, float]) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    if "copy_gbps" not in limits:
        return [Row("kernel_speed", "all", "-", status="skipped: no limits from the env stage")], {}
    for item, fn in (("MLA decode", speed_mla), ("DCP decode", speed_dcp_decode),
                     ("long-context prefill", speed_long_prefill), ("vision tower", speed_vision_tower),
                     ("fused MoE", speed_moe),
                     ("W4A16 MoE", speed_w4a16_moe), ("block-FP8 GEMM", speed_fp8_gemm)):
        guarded("kernel_speed", item, rows, budget, lambda fn=fn: fn(plan, limits, budget))
        release(plan.device)
    return rows, {}


# --- stage 4: decode step of a 4-layer K2-width model at one rank of 8 ---------------------------------


def decode_config(plan: Plan) -> ModelConfig:
    from kserve.config import ModelConfig

    raw = json.loads(K2_CONFIG.read_text())
    raw["num_hidden_layers"] = plan.decode_layers
    if plan.dry_run:  # K2's structure at toy width
        raw.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=16,
                   num_key_value_heads=16, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                   qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=4, vocab_size=2048)
    return ModelConfig.from_dict(raw)


def fill_random_(model: torch.nn.Module, seed: int) -> None:
    """Random weights of sensible size: FP8 tensors as random e4m3 values, their scales ~1/(64 sqrt(K)),
    norms 1, biases 0, other weights ~N(0, 1/fan_in)."""
    torch = _torch()
    gen_device = next(model.parameters()).device
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                flat = p.data.view(-1, p.shape[-1]) if p.dim() > 1 else p.data.view(1, -1)
                step = max(1, (1 << 26) // max(1, flat.shape[1]))
                for r in range(0, flat.shape[0], step):
                    chunk = torch.randn(flat[r : r + step].shape, device=gen_device, generator=gen) * 64
                    flat[r : r + step] = chunk.clamp(-448, 448).to(torch.float8_e4m3fn)
            elif "scale_inv" in name:
                p.data.copy_((0.5 + torch.rand(p.shape, device=gen_device, generator=gen)) / (64 * math.sqrt(p.shape[-1] * 128)))
            elif "norm" in name:
                p.data.fill_(1.0)
            elif "bias" in name:
                p.data.zero_()
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.data.copy_(torch.randn(p.shape, device=gen_device, generator=gen) / math.sqrt(fan_in))


def _param_bytes(model, config, batch: int) -> tuple[int, int]:
    """(weight bytes one decode step must read, of which routed experts), for uniform routing."""
    total = experts = 0
    hit_fraction = 1 - (1 - config.num_experts_per_tok / config.n_routed_experts) ** batch
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name and "shared" not in name:
            experts += nbytes
            total += int(nbytes * hit_fraction)
        elif "embed_tokens" in name:
            total += batch * p.shape[-1] * p.element_size()
        else:
            total += nbytes
    return total, experts


def stage_decode_step(plan: Plan, budget: Budget, limits: dict[str, float]) -> tuple[list[Row], dict[str, Any]]:
    torch = _torch()
    mod, why = import_or_skip("kserve.model.deepseek_v3", ["KimiK2ForCausalLM"])
    fb, why_fb = import_or_skip("kserve.model.forward_batch", ["ForwardBatch"])
    if mod is None or fb is None:
        return [Row("decode_step", "model", "-", status=why or why_fb)], {}
    from kserve.distributed import ParallelState

    config = decode_config(plan)
    parallel = ParallelState(tp_rank=0, tp_size=8)
    if not hasattr(parallel, "without_collectives"):
        return [Row("decode_step", "model", "-", status="skipped: ParallelState cannot build one rank alone (no without_collectives)")], {}
    parallel = parallel.without_collectives()
    kwargs: dict[str, Any] = {"dtype": act_dtype(plan) if not plan.dry_run else torch.float32, "device": plan.device}
    params = inspect.signature(mod.KimiK2ForCausalLM.__init__).parameters
    if "weights" in params:  # the stored (FP8) weights
        kwargs["weights"] = "quantized"
    elif "keep_fp8" in params:
        kwargs["keep_fp8"] = True
    t0 = time.perf_counter()
    model = mod.KimiK2ForCausalLM(config, parallel, **kwargs).eval()
    fill_random_(model, seed=7)
    sync(plan.device)
    build_s = time.perf_counter() - t0
    fp8_bytes = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    info = {"config": {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "tp": "rank 0 of 8 (collectives off)"},
            "build_s": build_s, "param_bytes": all_bytes, "fp8_param_bytes": fp8_bytes}
    rows = [Row("decode_step", f"model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, rank 0 of 8",
                f"{all_bytes / 2**30:.2f} GiB params ({fp8_bytes / max(1, all_bytes):.0%} fp8), built in {build_s:.1f} s")]
    block_size = 16
    ctx = plan.decode_context
    cache_dtype = kwargs["dtype"]
    max_batch = max(plan.decode_batches)
    blocks_per_seq = -(-(ctx + 1) // block_size)
    kv_cache = torch.randn(config.num_hidden_layers, max_batch * blocks_per_seq, block_size, config.kv_cache_dim,
                           device=plan.device).mul_(0.5).to(cache_dtype)
    measured: list[tuple[int, Callable[[], Any], dict[str, Any]]] = []
    for b in plan.decode_batches:
        if budget.spent():
            rows.append(Row("decode_step", f"decode B={b}", "-", status="skipped: stage time budget spent"))
            continue
        batch = fb.ForwardBatch.contiguous([1] * b, [ctx + 1] * b, block_size, device=plan.device)
        ids = torch.randint(0, config.vocab_size, (b,), device=plan.device)

        def step(batch=batch, ids=ids, model=model, kv_cache=kv_cache):
            hidden = model(ids, batch, kv_cache)
            return model.compute_logits(hidden)

        weight_bytes, _ = _param_bytes(model, config, b)
        kv_bytes = b * (ctx + 1) * config.kv_cache_dim * kv_cache.element_size() * config.num_hidden_layers
        floor_ms = (weight_bytes + kv_bytes) / (limits.get("copy_gbps", float("nan")) * 1e6)
        data: dict[str, Any] = {"batch": b, "floor_ms": floor_ms, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes}
        try:
            data["eager_ms"] = time_ms([step], plan, iters=max(1, plan.iters // 2))
        except Exception as exc:  # noqa: BLE001 - a failing batch is a row
            rows.append(Row("decode_step", f"decode B={b}", "-", status=f"error: {type(exc).__name__}: {str(exc)[:300]}"))
            continue
        measured.append((b, step, data))
    # CUDA graphs after every eager run: a failed capture cannot spoil an eager figure
    for b, step, data in measured:
        if plan.device == "cuda" and not budget.spent():
            try:
                data["graph_ms"] = _time_cuda_graph(step, plan)
            except Exception as exc:  # noqa: BLE001 - a failing capture is recorded
                data["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        floor_ms, eager_ms = data["floor_ms"], data["eager_ms"]
        value = f"eager {eager_ms:.2f} ms ({eager_ms / floor_ms:.2f}x floor {floor_ms:.2f} ms)"
        if "graph_ms" in data:
            value += f"; graph {data['graph_ms']:.2f} ms ({data['graph_ms'] / floor_ms:.2f}x)"
        elif "graph_error" in data:
            value += f"; graph failed: {data['graph_error'][:80]}"
        else:
            value += "; graph n/a on CPU" if plan.device != "cuda" else "; graph skipped: stage time budget spent"
        ratio = min(eager_ms, data.get("graph_ms", float("inf"))) / floor_ms
        rows.append(Row("decode_step", f"decode B={b} ctx={ctx}", value, "<= 2x bandwidth floor",
                        "ok" if ratio <= 2 else "below goal", data))
    # speculative decoding's verify step: k + 1 = 4 positions per sequence in one forward (eager)
    for b in [x for x in plan.decode_batches if x <= 64][:2]:
        if budget.spent():
            rows.append(Row("decode_step", f"verify B={b}", "-", status="skipped: stage time budget spent"))
            continue
        try:
            verify = fb.ForwardBatch.contiguous([4] * b, [ctx + 1] * b, block_size, device=plan.device)
            ids = torch.randint(0, config.vocab_size, (4 * b,), device=plan.device)
            ms = time_ms([lambda v=verify, i=ids: model.compute_logits(model(i, v, kv_cache))], plan,
                         iters=max(1, plan.iters // 2))
            plain = next((d["eager_ms"] for bb, _, d in measured if bb == b), None)
            ratio = f" ({ms / plain:.2f}x a decode step)" if plain else ""
            rows.append(Row("decode_step", f"verify B={b} k=3 ctx={ctx}", f"eager {ms:.2f} ms{ratio}", "",
                            data={"verify_ms": ms, "decode_ms": plain}))
        except Exception as exc:  # noqa: BLE001 - a failing row is recorded
            rows.append(Row("decode_step", f"verify B={b}", "-", status=f"error: {type(exc).__name__}: {str(exc)[:300]}"))
    measured.clear()
    del model, kv_cache
    release(plan.device)
    return rows, info


def _time_cuda_graph(step: Callable[[], Any], plan: Plan) -> float:
    torch = _torch()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return time_ms([graph.replay], plan)


# --- stage 5: serve_bench on the tiny model ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`kserve serve` on the embedded tiny model in a subprocess, its output to a temporary file (a pipe
    nobody reads could fill and block the server)."""

    def __init__(self, plan: Plan, eager: bool) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.mode = "eager" if eager else "CUDA graphs"
        cmd = [sys.executable, "-m", "kserve.cli", "serve", "--port", str(self.port), "--device", plan.device,
               "--max-num-seqs", str(max(plan.serve_concurrency)), "--log-level", "warning", "--skip-self-check"]
        if plan.device == "cuda":  # the tiny model needs little cache; leave the rest of the GPU alone
            cmd += ["--gpu-memory-utilization", "0.3"]
        if eager:
            cmd.append("--enforce-eager")
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    async def wait_ready(self, timeout_s: float) -> str:
        """Empty once /health answers 200, else why not."""
        import httpx

        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if (await http.get(self.base_url + "/health")).status_code == 200:
                        return ""
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.25)
        self.log.seek(0)
        tail = self.log.read()[-300:].strip()
        return tail or ("exited" if self.proc.poll() is not None else f"not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.log.closed:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def _serve_level_runs(plan: Plan, server: ServerProcess, budget: Budget) -> list[Row]:
    from openai import AsyncOpenAI

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import serve_bench

    mode = server.mode
    why = await server.wait_ready(min(plan.serve_startup_timeout_s, max(1.0, budget.left())))
    if why:
        return [Row("serve_bench", f"serve ({mode})", "-", status=f"error: server not ready ({why})")]
    rows: list[Row] = []
    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)
    try:
        model = (await client.models.list()).data[0].id
        prompts = serve_bench.make_prompts(plan.serve_prompts, plan.serve_input_len, 0)
        await serve_bench.run_http_level(client, model, prompts[:2], 2, 2, float("inf"))  # warm-up
        for conc in plan.serve_concurrency:
            if budget.spent():
                rows.append(Row("serve_bench", f"{mode} concurrency {conc}", "-", status="skipped: stage time budget spent"))
                continue
            results, duration = await serve_bench.run_http_level(client, model, prompts, plan.serve_output_len,
                                                                conc, float("inf"))
            rep = serve_bench.summarize(conc, results, duration)
            rows.append(Row("serve_bench", f"{mode} concurrency {conc}",
                            f"{rep.output_token_throughput:.1f} tok/s, TTFT p50 {rep.ttft_ms['p50']:.1f} ms, "
                            f"ITL p50 {rep.itl_ms['p50']:.2f} ms, failed {rep.failed}",
                            "no failed requests", "ok" if rep.failed == 0 else "fail", asdict(rep)))
    finally:
        await client.close()
    return rows


def serve_bench_missing() -> str:
    for needed in ("openai", "httpx"):
        if importlib.util.find_spec(needed) is None:
            return f"skipped: {needed} is not installed (pip install -e '.[bench]')"
    return ""


def stage_serve_bench(
    plan: Plan, budget: Budget, limits: dict[str, float], prestarted: ServerProcess | None = None
) -> tuple[list[Row], dict[str, Any]]:
    """CUDA graphs on, then off (eager); on the CPU only eager. `prestarted` is an eager server already
    starting (the dry run overlaps its start-up with the other stages; the GPU run never does)."""
    why = serve_bench_missing()
    if why:
        return [Row("serve_bench", "serve", "-", status=why)], {}
    rows: list[Row] = []
    modes = [False, True] if plan.device == "cuda" else [True]
    for eager in modes:
        server = prestarted if (eager and prestarted is not None) else None
        if server is None and budget.spent():
            rows.append(Row("serve_bench", f"serve ({'eager' if eager else 'CUDA graphs'})", "-",
                            status="skipped: stage time budget spent"))
            continue
        server = server or ServerProcess(plan, eager)
        try:
            guarded("serve_bench", f"serve ({server.mode})", rows, budget,
                    lambda server=server: asyncio.run(_serve_level_runs(plan, server, budget)))
        finally:
            server.stop()
    if plan.device != "cuda":
        rows.append(Row("serve_bench", "CUDA graphs", "-", status="skipped: n/a on CPU"))
    return rows, {"concurrency": plan.serve_concurrency, "num_prompts": plan.serve_prompts,
                  "output_len": plan.serve_output_len}


# --- driver ----------------------------------------------------------------------------------------------

STAGE_FUNCS: Mapping[str, Callable[..., Any]] = MappingProxyType({
    "env": stage_env, "correctness": stage_correctness, "kernel_speed": stage_kernel_speed,
    "decode_step": stage_decode_step, "serve_bench": stage_serve_bench,
})


def format_table(rows: list[Row]) -> str:
    headers = ("stage", "item", "result", "goal", "status")
    cells = [(r.stage, r.item, r.value, r.goal, r.status) for r in rows]
    widths = [min(110, max(len(h), *(len(c[i]) for c in cells))) if cells else len(h) for i, h in enumerate(headers)]

    def line(values):
        return " | ".join(str(v)[: widths[i]].ljust(widths[i]) for i, v in enumerate(values)).rstrip()

    out = [line(headers), "-+-".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return "\n".join(out)


def plot_kernel_table(rows: list[Row], path: Path) -> str:
    """A PNG of the kernel-speed rows; returns "" or why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - no usable matplotlib: skip the plot
        return f"skipped: matplotlib not available ({type(exc).__name__})"
    speed = [r for r in rows if r.stage == "kernel_speed"]
    if not speed:
        return "skipped: no kernel-speed rows"
    cells = [[r.item[:60], r.value[:110], r.status[:40]] for r in speed]
    fig, ax = plt.subplots(figsize=(18, 0.32 * len(cells) + 1.2))
    ax.axis("off")
    table = ax.table(cellText=cells, colLabels=["kernel", "result", "status"], loc="center", cellLoc="left",
                     colWidths=[0.28, 0.6, 0.12])
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    for (r, _), cell in table.get_celld().items():
        if r > 0 and cells[r - 1][2] != "ok":
            cell.set_facecolor("#fde2e2" if not cells[r - 1][2].startswith("skipped") else "#eeeeee")
    ax.set_title("gpu_check kernel speed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


def _stage_status(rows: list[Row]) -> str:
    statuses = [r.status for r in rows]
    if any(s == "fail" or s.startswith("error") for s in statuses):
        return "fail" if "fail" in statuses else "error"
    if rows and all(s.startswith("skipped") for s in statuses):
        return "skipped: " + "; ".join(sorted({s[len("skipped: "):] for s in statuses}))[:300]
    return "ok"


def run(plan: Plan, out_dir: Path, stages: list[str]) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    limits: dict[str, float] = {}
    all_rows: list[Row] = []
    report: dict[str, Any] = {"dry_run": plan.dry_run, "device": plan.device, "stages": {}}
    funcs = dict(STAGE_FUNCS)
    prestarted = None
    if plan.dry_run and "serve_bench" in stages and not serve_bench_missing():
        # CPU timings mean nothing here, so the server's start-up may overlap the other stages.
        prestarted = ServerProcess(plan, eager=True)
        funcs["serve_bench"] = partial(stage_serve_bench, prestarted=prestarted)
    try:
        for name in STAGES:
            if name not in stages:
                report["stages"][name] = {"status": "skipped: not requested", "rows": []}
                continue
            budget = Budget(plan.budgets_s[name])
            t0 = time.perf_counter()
            try:
                rows, info = funcs[name](plan, budget, limits)
            except Exception as exc:  # noqa: BLE001 - a failing stage is a row
                rows, info = [Row(name, "stage", "-", status=f"error: {type(exc).__name__}: {str(exc)[:300]}")], {}
            release(plan.device)
            status = _stage_status(rows)
            seconds = time.perf_counter() - t0
            report["stages"][name] = {"status": status, "seconds": round(seconds, 2), "info": info,
                                      "rows": [asdict(r) for r in rows]}
            all_rows.extend(rows)
            print(f"[gpu_check] {name}: {status} in {seconds:.1f} s", file=sys.stderr, flush=True)
            # a lease can end mid-run: each finished stage is printed and saved, not only the whole table
            print(format_table(rows), file=sys.stderr, flush=True)
            (out_dir / "gpu_check.partial.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    finally:
        if prestarted is not None:
            prestarted.stop()  # idempotent: also when the stage never ran
    report["limits"] = limits
    report["total_seconds"] = round(time.perf_counter() - started, 2)
    png = out_dir / "gpu_check_kernels.png"
    note = plot_kernel_table(all_rows, png)
    report["kernel_png"] = note or str(png)
    table = format_table(all_rows)
    report["table"] = table.splitlines()
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(table)
    print(f"\nwrote {out_dir / 'gpu_check.json'}" + (f" and {png}" if not note else f" ({note})"))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check_out", help="directory for gpu_check.json and the PNG")
    p.add_argument("--dry-run", action="store_true", help="every stage with small shapes on the CPU")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        p.error(f"unknown stage(s) {unknown}; choose from {list(STAGES)}")
    if args.dry_run:
        # Triton kernels run in the interpreter; must be set before triton is imported.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run with --dry-run to exercise the script on the CPU")
    if args.dry_run:
        # CPU figures mean nothing here; one intra-op thread avoids stalls on a shared, busy CPU.
        torch.set_num_threads(1)
    plan = Plan.dry() if args.dry_run else Plan.gpu()
    report = run(plan, Path(args.out), stages)
    failed = [n for n, s in report["stages"].items() if s["status"] in ("fail", "error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
