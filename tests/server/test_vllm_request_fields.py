"""Request fields as vLLM's server takes them: vLLM fields kvserve does not implement are refused by name
(not served without them), nulls and neutral values pass, bad_words are served, any chat role and the Responses API's text parts
are accepted, /tokenize renders what chat renders, and completions' top_logprobs hold the sampled token."""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve.entrypoints.openai.protocol import UNSUPPORTED_FIELDS

from .conftest import TINY_NAME, ServerProcess, read_sse

CHAT = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3}
COMPLETION = {"model": TINY_NAME, "prompt": "Hello there", "max_tokens": 3}
ACTIVE = {"use_beam_search": True,
          "logits_processors": ["x"], "prompt_embeds": "AAAA",
          "functions": [{"name": "f", "parameters": {}}], "function_call": "auto"}


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes non-ASCII (a lone surrogate as \\ud800, which UTF-8 could not carry)
    return httpx.post(server.base_url + path, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


def test_every_unsupported_field_has_a_case() -> None:
    assert set(ACTIVE) == set(UNSUPPORTED_FIELDS)


@pytest.mark.parametrize("field", sorted(ACTIVE))
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
def test_unsupported_vllm_fields_are_refused_by_name(tiny_server: ServerProcess, path: str, body: dict,
                                                     field: str) -> None:
    response = _post(tiny_server, path, {**body, field: ACTIVE[field]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field and "not supported" in response.json()["error"]["message"]


def test_neutral_values_and_nulls_pass(tiny_server: ServerProcess) -> None:
    neutral = {"use_beam_search": False, "prompt_logprobs": None, "bad_words": [], "truncate_prompt_tokens": None,
               "return_token_ids": 0, "return_tokens_as_token_ids": False, "logits_processors": None,
               "structured_outputs": None, "allowed_token_ids": None, "priority": 0, "function_call": "none",
               "guided_decoding_backend": "xgrammar", "length_penalty": 1.0, "n": None, "user": "u1",
               "metadata": {"a": "b"}}
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {**COMPLETION, "echo": None})):
        response = _post(tiny_server, path, {**body, **neutral})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 1
    assert _post(tiny_server, "/v1/completions", {**COMPLETION, "response_format": {"type": "text"}}).status_code == 200
    for response_format in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "structural_tag"}, "json", {}):
        refused = _post(tiny_server, "/v1/completions", {**COMPLETION, "response_format": response_format})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
    echo = _post(tiny_server, "/v1/chat/completions", {**CHAT, "echo": True})
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo"


def test_bad_words_are_served(tiny_server: ServerProcess, tiny_tokenizer) -> None:
    """A word the model writes (a generated token that is the word's own token), banned with bad_words, is
    not written; bad_words that are not words are a 400 naming the field."""
    body = {**COMPLETION, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = _post(tiny_server, "/v1/completions", body).json()["choices"][0]["token_ids"]

    def own_token(token: int) -> str | None:
        word = tiny_tokenizer.decode([token]).strip()
        forms = [tiny_tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word)]
        return word if word.isalpha() and [token] in forms and len(forms[0]) == len(forms[1]) else None

    token, word = next((t, w) for t in plain if (w := own_token(t)) is not None)
    banned = _post(tiny_server, "/v1/completions", {**body, "bad_words": [word]})
    assert banned.status_code == 200, banned.text
    assert token not in banned.json()["choices"][0]["token_ids"]
    for bad in ([""], "word", [3], ["a\ud800b"]):  # the last: a lone surrogate, which no tokenizer takes
        for path, request in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            refused = _post(tiny_server, path, {**request, "bad_words": bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words", refused.text


def test_text_a_tokenizer_cannot_take_is_a_400(tiny_server: ServerProcess) -> None:
    """A lone surrogate (valid in JSON's \\u escapes, not in UTF-8) in a prompt: a 400, not a 500."""
    for path, body in (("/v1/completions", {**COMPLETION, "prompt": "a\ud800b"}),
                       ("/tokenize", {"model": TINY_NAME, "prompt": "a\ud800b"})):
        refused = _post(tiny_server, path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
    messages = [{"role": "user", "content": "a\ud800b"}]
    for path, body in (("/v1/chat/completions", {**CHAT, "messages": messages}),
                       ("/tokenize", {"model": TINY_NAME, "messages": messages})):
        refused = _post(tiny_server, path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text
        assert "surrogates not allowed" in refused.json()["error"]["message"]


def test_priority_needs_the_priority_policy(tiny_server: ServerProcess) -> None:
    """The tiny server schedules first come, first served: a priority other than 0 is a 400 naming the flag,
    streamed or not, before anything runs."""
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        for stream in (False, True):
            refused = _post(tiny_server, path, {**body, "priority": 3, "stream": stream})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
            assert "--scheduling-policy priority" in refused.json()["error"]["message"]
        assert _post(tiny_server, path, {**body, "priority": 0}).status_code == 200


def test_return_tokens_as_token_ids(tiny_server: ServerProcess) -> None:
    """Logprobs' tokens (and completions' top_logprobs keys) as "token_id:<id>", the ids of the tokens
    generated; completions' text_offset counts those strings (as vLLM's); streamed as not."""
    flags = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
    chat = _post(tiny_server, "/v1/chat/completions", {**CHAT, **flags, "logprobs": True, "top_logprobs": 2})
    choice = chat.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    # `bytes` stay the tokens' own bytes
    as_text = _post(tiny_server, "/v1/chat/completions", {**CHAT, **flags, "logprobs": True, "top_logprobs": 2,
                                                          "return_tokens_as_token_ids": False})
    text_content = as_text.json()["choices"][0]["logprobs"]["content"]
    assert [c["bytes"] for c in content] == [c["bytes"] for c in text_content]
    assert [[t["bytes"] for t in c["top_logprobs"]] for c in content] == \
        [[t["bytes"] for t in c["top_logprobs"]] for c in text_content]
    for c in text_content:  # a token's own bytes: its text's where whole, part of a character's where U+FFFD
        assert bytes(c["bytes"]) != "\ufffd".encode() if "\ufffd" in c["token"] else c["bytes"] == list(c["token"].encode())
    streamed_tokens = []
    chat_stream = {**CHAT, **flags, "logprobs": True, "top_logprobs": 2, "stream": True}
    with httpx.stream("POST", tiny_server.base_url + "/v1/chat/completions", json=chat_stream, timeout=60) as r:
        for event in read_sse(r):
            if isinstance(event, dict) and event["choices"] and event["choices"][0].get("logprobs"):
                streamed_tokens += [c["token"] for c in event["choices"][0]["logprobs"]["content"]]
    assert streamed_tokens == [c["token"] for c in content]
    body = {**COMPLETION, **flags, "logprobs": 2}
    full = _post(tiny_server, "/v1/completions", body).json()["choices"][0]
    logprobs = full["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in full["token_ids"]]
    assert all(key.startswith("token_id:") for top in logprobs["top_logprobs"] for key in top)
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(logprobs["tokens"]))]
    streamed: dict[str, list] = {"tokens": [], "text_offset": []}
    with httpx.stream("POST", tiny_server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for event in read_sse(r):
            if isinstance(event, dict) and event["choices"] and event["choices"][0]["logprobs"]:
                for key in streamed:
                    streamed[key] += event["choices"][0]["logprobs"][key]
    assert streamed == {key: logprobs[key] for key in streamed}
    plain = _post(tiny_server, "/v1/completions", {**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert not any(t.startswith("token_id:") for t in plain["logprobs"]["tokens"])
    echoed = _post(tiny_server, "/v1/completions", {**body, "echo": True}).json()["choices"][0]
    prompt_ids = echoed["prompt_token_ids"]
    assert echoed["logprobs"]["tokens"] == [f"token_id:{t}" for t in prompt_ids + echoed["token_ids"]]
    assert echoed["logprobs"]["token_logprobs"][0] is None  # the prompt's first token, labelled all the same


def test_any_role_and_responses_text_parts(tiny_server: ServerProcess) -> None:
    def prompt_tokens(messages: list[dict]) -> int:
        response = _post(tiny_server, "/v1/chat/completions", {**CHAT, "messages": messages})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens([{"role": "user", "content": "Hello there"}])
    for kind in ("input_text", "output_text", "text"):
        assert prompt_tokens([{"role": "user", "content": [{"type": kind, "text": "Hello there"}]}]) == plain
    assert prompt_tokens([{"role": "ipython", "content": "42"}, {"role": "user", "content": "Hello there"}]) > plain
    refusal = [{"role": "user", "content": "Hello there"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
               {"role": "user", "content": "Hello there"}]
    as_text = [refusal[0], {"role": "assistant", "content": "I cannot."}, refusal[2]]
    assert prompt_tokens(refusal) == prompt_tokens(as_text)
    no_text = _post(tiny_server, "/v1/chat/completions",
                    {**CHAT, "messages": [{"role": "user", "content": [{"type": "input_text"}]}]})
    assert no_text.status_code == 400 and "text as a string" in no_text.json()["error"]["message"]
    empty_role = _post(tiny_server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "", "content": "x"}]})
    assert empty_role.status_code == 400


def test_tokenize_renders_what_chat_renders(tiny_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "List three colours."}, {"role": "assistant", "content": "1. Red\n2."}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    chat = _post(tiny_server, "/v1/chat/completions", {**CHAT, "messages": messages, **fields})
    assert chat.status_code == 200, chat.text
    tokenized = _post(tiny_server, "/tokenize", {"model": TINY_NAME, "messages": messages, **fields}).json()
    assert tokenized["count"] == chat.json()["usage"]["prompt_tokens"]
    closed = _post(tiny_server, "/tokenize", {"model": TINY_NAME, "messages": messages,
                                              "add_generation_prompt": False}).json()
    assert closed["count"] > tokenized["count"]  # the final message closed by the template's end marker
    both = _post(tiny_server, "/tokenize", {"model": TINY_NAME, "messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_completion_top_logprobs_hold_the_sampled_token(tiny_server: ServerProcess) -> None:
    body = {**COMPLETION, "max_tokens": 12, "temperature": 1.5, "seed": 4, "ignore_eos": True}
    one = _post(tiny_server, "/v1/completions", {**body, "logprobs": 1}).json()["choices"][0]["logprobs"]
    for token, logprob, top in zip(one["tokens"], one["token_logprobs"], one["top_logprobs"], strict=True):
        assert top[token] == logprob and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in one["top_logprobs"])  # a sampled token outside the top 1
    zero = _post(tiny_server, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert [list(top) for top in zero["top_logprobs"]] == [[token] for token in zero["tokens"]]


def test_completion_top_logprobs_keep_the_sampled_value_where_texts_collide() -> None:
    """Byte-piece tokens all decode to U+FFFD: the sampled token's value is kept, then the likelier one's."""
    from kvserve.entrypoints.openai.serving_common import completion_logprobs
    from kvserve.protocol.outputs import Logprob

    class Bytes:
        def decode(self, ids: list[int]) -> str:
            return "\ufffd"

    entry = {7: Logprob(-3.0, 3, None), 3: Logprob(-0.5, 1, None), 9: Logprob(-1.0, 2, None)}
    got = completion_logprobs(Bytes(), [7], [entry], num_top=2, text_offset=0)
    assert got["top_logprobs"] == [{"\ufffd": -3.0}] and got["token_logprobs"] == [-3.0]


def test_request_ids_as_vllm_names_them(tiny_server: ServerProcess) -> None:
    """A response's id is `chatcmpl-` / `cmpl-` and the client's id: the X-Request-Id header, else the body's
    request_id; a fresh one otherwise. The same client id can be used again once its request is done."""
    chat = _post(tiny_server, "/v1/chat/completions", {**CHAT, "request_id": "fixed-1"})
    assert chat.status_code == 200 and chat.json()["id"] == "chatcmpl-fixed-1"
    again = _post(tiny_server, "/v1/chat/completions", {**CHAT, "request_id": "fixed-1"})
    assert again.json()["id"] == "chatcmpl-fixed-1"
    completion = _post(tiny_server, "/v1/completions", {**COMPLETION, "request_id": "fixed-1"})
    assert completion.json()["id"] == "cmpl-fixed-1"
    header = httpx.post(tiny_server.base_url + "/v1/chat/completions", json={**CHAT, "request_id": "body-id"},
                        headers={"X-Request-Id": "header-id"}, timeout=60)
    assert header.json()["id"] == "chatcmpl-header-id"
    fresh = _post(tiny_server, "/v1/chat/completions", CHAT).json()["id"]
    assert fresh.startswith("chatcmpl-") and len(fresh) > len("chatcmpl-") + 16
    too_long = httpx.post(tiny_server.base_url + "/v1/completions", json=COMPLETION,
                          headers={"X-Request-Id": "x" * 257}, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "X-Request-Id"


def test_truncate_prompt_tokens(tiny_server: ServerProcess) -> None:
    """vLLM's truncate_prompt_tokens keeps the prompt's last N tokens (usage counts those; completions' echo
    shows them); -1 keeps what max_model_len leaves room for; 0 is a 400 naming the field."""
    ids = list(range(100, 140))
    base = {"model": TINY_NAME, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    tail = _post(tiny_server, "/v1/completions", {**base, "prompt": ids[-8:]}).json()
    cut = _post(tiny_server, "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": 8, "echo": True})
    assert cut.status_code == 200, cut.text
    body = cut.json()
    assert body["usage"]["prompt_tokens"] == 8
    detok = _post(tiny_server, "/detokenize", {"model": TINY_NAME, "tokens": ids[-8:]}).json()["prompt"]
    assert body["choices"][0]["text"] == detok + tail["choices"][0]["text"]
    chat = _post(tiny_server, "/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": 5})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 5
    models = httpx.get(tiny_server.base_url + "/v1/models", timeout=10).json()
    max_len = models["data"][0]["max_model_len"]
    long = _post(tiny_server, "/v1/completions", {"model": TINY_NAME, "prompt": [5] * (max_len + 10),
                                                  "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == max_len - 1
    refused = _post(tiny_server, "/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"
    # Above max_model_len: refused as vLLM refuses it (it was taken, and kept prompts no request can hold).
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        over = _post(tiny_server, path, {**body, "truncate_prompt_tokens": max_len + 1})
        assert over.status_code == 400 and over.json()["error"]["param"] == "truncate_prompt_tokens", over.text
        assert over.json()["error"]["message"] == (
            f"truncate_prompt_tokens ({max_len + 1}) must be at most max_model_len ({max_len})")


def test_allowed_token_ids(tiny_server: ServerProcess) -> None:
    """vLLM's allowed_token_ids: every generated token is one of them; an id past the vocabulary is a 400."""
    body = {"model": TINY_NAME, "prompt": "Hello there", "max_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    for allowed in ([300], [300, 301]):
        got = _post(tiny_server, "/v1/completions", {**body, "allowed_token_ids": allowed, "logprobs": 0})
        assert got.status_code == 200, got.text
        texts = {_post(tiny_server, "/detokenize", {"model": TINY_NAME, "tokens": [t]}).json()["prompt"]
                 for t in allowed}
        assert set(got.json()["choices"][0]["logprobs"]["tokens"]) <= texts
    for bad in ([10**9], []):  # past the vocabulary; empty (nothing could be sampled)
        refused = _post(tiny_server, "/v1/completions", {**body, "allowed_token_ids": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "allowed_token_ids"


def test_return_token_ids(tiny_server: ServerProcess, tiny_tokenizer) -> None:
    """vLLM's return_token_ids: completions choices carry prompt_token_ids and token_ids, chat choices token_ids
    and the response prompt_token_ids; streamed, the chunks' token ids add up to the same; the ids decode to
    the text."""
    body = {**COMPLETION, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    choice = _post(tiny_server, "/v1/completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == tiny_tokenizer("Hello there")["input_ids"]
    assert len(choice["token_ids"]) == 6 and tiny_tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = [e["choices"][0] for e in read_sse(httpx.post(tiny_server.base_url + "/v1/completions",
                                                           json={**body, "stream": True}, timeout=60))
              if isinstance(e, dict) and e["choices"]]
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    chat_body = {**CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    chat = _post(tiny_server, "/v1/chat/completions", chat_body).json()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    tokens = chat["choices"][0]["token_ids"]
    assert len(tokens) == 5 and tiny_tokenizer.decode(tokens) == chat["choices"][0]["message"]["content"]
    events = [e for e in read_sse(httpx.post(tiny_server.base_url + "/v1/chat/completions",
                                             json={**chat_body, "stream": True}, timeout=60)) if isinstance(e, dict)]
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids", [])] == tokens
    plain = _post(tiny_server, "/v1/completions", COMPLETION).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
