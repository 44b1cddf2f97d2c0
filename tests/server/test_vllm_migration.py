"""A vLLM deployment moved to kvserve: VLLM_API_KEY keeps the server closed (unless KVSERVE_API_KEY is set,
even empty), other VLLM_* variables and vLLM's harmless flags are reported at start, --max-model-len auto,
--enable-force-include-usage, --disable-fastapi-docs, the start-up line at the default host, and HTTPS with
--ssl-keyfile / --ssl-certfile."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from .conftest import STARTUP_TIMEOUT_S, ServerProcess, read_sse

VLLM_KEY = "key-from-vllm-env"
FLAGS = ["--served-model-name", "tiny", "--max-model-len", "64", "--kv-cache-memory", "64MiB"]
AUTO_BLOCKS = 5
AUTO_LEN = AUTO_BLOCKS * 16  # the length --max-model-len auto settles on: what those blocks hold


def _certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 made with the openssl command (the test skips without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True, timeout=60)
    return key, cert


@pytest.fixture(scope="module")
def servers(launch_server: Callable[..., ServerProcess], tiny_llama_dir: str,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServerProcess]:
    """Both servers launched together (their start-ups overlap), waited for by the tests."""
    # KVSERVE_API_KEY unset (set, even empty, it would decide and VLLM_API_KEY would not be read)
    vllm_env = {"VLLM_API_KEY": VLLM_KEY, "KVSERVE_API_KEY": None, "VLLM_USE_V1": "1",
                "VLLM_LOGGING_LEVEL": "DEBUG"}
    # --max-model-len auto with a KV cache of AUTO_BLOCKS blocks, fewer tokens than the tiny model's 256 positions
    vllm_flags = ["--served-model-name", "tiny", "--max-model-len", "auto", "--num-gpu-blocks-override",
                  str(AUTO_BLOCKS)]
    launched = {"vllm": launch_server([tiny_llama_dir, *vllm_flags, "--swap-space", "4", "--enable-force-include-usage",
                                       "--disable-fastapi-docs"], wait=False, env=vllm_env)}
    key, cert = _certificate(tmp_path_factory.mktemp("tls"))
    # the certificate is its own CA: the server asks for it from clients too (--ssl-cert-reqs 2: required)
    launched["https"] = launch_server([tiny_llama_dir, *FLAGS, "--ssl-keyfile", str(key), "--ssl-certfile",
                                       str(cert), "--ssl-ca-certs", str(cert), "--ssl-cert-reqs", "2"],
                                      wait=False, env={"KVSERVE_API_KEY": "", "VLLM_API_KEY": "ignored-key"})
    launched["https"].client_cert = (str(cert), str(key))  # type: ignore[attr-defined]
    return launched


def test_a_vllm_deployments_environment_and_flags(servers: dict[str, ServerProcess]) -> None:
    server = servers["vllm"].wait_ready()
    base, auth = server.base_url, {"Authorization": f"Bearer {VLLM_KEY}"}
    # VLLM_API_KEY (no --api-key, no KVSERVE_API_KEY): the API is closed to requests without it
    assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer other"}, timeout=10).status_code == 401
    assert httpx.get(base + "/v1/models", headers=auth, timeout=10).status_code == 200

    log = server.log()
    assert "API key from VLLM_API_KEY (no --api-key, KVSERVE_API_KEY unset)" in log and VLLM_KEY not in log
    assert ("vLLM environment variables kvserve does not read: VLLM_LOGGING_LEVEL (use KVSERVE_LOGGING_LEVEL), "
            "VLLM_USE_V1") in log
    assert log.count("--swap-space ignored: kvserve preempts requests by recomputing them") == 1
    assert "on http://127.0.0.1:" in log and "(this machine only; --host 0.0.0.0 to accept others)" in log

    # --enable-force-include-usage: a stream that did not ask for usage ends with it anyway
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/chat/completions", headers=auth, json=chat, timeout=60) as response:
        events = read_sse(response)
    assert events[-1] == "[DONE]" and isinstance(events[-2], dict), events
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-2]["choices"] == []
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", headers=auth, json=completion, timeout=60) as response:
        events = read_sse(response)
    assert isinstance(events[-2], dict) and events[-2]["usage"]["completion_tokens"] == 2, events

    # --disable-fastapi-docs
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(base + path, headers=auth, timeout=10).status_code == 404, path

    # --max-model-len auto: the API serves the length the engine settled on once the KV cache was sized
    models = httpx.get(base + "/v1/models", headers=auth, timeout=10).json()
    assert models["data"][0]["max_model_len"] == AUTO_LEN, models
    assert f"max_model_len is lowered to {AUTO_LEN}" in server.log()
    url = base + "/v1/completions"
    ok = httpx.post(url, headers=auth, json={"model": "tiny", "prompt": [1] * (AUTO_LEN - 1), "max_tokens": 1,
                                             "temperature": 0}, timeout=60)
    assert ok.status_code == 200, ok.text
    too_long = httpx.post(url, headers=auth, json={"model": "tiny", "prompt": [1] * AUTO_LEN, "max_tokens": 1},
                          timeout=60)
    assert too_long.status_code == 400, too_long.text
    assert f"maximum context length is {AUTO_LEN} tokens" in too_long.json()["error"]["message"]
    over = httpx.post(url, headers=auth, json={"model": "tiny", "prompt": [1] * 10, "max_tokens": AUTO_LEN},
                      timeout=60)
    assert over.status_code == 400, over.text
    tokenized = httpx.post(base + "/tokenize", headers=auth, json={"model": "tiny", "prompt": "Hi"}, timeout=10)
    assert tokenized.json()["max_model_len"] == AUTO_LEN


def test_https_with_a_self_signed_certificate(servers: dict[str, ServerProcess]) -> None:
    server = servers["https"]
    base = server.base_url.replace("http://", "https://")
    client = httpx.Client(verify=False, cert=server.client_cert, timeout=60)  # type: ignore[attr-defined]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        assert server.proc.poll() is None, f"server exited during start-up:\n{server.log()}"
        try:
            if client.get(base + "/health", timeout=2.0).status_code == 200:
                server.engine_pid = server._find_engine_pid()  # stopped with it at the end
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not healthy over HTTPS within {STARTUP_TIMEOUT_S} s:\n{server.log()}"
        time.sleep(0.2)
    # KVSERVE_API_KEY set empty: no key, though VLLM_API_KEY is set too (the request carries no Authorization)
    assert "no API key: KVSERVE_API_KEY is set empty (VLLM_API_KEY, also set, is not read)" in server.log()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = client.post(base + "/v1/chat/completions", json=chat)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1, reply.text
    with pytest.raises(httpx.HTTPError):  # without a client certificate (--ssl-cert-reqs 2)
        httpx.get(base + "/health", verify=False, timeout=5)
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
        httpx.get(server.base_url + "/health", timeout=5)
    assert "on https://127.0.0.1:" in server.log()
    # SIGTERM with the client's kept-alive connection open and idle: the server stops. It waited 30 s for the
    # client's TLS close_notify, which an idle client does not send, and was killed by this fixture's timeout.
    server.terminate()
    try:
        assert server.proc.wait(timeout=15) == 0, server.log()
    finally:
        client.close()
