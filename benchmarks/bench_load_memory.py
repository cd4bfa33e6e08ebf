"""Peak memory while loading a checkpoint, against the bound the loader promises.

Writes a larger-than-tiny checkpoint in K2's layout (FP8 shards), loads it in a fresh process and
reports both peaks:
- host: VmHWM over the RSS before loading; bound = the model's bytes (when it lives on the host) +
  the largest tensor in flight + the largest shard file (the one shard mapped at a time) + 32 MiB
  of process noise that does not grow with the model (SLACK_BYTES); the peak is reset after a warm-up;
- device (CUDA only): torch's peak allocation over the allocation before loading; bound = the
  model's bytes + the largest tensor in flight.

    python benchmarks/bench_load_memory.py [--weights quantized|dequantized] [--device cuda] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LARGER = {
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "n_routed_experts": 32,
    "num_hidden_layers": 6, "q_lora_rank": 384, "kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
    "v_head_dim": 64,
}
MIB = 2**20
# Process noise that does not grow with the model: Python objects, safetensors handles, the progress
# bar, allocator arenas and rounding (measured 0-25 MiB from run to run on the tiny checkpoint).
SLACK_BYTES = 32 * MIB


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _warm_up(model_dir: str) -> None:
    """Pay the one-time costs (thread pools, lazy imports) before the baseline, then reset the peak
    RSS (Linux: writing 5 to clear_refs), so the peak measures the load alone."""
    import safetensors.torch  # noqa: F401
    import torch
    import tqdm  # noqa: F401

    from kserve.model.loader import read_weight_map

    read_weight_map(Path(model_dir))
    a = torch.randn(256, 256)
    (a @ a).sum().item()
    torch.zeros(8, dtype=torch.float8_e4m3fn).view(torch.uint8).zero_()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def measure(model_dir: str, weights: str, device: str) -> dict[str, object]:
    import torch

    from kserve.model import load_model
    from kserve.model.loader import read_weight_map
    from kserve.model.memory_plan import tensor_bytes

    cuda = device.startswith("cuda")
    _warm_up(model_dir)
    if cuda:
        torch.cuda.init()
        torch.cuda.synchronize()
        device_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    host_base = _status_bytes("VmRSS")
    start = time.perf_counter()
    model = load_model(model_dir, device=device, weights=weights)
    seconds = time.perf_counter() - start
    host_peak = _status_bytes("VmHWM") - host_base
    report = model.load_report
    model_bytes = tensor_bytes(model)
    shard_bytes = max((Path(model_dir) / f).stat().st_size for f in set(read_weight_map(Path(model_dir)).values()))
    # dequantized loads widen the largest FP8 tensor in flight to fp32 (plus the fp32 product temporary)
    in_flight = report.largest_tensor_bytes * (9 if weights == "dequantized" else 1)
    host_bound = (0 if cuda else model_bytes) + in_flight + shard_bytes + SLACK_BYTES
    out: dict[str, object] = {
        "weights": weights,
        "device": device,
        "model_MiB": round(model_bytes / MIB, 2),
        "largest_tensor_MiB": round(report.largest_tensor_bytes / MIB, 2),
        "largest_shard_MiB": round(shard_bytes / MIB, 2),
        "host_peak_MiB": round(host_peak / MIB, 2),
        "host_bound_MiB": round(host_bound / MIB, 2),
        "host_within_bound": host_peak <= host_bound,
        "bytes_read_MiB": round(report.bytes_read / MIB, 2),
        "load_s": round(seconds, 2),
    }
    if cuda:
        torch.cuda.synchronize()
        device_peak = torch.cuda.max_memory_allocated() - device_base
        device_bound = model_bytes + in_flight
        out.update(
            device_peak_MiB=round(device_peak / MIB, 2),
            device_bound_MiB=round(device_bound / MIB, 2),
            device_within_bound=device_peak <= device_bound,
        )
    else:
        out.update(device_peak_MiB=None, device_note="the device is the host: see host_peak")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", choices=["quantized", "dequantized"], default="quantized")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", default=None, help="an existing checkpoint (default: write a larger tiny one)")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.weights, args.device)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.dir
        if model_dir is None:
            from kserve.tiny import write_tiny_checkpoint

            model_dir = str(write_tiny_checkpoint(Path(tmp) / "model", seed=0, config_overrides=LARGER))
        cmd = [sys.executable, __file__, "--measure", model_dir, "--weights", args.weights, "--device", args.device]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
