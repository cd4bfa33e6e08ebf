"""Fault run: inject model-step failures into a live `kserve serve` and check the health contract.

Two runs, each against its own server subprocess on 127.0.0.1 (started and stopped here):

- dying: once the clients' requests are in flight, every model step fails (or the first one fails
  fatally, with --fatal). Contract: /health answers 503 within 5 s, every in-flight request ends (a
  stream with an in-band 503 `engine_dead`, a plain request with a 503), and the process exits non-zero.
- transient: one step fails (retried). Contract: every request completes, /health stays 200, the server
  keeps running.

    python benchmarks/fault_harness.py --clients 16 --out-json fault.json

Prints a JSON report; exits 1 if the contract is broken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness_server import ServerProcess, report_and_exit_status

HEALTH_DEADLINE_S = 5.0
EXIT_DEADLINE_S = 30.0


async def _client(base: str, model: str, index: int, started: asyncio.Event, counter: list[int],
                  need: int, timeout: float) -> dict[str, Any]:
    stream = index % 2 == 0
    body = {"model": model, "messages": [{"role": "user", "content": f"count to a thousand ({index})"}],
            "max_tokens": 400, "ignore_eos": True, "temperature": 0.0, "stream": stream}
    out: dict[str, Any] = {"stream": stream, "status": None, "error": None, "finish": None, "chunks": 0}
    async with httpx.AsyncClient(timeout=timeout) as client:
        if not stream:
            counter[0] += 1
            if counter[0] >= need:
                started.set()
            resp = await client.post(base + "/v1/chat/completions", json=body)
            out["status"] = resp.status_code
            data = resp.json()
            out["error"] = (data.get("error") or {}).get("code")
            out["finish"] = data["choices"][0]["finish_reason"] if "choices" in data else None
            return out
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
            out["status"] = resp.status_code
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                out["chunks"] += 1
                if out["chunks"] == 2:
                    counter[0] += 1
                    if counter[0] >= need:
                        started.set()
                if "error" in event:
                    out["error"] = event["error"].get("code")
                for choice in event.get("choices", []):
                    out["finish"] = choice.get("finish_reason") or out["finish"]
    return out


async def _drive(server: ServerProcess, clients: int, trigger: Path, timeout: float) -> dict[str, Any]:
    model = server.model()
    started = asyncio.Event()
    counter = [0]
    tasks = [asyncio.create_task(_client(server.base_url, model, i, started, counter, clients, timeout))
             for i in range(clients)]
    await asyncio.wait_for(started.wait(), timeout)
    await asyncio.sleep(0.2)  # the plain requests are in the engine too
    trigger.touch()
    armed_at = time.monotonic()
    first_503 = None
    async with httpx.AsyncClient(timeout=5) as probe:
        while time.monotonic() - armed_at < HEALTH_DEADLINE_S * 3:
            try:
                status = (await probe.get(server.base_url + "/health")).status_code
            except httpx.HTTPError:
                status = None  # the process may already be gone
            if status != 200:
                first_503 = (time.monotonic() - armed_at, status)
                break
            if all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.1)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout)
    return {"armed_at": armed_at, "first_unhealthy": first_503, "results": results,
            "ended_s": time.monotonic() - armed_at}


def run_dying(clients: int, fatal: bool, timeout: float, workdir: Path) -> dict[str, Any]:
    trigger = workdir / "fail-dying"
    fault_args = ["--fail-trigger", str(trigger)] + (["--fail-fatal"] if fatal else [])
    server = ServerProcess([], fault_args, log_path=str(workdir / "dying.log"))
    try:
        server.wait_ready()
        drive = asyncio.run(_drive(server, clients, trigger, timeout))
        exit_code = server.wait_exit(EXIT_DEADLINE_S)
        exited_s = time.monotonic() - drive["armed_at"]
    finally:
        server.stop()
    results = drive["results"]
    outcomes = [r if isinstance(r, dict) else {"exception": repr(r)} for r in results]
    ended_with_503 = [r for r in outcomes if r.get("error") == "engine_dead" or r.get("status") == 503]
    problems = []
    unhealthy = drive["first_unhealthy"]
    if unhealthy is None or unhealthy[0] > HEALTH_DEADLINE_S:
        problems.append(f"/health did not fail within {HEALTH_DEADLINE_S}s: {unhealthy}")
    if len(ended_with_503) != clients:
        problems.append(f"{clients - len(ended_with_503)} in-flight requests did not end with a 503 engine_dead: "
                        f"{[r for r in outcomes if r not in ended_with_503][:3]}")
    if any(r.get("status", 0) and r["status"] >= 500 and r["status"] != 503 for r in outcomes):
        problems.append("a request got a 5xx other than 503")
    if exit_code is None or exit_code == 0:
        problems.append(f"the server did not exit non-zero within {EXIT_DEADLINE_S}s (status {exit_code})")
    return {"run": "dying", "fatal": fatal, "clients": clients,
            "health_503_after_s": None if unhealthy is None else round(unhealthy[0], 3),
            "requests_ended_after_s": round(drive["ended_s"], 3),
            "in_flight_ended_with_503": len(ended_with_503), "exit_code": exit_code,
            "exited_after_s": round(exited_s, 3), "problems": problems}


def run_transient(clients: int, timeout: float, workdir: Path) -> dict[str, Any]:
    trigger = workdir / "fail-transient"
    server = ServerProcess([], ["--fail-trigger", str(trigger), "--fail-steps", "1"],
                           log_path=str(workdir / "transient.log"))
    try:
        server.wait_ready()
        drive = asyncio.run(_drive(server, clients, trigger, timeout))
        healthy = httpx.get(server.base_url + "/health", timeout=10).status_code
        alive = server.proc.poll() is None
    finally:
        server.stop()
    outcomes = [r if isinstance(r, dict) else {"exception": repr(r)} for r in drive["results"]]
    completed = [r for r in outcomes if r.get("status") == 200 and r.get("finish") == "length" and not r.get("error")]
    problems = []
    if len(completed) != clients:
        problems.append(f"{clients - len(completed)} requests did not complete: "
                        f"{[r for r in outcomes if r not in completed][:3]}")
    if healthy != 200 or not alive or drive["first_unhealthy"] is not None:
        problems.append(f"a failed step changed the health: /health {healthy}, alive {alive}, "
                        f"unhealthy {drive['first_unhealthy']}")
    return {"run": "transient", "clients": clients, "completed": len(completed), "health_after": healthy,
            "server_alive": alive, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16, help="requests in flight when the faults start")
    parser.add_argument("--fatal", action="store_true", help="the dying run's first failure is fatal")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request bound in seconds")
    parser.add_argument("--out-json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kserve-fault-") as tmp:
        workdir = Path(tmp)
        reports = [run_dying(args.clients, args.fatal, args.timeout, workdir),
                   run_transient(args.clients, args.timeout, workdir)]
        problems = [p for r in reports for p in r["problems"]]
        if problems:
            for name in ("dying.log", "transient.log"):
                log = workdir / name
                if log.exists():
                    print(f"--- {name} (tail)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]),
                          file=sys.stderr)
    report = {"harness": "fault", "runs": reports, "ok": not problems}
    return report_and_exit_status(report, args.out_json)


if __name__ == "__main__":
    sys.exit(main())
