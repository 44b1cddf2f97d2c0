"""The client and load loops against an in-process fake OpenAI server (tests/bench/fake_server.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import numpy as np
import pytest

from bench.fake_server import MODEL, answer_text
from kvserve import envs
from kvserve.bench import runner
from kvserve.bench.client_health import ClientHealthMonitor, ClientHealthReport
from kvserve.bench.config import ABORT_AFTER_ALL_FAILED, ABORT_AFTER_CONNECTION_FAILURES
from kvserve.bench.load import arrival_gaps

STAT_ORDER = ("min_ms", "median_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms")


def assert_consistent(summary, records):
    """Numbers that must agree whatever the timings."""
    assert summary.num_requests == len(records) == summary.completed + summary.failed
    assert sum(summary.errors.values()) == summary.failed
    for r in records:
        if r.success:
            assert 0 < r.ttft_s <= r.e2e_s
            assert all(gap >= 0 for gap in r.itl_s)
    for stats in (summary.ttft, summary.tpot, summary.itl, summary.e2e):
        values = [getattr(stats, name) for name in STAT_ORDER]
        if stats.count:
            assert values == sorted(values), stats
            assert stats.min_ms <= stats.mean_ms <= stats.max_ms
    assert summary.e2e.median_ms >= summary.ttft.median_ms
    assert summary.output_throughput * summary.duration_s == pytest.approx(summary.total_output_tokens)
    assert summary.request_throughput * summary.duration_s == pytest.approx(summary.completed)
    total = summary.total_input_tokens + summary.total_output_tokens
    assert summary.total_token_throughput * summary.duration_s == pytest.approx(total)
    assert summary.duration_s >= max(r.e2e_s for r in records)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_closed_loop_measures_every_request(fake_server, bench, prompts_file, api):
    server = fake_server(itl_s=0.003)
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    result, _ = bench(server.base_url + path, "--concurrency", "4", "--num-prompts", "20", "--max-tokens", "6",
                      "--dataset", "file", "--dataset-path", prompts_file)
    run = result.runs[0]
    s, records = run.summary, run.records
    assert_consistent(s, records)
    assert (s.completed, s.failed) == (20, 0)
    assert sorted(r.index for r in records) == list(range(20))
    # Counts from the server's usage chunk; 6 tokens = 6 text chunks = 5 gaps.
    assert all(r.output_tokens == 6 and r.token_source == "usage" for r in records)
    assert all(len(r.itl_s) == 5 and r.finish_reason == "length" for r in records)
    assert s.total_output_tokens == 120 and s.itl.count == 100 and s.tokens_from_usage == 20
    # The closed loop keeps exactly `concurrency` requests in flight, never more.
    assert server.state.max_in_flight == 4
    body = server.state.bodies[0]
    assert body["model"] == MODEL and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert ("messages" in body) == (api == "chat") and ("prompt" in body) == (api == "completions")
    assert result.config["model"] == MODEL and result.config["api"] == api


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_ttft_and_itl_count_tokens_whose_text_is_still_empty(fake_server, bench, prompts_file, api):
    # Three tokens with no text yet, 0.3 s apart, then three with text: TTFT is the first token's arrival,
    # not the first text's (0.6 s later), and every token after it is one gap. The chat role chunk, sent
    # before any token, is not a token.
    server = fake_server(ttft_s=0.01, itl_s=0.3, empty_text_tokens=3)
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    result, _ = bench(server.base_url + path, "--concurrency", "1", "--num-prompts", "1", "--max-tokens", "6",
                      "--dataset", "file", "--dataset-path", prompts_file)
    (record,) = result.runs[0].records
    assert record.success and record.output_tokens == 6
    assert record.ttft_s < 0.3 <= record.e2e_s - record.ttft_s
    assert len(record.itl_s) == 5 and min(record.itl_s) >= 0.15  # 0.3 s apart, less a client-side stall


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_last_token_without_text_is_a_token(fake_server, bench, prompts_file, api):
    # The EOS that ends an answer is left out of the text; its chunk carries the finish and one more gap.
    server = fake_server(itl_s=0.01, empty_text_last=True)
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    result, _ = bench(server.base_url + path, "--concurrency", "1", "--num-prompts", "2", "--max-tokens", "6",
                      "--dataset", "file", "--dataset-path", prompts_file)
    assert [len(r.itl_s) for r in result.runs[0].records] == [5, 5]


def test_a_chat_finish_on_its_own_is_not_a_token(fake_server, bench, prompts_file):
    server = fake_server(itl_s=0.01, finish_only_chunk=True)
    result, _ = bench(server.base_url + "/v1/chat/completions", "--concurrency", "1", "--num-prompts", "2",
                      "--max-tokens", "6", "--dataset", "file", "--dataset-path", prompts_file)
    records = result.runs[0].records
    assert [len(r.itl_s) for r in records] == [5, 5]
    assert all(r.finish_reason == "length" for r in records)


@pytest.mark.parametrize("fields", [("reasoning",), ("reasoning_content",), ("reasoning", "reasoning_content")])
def test_a_reasoning_models_thinking_is_timed_and_counted(fake_server, bench, prompts_file, tiny_model_dir,
                                                          fields):
    # Two thinking tokens, then two of the answer, 0.3 s apart. Current vLLM streams the thinking as
    # `delta.reasoning`, older vLLM and DeepSeek as `delta.reasoning_content`, vLLM's backward-compatible
    # deltas both: the first thinking token is the first token, and every token is one gap. Without usage,
    # the local tokenizer counts the thinking too, once.
    from transformers import AutoTokenizer

    tokenizer_dir = tiny_model_dir("llama")
    server = fake_server(ttft_s=0.01, itl_s=0.3, reasoning_tokens=2, reasoning_fields=fields, include_usage=False)
    result, _ = bench(server.base_url + "/v1/chat/completions", "--concurrency", "1", "--num-prompts", "1",
                      "--max-tokens", "4", "--dataset", "file", "--dataset-path", prompts_file,
                      "--tokenizer", tokenizer_dir)
    (record,) = result.runs[0].records
    assert record.success and record.token_source == "tokenizer"
    assert record.ttft_s < 0.3 <= record.e2e_s - record.ttft_s
    assert len(record.itl_s) == 3 and min(record.itl_s) >= 0.15  # 0.3 s apart, less a client-side stall
    expected = len(AutoTokenizer.from_pretrained(tokenizer_dir).encode(answer_text(4), add_special_tokens=False))
    assert record.output_tokens == expected


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_events_split_across_reads_and_crlf_lines(fake_server, bench, prompts_file, api):
    server = fake_server(itl_s=0.003, ragged=True)
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    result, _ = bench(server.base_url + path, "--concurrency", "2", "--num-prompts", "4", "--max-tokens", "5",
                      "--dataset", "file", "--dataset-path", prompts_file)
    records = result.runs[0].records
    assert [r.error_kind for r in records] == [None] * 4
    assert all(r.output_tokens == 5 and len(r.itl_s) == 4 and r.finish_reason == "length" for r in records)


def test_duration_bounds_the_issue_window(fake_server, bench, prompts_file):
    server = fake_server(itl_s=0.01)
    result, _ = bench(server.base_url + "/v1/chat/completions", "--concurrency", "2", "--duration", "1.5",
                      "--max-tokens", "5", "--dataset", "file", "--dataset-path", prompts_file)
    records = result.runs[0].records
    assert len(records) >= 4
    # No request is sent after the deadline; those in flight at the deadline are finished and counted.
    assert max(r.start_s for r in records) < 1.5 + 0.5
    assert all(r.success for r in records)


def test_arrival_gaps_have_the_requested_rate_and_burstiness():
    for burstiness in (0.25, 1.0, 4.0):
        gaps_iter = arrival_gaps(10.0, burstiness, np.random.default_rng(0))
        gaps = np.array([next(gaps_iter) for _ in range(40000)])
        assert gaps.mean() == pytest.approx(0.1, rel=0.03)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)
    zero = arrival_gaps(float("inf"), 1.0, np.random.default_rng(0))
    assert [next(zero) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_open_loop_honours_the_request_rate(fake_server, bench, prompts_file):
    server = fake_server(ttft_s=0.002, itl_s=0.001)
    result, _ = bench(server.base_url + "/v1/completions", "--request-rate", "50", "--duration", "2",
                      "--max-tokens", "3", "--dataset", "file", "--dataset-path", prompts_file)
    records = sorted(result.runs[0].records, key=lambda r: r.index)
    assert all(r.success for r in records)
    # A Poisson process of rate 50/s has 100 +- 10 arrivals in 2 s: within 4 sigma.
    assert abs(len(records) - 100) <= 40
    scheduled = np.array([r.scheduled_s for r in records])
    starts = np.array([r.start_s for r in records])
    # Never sent before its arrival time; arrivals in order and inside the window.
    assert np.all(starts >= scheduled) and np.all(np.diff(scheduled) >= 0) and scheduled[-1] < 2.0
    # The requests went out at the schedule's rate (the client kept up with it).
    achieved = (len(records) - 1) / (starts[-1] - starts[0])
    assert achieved == pytest.approx((len(records) - 1) / (scheduled[-1] - scheduled[0]), rel=0.3)
    assert server.state.num_requests == len(records)


def test_max_concurrency_caps_an_open_loop(fake_server, bench, prompts_file):
    server = fake_server(itl_s=0.01)
    result, _ = bench(server.base_url + "/v1/completions", "--request-rate", "inf", "--num-prompts", "12",
                      "--max-concurrency", "3", "--max-tokens", "4", "--dataset", "file",
                      "--dataset-path", prompts_file)
    run = result.runs[0]
    assert run.summary.completed == 12
    assert server.state.max_in_flight == 3
    # Nine arrivals had to wait for one of the three slots; the wait is reported, not hidden in TTFT.
    assert sum(r.queued_s > 0.005 for r in run.records) >= 9
    assert run.summary.queued.count == 12


def test_errors_are_counted_by_kind_not_crashed_on(fake_server, bench, prompts_file):
    # Request k fails with 503 when k % 5 == 0, has its stream cut when k % 7 == 0, an in-stream error
    # when k % 11 == 0 (first rule wins).
    server = fake_server(fail_every=5, fail_status=503, cut_every=7, stream_error_every=11)
    result, _ = bench(server.base_url + "/v1/chat/completions", "--concurrency", "3", "--num-prompts", "40",
                      "--max-tokens", "5", "--dataset", "file", "--dataset-path", prompts_file,
                      "--goodput", "e2e:60000")
    s = result.runs[0].summary
    ks = range(1, 41)
    http = sum(k % 5 == 0 for k in ks)
    cut = sum(k % 5 != 0 and k % 7 == 0 for k in ks)
    in_stream = sum(k % 5 != 0 and k % 7 != 0 and k % 11 == 0 for k in ks)
    assert s.errors == {"http_503": http, "broken_stream": cut, "stream_error": in_stream}
    assert s.num_requests == 40 and s.completed == 40 - http - cut - in_stream
    # Failures stay in the denominators: the success rate and goodput count them as misses.
    assert s.success_rate == pytest.approx(s.completed / 40)
    assert s.good_requests == s.completed
    assert_consistent(s, result.runs[0].records)
    failed = [r for r in result.runs[0].records if not r.success]
    assert all(r.error for r in failed)
    assert {r.status_code for r in failed if r.error_kind == "http_503"} == {503}


def test_invalid_chunks_and_refused_connections_are_counted(fake_server, bench, prompts_file):
    import asyncio

    from kvserve.bench.client import ClientSettings, StreamClient
    from kvserve.bench.datasets import BenchRequest

    server = fake_server(garbage_every=2)
    result, _ = bench(server.base_url + "/v1/completions", "--concurrency", "2", "--num-prompts", "6",
                      "--max-tokens", "4", "--dataset", "file", "--dataset-path", prompts_file)
    assert result.runs[0].summary.errors == {"invalid_response": 3}
    # A server that goes away mid-run: nothing listens any more.
    port = server.port
    server.stop()

    async def send():
        client = StreamClient(ClientSettings(f"http://127.0.0.1:{port}/v1/completions", "completions", MODEL))
        try:
            return await client.send(BenchRequest(0, ({"role": "user", "content": "hi"},), 4), 0.0)
        finally:
            await client.aclose()

    record = asyncio.run(send())
    assert record.error_kind == "connection" and record.status_code is None and not record.success


def _with_client(server, scenario, **settings):
    """Run `scenario(client, request)` with a StreamClient on `server`'s completions endpoint; `request(i)`
    makes the i-th four-token request."""
    from kvserve.bench.client import ClientSettings, StreamClient
    from kvserve.bench.datasets import BenchRequest

    def request(i):
        return BenchRequest(i, ({"role": "user", "content": "hi"},), 4)

    async def run():
        client = StreamClient(ClientSettings(server.base_url + "/v1/completions", "completions", MODEL,
                                             **settings))
        try:
            return await scenario(client, request)
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_the_pool_reuses_at_most_max_connections_and_sends_the_key(fake_server):
    server = fake_server(itl_s=0.001)

    async def scenario(client, request):
        first = [await client.send(request(i), 0.0) for i in range(4)]
        sequential_connections = len(server.state.connections)
        rest = await asyncio.gather(*(client.send(request(i), 0.0) for i in range(4, 12)))
        return first + list(rest), sequential_connections

    records, sequential_connections = _with_client(server, scenario, api_key="sk-test", max_connections=3)
    assert all(r.success and r.output_tokens == 4 for r in records)
    # One after another, the four requests reuse one connection; then eight at once through a pool of three
    # share three.
    assert sequential_connections == 1
    assert len(server.state.connections) <= 3
    assert server.state.max_in_flight <= 3
    assert server.state.authorizations == ["Bearer sk-test"] * 12


def test_a_body_held_open_after_done_does_not_hold_the_request(fake_server):
    server = fake_server(hold_after_done_s=5.0)

    async def scenario(client, request):
        started = time.perf_counter()
        record = await client.send(request(0), 0.0)
        waited = time.perf_counter() - started
        return record, waited, await client.send(request(1), 0.0)

    record, waited, second = _with_client(server, scenario)
    # Complete at [DONE]; the client drops the connection rather than wait for the body's end, so the next
    # request opens a new one.
    assert record.success and record.output_tokens == 4 and record.e2e_s < 2.0
    assert waited < 2.0
    assert second.success and len(server.state.connections) == 2


def test_a_timeout_while_reading_a_finished_bodys_end_keeps_the_answer(fake_server):
    # The answer is complete after about 15 ms; the request timeout (1 s: room for a stalled CI machine) fires
    # while the client reads the end of a body the server holds open for 5 s.
    server = fake_server(hold_after_done_s=5.0)

    async def scenario(client, request):
        return await client.send(request(0), 0.0)

    record = _with_client(server, scenario, request_timeout_s=1.0)
    assert record.success and record.output_tokens == 4 and record.finish_reason == "length"
    assert record.e2e_s < 1.0


def test_missing_done_and_finish_reason_is_a_broken_stream(fake_server, bench, prompts_file):
    # Cut after the last token chunk was sent but before any finish: every request is broken.
    server = fake_server(cut_every=1, cut_after_tokens=3)
    result, _ = bench(server.base_url + "/v1/completions", "--concurrency", "2", "--num-prompts", "4",
                      "--max-tokens", "10", "--dataset", "file", "--dataset-path", prompts_file)
    s = result.runs[0].summary
    assert s.errors == {"broken_stream": 4} and s.completed == 0


def test_timeouts_are_counted(fake_server, bench, prompts_file):
    server = fake_server(ttft_s=5.0)
    result, _ = bench(server.base_url + "/v1/completions", "--concurrency", "2", "--num-prompts", "2",
                      "--max-tokens", "3", "--request-timeout", "0.3", "--dataset", "file",
                      "--dataset-path", prompts_file)
    records = result.runs[0].records
    assert [r.error_kind for r in records] == ["timeout", "timeout"]
    assert all(r.e2e_s < 5.0 for r in records)


def test_a_server_that_fails_everything_stops_the_run_early(fake_server, bench, prompts_file):
    server = fake_server(fail_every=1)
    result, _ = bench(server.base_url + "/v1/completions", "--concurrency", "4", "--duration", "60",
                      "--max-tokens", "3", "--dataset", "file", "--dataset-path", prompts_file)
    s = result.runs[0].summary
    assert s.completed == 0 and s.errors == {"http_500": s.num_requests}
    assert ABORT_AFTER_ALL_FAILED <= s.num_requests < ABORT_AFTER_ALL_FAILED + 4
    assert s.stopped and "all failed" in s.stopped


def test_a_server_that_goes_away_mid_run_stops_the_run(fake_server, bench, prompts_file):
    """Refused connections after some successes: the closed loop resent at once after each (8,274 failed
    requests in 5 s in a user's run); now the run stops issuing after ABORT_AFTER_CONNECTION_FAILURES in a
    row, saying why, and reports what it measured."""
    import time

    server = fake_server(exit_after=6)
    start = time.perf_counter()
    result, _ = bench(server.base_url + "/v1/completions", "--concurrency", "2", "--duration", "60",
                      "--max-tokens", "3", "--dataset", "file", "--dataset-path", prompts_file)
    s = result.runs[0].summary
    assert time.perf_counter() - start < 50
    assert s.completed >= 5 and s.errors.get("connection", 0) >= ABORT_AFTER_CONNECTION_FAILURES
    assert s.num_requests < s.completed + ABORT_AFTER_CONNECTION_FAILURES + 10
    assert s.stopped and f"{ABORT_AFTER_CONNECTION_FAILURES} requests in a row could not connect" in s.stopped


def test_a_request_sent_before_the_server_went_away_does_not_break_the_refused_streak():
    """CI saw 63 refused connections before the stop, not 50: a request sent before the server went away
    finished after 13 refused ones and reset the count. Only a request sent after the latest refused one
    says the server is back."""
    from kvserve.bench.client import ERROR_CONNECTION, RequestRecord
    from kvserve.bench.config import LoadShape
    from kvserve.bench.load import _Run

    def record(index: int, start_s: float, refused: bool) -> RequestRecord:
        r = RequestRecord(index, 3)
        r.start_s = start_s
        if refused:
            r.fail(ERROR_CONNECTION, "refused")
        return r

    run = _Run(LoadShape(concurrency=2, num_prompts=1000), 0.0, None)
    for i in range(13):
        run.finished(record(i, 1.0 + i, refused=True))
    run.finished(record(13, 0.5, refused=False))  # sent at 0.5 s, before the first refusal
    assert run.unconnected_in_row == 13 and not run.stopped
    for i in range(ABORT_AFTER_CONNECTION_FAILURES - 13):
        run.finished(record(14 + i, 20.0 + i, refused=True))
    assert run.stopped and f"{ABORT_AFTER_CONNECTION_FAILURES} requests in a row" in run.stopped

    later = _Run(LoadShape(concurrency=2, num_prompts=1000), 0.0, None)
    for i in range(10):
        later.finished(record(i, 1.0 + i, refused=True))
    later.finished(record(10, 10.5, refused=False))  # sent after the latest refusal: the server is back
    assert later.unconnected_in_row == 0


def test_without_usage_tokens_are_counted_with_the_local_tokenizer(fake_server, bench, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer_dir = tiny_model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    server = fake_server(include_usage=False, send_done=False)
    result, _ = bench(server.base_url + "/v1/chat/completions", "--concurrency", "2", "--num-prompts", "4",
                      "--max-tokens", "9", "--input-len", "40", "--language", "en", "--tokenizer", tokenizer_dir)
    run = result.runs[0]
    expected = len(tokenizer.encode(answer_text(9), add_special_tokens=False))
    assert run.summary.completed == 4 and run.summary.tokens_from_tokenizer == 4
    for r in run.records:
        assert r.token_source == "tokenizer" and r.output_tokens == expected
        # The prompt is counted through the chat template: more than the 40 tokens of text.
        assert r.prompt_tokens > 40
    assert run.summary.total_output_tokens == 4 * expected
    # Generated prompts open with the request's reference line; the run nonce is recorded in the JSON config.
    nonce = result.config["dataset"]["run_nonce"]
    assert len(nonce) == 8
    users = sorted(body["messages"][-1]["content"] for body in server.state.bodies)
    assert [u.split(".")[0] for u in users] == [f"Ref {i}-{nonce}" for i in range(4)]


def test_server_metrics_are_sampled(fake_server, bench, prompts_file):
    server = fake_server(itl_s=0.02)
    result, _ = bench(server.base_url + "/v1/chat/completions", "--concurrency", "3", "--num-prompts", "9",
                      "--max-tokens", "10", "--metrics-interval", "0.05", "--dataset", "file",
                      "--dataset-path", prompts_file)
    run = result.runs[0]
    assert len(run.server_samples) >= 3
    assert 1 <= run.summary.server["max_running"] <= 3
    # The fake reports half of the prompt tokens queried during the run as hits.
    assert run.summary.server["prefix_hit_rate"] == pytest.approx(0.5)
    # And the usage's cached_tokens reach the summary.
    assert run.summary.cached_input_tokens == sum(r.cached_tokens for r in run.records)


def test_a_slow_first_metrics_scrape_does_not_delay_the_arrivals(fake_server, bench, prompts_file):
    # The baseline scrape takes 1 s. Counted inside the run, it held back the first second's Poisson
    # arrivals, which then went out together about 1 s late, and it shortened the --duration window.
    server = fake_server(ttft_s=0.002, itl_s=0.001, metrics_delay_s=1.0)
    result, _ = bench(server.base_url + "/v1/completions", "--request-rate", "20", "--duration", "2",
                      "--max-tokens", "2", "--dataset", "file", "--dataset-path", prompts_file)
    run = result.runs[0]
    # A Poisson process of rate 20/s has 40 +- 6 arrivals in 2 s.
    assert len(run.records) >= 10 and all(r.success for r in run.records)
    # Each arrival went out at its time (0.5 s: room for a stalled CI machine, half the scrape's delay).
    assert max(r.queued_s for r in run.records) < 0.5
    # The baseline is still the counters before the run: taken before its clock started, nothing sent yet.
    baseline = run.server_samples[0]
    assert baseline.t_s <= 0.0 and baseline.running == 0 and baseline.prefix_queries == 0
    assert len(run.server_samples) >= 2 and run.summary.server["prefix_hit_rate"] == pytest.approx(0.5)


def test_no_server_metrics_when_the_server_has_none(fake_server, bench, prompts_file):
    server = fake_server()
    result, _ = bench(server.base_url + "/v1/completions", "--concurrency", "1", "--num-prompts", "2",
                      "--max-tokens", "2", "--metrics-url", server.base_url + "/nothing-here",
                      "--dataset", "file", "--dataset-path", prompts_file)
    run = result.runs[0]
    assert run.summary.completed == 2
    assert run.server_samples == [] and run.summary.server is None


def test_warmup_requests_are_not_counted(fake_server, bench, prompts_file):
    server = fake_server()
    result, _ = bench(server.base_url + "/v1/completions", "--concurrency", "2", "--num-prompts", "5",
                      "--warmup", "3", "--max-tokens", "2", "--dataset", "file", "--dataset-path", prompts_file)
    assert server.state.num_requests == 8
    assert result.runs[0].summary.num_requests == 5


def test_sweep_runs_one_point_per_value(fake_server, bench, prompts_file):
    server = fake_server(itl_s=0.005)
    result, _ = bench(server.base_url + "/v1/completions", "--sweep-concurrency", "1,3", "--num-prompts", "6",
                      "--max-tokens", "4", "--dataset", "file", "--dataset-path", prompts_file)
    assert [run.label for run in result.runs] == ["concurrency=1", "concurrency=3"]
    assert [run.summary.completed for run in result.runs] == [6, 6]
    assert server.state.max_in_flight == 3


def test_a_sweeps_points_do_not_resend_each_others_prompts(fake_server, bench, tiny_model_dir):
    # The same prompts in every point let a prefix-caching server answer most of a later point's prompt
    # tokens from its cache (81-83 % in a 50,50 sweep on the H200).
    server = fake_server()
    result, _ = bench(server.base_url + "/v1/chat/completions", "--sweep-concurrency", "1,2", "--num-prompts", "3",
                      "--warmup", "2", "--max-tokens", "2", "--input-len", "40", "--language", "en",
                      "--tokenizer", tiny_model_dir("llama"))
    assert [run.summary.completed for run in result.runs] == [3, 3]
    users = [body["messages"][-1]["content"] for body in server.state.bodies]
    assert len(users) == 8 and len(set(users)) == 8
    nonce = result.config["dataset"]["run_nonce"]
    assert sorted(u.split(".")[0] for u in users[2:]) == sorted(
        [f"Ref {i}-{nonce}" for i in range(3)] + [f"Ref 1:{i}-{nonce}" for i in range(3)])


def test_drain_timeout_cancels_requests_still_running(fake_server, bench, prompts_file):
    # Each answer would take 40 x 0.25 s = 10 s; the run issues for 0.5 s and drains for 0.5 s more.
    server = fake_server(itl_s=0.25)
    result, _ = bench(server.base_url + "/v1/completions", "--concurrency", "2", "--duration", "0.5",
                      "--drain-timeout", "0.5", "--max-tokens", "40", "--dataset", "file",
                      "--dataset-path", prompts_file)
    s = result.runs[0].summary
    # Both requests are recorded (not dropped) as cancelled, and the run ended at the drain deadline.
    assert s.num_requests == 2 and s.errors == {"cancelled": 2}
    assert all(r.e2e_s < 5.0 for r in result.runs[0].records)
    assert "--drain-timeout" in s.stopped


@pytest.mark.parametrize("shape", ["closed", "open"])
def test_stop_cancels_and_records_everything_in_flight(fake_server, prompts_file, shape):
    import asyncio

    from kvserve.bench.client import ClientSettings, StreamClient
    from kvserve.bench.config import LoadShape
    from kvserve.bench.datasets import DatasetConfig, FileDataset
    from kvserve.bench.load import run_load

    server = fake_server(itl_s=0.25)
    dataset = FileDataset(DatasetConfig(name="file", path=prompts_file, output_len=40))
    load = (LoadShape(concurrency=2, num_prompts=6) if shape == "closed"
            else LoadShape(request_rate=float("inf"), max_concurrency=2, num_prompts=6))

    async def scenario():
        client = StreamClient(ClientSettings(server.base_url + "/v1/completions", "completions", MODEL))
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        try:
            return await run_load(load, dataset, client, stop=stop)
        finally:
            await client.aclose()

    result = asyncio.run(scenario())
    kinds = [r.error_kind for r in result.records]
    assert kinds == ["cancelled"] * len(kinds) and result.stopped.startswith("interrupted")
    # Closed loop: the two in flight. Open loop: all six arrived at once; two were sent, four waited.
    assert len(kinds) == (2 if shape == "closed" else 6)
    assert server.state.num_requests == 2
    if shape == "open":
        # The four that waited for a slot until the stop waited that long (recorded as 0, the queueing
        # statistics hid an overloaded run's longest waits)
        unsent = [r for r in result.records if r.status_code is None]
        assert len(unsent) == 4
        assert all(r.queued_s > 0 and r.queued_s == pytest.approx(r.start_s - r.scheduled_s) for r in unsent)


def test_arrivals_cancelled_before_their_task_runs_are_recorded(fake_server, prompts_file):
    from kvserve.bench.client import ClientSettings, StreamClient
    from kvserve.bench.config import LoadShape
    from kvserve.bench.datasets import DatasetConfig, FileDataset
    from kvserve.bench.load import run_load

    # A stop that comes as a burst of arrivals is spawned (here: set before the run, so every arrival's task
    # is cancelled before it first runs). Each arrival counted is recorded, cancelled and never sent; they
    # used to be dropped.
    server = fake_server()
    dataset = FileDataset(DatasetConfig(name="file", path=prompts_file, output_len=4))

    async def scenario():
        client = StreamClient(ClientSettings(server.base_url + "/v1/completions", "completions", MODEL))
        stop = asyncio.Event()
        stop.set()
        try:
            return await run_load(LoadShape(request_rate=float("inf"), num_prompts=5), dataset, client, stop=stop)
        finally:
            await client.aclose()

    result = asyncio.run(scenario())
    assert sorted(r.index for r in result.records) == [0, 1, 2, 3, 4]
    assert all(r.error_kind == "cancelled" and r.scheduled_s == 0.0 for r in result.records)
    assert result.stopped.startswith("interrupted") and server.state.num_requests == 0


def test_each_run_measures_with_the_client_heap_frozen(fake_server, bench, prompts_file, monkeypatch):
    # A full collection walking the client's start-up objects (tokenizer, torch) stopped its event loop for
    # 190-265 ms on the H200 host, which the run reported as the server's inter-token gaps.
    gc.unfreeze()
    monkeypatch.setattr(envs, "KVSERVE_GC_FREEZE", True)
    seen: list[int] = []
    real_run_load = runner.run_load

    async def run_load(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return await real_run_load(*args, **kwargs)

    monkeypatch.setattr(runner, "run_load", run_load)
    server = fake_server()
    result, _ = bench(server.base_url + "/v1/completions", "--sweep-concurrency", "1,2", "--num-prompts", "3",
                      "--warmup", "1", "--max-tokens", "2", "--dataset", "file", "--dataset-path", prompts_file)
    assert [run.summary.completed for run in result.runs] == [3, 3]
    assert seen[0] == 0  # the warm-up is not measured
    assert len(seen) == 3 and all(count > 0 for count in seen[1:])
    assert gc.get_freeze_count() == 0  # thawed after each run


def test_the_client_health_monitor_times_collections_during_the_run_only():
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    async def run() -> tuple[ClientHealthMonitor, ClientHealthReport]:
        monitor = ClientHealthMonitor()
        monitor.start()
        monitor.collections._on_gc("stop", {"generation": 0, "collected": 0})  # the end of one under way at start()
        junk = [Cycle() for _ in range(20_000)]
        del junk
        gc.collect()
        return monitor, await monitor.stop()

    callbacks = len(gc.callbacks)
    monitor, report = asyncio.run(run())
    timed = len(monitor.collections.collections)
    assert report.gc_collections == timed >= 1 and 0.0 < report.gc_pause_max_ms < 60_000
    gc.collect()  # after stop(): not timed
    assert len(monitor.collections.collections) == timed and len(gc.callbacks) == callbacks
    # A JSON written before the collector fields were added still reads.
    old = {"cpu_percent": 1.0, "loop_lag_p50_ms": 0.1, "loop_lag_p99_ms": 0.2, "loop_lag_max_ms": 0.3}
    assert ClientHealthReport.from_dict(old).gc_collections == 0
    assert ClientHealthReport.from_dict(report.to_dict()) == report


def test_the_client_health_monitor_lists_long_stalls_on_the_run_clock():
    async def run() -> ClientHealthReport:
        run_start = time.perf_counter() - 1.0  # the run began a second ago
        monitor = ClientHealthMonitor()
        monitor.start(run_start)
        await asyncio.sleep(0.06)  # let the lag timer tick once
        monitor.collections._on_gc("start", {"generation": 2})
        time.sleep(0.02)  # a 20-ms collection
        monitor.collections._on_gc("stop", {"generation": 2, "collected": 0})
        time.sleep(0.15)  # the loop blocked: the timer fires at least 0.1 s late
        await asyncio.sleep(0.06)
        return await monitor.stop()

    enabled = gc.isenabled()
    gc.disable()  # an automatic full collection of the suite's heap would be a second long pause
    try:
        report = asyncio.run(run())
    finally:
        if enabled:
            gc.enable()
    (gc_start, gc_ms), = report.long_gc_pauses
    assert 1.0 < gc_start < 1.5 and gc_ms >= 20.0
    assert any(lag_ms >= 100.0 and 1.0 < start < 1.6 for start, lag_ms in report.long_loop_lags)
    assert ClientHealthReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_streamed_tool_call_chunks_are_tokens() -> None:
    """A tool call streams its name and arguments in `delta.tool_calls` (no content): those chunks are
    generated tokens, timed and, without usage, counted from their text."""
    from kvserve.bench.client import _carries_token, _choice_text

    opened = {"delta": {"tool_calls": [{"index": 0, "id": "call-1", "type": "function",
                                        "function": {"name": "get_time", "arguments": ""}}]}}
    piece = {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone": '}}]}}
    assert _carries_token(opened, "chat") and _carries_token(piece, "chat")
    assert _choice_text(opened, "chat") + _choice_text(piece, "chat") == 'get_time{"zone": '
    for not_a_token in ({"delta": {"role": "assistant", "content": ""}}, {"delta": {}, "finish_reason": "stop"},
                        {"delta": {"tool_calls": []}}, {"delta": {"tool_calls": "x"}}):
        assert not _carries_token(not_a_token, "chat") and _choice_text(not_a_token, "chat") == ""


@pytest.mark.parametrize("content_type", ["text/plain", "application/octet-stream"])
def test_an_event_stream_sent_under_another_type_is_read_as_one(fake_server, bench, prompts_file, content_type):
    # A proxy that sends the stream as text/plain: every request failed as invalid_response (the whole body
    # read as one JSON answer), where vLLM's client reads any body as SSE lines
    server = fake_server(content_type=content_type)
    result, _ = bench(server.base_url + "/v1/completions", "--num-prompts", "3", "--max-tokens", "4",
                      "--dataset", "file", "--dataset-path", prompts_file)
    records = result.runs[0].records
    assert result.runs[0].summary.errors == {}
    assert all(r.output_tokens == 4 and len(r.itl_s) == 3 and r.finish_reason == "length" for r in records)


def test_a_whole_json_answer_is_read_whatever_its_type():
    """A server that ignores `stream` answers with one JSON body: read at once under application/json, and
    under another type when the body is a JSON object."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvserve.bench.client import ClientSettings, StreamClient
    from kvserve.bench.datasets import BenchRequest

    answer = json.dumps({"choices": [{"index": 0, "text": " hi there", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", self.path.rsplit("/", 1)[-1].replace("_", "/"))
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def send(content_type: str):
        client = StreamClient(ClientSettings(f"http://127.0.0.1:{httpd.server_port}/v1/completions/"
                                             f"{content_type.replace('/', '_')}", "completions", MODEL))
        try:
            return await client.send(BenchRequest(0, ({"role": "user", "content": "x"},), 2), time.perf_counter())
        finally:
            await client.aclose()

    try:
        for content_type in ("application/json", "text/plain"):
            record = asyncio.run(send(content_type))
            assert record.success and record.output_tokens == 2 and record.output_text == " hi there", content_type
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_responses_api_events_make_the_record():
    """The Responses API's events: text, reasoning and arguments deltas are timed tokens, response.completed /
    response.incomplete carries the counts and the end (no [DONE]); `error` and response.failed fail the request;
    a server that does not stream sends the whole response, read at once."""
    from kvserve.bench.client import ERROR_STREAM_ERROR, RequestRecord, _StreamState

    record = RequestRecord(0, 8, 4)
    state = _StreamState(record, time.perf_counter())
    for kind in ("response.reasoning_text.delta", "response.output_text.delta", "response.output_text.delta"):
        assert state.on_payload({"type": kind, "delta": "ab"}, "responses") and not state.completed
    assert state.on_payload({"type": "response.content_part.done", "part": {}}, "responses")
    final = {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
             "usage": {"input_tokens": 5, "output_tokens": 8, "input_tokens_details": {"cached_tokens": 2}}}
    assert state.on_payload({"type": "response.incomplete", "response": final}, "responses") and state.completed
    state.finish(done=True)
    assert (record.prompt_tokens, record.output_tokens, record.cached_tokens) == (5, 8, 2)
    assert record.finish_reason == "length" and record.token_source == "usage" and len(record.itl_s) == 2
    assert record.output_text == "ababab" and record.error_kind is None

    for event in ({"type": "error", "message": "grammar failed"},
                  {"type": "response.failed", "response": {"error": {"message": "grammar failed"}}}):
        failed = RequestRecord(1, 8, 4)
        assert not _StreamState(failed, time.perf_counter()).on_payload(event, "responses")
        assert failed.error_kind == ERROR_STREAM_ERROR and failed.error == "grammar failed"

    whole = RequestRecord(2, 8, 4)
    state = _StreamState(whole, time.perf_counter())
    response = {"object": "response", "status": "completed", "output": [
        {"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
        {"type": "function_call", "name": "f", "arguments": "{}"}], "usage": {"input_tokens": 3, "output_tokens": 4}}
    assert state.on_payload(response, "responses") and state.completed
    state.finish(done=True)
    assert whole.output_text == "hif{}" and whole.finish_reason == "stop" and whole.output_tokens == 4
