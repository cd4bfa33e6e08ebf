"""Block-FP8 (w8a8) linear: Triton (interpreter) vs torch reference, reference vs an independent
dequantize-then-matmul, error against unquantized fp32, the custom op under tracing, and bad input."""

import os

import pytest
import torch

from kserve.kernels.fp8_gemm import fp8_block_linear, w8a8_block_matmul_torch
from kserve.kernels.fp8_quant import FP8_DTYPE, dequantize_per_token_group_torch, quantize_per_token_group_torch
from kserve.kernels.triton_support import triton_available

needs_interpreter = pytest.mark.skipif(
    not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs Triton under TRITON_INTERPRET=1 (the GPU path is checked by benchmarks/gpu_check.py)",
)

# (M, N, K): decode and ragged batches; N and K off multiples of 128.
RAGGED = [(1, 160, 200), (3, 576, 160), (33, 200, 576), (3, 256, 256)]


def make_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float8_e4m3fn weight with per-128x128-block fp32 scales of varying size (built here, not
    with the library's quantizer, so the test does not lean on code it checks)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 1e-2 + 1e-4
    return q, scale


def make_activation(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows and groups on very different scales, as real activations are.
    return torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10 * (1 + 9 * torch.rand(1, k, generator=gen))


def dequantize_weight_by_loop(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    w = q.double()
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            w[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128] *= float(scale[bi, bj])
    return w


@pytest.mark.parametrize("m,n,k", RAGGED + [(2, 576, 7168)])  # last: K2's kv_a_proj_with_mqa
def test_reference_matches_dequantize_then_matmul(m, n, k):
    x = make_activation(m, k, seed=m + n + k)
    w_q, w_s = make_weight(n, k, seed=n * k)
    got = w8a8_block_matmul_torch(x, w_q, w_s)
    x_q, x_s = quantize_per_token_group_torch(x)
    want = dequantize_per_token_group_torch(x_q, x_s).double() @ dequantize_weight_by_loop(w_q, w_s).t()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # Same quantized values; only fp32 summation order differs from the float64 product.
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_reference_in_several_weight_chunks(monkeypatch):
    from kserve.kernels import fp8_gemm

    x = make_activation(5, 600, seed=21)  # 5 groups, the last one ragged
    w_q, w_s = make_weight(200, 600, seed=22)
    whole = w8a8_block_matmul_torch(x, w_q, w_s)
    monkeypatch.setattr(fp8_gemm, "CHUNK_ELEMENTS", 200 * 128 * 2)  # two groups per chunk: 3 chunks
    chunked = w8a8_block_matmul_torch(x, w_q, w_s)
    x_q, x_s = quantize_per_token_group_torch(x)
    want = dequantize_per_token_group_torch(x_q, x_s).double() @ dequantize_weight_by_loop(w_q, w_s).t()
    for got in (whole, chunked):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_error_against_unquantized_fp32_matmul():
    """Measured (seeded, M=16 N=576 K=1024, rows/groups on different scales): relative Frobenius error
    ~2.5e-2 against x @ dequant(W)^T with x unquantized; that is fp8 e4m3's 3-bit mantissa on the
    activations (the weight is the same on both sides)."""
    m, n, k = 16, 576, 1024
    x = make_activation(m, k, seed=7)
    w_q, w_s = make_weight(n, k, seed=8)
    exact = x.double() @ dequantize_weight_by_loop(w_q, w_s).t()
    got = w8a8_block_matmul_torch(x, w_q, w_s).double()
    rel = ((got - exact).norm() / exact.norm()).item()
    print(f"block-FP8 linear vs unquantized fp32 matmul: relative error {rel:.3e}")
    assert 1e-3 < rel < 5e-2  # quantization really happened, and it is fp8-sized


@needs_interpreter
@pytest.mark.parametrize("container", [torch.float32, torch.float16])
def test_triton_quant_matches_reference_exactly(container):
    from kserve.kernels.fp8_gemm import quantize_per_token_group_triton

    # Row 0: a group whose scale is exactly 1 (amax 448), so its values are the rounding inputs themselves:
    # every fp8 value's midpoint with its neighbour (ties to even) and points just off them.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    probes = torch.cat([mids, mids * (1 + 2**-20), mids * (1 - 2**-20), -mids])[:508]
    probes = torch.cat([probes, torch.zeros(508 - probes.numel())])
    rows = torch.zeros(5, 512)
    rows[0] = torch.cat([torch.full((4, 1), 448.0), probes.view(4, 127)], dim=1).flatten()
    rows[1] = make_activation(1, 512, seed=1)
    rows[2, :128] = 0.0  # an all-zero group
    rows[2, 128:] = 1e-30  # tiny values near the scale floor
    rows[3:] = make_activation(2, 512, seed=2) * 1e3
    for x in (rows, rows[:, :300], rows[:3, :129]):  # ragged last groups too
        want_q, want_s = quantize_per_token_group_torch(x)
        got_q, got_s = quantize_per_token_group_triton(x, out_dtype=container)
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_q.float(), want_q.float())


@needs_interpreter
@pytest.mark.parametrize("container", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", RAGGED)
def test_triton_gemm_matches_reference(container, m, n, k):
    from kserve.kernels.fp8_gemm import w8a8_block_matmul_triton

    x = make_activation(m, k, seed=3 * m + k)
    w_q, w_s = make_weight(n, k, seed=n + 5 * k)
    want = w8a8_block_matmul_torch(x, w_q, w_s)
    got = w8a8_block_matmul_triton(x, w_q.float().to(container), w_s, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_interpreter
@pytest.mark.parametrize("m,n,k,split_k", [(3, 200, 576, 3), (1, 160, 1100, 4), (2, 130, 300, 9)])
def test_triton_gemm_split_k_matches_reference(m, n, k, split_k):
    """K groups shared by several programs (decode-sized GEMMs on the GPU), ragged last group included;
    more splits than groups falls back to one group per split."""
    from kserve.kernels.fp8_gemm import w8a8_block_matmul_triton

    x = make_activation(m, k, seed=k + split_k)
    w_q, w_s = make_weight(n, k, seed=n + split_k)
    want = w8a8_block_matmul_torch(x, w_q, w_s)
    got = w8a8_block_matmul_triton(x, w_q.float(), w_s, out_dtype=torch.float32, split_k=split_k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_interpreter
def test_triton_gemm_k2_shape_and_leading_dims():
    """K2's per-rank o_proj at TP 8 (K = 8 heads x 128, N = 7168) on a [2, 1, K] decode input."""
    from kserve.kernels.fp8_gemm import w8a8_block_matmul_triton

    x = make_activation(2, 1024, seed=11).view(2, 1, 1024)
    w_q, w_s = make_weight(7168, 1024, seed=12)
    want = w8a8_block_matmul_torch(x, w_q, w_s)
    got = w8a8_block_matmul_triton(x, w_q.float().to(torch.float16), w_s, block_n=128)
    assert got.shape == (2, 1, 7168)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_op_dispatch_leading_dims_and_out_dtype():
    x = make_activation(6, 200, seed=4)
    w_q, w_s = make_weight(160, 200, seed=5)
    want = w8a8_block_matmul_torch(x, w_q, w_s)
    got = fp8_block_linear(x.view(2, 3, 200), w_q, w_s)
    assert got.shape == (2, 3, 160) and got.dtype == torch.float32
    assert torch.equal(got.view(6, 160), want)  # CPU runs exactly the reference
    bf = fp8_block_linear(x.bfloat16(), w_q, w_s, out_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    # bf16 input rounds x before quantization; the result stays within fp8 error of the fp32 run.
    assert ((bf.float() - want).norm() / want.norm()).item() < 5e-2
    assert fp8_block_linear(x[:0], w_q, w_s).shape == (0, 160)


def test_op_traces_under_fake_tensor_mode_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    w_q, w_s = make_weight(576, 256, seed=6)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(torch.randn(4, 7, 256, dtype=torch.bfloat16))
        fw, fs = mode.from_tensor(w_q), mode.from_tensor(w_s)
        out = fp8_block_linear(fx, fw, fs)
        assert out.shape == (4, 7, 576) and out.dtype == torch.bfloat16
        out = torch.ops.kserve.fp8_block_linear(fx, fw, fs, 128, 128, torch.float32)
        assert out.shape == (4, 7, 576) and out.dtype == torch.float32

    def layer(x):
        return torch.relu(fp8_block_linear(x, w_q, w_s)) * 2

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")  # fullgraph: a graph break raises
    x = make_activation(3, 256, seed=9)
    assert torch.equal(compiled(x), layer(x))


def test_bad_inputs_name_the_problem():
    w_q, w_s = make_weight(256, 384, seed=1)
    x = torch.randn(2, 384)
    with pytest.raises(ValueError, match=r"weight_scale_inv shape \(2, 2\) does not match weight \(256, 384\).*expected \(2, 3\)"):
        fp8_block_linear(x, w_q, w_s[:, :2])
    with pytest.raises(ValueError, match=r"x has K=300.*weight \(256, 384\) has K=384"):
        fp8_block_linear(torch.randn(2, 300), w_q, w_s)
    with pytest.raises(ValueError, match=r"block \(64, 128\) is not supported"):
        fp8_block_linear(x, w_q, w_s, block=(64, 128))
    w4, _ = make_weight(256, 256, seed=2)
    with pytest.raises(ValueError, match=r"implies blocks of about \(64, 64\)"):
        fp8_block_linear(torch.randn(2, 256), w4, torch.ones(4, 4))
    with pytest.raises(ValueError, match="weight must be 2-D"):
        fp8_block_linear(x, w_q[None], w_s)
    with pytest.raises(ValueError, match="weight_scale_inv dtype"):
        fp8_block_linear(x, w_q, w_s.to(FP8_DTYPE))
    with pytest.raises(ValueError, match="weight dtype torch.int8"):
        fp8_block_linear(x, w_q.view(torch.int8), w_s)
    with pytest.raises(ValueError, match="block"):
        torch.ops.kserve.fp8_block_linear(x, w_q, w_s, 128, 64, torch.float32)


def test_group_scales_are_correctly_rounded_quotients_on_every_device():
    """A group's scale is amax / 448 rounded once, as the Triton kernels compute it. On CUDA, torch
    multiplies a tensor by the rounded reciprocal of a Python-float divisor, one ulp off in about half
    the groups: on the first GPU run, a 64 x 7168 activation (3,584 groups) had 1,912 scales and values
    unlike the kernel's. So the reference divides by a tensor, which CPU and CUDA both divide exactly."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kserve.kernels.fp8_quant import group_scales

    class Divisors(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.kinds: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.div:
                self.kinds.append(type(args[1]).__name__)
            return func(*args, **(kwargs or {}))

    x = make_activation(5, 300, seed=3)
    with Divisors() as seen:
        quantize_per_token_group_torch(x)
    assert seen.kinds and all(kind == "Tensor" for kind in seen.kinds), seen.kinds
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    amax = torch.rand(4096) * 100
    exact = (amax.double() / 448.0).float()  # the float64 quotient, rounded once to fp32
    for device in devices:
        assert torch.equal(group_scales(amax.to(device)).cpu(), exact), device
