"""benchmarks/gpu_check.py keeps working without a GPU: its --dry-run runs every stage on the CPU."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve annotations through the module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    return proc, out


def test_dry_run_reports_every_stage(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert list(report["stages"]) == ["env", "correctness", "kernel_speed", "decode_step", "serve_bench"]
    for name, stage in report["stages"].items():
        assert stage["rows"], f"stage {name} has no rows"
        bad = [(r["item"], r["status"]) for r in stage["rows"] if r["status"] == "fail" or r["status"].startswith("error")]
        assert not bad, f"stage {name}: {bad}"
    assert report["limits"]["copy_gbps"] > 0 and report["limits"]["bf16_tflops"] > 0
    # every kernel was really checked against its reference, not skipped
    correctness = report["stages"]["correctness"]["rows"]
    for kernel in ("fp8 GEMM", "fused MoE", "MLA decode bf16", "MLA decode fp8", "prefill attention"):
        rows = [r for r in correctness if r["item"].startswith(kernel)]
        assert rows and all(r["status"] == "ok" for r in rows), (kernel, rows)
        assert all(r["data"]["rel"] <= 1e-4 for r in rows)
    speed = report["stages"]["kernel_speed"]["rows"]
    for kernel in ("MLA decode", "fused MoE", "fp8 GEMM"):
        timed = [r for r in speed if r["item"].startswith(kernel) and not r["status"].startswith("skipped")]
        assert timed and all(min(v for k, v in r["data"].items() if k.endswith("ms")) > 0 for r in timed), kernel
    decode = [r for r in report["stages"]["decode_step"]["rows"] if r["item"].startswith("decode B=")]
    assert decode and all(r["data"]["eager_ms"] > 0 and r["data"]["floor_ms"] > 0 for r in decode)
    served = [r for r in report["stages"]["serve_bench"]["rows"] if "concurrency" in r["item"]]
    assert [r["data"]["concurrency"] for r in served] == [1, 4]
    assert all(r["data"]["failed"] == 0 and r["data"]["output_token_throughput"] > 0 for r in served)
    png = report["kernel_png"]
    assert png.startswith("skipped") or Path(png).is_file()
    assert "stage" in proc.stdout and "kernel_speed" in proc.stdout  # the printed table


def test_missing_kernel_is_recorded_as_skipped():
    gpu_check = load_script()
    mod, why = gpu_check.import_or_skip("kserve.kernels.no_such_kernel", ["f"])
    assert mod is None and why.startswith("skipped: kserve.kernels.no_such_kernel not importable")
    mod, why = gpu_check.import_or_skip("kserve.kernels.fp8_quant", ["no_such_function"])
    assert mod is None and why == "skipped: kserve.kernels.fp8_quant has no no_such_function"


def test_unknown_stage_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--stages", "env,warp"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown stage(s) ['warp']" in proc.stderr
