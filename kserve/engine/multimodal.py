"""Images in a request, as the engine takes them: preprocessed pixels, their placeholder count and a content hash.

The prompt holds each image as a run of `num_tokens` placeholder ids (`media_placeholder_token_id`, K2.6:
163605), images in order. The engine encodes a request's images once, before its first prefill chunk,
keeps the embeddings with the sequence (preemption recomputes the text, not the tower), and the model
takes them in place of the placeholders' token embeddings. Prefix-cache blocks covering an image are
keyed on its content hash as well as the token ids, so two different images never share cached blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageInput:
    pixel_values: torch.Tensor  # [patches, 3, p, p] float32, as kserve.model.vision_preprocess makes them
    grid_thw: tuple[int, int, int]
    num_tokens: int  # placeholders in the prompt, = embeddings the tower returns
    content_hash: str  # of the pixels the tower sees

    @classmethod
    def from_preprocessed(cls, image) -> ImageInput:
        """From `kserve.model.vision_preprocess.PreprocessedImage`."""
        pixels = image.pixel_values.contiguous()
        digest = hashlib.sha256(pixels.numpy().tobytes())
        digest.update(repr(tuple(image.grid_thw)).encode())
        return cls(pixels, tuple(image.grid_thw), image.num_tokens, digest.hexdigest())


def placeholder_runs(token_ids: list[int], placeholder_id: int) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of placeholder ids, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate(token_ids):
        if token == placeholder_id:
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(token_ids) - start))
    return runs
