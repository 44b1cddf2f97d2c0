"""In-process tests of the pieces under the server: the engine <-> API messages (msgspec round trips), the
per-request stats tracker and the Prometheus logger. No processes, no model."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.core.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
from kvserve.metrics.prometheus import PrometheusStatLogger, token_buckets
from kvserve.metrics.stats import IterationStats, RequestStatsTracker
from kvserve.protocol.core_messages import (
    AbortRequests,
    AddRequests,
    EngineDead,
    EngineOutputs,
    EngineReady,
    RequestFailed,
    Shutdown,
    make_input_decoder,
    make_message_decoder,
)
from kvserve.protocol.engine import EngineCoreRequest
from kvserve.protocol.sampling_params import SamplingParams


def _roundtrip(message: object, decoder: msgspec.msgpack.Decoder) -> object:
    return decoder.decode(msgspec.msgpack.encode(message))


def test_engine_inputs_round_trip_with_every_sampling_field():
    params = SamplingParams(
        n=1, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=2**63 - 1, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={0: -100.0, 49151: 5.5}, max_tokens=7,
        min_tokens=2, ignore_eos=True, stop=["\n\n", "END"], stop_token_ids=[2, 3], include_stop_str_in_output=True,
        logprobs=5, skip_special_tokens=False, spaces_between_special_tokens=False,
        extra={"tag": [1, "two", {"three": 3.0}]},
    )
    request = EngineCoreRequest(req_id="0_abc", prompt_token_ids=[1, 2, 3], sampling_params=params, max_tokens=7,
                                eos_token_ids=[2], arrival_time=123.5, cache_salt="salt", group_key="abc")
    decoded = _roundtrip(AddRequests([request]), make_input_decoder())
    assert isinstance(decoded, AddRequests)
    assert decoded.requests == [request]
    got = decoded.requests[0].sampling_params
    assert isinstance(got, SamplingParams) and got == params
    assert all(type(k) is int for k in got.logit_bias)  # msgpack keeps integer map keys
    assert _roundtrip(AbortRequests(["a", "b"]), make_input_decoder()) == AbortRequests(["a", "b"])
    assert _roundtrip(Shutdown(), make_input_decoder()) == Shutdown()


def test_decoding_revalidates_sampling_params():
    # A dataclass decoded by msgspec runs __post_init__: an out-of-range value cannot slip through the socket.
    bad = msgspec.msgpack.encode({"type": "add", "requests": [{
        "req_id": "r", "prompt_token_ids": [1], "max_tokens": 1, "sampling_params": {"temperature": -1.0}}]})
    with pytest.raises((msgspec.ValidationError, ValueError)):
        make_input_decoder().decode(bad)


def test_engine_messages_round_trip():
    decoder = make_message_decoder()
    outputs = EngineOutputs(
        outputs=[
            EngineCoreOutput("r1", [5], [TokenLogprobs([5, 6], [-0.1, -2.5], 1)], first_scheduled_time=10.25),
            EngineCoreOutput("r2", [7], finish_reason="stop", stop_token_id=2, num_cached_tokens=16),
        ],
        stats=SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.25, prefix_cache_queries=64,
                             prefix_cache_hits=16, num_preemptions=1, num_blocks=100, num_free_blocks=75),
        timestamp=99.0,
    )
    assert _roundtrip(outputs, decoder) == outputs
    ready = EngineReady(pid=1, num_blocks=10, block_size=16, max_model_len=256, eos_token_ids=[2], startup_s=1.5,
                        vocab_size=49152, capacity_description="KV cache: ...")
    for message in (ready, RequestFailed("r", "too long", "prompt"), RequestFailed("r", "bad"), EngineDead("boom")):
        assert _roundtrip(message, decoder) == message


def test_stats_tracker_measures_each_request():
    tracker = RequestStatsTracker()
    tracker.add("a", arrival_time=100.0, num_prompt_tokens=10, max_tokens=3)
    it = IterationStats()
    tracker.on_output(EngineCoreOutput("a", [1], first_scheduled_time=100.5), now=101.0, iteration=it)
    assert it.time_to_first_tokens_s == [1.0] and it.num_prompt_tokens == 10 and it.num_generation_tokens == 1
    it = IterationStats()
    tracker.on_output(EngineCoreOutput("a", [2]), now=101.25, iteration=it)
    tracker.on_output(EngineCoreOutput("a", [3]), now=101.75, iteration=it)
    assert it.inter_token_latencies_s == [0.25, 0.5] and it.num_prompt_tokens == 0
    tracker.finish("a", "length", now=102.0, iteration=it)
    (done,) = it.finished
    assert (done.finish_reason, done.e2e_latency_s, done.queue_time_s) == ("length", 2.0, 0.5)
    assert (done.prefill_time_s, done.decode_time_s, done.num_generation_tokens) == (0.5, 0.75, 3)
    tracker.finish("a", "length", now=103.0, iteration=it)  # finished ids are forgotten: no double count
    assert len(it.finished) == 1 and len(tracker) == 0


def test_stats_tracker_counts_a_prompt_only_request():
    """A request that ends with no token after its prompt ran (prompt_logprobs asked, a grammar that allows only
    EOS under min_tokens): its prompt tokens and queue time are counted; no TTFT (no token), no prefill time.
    One ended before it was scheduled (the same grammar without prompt_logprobs) counts no prompt tokens."""
    tracker = RequestStatsTracker()
    tracker.add("p", arrival_time=100.0, num_prompt_tokens=10, max_tokens=3)
    tracker.add("g", arrival_time=100.0, num_prompt_tokens=6, max_tokens=3)
    it = IterationStats()
    tracker.on_output(EngineCoreOutput("g", [], finish_reason="stop"), now=100.25, iteration=it)
    tracker.finish("g", "stop", now=100.25, iteration=it)
    tracker.on_output(EngineCoreOutput("p", [], finish_reason="stop", first_scheduled_time=100.5), now=101.0,
                      iteration=it)
    tracker.finish("p", "stop", now=101.0, iteration=it)
    assert it.num_prompt_tokens == 10 and it.num_generation_tokens == 0 and it.time_to_first_tokens_s == []
    ended_unscheduled, prompt_only = it.finished
    assert ended_unscheduled.queue_time_s is None
    assert (prompt_only.queue_time_s, prompt_only.prefill_time_s, prompt_only.decode_time_s) == (0.5, None, None)
    assert (prompt_only.num_prompt_tokens, prompt_only.num_generation_tokens) == (10, 0)
    # Counted once: a later output with tokens (not a prompt-only request's, shown for the rule) adds none.
    tracker.add("q", arrival_time=0.0, num_prompt_tokens=4, max_tokens=3)
    it = IterationStats()
    tracker.on_output(EngineCoreOutput("q", [1], first_scheduled_time=0.5), now=1.0, iteration=it)
    tracker.on_output(EngineCoreOutput("q", [2]), now=1.5, iteration=it)
    assert it.num_prompt_tokens == 4 and it.time_to_first_tokens_s == [1.0]


def test_stats_tracker_abort_before_scheduling():
    tracker = RequestStatsTracker()
    tracker.add("b", arrival_time=5.0, num_prompt_tokens=4, max_tokens=8)
    it = IterationStats()
    tracker.finish("b", "abort", now=6.0, iteration=it)
    (done,) = it.finished
    assert done.queue_time_s is None and done.num_generation_tokens == 0 and done.e2e_latency_s == 1.0


def _samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(logger.generate_latest().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_prometheus_logger_turns_cumulative_engine_counters_into_increments():
    logger = PrometheusStatLogger("m", max_model_len=100, metrics_compat="vllm")
    label = (("model_name", "m"),)
    logger.record(SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1), IterationStats())
    logger.record(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5, prefix_cache_queries=30,
                                 prefix_cache_hits=4, num_preemptions=2), IterationStats())
    s = _samples(logger)
    assert s[("kvserve:prefix_cache_queries_total", label)] == 30
    assert s[("kvserve:prefix_cache_hits_total", label)] == 4
    assert s[("kvserve:num_preemptions_total", label)] == 2
    assert s[("kvserve:num_requests_running", label)] == 3
    assert s[("vllm:gpu_cache_usage_perc", label)] == s[("kvserve:kv_cache_usage_perc", label)] == 0.5
    # An engine that restarted its counts (smaller numbers) contributes them as new increments.
    logger.record(SchedulerStats(prefix_cache_queries=5), IterationStats())
    assert _samples(logger)[("kvserve:prefix_cache_queries_total", label)] == 35


def test_prometheus_logger_observes_iterations():
    logger = PrometheusStatLogger("m", max_model_len=100)
    tracker = RequestStatsTracker()
    tracker.add("a", 0.0, 7, 2)
    it = IterationStats()
    tracker.on_output(EngineCoreOutput("a", [1], first_scheduled_time=0.001), 0.0015, it)
    tracker.on_output(EngineCoreOutput("a", [2]), 0.004, it)
    tracker.finish("a", "stop", 0.004, it)
    logger.record(None, it)
    s = _samples(logger)
    label = ("model_name", "m")
    assert s[("kvserve:prompt_tokens_total", (label,))] == 7
    assert s[("kvserve:generation_tokens_total", (label,))] == 2
    assert s[("kvserve:request_success_total", (("finished_reason", "stop"), label))] == 1
    # 1.5 ms TTFT lands between the 1 ms and 2 ms buckets; 2.5 ms ITL between 2 ms and 3 ms.
    ttft = "kvserve:time_to_first_token_seconds_bucket"
    assert s[(ttft, (("le", "0.001"), label))] == 0 and s[(ttft, (("le", "0.002"), label))] == 1
    itl = "kvserve:inter_token_latency_seconds_bucket"
    assert s[(itl, (("le", "0.002"), label))] == 0 and s[(itl, (("le", "0.003"), label))] == 1
    assert not any(name.startswith("vllm:") for name, _ in s)


def test_time_per_output_token_is_observed_once_a_request_as_vllms():
    """vLLM's request_time_per_output_token_seconds (the TPOT vLLM dashboards and tools read): a request's
    decode time over its tokens after the first, once when it ends; 0 for a one-token request."""
    logger = PrometheusStatLogger("m", max_model_len=100, metrics_compat="vllm")
    tracker = RequestStatsTracker()
    tracker.add("a", 0.0, 3, 8)
    tracker.add("b", 0.0, 3, 8)
    it = IterationStats()
    tracker.on_output(EngineCoreOutput("a", [1], first_scheduled_time=0.01), 0.1, it)
    tracker.on_output(EngineCoreOutput("b", [1], first_scheduled_time=0.01), 0.1, it)
    tracker.on_output(EngineCoreOutput("a", [2, 3]), 0.2, it)
    tracker.on_output(EngineCoreOutput("a", [4]), 0.4, it)
    tracker.finish("a", "length", 0.4, it)  # 0.3 s for 3 tokens after the first: 0.1 s a token
    tracker.finish("b", "stop", 0.4, it)
    logger.record(None, it)
    s = _samples(logger)
    label = ("model_name", "m")
    for prefix in ("kvserve:", "vllm:"):
        name = prefix + "request_time_per_output_token_seconds"
        assert s[(name + "_count", (label,))] == 2
        assert s[(name + "_sum", (label,))] == pytest.approx(0.1)
        assert s[(name + "_bucket", (("le", "0.01"), label))] == 1  # b's 0
        assert s[(name + "_bucket", (("le", "0.075"), label))] == 1
        assert s[(name + "_bucket", (("le", "0.15"), label))] == 2


def test_a_requests_samples_count_once_for_n_and_their_longest_output():
    """vLLM's request_params_n and request_max_num_generation_tokens: once per request, when its last sample
    ends (an n=3 request whose samples made 2, 5 and 1 tokens: n 3, 5 tokens; a request alone: n 1)."""
    logger = PrometheusStatLogger("m", max_model_len=100, metrics_compat="vllm")
    tracker = RequestStatsTracker()
    tracker.add_group(["g0", "g1", "g2"], 0.0, 4, 8)
    tracker.add("solo", 0.0, 4, 8)
    it = IterationStats()
    for req_id, num in (("g0", 2), ("g1", 5), ("g2", 1), ("solo", 3)):
        tracker.on_output(EngineCoreOutput(req_id, list(range(num)), first_scheduled_time=0.1), 0.2, it)
    tracker.finish("g0", "stop", 0.3, it)
    tracker.finish("g1", "length", 0.3, it)
    assert it.finished_groups == []  # a sample is still live
    tracker.finish("solo", "stop", 0.3, it)
    tracker.finish("g2", "abort", 0.4, it)
    assert it.finished_groups == [(1, 3), (3, 5)] and len(tracker) == 0
    logger.record(None, it)
    s = _samples(logger)
    label = ("model_name", "m")
    for prefix in ("kvserve:", "vllm:"):
        assert s[(prefix + "request_params_n_count", (label,))] == 2
        assert s[(prefix + "request_params_n_sum", (label,))] == 4
        assert s[(prefix + "request_max_num_generation_tokens_sum", (label,))] == 8
        assert s[(prefix + "request_params_n_bucket", (("le", "2.0"), label))] == 1
    # vLLM's request latency buckets are all there (0.3 s was missing).
    assert (("vllm:e2e_request_latency_seconds_bucket", (("le", "0.3"), label))) in s


def test_token_buckets():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(8192)[-1] == 5000


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_cache_config_info_carries_vllms_cache_dtype_label(kv_cache_dtype: str) -> None:
    """The server's cache_config_info has vLLM's `cache_dtype` label: the --kv-cache-dtype value."""
    import argparse

    from kvserve.config import CacheConfig
    from kvserve.entrypoints.openai.api_server import _make_metrics

    config = SimpleNamespace(cache_config=CacheConfig(enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype))
    ready = EngineReady(pid=1, num_blocks=10, block_size=16, max_model_len=256, eos_token_ids=[2], startup_s=1.5,
                        vocab_size=49152, capacity_description="")
    logger = _make_metrics(argparse.Namespace(metrics_compat="vllm"), config, ready, ["m"], None, True)
    labels = (("block_size", "16"), ("cache_dtype", kv_cache_dtype), ("enable_prefix_caching", "False"),
              ("num_gpu_blocks", "10"))
    s = _samples(logger)
    assert s[("kvserve:cache_config_info", labels)] == s[("vllm:cache_config_info", labels)] == 1
