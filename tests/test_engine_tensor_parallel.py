"""The engine with tensor_parallel_size=2 (two gloo ranks on CPU) matches the single process.

On a dequantized copy of the tiny checkpoint: with FP8 weights the activations are rounded to e4m3,
and the all-reduces sum in another order than one process does, which can flip a rounding and then a
near-tied greedy token of the random model (tests/test_model_tensor_parallel.py checks the FP8 path)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from kserve.engine.llm import LLM
from kserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def dense_tiny_dir(tiny_k2_dir, tmp_path_factory):
    from kserve.model.loader import write_dequantized_checkpoint

    return write_dequantized_checkpoint(tiny_k2_dir, tmp_path_factory.mktemp("dense") / "k2")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is unavailable")
def test_tp2_engine_matches_tp1(dense_tiny_dir) -> None:
    prompts = [[11 + 3 * i for i in range(n)] for n in (5, 23, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    knobs = {"model": str(dense_tiny_dir), "dtype": "float32", "device": "cpu", "num_kv_blocks": 64,
             "max_num_batched_tokens": 32}
    expected = [o.token_ids for o in LLM(**knobs).generate(prompts, params, use_tqdm=False)]
    with LLM(tensor_parallel_size=2, **knobs) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = llm.generate(prompts[:1], params[:1], use_tqdm=False)[0].token_ids
    assert got == expected
    assert again == expected[0]
    assert not dist.is_initialized()
