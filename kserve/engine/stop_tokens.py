"""The token ids that end a completion: the tokenizer's stop tokens, generation_config.json's
eos_token_id, and config.json's eos_token_id, in that order, without repeats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def generation_eos_ids(model_dir: Path | None) -> list[int]:
    """eos_token_id from generation_config.json (an int or a list), if the file exists."""
    if model_dir is None:
        return []
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def collect_eos_ids(tokenizer: Any, model_dir: Path | None, config_eos: int | None) -> list[int]:
    eos: list[int] = []
    for tok in (
        list(getattr(tokenizer, "stop_token_ids", None) or [])
        + generation_eos_ids(model_dir)
        + ([config_eos] if config_eos is not None else [])
    ):
        if tok not in eos:
            eos.append(tok)
    return eos
