"""`kvserve bench` against a real `kvserve serve` on loopback (tiny random Llama, CPU), bounded in time.

The server's own counters are the oracle for what the client reports: the tokens it generated and the
requests it finished between two scrapes must equal the bench's totals.
"""

from __future__ import annotations

import json

import pytest

from bench.conftest import TINY_SERVED_NAME, scrape_counter
from kvserve.entrypoints.cli import main

STAT_ORDER = ("min_ms", "median_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms")
# The seeds' command runs for --duration seconds; a few are enough for a closed loop of 4 on the tiny model to
# finish many requests (each takes well under a second), and the window's bound is the same at any length.
SEEDS_DURATION_S = 4

pytestmark = pytest.mark.slow


def _served(base_url: str) -> tuple[float, float]:
    return (scrape_counter(base_url, "kvserve:generation_tokens_total"),
            scrape_counter(base_url, "kvserve:request_success_total"))


def test_seeds_command_shape(kvserve_server, tmp_path, capsys):
    json_path, plot_path = tmp_path / "seeds.json", tmp_path / "seeds.png"
    tokens_before, finished_before = _served(kvserve_server)
    # The seeds' command with the test's sizes; everything else (dataset, tokenizer) at its default.
    rc = main(["bench", "--endpoint", f"{kvserve_server}/v1/chat/completions", "--model", TINY_SERVED_NAME,
               "--concurrency", "4", "--duration", str(SEEDS_DURATION_S), "--max-tokens", "16",
               "--json", str(json_path), "--plot", str(plot_path), "--metrics-interval", "0.5", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for line in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                 "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Total token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                 "Mean TPOT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "P99 ITL (ms):", "Mean E2E Latency (ms):",
                 "P99 E2E Latency (ms):", "Max running requests:", "Client CPU (% of one core):"):
        assert line in out, line

    data = json.loads(json_path.read_text())
    (run,) = data["runs"]
    s, records = run["summary"], run["records"]
    assert s["failed"] == 0 and s["completed"] == len(records) >= 4
    for r in records:
        assert r["token_source"] == "usage" and 1 <= r["output_tokens"] <= 16
        assert r["prompt_tokens"] >= 256  # 256 tokens of text plus the chat template
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        # No request is sent after the --duration window.
        assert r["start_s"] < SEEDS_DURATION_S + 0.5
    for key in ("ttft", "tpot", "itl", "e2e"):
        values = [s[key][name] for name in STAT_ORDER]
        assert values == sorted(values), (key, values)
    assert s["e2e"]["median_ms"] >= s["ttft"]["median_ms"]
    assert s["output_throughput"] * s["duration_s"] == pytest.approx(s["total_output_tokens"])
    assert s["request_throughput"] * s["duration_s"] == pytest.approx(s["completed"])
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in records)
    # The server agrees: it generated exactly the tokens the client counted, for as many requests.
    tokens_after, finished_after = _served(kvserve_server)
    assert tokens_after - tokens_before == s["total_output_tokens"]
    assert finished_after - finished_before == s["completed"]
    # Server metrics were sampled: the closed loop never had more than 4 requests running.
    assert run["server_samples"] and 1 <= s["server"]["max_running"] <= 4
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_completions_open_loop_chinese(kvserve_server, kvserve_model_dir, bench):
    result, _ = bench(f"{kvserve_server}/v1/completions", "--request-rate", "8", "--num-prompts", "6",
                      "--max-tokens", "8", "--ignore-eos", "--input-len", "48", "--language", "zh",
                      "--tokenizer", kvserve_model_dir)
    run = result.runs[0]
    assert result.config["api"] == "completions" and result.config["model"] == TINY_SERVED_NAME
    assert run.summary.completed == 6
    # ignore_eos: every request generates exactly max_tokens.
    assert all(r.output_tokens == 8 for r in run.records)
    # The prompt is the 48 tokens the dataset cut (a BOS may be added by the server).
    assert all(47 <= r.prompt_tokens <= 52 for r in run.records)


def test_the_responses_api_is_measured_as_chat_is(kvserve_server, kvserve_model_dir, bench):
    """--endpoint .../v1/responses: the messages go as input items, the events' text deltas are the tokens'
    times, and response.completed's usage the counts; the server's counters agree."""
    tokens_before, finished_before = _served(kvserve_server)
    result, _ = bench(f"{kvserve_server}/v1/responses", "--num-prompts", "4", "--concurrency", "2",
                      "--max-tokens", "8", "--ignore-eos", "--input-len", "32", "--language", "en",
                      "--tokenizer", kvserve_model_dir)
    run = result.runs[0]
    assert result.config["api"] == "responses" and run.summary.completed == 4, run.summary.errors
    for r in run.records:
        assert r.token_source == "usage" and r.output_tokens == 8 and r.finish_reason == "length"
        assert r.prompt_tokens >= 32 and 0 < r.ttft_s <= r.e2e_s and r.itl_s  # a time per text delta
    tokens_after, finished_after = _served(kvserve_server)
    assert tokens_after - tokens_before == 32 and finished_after - finished_before == 4


def test_shared_prefix_hits_the_prefix_cache(kvserve_server, kvserve_model_dir, bench):
    result, _ = bench(f"{kvserve_server}/v1/chat/completions", "--dataset", "shared-prefix", "--prefix-len", "128",
                      "--input-len", "24", "--num-prompts", "5", "--concurrency", "1", "--max-tokens", "2",
                      "--language", "en", "--tokenizer", kvserve_model_dir, "--metrics-interval", "0.2")
    run = result.runs[0]
    assert run.summary.completed == 5
    records = sorted(run.records, key=lambda r: r.index)
    # After the first request, the chat template and the 128-token system prompt come from the cache
    # (whole 16-token blocks: at least 128 tokens).
    assert all(r.cached_tokens >= 128 for r in records[1:])
    assert run.summary.server["prefix_hit_rate"] > 0


def test_requests_the_server_refuses_are_counted(kvserve_server, kvserve_model_dir, bench):
    # 600-token prompts do not fit --max-model-len 512: the server answers 400, the bench reports it.
    result, _ = bench(f"{kvserve_server}/v1/completions", "--num-prompts", "3", "--concurrency", "3",
                      "--input-len", "600", "--max-tokens", "4", "--language", "en",
                      "--tokenizer", kvserve_model_dir)
    s = result.runs[0].summary
    assert s.completed == 0 and s.errors == {"http_400": 3}
