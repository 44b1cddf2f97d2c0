"""A run's numbers from its request records: latency statistics, throughput, goodput, errors by kind.

Denominators are honest: `num_requests` counts every request issued, failed ones included; success rate
and goodput are fractions of it. Latency statistics cover successful requests (a failed request has no
end-to-end latency). Token totals and throughputs count successful requests' tokens; `duration_s` spans
from the first request sent to the last one finished (failures included), so throughput x duration =
tokens exactly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvserve.bench.client import RequestRecord
from kvserve.bench.client_health import ClientHealthReport


@dataclass(frozen=True)
class LatencyStats:
    """Statistics of one latency in milliseconds over `count` values (all None when count is 0).
    Percentiles interpolate linearly between order statistics (numpy's default)."""

    count: int
    mean_ms: float | None = None
    median_ms: float | None = None
    p90_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    std_ms: float | None = None
    # Further percentiles asked for (--metric-percentiles), by name ("p99.9", "p25"; None when count is 0).
    percentiles_ms: dict[str, float | None] = field(default_factory=dict)

    @classmethod
    def of(cls, values_s: list[float], percentiles: tuple[float, ...] = ()) -> LatencyStats:
        extra = [p for p in percentiles if p not in STANDARD_PERCENTILES]
        if not values_s:
            return cls(0, percentiles_ms={percentile_name(p): None for p in extra})
        ms = np.asarray(values_s, dtype=np.float64) * 1e3
        p50, p90, p95, p99 = (float(v) for v in np.percentile(ms, STANDARD_PERCENTILES))
        return cls(len(values_s), float(ms.mean()), p50, p90, p95, p99, float(ms.min()), float(ms.max()),
                   float(ms.std()), {percentile_name(p): float(np.percentile(ms, p)) for p in extra})


# The percentiles every LatencyStats has (median_ms, p90_ms, p95_ms, p99_ms).
STANDARD_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


def percentile_name(p: float) -> str:
    """"p99.9", "p25": the name of a further percentile (vLLM's key part)."""
    return f"p{p:g}"


@dataclass(frozen=True)
class Summary:
    label: str
    num_requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    cached_input_tokens: int | None
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # Little's law: the average number of requests in flight over the run.
    mean_concurrency: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    # Open loop: how long arrivals waited for a concurrency slot before being sent.
    queued: LatencyStats
    # TTFT of every request that received a first token, failed and cancelled ones included: when few
    # requests complete (an overloaded server), this is the first-token latency users actually saw.
    ttft_all: LatencyStats
    tokens_from_usage: int
    tokens_from_tokenizer: int
    goodput_ms: dict[str, float] = field(default_factory=dict)
    good_requests: int | None = None
    goodput: float | None = None
    client: ClientHealthReport | None = None
    server: dict[str, float | None] | None = None
    stopped: str | None = None

    @property
    def success_rate(self) -> float:
        return self.completed / self.num_requests if self.num_requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["client"] = self.client.to_dict() if self.client is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        values = dict(data)
        for name in ("ttft", "tpot", "itl", "e2e", "queued", "ttft_all"):
            values[name] = LatencyStats(**values[name])
        if values.get("client") is not None:
            values["client"] = ClientHealthReport.from_dict(values["client"])
        return cls(**values)


def meets_slos(record: RequestRecord, goodput_ms: dict[str, float]) -> bool:
    """Whether a request counts toward goodput: it succeeded and every given SLO holds. `itl` applies to
    the request's mean inter-token gap, `tpot` to its TPOT (both trivially met with fewer than 2 tokens)."""
    if not record.success:
        return False
    per_request_ms = {
        "ttft": record.ttft_s * 1e3 if record.ttft_s is not None else None,
        "e2e": record.e2e_s * 1e3 if record.e2e_s is not None else None,
        "itl": float(np.mean(record.itl_s)) * 1e3 if record.itl_s else None,
        "tpot": record.tpot_s * 1e3 if record.tpot_s is not None else None,
    }
    return all(per_request_ms[key] is None or per_request_ms[key] <= limit  # type: ignore[operator]
               for key, limit in goodput_ms.items())


def summarize(
    label: str,
    records: list[RequestRecord],
    goodput_ms: dict[str, float] | None = None,
    client: ClientHealthReport | None = None,
    server: dict[str, float | None] | None = None,
    stopped: str | None = None,
    percentiles: tuple[float, ...] = (),
) -> Summary:
    """`percentiles`: further percentiles of each latency (LatencyStats.percentiles_ms)."""
    goodput_ms = dict(goodput_ms or {})
    ok = [r for r in records if r.success]
    if records:
        duration_s = max(r.end_s for r in records) - min(r.start_s for r in records)
    else:
        duration_s = 0.0
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]

    def rate(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    good = sum(meets_slos(r, goodput_ms) for r in records) if goodput_ms else None
    return Summary(
        label=label,
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=dict(sorted(Counter(r.error_kind for r in records if r.error_kind is not None).items())),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        cached_input_tokens=sum(cached) if cached else None,
        request_throughput=rate(len(ok)),
        output_throughput=rate(output_tokens),
        total_token_throughput=rate(input_tokens + output_tokens),
        mean_concurrency=rate(sum(r.e2e_s or 0.0 for r in records)),
        ttft=LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None], percentiles),
        tpot=LatencyStats.of([t for r in ok if (t := r.tpot_s) is not None], percentiles),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl_s], percentiles),
        e2e=LatencyStats.of([r.e2e_s for r in ok if r.e2e_s is not None], percentiles),
        queued=LatencyStats.of([r.queued_s for r in records if r.scheduled_s is not None]),
        ttft_all=LatencyStats.of([r.ttft_s for r in records if r.ttft_s is not None]),
        tokens_from_usage=sum(r.token_source == "usage" for r in ok),
        tokens_from_tokenizer=sum(r.token_source == "tokenizer" for r in ok),
        goodput_ms=goodput_ms,
        good_requests=good,
        goodput=rate(good) if good is not None else None,
        client=client,
        server=server,
        stopped=stopped,
    )
