"""Images through the engine on a tiny K2.6 checkpoint with its random MoonViT tower (kserve/engine/multimodal.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from kserve.config import EngineConfig
from kserve.engine.errors import PromptRejected
from kserve.engine.llm_engine import LLMEngine
from kserve.engine.multimodal import ImageInput
from kserve.engine.sampling_params import SamplingParams

Image = pytest.importorskip("PIL.Image")


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def engine(model_dir, **knobs) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32", **knobs))


def image(eng: LLMEngine, width: int, height: int, seed: int) -> ImageInput:
    from kserve.model.vision_preprocess import preprocess_image

    return ImageInput.from_preprocessed(preprocess_image(png(width, height, seed), eng.image_config))


def prompt(eng: LLMEngine, images: list[ImageInput]) -> list[int]:
    ids = [5, 6, 7]
    for im in images:
        ids += [eng.media_placeholder_token_id] * im.num_tokens + [8, 9]
    return ids + [10]


def run(eng: LLMEngine, request_id: str, images: list[ImageInput], max_tokens: int = 6) -> list[int]:
    eng.add_request(request_id, prompt(eng, images), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                    ignore_eos=True), images=images)
    while eng.has_unfinished():
        for request in eng.step():
            if request.finished and request.request_id == request_id:
                return request.output().outputs[0].token_ids
    raise AssertionError("the request did not finish")


@pytest.fixture(scope="module")
def k25_engine(tiny_k25_dir):
    eng = engine(tiny_k25_dir)
    yield eng
    eng.shutdown()


def test_prefix_cache_never_mixes_two_images_of_one_size(k25_engine) -> None:
    eng = k25_engine
    first, other = image(eng, 100, 60, 1), image(eng, 100, 60, 2)
    assert first.num_tokens == other.num_tokens and first.content_hash != other.content_hash
    hits = eng.stats().prefix_cache_hit_tokens
    a = run(eng, "a", [first])
    b = run(eng, "b", [other])
    assert eng.stats().prefix_cache_hit_tokens == hits  # nothing shared: only "5 6 7" precede the image
    again = run(eng, "a-again", [first])
    assert eng.stats().prefix_cache_hit_tokens > hits  # the same image is served from the cache
    assert again == a and b != a


def test_chunks_cutting_through_images_and_preemption_keep_the_tokens(tiny_k25_dir, k25_engine) -> None:
    """Three images of different sizes and aspect ratios with text around them: a 7-token prefill budget
    cuts through every image, and a cache too small for two requests preempts one; same greedy tokens."""
    images = [image(k25_engine, 100, 60, 3), image(k25_engine, 30, 90, 4), image(k25_engine, 64, 64, 5)]
    whole = run(k25_engine, "whole", images)
    small = engine(tiny_k25_dir, max_num_batched_tokens=7, enable_prefix_caching=False, num_kv_blocks=14,
                   block_size=4)
    try:
        other = [image(small, 50, 50, 6)]
        small.add_request("other", prompt(small, other), SamplingParams(temperature=0.0, max_tokens=12,
                                                                        ignore_eos=True), images=other)
        assert run(small, "cut", images) == whole
        assert small.scheduler.num_preemptions > 0
    finally:
        small.shutdown()


def test_bad_image_requests_are_rejected(k25_engine, tiny_k2_dir) -> None:
    eng = k25_engine
    one = image(eng, 40, 40, 7)
    with pytest.raises(PromptRejected, match="placeholder runs"):
        eng.validate_images(prompt(eng, [one])[:-3], [one, one])
    with pytest.raises(PromptRejected, match="placeholder runs"):
        eng.validate_images(prompt(eng, [one]) + [eng.media_placeholder_token_id], [one])
    text_only = engine(tiny_k2_dir, num_kv_blocks=16)
    try:
        assert not text_only.supports_images
        with pytest.raises(PromptRejected, match="no vision tower"):
            text_only.validate_images([1, 2, 3], [one])
    finally:
        text_only.shutdown()


def test_language_model_only_skips_the_tower(tiny_k25_dir) -> None:
    eng = engine(tiny_k25_dir, language_model_only=True, num_kv_blocks=16)
    try:
        assert eng.vision is None and not eng.supports_images
        assert "--language-model-only" in eng.images_unsupported_reason
    finally:
        eng.shutdown()


def test_tensor_parallel_ranks_get_the_image_embeddings(tiny_k25_dir, k25_engine) -> None:
    """Under TP 2 rank 0 encodes the images and the step carries their embeddings to rank 1: the greedy
    tokens are TP 1's (fp32; INT4 experts run unquantized activations, so only all-reduce order differs)."""
    import torch.distributed as dist

    images = [image(k25_engine, 100, 60, 8), image(k25_engine, 40, 70, 9)]
    expected = run(k25_engine, "tp1", images)
    eng = engine(tiny_k25_dir, tensor_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=16)
    try:
        assert eng.supports_images
        assert run(eng, "tp2", images) == expected
    finally:
        eng.shutdown()
    assert not dist.is_initialized()
