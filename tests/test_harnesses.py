"""The load, fuzz and fault harnesses in benchmarks/ at a small size: each starts its own `kserve serve` on
127.0.0.1, checks its contract and stops by itself (issue 13). Full size by hand: see each harness's doc."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_harness(name: str, *args: str, timeout: float = 600) -> dict:
    out = Path(f"/tmp/kserve-{name}-{id(args)}.json")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args, "--out-json", str(out)],
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    out.unlink()
    assert report["ok"] is True
    return report


@pytest.mark.slow
def test_load_harness_small():
    report = run_harness("load_harness", "--clients", "12", "--rounds", "3", "--max-tokens", "8")
    assert len(report["rounds"]) == 3
    for r in report["rounds"]:
        assert r["kv_blocks_used_after"] == 0
        assert r["completed"]["plain"] == r["clients"]["plain"] and r["completed"]["tools"] == r["clients"]["tools"]
        assert r["clients"]["disconnect"] == 4
    assert report["rss_growth"] < 0.10


@pytest.mark.slow
def test_fuzz_harness_small():
    report = run_harness("fuzz_harness", "--examples", "40")
    assert report["requests"] == 40 and not report["failures"]
    assert not [k for k in report["statuses"] if k.endswith(("500", "502", "503"))]


@pytest.mark.slow
def test_fault_harness_small():
    report = run_harness("fault_harness", "--clients", "4")
    dying, transient = report["runs"]
    assert dying["health_503_after_s"] < 5 and dying["in_flight_ended_with_503"] == 4
    assert dying["exit_code"] not in (None, 0)
    assert transient["completed"] == 4 and transient["server_alive"]
