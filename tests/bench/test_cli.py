"""`kvserve bench` flags and the command end to end (in-process, against the fake server)."""

from __future__ import annotations

import io
import json
import math
import os
import re

import httpx
import pytest

from bench.conftest import parse_bench
from bench.fake_server import MODEL, FakeBehavior, FakeOpenAIServer
from kvserve.bench import client_health, runner
from kvserve.bench.cli_args import config_from_args
from kvserve.bench.config import BenchConfig, BenchConfigError
from kvserve.bench.runner import run_benchmark
from kvserve.entrypoints.cli import build_parser, main

SEEDS_ENDPOINT = "http://localhost:8000/v1/chat/completions"


def test_the_seeds_command_parses_as_written():
    config = parse_bench(SEEDS_ENDPOINT, "--model", "qwen2-7b", "--concurrency", "50", "--duration", "30",
                         "--max-tokens", "256")
    (shape,) = config.shapes
    assert shape.closed_loop and shape.concurrency == 50 and shape.duration_s == 30 and shape.num_prompts is None
    assert config.model == "qwen2-7b" and config.resolved_api == "chat"
    assert config.dataset.output_len == 256 and config.dataset.name == "random"
    assert config.api_base == "http://localhost:8000/v1"
    assert config.resolved_metrics_url == "http://localhost:8000/metrics"
    # The pool holds one connection per concurrent request.
    assert config.pool_size() == 50


def test_open_loop_and_sweep_flags():
    config = parse_bench("http://127.0.0.1:1/v1/completions", "--request-rate", "4", "--burstiness", "0.5",
                         "--max-concurrency", "16", "--num-prompts", "100", "--goodput", "ttft:500", "itl:50")
    (shape,) = config.shapes
    assert not shape.closed_loop and shape.request_rate == 4 and shape.burstiness == 0.5
    assert shape.max_concurrency == 16 and config.pool_size() == 16 and config.resolved_api == "completions"
    assert config.goodput_ms == {"ttft": 500.0, "itl": 50.0}
    sweep = parse_bench("http://127.0.0.1:1/v1/completions", "--sweep-rate", "1,2,inf", "--num-prompts", "10")
    assert [s.request_rate for s in sweep.shapes] == [1, 2, math.inf]
    assert sweep.pool_size() is None  # an uncapped open loop
    sweep = parse_bench("http://127.0.0.1:1/v1/completions", "--sweep-concurrency", "1,8,32,64")
    assert [s.concurrency for s in sweep.shapes] == [1, 8, 32, 64]
    assert all(s.duration_s == 60 for s in sweep.shapes)  # the default bound


def test_max_concurrency_without_a_rate_is_vllms_capped_burst():
    # `vllm bench serve --max-concurrency 8 --num-prompts 100`: vLLM's rate defaults to inf, so all 100
    # arrive at once and 8 run at a time, each sent when another ends: the closed loop of 8.
    (shape,) = parse_bench("http://127.0.0.1:1/v1/completions", "--max-concurrency", "8", "--num-prompts",
                           "100").shapes
    assert shape.closed_loop and shape.concurrency == 8 and shape.num_prompts == 100


def _parse_vllm_style(*flags: str) -> BenchConfig:
    return config_from_args(build_parser().parse_args(["bench", "--no-progress", *flags]))


def test_the_endpoint_may_be_vllms_path_on_base_url_or_host_and_port(fake_server, prompts_file):
    # vllm bench serve: --endpoint is the route's path (default /v1/completions), on --base-url, else on
    # http://--host:--port (default 127.0.0.1:8000)
    assert _parse_vllm_style().endpoint == "http://127.0.0.1:8000/v1/chat/completions"  # kvserve's default
    assert _parse_vllm_style("--port", "9000").endpoint == "http://127.0.0.1:9000/v1/completions"
    config = _parse_vllm_style("--host", "h.example", "--endpoint", "/v1/chat/completions")
    assert config.endpoint == "http://h.example:8000/v1/chat/completions" and config.resolved_api == "chat"
    assert _parse_vllm_style("--base-url", "https://g.example/", "--endpoint", "/v1/completions").endpoint == \
        "https://g.example/v1/completions"
    assert _parse_vllm_style("--endpoint", "/v1/completions").endpoint == "http://127.0.0.1:8000/v1/completions"
    with pytest.raises(BenchConfigError, match="not both"):
        _parse_vllm_style("--base-url", "http://a:1", "--port", "2")
    with pytest.raises(BenchConfigError, match="is a full URL"):
        _parse_vllm_style("--base-url", "http://a:1", "--endpoint", "http://a:1/v1/completions")
    server = fake_server()
    config = _parse_vllm_style("--base-url", server.base_url, "--endpoint", "/v1/completions", "--num-prompts", "2",
                               "--max-tokens", "3", "--dataset", "file", "--dataset-path", prompts_file)
    result = run_benchmark(config, log=io.StringIO())
    assert result.runs[0].summary.completed == 2 and "prompt" in server.state.bodies[0]


def test_vllms_dataset_flags():
    # vllm bench serve --dataset-name random --random-input-len 1024 --random-output-len 128
    # --random-range-ratio 0.5: lengths uniform on 512-1536 and 64-192
    config = parse_bench("http://127.0.0.1:1/v1/completions", "--dataset-name", "random", "--random-input-len",
                         "1024", "--random-output-len", "100", "--random-range-ratio", "0.5")
    d = config.dataset
    assert (d.name, d.input_len, d.output_len, d.input_dist, d.output_dist, d.range_ratio) == \
        ("random", 1024, 100, "uniform", "uniform", 0.5)
    fixed = parse_bench("http://127.0.0.1:1/v1/completions", "--random-range-ratio", "0").dataset
    assert (fixed.input_dist, fixed.output_dist) == ("fixed", "fixed")
    # vLLM's custom dataset is a JSONL of {"prompt": ...}: kvserve's file dataset
    custom = parse_bench("http://127.0.0.1:1/v1/completions", "--dataset-name", "custom", "--dataset-path", "x.jsonl")
    assert custom.dataset.name == "file" and custom.dataset.path == "x.jsonl"
    assert parse_bench("http://127.0.0.1:1/v1/completions", "--custom-output-len", "77").dataset.output_len == 77
    with pytest.raises(BenchConfigError, match="not both"):
        parse_bench("http://127.0.0.1:1/v1/completions", "--random-range-ratio", "0.5", "--input-dist", "chat")
    with pytest.raises(BenchConfigError, match=r"--random-range-ratio must be in \[0, 1\), got 1"):
        parse_bench("http://127.0.0.1:1/v1/completions", "--random-range-ratio", "1.0")
    sharegpt = parse_bench("http://127.0.0.1:1/v1/completions", "--dataset-name", "sharegpt", "--dataset-path",
                           "s.json", "--sharegpt-output-len", "64").dataset
    assert (sharegpt.name, sharegpt.path, sharegpt.sharegpt_output_len) == ("sharegpt", "s.json", 64)


def test_save_result_writes_the_json_as_vllms_flags_say(fake_server, prompts_file, tmp_path, monkeypatch):
    endpoint = "http://127.0.0.1:1/v1/completions"
    config = parse_bench(endpoint, "--save-result", "--result-dir", str(tmp_path / "out"), "--result-filename", "r.json")
    assert config.json_path == str(tmp_path / "out" / "r.json")
    monkeypatch.chdir(tmp_path)
    default = parse_bench(endpoint, "--save-result").json_path
    assert default.startswith("kvserve-bench-") and default.endswith(".json") and os.sep not in default
    with pytest.raises(BenchConfigError, match="not both"):
        parse_bench(endpoint, "--save-result", "--json", "x.json")
    server = fake_server()
    assert main(["bench", "--endpoint", server.base_url + "/v1/completions", "--num-prompts", "2", "--max-tokens", "3",
                 "--dataset", "file", "--dataset-path", prompts_file, "--no-progress", "--save-result",
                 "--result-dir", "results", "--result-filename", "run.json"]) == 0
    data = json.loads((tmp_path / "results" / "run.json").read_text())
    assert data["runs"][0]["summary"]["completed"] == 2


def test_vllms_backend_and_trust_remote_code_flags():
    # vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --trust-remote-code
    config = _parse_vllm_style("--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--trust-remote-code")
    assert config.resolved_api == "chat" and config.endpoint == "http://127.0.0.1:8000/v1/chat/completions"
    for backend in ("vllm", "openai"):
        assert _parse_vllm_style("--backend", backend, "--port", "9000").resolved_api == "completions"
    # a route the endpoint names and a backend of the other API (vLLM refuses it too)
    with pytest.raises(BenchConfigError, match="is the completions route"):
        _parse_vllm_style("--backend", "openai-chat", "--port", "9000")
    with pytest.raises(BenchConfigError, match="give one"):
        _parse_vllm_style("--backend", "vllm", "--api", "chat", "--endpoint", "/gateway")
    assert build_parser().parse_args(["bench", "--disable-tqdm"]).progress is False
    assert build_parser().parse_args(["bench"]).progress is None
    # a route of another name: the backend says the API
    assert _parse_vllm_style("--backend", "openai-chat", "--endpoint", "/gateway").resolved_api == "chat"


def test_percentile_flags(fake_server, prompts_file, capsys):
    config = parse_bench("http://127.0.0.1:1/v1/completions", "--percentile-metrics", "ttft,E2EL",
                         "--metric-percentiles", "50,99.9")
    assert config.percentile_metrics == ("ttft", "e2e") and config.metric_percentiles == (50.0, 99.9)
    default = parse_bench("http://127.0.0.1:1/v1/completions")
    assert default.percentile_metrics == ("ttft", "tpot", "itl", "e2e") and default.metric_percentiles == ()
    with pytest.raises(BenchConfigError, match="--percentile-metrics takes"):
        parse_bench("http://127.0.0.1:1/v1/completions", "--percentile-metrics", "ttft,latency")
    with pytest.raises(BenchConfigError, match=r"--metric-percentiles must be in \[0, 100\]"):
        parse_bench("http://127.0.0.1:1/v1/completions", "--metric-percentiles", "99,101")
    server = fake_server()
    assert main(["bench", "--endpoint", server.base_url + "/v1/completions", "--num-prompts", "3", "--max-tokens", "3",
                 "--dataset", "file", "--dataset-path", prompts_file, "--no-progress", "--percentile-metrics",
                 "tpot", "--metric-percentiles", "99.9"]) == 0
    out = capsys.readouterr().out
    assert "P99.9 TPOT (ms):" in out and "TTFT" not in out


def test_the_model_names_the_tokenizer_as_in_vllm(tiny_model_dir):
    # vllm bench serve --model ORG/NAME --served-model-name NAME: --model is the tokenizer, the served name is sent
    model_dir = tiny_model_dir("llama")
    endpoint = "http://127.0.0.1:1/v1/completions"
    config = parse_bench(endpoint, "--model", model_dir, "--served-model-name", "tiny")
    assert (config.model, config.tokenizer) == ("tiny", model_dir)
    config = parse_bench(endpoint, "--model", model_dir)
    assert (config.model, config.tokenizer) == (model_dir, model_dir)
    # a served name (no local model): the default tokenizer; --tokenizer wins
    assert parse_bench(endpoint, "--model", "tiny").tokenizer is None
    assert parse_bench(endpoint, "--model", model_dir, "--tokenizer", "/t").tokenizer == "/t"


def test_goodput_takes_vllms_e2el_key():
    # `vllm bench serve --goodput ttft:500 e2el:2000`: vLLM's name of the end-to-end latency SLO
    config = parse_bench("http://127.0.0.1:1/v1/completions", "--goodput", "ttft:500", "E2EL:2000")
    assert config.goodput_ms == {"ttft": 500.0, "e2e": 2000.0}


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "4", "--request-rate", "2"], "give one"),
    (["--burstiness", "0.5"], "open loop"),
    (["--max-concurrency", "4", "--concurrency", "4"], "not both"),
    (["--sweep-concurrency", "1,2", "--concurrency", "3"], "replaces"),
    (["--request-rate", "inf", "--duration", "10"], "needs --num-prompts"),
    (["--goodput", "ttft=5"], "KEY:MS"),
    (["--goodput", "latency:5"], "--goodput keys"),
    (["--concurrency", "0"], "at least 1"),
])
def test_bad_flag_combinations(flags, message):
    with pytest.raises(BenchConfigError, match=message):
        parse_bench("http://127.0.0.1:1/v1/completions", *flags)


def test_an_endpoint_that_is_no_completions_route_is_refused_before_any_request():
    """The OpenAI client's base URL (.../v1) as --endpoint: every request would get a 404."""
    for endpoint in ("http://127.0.0.1:1/v1", "http://127.0.0.1:1/v1/", "http://127.0.0.1:1"):
        with pytest.raises(BenchConfigError, match=rf"^--endpoint '{endpoint}' is no completions URL: give the route "
                                                   rf"itself, e.g. {endpoint.rstrip('/')}/chat/completions"):
            parse_bench(endpoint)
    with pytest.raises(BenchConfigError, match=r"e\.g\. https://x\.example/openai/v1/chat/completions\?api-version=1 "):
        parse_bench("https://x.example/openai/v1?api-version=1")  # the query stays after the route
    # --api sends to the URL as it is (a gateway's own path)
    assert parse_bench("http://127.0.0.1:1/gateway/generate", "--api", "chat").resolved_api == "chat"
    # the Responses API's route
    responses = parse_bench("http://127.0.0.1:1/v1/responses")
    assert responses.resolved_api == "responses" and responses.api_base == "http://127.0.0.1:1/v1"
    assert parse_bench("http://127.0.0.1:1/gateway/generate", "--api", "responses").resolved_api == "responses"


def test_command_end_to_end(fake_server, prompts_file, tmp_path, capsys):
    server = fake_server(itl_s=0.002)
    first, second, plot = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "a.png"
    common = ["bench", "--endpoint", server.base_url + "/v1/chat/completions", "--concurrency", "2",
              "--num-prompts", "6", "--max-tokens", "4", "--dataset", "file", "--dataset-path", prompts_file,
              "--no-progress"]
    assert main([*common, "--json", str(first), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out
    assert json.loads(first.read_text())["runs"][0]["summary"]["completed"] == 6
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*common, "--json", str(second), "--compare", str(first)]) == 0
    out = capsys.readouterr().out
    assert f"vs {first}" in out and "Output token throughput (tok/s)" in out


@pytest.mark.parametrize("busy_client", [False, True])
def test_command_sweep_prints_one_row_per_point(fake_server, prompts_file, capsys, monkeypatch, busy_client):
    if busy_client:  # every run then reports a saturated client, as a loaded CI machine may
        monkeypatch.setattr(client_health, "SATURATED_CPU_PERCENT", 0.0)
    server = fake_server()
    assert main(["bench", "--endpoint", server.base_url + "/v1/completions", "--sweep-concurrency", "1,2",
                 "--num-prompts", "4", "--max-tokens", "2", "--dataset", "file", "--dataset-path", prompts_file,
                 "--no-progress"]) == 0
    # Table rows start with the run's label. A note after the table (the client-health warning on a busy
    # machine, say) starts with the label and a colon: it is not a row.
    rows: list[str] = []
    notes: list[str] = []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("concurrency="):
            (notes if line.split()[0].endswith(":") else rows).append(line)
    assert [row.split()[0] for row in rows] == ["concurrency=1", "concurrency=2"]
    assert {note.split()[0] for note in notes} <= {"concurrency=1:", "concurrency=2:"}
    if busy_client:
        assert [note.split()[0] for note in notes] == ["concurrency=1:", "concurrency=2:"]
        assert all("may be the bottleneck" in note for note in notes)


def test_command_fails_cleanly(fake_server, prompts_file, tmp_path, capsys):
    # Nothing listens on the port: an error message and status 2, before any load.
    server = fake_server()
    port = server.port
    server.stop()
    assert main(["bench", "--endpoint", f"http://127.0.0.1:{port}/v1/completions", "--num-prompts", "2",
                 "--dataset", "file", "--dataset-path", prompts_file, "--no-progress"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    # A --compare file that is not a result: refused before the run.
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    server = fake_server()
    assert main(["bench", "--endpoint", server.base_url + "/v1/completions", "--num-prompts", "2",
                 "--dataset", "file", "--dataset-path", prompts_file, "--compare", str(bad), "--no-progress"]) == 2
    assert server.state.num_requests == 0
    # Every request failing: the report still prints, and the status says nothing succeeded.
    failing = fake_server(fail_every=1)
    assert main(["bench", "--endpoint", failing.base_url + "/v1/completions", "--num-prompts", "3",
                 "--dataset", "file", "--dataset-path", prompts_file, "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "http_500:" in captured.out
    # ... and the log says why, with the server's message (the report only counts the kinds).
    assert "3 of 3 requests failed; the first of each kind: http_500: injected failure of request 1" in captured.err


def test_what_would_fail_after_the_run_fails_before_it(fake_server, prompts_file, tmp_path, capsys):
    """A run's results were lost, or the JSON left half written, when the output failed after the run: a
    --json path that cannot be written (a traceback, no JSON), --temperature nan (the JSON broke midway), a
    --compare file that does not exist (a traceback). Each is now refused before any request (status 2);
    a missing directory is made, as vLLM's --result-dir is. --json X --compare X compared the run with
    itself (the file was written first); it compares with the file as it was."""
    server = fake_server()
    common = ["bench", "--endpoint", server.base_url + "/v1/chat/completions", "--num-prompts", "2",
              "--max-tokens", "2", "--dataset", "file", "--dataset-path", prompts_file, "--no-progress"]
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    for flags, message in [
        (["--json", str(tmp_path)], "is a directory"),
        (["--json", str(blocker / "r.json")], "cannot create its directory"),
        (["--plot", str(blocker / "p.png")], "cannot create its directory"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
        (["--compare", str(tmp_path / "missing.json")], "No such file or directory"),
    ]:
        assert main([*common, *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    assert server.state.num_requests == 0
    result = tmp_path / "new" / "dir" / "r.json"
    assert main([*common, "--concurrency", "2", "--json", str(result)]) == 0
    assert json.loads(result.read_text())["runs"][0]["label"] == "concurrency=2"
    capsys.readouterr()
    assert main([*common, "--concurrency", "1", "--json", str(result), "--compare", str(result)]) == 0
    assert f" concurrency=1 vs {result} (concurrency=2) " in capsys.readouterr().out
    assert json.loads(result.read_text())["runs"][0]["label"] == "concurrency=1"


def test_an_endpoint_with_a_trailing_slash_is_the_route_and_redirects_are_errors(fake_server, bench, prompts_file):
    """.../chat/completions/ passed the route check but went out as given: the server's 307 was read as a
    stream, every request an 'invalid_response' of an empty chunk. The slash is dropped; an answer that is a
    redirect is recorded as http_307 with where it points."""
    server = fake_server()
    result, config = bench(server.base_url + "/v1/completions/", "--num-prompts", "2", "--max-tokens", "2",
                           "--dataset", "file", "--dataset-path", prompts_file)
    assert config.endpoint == server.base_url + "/v1/completions" and result.runs[0].summary.completed == 2
    from kvserve.bench.runner import BenchError

    # (the model is not listed under that path, so one test request goes first, and its failure says why)
    with pytest.raises(BenchError, match=r"\(http_307: redirected to '/v1/completions'\)"):
        bench(server.base_url + "/v1/redirect/completions", "--num-prompts", "1", "--max-tokens", "2",
              "--dataset", "file", "--dataset-path", prompts_file, "--model", MODEL)


def test_a_model_the_server_does_not_list_gets_one_test_request_first(fake_server, prompts_file, capsys):
    """--model not in GET /v1/models: one short request before the run. A name the server does not serve stops
    the benchmark there with the server's reason (not a run of 404s); one it serves without listing it (an
    alias behind a proxy) is measured after that one request. A listed name gets no test request."""
    args = ["--dataset", "file", "--dataset-path", prompts_file, "--num-prompts", "3", "--no-progress"]
    server = fake_server(served_models=(MODEL,))
    assert main(["bench", "--endpoint", server.base_url + "/v1/chat/completions", "--model", "nope", *args]) == 2
    err = capsys.readouterr().err
    assert "kvserve bench: error: the test request for model 'nope' failed (http_404: The model `nope` does not " \
           "exist.); nothing was measured" in err, err
    assert server.state.num_requests == 1 and server.state.bodies[0]["max_tokens"] == 1

    alias = fake_server(served_models=(MODEL, "alias"))
    assert main(["bench", "--endpoint", alias.base_url + "/v1/completions", "--model", "alias", *args]) == 0
    assert f"the server lists {MODEL}, not 'alias': sending one test request" in capsys.readouterr().err
    assert alias.state.num_requests == 1 + 3
    assert [b["model"] for b in alias.state.bodies] == ["alias"] * 4

    listed = fake_server(served_models=(MODEL,))
    assert main(["bench", "--endpoint", listed.base_url + "/v1/completions", "--model", MODEL, *args]) == 0
    assert listed.state.num_requests == 3


def test_ctrl_c_ends_the_run_with_a_report(fake_server, prompts_file):
    import signal
    import subprocess
    import sys
    import time

    server = fake_server(itl_s=0.25)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "bench", "--endpoint", server.base_url + "/v1/completions",
         "--concurrency", "2", "--duration", "60", "--max-tokens", "100", "--dataset", "file",
         "--dataset-path", prompts_file, "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while server.state.num_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.state.num_requests >= 2, "the bench never sent its requests"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    # Nothing completed: status 1, and the report of what happened.
    assert proc.returncode == 1, err
    assert "cancelled:" in out and "interrupted" in out


def test_ctrl_c_during_the_warmup_ends_the_benchmark(fake_server, prompts_file, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    # Three warm-up requests of 8 x 0.25 s, one at a time; Ctrl-C during the first. It used to be ignored
    # until the warm-up ended, and a measured run then started already stopped.
    server = fake_server(itl_s=0.25)
    json_path = tmp_path / "result.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "bench", "--endpoint", server.base_url + "/v1/completions",
         "--concurrency", "1", "--num-prompts", "4", "--warmup", "3", "--max-tokens", "8", "--dataset", "file",
         "--dataset-path", prompts_file, "--json", str(json_path), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while server.state.num_requests < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.state.num_requests == 1, "the bench never sent its first warm-up request"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    # The first warm-up request was cancelled and nothing more sent: no further warm-up, no measured run.
    assert server.state.num_requests == 1
    # Nothing measured: status 1 (as a Ctrl-C that leaves no completed request), a message, and no report.
    assert proc.returncode == 1, err
    assert "interrupted during the warm-up" in err and "Traceback" not in err
    assert "Serving Benchmark Result" not in out and not json_path.exists()


def test_the_api_key_defaults_to_openai_api_key(monkeypatch):
    """As the OpenAI client and vLLM's benchmark: OPENAI_API_KEY when --api-key is not given; the flag wins."""
    from kvserve import envs

    monkeypatch.setattr(envs, "OPENAI_API_KEY", "sk-from-env")
    config = parse_bench("http://127.0.0.1:1/v1/completions")
    # ... to the endpoint only: /metrics needs none and may be another host's (a user's OpenAI key).
    assert config.api_key == "sk-from-env" and config.metrics_api_key is None
    config = parse_bench("http://127.0.0.1:1/v1/completions", "--api-key", "sk-flag")
    assert config.api_key == "sk-flag" and config.metrics_api_key == "sk-flag"
    monkeypatch.setattr(envs, "OPENAI_API_KEY", None)
    assert parse_bench("http://127.0.0.1:1/v1/completions").api_key is None


def test_ready_check_timeout_waits_for_a_server_that_comes_up_late(prompts_file, capsys, monkeypatch):
    # vLLM's --ready-check-timeout-sec N: the benchmark waits for a server still starting (its port bound but
    # not listening yet: connections refused), saying so, and runs once it answers. It failed at once (status 2).
    monkeypatch.setattr(runner, "READY_RETRY_S", 0.05)
    server = FakeOpenAIServer(FakeBehavior())
    attempts: list[float] = []
    fetch = runner.fetch_model_names

    async def counting_fetch(*args, **kwargs):
        attempts.append(0.0)
        if len(attempts) == 3:  # the server comes up after the second refused attempt
            server.start()
        return await fetch(*args, **kwargs)

    monkeypatch.setattr(runner, "fetch_model_names", counting_fetch)
    try:
        assert main(["bench", "--endpoint", server.base_url + "/v1/completions", "--num-prompts", "2",
                     "--max-tokens", "2", "--dataset", "file", "--dataset-path", prompts_file, "--no-progress",
                     "--ready-check-timeout-sec", "600"]) == 0
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert f"waiting up to 600 s for the server at {server.base_url}/v1 to come up" in err
    assert err.count("not up yet after") == 2
    assert server.state.num_requests == 2


def test_ready_check_timeout_fails_clearly_when_the_server_never_comes_up(fake_server, prompts_file, capsys,
                                                                          monkeypatch):
    monkeypatch.setattr(runner, "READY_RETRY_S", 0.05)
    server = fake_server()
    port = server.port
    server.stop()
    flags = ["bench", "--endpoint", f"http://127.0.0.1:{port}/v1/completions", "--num-prompts", "2",
             "--dataset", "file", "--dataset-path", prompts_file, "--no-progress"]
    assert main([*flags, "--ready-check-timeout-sec", "1"]) == 2
    err = capsys.readouterr().err
    assert f"the server at http://127.0.0.1:{port}/v1 did not come up within 1 s (--ready-check-timeout-sec)" in err
    assert "last attempt: ConnectError" in err and "not up yet after" in err
    # The default (0) checks once and names the flag that waits.
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert "cannot reach the server" in err and "--ready-check-timeout-sec N waits" in err
    assert "not up yet" not in err
    assert main([*flags, "--ready-check-timeout-sec", "-1"]) == 2
    assert "--ready-check-timeout-sec must be in [0, 86400], got -1" in capsys.readouterr().err


def test_ready_check_waits_out_a_server_that_answers_503_while_it_loads(fake_server, prompts_file, capsys,
                                                                        monkeypatch):
    monkeypatch.setattr(runner, "READY_RETRY_S", 0.05)
    server = fake_server()
    statuses = [503, 503]
    fetch = runner.fetch_model_names

    async def loading(api_base, *args, **kwargs):
        if statuses:
            request = httpx.Request("GET", api_base + "/models")
            raise httpx.HTTPStatusError("loading", request=request,
                                        response=httpx.Response(statuses.pop(), request=request))
        return await fetch(api_base, *args, **kwargs)

    monkeypatch.setattr(runner, "fetch_model_names", loading)
    assert main(["bench", "--endpoint", server.base_url + "/v1/completions", "--num-prompts", "1",
                 "--max-tokens", "2", "--dataset", "file", "--dataset-path", prompts_file, "--no-progress",
                 "--ready-check-timeout-sec", "60"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"({server.base_url}/v1/models answered 503)") == 2
    assert server.state.num_requests == 1


def test_vllms_sampling_flags_go_into_every_request(fake_server, prompts_file, capsys):
    # As vLLM's bench serve: no --temperature is greedy (0 sent; kvserve bench sent none, the server's default
    # sampling); --top-p, --top-k, --min-p and the penalties go into each request body under their API names.
    server = fake_server()
    common = ["bench", "--endpoint", server.base_url + "/v1/completions", "--num-prompts", "2", "--max-tokens",
              "2", "--dataset", "file", "--dataset-path", prompts_file, "--no-progress"]
    assert main(common) == 0
    assert [b["temperature"] for b in server.state.bodies] == [0.0, 0.0]
    assert not {"top_p", "top_k", "min_p", "repetition_penalty"} & set(server.state.bodies[0])
    server.state.bodies.clear()
    assert main([*common, "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05",
                 "--repetition-penalty", "1.1", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5"]) == 0
    for body in server.state.bodies:
        assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                     "presence_penalty", "frequency_penalty")} == {
            "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
            "presence_penalty": 0.5, "frequency_penalty": -0.5}
    assert len(server.state.bodies) == 2
    # 'server' sends no temperature (the server's default, kvserve bench's earlier behaviour)
    server.state.bodies.clear()
    assert main([*common, "--temperature", "server", "--top-k", "-1"]) == 0
    assert "temperature" not in server.state.bodies[0] and server.state.bodies[0]["top_k"] == -1
    capsys.readouterr()


@pytest.mark.parametrize(("flags", "message"), [
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["--top-k", "-2"], "--top-k must be -1 or 0 (no limit) or a positive integer, got -2"),
    (["--min-p", "-0.1"], "--min-p must be in [0, 1], got -0.1"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0 (1: none), got 0"),
    (["--repetition-penalty", "inf"], "--repetition-penalty must be a finite number > 0 (1: none), got inf"),
    (["--presence-penalty", "3"], "--presence-penalty must be in [-2, 2], got 3"),
    (["--frequency-penalty", "-2.5"], "--frequency-penalty must be in [-2, 2], got -2.5"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1"),
])
def test_nonsensical_sampling_values_are_refused_before_any_request(fake_server, prompts_file, capsys, flags,
                                                                    message):
    server = fake_server()
    assert main(["bench", "--endpoint", server.base_url + "/v1/completions", "--num-prompts", "1",
                 "--dataset", "file", "--dataset-path", prompts_file, "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err
    assert server.state.num_requests == 0


def test_extra_body_goes_into_every_request_over_the_flags(fake_server, prompts_file, capsys, tmp_path):
    # vLLM's --extra-body: fields the flags do not cover (chat_template_kwargs), and over a flag's value
    server = fake_server()
    common = ["bench", "--endpoint", server.base_url + "/v1/chat/completions", "--num-prompts", "2", "--max-tokens",
              "2", "--dataset", "file", "--dataset-path", prompts_file, "--no-progress"]
    path = tmp_path / "r.json"
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "top_p": 0.5}
    assert main([*common, "--top-p", "0.9", "--extra-body", json.dumps(extra), "--json", str(path)]) == 0
    assert len(server.state.bodies) == 2
    for body in server.state.bodies:
        assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["top_p"] == 0.5
        assert body["stream"] is True and body["messages"]
    assert json.loads(path.read_text())["config"]["extra_body"] == extra
    # stream_options is merged with the client's own (its usage counts the tokens)
    server.state.bodies.clear()
    assert main([*common, "--extra-body", '{"stream_options": {"continuous_usage_stats": true}}']) == 0
    assert server.state.bodies[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    # keys the client must set itself are refused before any request; anything but an object is a usage error
    server.state.bodies.clear()
    assert main([*common, "--extra-body", '{"stream": false, "messages": []}']) == 2
    assert "--extra-body cannot set messages, stream" in capsys.readouterr().err
    assert server.state.num_requests == 4  # (two runs of two requests before: none more)
    for bad in ("[1]", "{oops"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "--extra-body", bad])
        assert "--extra-body: expected a JSON object" in capsys.readouterr().err


def test_temperature_takes_a_number_or_server(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--temperature", "hot"])
    assert "--temperature takes a number or 'server', got 'hot'" in capsys.readouterr().err


def test_the_result_json_carries_vllms_config_keys_and_detailed_lists(fake_server, prompts_file, tmp_path):
    # A script that reads `vllm bench serve --save-result --save-detailed` files finds its keys: the
    # configuration (date, backend, label, model_id, tokenizer_id, num_prompts, request_rate, burstiness,
    # max_concurrency), --metadata's keys, and with --save-detailed the per-request lists.
    server = fake_server(stop_after_tokens=2, fail_every=3)
    common = ["bench", "--base-url", server.base_url, "--backend", "vllm", "--num-prompts", "3", "--max-tokens",
              "4", "--dataset", "file", "--dataset-path", prompts_file, "--no-progress"]
    path = tmp_path / "r.json"
    assert main([*common, "--max-concurrency", "2", "--json", str(path), "--label", "nightly", "--metadata",
                 "gpu=H100", "note = a=b ", "--save-detailed"]) == 0
    data = json.loads(path.read_text())
    assert re.fullmatch(r"\d{8}-\d{6}", data["date"])
    assert {k: data[k] for k in ("backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                                 "burstiness", "max_concurrency", "gpu", "note")} == {
        "backend": "vllm", "label": "nightly", "model_id": MODEL, "tokenizer_id": MODEL, "num_prompts": 3,
        "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 2, "gpu": "H100", "note": "a=b"}
    # request order; the third request failed (the fake fails every third)
    assert data["input_lens"][2] == 0 and data["output_lens"] == [2, 2, 0]
    assert data["generated_texts"][:2] == [" alpha bravo", " alpha bravo"] and data["generated_texts"][2] == ""
    assert data["errors"][:2] == ["", ""] and "injected failure of request 3" in data["errors"][2]
    assert all(t > 0 for t in data["ttfts"][:2]) and data["ttfts"][2] == 0
    assert [len(gaps) for gaps in data["itls"]] == [1, 1, 0]
    # Without --save-detailed: no lists, and no answer text kept; an open loop's own rate and cap.
    assert main([*common, "--request-rate", "50", "--burstiness", "2", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert not {"input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"} & set(data)
    assert data["label"] is None and data["request_rate"] == 50 and data["burstiness"] == 2
    assert data["max_concurrency"] is None
    assert all(r["generated_text"] is None for r in data["runs"][0]["records"])


def test_metadata_takes_key_value_pairs_and_leaves_the_files_own_keys(capsys):
    with pytest.raises(BenchConfigError, match="--metadata takes KEY=VALUE pairs, got 'gpu'"):
        parse_bench("http://127.0.0.1:1/v1/completions", "--metadata", "gpu")
    with pytest.raises(BenchConfigError, match="that key is the result file's own"):
        parse_bench("http://127.0.0.1:1/v1/completions", "--metadata", "runs=3")


def test_append_result_adds_one_line_per_run_and_compare_reads_the_last(fake_server, prompts_file, tmp_path,
                                                                        monkeypatch, capsys):
    server = fake_server()
    monkeypatch.chdir(tmp_path)
    common = ["bench", "--endpoint", server.base_url + "/v1/completions", "--num-prompts", "2", "--max-tokens",
              "2", "--dataset", "file", "--dataset-path", prompts_file, "--no-progress", "--result-filename",
              "all.jsonl", "--append-result"]
    assert main([*common, "--concurrency", "1"]) == 0
    assert main([*common, "--concurrency", "2"]) == 0
    lines = (tmp_path / "all.jsonl").read_text().splitlines()
    assert [json.loads(line)["max_concurrency"] for line in lines] == [1, 2]
    assert "results appended to all.jsonl" in capsys.readouterr().err
    # --compare with an appended file compares with its last result
    assert main([*common[:-3], "--concurrency", "1", "--compare", "all.jsonl"]) == 0
    assert "vs all.jsonl (concurrency=2)" in capsys.readouterr().out
    # --label names the default file, as in vLLM
    assert parse_bench("http://127.0.0.1:1/v1/completions", "--save-result", "--label", "nightly"
                       ).json_path.startswith("nightly-")


def test_request_id_prefix_sends_vllms_x_request_id(fake_server, prompts_file, tmp_path):
    server = fake_server()
    common = ["bench", "--endpoint", server.base_url + "/v1/completions", "--max-tokens", "2", "--dataset",
              "file", "--dataset-path", prompts_file, "--no-progress"]
    path = tmp_path / "r.json"
    # without the flag, vLLM's default: bench-<8 hex digits>-<index>, the prefix new for each command
    prefixes = set()
    for _ in range(2):
        assert main([*common, "--num-prompts", "3", "--json", str(path)]) == 0
        ids = server.state.request_ids
        assert len(ids) == 3 and all(re.fullmatch(r"bench-[0-9a-f]{8}-[0-2]", i or "") for i in ids), ids
        assert sorted(i.rsplit("-", 1)[1] for i in ids) == ["0", "1", "2"] and len({i[:15] for i in ids}) == 1
        prefixes.add(ids[0][:15])
        server.state.request_ids.clear()
    assert len(prefixes) == 2
    assert main([*common, "--num-prompts", "3", "--warmup", "1", "--request-id-prefix", "bench-", "--json",
                 str(path)]) == 0
    assert server.state.request_ids[0] == "bench-warmup-0"
    assert sorted(server.state.request_ids[1:]) == ["bench-0", "bench-1", "bench-2"]
    records = json.loads(path.read_text())["runs"][0]["records"]
    assert [r["request_id"] for r in records] == ["bench-0", "bench-1", "bench-2"]
    # a sweep's later points number their ids apart: no id is sent twice
    server.state.request_ids.clear()
    assert main([*common, "--num-prompts", "2", "--sweep-concurrency", "1,2", "--request-id-prefix", "p"]) == 0
    assert sorted(server.state.request_ids) == ["p0", "p1", "p1-0", "p1-1"]
