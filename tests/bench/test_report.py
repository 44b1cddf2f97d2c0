"""Summary statistics, the text block, --json round trip, --compare and --plot, on records built by hand."""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib

import numpy as np
import pytest

from kvserve.bench.client import RequestRecord
from kvserve.bench.client_health import ClientHealthReport
from kvserve.bench.plot import plot_runs, throughput_series
from kvserve.bench.report import compare_summaries, format_compare, format_summary, format_sweep
from kvserve.bench.results import BenchResult, RunResult, read_json, write_json
from kvserve.bench.server_metrics import MetricSample, histogram_means, parse_metrics, summarize_samples
from kvserve.bench.summary import summarize


def ok(index, start_s, ttft_s, itl_s, output_tokens, prompt_tokens=10, **kw):
    e2e = ttft_s + sum(itl_s)
    return RequestRecord(index, max_tokens=output_tokens, start_s=start_s, ttft_s=ttft_s, e2e_s=e2e,
                         itl_s=list(itl_s), prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                         token_source="usage", finish_reason="length", status_code=200, **kw)


def failed(index, start_s, kind, e2e_s=0.05, ttft_s=None):
    record = RequestRecord(index, max_tokens=4, start_s=start_s, e2e_s=e2e_s, ttft_s=ttft_s)
    record.fail(kind, "boom", 500 if kind.startswith("http") else None)
    return record


@pytest.fixture
def records():
    return [
        ok(0, 0.0, 0.1, [0.1, 0.1, 0.1], 4),  # ends at 0.4
        ok(1, 0.0, 0.2, [0.2, 0.2, 0.2], 4),  # ends at 0.8
        ok(2, 0.5, 0.3, [0.1], 2),  # ends at 0.9
        ok(3, 1.0, 0.4, [], 1),  # ends at 1.4
        failed(4, 1.5, "http_500"),  # ends at 1.55
        failed(5, 1.9, "broken_stream", e2e_s=0.1, ttft_s=0.05),  # ends at 2.0, had a first token
    ]


def test_summary_numbers(records):
    s = summarize("concurrency=2", records, goodput_ms={"ttft": 250.0})
    assert (s.num_requests, s.completed, s.failed) == (6, 4, 2)
    assert s.errors == {"broken_stream": 1, "http_500": 1}
    assert s.duration_s == pytest.approx(2.0)  # first send at 0.0, last end at 2.0 (a failure)
    assert (s.total_output_tokens, s.total_input_tokens) == (11, 40)
    assert s.request_throughput == pytest.approx(4 / 2.0)
    assert s.output_throughput == pytest.approx(11 / 2.0)
    assert s.total_token_throughput == pytest.approx(51 / 2.0)
    # TTFT 100, 200, 300, 400 ms: mean 250, median 250, P99 interpolates 300 -> 400 at 0.97.
    assert s.ttft.mean_ms == pytest.approx(250) and s.ttft.median_ms == pytest.approx(250)
    assert s.ttft.p99_ms == pytest.approx(397) and s.ttft.max_ms == pytest.approx(400)
    # Counting the broken stream's first token too: 50, 100, 200, 300, 400 ms.
    assert s.ttft_all.count == 5 and s.ttft_all.median_ms == pytest.approx(200)
    # TPOT = (E2E - TTFT) / (tokens - 1): 100, 200, 100 ms; request 3 has one token and no TPOT.
    assert s.tpot.count == 3 and s.tpot.mean_ms == pytest.approx(400 / 3)
    assert s.itl.count == 7 and s.itl.mean_ms == pytest.approx(1000 / 7)
    assert s.e2e.count == 4 and s.e2e.max_ms == pytest.approx(800)
    # TTFT <= 250 ms: requests 0 and 1; the failures count as misses in the denominator.
    assert s.good_requests == 2 and s.goodput == pytest.approx(1.0)
    # Little's law: (0.4 + 0.8 + 0.4 + 0.4 + 0.05 + 0.1) / 2.0.
    assert s.mean_concurrency == pytest.approx(2.15 / 2.0)


def test_empty_run_is_reported_not_crashed_on():
    s = summarize("concurrency=1", [])
    assert s.num_requests == 0 and s.ttft.count == 0 and s.output_throughput == 0.0
    assert "Successful requests:" in format_summary(s)


def test_text_block_names_every_metric(records):
    client = ClientHealthReport(cpu_percent=97.0, loop_lag_p50_ms=1.0, loop_lag_p99_ms=2.0, loop_lag_max_ms=3.0)
    s = summarize("concurrency=2", records, {"ttft": 250.0}, client,
                  {"max_running": 2.0, "max_waiting": 0.0, "max_kv_usage": 0.5, "prefix_hit_rate": 0.25})
    text = format_summary(s)
    for line in ("Successful requests:", "Failed requests:", "http_500:", "broken_stream:",
                 "Benchmark duration (s):", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Total token throughput (tok/s):", "Goodput (req/s)", "Mean TTFT (ms):", "P99 TTFT (ms):",
                 "Median TPOT (ms):", "P95 ITL (ms):", "P90 E2E Latency (ms):", "Max running requests:",
                 "Prefix cache hit rate (%):", "Client CPU (% of one core):", "Event-loop lag max (ms):",
                 "Longest client GC pause (ms):",
                 "Median TTFT incl. 1 unfinished (ms):"):
        assert line in text, line
    assert "25.0" in text.split("Prefix cache hit rate (%):")[1].splitlines()[0]
    # 97% CPU: the saturation warning is printed with the report.
    assert "client may be the bottleneck" in text
    fine = ClientHealthReport(cpu_percent=20.0, loop_lag_p50_ms=1.0, loop_lag_p99_ms=2.0, loop_lag_max_ms=3.0)
    assert fine.warning() is None and not fine.saturated
    laggy = ClientHealthReport(cpu_percent=20.0, loop_lag_p50_ms=1.0, loop_lag_p99_ms=80.0, loop_lag_max_ms=90.0)
    assert laggy.saturated


def _result(records, samples):
    client = ClientHealthReport(cpu_percent=12.5, loop_lag_p50_ms=0.1, loop_lag_p99_ms=0.7, loop_lag_max_ms=1.5)
    server = summarize_samples(samples)
    summary = summarize("rate=inf", records, {"e2e": 500.0}, client, server)
    run = RunResult("rate=inf", {"request_rate": "inf", "num_prompts": 6}, summary, records, samples)
    return BenchResult(config={"endpoint": "http://127.0.0.1:1/v1/completions", "shapes": []}, runs=[run])


SAMPLES = [MetricSample(0.0, 0, 0, 0.0, 100, 400), MetricSample(1.0, 2, 1, 0.25, 160, 500),
           MetricSample(2.0, 0, 0, 0.0, 220, 600)]


def test_json_round_trip(tmp_path, records):
    result = _result(records, SAMPLES)
    path = tmp_path / "result.json"
    write_json(result, str(path))
    loaded = read_json(str(path))
    assert loaded.to_dict() == result.to_dict()
    assert loaded.runs[0].records == records
    assert loaded.runs[0].summary == result.runs[0].summary
    # The stored records reproduce the stored summary.
    run = loaded.runs[0]
    again = summarize(run.label, run.records, run.summary.goodput_ms, run.summary.client, run.summary.server)
    assert again == run.summary
    # Plain JSON: any tool can read it.
    data = json.loads(path.read_text())
    assert data["format"] == "kvserve-bench" and data["runs"][0]["shape"]["request_rate"] == "inf"
    assert len(data["runs"][0]["records"]) == 6 and "output_text" not in data["runs"][0]["records"][0]


def test_read_json_rejects_other_files(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not a kvserve bench result"):
        read_json(str(path))


def test_compare(records):
    old = summarize("concurrency=2", records)
    faster = [ok(r.index, r.start_s / 2, r.ttft_s / 2, [g / 2 for g in r.itl_s], r.output_tokens)
              for r in records if r.success]
    new = summarize("concurrency=2", faster)
    rows = {name: (a, b, change, verdict) for name, a, b, change, verdict in compare_summaries(old, new)}
    a, b, change, verdict = rows["Output token throughput (tok/s)"]
    assert b > a and verdict == "better" and change == pytest.approx((b - a) / a * 100)
    assert rows["Mean TTFT (ms)"][3] == "better" and rows["Mean TTFT (ms)"][2] == pytest.approx(-50)
    assert rows["Success rate (%)"][3] == "better"  # 4/6 -> 4/4
    worse = {name: verdict for name, *_, verdict in compare_summaries(new, old)}
    assert worse["Mean TTFT (ms)"] == "worse" and worse["Output token throughput (tok/s)"] == "worse"
    text = format_compare(old, new, "old.json")
    assert "old.json" in text and "-50.0%" in text


def test_sweep_table_has_one_row_per_point(records):
    summaries = [summarize(f"concurrency={c}", records) for c in (1, 8, 32)]
    lines = format_sweep(summaries).splitlines()
    assert len(lines) == 2 + 3
    assert [line.split()[0] for line in lines[2:]] == ["concurrency=1", "concurrency=8", "concurrency=32"]
    # The share of prompt tokens served from the prefix cache, last: "-" when the server sent no counts.
    assert lines[0].split()[-2:] == ["cached", "%"]
    cached = dataclasses.replace(summaries[1], cached_input_tokens=summaries[1].total_input_tokens // 4)
    rows = format_sweep([summaries[0], cached]).splitlines()[2:]
    assert rows[0].split()[-1] == "-" and rows[1].split()[-1] == "25.0"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    return width, height


def test_plot_is_a_valid_png(tmp_path, records):
    path = tmp_path / "plot.png"
    result = _result(records, SAMPLES)
    plot_runs(result.runs, str(path))
    data = path.read_bytes()
    # Three rows of panels (CDFs, throughput, server metrics) at 12 x 12 in, 100 dpi.
    assert _png_size(data) == (1200, 1200)
    assert data.endswith(b"IEND\xaeB`\x82")
    without_server = _result(records, [])
    plot_runs(without_server.runs, str(path))
    assert _png_size(path.read_bytes()) == (1200, 800)


def test_throughput_series_conserves_tokens(records):
    edges, tput = throughput_series(records, bin_s=0.25)
    assert len(edges) == len(tput) + 1
    assert float(np.sum(tput * np.diff(edges))) == pytest.approx(11)


def test_parse_metrics_reads_kvserve_and_vllm_names():
    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3.0
vllm:num_requests_running{model_name="b"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 7.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="a"} 0.5
# TYPE kvserve:prefix_cache_hits counter
kvserve:prefix_cache_hits_total{model_name="a"} 10.0
# TYPE kvserve:prefix_cache_queries counter
kvserve:prefix_cache_queries_total{model_name="a"} 40.0
"""
    sample = parse_metrics(text, 1.5)
    assert sample == MetricSample(1.5, running=5.0, waiting=7.0, kv_usage=0.5, prefix_hits=10.0,
                                  prefix_queries=40.0)
    # data-parallel replicas (`engine` labels): counts add up, the KV cache usage is the fullest replica's
    replicas = """# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running{engine="0"} 4.0
kvserve:num_requests_running{engine="1"} 6.0
# TYPE kvserve:kv_cache_usage_perc gauge
kvserve:kv_cache_usage_perc{engine="0"} 0.6
kvserve:kv_cache_usage_perc{engine="1"} 0.7
"""
    assert parse_metrics(replicas, 2.0) == MetricSample(2.0, running=10.0, kv_usage=0.7)
    summary = summarize_samples(SAMPLES)
    assert summary["max_running"] == 2 and summary["max_kv_usage"] == 0.25
    assert summary["prefix_hit_rate"] == pytest.approx(120 / 200)


HISTOGRAMS_BEFORE = """# HELP kvserve:time_to_first_token_seconds Arrival to first output token.
# TYPE kvserve:time_to_first_token_seconds histogram
kvserve:time_to_first_token_seconds_bucket{le="0.01",model_name="m"} 1.0
kvserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
kvserve:time_to_first_token_seconds_count{model_name="m"} 10.0
kvserve:time_to_first_token_seconds_sum{model_name="m"} 0.5
# TYPE kvserve:request_queue_time_seconds histogram
kvserve:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 10.0
kvserve:request_queue_time_seconds_count{model_name="m"} 10.0
kvserve:request_queue_time_seconds_sum{model_name="m"} 0.1
# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running{model_name="m"} 3.0
"""

HISTOGRAMS_AFTER = """# TYPE kvserve:time_to_first_token_seconds histogram
kvserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 20.0
kvserve:time_to_first_token_seconds_count{model_name="m"} 20.0
kvserve:time_to_first_token_seconds_sum{model_name="m"} 0.8
# TYPE kvserve:request_queue_time_seconds histogram
kvserve:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 10.0
kvserve:request_queue_time_seconds_count{model_name="m"} 10.0
kvserve:request_queue_time_seconds_sum{model_name="m"} 0.1
# TYPE kvserve:e2e_request_latency_seconds histogram
kvserve:e2e_request_latency_seconds_bucket{le="+Inf",model_name="a"} 1.0
kvserve:e2e_request_latency_seconds_count{model_name="a"} 1.0
kvserve:e2e_request_latency_seconds_sum{model_name="a"} 2.0
kvserve:e2e_request_latency_seconds_bucket{le="+Inf",model_name="b"} 1.0
kvserve:e2e_request_latency_seconds_count{model_name="b"} 1.0
kvserve:e2e_request_latency_seconds_sum{model_name="b"} 4.0
# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running{model_name="m"} 5.0
"""


def test_histogram_means_between_two_scrapes():
    means = histogram_means(HISTOGRAMS_BEFORE, HISTOGRAMS_AFTER)
    # 10 new TTFT observations summing to 0.3 s; none new for the queue; a histogram first seen in the
    # second scrape counts from zero, its two label sets summed; gauges are not histograms.
    assert set(means) == {"kvserve:time_to_first_token_seconds", "kvserve:e2e_request_latency_seconds"}
    mean, count = means["kvserve:time_to_first_token_seconds"]
    assert count == 10 and mean == pytest.approx(0.03)
    assert means["kvserve:e2e_request_latency_seconds"] == (3.0, 2)


def test_the_first_error_of_each_kind_is_sampled() -> None:
    """An OpenAI error body gives its message; another body is shown as sent, cut; successes are skipped."""
    from kvserve.bench.client import RequestRecord
    from kvserve.bench.runner import error_samples

    def record(index: int, kind: str | None, error: str | None) -> RequestRecord:
        r = RequestRecord(index=index, max_tokens=4)
        if kind is not None:
            r.fail(kind, error or "")
        return r

    records = [record(0, None, None),
               record(1, "http_404", '{"error": {"message": "The model `nope` does not exist.", "code": 404}}'),
               record(2, "timeout", "no answer within 600 s"),
               record(3, "http_404", '{"error": {"message": "another"}}'),
               record(4, "http_502", "<html>" + "x" * 1000),
               record(5, "http_400", '{"error": "a string"}')]
    samples = error_samples(records)
    assert list(samples) == ["http_404", "timeout", "http_502", "http_400"]
    assert samples["http_404"] == "The model `nope` does not exist."
    assert samples["timeout"] == "no answer within 600 s"
    assert samples["http_502"] == ("<html>" + "x" * 1000)[:300]
    assert samples["http_400"] == '{"error": "a string"}'


def test_metric_percentiles_and_percentile_metrics(records, tmp_path):
    # vllm bench serve --percentile-metrics ttft,e2el --metric-percentiles 25,99,99.9: the latencies shown,
    # and percentiles besides the usual ones (which stay), in the block and in the JSON
    s = summarize("concurrency=2", records, percentiles=(25.0, 99.0, 99.9))
    # TTFT 100, 200, 300, 400 ms: P25 at 175, P99.9 interpolates 300 -> 400 at 0.997
    assert s.ttft.percentiles_ms == {"p25": pytest.approx(175), "p99.9": pytest.approx(399.7)}
    assert set(s.e2e.percentiles_ms) == {"p25", "p99.9"} and s.queued.percentiles_ms == {}
    text = format_summary(s, ("ttft", "e2e"))
    assert "P25 TTFT (ms):" in text and "P99.9 E2E Latency (ms):" in text and "P99 TTFT (ms):" in text
    assert "TPOT" not in text and "ITL" not in text
    assert "P99.9 TTFT (ms):" in format_summary(s) and "Mean ITL (ms):" in format_summary(s)
    empty = summarize("concurrency=1", [], percentiles=(99.9,))
    assert empty.ttft.percentiles_ms == {"p99.9": None} and "P99.9 TTFT (ms):" in format_summary(empty)
    path = tmp_path / "r.json"
    write_json(BenchResult({}, [RunResult("concurrency=2", {}, s, records)]), str(path))
    assert read_json(str(path)).runs[0].summary == s


def test_a_single_runs_json_carries_vllms_result_keys(tmp_path, records):
    # Scripts written for `vllm bench serve --save-result` files read completed, request_throughput,
    # mean_ttft_ms, p99_e2el_ms, ... at the top level
    result = _result(records, SAMPLES)
    result.config["model"] = "m"
    result.runs[0].summary = summarize("rate=inf", records, {"e2e": 500.0}, percentiles=(99.9,))
    path = tmp_path / "result.json"
    write_json(result, str(path))
    data = json.loads(path.read_text())
    s = result.runs[0].summary
    assert (data["model_id"], data["completed"], data["failed"], data["duration"]) == ("m", 4, 2, s.duration_s)
    assert (data["total_input_tokens"], data["total_output_tokens"]) == (40, 11)
    assert data["request_throughput"] == s.request_throughput and data["request_goodput"] == s.goodput
    assert data["output_throughput"] == s.output_throughput
    assert data["total_token_throughput"] == s.total_token_throughput
    assert data["mean_ttft_ms"] == s.ttft.mean_ms and data["median_tpot_ms"] == s.tpot.median_ms
    assert data["std_itl_ms"] == s.itl.std_ms and data["p99_e2el_ms"] == s.e2e.p99_ms
    assert data["p99.9_ttft_ms"] == s.ttft.percentiles_ms["p99.9"] and data["p90_itl_ms"] == s.itl.p90_ms
    assert read_json(str(path)).runs[0].summary == s
    # a sweep's runs: their own summaries only (vLLM writes a file per run)
    result.runs.append(result.runs[0])
    assert "completed" not in result.to_dict()
