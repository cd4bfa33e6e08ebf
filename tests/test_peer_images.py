"""kserve's image path against vLLM's CPU build on the same tiny K2.6 checkpoint (benchmarks/peer_images.py):
five chat prompts with 1 to 3 images of different sizes and aspect ratios, text before and after each image, fp32,
greedy. Same expanded prompt ids (so the same prompt_tokens), the same 16 greedy tokens, logprobs within 1e-3,
also with a 16-token prefill budget that cuts through the images; swapping two same-size images changes the
output (the agreement is not the text's alone).

Needs vLLM's venv (/tmp/vllm-venv/bin/python or $KSERVE_VLLM_PYTHON, see docs/peer_k25.md) and Moonshot's
tokenizer code in ../shared/kimi_k25/tokenizer (vLLM's kimi_k25 processor needs a tokenizer); skipped otherwise.
About 1.5 minutes on 2 cores, most of it vLLM's start-up."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytest.importorskip("PIL.Image")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "peer_images.py"
VLLM_PYTHON = Path(os.environ.get("KSERVE_VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))

# (width, height) -> placeholder tokens: (ceil(w / 28) * ceil(h / 28)) for these small images (no downscaling)
IMAGE_TOKENS = {(100, 60): 12, (30, 90): 8, (64, 64): 9, (300, 200): 88, (20, 20): 1, (40, 180): 14, (90, 30): 8}


def _bench():
    spec = importlib.util.spec_from_file_location("peer_images", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tiny_k25_dir, tmp_path_factory) -> dict:
    bench = _bench()
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"vLLM's venv is not at {VLLM_PYTHON} (set KSERVE_VLLM_PYTHON; docs/peer_k25.md says how to make it)")
    if not (bench.DEFAULT_TOKENIZER_CODE / "tokenization_kimi.py").is_file():
        pytest.skip(f"Moonshot's tokenization_kimi.py is not in {bench.DEFAULT_TOKENIZER_CODE} (../shared/ absent); "
                    f"vLLM's kimi_k25 processor needs the tokenizer")
    out = bench.run(tiny_k25_dir, str(VLLM_PYTHON), 16, tmp_path_factory.mktemp("peer_images"), prefill_chunk=16)
    if not out["vllm"].startswith("vllm "):
        pytest.fail(f"vLLM did not run: {out['vllm']}")
    bench.print_table(out["rows"])
    return out


def test_same_prompt_tokens_as_vllm(report) -> None:
    assert len(report["rows"]) == 5
    for row in report["rows"]:
        assert 1 <= len(row["images"]) <= 3
        assert row["kserve_prompt_tokens"] == row["vllm_prompt_tokens"], row["prompt"]
        assert row["prompt_ids_equal"], row["prompt"]  # the placeholder runs sit at the same positions too
        # the rendered prompt (one <|media_pad|> per image) grows by (placeholders - 1) per image
        expected = row["rendered_prompt_tokens"] + sum(IMAGE_TOKENS[tuple(size)] - 1 for size in row["images"])
        assert row["kserve_prompt_tokens"] == expected, row["prompt"]


def test_same_greedy_tokens_as_vllm(report) -> None:
    for rows in (report["rows"], report["chunked_rows"]):
        for row in rows:
            assert row["tokens_equal"], (row["prompt"], row["first_divergence"], row.get("at_divergence"))
            assert len(row["vllm_tokens"]) == 16
            # fp32 on both sides: the chosen tokens' logprobs agree closely, far inside the top-2 gaps
            assert row["max_abs_logprob_diff"] < 1e-3, row
    assert all(report["chunked_equals_unchunked"])


def test_swapped_images_change_the_output(report) -> None:
    control = report["control"]
    assert control["prompt_ids_equal_to_unswapped"]
    assert not control["tokens_equal_to_unswapped"] and not control["tokens_equal_to_vllm"]
