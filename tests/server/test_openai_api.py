"""The official `openai` client against a real server (tiny random Llama): chat and completions, streaming
and not, usage, n=2, logprobs (checked against HF Transformers), stop strings, and the small endpoints."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

import kvserve

from .conftest import TINY_NAME, ServerProcess, metric, read_sse, scrape

MESSAGES_EN = [{"role": "user", "content": "Tell me a short story about a fox."}]
MESSAGES_ZH = [{"role": "user", "content": "给我讲一个关于狐狸的短故事。"}]


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _stream_chat(client: openai.OpenAI, **kwargs: object) -> tuple[dict[int, str], dict[int, str | None], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    chunks = list(client.chat.completions.create(model=TINY_NAME, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in finish, "a choice finished twice"
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def _chat_prompt_len(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("messages", [MESSAGES_EN, MESSAGES_ZH], ids=["english", "chinese"])
def test_chat_stream_equals_non_stream_and_usage(client, tiny_tokenizer, messages):
    full = client.chat.completions.create(model=TINY_NAME, messages=messages, temperature=0, max_tokens=12,
                                          extra_body={"ignore_eos": True})
    assert full.object == "chat.completion" and full.model == TINY_NAME
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == _chat_prompt_len(tiny_tokenizer, messages)
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    texts, finish, chunks = _stream_chat(client, messages=messages, temperature=0, max_tokens=12,
                                         extra_body={"ignore_eos": True},
                                         stream_options={"include_usage": True})
    assert texts == {0: full.choices[0].message.content}
    assert finish == {0: "length"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_with_tools_on_a_tool_calling_server(client):
    """The tiny server runs with --enable-auto-tool-choice --tool-call-parser hermes: a request with tools is
    read for tool calls (the message has its tool_calls list). The tiny model writes no <tool_call>, so its
    text is the content, as without tools (its template does not render tools), streamed or not."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    settings = dict(messages=MESSAGES_EN, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(model=TINY_NAME, **settings)
    full = client.chat.completions.create(model=TINY_NAME, **settings, tools=tools)
    assert full.choices[0].message.tool_calls == [] and full.choices[0].finish_reason == "length"
    assert full.choices[0].message.content == plain.choices[0].message.content
    texts, finish, _ = _stream_chat(client, **settings, tools=tools)
    assert texts == {0: plain.choices[0].message.content} and finish == {0: "length"}


@pytest.mark.parametrize("prompt", ["The capital of France is", "北京是中国的首都，"], ids=["english", "chinese"])
def test_completion_stream_equals_non_stream(client, tiny_tokenizer, prompt):
    full = client.completions.create(model=TINY_NAME, prompt=prompt, temperature=0, max_tokens=10)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=TINY_NAME, prompt=prompt, temperature=0, max_tokens=10, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    assert full.object == "text_completion"
    assert full.usage.prompt_tokens == len(tiny_tokenizer(prompt)["input_ids"])
    assert full.usage.completion_tokens <= 10
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == 10


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_stream_sends_a_chunk_for_every_token_also_without_text(tiny_server, tiny_tokenizer, api):
    """A token whose text is empty (here a special token, left out of the text) still gets its chunk, with
    empty text, as vLLM streams: a client sees the first token when it is generated. A chunk carries one
    step's token, or the tokens of every step that queued while the server was behind: the logprobs count
    them."""
    special = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert special in tiny_tokenizer.all_special_ids
    body: dict = {"model": TINY_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
                  "logit_bias": {str(special): 100}, "stream_options": {"include_usage": True}}
    if api == "chat":
        body.update(messages=MESSAGES_EN, logprobs=True)
    else:
        body.update(prompt="Hello", logprobs=0)
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/{'chat/completions' if api == 'chat' else 'completions'}",
                      json=body, timeout=120) as response:
        events = read_sse(response)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 4
    choices = [c for e in events[:-2] for c in e["choices"]]
    if api == "chat":
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}  # first, with the first token
        choices = choices[1:]
        texts = [c["delta"].get("content") for c in choices]
        tokens = [len(c["logprobs"]["content"]) for c in choices]
    else:
        texts = [c["text"] for c in choices]
        tokens = [len(c["logprobs"]["tokens"]) for c in choices]
    assert texts == [""] * len(choices)
    assert sum(tokens) == 4 and min(tokens) >= 1  # every token in a chunk, no chunk without one
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]


def test_n2_seeded_samples_stream_equals_non_stream(client):
    kwargs = dict(messages=MESSAGES_EN, temperature=1.0, max_tokens=8, n=2, seed=1234)
    full = client.chat.completions.create(model=TINY_NAME, **kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert full.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in client.chat.completions.create(
            model=TINY_NAME, logprobs=True, **kwargs).choices)
    texts, finish, _ = _stream_chat(client, **kwargs)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    # Each sample draws from its own seeded generator: the two differ (random 49k-token model, 8 draws).
    assert full.choices[0].message.content != full.choices[1].message.content



@pytest.mark.parametrize("api", ["chat", "completions"])
def test_continuous_usage_is_per_choice_and_needs_include_usage(tiny_server, api):
    """stream_options.continuous_usage_stats as vLLM reads it: usage on every chunk only together with
    include_usage (alone it adds nothing), and each chunk's completion_tokens counts its own choice's tokens
    so far, not every choice's (chat's role chunks: 0); the last chunk's usage has the total."""
    prompt = {"messages": MESSAGES_EN} if api == "chat" else {"prompt": "Once upon a time"}
    body = {"model": TINY_NAME, **prompt, "max_tokens": 5, "n": 2, "ignore_eos": True, "stream": True}
    url = tiny_server.base_url + f"/v1/{'chat/completions' if api == 'chat' else 'completions'}"

    def events(options: dict) -> list[dict]:
        return [e for e in read_sse(httpx.post(url, json={**body, "stream_options": options}, timeout=60))
                if isinstance(e, dict)]

    alone = events({"continuous_usage_stats": True})
    assert alone and all(e.get("usage") is None for e in alone)
    both = events({"include_usage": True, "continuous_usage_stats": True})
    *chunks, last = both
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    seen: dict[int, list[int]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        seen.setdefault(choice["index"], []).append(chunk["usage"]["completion_tokens"])
    assert sorted(seen) == [0, 1]
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 5 and (api == "completions" or counts[0] == 0)


def test_n3_samples_finishing_at_different_steps_stream_equals_non_stream(tiny_server):
    """Stop strings end the seeded samples at different steps; every choice's streamed text, logprob tokens,
    finish and stop reason match the non-streamed response, and each choice finishes exactly once."""
    body = {"model": TINY_NAME, "prompt": "Hello", "max_tokens": 12, "n": 3, "seed": 7, "temperature": 1.0,
            "stop": ["a", "o"], "ignore_eos": True, "logprobs": 1}
    full = httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=120).json()
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, tuple] = {}
    with httpx.stream("POST", tiny_server.base_url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as response:
        events = read_sse(response)
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            tokens.setdefault(c["index"], []).extend(c["logprobs"]["tokens"] if c["logprobs"] else [])
            if c["finish_reason"]:
                assert c["index"] not in finish
                finish[c["index"]] = (c["finish_reason"], c.get("stop_reason"))
    assert sorted(finish) == [0, 1, 2]
    for choice in full["choices"]:
        i = choice["index"]
        assert texts[i] == choice["text"]
        assert tokens[i] == choice["logprobs"]["tokens"]
        assert finish[i] == (choice["finish_reason"], choice["stop_reason"])
        if choice["finish_reason"] == "stop":
            assert choice["stop_reason"] in ("a", "o") and not any(s in choice["text"] for s in ("a", "o"))


def test_completion_list_prompts_and_token_ids(client, tiny_tokenizer):
    ids = tiny_tokenizer("Once upon a time")["input_ids"]
    single = client.completions.create(model=TINY_NAME, prompt=ids, temperature=0, max_tokens=5)
    text_single = client.completions.create(model=TINY_NAME, prompt="Once upon a time", temperature=0,
                                            max_tokens=5)
    assert single.choices[0].text == text_single.choices[0].text
    batch = client.completions.create(model=TINY_NAME, prompt=["Once upon a time", "Hello"], temperature=0,
                                      max_tokens=5, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    # Prompt p's samples are choices p*n .. p*n+n-1; greedy samples of one prompt agree.
    assert batch.choices[0].text == batch.choices[1].text == single.choices[0].text
    hello = client.completions.create(model=TINY_NAME, prompt="Hello", temperature=0, max_tokens=5)
    assert batch.choices[2].text == batch.choices[3].text == hello.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + len(tiny_tokenizer("Hello")["input_ids"])


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_completion_logprobs_match_hf(client, tiny_tokenizer, hf_tiny):
    ids = tiny_tokenizer("The quick brown fox")["input_ids"]
    out = client.completions.create(model=TINY_NAME, prompt=ids, temperature=0, max_tokens=4, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Oracle: HF Transformers' log-softmax over the same tokens.
    generated = tiny_tokenizer(out.choices[0].text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([ids + generated[:3]])).logits[0, len(ids) - 1:]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for step in range(min(len(generated), 4)):
        top = torch.topk(expected[step], 3)
        assert lp.token_logprobs[step] == pytest.approx(top.values[0].item(), abs=1e-3)
        got_top = sorted(lp.top_logprobs[step].values(), reverse=True)
        assert got_top == pytest.approx(top.values.tolist(), abs=1e-3)


def _hf_logprobs(hf_tiny, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_tiny(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completion_echo_with_logprobs_scores_the_prompt(client, tiny_server, tiny_tokenizer, hf_tiny):
    """echo with logprobs (how scoring clients such as lm-eval-harness ask for a text's likelihood): the
    prompt's tokens come first in `logprobs`, the first with null values, the others as HF scores them; with
    max_tokens 0 the prompt alone. The same streamed; vLLM's prompt_logprobs field alongside."""
    ids = tiny_tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    expected = _hf_logprobs(hf_tiny, ids)
    text = tiny_tokenizer.decode(ids)
    body = {"model": TINY_NAME, "prompt": ids, "temperature": 0, "logprobs": 2, "echo": True, "ignore_eos": True}
    for max_tokens in (3, 0):
        out = httpx.post(tiny_server.base_url + "/v1/completions", json={**body, "max_tokens": max_tokens},
                         timeout=60).json()
        choice = out["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        assert out["usage"]["completion_tokens"] == max_tokens
        assert choice["text"].startswith(text) and (max_tokens or choice["text"] == text)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for pos in range(1, len(ids)):
            assert lp["token_logprobs"][pos] == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=1e-3)
            assert sorted(lp["top_logprobs"][pos].values(), reverse=True)[:2] == \
                pytest.approx(expected[pos - 1].topk(2).values.tolist(), abs=1e-3)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        prompt_lp = choice["prompt_logprobs"]
        assert prompt_lp[0] is None and len(prompt_lp) == len(ids)
        assert all(str(ids[pos]) in prompt_lp[pos] for pos in range(1, len(ids)))
        streamed = [event for event in read_sse(httpx.post(
            tiny_server.base_url + "/v1/completions", json={**body, "max_tokens": max_tokens, "stream": True},
            timeout=60)) if isinstance(event, dict) and event["choices"]]
        assert "".join(c["choices"][0]["text"] for c in streamed) == choice["text"]
        assert [t for c in streamed for t in c["choices"][0]["logprobs"]["tokens"]] == lp["tokens"]
        assert [v for c in streamed for v in c["choices"][0]["logprobs"]["token_logprobs"]] == \
            pytest.approx(lp["token_logprobs"])
        assert [o for c in streamed for o in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]
        assert streamed[0]["choices"][0]["prompt_logprobs"] == prompt_lp
    # A prompt whose tokens' texts do not add up to it (characters split into byte pieces): the offsets are
    # one chain over the prompt's tokens and the generated ones, never going back, streamed or not.
    text_body = {**body, "prompt": "日本語のテキスト 😀😀", "max_tokens": 3}
    whole = httpx.post(tiny_server.base_url + "/v1/completions", json=text_body, timeout=60).json()
    offsets = whole["choices"][0]["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    streamed = [event for event in read_sse(httpx.post(tiny_server.base_url + "/v1/completions",
                                                       json={**text_body, "stream": True}, timeout=60))
                if isinstance(event, dict) and event["choices"]]
    assert [o for c in streamed for o in c["choices"][0]["logprobs"]["text_offset"]] == offsets



def test_echo_with_max_tokens_0_generates_no_token(tiny_server):
    """echo with max_tokens 0 runs the prompt and ends with no token: the engine generates none (the
    generation counters and TTFT stay as they were; the request and prompt counters grow), and the answer,
    with logprobs or without, streamed or not, is the prompt alone with finish_reason "length"."""
    body = {"model": TINY_NAME, "prompt": "Hello world again", "max_tokens": 0, "echo": True}
    unchanged = ("kvserve:generation_tokens_total", "kvserve:request_generation_tokens_sum",
                 "kvserve:time_to_first_token_seconds_count")
    before = scrape(tiny_server.base_url)
    for extra in ({}, {"logprobs": 1}, {"stream": True}, {"stream": True, "logprobs": 1}):
        response = httpx.post(tiny_server.base_url + "/v1/completions", json={**body, **extra}, timeout=60)
        if extra.get("stream"):
            chunks = [e for e in read_sse(response) if isinstance(e, dict) and e["choices"]]
            assert "".join(c["choices"][0]["text"] for c in chunks) == body["prompt"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            out = response.json()
            assert out["choices"][0]["text"] == body["prompt"] and out["choices"][0]["finish_reason"] == "length"
            assert out["usage"]["completion_tokens"] == 0
    after = scrape(tiny_server.base_url)
    for name in unchanged:
        assert metric(after, name) == metric(before, name), name
    assert metric(after, "kvserve:request_success_total", finished_reason="length") == \
        metric(before, "kvserve:request_success_total", finished_reason="length") + 4
    assert metric(after, "kvserve:prompt_tokens_total") > metric(before, "kvserve:prompt_tokens_total")
    # min_tokens above the max_tokens of 0 is refused naming the client's values (not the engine's 1)
    refused = httpx.post(tiny_server.base_url + "/v1/completions", json={**body, "min_tokens": 3}, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "min_tokens (3) must be <= max_tokens (0)"
    assert refused.json()["error"]["param"] == "min_tokens"


def test_prompt_logprobs_field(client, tiny_server, tiny_tokenizer, hf_tiny):
    """vLLM's prompt_logprobs request field: completions return it in each choice, chat at the top level
    (the rendered prompt's tokens; with the stream's first chunk); over --max-logprobs is a 400."""
    ids = tiny_tokenizer("Hello there, general")["input_ids"]
    expected = _hf_logprobs(hf_tiny, ids)
    out = client.completions.create(model=TINY_NAME, prompt=ids, max_tokens=2, n=2,
                                    extra_body={"prompt_logprobs": 3})
    assert out.choices[0].logprobs is None and len(out.choices) == 2
    for choice in out.choices:
        table = choice.model_extra["prompt_logprobs"]
        assert table[0] is None and len(table) == len(ids)
        for pos in range(1, len(ids)):
            entry = table[pos][str(ids[pos])]
            assert entry["logprob"] == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=1e-3)
            assert 3 <= len(table[pos]) <= 4 and isinstance(entry["decoded_token"], str)
    chat = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES_EN, max_tokens=2,
                                          extra_body={"prompt_logprobs": 1})
    table = chat.model_extra["prompt_logprobs"]
    assert len(table) == chat.usage.prompt_tokens and table[0] is None and all(table[1:])
    first = next(c for c in client.chat.completions.create(model=TINY_NAME, messages=MESSAGES_EN, max_tokens=2,
                                                           stream=True, extra_body={"prompt_logprobs": 1}))
    assert [None if e is None else sorted(e) for e in first.model_extra["prompt_logprobs"]] == \
        [None if e is None else sorted(e) for e in table]
    plain = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES_EN, max_tokens=2)
    assert "prompt_logprobs" not in (plain.model_extra or {})
    for path, body in (("/v1/completions", {"prompt": ids}), ("/v1/chat/completions", {"messages": MESSAGES_EN})):
        refused = httpx.post(tiny_server.base_url + path, json={"model": TINY_NAME, "prompt_logprobs": 21, **body},
                             timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES_EN, temperature=0, max_tokens=5,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(values[0])
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    # Streamed logprobs cover the same tokens.
    streamed = [e for chunk in client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES_EN, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3,
        stream=True, extra_body={"ignore_eos": True})
        for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_stop_string_stream_equals_non_stream(client):
    base = client.completions.create(model=TINY_NAME, prompt="Hello there", temperature=0, max_tokens=12,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 6
    stop = base[len(base) // 2: len(base) // 2 + 3]
    cut = base[: base.index(stop)]
    full = client.completions.create(model=TINY_NAME, prompt="Hello there", temperature=0, max_tokens=12,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert full.choices[0].text == cut
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].model_extra.get("stop_reason") == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=TINY_NAME, prompt="Hello there", temperature=0, max_tokens=12, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == cut


def test_models_version_tokenize_detokenize(tiny_server, client, tiny_tokenizer):
    models = client.models.list()
    assert [m.id for m in models.data] == [TINY_NAME]
    assert models.data[0].model_extra["max_model_len"] == 256
    assert httpx.get(tiny_server.base_url + "/version").json() == {"version": kvserve.__version__}
    tok = httpx.post(tiny_server.base_url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["tokens"] == tiny_tokenizer("Hello world")["input_ids"]
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    chat_tok = httpx.post(tiny_server.base_url + "/tokenize", json={"messages": MESSAGES_EN}).json()
    assert chat_tok["count"] == _chat_prompt_len(tiny_tokenizer, MESSAGES_EN)
    detok = httpx.post(tiny_server.base_url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": "Hello world"}


def test_requests_are_logged_without_prompts(tiny_server, client):
    secret = "the password is swordfish"
    client.completions.create(model=TINY_NAME, prompt=secret, max_tokens=1)
    client.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": secret}], max_tokens=1)
    log = tiny_server.log()
    assert "swordfish" not in log
    assert "prompt tokens" in log  # the request lines are there, with sizes and parameters only


def test_async_scheduling_server_gives_the_same_completions(launch_server, tiny_llama_dir, tiny_server):
    """`--async-scheduling` (pipelined engine steps) gives the same greedy, seeded, streamed and logprob
    completions as the default server, request by request (the same batches on both); under concurrent
    load every request completes with the tokens it asked for."""
    from concurrent.futures import ThreadPoolExecutor

    from .conftest import TINY_SERVER_FLAGS

    pipelined = launch_server([tiny_llama_dir, *TINY_SERVER_FLAGS, "--async-scheduling"])
    bodies = [
        {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0},
        {"prompt": "The fox", "max_tokens": 7, "temperature": 0},
        {"prompt": "A story:", "max_tokens": 16, "temperature": 0.9, "seed": 4, "n": 2},
        {"prompt": "Hello", "max_tokens": 20, "temperature": 0, "stream": True},
        {"prompt": "Numbers:", "max_tokens": 12, "temperature": 0.7, "seed": 9, "logprobs": 2},
    ]

    def complete(base_url: str, body: dict) -> list:
        body = {"model": TINY_NAME, "ignore_eos": True, **body}
        if body.get("stream"):
            with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
                texts = [c["choices"][0]["text"] for c in read_sse(response) if isinstance(c, dict) and c["choices"]]
            return [("".join(texts), None, None)]
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=120).json()
        assert response["usage"]["completion_tokens"] == body["max_tokens"] * body.get("n", 1)
        return [(c["text"], c["finish_reason"], (c.get("logprobs") or {}).get("token_logprobs"))
                for c in response["choices"]]

    for body in bodies:
        got, want = complete(pipelined.base_url, body), complete(tiny_server.base_url, body)
        assert [(text, reason) for text, reason, _ in got] == [(text, reason) for text, reason, _ in want]
        for (_, _, got_lp), (_, _, want_lp) in zip(got, want, strict=True):
            assert (got_lp is None) == (want_lp is None)
            if got_lp is not None:
                assert got_lp == pytest.approx(want_lp, abs=1e-4)
    with ThreadPoolExecutor(len(bodies)) as pool:  # asserts each request's usage (no stream) inside
        results = list(pool.map(lambda body: complete(pipelined.base_url, body), bodies * 2))
    assert all(text for result in results for text, _, _ in result)
    assert "Traceback" not in pipelined.log()


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_cache_salt_separates_prefix_cache_hits(tiny_server, api):
    """vLLM's cache_salt reaches the engine: the same prompt again hits the prefix cache with its salt, and
    misses with another salt or none; an empty salt is refused."""
    prompt = f"The cache salt test of the {api} endpoint: " + " ".join(f"owl{i}" for i in range(40))

    def cached(**fields: object) -> int:
        if api == "chat":
            body = {"model": TINY_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
            url = "/v1/chat/completions"
        else:
            body = {"model": TINY_NAME, "prompt": prompt, "max_tokens": 1}
            url = "/v1/completions"
        response = httpx.post(tiny_server.base_url + url, json={**body, **fields}, timeout=60)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] > 48
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") >= 48
    assert cached(cache_salt="tenant-b") == 0
    assert cached() < 48  # unsalted: at most the chat template's opening, which other tests' chats share
    assert cached() >= 48
    url = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    empty = httpx.post(tiny_server.base_url + url, timeout=60, json={
        "model": TINY_NAME, "prompt": "x", "messages": [{"role": "user", "content": "x"}], "cache_salt": ""})
    assert empty.status_code == 400 and "cache_salt" in empty.text
