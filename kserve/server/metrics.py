"""Server counters and their Prometheus text exposition (format 0.0.4), engine gauges included."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

# Tool-call outcomes that signal format drift or an unconstrained model (see notes/vendor-verifier.md).
TOOL_CALL_PROBLEMS = (
    "schema_invalid", "schema_unresolvable", "invalid_json", "undeclared_tool", "empty_tool_calls",
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.n += 1
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1


@dataclass
class ServerMetrics:
    """Counters owned by one server instance; safe to bump from any thread."""

    requests: Counter = field(default_factory=Counter)  # (endpoint, status) -> n
    finish_reasons: Counter = field(default_factory=Counter)  # reason -> n
    tool_calls: int = 0
    tool_call_problems: Counter = field(default_factory=Counter)  # problem -> n
    prompt_tokens: int = 0
    completion_tokens: int = 0
    aborted: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def count_finish(self, reason: str) -> None:
        with self._lock:
            self.finish_reasons[reason] += 1

    def count_tool_calls(self, n: int) -> None:
        with self._lock:
            self.tool_calls += n

    def count_tool_problem(self, problem: str) -> None:
        assert problem in TOOL_CALL_PROBLEMS, problem
        with self._lock:
            self.tool_call_problems[problem] += 1

    def count_tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def count_abort(self) -> None:
        with self._lock:
            self.aborted += 1

    def observe_latency(self, ttft: float | None, e2e: float) -> None:
        with self._lock:
            if ttft is not None:
                self.ttft.observe(ttft)
            self.e2e.observe(e2e)

    def render(self, engine_stats: Any | None, model_name: str, ready: bool) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {_fmt(value)}")

        model = f'model="{_escape(model_name)}"'
        with self._lock:
            metric("kserve_ready", "gauge", "1 once the model is loaded", [(f"{{{model}}}", int(ready))])
            metric("kserve_requests_total", "counter", "HTTP requests by endpoint and status",
                   [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("kserve_finish_reason_total", "counter", "finished choices by finish_reason",
                   [(f'{{reason="{r}"}}', n) for r, n in sorted(self.finish_reasons.items())])
            metric("kserve_tool_calls_total", "counter", "tool calls returned to clients",
                   [(f"{{{model}}}", self.tool_calls)])
            metric("kserve_tool_call_problems_total", "counter",
                   "tool-call outcomes that failed validation: schema_invalid, schema_unresolvable, invalid_json, "
                   "undeclared_tool, "
                   "empty_tool_calls (a section was opened but no call parsed)",
                   [(f'{{problem="{p}"}}', self.tool_call_problems[p]) for p in TOOL_CALL_PROBLEMS])
            metric("kserve_prompt_tokens_total", "counter", "prompt tokens of served requests",
                   [("", self.prompt_tokens)])
            metric("kserve_generation_tokens_total", "counter", "tokens generated for served requests",
                   [("", self.completion_tokens)])
            metric("kserve_aborted_requests_total", "counter", "requests aborted (client gone or error)",
                   [("", self.aborted)])
            for name, hist, help_text in (
                ("kserve_time_to_first_token_seconds", self.ttft, "time to first token"),
                ("kserve_e2e_request_latency_seconds", self.e2e, "request latency"),
            ):
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} histogram")
                for edge, count in zip(hist.buckets, hist.counts):
                    lines.append(f'{name}_bucket{{le="{edge}"}} {count}')
                lines.append(f'{name}_bucket{{le="+Inf"}} {hist.n}')
                lines.append(f"{name}_sum {_fmt(hist.total)}")
                lines.append(f"{name}_count {hist.n}")
        if engine_stats is not None:
            for key, value in _stats_items(engine_stats):
                metric(f"kserve_engine_{key}", "gauge", f"engine stat {key}", [("", value)])
            spec = getattr(engine_stats, "spec_decode", None)
            if spec is not None:  # vLLM's names, kserve_ prefix
                for name, value, help_text in (
                    ("num_drafts", spec.num_drafts, "verify steps that carried drafts (per sequence)"),
                    ("num_draft_tokens", spec.num_draft_tokens, "draft tokens proposed and verified"),
                    ("num_accepted_tokens", spec.num_accepted_tokens, "draft tokens accepted"),
                ):
                    metric(f"kserve_spec_decode_{name}_total", "counter", help_text, [("", value)])
                metric("kserve_spec_decode_num_accepted_tokens_per_pos_total", "counter",
                       "accepted draft tokens by position in the draft",
                       [(f'{{position="{i}"}}', n) for i, n in enumerate(spec.accepted_per_position)])
                metric("kserve_spec_decode_acceptance_rate", "gauge", "accepted / drafted tokens",
                       [("", spec.acceptance_rate)])
                metric("kserve_spec_decode_mean_accepted_length", "gauge",
                       "tokens per verify step per sequence (accepted drafts + 1)", [("", spec.mean_accepted_length)])
        return "\n".join(lines) + "\n"


def _stats_items(stats: Any) -> list[tuple[str, float]]:
    if is_dataclass(stats):
        raw = {f.name: getattr(stats, f.name) for f in fields(stats)}
    elif isinstance(stats, dict):
        raw = stats
    else:
        raw = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    return [(k, float(v)) for k, v in sorted(raw.items()) if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
