"""Load run: many concurrent streaming clients against `kserve serve`, some leaving mid-stream, some with tools.

Each round starts `--clients` streaming chat requests at once: every third client disconnects after its
first content chunks, every tenth (of the others) sends tools with tool_choice=required. Contract, checked
after every round and across rounds:

- no 5xx, neither as a status nor as an in-band stream error;
- every client that stays gets a finish_reason and [DONE];
- the engine's KV blocks go back to zero (`kserve_engine_kv_blocks_used` on /metrics);
- the server's RSS grows less than `--max-rss-growth` (10%) from the end of the first round to the last.

Without --base-url it starts `kserve serve` (the embedded tiny model, the defaults a user gets) on
127.0.0.1 as a subprocess and stops it at the end. Full size is the default:

    python benchmarks/load_harness.py                       # 1000 clients x 3 rounds
    python benchmarks/load_harness.py --clients 12 --max-tokens 8 --out-json load.json   # CI size

Prints a JSON report; exits 1 if the contract is broken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness_server import ServerProcess, metric, report_and_exit_status, rss_bytes

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def kind_of(index: int) -> str:
    if index % 3 == 0:
        return "disconnect"
    return "tools" if index % 10 == 1 else "plain"


async def one_client(client: httpx.AsyncClient, base: str, model: str, index: int, max_tokens: int) -> dict[str, Any]:
    kind = kind_of(index)
    body: dict[str, Any] = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.8,
                            "seed": index, "messages": [{"role": "user", "content": f"Tell me about item {index}."}]}
    if kind == "disconnect":
        body["max_tokens"] = max(max_tokens, 64)  # long enough to leave while the engine holds it
    if kind == "tools":
        body.update(tools=TOOLS, tool_choice="required")
    out: dict[str, Any] = {"kind": kind, "status": None, "finish": None, "done": False, "error": None}
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                out["error"] = resp.text[:200]
                return out
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                for choice in event.get("choices", []):
                    out["finish"] = choice.get("finish_reason") or out["finish"]
                chunks += 1
                if kind == "disconnect" and chunks >= 3:
                    return out  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


async def run_round(base: str, model: str, clients: int, max_tokens: int, timeout: float) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        return await asyncio.gather(*(one_client(client, base, model, i, max_tokens) for i in range(clients)))


def wait_engine_idle(base: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    used = metric(base, "kserve_engine_kv_blocks_used")
    while time.monotonic() < deadline:
        used = metric(base, "kserve_engine_kv_blocks_used")
        if used == 0 and metric(base, "kserve_engine_num_running") == 0:
            break
        time.sleep(0.2)
    return used


def check_round(results: list[dict[str, Any]]) -> list[str]:
    problems = []
    for r in results:
        if r["status"] is not None and r["status"] >= 500:
            problems.append(f"{r['kind']} client got status {r['status']}: {r['error']}")
        elif isinstance(r["error"], dict):
            problems.append(f"{r['kind']} client got an in-band error: {r['error']}")
        elif r["kind"] != "disconnect" and not (r["status"] == 200 and r["done"] and r["finish"]):
            problems.append(f"{r['kind']} client did not complete: {r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-rss-growth", type=float, default=0.10)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per-request bound in seconds")
    parser.add_argument("--base-url", default=None, help="an already running server (no RSS check then)")
    parser.add_argument("--out-json", default=None)
    args = parser.parse_args(argv)

    server = None if args.base_url else ServerProcess()
    base = args.base_url or server.base_url
    rounds: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        if server is not None:
            server.wait_ready()
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        for number in range(1, args.rounds + 1):
            started = time.monotonic()
            results = asyncio.run(run_round(base, model, args.clients, args.max_tokens, args.timeout))
            took = time.monotonic() - started
            blocks = wait_engine_idle(base, 60)
            round_problems = check_round(results)
            if blocks != 0:
                round_problems.append(f"{blocks:.0f} KV blocks still in use after round {number}")
            kinds = Counter(r["kind"] for r in results)
            completed = Counter(r["kind"] for r in results if r["done"] and r["finish"])
            rounds.append({"round": number, "seconds": round(took, 1), "clients": kinds, "completed": completed,
                           "statuses": Counter(str(r["status"]) for r in results), "kv_blocks_used_after": blocks,
                           "rss_mib": None if server is None else round(rss_bytes(server.pid) / 2**20, 1),
                           "problems": len(round_problems)})
            problems += [f"round {number}: {p}" for p in round_problems[:10]]
        growth = None
        if server is not None and len(rounds) >= 2:
            growth = (rounds[-1]["rss_mib"] - rounds[0]["rss_mib"]) / rounds[0]["rss_mib"]
            if growth >= args.max_rss_growth:
                problems.append(f"RSS grew {growth:.1%} from round 1 to round {len(rounds)}")
    finally:
        if server is not None:
            server.stop()
    report = {"harness": "load", "clients": args.clients, "rounds": rounds,
              "rss_growth": None if growth is None else round(growth, 4), "problems": problems, "ok": not problems}
    return report_and_exit_status(report, args.out_json)


if __name__ == "__main__":
    sys.exit(main())
