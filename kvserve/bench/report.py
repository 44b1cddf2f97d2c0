"""Text output: the result block of one run (laid out like `vllm bench serve`'s), one table row per sweep
point, and the per-metric change against an earlier result (`--compare OLD.json`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.bench.summary import LatencyStats, Summary

WIDTH = 50
_LATENCIES = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2e", "E2E Latency", "End-to-end Latency"),
)
_STATS = (("mean_ms", "Mean"), ("median_ms", "Median"), ("p90_ms", "P90"), ("p95_ms", "P95"), ("p99_ms", "P99"))


def _line(name: str, value: object, precision: int = 2) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.{precision}f}"
    else:
        text = str(value)
    return f"{name + ':':<40} {text:<10}"


def _rule(title: str, fill: str = "-") -> str:
    return f"{title:{fill}^{WIDTH}}"


def format_summary(summary: Summary, metrics: tuple[str, ...] | None = None) -> str:
    """The result block of one run; `metrics` (default all) are the latencies shown (--percentile-metrics)."""
    s = summary
    lines = [_rule(" Serving Benchmark Result ", "="), _line("Load", s.label)]
    lines.append(_line("Successful requests", s.completed))
    lines.append(_line("Failed requests", s.failed))
    for kind, count in s.errors.items():
        lines.append(_line(f"  {kind}", count))
    lines += [
        _line("Success rate (%)", 100.0 * s.success_rate),
        _line("Benchmark duration (s)", s.duration_s),
        _line("Total input tokens", s.total_input_tokens),
        _line("Total generated tokens", s.total_output_tokens),
        _line("Request throughput (req/s)", s.request_throughput),
        _line("Output token throughput (tok/s)", s.output_throughput),
        _line("Total token throughput (tok/s)", s.total_token_throughput),
        _line("Mean requests in flight", s.mean_concurrency),
    ]
    if s.good_requests is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in s.goodput_ms.items())
        lines.append(_line(f"Goodput (req/s) [{slos} ms]", s.goodput))
        lines.append(_line("Requests meeting the SLOs (%)",
                           100.0 * s.good_requests / s.num_requests if s.num_requests else None))
    if s.cached_input_tokens is not None and s.total_input_tokens:
        lines.append(_line("Cached input tokens (%)", 100.0 * s.cached_input_tokens / s.total_input_tokens))
    if s.tokens_from_tokenizer:
        lines.append(_line("Token counts from local tokenizer", f"{s.tokens_from_tokenizer} requests"))
    for key, short, title in _LATENCIES:
        if metrics is not None and key not in metrics:
            continue
        stats: LatencyStats = getattr(s, key)
        lines.append(_rule(title))
        for attr, name in _STATS:
            lines.append(_line(f"{name} {short} (ms)", getattr(stats, attr)))
        for name, value in stats.percentiles_ms.items():  # --metric-percentiles beyond the usual ones
            lines.append(_line(f"{name.upper()} {short} (ms)", value))
        if key == "ttft" and s.ttft_all.count > s.ttft.count:
            # Unfinished requests saw first tokens too: say so rather than show only the survivors.
            lines.append(_line(f"Median TTFT incl. {s.ttft_all.count - s.ttft.count} unfinished (ms)",
                               s.ttft_all.median_ms))
            lines.append(_line("P99 TTFT incl. unfinished (ms)", s.ttft_all.p99_ms))
    if s.queued.count and s.queued.max_ms:
        lines.append(_rule("Client-side queueing (open loop)"))
        lines.append(_line("Mean wait for a slot (ms)", s.queued.mean_ms))
        lines.append(_line("P99 wait for a slot (ms)", s.queued.p99_ms))
    if s.server is not None:
        lines.append(_rule("Server metrics (/metrics)"))
        lines.append(_line("Max running requests", s.server.get("max_running"), 0))
        lines.append(_line("Max waiting requests", s.server.get("max_waiting"), 0))
        kv = s.server.get("max_kv_usage")
        lines.append(_line("Max KV cache usage (%)", 100.0 * kv if kv is not None else None, 1))
        hit = s.server.get("prefix_hit_rate")
        lines.append(_line("Prefix cache hit rate (%)", 100.0 * hit if hit is not None else None, 1))
    if s.client is not None:
        lines.append(_rule("Client"))
        lines.append(_line("Client CPU (% of one core)", s.client.cpu_percent, 1))
        lines.append(_line("Event-loop lag P99 (ms)", s.client.loop_lag_p99_ms))
        lines.append(_line("Event-loop lag max (ms)", s.client.loop_lag_max_ms))
        lines.append(_line("Longest client GC pause (ms)", s.client.gc_pause_max_ms))
    lines.append("=" * WIDTH)
    if s.stopped:
        lines.append(s.stopped)
    if s.client is not None and (warning := s.client.warning()):
        lines.append(warning)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- sweep table

_SWEEP_COLUMNS: tuple[tuple[str, Callable[[Summary], object]], ...] = (
    ("load", lambda s: s.label),
    ("ok", lambda s: s.completed),
    ("failed", lambda s: s.failed),
    ("req/s", lambda s: s.request_throughput),
    ("out tok/s", lambda s: s.output_throughput),
    ("TTFT p50", lambda s: s.ttft.median_ms),
    ("TTFT p99", lambda s: s.ttft.p99_ms),
    ("TPOT p50", lambda s: s.tpot.median_ms),
    ("ITL p50", lambda s: s.itl.median_ms),
    ("ITL p99", lambda s: s.itl.p99_ms),
    ("E2E p50", lambda s: s.e2e.median_ms),
    ("E2E p99", lambda s: s.e2e.p99_ms),
    ("goodput", lambda s: s.goodput),
    # Prompt tokens the server answered from its prefix cache: a point that shows hits it was not meant to
    # have (a `file` dataset re-sent by each point) measured a lighter load.
    ("cached %", lambda s: None if s.cached_input_tokens is None or not s.total_input_tokens
     else 100.0 * s.cached_input_tokens / s.total_input_tokens),
)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def format_sweep(summaries: list[Summary]) -> str:
    """One row per run (latencies in ms)."""
    rows = [[name for name, _ in _SWEEP_COLUMNS]]
    rows += [[_cell(get(s)) for _, get in _SWEEP_COLUMNS] for s in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
           for row in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- compare


@dataclass(frozen=True)
class _Metric:
    name: str
    get: Callable[[Summary], float | None]
    higher_is_better: bool


_COMPARED: tuple[_Metric, ...] = (
    _Metric("Request throughput (req/s)", lambda s: s.request_throughput, True),
    _Metric("Output token throughput (tok/s)", lambda s: s.output_throughput, True),
    _Metric("Total token throughput (tok/s)", lambda s: s.total_token_throughput, True),
    _Metric("Goodput (req/s)", lambda s: s.goodput, True),
    _Metric("Success rate (%)", lambda s: 100.0 * s.success_rate, True),
    *(_Metric(f"{stat} {short} (ms)", (lambda s, k=key, a=attr: getattr(getattr(s, k), a)), False)
      for key, short, _ in _LATENCIES for attr, stat in (("mean_ms", "Mean"), ("median_ms", "Median"),
                                                          ("p99_ms", "P99"))),
)


def compare_summaries(old: Summary, new: Summary) -> list[tuple[str, float | None, float | None, float | None, str]]:
    """(metric, old, new, change in %, verdict) per metric; verdict is "better", "worse" or "" (same/n/a)."""
    rows = []
    for metric in _COMPARED:
        a, b = metric.get(old), metric.get(new)
        change = (b - a) / a * 100.0 if a is not None and b is not None and a != 0 else None
        verdict = ""
        if a is not None and b is not None and a != b:
            verdict = "better" if (b > a) == metric.higher_is_better else "worse"
        rows.append((metric.name, a, b, change, verdict))
    return rows


def format_compare(old: Summary, new: Summary, old_name: str) -> str:
    title = f" {new.label} vs {old_name} ({old.label}) "
    lines = [_rule(title, "="), f"{'metric':<34} {'old':>11} {'new':>11} {'change':>9}"]
    for name, a, b, change, verdict in compare_summaries(old, new):
        change_text = f"{change:+.1f}%" if change is not None else "-"
        lines.append(f"{name:<34} {_cell(a):>11} {_cell(b):>11} {change_text:>9}  {verdict}")
    lines.append("=" * max(WIDTH, len(lines[0])))
    return "\n".join(lines)
