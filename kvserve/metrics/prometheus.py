"""Prometheus metrics of the API process, fed from the engine's `SchedulerStats` and `IterationStats`.

Every series is labelled `model_name` and named as vLLM names it under our prefix (`kvserve:`); with
``metrics_compat="vllm"`` the same values are also exported under `vllm:` (plus vLLM's older aliases
`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_*` and `vllm:time_per_output_token_seconds`) so
existing vLLM dashboards and alerts work unchanged.

Only this module imports `prometheus_client`; the engine core sends plain stats objects.

With several API processes (`--api-server-count`) every process keeps its series in prometheus_client's
multiprocess files in one directory (`enable_multiprocess`), and /metrics, whichever process answers it,
merges them: counters and histograms are summed over the processes. The engine's gauges and cumulative
counters reach every process alike, so only the first records them (`record_scheduler`), and the gauges
merge by their maximum (the others' files hold 0).
"""

from __future__ import annotations

import os

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, values

from kvserve.core.outputs import SchedulerStats
from kvserve.metrics.stats import IterationStats

# `*_created` series double the output and no dashboard uses them.
prometheus_client.disable_created_metrics()

# Fine enough for the P50/P99 of a fast GPU: 1 ms steps at the low end, then roughly x2 up to minutes.
TTFT_BUCKETS_S = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
ITL_BUCKETS_S = [
    0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
# vLLM's for request_time_per_output_token_seconds (one observation a request, its mean time a token).
TPOT_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS_S = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]
N_BUCKETS = [1, 2, 5, 10, 20]  # vLLM's for request_params_n
# vLLM's finish reasons that kvserve gives ("error": a request that failed in the engine after it ran), each
# exported from the start so that a rate() of it has a series before the first such request.
FINISH_REASONS = ("stop", "length", "abort", "error")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def enable_multiprocess(directory: str) -> None:
    """Keep every metric created from now on in `directory`'s files, shared with the other API processes.

    prometheus_client picks its value class when it is first imported, from $PROMETHEUS_MULTIPROC_DIR: the
    variable is set for the processes spawned from now on, and this process switches the class the same way.
    """
    os.environ[MULTIPROC_ENV] = directory
    values.ValueClass = values.MultiProcessValue()


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (token-count histograms)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


class _Series:
    """One name prefix's metric objects, already bound to the model_name label."""

    def __init__(self, prefix: str, model_name: str, max_model_len: int, registry: CollectorRegistry,
                 legacy_aliases: bool) -> None:
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            # multiprocess_mode applies to multiprocess files only: see the module's docstring.
            return Gauge(prefix + name, doc, labels, registry=registry, multiprocess_mode="max").labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        tokens = token_buckets(max_model_len)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.kv_usage = [gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")]
        self.prefix_queries = [counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")]
        self.prefix_hits = [counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")]
        self.itl = [histogram("inter_token_latency_seconds", "Time between two output steps of a request.",
                              ITL_BUCKETS_S)]
        if legacy_aliases:
            self.kv_usage.append(gauge("gpu_cache_usage_perc", "Deprecated alias of kv_cache_usage_perc."))
            self.prefix_queries.append(counter("gpu_prefix_cache_queries", "Deprecated alias of "
                                               "prefix_cache_queries."))
            self.prefix_hits.append(counter("gpu_prefix_cache_hits", "Deprecated alias of prefix_cache_hits."))
            self.itl.append(histogram("time_per_output_token_seconds", "Deprecated alias of "
                                      "inter_token_latency_seconds.", ITL_BUCKETS_S))
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached their first token, prefix-cache hits included.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        success = Counter(prefix + "request_success", "Requests finished, by finish reason.",
                          ["model_name", "finished_reason"], registry=registry)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success_family = success
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS_S)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS_S)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                               REQUEST_LATENCY_BUCKETS_S)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                 REQUEST_LATENCY_BUCKETS_S)
        self.decode = histogram("request_decode_time_seconds", "First token to last token.",
                                REQUEST_LATENCY_BUCKETS_S)
        self.inference = histogram("request_inference_time_seconds", "First scheduled to last token.",
                                   REQUEST_LATENCY_BUCKETS_S)
        self.tpot = histogram("request_time_per_output_token_seconds", "A request's mean time per output token "
                              "after its first (its decode time / (output tokens - 1); 0 with one token).",
                              TPOT_BUCKETS_S)
        self.prompt_hist = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_hist = histogram("request_generation_tokens", "Generated tokens per request.", tokens)
        self.max_tokens_hist = histogram("request_params_max_tokens", "max_tokens per request.", tokens)
        self.n_hist = histogram("request_params_n", "n (samples) per request, counted once all its samples end.",
                                N_BUCKETS)
        self.max_generation_hist = histogram("request_max_num_generation_tokens", "The most tokens one sample of "
                                             "a request generated, once all its samples end.", tokens)

    def success_counter(self, reason: str) -> Counter:
        if reason not in self.success:
            self.success[reason] = self._success_family.labels(self._model_name, reason)
        return self.success[reason]


class PrometheusStatLogger:
    """A `StatLogger` that keeps Prometheus series in `registry` (its own, unless one is given)."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        metrics_compat: str | None = None,
        registry: CollectorRegistry | None = None,
        cache_info: dict[str, str] | None = None,
        multiprocess_dir: str | None = None,
        record_scheduler: bool = True,
    ) -> None:
        """`multiprocess_dir`: /metrics merges every API process's files there (`enable_multiprocess` must
        have run first). `record_scheduler`: whether this process records the engine's stats."""
        if metrics_compat not in (None, "vllm"):
            raise ValueError(f"metrics_compat must be None or 'vllm', got {metrics_compat!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self._series = [_Series("kvserve:", model_name, max_model_len, self.registry, legacy_aliases=False)]
        if metrics_compat == "vllm":
            self._series.append(_Series("vllm:", model_name, max_model_len, self.registry, legacy_aliases=True))
        if cache_info:
            prefixes = ["kvserve:"] + (["vllm:"] if metrics_compat == "vllm" else [])
            for prefix in prefixes:
                info = Gauge(prefix + "cache_config_info", "KV cache configuration (value 1).",
                             sorted(cache_info), registry=self.registry, multiprocess_mode="max")
                info.labels(**cache_info).set(1)
        # The engine's counters are cumulative; Prometheus counters take increments.
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self.multiprocess_dir = multiprocess_dir
        self.record_scheduler = record_scheduler

    def generate_latest(self) -> bytes:
        if self.multiprocess_dir is None:
            return prometheus_client.generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self.multiprocess_dir)
        return prometheus_client.generate_latest(merged)

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        if scheduler_stats is not None and self.record_scheduler:
            self._record_scheduler(scheduler_stats)
        for s in self._series:
            if iteration.num_prompt_tokens:
                s.prompt_tokens.inc(iteration.num_prompt_tokens)
            if iteration.num_generation_tokens:
                s.generation_tokens.inc(iteration.num_generation_tokens)
            for ttft in iteration.time_to_first_tokens_s:
                s.ttft.observe(ttft)
            for itl in iteration.inter_token_latencies_s:
                for h in s.itl:
                    h.observe(itl)
            for done in iteration.finished:
                s.success_counter(done.finish_reason).inc()
                s.e2e.observe(done.e2e_latency_s)
                s.prompt_hist.observe(done.num_prompt_tokens)
                s.generation_hist.observe(done.num_generation_tokens)
                s.max_tokens_hist.observe(done.max_tokens)
                if done.queue_time_s is not None:
                    s.queue.observe(done.queue_time_s)
                if done.prefill_time_s is not None:
                    s.prefill.observe(done.prefill_time_s)
                if done.decode_time_s is not None:
                    s.decode.observe(done.decode_time_s)
                    # vLLM's: the first token is the prefill's, so it is not counted
                    tokens_after_first = done.num_generation_tokens - 1
                    s.tpot.observe(done.decode_time_s / tokens_after_first if tokens_after_first > 0 else 0.0)
                if done.prefill_time_s is not None and done.decode_time_s is not None:
                    s.inference.observe(done.prefill_time_s + done.decode_time_s)
            for n, max_generation_tokens in iteration.finished_groups:
                s.n_hist.observe(n)
                s.max_generation_hist.observe(max_generation_tokens)

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        queries = _delta(stats.prefix_cache_queries, self._last_queries)
        hits = _delta(stats.prefix_cache_hits, self._last_hits)
        preemptions = _delta(stats.num_preemptions, self._last_preemptions)
        self._last_queries = stats.prefix_cache_queries
        self._last_hits = stats.prefix_cache_hits
        self._last_preemptions = stats.num_preemptions
        for s in self._series:
            s.running.set(stats.num_running_reqs)
            s.waiting.set(stats.num_waiting_reqs)
            for g in s.kv_usage:
                g.set(stats.kv_cache_usage)
            for c in s.prefix_queries:
                c.inc(queries)
            for c in s.prefix_hits:
                c.inc(hits)
            s.preemptions.inc(preemptions)


def _delta(current: int, last: int) -> int:
    # A smaller value means the engine restarted its count: everything since is new.
    return current - last if current >= last else current
