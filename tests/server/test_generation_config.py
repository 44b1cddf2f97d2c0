"""A served model's generation_config.json sets what requests leave out, as with vLLM's default
`--generation-config auto`: its checkpoint here sets top_k 1 (greedy whatever the temperature) and 50 new
tokens, and `--override-generation-config` takes the tokens down to 4, which (as in vLLM) also caps what every
request asks for. The session's `tiny_server` serves the
same weights with no such file, for the greedy reference."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from helpers.tiny_models import with_generation_config

from .conftest import TINY_NAME, ServerProcess, read_sse

MAX_MODEL_LEN = 64
MESSAGES = [{"role": "user", "content": "Tell me about owls."}]
# An EOS id of the generation config beyond the tokenizer's (2), as Qwen's lists <|endoftext|> beside <|im_end|>
EXTRA_EOS = 5


@pytest.fixture(scope="module")
def defaults_server(launch_server: Callable[..., ServerProcess], tiny_llama_dir: str,
                    tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    model = with_generation_config(tiny_llama_dir, str(tmp_path_factory.mktemp("generation")),
                                   {"top_k": 1, "temperature": 1.3, "max_new_tokens": 50,
                                    "eos_token_id": [2, EXTRA_EOS]})
    return launch_server([model, "--served-model-name", TINY_NAME, "--max-model-len", str(MAX_MODEL_LEN),
                          "--kv-cache-memory", "64MiB", "--override-generation-config", '{"max_new_tokens": 4}'])


def _chat(server: ServerProcess, **fields: object) -> dict:
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"model": TINY_NAME, "messages": MESSAGES, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def _tokens(body: dict) -> list[str]:
    """The generated text as the tokenizer splits it (token strings of the reply)."""
    return [t["token"] for t in body["choices"][0]["logprobs"]["content"]]


def test_what_a_request_leaves_out_comes_from_the_generation_config(defaults_server: ServerProcess,
                                                                   tiny_server: ServerProcess) -> None:
    assert "default sampling settings from the model's generation config: max_tokens=4, temperature=1.3, " \
           "top_k=1" in defaults_server.log()
    assert "every request's max_tokens is capped at 4" in defaults_server.log()
    greedy = _chat(tiny_server, temperature=0, max_tokens=4, ignore_eos=True, logprobs=True)
    defaulted = _chat(defaults_server, ignore_eos=True, logprobs=True)
    assert _tokens(defaulted) == _tokens(greedy)
    assert defaulted["usage"]["completion_tokens"] == 4
    assert defaulted["choices"][0]["finish_reason"] == "length"

    # A request's own values win, but the override's max_new_tokens caps the length (as vLLM's
    # override_max_tokens: silently lowered); top_k off samples at the file's temperature.
    shorter = _chat(defaults_server, max_tokens=3, ignore_eos=True)
    assert shorter["usage"]["completion_tokens"] == 3
    for field in ("max_tokens", "max_completion_tokens"):
        capped = _chat(defaults_server, ignore_eos=True, **{field: 7})
        assert capped["usage"]["completion_tokens"] == 4 and capped["choices"][0]["finish_reason"] == "length"
    sampled = _chat(defaults_server, top_k=-1, seed=3, max_tokens=4, ignore_eos=True, logprobs=True)
    assert _tokens(sampled) != _tokens(greedy)

    # An explicit null is left out too; a min_tokens the default length or the cap cannot hold is a 400, not
    # a 500.
    assert _chat(defaults_server, max_tokens=None, ignore_eos=True)["usage"]["completion_tokens"] == 4
    for extra in ({}, {"max_tokens": 20}):
        too_few = httpx.post(defaults_server.base_url + "/v1/chat/completions", timeout=60,
                             json={"model": TINY_NAME, "messages": MESSAGES, "min_tokens": 10, **extra})
        assert too_few.status_code == 400 and too_few.json()["error"]["param"] == "min_tokens", too_few.text

    # Completions: max_tokens left out is the API's 16 (as in vLLM), capped at 4; null takes the generation
    # config's.
    def complete(server: ServerProcess, **fields: object) -> dict:
        response = httpx.post(server.base_url + "/v1/completions", timeout=60,
                              json={"model": TINY_NAME, "prompt": "Owls are", "ignore_eos": True, **fields})
        assert response.status_code == 200, response.text
        return response.json()

    assert complete(tiny_server)["usage"]["completion_tokens"] == 16
    assert complete(defaults_server)["usage"]["completion_tokens"] == 4
    assert complete(defaults_server, max_tokens=2)["usage"]["completion_tokens"] == 2
    completion = complete(defaults_server, max_tokens=None)
    assert completion["usage"]["completion_tokens"] == 4
    reference = complete(tiny_server, temperature=0, max_tokens=4)
    assert completion["choices"][0]["text"] == reference["choices"][0]["text"]


def test_a_generation_config_eos_id_is_the_stop_reason(defaults_server: ServerProcess) -> None:
    """vLLM adds the generation config's EOS ids beyond the tokenizer's to stop_token_ids: a choice ended by
    one has it as stop_reason (as the offline API gives it), in every API and streamed too; the tokenizer's
    own EOS is null."""
    url = defaults_server.base_url
    for eos, reason in ((EXTRA_EOS, EXTRA_EOS), (2, None)):
        forced = {"model": TINY_NAME, "max_tokens": 3, "logit_bias": {str(eos): 100}}
        for path, body in (("/v1/completions", {"prompt": "Owls are"}), ("/v1/chat/completions",
                                                                          {"messages": MESSAGES})):
            done = httpx.post(url + path, json={**forced, **body}, timeout=60).json()["choices"][0]
            assert (done["finish_reason"], done["stop_reason"]) == ("stop", reason), (path, done)
            with httpx.stream("POST", url + path, json={**forced, **body, "stream": True}, timeout=60) as response:
                last = [e for e in read_sse(response) if isinstance(e, dict) and e["choices"]][-1]["choices"][0]
            assert (last["finish_reason"], last["stop_reason"]) == ("stop", reason), (path, last)


def test_the_default_length_never_refuses_a_prompt_that_fits(defaults_server: ServerProcess) -> None:
    """A chat prompt two tokens short of --max-model-len: the default 4 tokens is cut to the 2 that fit
    (an explicit max_tokens of 4 is refused, as before)."""
    words = []
    while True:
        words.append("owl")
        messages = [{"role": "user", "content": " ".join(words)}]
        count = httpx.post(defaults_server.base_url + "/tokenize", timeout=30,
                           json={"model": TINY_NAME, "messages": messages}).json()["count"]
        if count >= MAX_MODEL_LEN - 2:
            break
    assert count == MAX_MODEL_LEN - 2, "one more word took two tokens; pick another word"
    body = {"model": TINY_NAME, "messages": messages, "ignore_eos": True}
    fitted = httpx.post(defaults_server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert fitted.status_code == 200, fitted.text
    assert fitted.json()["usage"]["completion_tokens"] == 2
    assert fitted.json()["choices"][0]["finish_reason"] == "length"
    refused = httpx.post(defaults_server.base_url + "/v1/chat/completions", json={**body, "max_tokens": 4},
                         timeout=60)
    assert refused.status_code == 400 and "max_tokens" in json.dumps(refused.json())


def test_each_completion_prompt_gets_its_own_default_length(defaults_server: ServerProcess) -> None:
    """Several prompts in one completions request with max_tokens null: each prompt's default length is cut
    to what the context leaves it, as vLLM resolves it per prompt; the longest prompt's room cut them all."""
    body = {"model": TINY_NAME, "prompt": [[10, 11, 12], [10] * (MAX_MODEL_LEN - 2)], "max_tokens": None,
            "ignore_eos": True, "logprobs": 0}
    response = httpx.post(defaults_server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    lengths = [len(c["logprobs"]["tokens"]) for c in choices]
    assert lengths == [4, 2], lengths  # the override's 4; the long prompt's 2 that fit
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    assert response.json()["usage"]["completion_tokens"] == 6


def test_a_bad_override_stops_the_server_at_start(launch_server: Callable[..., ServerProcess],
                                                  tiny_llama_dir: str) -> None:
    server = launch_server([tiny_llama_dir, "--max-model-len", "64", "--kv-cache-memory", "64MiB",
                            "--override-generation-config", '{"temprature": 0.5}'], wait=False)
    assert server.wait_exit(120) != 0
    assert "unknown setting(s) temprature" in server.log()
