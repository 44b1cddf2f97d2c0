"""What one `kvserve bench` invocation does: target, load shapes, workload, outputs. Validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvserve.bench.datasets import DatasetConfig

APIS = ("chat", "completions", "responses")
GOODPUT_KEYS = ("ttft", "itl", "tpot", "e2e")
# The latencies the report shows (--percentile-metrics chooses among them).
LATENCY_KEYS = ("ttft", "tpot", "itl", "e2e")
# Hard bounds that hold whatever the flags say: no run issues more requests than this, and no run issues
# requests for longer than this.
MAX_REQUESTS_PER_RUN = 1_000_000
MAX_DURATION_S = 24 * 3600.0
# Stop issuing when this many requests have finished and every one of them failed (server down, wrong
# model name): more requests would only measure the error path.
ABORT_AFTER_ALL_FAILED = 100
# Stop issuing when this many requests in a row got no answer at all (`connection`): the server has gone (a
# closed loop would otherwise resend at once after each refused connection, thousands a second).
ABORT_AFTER_CONNECTION_FAILURES = 50
# Request-body keys --extra-body may not set: those the client needs as it sends them.
EXTRA_BODY_RESERVED = frozenset({"stream", "messages", "prompt", "input"})


# Top-level keys of the result JSON that --metadata may not name (kvserve's, and vLLM's configuration and
# per-request lists).
RESERVED_RESULT_KEYS = frozenset((
    "format", "version", "created_utc", "config", "runs", "date", "endpoint_type", "backend", "label", "model_id",
    "tokenizer_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "input_lens", "output_lens",
    "ttfts", "itls", "generated_texts", "errors"))


class BenchConfigError(ValueError):
    """A benchmark setting is invalid; the message names the flag."""


@dataclass(frozen=True)
class LoadShape:
    """How requests are issued in one run.

    Closed loop (`concurrency` set): that many workers, each sends its next request when the previous one
    ends. Open loop (`request_rate` set, requests/s, `math.inf` = all at once): arrivals with gamma
    inter-arrival gaps of mean 1/rate and shape `burstiness` (1 = Poisson; < 1 burstier, > 1 smoother),
    at most `max_concurrency` in flight (later arrivals wait for a slot, and the wait is recorded).
    The run stops issuing after `num_prompts` requests or `duration_s` seconds, whichever comes first;
    requests in flight then finish (each bounded by the request timeout).
    """

    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None
    num_prompts: int | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise BenchConfigError("give exactly one of --concurrency (closed loop) and --request-rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchConfigError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise BenchConfigError(f"--request-rate must be positive, got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise BenchConfigError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchConfigError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if self.duration_s is None and self.num_prompts is None:
            raise BenchConfigError("give --duration or --num-prompts (or both: whichever ends first)")
        if self.duration_s is not None and not 0 < self.duration_s <= MAX_DURATION_S:
            raise BenchConfigError(f"--duration must be in (0, {MAX_DURATION_S:.0f}] s, got {self.duration_s}")
        if self.num_prompts is not None and not 1 <= self.num_prompts <= MAX_REQUESTS_PER_RUN:
            raise BenchConfigError(f"--num-prompts must be in [1, {MAX_REQUESTS_PER_RUN}], got {self.num_prompts}")
        if self.request_rate is not None and math.isinf(self.request_rate) and self.num_prompts is None:
            raise BenchConfigError("--request-rate inf sends everything at once: it needs --num-prompts")

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    @property
    def max_in_flight(self) -> int | None:
        """Most requests in flight at once (None: unbounded open loop)."""
        return self.concurrency if self.closed_loop else self.max_concurrency

    @property
    def max_requests(self) -> int:
        return self.num_prompts if self.num_prompts is not None else MAX_REQUESTS_PER_RUN

    def label(self) -> str:
        if self.closed_loop:
            return f"concurrency={self.concurrency}"
        rate = "inf" if self.request_rate is not None and math.isinf(self.request_rate) else f"{self.request_rate:g}"
        label = f"rate={rate}"
        if self.burstiness != 1.0:
            label += f" burstiness={self.burstiness:g}"
        if self.max_concurrency is not None:
            label += f" max_concurrency={self.max_concurrency}"
        return label


@dataclass(frozen=True)
class BenchConfig:
    """One `kvserve bench` invocation. `shapes` holds one LoadShape per run (several for a sweep)."""

    endpoint: str
    shapes: tuple[LoadShape, ...]
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    api: str | None = None
    model: str | None = None
    api_key: str | None = None
    # The key came from $OPENAI_API_KEY, not --api-key: it goes to the endpoint's server only, never to a
    # /metrics scrape (`metrics_api_key`), which may be another host and needs no key on kvserve or vLLM.
    api_key_from_env: bool = False
    tokenizer: str | None = None
    warmup: int = 0
    request_timeout_s: float = 600.0
    # How long to wait for the server to come up (vLLM's --ready-check-timeout-sec; 0: one check, no wait).
    ready_check_timeout_s: float = 0.0
    # With a duration: requests still running this long after it are cancelled (None: never).
    drain_timeout_s: float | None = 60.0
    ignore_eos: bool = False
    # Sent in every request when set (None: the server's default); vLLM's bench sends temperature 0 unless told.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's --extra-body: keys merged into every request body last (over the flags' values).
    extra_body: dict[str, Any] = field(default_factory=dict)
    goodput_ms: dict[str, float] = field(default_factory=dict)
    server_metrics: bool = True
    metrics_url: str | None = None
    metrics_interval_s: float = 1.0
    # Latencies the report shows, and percentiles of each beyond its median, P90, P95 and P99.
    percentile_metrics: tuple[str, ...] = LATENCY_KEYS
    metric_percentiles: tuple[float, ...] = ()
    json_path: str | None = None
    # vLLM's result-file options: --backend as given, --label, --metadata KEY=VALUE (top-level keys of the
    # JSON), --save-detailed (its per-request lists), --append-result (the JSON appended as one more line).
    backend: str | None = None
    label: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    save_detailed: bool = False
    append_result: bool = False
    request_id_prefix: str | None = None
    plot_path: str | None = None
    compare_path: str | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise BenchConfigError(f"--endpoint must be an http(s) URL, got {self.endpoint!r}")
        if self.api is not None and self.api not in APIS:
            raise BenchConfigError(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.api is None and not parts.path.rstrip("/").endswith(("/completions", "/responses")):
            # e.g. http://host:8000/v1, the OpenAI client's base URL: every request would get a 404
            chat = parts._replace(path=parts.path.rstrip("/") + "/chat/completions", fragment="").geturl()
            raise BenchConfigError(
                f"--endpoint {self.endpoint!r} is no completions URL: give the route itself, e.g. {chat} or "
                ".../completions or .../responses (or --api chat / completions / responses for a server whose "
                "route is named otherwise)")
        if parts.path.endswith("/") and parts.path.rstrip("/"):
            # .../chat/completions/ is the route itself to a user, but a server answers it with a redirect (or 404)
            object.__setattr__(self, "endpoint", parts._replace(path=parts.path.rstrip("/")).geturl())
        if not self.shapes:
            raise BenchConfigError("no load shape to run")
        if self.warmup < 0:
            raise BenchConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.request_timeout_s > 0:
            raise BenchConfigError(f"--request-timeout must be positive, got {self.request_timeout_s}")
        if not 0 <= self.ready_check_timeout_s <= MAX_DURATION_S:
            raise BenchConfigError(f"--ready-check-timeout-sec must be in [0, {MAX_DURATION_S:.0f}], got "
                                   f"{self.ready_check_timeout_s:g}")
        if self.drain_timeout_s is not None and not self.drain_timeout_s >= 0:
            raise BenchConfigError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if not self.metrics_interval_s > 0:
            raise BenchConfigError(f"--metrics-interval must be positive, got {self.metrics_interval_s}")
        if self.temperature is not None and not 0 <= self.temperature < math.inf:
            # (NaN and inf went out as JSON null, the server's default, and NaN broke the result JSON)
            raise BenchConfigError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        for flag, value, ok, accepted in (
            ("--top-p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("--top-k", self.top_k, lambda v: v == -1 or v >= 0, "-1 or 0 (no limit) or a positive integer"),
            ("--min-p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("--repetition-penalty", self.repetition_penalty, lambda v: 0 < v < math.inf,
             "a finite number > 0 (1: none)"),
            ("--presence-penalty", self.presence_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("--frequency-penalty", self.frequency_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        ):
            if value is not None and not ok(value):  # (NaN fails every comparison)
                raise BenchConfigError(f"{flag} must be {accepted}, got {value:g}")
        taken = sorted(set(self.extra_body) & EXTRA_BODY_RESERVED)
        if taken:
            raise BenchConfigError(f"--extra-body cannot set {', '.join(taken)}: the benchmark streams each request "
                                   "and takes its prompt from the dataset")
        for key, value in self.goodput_ms.items():
            if key not in GOODPUT_KEYS:
                raise BenchConfigError(f"--goodput keys are {', '.join(GOODPUT_KEYS)}, got {key!r}")
            if not value > 0:
                raise BenchConfigError(f"--goodput {key} must be a positive number of ms, got {value}")

        for key in self.metadata:
            if not key or key in RESERVED_RESULT_KEYS:
                raise BenchConfigError(f"--metadata {key!r}=...: that key is the result file's own"
                                       if key else "--metadata takes KEY=VALUE with a non-empty KEY")
        if not self.percentile_metrics or any(key not in LATENCY_KEYS for key in self.percentile_metrics):
            raise BenchConfigError(f"--percentile-metrics takes {', '.join(LATENCY_KEYS)} (or e2el), got "
                                   f"{','.join(self.percentile_metrics)!r}")
        for p in self.metric_percentiles:
            if not 0 <= p <= 100:
                raise BenchConfigError(f"--metric-percentiles must be in [0, 100], got {p:g}")

    def sampling(self) -> dict[str, float | int]:
        """The sampling parameters every request carries, under their request-body names."""
        values = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty}
        return {key: value for key, value in values.items() if value is not None}

    @property
    def resolved_api(self) -> str:
        """`api`, or guessed from the endpoint path: .../chat/completions is chat, .../responses the Responses
        API, anything else completions."""
        if self.api is not None:
            return self.api
        path = urlsplit(self.endpoint).path.rstrip("/")
        if path.endswith("/responses"):
            return "responses"
        return "chat" if path.endswith("chat/completions") else "completions"

    @property
    def server_root(self) -> str:
        parts = urlsplit(self.endpoint)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def api_base(self) -> str:
        """The URL that `/models` hangs off: the endpoint without its trailing `/chat/completions`,
        `/completions` or `/responses` (e.g. http://host:8000/v1)."""
        path = urlsplit(self.endpoint).path.rstrip("/")
        for suffix in ("/chat/completions", "/completions", "/responses"):
            if path.endswith(suffix):
                path = path[: -len(suffix)]
                break
        return self.server_root + path

    @property
    def metrics_api_key(self) -> str | None:
        """The key sent with /metrics scrapes: --api-key's, never one taken from $OPENAI_API_KEY (a user's
        OpenAI key, which /metrics does not need, to a URL that may be another host's)."""
        return None if self.api_key_from_env else self.api_key

    @property
    def resolved_metrics_url(self) -> str:
        return self.metrics_url or self.server_root + "/metrics"

    def pool_size(self) -> int | None:
        """Connections the HTTP pool may open: the largest in-flight bound of any run (None: unbounded)."""
        bounds = [shape.max_in_flight for shape in self.shapes]
        if any(b is None for b in bounds):
            return None
        return max(max(b for b in bounds if b is not None), self.warmup_concurrency())

    def warmup_concurrency(self) -> int:
        first = self.shapes[0].max_in_flight
        return max(1, min(self.warmup, first if first is not None else self.warmup))
