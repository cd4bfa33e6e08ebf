"""Triton kernels of the fused MoE (see kserve.kernels.fused_moe for the contract and the launch code).

Imported lazily: only the Triton path needs triton. The jit helpers sit at module level because the
interpreter (TRITON_INTERPRET=1) resolves the names a kernel calls through the module's globals.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_fp8_grid(v):
    """fp32 values with |v| <= 448 rounded (half to even) to the nearest float8_e4m3fn value, as fp32.

    Integer/fp32 arithmetic, so the interpreter (no real fp8) and the GPU round identically."""
    # Normal range: keep the top 3 of fp32's 23 mantissa bits.
    bits = v.to(tl.int32, bitcast=True)
    keep_odd = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + keep_odd) & -1048576).to(tl.float32, bitcast=True)  # clear 20 low bits
    # Below 2^-6 the grid is multiples of 2^-9: at 1.5 * 2^14 an fp32 ulp is exactly 2^-9.
    subnormal = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def quantize_group(v, FP8_MAX_C: tl.constexpr, FLOOR: tl.constexpr):
    """Per-row FP8 quantization of a [rows, GROUP] fp32 tile, exactly as quantize_per_token_group_torch:
    returns (fp8 values as fp32, scale per row)."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), FLOOR)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX_C, tl.float32))
    q = tl.math.div_rn(v, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    return round_to_fp8_grid(q), scale


@triton.jit
def gate_up_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, sorted_pair_ptr, block_expert_ptr,
    num_pairs, top_k, H, I, a_groups, w_scale_rows, w_scale_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr, FUSE_QUANT: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_MAX_C: tl.constexpr, FLOOR: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    """h[pair, n] = silu(x_t . w13[e, n]) * (x_t . w13[e, I + n]) for the pairs of one padded block.

    FUSE_QUANT (FP8 only, BLOCK_K = BLOCK_N = the group): a_ptr is x itself and each [BLOCK_M, 128]
    tile is quantized here; h is rounded to x.dtype (OUT_DTYPE), quantized per row over this tile's
    128 columns (one group), and stored as fp8 values with one scale per (pair, pid_n)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + offs_m)
    valid_m = pair < num_pairs
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_n = offs_n < I
    w_base = w_ptr + expert * (2 * I) * H
    s_base = w_scale_ptr + expert * w_scale_rows * w_scale_cols
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(tl.cdiv(H, BLOCK_K)):
        offs_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        valid_k = offs_k < H
        a = tl.load(a_ptr + token[:, None] * H + offs_k[None, :], mask=valid_m[:, None] & valid_k[None, :], other=0.0)
        b_mask = valid_k[:, None] & valid_n[None, :]
        # [BLOCK_K, BLOCK_N] tiles of W^T for the gate rows n and the up rows I + n.
        b_gate = tl.load(w_base + offs_n[None, :] * H + offs_k[:, None], mask=b_mask, other=0.0)
        b_up = tl.load(w_base + (offs_n[None, :] + I) * H + offs_k[:, None], mask=b_mask, other=0.0)
        if QUANT:
            if FUSE_QUANT:
                a_q, a_s = quantize_group(a.to(tl.float32), FP8_MAX_C, FLOOR)
                a = a_q.to(b_gate.dtype)
            else:
                a_s = tl.load(a_scale_ptr + token * a_groups + kk, mask=valid_m, other=0.0)
            s_gate = tl.load(s_base + (offs_n // SCALE_BLOCK_N) * w_scale_cols + kk, mask=valid_n, other=0.0)
            s_up = tl.load(s_base + ((offs_n + I) // SCALE_BLOCK_N) * w_scale_cols + kk, mask=valid_n, other=0.0)
            acc_gate += tl.dot(a, b_gate, input_precision=DOT_PRECISION) * a_s[:, None] * s_gate[None, :]
            acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION) * a_s[:, None] * s_up[None, :]
        else:
            acc_gate += tl.dot(a, b_gate.to(a.dtype), input_precision=DOT_PRECISION)
            acc_up += tl.dot(a, b_up.to(a.dtype), input_precision=DOT_PRECISION)
    h = (acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up).to(OUT_DTYPE)
    out_mask = valid_m[:, None] & valid_n[None, :]
    if FUSE_QUANT:
        h_q, h_s = quantize_group(h.to(tl.float32), FP8_MAX_C, FLOOR)
        tl.store(out_ptr + pair[:, None] * I + offs_n[None, :], h_q.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(out_scale_ptr + pair * tl.cdiv(I, BLOCK_N) + pid_n, h_s, mask=valid_m)
    else:
        tl.store(out_ptr + pair[:, None] * I + offs_n[None, :], h.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def down_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_pair_ptr, block_expert_ptr, topk_weight_ptr,
    num_pairs, H, I, a_groups, w_scale_rows, w_scale_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """y[pair, n] = topk_weight[pair] * (h_pair . w2[e, n]), stored in fp32."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + offs_m)
    valid_m = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_n = offs_n < H
    w_base = w_ptr + expert * H * I
    s_base = w_scale_ptr + expert * w_scale_rows * w_scale_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(tl.cdiv(I, BLOCK_K)):
        offs_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        valid_k = offs_k < I
        a = tl.load(a_ptr + pair[:, None] * I + offs_k[None, :], mask=valid_m[:, None] & valid_k[None, :], other=0.0)
        b = tl.load(w_base + offs_n[None, :] * I + offs_k[:, None], mask=valid_k[:, None] & valid_n[None, :], other=0.0)
        if QUANT:
            a_s = tl.load(a_scale_ptr + pair * a_groups + kk, mask=valid_m, other=0.0)
            s = tl.load(s_base + (offs_n // SCALE_BLOCK_N) * w_scale_cols + kk, mask=valid_n, other=0.0)
            acc += tl.dot(a, b, input_precision=DOT_PRECISION) * a_s[:, None] * s[None, :]
        else:
            acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)
    routed = tl.load(topk_weight_ptr + pair, mask=valid_m, other=0.0)
    acc = acc * routed[:, None]
    out_mask = valid_m[:, None] & valid_n[None, :]
    tl.store(out_ptr + pair[:, None] * H + offs_n[None, :], acc, mask=out_mask)
