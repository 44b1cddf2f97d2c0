"""Sample the server's Prometheus `/metrics` during a run: running and waiting requests, KV cache usage,
prefix-cache hits. Understands kvserve's and vLLM's names (and SGLang's/TGI's where they have one);
a server without `/metrics` just yields no samples.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Field -> sample names that carry it, first match wins (a server exporting both kvserve: and vllm: names
# reports the same values under both). Several label sets of one name (per model, or per data-parallel
# replica's `engine`) are summed, except the KV cache usage, a fraction: the fullest one's (MAXED_FIELDS).
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "running": ("kvserve:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs",
                "tgi_batch_current_size"),
    "waiting": ("kvserve:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs",
                "tgi_queue_size"),
    "kv_usage": ("kvserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "sglang:token_usage"),
    "prefix_hits": ("kvserve:prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                    "vllm:gpu_prefix_cache_hits_total"),
    "prefix_queries": ("kvserve:prefix_cache_queries_total", "vllm:prefix_cache_queries_total",
                       "vllm:gpu_prefix_cache_queries_total"),
}

MAXED_FIELDS = frozenset({"kv_usage"})


@dataclass(frozen=True)
class MetricSample:
    """One scrape. `t_s` is relative to the run start; `kv_usage` is a fraction (1 = full); prefix counters
    are cumulative token counts. None: the server does not export it."""

    t_s: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MetricSample:
        return cls(**data)


def _sample_totals(text: str, maxed: frozenset[str] = frozenset()) -> dict[str, float]:
    """{sample name: value summed over its label sets} of a Prometheus text exposition; the largest of its
    label sets' values for a name in `maxed`."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            value = float(sample.value)
            if sample.name in maxed:
                totals[sample.name] = max(totals.get(sample.name, value), value)
            else:
                totals[sample.name] = totals.get(sample.name, 0.0) + value
    return totals


def histogram_means(before: str, after: str) -> dict[str, tuple[float, int]]:
    """{histogram name: (mean value, observations)} of what every histogram observed between two scrapes
    (each histogram's series summed over their labels), for histograms that observed anything."""
    a, b = _sample_totals(before), _sample_totals(after)
    out = {}
    for name, count in b.items():
        if not name.endswith("_count") or (base := name[: -len("_count")]) + "_sum" not in b:
            continue
        new = count - a.get(name, 0.0)
        if new > 0:
            out[base] = ((b[base + "_sum"] - a.get(base + "_sum", 0.0)) / new, int(new))
    return out


def parse_metrics(text: str, t_s: float) -> MetricSample:
    """The fields of METRIC_NAMES found in a Prometheus text exposition."""
    totals = _sample_totals(text, frozenset(n for f in MAXED_FIELDS for n in METRIC_NAMES[f]))
    values: dict[str, float | None] = {}
    for field_name, names in METRIC_NAMES.items():
        values[field_name] = next((totals[n] for n in names if n in totals), None)
    return MetricSample(t_s=t_s, **values)


def summarize_samples(samples: list[MetricSample]) -> dict[str, float | None]:
    """Peaks and means over the run; the prefix hit rate of the tokens queried during the run."""

    def series(name: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, name)) is not None]

    running, waiting, kv = series("running"), series("waiting"), series("kv_usage")
    summary: dict[str, float | None] = {
        "num_samples": float(len(samples)),
        "max_running": max(running) if running else None,
        "mean_running": sum(running) / len(running) if running else None,
        "max_waiting": max(waiting) if waiting else None,
        "mean_waiting": sum(waiting) / len(waiting) if waiting else None,
        "max_kv_usage": max(kv) if kv else None,
        "prefix_hit_rate": None,
    }
    with_prefix = [s for s in samples if s.prefix_hits is not None and s.prefix_queries is not None]
    if len(with_prefix) >= 2:
        queries = with_prefix[-1].prefix_queries - with_prefix[0].prefix_queries  # type: ignore[operator]
        hits = with_prefix[-1].prefix_hits - with_prefix[0].prefix_hits  # type: ignore[operator]
        summary["prefix_hit_rate"] = hits / queries if queries > 0 else None
    return summary


class ServerMetricsSampler:
    """Scrapes `url` once before the run (`baseline()`), then every `interval_s` from `start()` until
    `stop()`, and once more at the end. The first failed scrape turns it off: the run goes on without server
    metrics."""

    def __init__(self, url: str, interval_s: float, api_key: str | None = None) -> None:
        self.url = url
        self.interval_s = interval_s
        self.samples: list[MetricSample] = []
        self.error: str | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Its own connection: scraping must not take a slot of the request pool.
        self._http = httpx.AsyncClient(timeout=max(interval_s, 5.0), headers=headers)
        self._task: asyncio.Task[None] | None = None
        # The origin of the samples' times: 0 (perf_counter's own) until `start()` rebases them.
        self._run_start = 0.0

    async def scrape(self) -> bool:
        if self.error is not None:
            return False
        try:
            response = await self._http.get(self.url)
            response.raise_for_status()
            self.samples.append(parse_metrics(response.text, time.perf_counter() - self._run_start))
            return True
        except (httpx.HTTPError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return False

    async def baseline(self) -> None:
        """The first scrape: the counters the run's are measured from (the prefix hit rate). Awaited
        before the run's clock starts, since a slow /metrics (up to the scrape timeout) would otherwise eat
        into the run, whose arrivals and --duration count from its start."""
        await self.scrape()

    def start(self, run_start: float) -> None:
        """After `baseline()`: scrape every interval from now on. Sample times count from `run_start`, the
        baseline's too (at most 0: it came before the run)."""
        self._run_start = run_start
        self.samples = [replace(sample, t_s=sample.t_s - run_start) for sample in self.samples]
        if self.error is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not await self.scrape():
                return

    async def stop(self) -> list[MetricSample]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            await self.scrape()
        await self._http.aclose()
        return self.samples
