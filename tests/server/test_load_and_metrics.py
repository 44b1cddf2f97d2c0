"""Concurrency, client disconnects and /metrics against the shared tiny server.

Metrics are cumulative over the session's server, so each test compares before/after scrapes.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx

from .conftest import TINY_NAME, ServerProcess, metric, scrape, wait_for

REQUIRED_SERIES = [
    "kvserve:num_requests_running",
    "kvserve:num_requests_waiting",
    "kvserve:kv_cache_usage_perc",
    "kvserve:prefix_cache_queries_total",
    "kvserve:prefix_cache_hits_total",
    "kvserve:num_preemptions_total",
    "kvserve:prompt_tokens_total",
    "kvserve:generation_tokens_total",
    "kvserve:time_to_first_token_seconds_count",
    "kvserve:inter_token_latency_seconds_count",
    "kvserve:e2e_request_latency_seconds_count",
    "kvserve:request_queue_time_seconds_count",
    "kvserve:request_prompt_tokens_count",
    "kvserve:request_generation_tokens_count",
]


def _idle(server: ServerProcess) -> bool:
    samples = scrape(server.base_url)
    return (metric(samples, "kvserve:num_requests_running") == 0
            and metric(samples, "kvserve:num_requests_waiting") == 0
            and metric(samples, "kvserve:kv_cache_usage_perc") == 0)


def test_64_concurrent_streams_complete_and_engine_returns_to_idle(tiny_server: ServerProcess):
    before = scrape(tiny_server.base_url)
    num_requests, max_tokens = 64, 6

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str | None, int, bool]:
        body = {"model": TINY_NAME, "prompt": f"Request number {i}:", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.7, "seed": i}
        finish, num_chunks, done = None, 0, False
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                choice = json.loads(line[6:])["choices"][0]
                num_chunks += 1
                finish = choice["finish_reason"] or finish
        return finish, num_chunks, done

    async def run_all() -> list[tuple[str | None, int, bool]]:
        limits = httpx.Limits(max_connections=num_requests)
        async with httpx.AsyncClient(base_url=tiny_server.base_url, limits=limits, timeout=180) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(num_requests))), 300)

    results = asyncio.run(run_all())
    assert all(done for _, _, done in results)
    assert [finish for finish, _, _ in results] == ["length"] * num_requests
    assert all(1 <= chunks <= max_tokens for _, chunks, _ in results)
    wait_for(lambda: _idle(tiny_server), 30, "zero running requests and zero used KV blocks")
    after = scrape(tiny_server.base_url)
    key = "kvserve:request_success_total"
    assert metric(after, key, finished_reason="length") - metric(before, key, finished_reason="length") == 64
    generated = metric(after, "kvserve:generation_tokens_total") - metric(before, "kvserve:generation_tokens_total")
    assert generated == num_requests * max_tokens


def test_client_disconnect_aborts_the_request(tiny_server: ServerProcess):
    url = tiny_server.base_url
    before = scrape(url)
    body = {"model": TINY_NAME, "prompt": "A very long story:", "max_tokens": 240, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 3:
                        break
            # While it streams, the gauges show one running request holding KV blocks.
            during = scrape(url)
            assert metric(during, "kvserve:num_requests_running") == 1
            assert metric(during, "kvserve:kv_cache_usage_perc") > 0
        # Leaving the block closes the connection mid-stream.
    key = "kvserve:request_success_total"
    wait_for(lambda: metric(scrape(url), key, finished_reason="abort")
             == metric(before, key, finished_reason="abort") + 1, 30, "the abort to be counted")
    wait_for(lambda: _idle(tiny_server), 30, "the aborted request's blocks to be freed")
    after = scrape(url)
    generated = metric(after, "kvserve:generation_tokens_total") - metric(before, "kvserve:generation_tokens_total")
    assert 3 <= generated < 240, "generation went on after the client left"
    assert metric(after, key, finished_reason="length") == metric(before, key, finished_reason="length")


def test_non_streaming_client_disconnect_aborts_too(tiny_server: ServerProcess):
    url = tiny_server.base_url
    before = scrape(url)
    body = json.dumps({"model": TINY_NAME, "prompt": "Another long story:", "max_tokens": 240,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: metric(scrape(url), "kvserve:num_requests_running") == 1, 30, "the request to run")
    # The socket is closed before any response byte was read.
    key = "kvserve:request_success_total"
    wait_for(lambda: metric(scrape(url), key, finished_reason="abort")
             == metric(before, key, finished_reason="abort") + 1, 30, "the abort to be counted")
    wait_for(lambda: _idle(tiny_server), 30, "the aborted request's blocks to be freed")
    after = scrape(url)
    assert metric(after, key, finished_reason="length") == metric(before, key, finished_reason="length")


def test_metrics_present_labelled_and_moving(tiny_server: ServerProcess, tiny_tokenizer):
    url = tiny_server.base_url
    # A prompt of 3 full blocks (block size 16) so that a repeat hits the prefix cache.
    prompt_ids = tiny_tokenizer("the " * 60, add_special_tokens=False)["input_ids"][:48]
    assert len(prompt_ids) == 48
    before = scrape(url)
    for name in REQUIRED_SERIES:
        metric(before, name)  # present, with model_name="tiny"
    for reason in ("stop", "length", "abort"):
        metric(before, "kvserve:request_success_total", finished_reason=reason)
    assert all(dict(labels).get("model_name") == TINY_NAME
               for name, labels in before if name.startswith("kvserve:") and "cache_config" not in name)

    for _ in range(2):
        response = httpx.post(url + "/v1/completions", json={"prompt": prompt_ids, "max_tokens": 5,
                                                             "ignore_eos": True, "temperature": 0}, timeout=60)
        assert response.status_code == 200
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("kvserve:prompt_tokens_total") == 2 * 48
    assert delta("kvserve:generation_tokens_total") == 2 * 5
    assert delta("kvserve:request_success_total", finished_reason="length") == 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"kvserve:{name}_count") == 2, name
    assert delta("kvserve:inter_token_latency_seconds_count") == 2 * 4
    assert delta("kvserve:request_params_n_count") == 2 and delta("kvserve:request_params_n_sum") == 2
    assert delta("kvserve:request_max_num_generation_tokens_sum") == 2 * 5
    assert delta("kvserve:request_prompt_tokens_sum") == 2 * 48
    assert delta("kvserve:prefix_cache_queries_total") >= 2 * 48 - 1
    # The second request finds the first one's full blocks (its last token is recomputed).
    assert delta("kvserve:prefix_cache_hits_total") >= 32
    # Latency histograms have buckets down to 1 ms.
    assert ("kvserve:time_to_first_token_seconds_bucket",
            tuple(sorted({"model_name": TINY_NAME, "le": "0.001"}.items()))) in after
    assert ("kvserve:inter_token_latency_seconds_bucket",
            tuple(sorted({"model_name": TINY_NAME, "le": "0.001"}.items()))) in after


def test_vllm_compat_series_mirror_ours(tiny_server: ServerProcess):
    samples = scrape(tiny_server.base_url)
    for name in REQUIRED_SERIES:
        vllm_name = "vllm:" + name.split(":", 1)[1]
        assert metric(samples, vllm_name) == metric(samples, name), vllm_name
    assert metric(samples, "vllm:gpu_cache_usage_perc") == metric(samples, "kvserve:kv_cache_usage_perc")
    assert metric(samples, "vllm:time_per_output_token_seconds_count") == metric(
        samples, "kvserve:inter_token_latency_seconds_count")
    for reason in ("stop", "length", "abort"):
        assert metric(samples, "vllm:request_success_total", finished_reason=reason) == metric(
            samples, "kvserve:request_success_total", finished_reason=reason)
