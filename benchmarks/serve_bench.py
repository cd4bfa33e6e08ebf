"""Load generator for the OpenAI-compatible server: TTFT, ITL, throughput and p50/p99 against concurrency.

Drives `/v1/chat/completions` (streaming, `stream_options.include_usage`) with the official `openai` client.
Without `--base-url` it starts `kserve serve` on the embedded tiny model (a subprocess by default) and also
runs the same load straight against the same engine in this process (no HTTP) as the baseline, reporting
the server's throughput as a ratio of it.

    python benchmarks/serve_bench.py --concurrency 1,2,4,8 --num-prompts 16 --input-len 64 --output-len 32 \
        --out-json bench.json --out-png bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

WORDS = [
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye", "woman",
    "place", "work", "week", "case", "point", "government", "company", "number", "group", "problem", "fact",
]


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


@dataclass
class LevelReport:
    concurrency: int
    num_requests: int
    failed: int
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    mean_prompt_tokens: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    baseline_output_token_throughput: float | None = None
    server_vs_engine_ratio: float | None = None


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def pct(p: float) -> float:
        k = (len(ordered) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        return (ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)) * 1000.0

    return {"mean": statistics.fmean(ordered) * 1000.0, "p50": pct(0.5), "p99": pct(0.99)}


def make_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    # ~1 token per word plus separators for K2-like vocabularies; the server reports the real count.
    return [" ".join(rng.choice(WORDS) for _ in range(max(1, input_len))) for _ in range(n)]


async def _paced(items: list[Any], rate: float, concurrency: int, run: Any) -> list[Any]:
    """Start `run(item)` at `rate` per second (Poisson arrivals; inf = all at once), at most `concurrency` live."""
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(0)

    async def one(item: Any) -> Any:
        async with sem:
            return await run(item)

    tasks = []
    for item in items:
        tasks.append(asyncio.create_task(one(item)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    return await asyncio.gather(*tasks)


async def run_http_level(client: Any, model: str, prompts: list[str], output_len: int, concurrency: int,
                         rate: float) -> tuple[list[RequestResult], float]:
    async def one(prompt: str) -> RequestResult:
        start = time.perf_counter()
        last = None
        result = RequestResult(ok=True)
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=output_len,
                stream=True, stream_options={"include_usage": True}, temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    result.output_tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].delta.content:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        except Exception as exc:  # noqa: BLE001 - report, don't abort the run
            return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
        result.e2e = time.perf_counter() - start
        return result

    start = time.perf_counter()
    results = await _paced(prompts, rate, concurrency, one)
    return results, time.perf_counter() - start


async def run_engine_level(engine: Any, prompt_ids: list[list[int]], output_len: int, concurrency: int,
                           rate: float) -> tuple[list[RequestResult], float]:
    from kserve.engine.sampling_params import SamplingParams

    counter = iter(range(1 << 30))

    async def one(ids: list[int]) -> RequestResult:
        start = time.perf_counter()
        result = RequestResult(ok=True, prompt_tokens=len(ids))
        last, seen = None, 0
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0)
        async for out in engine.generate(f"bench-{next(counter)}", ids, params):
            n = len(out.outputs[0].token_ids)
            if n > seen:
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last, seen = now, n
        result.output_tokens = seen
        result.e2e = time.perf_counter() - start
        return result

    start = time.perf_counter()
    results = await _paced(prompt_ids, rate, concurrency, one)
    return results, time.perf_counter() - start


def summarize(concurrency: int, results: list[RequestResult], duration: float) -> LevelReport:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return LevelReport(
        concurrency=concurrency, num_requests=len(results), failed=len(results) - len(ok), duration_s=duration,
        request_throughput=len(ok) / duration, output_token_throughput=out_tokens / duration,
        mean_prompt_tokens=statistics.fmean([r.prompt_tokens for r in ok]) if ok else 0.0,
        ttft_ms=percentiles([r.ttft for r in ok]), itl_ms=percentiles([x for r in ok for x in r.itls]),
        e2e_ms=percentiles([r.e2e for r in ok]),
    )


def _median_run(runs: list[LevelReport]) -> LevelReport:
    return sorted(runs, key=lambda r: r.output_token_throughput)[len(runs) // 2]


def plot(reports: list[LevelReport], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r.concurrency for r in reports]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, attr, color in (("TTFT", "ttft_ms", "tab:blue"), ("ITL", "itl_ms", "tab:orange"),
                              ("E2E", "e2e_ms", "tab:green")):
        for key, style in (("p50", "-o"), ("p99", "--^")):
            ax1.plot(conc, [getattr(r, attr)[key] for r in reports], style, color=color, label=f"{name} {key}")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("latency (ms)")
    ax1.set_title("latency vs concurrency")
    ax1.legend(fontsize=7)
    ax2.plot(conc, [r.output_token_throughput for r in reports], "-o", label="server (HTTP)")
    if any(r.baseline_output_token_throughput for r in reports):
        ax2.plot(conc, [r.baseline_output_token_throughput or float("nan") for r in reports], "--o",
                 label="engine direct (baseline)")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("throughput vs concurrency")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class LocalServer:
    """`kserve serve` on the embedded tiny model, in a subprocess (the realistic case: the client does not
    share the server's interpreter) or in a thread of this process."""

    def __init__(self, mode: str, max_num_seqs: int) -> None:
        self.mode = mode
        self.max_num_seqs = max_num_seqs
        self.proc: subprocess.Popen | None = None
        self.thread_server: Any = None
        self.base_url = ""

    async def start(self) -> None:
        if self.mode == "thread":
            from kserve.config import EngineConfig
            from kserve.server.context import ServerSettings
            from kserve.server.launch import BackgroundServer

            settings = ServerSettings(port=0, engine=EngineConfig(max_num_seqs=self.max_num_seqs),
                                      log_level="warning")
            self.thread_server = await asyncio.to_thread(BackgroundServer(settings).start)
            self.base_url = self.thread_server.base_url
            return
        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.proc = subprocess.Popen(  # noqa: ASYNC220 - starts the server and returns at once
            [sys.executable, "-m", "kserve.cli", "serve", "--port", str(port), "--max-num-seqs",
             str(self.max_num_seqs), "--log-level", "warning"])
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError("kserve serve exited during startup")
                try:
                    if (await http.get(self.base_url + "/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError("kserve serve did not get ready")

    async def stop(self) -> None:
        if self.thread_server is not None:
            await asyncio.to_thread(self.thread_server.stop)
        if self.proc is not None:
            self.proc.terminate()
            await asyncio.to_thread(self.proc.wait)


async def load_baseline_engine(max_num_seqs: int) -> tuple[Any, Any]:
    """The same engine the server runs (embedded tiny model), in this process, plus a prompt encoder."""
    from kserve.chat import ChatTemplate
    from kserve.config import EngineConfig
    from kserve.engine.async_engine import AsyncLLMEngine

    engine = await asyncio.to_thread(AsyncLLMEngine.from_config, EngineConfig(max_num_seqs=max_num_seqs))
    await engine.start()
    template = ChatTemplate.load(engine.model_dir)

    def encode(prompt: str) -> list[int]:
        return template.encode(engine.tokenizer, [{"role": "user", "content": prompt}])

    return engine, encode


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from openai import AsyncOpenAI

    levels = [int(c) for c in args.concurrency.split(",")]
    server: LocalServer | None = None
    base_url, model = args.base_url, args.model
    if base_url is None:
        server = LocalServer(args.server_mode, max(levels))
        await server.start()
        base_url = server.base_url
    client = AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0, timeout=600)
    if model is None:
        model = (await client.models.list()).data[0].id
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    engine = encode = None
    if server is not None and not args.no_baseline:
        engine, encode = await load_baseline_engine(max(levels))
    reports: list[LevelReport] = []
    try:
        await run_http_level(client, model, prompts[:2], 4, 2, float("inf"))  # warm-up
        if engine is not None:
            await run_engine_level(engine, [encode(p) for p in prompts[:2]], 4, 2, float("inf"))
        for conc in levels:
            # Server and baseline runs alternate; the report keeps the median-throughput run of each, so a
            # burst of load from elsewhere on the machine skews one repeat, not the ratio.
            runs: list[LevelReport] = []
            base_runs: list[LevelReport] = []
            for _ in range(args.repeats):
                results, duration = await run_http_level(client, model, prompts, args.output_len, conc,
                                                         args.request_rate)
                runs.append(summarize(conc, results, duration))
                if engine is not None:
                    base, base_duration = await run_engine_level(engine, [encode(p) for p in prompts],
                                                                 args.output_len, conc, args.request_rate)
                    base_runs.append(summarize(conc, base, base_duration))
            report = _median_run(runs)
            if base_runs:
                baseline = _median_run(base_runs)
                report.baseline_output_token_throughput = baseline.output_token_throughput
                report.server_vs_engine_ratio = report.output_token_throughput / baseline.output_token_throughput
            reports.append(report)
            print(f"concurrency {conc}: {report.output_token_throughput:.1f} tok/s, TTFT p50 "
                  f"{report.ttft_ms['p50']:.1f} ms, ITL p50 {report.itl_ms['p50']:.1f} ms"
                  + (f", server/engine {report.server_vs_engine_ratio:.3f}" if report.server_vs_engine_ratio else ""),
                  file=sys.stderr)
    finally:
        await client.close()
        if engine is not None:
            await engine.shutdown()
        if server is not None:
            await server.stop()
    summary = {
        "base_url": base_url, "model": model, "server_mode": args.server_mode if server else "external",
        "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "levels": [asdict(r) for r in reports],
    }
    if args.out_png:
        plot(reports, args.out_png)
        summary["plot"] = args.out_png
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: start one in-process)")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated concurrency levels")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf = burst)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--input-len", type=int, default=64, help="approximate prompt length in words")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the direct-engine baseline")
    p.add_argument("--repeats", type=int, default=3, help="alternating server/baseline runs per level (median)")
    p.add_argument("--server-mode", choices=["subprocess", "thread"], default="subprocess",
                   help="without --base-url: run `kserve serve` in a subprocess, or in a thread of this process")
    p.add_argument("--out-json", default=None)
    p.add_argument("--out-png", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summary = asyncio.run(main_async(args))
    text = json.dumps(summary, indent=2)
    if args.out_json:
        with open(args.out_json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
