import os

import pytest
import torch

from kserve.kernels.fp8_dequant import triton_available
from kserve.kernels.rmsnorm import rms_norm, rms_norm_torch


def test_torch_rmsnorm_matches_definition():
    x = torch.randn(5, 96, dtype=torch.float64)
    w = torch.randn(96, dtype=torch.float64)
    want = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm_torch(x, w, 1e-6), want)
    torch.testing.assert_close(rms_norm(x.float(), w.float(), 1e-6), want.float())


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cols", [128, 160, 7])
def test_triton_rmsnorm_matches_torch(dtype, cols):
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    from kserve.kernels.rmsnorm import rms_norm_triton

    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(6, cols, generator=gen) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype)
    got = rms_norm_triton(x, w, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, rms_norm_torch(x, w, 1e-6), rtol=tol, atol=tol)
    assert rms_norm_triton(x[:0], w, 1e-6).shape == (0, cols)
