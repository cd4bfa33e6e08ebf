"""Peak resident memory while loading a checkpoint, against the size of the loaded model.

Writes a larger-than-tiny checkpoint in K2's layout (FP8 shards), then loads it in a fresh process
and reports VmHWM - baseline RSS over the bytes of the model's parameters.

    python benchmarks/bench_load_memory.py [--keep-fp8] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LARGER = dict(
    hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, n_routed_experts=32,
    num_hidden_layers=6, q_lora_rank=384, kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64,
    v_head_dim=64,
)


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(model_dir: str, keep_fp8: bool) -> dict[str, float]:
    from kserve.model import load_model

    baseline = _status_bytes("VmRSS")
    start = time.perf_counter()
    model = load_model(model_dir, keep_fp8=keep_fp8)
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM")
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return dict(
        model_MiB=model_bytes / 2**20,
        peak_over_baseline_MiB=(peak - baseline) / 2**20,
        ratio=(peak - baseline) / model_bytes,
        load_s=seconds,
        keep_fp8=keep_fp8,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep-fp8", action="store_true")
    parser.add_argument("--dir", default=None, help="an existing checkpoint (default: write a larger tiny one)")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.keep_fp8)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.dir
        if model_dir is None:
            from kserve.tiny_checkpoint import write_tiny_checkpoint

            model_dir = str(write_tiny_checkpoint(Path(tmp) / "model", seed=0, config_overrides=LARGER))
        cmd = [sys.executable, __file__, "--measure", model_dir] + (["--keep-fp8"] if args.keep_fp8 else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
