import os

import pytest
import torch

from kserve.kernels.rmsnorm import rms_norm, rms_norm_torch
from kserve.kernels.triton_support import triton_available


def test_torch_rmsnorm_matches_definition():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 96, generator=gen), torch.randn(96, generator=gen)
    x64, w64 = x.double(), w.double()
    want = (w64 * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6)).float()
    torch.testing.assert_close(rms_norm_torch(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)


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
