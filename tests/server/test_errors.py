"""Every error case returns its status and OpenAI's error body {"error": {message, type, param, code}}."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import (
    API_KEY,
    STRICT_ALIAS,
    STRICT_CHAT_TEMPLATE,
    STRICT_MAX_BODY_BYTES,
    STRICT_MAX_MODEL_LEN,
    STRICT_NAME,
    ServerProcess,
    assert_openai_error,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(strict_server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=strict_server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def test_valid_requests_pass(http):
    """The baseline the error cases below deviate from."""
    chat = http.post("/v1/chat/completions", json={"model": STRICT_NAME, "messages": CHAT, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    alias = http.post("/v1/completions", json={"model": STRICT_ALIAS, "prompt": "hi", "max_tokens": 2})
    assert alias.status_code == 200 and alias.json()["model"] == STRICT_ALIAS


def test_malformed_json_and_non_object_body(http):
    bad = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert "JSON" in assert_openai_error(bad, 400)["message"]
    for body in (b"[1, 2]", b'"text"', b"null", b""):
        assert_openai_error(http.post("/v1/completions", content=body,
                                      headers={"content-type": "application/json"}), 400)


def test_a_json_body_sent_as_a_form_names_the_content_type(http):
    # curl's -d without -H 'Content-Type: application/json' sends application/x-www-form-urlencoded: FastAPI then
    # does not read the body as JSON (as in vLLM), and the error says why instead of calling it no object.
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    error = assert_openai_error(http.post("/v1/chat/completions", content=body,
                                          headers={"content-type": "application/x-www-form-urlencoded"}), 400)
    assert "Content-Type: application/json" in error["message"] and "x-www-form-urlencoded" in error["message"]
    # A JSON type with parameters, or a +json type, is read as JSON.
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        ok = http.post("/v1/chat/completions", content=body, headers={"content-type": content_type})
        assert ok.status_code == 200, (content_type, ok.text)
    # No Content-Type: FastAPI releases differ (recent ones read no JSON); either answer, or the hint.
    bare = http.post("/v1/chat/completions", content=body)
    assert bare.status_code == 200 or "Content-Type given: none" in assert_openai_error(bare, 400)["message"]
    # A JSON body that is no object keeps its own message.
    not_object = http.post("/v1/chat/completions", content=b"[1]", headers={"content-type": "application/json"})
    assert "Content-Type" not in assert_openai_error(not_object, 400)["message"]


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", "hot"),
    ("max_tokens", "many"),
    ("n", 1.5),
    ("stop", 5),
    ("logprobs", "yes"),
    ("stream", "maybe"),
    ("messages", "hello"),
    ("messages", []),
    ("stream_options", [1]),
])
def test_wrong_types(http, field, value):
    body = {"messages": CHAT, "max_tokens": 2, field: value}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, field)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.5),
    ("top_p", 1.5),
    ("top_p", 0),
    ("top_k", -2),
    ("min_p", 2.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0),
    ("n", 0),
    ("n", 100000),
    ("max_tokens", 0),
    ("max_tokens", -4),
    ("seed", 2**64),
    ("logprobs", 21),
    ("logit_bias", {"not-a-token": 1}),
    ("logit_bias", {"99999999": 1}),
    ("logit_bias", {"5": 1000}),
    ("stop", [""]),
    ("min_tokens", 5),  # > max_tokens (2)
    ("stop_token_ids", [-1]),
])
def test_out_of_range_completion_parameters(http, field, value):
    body = {"prompt": "hello", "max_tokens": 2, field: value}
    assert_openai_error(http.post("/v1/completions", json=body), 400, field)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"99999999": 1}),
    ("allowed_token_ids", [99999999]),
])
def test_token_ids_past_the_vocabulary_are_a_400_streamed_too(http, path, body, field, value):
    """Refused before the response starts, as unstreamed: not a 200 stream whose one event is the error."""
    for stream in (False, True):
        response = http.post(path, json={**body, "max_tokens": 2, "stream": stream, field: value})
        assert "out of range" in assert_openai_error(response, 400, field)["message"]


# A checkpoint whose model has fewer token ids than its tokenizer (49,152): the engine core refuses a prompt or
# allowed_token_ids past the model's, and a logit_bias there changes nothing.
SMALL_VOCAB = 48000
PAST_THE_MODEL = 49100  # " CMOS" to the tokenizer
CMOS = "hello CMOS"  # a text whose tokens include PAST_THE_MODEL


@pytest.fixture(scope="module")
def small_vocab_http(launch_server, tiny_model_dir) -> httpx.Client:
    server = launch_server([tiny_model_dir("llama", vocab_size=SMALL_VOCAB), "--max-model-len", "64",
                            "--kv-cache-memory", "32MiB", "--disable-uvicorn-access-log"])
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [1, PAST_THE_MODEL]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [1, PAST_THE_MODEL]]}, "prompt"),
    ("/v1/completions", {"prompt": CMOS}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": CMOS}]}, "messages"),
    ("/v1/responses", {"input": CMOS}, "input"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, PAST_THE_MODEL]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": [PAST_THE_MODEL]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(PAST_THE_MODEL): 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {str(PAST_THE_MODEL): 5}}, "logit_bias"),
])
def test_token_ids_past_the_models_vocabulary_are_a_400_streamed_too(small_vocab_http, path, body, param):
    """The API process knows the model's vocabulary (from the engine core's EngineReady), not only the
    tokenizer's: ids between the two are refused before the response starts, streamed as unstreamed (they were a
    200 stream whose one event was the core's error; a logit_bias was ignored)."""
    for stream in (False, True):
        response = small_vocab_http.post(path, json={**body, "max_tokens": 2, "stream": stream})
        error = assert_openai_error(response, 400, param)
        assert f"out of range [0, {SMALL_VOCAB}) (the model's vocabulary size)" in error["message"], error


def test_token_ids_within_the_models_vocabulary_are_served(small_vocab_http):
    last = SMALL_VOCAB - 1
    bodies = [
        {"prompt": [1, last], "allowed_token_ids": [5, last], "logit_bias": {str(last): 5}},
        {"prompt": "hi", "bad_words": ["CMOS", " CMOS"]},  # tokens the model lacks: it never samples them anyway
    ]
    for body in bodies:
        for stream in (False, True):
            response = small_vocab_http.post("/v1/completions", json={**body, "max_tokens": 3, "stream": stream,
                                                                      "return_token_ids": True})
            assert response.status_code == 200, response.text
            if not stream:
                token_ids = response.json()["choices"][0]["token_ids"]
                assert len(token_ids) == 3 and ("allowed_token_ids" not in body or set(token_ids) <= {5, last})
    assert small_vocab_http.post("/detokenize", json={"tokens": [PAST_THE_MODEL]}).json() == {"prompt": " CMOS"}


def test_chat_only_parameters(http):
    bad_top = {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 21}
    assert_openai_error(http.post("/v1/chat/completions", json=bad_top), 400, "top_logprobs")
    without_logprobs = {"messages": CHAT, "max_tokens": 2, "top_logprobs": 2}
    assert_openai_error(http.post("/v1/chat/completions", json=without_logprobs), 400, "top_logprobs")
    zero = http.post("/v1/chat/completions", json={**without_logprobs, "top_logprobs": 0})  # taken, as vLLM
    assert zero.status_code == 200 and zero.json()["choices"][0]["logprobs"] is None, zero.text
    bad_completion_tokens = {"messages": CHAT, "max_completion_tokens": 0}
    assert_openai_error(http.post("/v1/chat/completions", json=bad_completion_tokens), 400, "max_completion_tokens")
    options_without_stream = {"messages": CHAT, "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert_openai_error(http.post("/v1/chat/completions", json=options_without_stream), 400, "stream_options")


def test_empty_stream_options_without_stream_are_taken(http):
    """vLLM refuses stream_options without stream only when they set something: clients that always send
    `stream_options: {}` get their answer."""
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "hi"})):
        response = http.post(path, json={**body, "max_tokens": 2, "stream_options": {}})
        assert response.status_code == 200, response.text
        refused = http.post(path, json={**body, "max_tokens": 2, "stream_options": {"include_usage": False}})
        assert_openai_error(refused, 400, "stream_options")


def test_non_finite_numbers_are_refused(http):
    # Python's json module (the server's) parses NaN and Infinity; they must not reach the sampler.
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + literal + b"}"
        assert_openai_error(http.post("/v1/completions", content=body,
                                      headers={"content-type": "application/json"}), 400, "temperature")


def test_unsupported_features_are_refused(http):
    cases = [
        # tools make tool_choice "auto", which this server (no --enable-auto-tool-choice) does not serve
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"chat_template": "{{ 1 }}"}, "chat_template"),
    ]
    for extra, param in cases:
        body = {"messages": CHAT, "max_tokens": 2, **extra}
        assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": image, "max_tokens": 2}), 400,
                        "messages")
    assert_openai_error(http.post("/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 2}), 400,
                        "suffix")
    assert_openai_error(http.post("/v1/completions", json={"prompt": "a", "best_of": 3, "max_tokens": 2}), 400,
                        "best_of")


def test_prompt_too_long_says_both_numbers(http, tiny_tokenizer):
    prompt = " ".join(["word"] * 60)
    num_prompt_tokens = len(tiny_tokenizer(prompt)["input_ids"])
    assert num_prompt_tokens > STRICT_MAX_MODEL_LEN
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), 400, "prompt")
    assert str(STRICT_MAX_MODEL_LEN) in error["message"] and str(num_prompt_tokens) in error["message"]
    # As token ids too, and in chat.
    ids = list(range(100, 100 + STRICT_MAX_MODEL_LEN))
    assert_openai_error(http.post("/v1/completions", json={"prompt": ids}), 400, "prompt")
    long_chat = [{"role": "user", "content": prompt}]
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": long_chat}), 400, "messages")


def test_prompt_plus_max_tokens_over_limit_is_refused_not_truncated(http, tiny_tokenizer):
    num_prompt_tokens = len(tiny_tokenizer("hello there")["input_ids"])
    max_tokens = STRICT_MAX_MODEL_LEN - num_prompt_tokens + 1
    error = assert_openai_error(
        http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": max_tokens}), 400, "max_tokens")
    message = error["message"]
    assert str(STRICT_MAX_MODEL_LEN) in message and str(num_prompt_tokens) in message and str(max_tokens) in message
    # Exactly at the limit is fine.
    ok = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": max_tokens - 1})
    assert ok.status_code == 200, ok.text


def test_min_tokens_beyond_the_contexts_room_is_refused_when_max_tokens_is_null(http, tiny_tokenizer):
    """max_tokens null is what the context leaves (vLLM's rule): a min_tokens above that is a 400 naming
    min_tokens, as it is against an explicit max_tokens, not a reply of fewer tokens than it asked for."""
    room = STRICT_MAX_MODEL_LEN - len(tiny_tokenizer("hello there")["input_ids"])
    body = {"prompt": "hello there", "max_tokens": None, "ignore_eos": True}
    error = assert_openai_error(http.post("/v1/completions", json={**body, "min_tokens": room + 1}), 400, "min_tokens")
    assert str(room) in error["message"] and str(room + 1) in error["message"]
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": None, "min_tokens": 40})
    assert_openai_error(chat, 400, "min_tokens")
    fits = http.post("/v1/completions", json={**body, "min_tokens": room})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == room, fits.text


def test_bad_token_ids_and_empty_prompt(http):
    assert_openai_error(http.post("/v1/completions", json={"prompt": [1, 10**9], "max_tokens": 1}), 400, "prompt")
    assert_openai_error(http.post("/v1/completions", json={"prompt": "", "max_tokens": 1}), 400, "prompt")
    assert_openai_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [-5], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, -5]], "max_tokens": 1}, "prompt"),
    ("/detokenize", {"tokens": [1, -5]}, "tokens"),
])
def test_a_negative_token_id_is_named_with_the_vocabularys_range(http, path, body, param):
    """As one past the vocabulary is: the message names the id and the range (it was pydantic's list of every
    form the prompt failed to match)."""
    error = assert_openai_error(http.post(path, json=body), 400, param)
    assert error["message"].startswith("token id -5 is out of range [0, "), error


def test_api_key(strict_server):
    url = strict_server.base_url
    body = {"prompt": "hi", "max_tokens": 1}
    assert_openai_error(httpx.post(url + "/v1/completions", json=body), 401)
    assert_openai_error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}),
                        401)
    assert_openai_error(httpx.get(url + "/v1/models", headers={"Authorization": f"Basic {API_KEY}"}), 401)
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # health checks carry no key
    client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0).models.list().data[0].id == STRICT_NAME


def test_unknown_model_and_route(http):
    error = assert_openai_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404, "model")
    assert "gpt-4" in error["message"]
    assert_openai_error(http.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT}), 404, "model")
    assert_openai_error(http.post("/tokenize", json={"model": "nope", "prompt": "hi"}), 404, "model")
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_routes_it_lacks_say_what_it_serves_and_a_model_can_be_retrieved(http):
    for method, path in (("POST", "/v1/embeddings"), ("POST", "/v1/conversations"),
                         ("GET", "/v1/nothing-here")):
        error = assert_openai_error(http.request(method, path, json={"model": STRICT_NAME, "input": "hi"}), 404)
        assert error["message"].startswith(f"{method} {path} is not served here: kvserve serves text generation: "
                                           "POST /v1/chat/completions, /v1/completions and /v1/responses"), error
    # OpenAI's "retrieve model" (the openai client's models.retrieve), for each served name.
    for name in (STRICT_NAME, STRICT_ALIAS):
        card = http.get(f"/v1/models/{name}")
        assert card.status_code == 200 and card.json()["id"] == name and card.json()["object"] == "model", card.text
    assert "`nope` does not exist" in assert_openai_error(http.get("/v1/models/nope"), 404, "model")["message"]
    assert_openai_error(http.get("/v1/models/"), 404, "model")


def test_request_values_that_utf8_cannot_carry_get_their_own_error_not_a_500(http):
    """A lone surrogate (JSON's "\\ud800" escape) quoted in an error message: the body escapes it."""
    body = b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'
    wrong_model = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert assert_openai_error(wrong_model, 404, "model")["message"] == "The model `\ud800` does not exist."
    assert b"\\ud800" in wrong_model.content
    accented = assert_openai_error(http.post("/v1/completions", json={"model": "modèle", "prompt": "hi"}), 404)
    assert accented["message"] == "The model `modèle` does not exist."
    assert "modèle".encode() in http.post("/v1/completions", json={"model": "modèle", "prompt": "hi"}).content
    stop = http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud800"]}',
                     headers={"content-type": "application/json"})
    assert_openai_error(stop, 400, "stop")


def test_messages_name_the_field_as_the_request_spelled_it(http):
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "messages": CHAT, "max_completion_tokens": 0}), 400, "max_completion_tokens")
    assert error["message"] == "max_completion_tokens must be an integer >= 1, got 0"
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "messages": CHAT, "max_completion_tokens": 3, "min_tokens": 5}), 400, "min_tokens")
    assert error["message"] == "min_tokens (5) must be <= max_completion_tokens (3)"
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 3, "min_tokens": 5}), 400, "min_tokens")
    assert error["message"] == "min_tokens (5) must be <= max_tokens (3)"
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 2}), 400, "messages")
    assert error["message"] == "a content part of type 'text' needs its text as a string, got '(none)'"
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 2}), 400, "messages")
    assert error["message"] == "a content part of type 'text' needs its text as a string, got 5"


def test_body_over_limit(http):
    big = {"prompt": "x" * (STRICT_MAX_BODY_BYTES + 10), "max_tokens": 1}
    assert_openai_error(http.post("/v1/completions", json=big), 413)

    def chunked():  # no content-length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(STRICT_MAX_BODY_BYTES // 1000 + 2):
            yield b"y" * 1000
        yield b'"}'

    assert_openai_error(http.post("/v1/completions", content=chunked(),
                                  headers={"content-type": "application/json"}), 413)


def test_chat_template_flag_overrides_the_tokenizers(http, tiny_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    expected_text = tiny_tokenizer.apply_chat_template(messages, chat_template=STRICT_CHAT_TEMPLATE, tokenize=False,
                                                       add_generation_prompt=True)
    assert expected_text == "system: be brief\nuser: hi there\nassistant:"
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == tiny_tokenizer(expected_text, add_special_tokens=False)["input_ids"]
    out = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert out["usage"]["prompt_tokens"] == len(tokens)
