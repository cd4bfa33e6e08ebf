"""Triton kernels of the W4A16 fused MoE (launch code and contract: kserve.kernels.fused_moe_w4a16).

Imported lazily; the jit helpers sit at module level so the interpreter (TRITON_INTERPRET=1) resolves them.
"""

import triton
import triton.language as tl


@triton.jit
def unpack_int4_tile(words, SUB_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """[SUB_K / 8, BLOCK_N] int32 words (word w of column n holds inputs 8w .. 8w + 7, input 8w + i in bits
    4i .. 4i + 3, offset by 8) -> [SUB_K, BLOCK_N] signed INT4 values. Each word is loaded once; the eight
    nibbles are split in registers, so only packed bytes are loaded and staged."""
    shifts = tl.arange(0, 8) * 4
    nibbles = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [SUB_K / 8, 8, BLOCK_N]
    return tl.reshape(nibbles, (SUB_K, BLOCK_N)) - 8


@triton.jit
def w4a16_gate_up_kernel(
    x_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_pair_ptr, block_expert_ptr,
    num_pairs, top_k, H, I, scale_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """h[pair, n] = silu(x_t . w13[e, n]) * (x_t . w13[e, I + n]) for the pairs of one padded block.

    Each K step covers BLOCK_K inputs as BLOCK_K / SUB_K dots of SUB_K inputs, SUB_K dividing the scale
    group: every partial product is scaled by its group's scale in fp32, so the weights used are exactly
    q * scale (never rounded to x.dtype)."""
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
    words_per_row = H // 8
    gate_rows = w_ptr + expert * (2 * I) * words_per_row + offs_n[None, :] * words_per_row
    up_rows = gate_rows + I * words_per_row
    gate_scales = w_scale_ptr + expert * (2 * I) * scale_cols + offs_n * scale_cols
    up_scales = gate_scales + I * scale_cols
    x_rows = x_ptr + token[:, None] * H
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(H // BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB_K):
            k0 = kk * BLOCK_K + j * SUB_K
            offs_k = k0 + tl.arange(0, SUB_K)
            a = tl.load(x_rows + offs_k[None, :], mask=valid_m[:, None], other=0.0)
            word_k = k0 // 8 + tl.arange(0, SUB_K // 8)[:, None]
            q_gate = unpack_int4_tile(tl.load(gate_rows + word_k, mask=valid_n[None, :], other=0), SUB_K, BLOCK_N)
            q_up = unpack_int4_tile(tl.load(up_rows + word_k, mask=valid_n[None, :], other=0), SUB_K, BLOCK_N)
            s_gate = tl.load(gate_scales + k0 // GROUP, mask=valid_n, other=0.0).to(tl.float32)
            s_up = tl.load(up_scales + k0 // GROUP, mask=valid_n, other=0.0).to(tl.float32)
            # INT4 values are exact in every activation dtype; the products accumulate in fp32.
            acc_gate += tl.dot(a, q_gate.to(a.dtype), input_precision=DOT_PRECISION) * s_gate[None, :]
            acc_up += tl.dot(a, q_up.to(a.dtype), input_precision=DOT_PRECISION) * s_up[None, :]
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out_mask = valid_m[:, None] & valid_n[None, :]
    tl.store(out_ptr + pair[:, None] * I + offs_n[None, :], h.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def w4a16_down_kernel(
    h_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_pair_ptr, block_expert_ptr, topk_weight_ptr,
    num_pairs, H, I, scale_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """y[pair, n] = topk_weight[pair] * (h_pair . w2[e, n]), stored in fp32 (scales as in gate_up)."""
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
    words_per_row = I // 8
    w_rows = w_ptr + expert * H * words_per_row + offs_n[None, :] * words_per_row
    scales = w_scale_ptr + expert * H * scale_cols + offs_n * scale_cols
    h_rows = h_ptr + pair[:, None] * I
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(I // BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB_K):
            k0 = kk * BLOCK_K + j * SUB_K
            offs_k = k0 + tl.arange(0, SUB_K)
            a = tl.load(h_rows + offs_k[None, :], mask=valid_m[:, None], other=0.0)
            word_k = k0 // 8 + tl.arange(0, SUB_K // 8)[:, None]
            q = unpack_int4_tile(tl.load(w_rows + word_k, mask=valid_n[None, :], other=0), SUB_K, BLOCK_N)
            s = tl.load(scales + k0 // GROUP, mask=valid_n, other=0.0).to(tl.float32)
            acc += tl.dot(a, q.to(a.dtype), input_precision=DOT_PRECISION) * s[None, :]
    routed = tl.load(topk_weight_ptr + pair, mask=valid_m, other=0.0)
    acc = acc * routed[:, None]
    out_mask = valid_m[:, None] & valid_n[None, :]
    tl.store(out_ptr + pair[:, None] * H + offs_n[None, :], acc, mask=out_mask)
