"""A `kserve serve` subprocess on 127.0.0.1 for the load, fuzz and fault harnesses.

    python benchmarks/harness_server.py [kserve serve arguments] [--fail-trigger PATH] [--fail-steps N] [--fail-fatal]

runs exactly what `kserve serve` runs (same parser, same settings, same exit status), plus the engine's
step-fault test hook (`kserve.engine.faults.StepFaults`) when asked: once PATH exists, model steps fail
(all of them, the first N, or fatally). The harnesses start and stop it with `ServerProcess`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric(base_url: str, name: str) -> float:
    """One unlabelled sample from /metrics (e.g. kserve_engine_kv_blocks_used)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)



def report_and_exit_status(report: dict, out_json: str | None) -> int:
    """Print a harness's report as JSON (and write it to `out_json` when given); 0 when it says ok, else 1."""
    text = json.dumps(report, indent=2)
    print(text)
    if out_json:
        Path(out_json).write_text(text)
    return 0 if report["ok"] else 1


class ServerProcess:
    """`kserve serve` (through this file) in a subprocess, bounded: it is killed on `stop()` or exit."""

    def __init__(self, serve_args: list[str] | None = None, fault_args: list[str] | None = None,
                 log_path: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--host", HOST, "--port", str(self.port),
               *(serve_args or []), *(fault_args or [])]
        self.log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s")

    def model(self) -> str:
        return httpx.get(self.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            if self.wait_exit(20) is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __enter__(self) -> ServerProcess:  # noqa: PYI034 -- not subclassed
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    from kserve.cli import build_parser
    from kserve.engine.faults import STEP_FAULTS_KEY, StepFaults
    from kserve.server.launch import serve, settings_from_args

    faults = argparse.ArgumentParser(add_help=False)
    faults.add_argument("--fail-trigger", default=None)
    faults.add_argument("--fail-steps", type=int, default=None)
    faults.add_argument("--fail-fatal", action="store_true")
    fault_args, rest = faults.parse_known_args(argv)
    args = build_parser().parse_args(["serve", *rest])
    settings = settings_from_args(args)
    if fault_args.fail_trigger is not None:
        settings.engine.extra[STEP_FAULTS_KEY] = StepFaults(
            fail_steps=fault_args.fail_steps, trigger_file=fault_args.fail_trigger, fatal=fault_args.fail_fatal)
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
