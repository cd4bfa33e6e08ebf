"""Which torch device and dtype an engine runs on, from the names a user gives."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
              "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(dtypes)} or 'auto'")
    return dtypes[name]
