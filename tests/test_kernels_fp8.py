import pytest
import torch

from kserve.kernels.fp8_dequant import dequantize_blocks, dequantize_blocks_torch, quantize_blocks_torch, scale_shape
from kserve.kernels.triton_support import triton_available

RAGGED_SHAPES = [(160, 256), (300, 200), (128, 128), (1, 5), (257, 129)]


def loop_reference(w_fp8: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Element by element over blocks: W[i, j] = q[i, j] * s[i // 128, j // 128]."""
    w = w_fp8.float()
    out = torch.empty_like(w)
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            rs = slice(bi * block[0], (bi + 1) * block[0])
            cs = slice(bj * block[1], (bj + 1) * block[1])
            out[rs, cs] = w[rs, cs] * scale[bi, bj]
    return out


@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_dequant_exact_against_reference(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * 3
    q, s = quantize_blocks_torch(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == scale_shape(shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    got = dequantize_blocks_torch(q, s)
    torch.testing.assert_close(got, loop_reference(q, s), rtol=0, atol=0)
    assert torch.equal(dequantize_blocks(q, s), got)
    # fp8 e4m3 has a 3-bit mantissa: relative error per element <= 2^-4 of the block max
    blockmax = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]] * 448
    assert ((got - w).abs() <= blockmax * 2**-4 + 1e-12).all()


def test_dequant_bf16_output_and_scale_mismatch():
    q, s = quantize_blocks_torch(torch.randn(160, 256))
    out = dequantize_blocks_torch(q, s, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_blocks_torch(q, s[:1])


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(160, 256), (200, 130)])
def test_triton_dequant_matches_torch(in_dtype, shape):
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    from kserve.kernels.fp8_dequant import dequantize_blocks_triton

    q, s = quantize_blocks_torch(torch.randn(shape, generator=torch.Generator().manual_seed(3)))
    values = q.float().to(in_dtype)  # the fp8 values, held exactly in fp32/fp16
    ref = dequantize_blocks_torch(values, s)
    got = dequantize_blocks_triton(values, s, out_dtype=torch.float32)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
