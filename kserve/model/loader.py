"""Load a Kimi K2 / DeepSeek-V3 checkpoint (Moonshot's published layout) into `KimiK2ForCausalLM`.

`load_model(dir, device, dtype, parallel, weights="quantized")` keeps FP8 and INT4 tensors as the checkpoint stores
them (kv_b_proj alone is dequantized at load); `weights="dequantized"` dequantizes them into the model dtype. Each
parameter's `checkpoint_slice` is read with safetensors' `get_slice`, one tensor at a time and one shard at a time,
so loading holds the model plus one tensor in flight. The weight modes, the kimi_k25 prefix, what is skipped and
the `LoadReport`: docs/model.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kserve.config import VISION_TENSOR_PREFIXES, ModelConfig
from kserve.distributed import ParallelState
from kserve.kernels.fp8_dequant import dequantize_blocks, scale_shape
from kserve.kernels.int4_pack import dequantize_int4, group_scale_shape
from kserve.model.deepseek_v3 import WEIGHT_MODES, KimiK2ForCausalLM
from kserve.model.weights_layout import EXPERT_TENSOR, FP8, INT4, TensorSpec, checkpoint_tensors

INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "I32": torch.int32,
    "I64": torch.int64,  # compressed-tensors writes weight_shape as int64
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}
_DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

logger = logging.getLogger("kserve.model.loader")

Slices = tuple[slice, ...]


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: the message names the tensor and the file."""


@dataclass
class LoadReport:
    """What one rank read. `bytes_split` counts tensors this rank reads only a part of (tensor- or
    expert-parallel splits, only local experts); `bytes_whole` those every rank reads whole."""

    tp_rank: int
    tp_size: int
    bytes_read: int = 0
    bytes_split: int = 0
    bytes_whole: int = 0
    tensors_read: int = 0
    largest_tensor_bytes: int = 0
    seconds: float = 0.0

    def add(self, tensor: torch.Tensor, split: bool) -> None:
        n = tensor.numel() * tensor.element_size()
        self.bytes_read += n
        if split:
            self.bytes_split += n
        else:
            self.bytes_whole += n
        self.tensors_read += 1
        self.largest_tensor_bytes = max(self.largest_tensor_bytes, n)


def read_weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index (or the single `model.safetensors`)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}  # noqa: SIM118 -- safe_open has no __iter__
    raise CheckpointError(f"no {INDEX_FILE} or model.safetensors in {model_dir}")


def text_weight_map(weight_map: dict[str, str], config: ModelConfig) -> dict[str, str]:
    """The text model's tensors, named without the checkpoint's `weight_prefix`; logs what else is skipped."""
    prefix = config.weight_prefix
    text = {name[len(prefix):]: file for name, file in weight_map.items() if name.startswith(prefix)}
    vision = [name for name in weight_map if name.startswith(VISION_TENSOR_PREFIXES)]
    if vision:
        logger.info("skipping %d vision tensors (%s): the text model alone is loaded",
                    len(vision), ", ".join(p + "*" for p in VISION_TENSOR_PREFIXES))
    return text


class ShardReader:
    """Opens each shard once, on first use; reads single tensors (or slices of them) with their shape
    and dtype checked before any data is read."""

    def __init__(self, model_dir: Path, weight_map: dict[str, str], stack: contextlib.ExitStack, prefix: str = ""):
        self.model_dir = model_dir
        self.weight_map = weight_map  # names without `prefix`, as text_weight_map gives them
        self.prefix = prefix
        self.stack = stack
        self.handles: dict[str, tuple[object, set[str]]] = {}

    def _handle(self, name: str, what: str):
        from safetensors import safe_open

        file = self.weight_map.get(name)
        name = self.prefix + name
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

    def read(
        self,
        name: str,
        shape: tuple[int, ...],
        dtypes: tuple[torch.dtype, ...],
        what: str = "tensor",
        index: Slices | None = None,
    ) -> torch.Tensor:
        """The tensor `name` (which must have `shape` and one of `dtypes`), or only `index` of it."""
        handle, file = self._handle(name, what)
        name = self.prefix + name
        view = handle.get_slice(name)
        got = tuple(view.get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{what} {name!r} in {file} has shape {list(got)}, expected {list(shape)}")
        dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
        if dtype not in dtypes:
            shown = dtype if dtype is not None else view.get_dtype()
            raise CheckpointError(f"{what} {name!r} in {file} has dtype {shown}, expected one of {dtypes}")
        if index is None or all(s == slice(None) for s in index):
            return handle.get_tensor(name)
        return view[index]


def block_slices(index: Slices | None, full_shape: tuple[int, ...], block: tuple[int, int]) -> Slices | None:
    """The scale blocks covering `index` of a weight of `full_shape` (None = all of them)."""
    if index is None:
        return None
    out = []
    for s, size, b in zip(index, full_shape, block):
        start, stop, _ = s.indices(size)
        out.append(slice(start // b, -(-stop // b)))
    return tuple(out)


def dequantize_slice(
    weight: torch.Tensor, scale: torch.Tensor, offsets: tuple[int, int], block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Dequantize a weight slice whose first element sits `offsets` into its first scale block."""
    if offsets == (0, 0):
        return dequantize_blocks(weight, scale, block, dtype)
    rows, cols = weight.shape
    r0, c0 = offsets
    expanded = scale.float().repeat_interleave(block[0], 0)[r0 : r0 + rows].repeat_interleave(block[1], 1)[:, c0 : c0 + cols]
    return (weight.float() * expanded).to(dtype)


def _is_partial(index: Slices | None, shape: tuple[int, ...]) -> bool:
    return index is not None and any(s.indices(n) != (0, n, 1) for s, n in zip(index, shape))


def _target(spec: TensorSpec, packed: bool) -> tuple[str, dict]:
    """The parameter a checkpoint tensor loads into, and the weight_loader's extra arguments. `packed`: the
    model keeps INT4 experts packed (`*_packed` parameters) rather than dequantized."""
    m = EXPERT_TENSOR.match(spec.name)
    if m is None:
        return spec.name, {}
    param = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"
    if spec.kind == INT4 and packed:
        param += "_packed"
    return param, {"expert_id": int(m.group(2)), "shard_id": m.group(3)}


def _companions(spec: TensorSpec) -> list[tuple[str, str]]:
    """The tensors a quantized weight needs beside it: (name, what)."""
    if spec.kind == FP8:
        return [(spec.scale_name, "fp8 scale")]
    if spec.kind == INT4:
        return [(spec.scale_name, "int4 scale"), (spec.shape_name, "int4 shape")]
    return []


def _check_listed(specs: list[TensorSpec], weight_map: dict[str, str], model_dir: Path) -> None:
    """Fail before reading anything when the index lacks a tensor or a quantized weight's scale."""
    for spec in specs:
        for name, what in [(spec.name, "tensor"), *_companions(spec)]:
            if name not in weight_map:
                raise CheckpointError(f"{what} {name!r} is missing: not listed in {model_dir / INDEX_FILE}")


def _by_shard(specs: list[TensorSpec], weight_map: dict[str, str]) -> dict[str, list[TensorSpec]]:
    by_shard: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        by_shard.setdefault(weight_map[spec.name], []).append(spec)
    return by_shard


def load_weights(model: KimiK2ForCausalLM, model_dir: str | Path) -> LoadReport:
    """Fill `model`'s parameters from the checkpoint, reading only this rank's slices."""
    model_dir = Path(model_dir)
    config = model.config
    parallel: ParallelState = model.parallel
    params = dict(model.named_parameters())
    experts = {name: mod for name, mod in model.named_modules() if name.endswith("mlp.experts")}
    block = config.fp8_block or (128, 128)
    packed = model.weights == "quantized"
    report = LoadReport(parallel.tp_rank, parallel.tp_size)
    start_time = time.perf_counter()

    def ours(spec: TensorSpec) -> bool:
        m = EXPERT_TENSOR.match(spec.name)
        return m is None or experts[m.group(1)].owns(int(m.group(2)))

    weight_map = text_weight_map(read_weight_map(model_dir), config)
    specs = [s for s in checkpoint_tensors(config) if ours(s)]
    _check_listed(specs, weight_map, model_dir)
    bar = tqdm(total=len(specs), desc=f"loading {model_dir.name}", unit="tensor", disable=None, leave=False)
    with bar:
        # Shard by shard, unmapping each when done, so at most one shard's pages stay mapped.
        for shard_specs in _by_shard(specs, weight_map).values():
            with contextlib.ExitStack() as stack:
                reader = ShardReader(model_dir, weight_map, stack, config.weight_prefix)
                for spec in shard_specs:
                    name, extra = _target(spec, packed)
                    param = params.get(name)
                    if param is None:
                        raise CheckpointError(f"tensor {spec.name!r} has no parameter {name!r} in the model")
                    index: Slices | None = getattr(param, "checkpoint_slice", None)
                    split = (bool(extra) and parallel.is_parallel) or _is_partial(index, spec.shape)
                    if spec.kind == FP8:
                        _load_fp8(reader, spec, param, params, name, extra, index, block, report, split)
                    elif spec.kind == INT4:
                        _load_int4(reader, spec, param, params, name, extra, config.int4_group_size, report, split)
                    else:
                        tensor = reader.read(spec.name, spec.shape, _DENSE_DTYPES, "tensor", index)
                        report.add(tensor, split)
                        param.weight_loader(param, tensor, **extra)
                        del tensor
                    bar.update(1)
    report.seconds = time.perf_counter() - start_time
    logger.info(
        "rank %d/%d read %.2f GiB in %d tensors (%.2f GiB of split tensors, %.2f GiB replicated) in %.1f s",
        report.tp_rank, report.tp_size, report.bytes_read / 2**30, report.tensors_read,
        report.bytes_split / 2**30, report.bytes_whole / 2**30, report.seconds,
    )
    return report


def _load_fp8(
    reader: ShardReader,
    spec: TensorSpec,
    param: torch.nn.Parameter,
    params: dict[str, torch.nn.Parameter],
    name: str,
    extra: dict,
    index: Slices | None,
    block: tuple[int, int],
    report: LoadReport,
    split: bool,
) -> None:
    weight = reader.read(spec.name, spec.shape, (torch.float8_e4m3fn,), "fp8 weight", index)
    scale_index = block_slices(index, spec.shape, block)
    scale = reader.read(spec.scale_name, scale_shape(spec.shape, block), (torch.float32,), "fp8 scale", scale_index)
    report.add(weight, split)
    report.add(scale, split)
    if param.dtype == torch.float8_e4m3fn:
        scale_param = params.get(name + "_scale_inv" if extra else spec.scale_name)
        if scale_param is None:
            raise CheckpointError(f"fp8 weight {spec.name!r} loads into {name!r}, which has no scale parameter")
        param.weight_loader(param, weight, **extra)
        scale_param.weight_loader(scale_param, scale, **extra)
        return
    # A parameter in a wider dtype: dequantize this slice on the target device.
    offsets = (0, 0) if index is None else tuple(s.indices(n)[0] % b for s, n, b in zip(index, spec.shape, block))
    device = param.device
    dense = dequantize_slice(weight.to(device), scale.to(device), offsets, block, param.dtype)
    del weight, scale
    param.weight_loader(param, dense, **extra)


def _read_int4(reader: ShardReader, spec: TensorSpec, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One INT4 weight's packed words and group scales, after checking its recorded [out, in]."""
    recorded = reader.read(spec.shape_name, (2,), (torch.int32, torch.int64), "int4 shape")
    if tuple(recorded.tolist()) != spec.logical_shape:
        raise CheckpointError(
            f"int4 shape {spec.shape_name!r} records {recorded.tolist()}, expected {list(spec.logical_shape)}"
        )
    packed = reader.read(spec.name, spec.shape, (torch.int32,), "int4 weight")
    # bf16 only: the experts hold bf16 scales, and another dtype would be rounded on the way in.
    scale = reader.read(spec.scale_name, group_scale_shape(*spec.logical_shape, group_size),
                        (torch.bfloat16,), "int4 scale")
    return packed, scale


def _load_int4(
    reader: ShardReader,
    spec: TensorSpec,
    param: torch.nn.Parameter,
    params: dict[str, torch.nn.Parameter],
    name: str,
    extra: dict,
    group_size: int,
    report: LoadReport,
    split: bool,
) -> None:
    packed, scale = _read_int4(reader, spec, group_size)
    report.add(packed, split)
    report.add(scale, split)
    if param.dtype == torch.int32:  # kept packed: words and scales go to their own parameters
        scale_param = params[name.removesuffix("_packed") + "_scale"]
        param.weight_loader(param, packed, **extra)
        scale_param.weight_loader(scale_param, scale, **extra)
        return
    dense = dequantize_int4(packed.to(param.device), scale.to(param.device), group_size, param.dtype)
    del packed, scale
    param.weight_loader(param, dense, **extra)


def iter_checkpoint(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    skip: Callable[[TensorSpec], bool] = lambda spec: False,
) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Yield (spec, full tensor) for every expected tensor, FP8 and INT4 ones dequantized to `dtype` (INT4 to
    its [out, in]) and the others converted to it, one at a time (for references such as hf_reference.py)."""
    model_dir = Path(model_dir)
    weight_map = text_weight_map(read_weight_map(model_dir), config)
    specs = [s for s in checkpoint_tensors(config) if not skip(s)]
    _check_listed(specs, weight_map, model_dir)
    block = config.fp8_block or (128, 128)
    for shard_specs in _by_shard(specs, weight_map).values():
        with contextlib.ExitStack() as stack:
            reader = ShardReader(model_dir, weight_map, stack, config.weight_prefix)
            for spec in shard_specs:
                if spec.kind == INT4:
                    packed, scale = _read_int4(reader, spec, config.int4_group_size)
                    yield spec, dequantize_int4(packed, scale, config.int4_group_size, dtype)
                elif spec.kind == FP8:
                    weight = reader.read(spec.name, spec.shape, (torch.float8_e4m3fn,), "fp8 weight")
                    scale = reader.read(spec.scale_name, scale_shape(spec.shape, block), (torch.float32,), "fp8 scale")
                    yield spec, dequantize_blocks(weight, scale, block, dtype)
                else:
                    yield spec, reader.read(spec.name, spec.shape, _DENSE_DTYPES).to(dtype)


def _dequantized_name(name: str) -> str | None:
    """What a quantized checkpoint's tensor becomes in a dense copy: the weight's name, or None for the scales
    and shapes that are folded into it."""
    if name.endswith(("_scale_inv", ".weight_scale", ".weight_shape")):
        return None
    return name.removesuffix("_packed")


def write_dequantized_checkpoint(model_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Copy a checkpoint with every FP8 and INT4 weight dequantized to `dtype`, its scales and its
    `quantization_config` dropped (tokenizer and other files copied as they are). The copy loads as a
    plain floating-point model whatever `weights` says: the reference for engine-level token parity
    (tensor parallelism, batching), where FP8 activation rounding would amplify summation order."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = ModelConfig.from_model_dir(model_dir)
    block = config.fp8_block or (128, 128)
    shutil.copytree(model_dir, out_dir)
    raw = json.loads((out_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"].pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    weight_map = read_weight_map(model_dir)
    for shard in sorted(set(weight_map.values())):
        tensors = load_file(str(model_dir / shard))
        dense = {}
        for name, tensor in tensors.items():
            if name.endswith("_scale_inv") and name[: -len("_scale_inv")] not in tensors:
                dense[name] = tensor  # not an FP8 weight's scale
            elif name.endswith(".weight_packed"):
                module = name.removesuffix(".weight_packed")
                dense[module + ".weight"] = dequantize_int4(
                    tensor, tensors[module + ".weight_scale"], config.int4_group_size, dtype
                )
            elif _dequantized_name(name) == name:
                scale = tensors.get(name + "_scale_inv")
                dense[name] = dequantize_blocks(tensor, scale, block, dtype) if scale is not None else tensor
        save_file(dense, str(out_dir / shard), metadata={"format": "pt"})
    index = out_dir / INDEX_FILE
    if index.is_file():
        raw_index = json.loads(index.read_text())
        names = {}
        for name, file in raw_index["weight_map"].items():
            kept = _dequantized_name(name)
            if kept is not None:
                names[kept] = file
        raw_index["weight_map"] = names
        index.write_text(json.dumps(raw_index, indent=2))
    return out_dir


def load_model(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    parallel: ParallelState | None = None,
    *,
    weights: str = "quantized",
) -> KimiK2ForCausalLM:
    """Build the model for this rank and load its slice of the checkpoint (see the module docstring
    for `weights`). The model's `load_report` says how many bytes this rank read."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    config = ModelConfig.from_model_dir(model_dir)
    model = KimiK2ForCausalLM(config, parallel, dtype=dtype, device=device, weights=weights)
    model.load_report = load_weights(model, model_dir)
    return model.eval()


__all__ = [
    "CheckpointError", "LoadReport", "iter_checkpoint", "load_model", "load_weights", "read_weight_map",
    "write_dequantized_checkpoint",
]
