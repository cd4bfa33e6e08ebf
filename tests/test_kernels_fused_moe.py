"""Fused MoE: the loop-free torch path against an independent per-(token, slot) loop written here, and the
Triton kernels (TRITON_INTERPRET=1, set in conftest) against the torch path. Ragged cases: T=1 and T=33,
k=1 and k=8, H/I not multiples of 128 (dense) or a ragged H edge block (FP8), experts with no token, and a
rank whose every pair belongs to another expert-parallel rank."""

import os

import pytest
import torch
import torch.nn.functional as F

from kserve.kernels.fp8_dequant import dequantize_blocks_torch, quantize_blocks_torch
from kserve.kernels.fp8_quant import dequantize_per_token_group_torch, quantize_per_token_group_torch
from kserve.kernels.fused_moe import _fp8_as_half_times_256, align_pairs_to_experts, fused_moe, fused_moe_torch
from kserve.kernels.triton_support import triton_available


def make_case(tokens, hidden, inter, experts, top_k, *, first_expert=0, total_experts=None, fp8=False,
              dtype=torch.float32, only_experts=None, seed=0):
    """Random inputs; ids are GLOBAL. `only_experts` restricts routing to those global ids."""
    gen = torch.Generator().manual_seed(seed)
    total_experts = total_experts or first_expert + experts
    x = (torch.randn(tokens, hidden, generator=gen)).to(dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    scores = torch.rand(tokens, total_experts, generator=gen)
    if only_experts is not None:
        allowed = torch.zeros(total_experts, dtype=torch.bool)
        allowed[list(only_experts)] = True
        scores = torch.where(allowed, scores + 1, scores - 1)  # allowed ones win when there are >= k
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    if not fp8:
        return {"x": x, "w13": w13.to(dtype), "w2": w2.to(dtype), "topk_weights": weights, "topk_ids": ids,
                "first_expert": first_expert}
    q13, s13 = zip(*(quantize_blocks_torch(w) for w in w13))
    q2, s2 = zip(*(quantize_blocks_torch(w) for w in w2))
    return {"x": x, "w13": torch.stack(q13), "w2": torch.stack(q2), "topk_weights": weights, "topk_ids": ids,
            "first_expert": first_expert, "w13_scale": torch.stack(s13), "w2_scale": torch.stack(s2)}


def fake_quant(a: torch.Tensor) -> torch.Tensor:
    return dequantize_per_token_group_torch(*quantize_per_token_group_torch(a))


def pair_loop_reference(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale=None, w2_scale=None):
    """One (token, slot) at a time, in float64 where nothing is quantized."""
    experts = w13.shape[0]
    if w13_scale is None:
        acts, dense13, dense2 = x.double(), w13.double(), w2.double()
    else:
        acts = torch.cat([fake_quant(x[t : t + 1]) for t in range(x.shape[0])]).double()
        dense13 = [dequantize_blocks_torch(w13[e], w13_scale[e]).double() for e in range(experts)]
        dense2 = [dequantize_blocks_torch(w2[e], w2_scale[e]).double() for e in range(experts)]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j]) - first_expert
            if not 0 <= e < experts:
                continue
            a, wa, wb = acts[t], dense13[e], dense2[e]
            gate, up = (wa @ a).chunk(2)
            h = (F.silu(gate) * up).to(x.dtype)
            if w13_scale is not None:
                h = fake_quant(h[None])[0]
            out[t] += float(topk_weights[t, j]) * (wb @ h.double())
    return out


def assert_moe_close(got, want, rel):
    want = want.double()
    scale = want.abs().max().clamp(min=1e-30)
    err = (got.double() - want).abs().max()
    assert err <= rel * scale, f"max |err| {err:.3e} > {rel} * max |want| {scale:.3e}"


TORCH_CASES = {
    # name: (T, H, I, E_local, k, extra)
    "T1-k1": (1, 200, 72, 6, 1, {}),
    "T33-k8-ragged": (33, 200, 72, 10, 8, {"first_expert": 4, "total_experts": 20}),
    "T33-empty-experts": (33, 96, 40, 8, 2, {"only_experts": [1, 5]}),
    "T5-k4-ep": (5, 130, 24, 4, 4, {"first_expert": 4, "total_experts": 12}),
}


@pytest.mark.parametrize("strategy", ["gather", "grouped"])
@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_torch_dense_matches_pair_loop(name, strategy):
    t, h, i, e, k, extra = TORCH_CASES[name]
    case = make_case(t, h, i, e, k, **extra)
    want = pair_loop_reference(**case)
    if strategy == "grouped" and h * 4 % 16:
        with pytest.raises(ValueError, match="multiple of 16 bytes"):
            fused_moe_torch(**case, strategy=strategy)
        strategy = None  # the automatic choice falls back to gather
    assert_moe_close(fused_moe_torch(**case, strategy=strategy), want, 1e-5)
    assert_moe_close(fused_moe(**case), want, 1e-5)  # the op, CPU dispatch


FP8_CASES = {
    "T1-k1": (1, 256, 128, 4, 1, {}),
    "T33-k8-ep": (33, 256, 128, 9, 8, {"first_expert": 9, "total_experts": 27}),
    "T33-ragged-H-edge-block": (33, 200, 128, 6, 2, {"only_experts": [0, 3, 4]}),
}


@pytest.mark.parametrize("strategy", ["gather", "grouped"])
@pytest.mark.parametrize("name", list(FP8_CASES))
def test_torch_fp8_matches_pair_loop(name, strategy):
    t, h, i, e, k, extra = FP8_CASES[name]
    case = make_case(t, h, i, e, k, fp8=True, **extra)
    assert case["w13"].dtype == torch.float8_e4m3fn
    want = pair_loop_reference(**case)
    # Only fp32 rounding differs; 2e-3 leaves room for one activation element landing on the other side
    # of an fp8 rounding boundary.
    got = fused_moe_torch(**case, strategy=strategy)
    assert_moe_close(got, want, 2e-3)
    assert_moe_close(fused_moe(**case), want, 2e-3)
    containers = dict(case, w13=case["w13"].float(), w2=case["w2"].half())  # the same values, widened
    assert torch.equal(fused_moe_torch(**containers, strategy=strategy), got)


def test_torch_bf16_matches_fp32_closely():
    case = make_case(9, 160, 48, 5, 3)
    want = pair_loop_reference(**case)
    bf = dict(case, x=case["x"].bfloat16(), w13=case["w13"].bfloat16(), w2=case["w2"].bfloat16())
    got = fused_moe_torch(**bf)
    assert got.dtype == torch.bfloat16
    assert_moe_close(got, want, 3e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_rank_with_no_local_token_gives_exact_zeros(fp8):
    # Global experts 0..15; this rank owns 8..11 and every token picks among 0..7 and 12..15.
    case = make_case(7, 256, 128, 4, 4, first_expert=8, total_experts=16, fp8=fp8,
                     only_experts=[0, 1, 2, 3, 12, 13, 14, 15])
    assert not ((case["topk_ids"] >= 8) & (case["topk_ids"] < 12)).any()
    for strategy in ("gather", "grouped"):
        got = fused_moe_torch(**case, strategy=strategy)
        assert torch.equal(got, torch.zeros_like(got))


def test_fast_fp8_decode_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = codes.float()
    got = _fp8_as_half_times_256(codes).float() * 256
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_pairs_to_experts(block_m):
    ids = torch.tensor([[5, 2, 9], [2, 7, 3], [9, 5, 2], [3, 3, 8]])  # local experts are 2..5 (first 2, E 4)
    sorted_ids, block_expert = align_pairs_to_experts(ids, first_expert=2, num_experts=4, block_m=block_m)
    pairs = ids.numel()
    num_blocks = -(-(pairs + 4 * (block_m - 1)) // block_m)
    assert sorted_ids.shape == (num_blocks * block_m,) and block_expert.shape == (num_blocks,)
    flat = ids.flatten()
    for p in range(pairs):  # every local pair exactly once, in a block of its expert; remote pairs never
        where = (sorted_ids == p).nonzero().flatten().tolist()
        if 2 <= int(flat[p]) < 6:
            assert len(where) == 1 and int(block_expert[where[0] // block_m]) == int(flat[p]) - 2
        else:
            assert where == []
    # Segments are in expert order and each starts on a block boundary.
    owners = [int(e) for e in block_expert]
    valid = [e for e in owners if e >= 0]
    assert valid == sorted(valid) and owners[len(valid):] == [-1] * (len(owners) - len(valid))
    for b, e in enumerate(owners):
        block = sorted_ids[b * block_m : (b + 1) * block_m]
        if e < 0:
            assert (block == pairs).all()
        else:
            assert (block < pairs).any()  # no all-padding block inside a segment
    # Within an expert, the pairs keep their original order (stable sort).
    for e in range(4):
        mine = [int(p) for b, o in enumerate(owners) if o == e for p in sorted_ids[b * block_m : (b + 1) * block_m] if p < pairs]
        assert mine == [p for p in range(pairs) if int(flat[p]) - 2 == e]


def test_bad_inputs_name_the_culprit():
    case = make_case(3, 128, 64, 2, 2)
    with pytest.raises(ValueError, match="w2 shape"):
        fused_moe(**dict(case, w2=case["w2"][:, :, :32]))
    with pytest.raises(ValueError, match="topk_ids must be an integer"):
        fused_moe(**dict(case, topk_ids=case["topk_ids"].float()))
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(**dict(case, topk_weights=case["topk_weights"][:, :1]))
    with pytest.raises(ValueError, match="both w13_scale and w2_scale"):
        fused_moe(**dict(case, w13_scale=torch.ones(2, 1, 1)))
    with pytest.raises(ValueError, match="needs scales"):
        fused_moe(**dict(case, w13=case["w13"].to(torch.float8_e4m3fn)))
    q = make_case(3, 256, 128, 2, 2, fp8=True)
    with pytest.raises(ValueError, match="w2_scale shape"):
        fused_moe(**dict(q, w2_scale=q["w2_scale"][:, :1]))
    with pytest.raises(ValueError, match="multiple of the block rows"):
        fused_moe_torch(**dict(q, w13=q["w13"][:, :192], w2=q["w2"][:, :, :96]))


def test_op_traces_without_host_reads():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(4, 256, 128, 3, 2, first_expert=1, total_experts=5, fp8=True)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        out = fused_moe(**fake)
        assert out.shape == (4, 256) and out.dtype == torch.float32

    def step(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids):
        routed = fused_moe(x, w13, w2, topk_weights, topk_ids, 1, w13_scale, w2_scale)
        # The routing prep the Triton path runs must itself trace whole (static sizes, no .item()).
        sorted_ids, block_expert = align_pairs_to_experts(topk_ids, 1, w13.shape[0], 16)
        return routed, sorted_ids, block_expert

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    args = [case[k] for k in ("x", "w13", "w2", "w13_scale", "w2_scale", "topk_weights", "topk_ids")]
    routed, sorted_ids, block_expert = compiled(*args)
    assert torch.equal(routed, fused_moe(**case))
    want_ids, want_blocks = align_pairs_to_experts(case["topk_ids"], 1, 3, 16)
    assert torch.equal(sorted_ids, want_ids) and torch.equal(block_expert, want_blocks)


# --- Triton in the interpreter ---------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(
    not triton_available() or (os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()),
    reason="needs triton with TRITON_INTERPRET=1 or CUDA",
)

TRITON_CASES = {
    # name: (T, H, I, E_local, k, fp8, container dtype, extra)
    "dense-fp32-T1-k1-ragged": (1, 200, 72, 4, 1, False, torch.float32, {}),
    "dense-fp16-T33-k8-ep": (33, 96, 40, 6, 8, False, torch.float16, {"first_expert": 6, "total_experts": 14}),
    "dense-fp32-T33-empty-experts": (33, 130, 24, 8, 2, False, torch.float32, {"only_experts": [2, 7]}),
    "fp8-in-fp32-T33-k8-ep": (33, 256, 128, 5, 8, True, torch.float32, {"first_expert": 5, "total_experts": 15}),
    "fp8-in-fp16-T1-k1": (1, 256, 128, 3, 1, True, torch.float16, {}),
    "fp8-in-fp32-ragged-H-edge-block": (33, 200, 128, 4, 2, True, torch.float32, {"only_experts": [0, 3]}),
}


@needs_triton
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_matches_torch(name):
    from kserve.kernels.fused_moe import fused_moe_triton

    t, h, i, e, k, fp8, container, extra = TRITON_CASES[name]
    case = make_case(t, h, i, e, k, fp8=fp8, dtype=torch.float32 if fp8 else container, **extra)
    want = fused_moe_torch(**case)
    if fp8:  # the interpreter has no fp8: the same fp8 values in a wider container
        case = dict(case, w13=case["w13"].to(container), w2=case["w2"].to(container))
    got = fused_moe_triton(**case)
    assert got.dtype == case["x"].dtype and got.shape == case["x"].shape
    # fp16: the torch path rounds gate/up to fp16 before SiLU, the kernel keeps them in fp32.
    rel = 5e-3 if container == torch.float16 else 2e-3 if fp8 else 1e-5
    assert_moe_close(got, want, rel)
    if fp8:  # in-kernel quantization of x and h == the torch reference's, bit for bit
        assert torch.equal(got, fused_moe_triton(**case, fuse_quant=False))


@needs_triton
def test_triton_in_kernel_quantization_rounds_ties_and_subnormals_like_torch():
    from kserve.kernels.fused_moe import fused_moe_triton

    case = make_case(3, 256, 128, 2, 2, fp8=True)
    # Row 0 has amax 448 (scale exactly 1), so these are quantized as written: ties between fp8
    # neighbours (1.0625, 1.1875, 34, 100), subnormal ties (1.5 and 2.5 * 2^-9), values around 2^-6.
    special = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 34.0, 100.0, 1.5 * 2**-9, 2.5 * 2**-9,
                            -0.5 * 2**-9, 2**-6 - 2**-11, 2**-6 + 2**-10, 0.0])
    x = case["x"].clone()
    x[0, : special.numel()] = special
    x[0, special.numel():128] = 0.5
    x[1, :128] = 0.0  # an all-zero group: the scale floor
    case = dict(case, x=x, w13=case["w13"].float(), w2=case["w2"].float())
    want_q, _ = quantize_per_token_group_torch(x[:1])
    assert [float(v) for v in want_q[0, 1:6]] == [1.0, 1.25, -1.0, 32.0, 96.0]  # ties went to even
    assert torch.equal(fused_moe_triton(**case), fused_moe_triton(**case, fuse_quant=False))


@needs_triton
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_rank_with_no_local_token_gives_exact_zeros(fp8):
    from kserve.kernels.fused_moe import fused_moe_triton

    case = make_case(5, 256, 128, 2, 3, first_expert=2, total_experts=8, fp8=fp8, only_experts=[0, 1, 4, 5, 6, 7])
    if fp8:
        case = dict(case, w13=case["w13"].float(), w2=case["w2"].float())
    got = fused_moe_triton(**case)
    assert torch.equal(got, torch.zeros_like(got))
