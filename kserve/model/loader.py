"""Load a Kimi K2 / DeepSeek-V3 checkpoint (Moonshot's published layout) into `KimiK2ForCausalLM`.

Shards are opened lazily; tensors are read one at a time, FP8 blocks dequantized, and copied into
preallocated parameters by each parameter's `weight_loader` (which slices its own TP shard), so no
second full copy of the weights is ever held. Rotary `inv_freq` buffers and MTP layers
(index >= num_hidden_layers) are skipped.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from kserve.config import ModelConfig
from kserve.distributed import ParallelState
from kserve.kernels.fp8_dequant import dequantize_blocks, scale_shape
from kserve.model.deepseek_v3 import KimiK2ForCausalLM
from kserve.model.weights_layout import FP8, TensorSpec, checkpoint_tensors

INDEX_FILE = "model.safetensors.index.json"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: the message names the tensor and the file."""


def read_weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index (or the single `model.safetensors`)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise CheckpointError(f"no {INDEX_FILE} or model.safetensors in {model_dir}")


class ShardReader:
    """Opens each shard once, on first use; reads single tensors with their shape and dtype checked."""

    def __init__(self, model_dir: Path, weight_map: dict[str, str], stack: contextlib.ExitStack):
        self.model_dir = model_dir
        self.weight_map = weight_map
        self.stack = stack
        self.handles: dict[str, tuple[object, set[str]]] = {}

    def _handle(self, name: str, what: str):
        from safetensors import safe_open

        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{what} {name!r} is missing: not listed in {self.model_dir / INDEX_FILE}")
        if file not in self.handles:
            path = self.model_dir / file
            if not path.is_file():
                raise CheckpointError(f"{what} {name!r} is listed in shard {file}, which does not exist")
            handle = self.stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            self.handles[file] = (handle, set(handle.keys()))
        handle, names = self.handles[file]
        if name not in names:
            raise CheckpointError(f"{what} {name!r} is missing from {self.model_dir / file}")
        return handle, file

    def read(self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], what: str = "tensor") -> torch.Tensor:
        handle, file = self._handle(name, what)
        got = tuple(handle.get_slice(name).get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{what} {name!r} in {file} has shape {list(got)}, expected {list(shape)}")
        tensor = handle.get_tensor(name)
        if tensor.dtype not in dtypes:
            raise CheckpointError(f"{what} {name!r} in {file} has dtype {tensor.dtype}, expected one of {dtypes}")
        return tensor


def _read_spec(
    reader: ShardReader, spec: TensorSpec, config: ModelConfig, out_dtype: torch.dtype, device: torch.device,
    keep_fp8: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tensor, scale) as the model uses them, on `device`.

    FP8 weights are dequantized there (Triton on CUDA) and scale is None, unless `keep_fp8`, in which
    case the raw float8 weight and its fp32 scale are returned. Other tensors are converted to `out_dtype`.
    """
    if spec.kind == FP8:
        weight = reader.read(spec.name, spec.shape, (torch.float8_e4m3fn,), "fp8 weight").to(device)
        block = config.quantization_config.weight_block_size
        scale = reader.read(spec.scale_name, scale_shape(spec.shape, block), (torch.float32,), "fp8 scale").to(device)
        if keep_fp8:
            return weight, scale
        return dequantize_blocks(weight, scale, block, out_dtype), None
    allowed = (torch.bfloat16, torch.float16, torch.float32)
    return reader.read(spec.name, spec.shape, allowed).to(device=device, dtype=out_dtype), None


def iter_checkpoint(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    skip: Callable[[TensorSpec], bool] = lambda spec: False,
    device: torch.device | str = "cpu",
    keep_fp8: Callable[[TensorSpec], bool] = lambda spec: False,
) -> Iterator[tuple[TensorSpec, torch.Tensor, torch.Tensor | None]]:
    """Yield (spec, tensor, scale) for every expected tensor, one at a time, with a progress bar.

    `scale` is None unless `keep_fp8(spec)` kept an FP8 weight quantized.
    """
    model_dir = Path(model_dir)
    weight_map = read_weight_map(model_dir)
    specs = [s for s in checkpoint_tensors(config) if not skip(s)]
    for spec in specs:  # fail before reading anything when the index lacks a tensor
        for name, what in [(spec.name, "tensor")] + ([(spec.scale_name, "fp8 scale")] if spec.kind == FP8 else []):
            if name not in weight_map:
                raise CheckpointError(f"{what} {name!r} is missing: not listed in {model_dir / INDEX_FILE}")
    # Shard by shard, unmapping each when done, so at most one shard's pages stay resident.
    by_shard: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        by_shard.setdefault(weight_map[spec.name], []).append(spec)
    with tqdm(total=len(specs), desc=f"loading {model_dir.name}", unit="tensor", disable=None, leave=False) as bar:
        for shard_specs in by_shard.values():
            with contextlib.ExitStack() as stack:
                reader = ShardReader(model_dir, weight_map, stack)
                for spec in shard_specs:
                    yield (spec, *_read_spec(reader, spec, config, dtype, torch.device(device), keep_fp8(spec)))
                    bar.update(1)


def _target(spec: TensorSpec) -> tuple[str, dict]:
    """The parameter a checkpoint tensor loads into, and the weight_loader's extra arguments."""
    m = _EXPERT.match(spec.name)
    if m is None:
        return spec.name, {}
    param = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"
    return param, {"expert_id": int(m.group(2)), "shard_id": m.group(3)}


def load_weights(model: KimiK2ForCausalLM, model_dir: str | Path) -> None:
    params = dict(model.named_parameters())
    experts = {name: mod for name, mod in model.named_modules() if name.endswith("mlp.experts")}
    dtype, device = model.lm_head.weight.dtype, model.lm_head.weight.device

    def not_ours(spec: TensorSpec) -> bool:
        m = _EXPERT.match(spec.name)
        return m is not None and not experts[m.group(1)].owns(int(m.group(2)))

    def stored_fp8(spec: TensorSpec) -> bool:
        return params[_target(spec)[0]].dtype == torch.float8_e4m3fn

    for spec, tensor, scale in iter_checkpoint(model_dir, model.config, dtype, not_ours, device, stored_fp8):
        name, extra = _target(spec)
        param = params[name]
        param.weight_loader(param, tensor if scale is not None else tensor.to(param.dtype), **extra)
        if scale is not None:
            scale_param = params[name + "_scale_inv" if extra else spec.scale_name]
            scale_param.weight_loader(scale_param, scale, **extra)
        del tensor, scale


def load_model(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    parallel: ParallelState = ParallelState(),
    *,
    keep_fp8: bool = False,
) -> KimiK2ForCausalLM:
    """`keep_fp8=True` keeps block-aligned FP8 weights quantized (dequantized per forward)."""
    config = ModelConfig.from_model_dir(model_dir)
    model = KimiK2ForCausalLM(config, parallel, dtype=dtype, device=device, keep_fp8=keep_fp8)
    load_weights(model, model_dir)
    return model.eval()


__all__ = ["CheckpointError", "iter_checkpoint", "load_model", "load_weights", "read_weight_map"]
