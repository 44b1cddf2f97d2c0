"""`kvserve serve org/name`: a Hugging Face repo id already in the local HF cache (HF_HUB_CACHE) is served from
its snapshot, under the id as given (as vLLM), and --revision picks a branch's snapshot."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from helpers.hf_cache import add_snapshot

from .conftest import ServerProcess

REPO = "tiny-org/tiny-llama"


def test_serve_a_cached_repo_id(launch_server: Callable[..., ServerProcess], tiny_model_dir: Callable[..., str],
                                tmp_path_factory) -> None:
    cache = str(tmp_path_factory.mktemp("hf-hub"))
    add_snapshot(cache, REPO, "a" * 40, tiny_model_dir("llama"), refs=("main",))
    v2 = add_snapshot(cache, REPO, "b" * 40, tiny_model_dir("llama", seed=1), refs=("v2",))
    server = launch_server([REPO, "--revision", "v2", "--max-model-len", "64", "--kv-cache-memory", "32MiB",
                            "--disable-uvicorn-access-log"], env={"HF_HUB_CACHE": cache})
    models = httpx.get(server.base_url + "/v1/models", timeout=10)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [REPO]
    assert f"using the Hugging Face cache's snapshot {v2}" in server.log()
    done = httpx.post(server.base_url + "/v1/completions", timeout=60,
                      json={"model": REPO, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert done.status_code == 200 and done.json()["model"] == REPO
