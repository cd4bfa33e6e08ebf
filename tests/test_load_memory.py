"""benchmarks/bench_load_memory.py on the tiny checkpoint: both peaks reported, the host peak within
weights + one tensor in flight + one mapped shard (+ its fixed slack)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_load_memory.py"


def test_bench_load_memory_reports_both_peaks_within_bound(tiny_k2_dir):
    out = subprocess.run(
        [sys.executable, str(BENCH), "--dir", str(tiny_k2_dir)], check=True, capture_output=True, text=True, timeout=300
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(result)
    assert result["weights"] == "quantized" and result["device"] == "cpu"
    assert "device_peak_MiB" in result and result["device_peak_MiB"] is None  # the CPU's device is the host
    assert result["host_peak_MiB"] > 0.5 * result["model_MiB"]  # it did measure the load
    assert result["host_within_bound"], result
