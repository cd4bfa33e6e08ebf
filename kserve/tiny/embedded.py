"""The embedded model: a tiny K2.6 trained on synthetic tool-use chats, shipped inside the package.

`kserve serve` with no model and `LLM()` serve it. It was written by scripts/train_tiny_chat.py in
K2.6's published layout (`kimi_k25` wrapper, compressed-tensors INT4 routed experts, tiktoken.model,
tokenizer_config.json, generation_config.json); the README's model card says what it can and cannot do.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL_NAME = "tiny-k26-chat"


def embedded_model_dir() -> Path:
    """The packaged checkpoint's directory (read-only; loaded in place)."""
    path = Path(__file__).resolve().parent / EMBEDDED_MODEL_NAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the embedded model is missing from the installed package: {path}")
    return path
