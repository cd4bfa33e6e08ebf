"""Dense 16-bit GEMMs widened to fp32 on CPUs without 16-bit matmul instructions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kserve.kernels import dense_gemm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _bf16_ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest error in units of bf16's spacing at the exact value."""
    spacing = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=1e-3)
    return float(((got.double() - exact).abs() / spacing).max())


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(dense_gemm, "CPU_NATIVE_16BIT", frozenset())


def test_widened_linear_is_the_exact_product_rounded_once(no_native_bf16):
    torch.manual_seed(0)
    x = torch.randn(64, 320).bfloat16()
    w = torch.randn(96, 320).bfloat16()
    exact = x.double() @ w.double().T
    got = dense_gemm.linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (64, 96)
    # fp32 accumulation then one rounding to bf16: within a bf16 ulp (plus fp32 summation error)
    assert _bf16_ulps(got, exact) <= 1.01
    assert dense_gemm.widens(x, 64)


def test_few_rows_and_native_cpus_and_fp32_are_not_widened(monkeypatch, no_native_bf16):
    torch.manual_seed(0)
    w = torch.randn(48, 64).bfloat16()
    few = torch.randn(dense_gemm.WIDEN_MIN_ROWS - 1, 64).bfloat16()
    assert not dense_gemm.widens(few, few.shape[0])
    assert torch.equal(dense_gemm.linear(few, w), F.linear(few, w))
    many = torch.randn(32, 64).bfloat16()
    assert not dense_gemm.widens(many.float(), 32)
    assert torch.equal(dense_gemm.linear(many.float(), w.float()), F.linear(many.float(), w.float()))
    monkeypatch.setattr(dense_gemm, "CPU_NATIVE_16BIT", frozenset({torch.bfloat16}))
    assert not dense_gemm.widens(many, 32)
    assert torch.equal(dense_gemm.linear(many, w), F.linear(many, w))


def test_a_large_weight_is_widened_in_chunks_with_the_same_result(monkeypatch, no_native_bf16):
    torch.manual_seed(1)
    x = torch.randn(2, 8, 128).bfloat16()  # leading dims: 16 rows
    w = torch.randn(1000, 128).bfloat16()
    whole = dense_gemm.linear(x, w)
    monkeypatch.setattr(dense_gemm, "WIDEN_CHUNK_ELEMENTS", 128 * 96)  # 96 weight rows at a time, ragged tail
    chunked = dense_gemm.linear(x, w)
    assert chunked.shape == (2, 8, 1000)
    assert torch.equal(chunked, whole)


def test_widened_bmm(no_native_bf16):
    torch.manual_seed(2)
    a = torch.randn(8, 16, 128).bfloat16()
    b = torch.randn(8, 128, 512).bfloat16()
    got = dense_gemm.bmm(a, b.transpose(1, 2).contiguous().transpose(1, 2))  # a transposed view, as W_UV^T is
    assert got.dtype == torch.bfloat16
    assert _bf16_ulps(got, a.double() @ b.double()) <= 1.01
