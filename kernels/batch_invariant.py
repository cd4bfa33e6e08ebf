"""Batch-invariant building blocks: results for one row that do not depend on the other rows of the call.

GEMMs over row tiles of one fixed shape (`linear_rows` / `matmul_rows` / `bmm_rows`), silu / sigmoid without a
scalar tail, and sums in a fixed order (`sum_fixed_order`, `all_reduce_fixed_order`). The default paths never call
these; the layers switch with their `batch_invariant` attribute (`KimiK2ForCausalLM.set_batch_invariant`). Why the
default ops are not invariant and what each block does: docs/kernels.md; the mode's design and cost:
docs/batch_invariance.md.
"""

from __future__ import annotations

import torch

# Rows per GEMM call. The CPU value trades decode padding (a batch of 1 computes 16 rows) against the
# per-call overhead of long prefills (16 measured a few percent faster than 32 or 64 end to end on the
# tiny model); the CUDA value is one large cuBLAS tile.
CPU_ROW_TILE = 16
CUDA_ROW_TILE = 128


def row_tile(device: torch.device) -> int:
    return CUDA_ROW_TILE if device.type == "cuda" else CPU_ROW_TILE


def _padded_rows(x2: torch.Tensor, tile: int) -> torch.Tensor:
    """x2 [M, K] as a contiguous [ceil(M / tile) * tile, K] tensor (zero rows at the end)."""
    m = x2.shape[0]
    padded = -(-m // tile) * tile
    if padded == m and x2.is_contiguous():
        return x2
    out = x2.new_zeros(padded, x2.shape[1])
    out[:m] = x2
    return out


def matmul_rows(x2: torch.Tensor, w_t: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x2 [M, K] @ w_t [K, N] -> [M, N] through [tile, K] @ [K, N] GEMMs only (a batch-invariant mm)."""
    m, n = x2.shape[0], w_t.shape[1]
    if m == 0:
        return x2.new_empty(0, n, dtype=out_dtype or x2.dtype)
    tile = row_tile(x2.device)
    xp = _padded_rows(x2, tile)
    out = torch.empty(xp.shape[0], n, dtype=x2.dtype, device=x2.device)
    for r in range(0, xp.shape[0], tile):
        torch.mm(xp[r : r + tile], w_t, out=out[r : r + tile])
    out = out[:m]
    return out if out_dtype is None else out.to(out_dtype)


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias), batch-invariant: x [..., K], weight [N, K] -> [..., N]."""
    lead = x.shape[:-1]
    y = matmul_rows(x.reshape(-1, x.shape[-1]), weight.t())
    return y.view(*lead, weight.shape[0])


def addmm_rows_(out: torch.Tensor, x2: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """out [M_pad, N] += x2 [M_pad, K] @ w_t [K, N] in row tiles; M_pad must be a multiple of the tile
    (callers pad once and accumulate several K chunks into the same rows)."""
    tile = row_tile(x2.device)
    if x2.shape[0] % tile:
        raise ValueError(f"addmm_rows_ needs a multiple of {tile} rows, got {x2.shape[0]}")
    for r in range(0, x2.shape[0], tile):
        out[r : r + tile].addmm_(x2[r : r + tile], w_t)
    return out


def bmm_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul x [T, H, K] @ w [H, K, N] -> [T, H, N] (MLA's absorbed W_UK / W_UV), batch-invariant:
    torch.bmm over the H heads of `row_tile` tokens at a time, always with that one shape."""
    tokens, heads, k = x.shape
    n = w.shape[-1]
    if tokens == 0:
        return x.new_empty(0, heads, n)
    tile = row_tile(x.device)
    padded = -(-tokens // tile) * tile
    xt = x.new_zeros(heads, padded, k)
    xt[:, :tokens] = x.transpose(0, 1)
    out = torch.empty(heads, padded, n, dtype=x.dtype, device=x.device)
    for r in range(0, padded, tile):
        torch.bmm(xt[:, r : r + tile], w, out=out[:, r : r + tile])
    return out[:, :tokens].transpose(0, 1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), the same for every element wherever it sits (no scalar-tail formula)."""
    return 1.0 / torch.exp(-x).add_(1.0)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)), computed in fp32 and returned in x.dtype; see `sigmoid`."""
    x32 = x.float()
    return (x32 / torch.exp(-x32).add_(1.0)).to(x.dtype)


def sum_fixed_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` (a short one, such as the top-k slots) as adds from first to last."""
    parts = x.unbind(dim)
    acc = parts[0].clone()
    for part in parts[1:]:
        acc.add_(part)
    return acc


def all_reduce_fixed_order(parallel, x: torch.Tensor) -> torch.Tensor:
    """`parallel.all_reduce(x)` with a fixed order per element: every rank's part gathered, then added in
    rank order (tp_size times the bytes of an all-reduce)."""
    if parallel.tp_size == 1:
        return x
    gathered = parallel.all_gather_last_dim(x.unsqueeze(-1))  # [..., tp] in rank order
    return sum_fixed_order(gathered, -1)
