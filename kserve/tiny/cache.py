"""The embedded tiny model: built once under the cache directory, shared by concurrent callers."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kserve.tiny.checkpoint import write_tiny_checkpoint

EMBEDDED_MODEL_NAME = "tiny-k2-v3"  # bump when the generator's output changes


def ensure_embedded_model() -> Path:
    """The default tiny model (seed 0, k2) under the cache directory, built once.

    Built in a temporary sibling directory and renamed into place, so concurrent callers never
    see a partial model; a loser of the rename race discards its copy.
    """
    from kserve.config import default_cache_dir

    root = default_cache_dir()
    final = root / EMBEDDED_MODEL_NAME
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_MODEL_NAME}-", dir=root))
    try:
        write_tiny_checkpoint(tmp, seed=0, variant="k2")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
