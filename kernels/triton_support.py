"""Where Triton kernels can run: whether triton is installed, whether a device runs fp8 Triton kernels,
and a device's SM count for sizing split launches."""

from __future__ import annotations

import functools

import torch


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cuda_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one when `device` has no index)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def fp8_triton_runs(device: torch.device) -> bool:
    """Whether Triton kernels with fp8 operands run on `device`: Triton loads float8_e4m3fn natively from sm89."""
    return device.type == "cuda" and triton_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def triton_runs(device: torch.device, *, fp8: bool = False) -> bool:
    """Whether Triton kernels run on `device`: CUDA with triton installed, and sm89+ when `fp8` operands."""
    if fp8:
        return fp8_triton_runs(device)
    return device.type == "cuda" and triton_available()
