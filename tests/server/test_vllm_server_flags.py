"""vLLM's server flags and endpoints that deployments rely on: CORS (`--allowed-origins` and friends, all
origins by default), `/ping`, `--root-path` behind a proxy, `--max-logprobs`."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from .conftest import API_KEY, TINY_NAME, ServerProcess

ORIGIN = "http://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_by_default_and_before_the_api_key(tiny_server: ServerProcess, strict_server: ServerProcess) -> None:
    """Every origin by default, as vLLM: a browser's preflight gets its answer, and responses carry the
    header; with --api-key the preflight (which carries no key) is not refused, while the request is."""
    for server in (tiny_server, strict_server):
        preflight = httpx.options(server.base_url + "/v1/chat/completions", headers=PREFLIGHT, timeout=10)
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] in ("*", ORIGIN)
        assert "POST" in preflight.headers["access-control-allow-methods"]
    models = httpx.get(tiny_server.base_url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"
    refused = httpx.get(strict_server.base_url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_ping_is_the_health_check(tiny_server: ServerProcess) -> None:
    for method in ("GET", "POST"):
        assert httpx.request(method, tiny_server.base_url + "/ping", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def flagged_server(launch_server: Callable[..., ServerProcess], tiny_llama_dir: str) -> ServerProcess:
    return launch_server([tiny_llama_dir, "--served-model-name", TINY_NAME, "--max-model-len", "64",
                          "--kv-cache-memory", "64MiB", "--api-key", API_KEY, "--max-logprobs", "3",
                          "--allowed-origins", f'["{ORIGIN}"]', "--root-path", "/v", "--return-tokens-as-token-ids",
                          "--scheduling-policy", "priority", "--tool-call-parser", "hermes",
                          "--response-role", "model", "--enable-request-id-headers"])


def test_origins_root_path_and_max_logprobs(flagged_server: ServerProcess) -> None:
    base, auth = flagged_server.base_url, {"Authorization": f"Bearer {API_KEY}"}
    allowed = httpx.options(base + "/v1/models", headers=PREFLIGHT, timeout=10)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(base + "/v1/models", headers={**PREFLIGHT, "Origin": "http://evil.example"}, timeout=10)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers

    # Behind a proxy that serves it at /v and strips the prefix: the routes answer as before, under the API key
    # (the guard routes on the path below the root path too), and the API's schema names the prefix.
    assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
    listed = httpx.get(base + "/v1/models", headers=auth, timeout=10)
    assert listed.status_code == 200 and listed.json()["data"][0]["id"] == TINY_NAME
    assert httpx.get(base + "/openapi.json", timeout=10).json()["servers"] == [{"url": "/v"}]

    chat = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    ok = httpx.post(base + "/v1/chat/completions", headers=auth, json={**chat, "top_logprobs": 3}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    # --return-tokens-as-token-ids: the default of the request field, which a request may turn off
    assert ok.json()["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    as_text = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=60,
                         json={**chat, "return_tokens_as_token_ids": False})
    assert not as_text.json()["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    # --scheduling-policy priority: requests' priorities are served
    ranked = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=60, json={**chat, "priority": 5})
    assert ranked.status_code == 200, ranked.text
    # --tool-call-parser without --enable-auto-tool-choice (as in vLLM): tool_choice "auto" is not served
    tools = [{"type": "function", "function": {"name": "f"}}]
    auto = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=60, json={**chat, "tools": tools})
    assert auto.status_code == 400 and auto.json()["error"]["param"] == "tool_choice", auto.text
    over = httpx.post(base + "/v1/chat/completions", headers=auth, json={**chat, "top_logprobs": 4}, timeout=60)
    assert over.status_code == 400 and over.json()["error"]["param"] == "top_logprobs"
    assert "--max-logprobs (3)" in over.json()["error"]["message"]
    completion = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 2, "logprobs": 4}
    over = httpx.post(base + "/v1/completions", headers=auth, json=completion, timeout=60)
    assert over.status_code == 400 and over.json()["error"]["param"] == "logprobs"


def test_response_role_and_request_id_headers(flagged_server: ServerProcess, tiny_server: ServerProcess) -> None:
    """--response-role: a chat reply's role (streamed too) under add_generation_prompt; without a generation
    prompt the reply takes the last message's role, as vLLM's. --enable-request-id-headers: every response,
    the guard's 401 included, carries X-Request-Id: the client's own, else a new random one. Not without it."""
    import json
    import re

    base, auth = flagged_server.base_url, {"Authorization": f"Bearer {API_KEY}"}
    chat = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(base + "/v1/chat/completions", headers={**auth, "X-Request-Id": "trace-7"}, json=chat,
                       timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "model"
    assert reply.headers["x-request-id"] == "trace-7"
    with httpx.stream("POST", base + "/v1/chat/completions", headers=auth, json={**chat, "stream": True},
                      timeout=60) as stream:
        assert re.fullmatch("[0-9a-f]{32}", stream.headers["x-request-id"]), stream.headers
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "model"
    assert all("role" not in event["choices"][0]["delta"] for event in events[1:] if event["choices"])
    continued = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=60, json={
        **chat, "messages": [*chat["messages"], {"role": "assistant", "content": "Hello"}],
        "add_generation_prompt": False, "continue_final_message": True})
    assert continued.status_code == 200, continued.text
    assert continued.json()["choices"][0]["message"]["role"] == "assistant"
    as_user = httpx.post(base + "/v1/chat/completions", headers=auth, json={**chat, "add_generation_prompt": False},
                         timeout=60)
    assert as_user.status_code == 200 and as_user.json()["choices"][0]["message"]["role"] == "user", as_user.text
    refused = httpx.get(base + "/v1/models", headers={"X-Request-Id": "trace-8"}, timeout=10)
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "trace-8"
    ids = {httpx.get(base + "/v1/models", headers=auth, timeout=10).headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2
    plain = httpx.post(tiny_server.base_url + "/v1/chat/completions", json=chat, timeout=60,
                       headers={"X-Request-Id": "trace-9"})
    assert plain.json()["choices"][0]["message"]["role"] == "assistant"
    assert "x-request-id" not in plain.headers


@pytest.mark.parametrize("flags, message", [
    (["--response-role", " "], "argument --response-role: must not be empty"),
    (["--allowed-origins", "*"], "expected a JSON list"),
    (["--max-logprobs", "21"], "must be in [0, 20]"),
    (["--root-path", "llm"], "must start with '/'"),
    # a negative size or time started the server (every body refused, connections closed at once)
    (["--max-request-body-bytes", "-1"], "argument --max-request-body-bytes: must be at least 0, got -1"),
    (["--timeout-keep-alive", "-1"], "argument --timeout-keep-alive: must be at least 0, got -1"),
    (["--shutdown-timeout", "-5"], "argument --shutdown-timeout: must be at least 0, got -5"),
    (["--shutdown-timeout", "nan"], "argument --shutdown-timeout: must be at least 0, got nan"),
])
def test_bad_flag_values_are_refused(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.entrypoints.openai.cli_args import make_arg_parser

    with pytest.raises(SystemExit) as exited:
        make_arg_parser().parse_args(flags)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_root_path_is_cut_where_the_router_cuts_it() -> None:
    """The guard judges the path the router serves: the root path is cut only before a "/"."""
    from kvserve.entrypoints.openai.cli_args import make_arg_parser
    from kvserve.entrypoints.openai.middleware import route_path

    cases = [("/llm", "/llm/v1/models", "/v1/models"), ("/llm", "/llm", ""), ("/llm", "/llmv1/models", "/llmv1/models"),
             ("/v", "/v1/models", "/v1/models"), ("", "/v1/models", "/v1/models"), ("", "v1/models", "v1/models")]
    for root, path, routed in cases:
        assert route_path({"root_path": root, "path": path}) == routed, (root, path)
    assert make_arg_parser().parse_args(["--root-path", "/"]).root_path == ""
    assert make_arg_parser().parse_args(["--root-path", "/llm/"]).root_path == "/llm"


def test_raw_paths_do_not_pass_the_api_key(flagged_server: ServerProcess) -> None:
    """Request targets without the leading "/" (the HTTP server puts the root path /v in front of them as they
    come: "1/models" becomes /v1/models) never reach the API unauthenticated."""
    import socket

    host, port = flagged_server.base_url.removeprefix("http://").split(":")
    for target in ("1/models", "v1/models", "/1/models", "/v/v1/models"):
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            status = conn.recv(4096).split(b"\r\n", 1)[0]
        assert b" 200 " not in status, (target, status)
