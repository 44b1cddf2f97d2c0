"""`kvserve serve --max-model-len auto` (vLLM's): the API process serves the length the engine settled on once
the KV cache was sized, not the model's own."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from .conftest import TINY_NAME, ServerProcess

NUM_BLOCKS = 5  # x 16 tokens: fewer than the tiny model's 256 positions
HELD = NUM_BLOCKS * 16


def test_served_length_is_the_one_the_kv_cache_holds(launch_server: Callable[..., ServerProcess],
                                                     tiny_llama_dir: str) -> None:
    server = launch_server([tiny_llama_dir, "--served-model-name", TINY_NAME, "--max-model-len", "auto",
                            "--num-gpu-blocks-override", str(NUM_BLOCKS), "--disable-uvicorn-access-log"])
    models = httpx.get(server.base_url + "/v1/models", timeout=10).json()
    assert models["data"][0]["max_model_len"] == HELD, models
    assert f"max_model_len is lowered to {HELD}" in server.log()
    url = server.base_url + "/v1/completions"
    ok = httpx.post(url, json={"model": TINY_NAME, "prompt": [1] * (HELD - 1), "max_tokens": 1,
                               "temperature": 0}, timeout=60)
    assert ok.status_code == 200, ok.text
    too_long = httpx.post(url, json={"model": TINY_NAME, "prompt": [1] * HELD, "max_tokens": 1}, timeout=60)
    assert too_long.status_code == 400, too_long.text
    assert f"maximum context length is {HELD} tokens" in too_long.json()["error"]["message"]
    over = httpx.post(url, json={"model": TINY_NAME, "prompt": [1] * 10, "max_tokens": HELD}, timeout=60)
    assert over.status_code == 400, over.text
    tokenized = httpx.post(server.base_url + "/tokenize", json={"model": TINY_NAME, "prompt": "Hi"}, timeout=10)
    assert tokenized.json()["max_model_len"] == HELD
