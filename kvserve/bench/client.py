"""One streaming request to an OpenAI-compatible server, timed from the stream: `StreamClient.send()`.

Timing (all `time.perf_counter()`, from just before the request is handed to the connection pool):

* TTFT: until the first SSE chunk that carries a token, of the answer or of a reasoning model's thinking (a
  role-only first chunk does not count).
* ITL: gaps between consecutive token-carrying chunks (a server that packs several tokens in one chunk
  shows fewer, longer gaps; TPOT below does not depend on chunking).
* E2E: until the stream ends (`[DONE]`, or the end of the body after a finish_reason).
* TPOT: (E2E - TTFT) / (output tokens - 1), per request.

Token counts come from the final `usage` chunk (requested with `stream_options.include_usage`); when the
server sends none, the output text is kept so that the caller can count it with a local tokenizer.

Failures are records too, never exceptions: `error_kind` is `http_<status>`, `timeout`, `connection` (no
response), `broken_stream` (the stream stopped before a finish_reason or `[DONE]`), `stream_error` (the
server sent an error object inside the stream), `invalid_response` (a chunk that is not JSON) or
`cancelled` (still running when the run was ended by its drain timeout or an interrupt; `send` records it
and re-raises the cancellation).

The streams go through aiohttp, which costs about a quarter of httpx's client CPU per streamed chunk (23-27
against 90-92 µs on the H200 host, 27-30 against 108-115 on the CI machine; `docs/perf_notes.md` entry 48):
a client short of CPU reads chunks late, which shows in the TTFT and ITL it reports. Listing the models
(`fetch_model_names`) is one request and stays on httpx. Redirects are not followed (the httpx client
followed none either), and proxy variables such as HTTP_PROXY do not apply (the httpx client read them).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import msgspec

from kvserve.bench.datasets import BenchRequest

ERROR_TIMEOUT = "timeout"
ERROR_CONNECTION = "connection"
ERROR_BROKEN_STREAM = "broken_stream"
ERROR_STREAM_ERROR = "stream_error"
ERROR_INVALID_RESPONSE = "invalid_response"
# Still running when the run ended (drain timeout or interrupt): not the server's failure, but not a
# completed request either, so it stays in the denominators.
ERROR_CANCELLED = "cancelled"
# Error messages kept per record (the first bytes of an error body are enough to tell what went wrong).
_MAX_ERROR_CHARS = 300
# Where a chat delta carries a reasoning model's thinking: `reasoning` in current vLLM, `reasoning_content`
# in older vLLM, DeepSeek's API and SGLang.
_REASONING_FIELDS = ("reasoning", "reasoning_content")
# Seconds an idle pooled connection is kept (see StreamClient._http).
_KEEPALIVE_S = 4.0
# How long a finished answer's remaining bytes (the end of the chunked body after `[DONE]`) may take to
# arrive before its connection is dropped instead of going back to the pool.
_DRAIN_S = 0.2


@dataclass
class RequestRecord:
    """What happened to one request. Times in seconds; `start_s` and `scheduled_s` are relative to the run
    start. `queued_s` is how long an open-loop arrival waited for a concurrency slot (or for the event loop)
    after its scheduled time: latencies are measured from the actual send, so it is reported separately."""

    index: int
    max_tokens: int
    input_tokens_target: int | None = None
    scheduled_s: float | None = None
    start_s: float = 0.0
    queued_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    token_source: str | None = None
    finish_reason: str | None = None
    error_kind: str | None = None
    error: str | None = None
    status_code: int | None = None
    # The x-request-id sent (--request-id-prefix, the command's default bench-<8 hex>-; None: none sent).
    request_id: str | None = None
    # The answer's text, kept with --save-detailed only (vLLM's generated_texts).
    generated_text: str | None = None
    # Kept only until tokens are counted (never serialized): the fallback counts them with a tokenizer.
    output_text: str = field(default="", repr=False, compare=False)

    @property
    def success(self) -> bool:
        return self.error_kind is None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or self.e2e_s is None or not self.output_tokens:
            return None
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float:
        return self.start_s + (self.e2e_s or 0.0)

    def fail(self, kind: str, message: str, status_code: int | None = None) -> None:
        self.error_kind = kind
        self.error = message[:_MAX_ERROR_CHARS]
        self.status_code = status_code

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _RECORD_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{name: data[name] for name in _RECORD_FIELDS if name in data})


_RECORD_FIELDS = tuple(name for name in RequestRecord.__dataclass_fields__ if name != "output_text")


@dataclass(frozen=True)
class ClientSettings:
    """Everything `StreamClient` sends besides the request itself."""

    endpoint: str
    api: str
    model: str
    api_key: str | None = None
    request_timeout_s: float = 600.0
    ignore_eos: bool = False
    temperature: float | None = None
    max_connections: int | None = None
    # Further sampling parameters sent in every request body (top_p, top_k, min_p, penalties).
    sampling: dict[str, float | int] = field(default_factory=dict)
    # Each request's x-request-id header is this prefix, the client's `id_scope` and the request's index, as
    # vLLM's bench sends `{prefix}{index}` (None: no header).
    request_id_prefix: str | None = None
    # vLLM's --extra-body: merged into every request body last.
    extra_body: dict[str, Any] = field(default_factory=dict)


class StreamClient:
    """Pooled async HTTP client for streaming completions. The pool holds `max_connections` connections
    (the run's concurrency; None: no limit), so no request waits for a connection the load shape meant it to
    have. The session is opened on first use, inside the running event loop (aiohttp binds it there)."""

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings
        self._headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._headers["Content-Type"] = "application/json"
        self._session: aiohttp.ClientSession | None = None
        self._decoder = msgspec.json.Decoder()
        self._encoder = msgspec.json.Encoder()
        # Between the prefix and the index of request ids: set per run so that no two requests share an id
        # (a sweep's later points and the warm-up number their requests from 0 too).
        self.id_scope = ""

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            s = self.settings
            # Idle connections are dropped after 4 s, before the usual server-side keep-alive of 5 s
            # (uvicorn's default, so kvserve's and vLLM's): a request sent on a connection the server is just
            # closing would fail, and aiohttp does not retry a POST.
            connector = aiohttp.TCPConnector(limit=s.max_connections or 0, limit_per_host=0,
                                             keepalive_timeout=_KEEPALIVE_S)
            # No total or read limit here: `send` bounds the whole request by the request timeout.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(s.request_timeout_s, 30.0))
            # trust_env off: with it, aiohttp reads ~/.netrc and looks up proxies in a thread for every
            # request, inside the timed window. Proxy variables therefore do not apply.
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._headers,
                                                  trust_env=False)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def body(self, request: BenchRequest) -> dict[str, Any]:
        s = self.settings
        body: dict[str, Any]
        if s.api == "responses":  # the messages as input items; usage comes with response.completed
            body = {"model": s.model, "input": [dict(m) for m in request.messages],
                    "max_output_tokens": request.max_tokens, "stream": True, "store": False}
        else:
            body = {"model": s.model, "max_tokens": request.max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            if s.api == "chat":
                body["messages"] = [dict(m) for m in request.messages]
            else:
                body["prompt"] = request.prompt()
        if s.ignore_eos:
            body["ignore_eos"] = True
        if s.temperature is not None:
            body["temperature"] = s.temperature
        body.update(s.sampling)
        for key, value in s.extra_body.items():
            if key == "stream_options" and isinstance(value, dict) and isinstance(body.get(key), dict):
                body[key] = {**body[key], **value}  # (continuous_usage_stats, say: include_usage stays on)
            else:
                body[key] = value
        return body

    async def send(self, request: BenchRequest, run_start: float, record: RequestRecord | None = None
                   ) -> RequestRecord:
        """Send `request`, stream the answer, and return its record (failures included; never raises
        except on cancellation, after marking `record` cancelled). The whole request is bounded by the
        request timeout."""
        if record is None:
            record = RequestRecord(request.index, request.max_tokens, request.input_tokens)
        body = self.body(request)
        headers = None
        if self.settings.request_id_prefix is not None:
            record.request_id = f"{self.settings.request_id_prefix}{self.id_scope}{request.index}"
            headers = {"x-request-id": record.request_id}
        started = time.perf_counter()
        record.start_s = started - run_start
        try:
            await asyncio.wait_for(self._stream(body, record, started, headers), self.settings.request_timeout_s)
        except asyncio.CancelledError:
            # An answer already complete (cancelled while its body's end was read) keeps its record.
            if record.e2e_s is None:
                record.fail(ERROR_CANCELLED, "still running when the run ended (drain timeout or interrupt)",
                            record.status_code)
                record.e2e_s = time.perf_counter() - started
            raise
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # Before asyncio.TimeoutError: aiohttp's connect timeout is one too.
            record.fail(ERROR_CONNECTION, f"{type(exc).__name__}: {exc}")
        except asyncio.TimeoutError:
            if record.e2e_s is None:  # else complete, and timed out while its body's end was read
                record.fail(ERROR_TIMEOUT, f"no complete answer within {self.settings.request_timeout_s:g} s",
                            record.status_code)
        except aiohttp.ClientError as exc:
            # Headers received: the stream broke; none: the connection failed before any answer.
            kind = ERROR_BROKEN_STREAM if record.status_code is not None else ERROR_CONNECTION
            record.fail(kind, f"{type(exc).__name__}: {exc}", record.status_code)
        if record.e2e_s is None:
            record.e2e_s = time.perf_counter() - started
        return record

    async def _stream(self, body: dict[str, Any], record: RequestRecord, started: float,
                      headers: dict[str, str] | None = None) -> None:
        async with self._http().post(self.settings.endpoint, data=self._encoder.encode(body), headers=headers,
                                     allow_redirects=False) as response:
            record.status_code = response.status
            if response.status >= 400:
                text = (await response.read()).decode("utf-8", "replace")
                record.fail(f"http_{response.status}", text.strip(), response.status)
                return
            if response.status >= 300:  # not followed: the body of a POST would not go with it
                record.fail(f"http_{response.status}", f"redirected to {response.headers.get('Location')!r}",
                            response.status)
                return
            content_type = response.headers.get("Content-Type", "")
            first = b""
            if "text/event-stream" not in content_type and "json" not in content_type:
                # Neither an event stream nor JSON by its type (a proxy's text/plain, or none): the body tells,
                # by its first bytes (as vLLM's client, which reads any body as SSE lines).
                first = await response.content.readany()
            if "json" in content_type or first.lstrip().startswith(b"{"):
                # A server that ignores `stream`: the whole answer is one chunk.
                obj = self._decode(first + await response.read(), record)
                state = _StreamState(record, started)
                if obj is not None and state.on_payload(obj, self.settings.api):
                    state.finish(done=True)
                return
            state = _StreamState(record, started)
            # Lines are split from the bytes as they arrive (SSE lines end in LF or CRLF).
            pending, over = self._on_bytes(b"", first, state, record)
            if not over:
                async for data in response.content.iter_any():
                    pending, over = self._on_bytes(pending, data, state, record)
                    if over:
                        break
            if over:
                if record.error_kind is None:
                    await _drain(response)
            elif not (pending and self._on_line(pending, state, record)):  # a last line without a newline
                state.finish(done=False)

    def _on_bytes(self, pending: bytes, data: bytes, state: _StreamState, record: RequestRecord) -> tuple[bytes, bool]:
        """Apply the complete SSE lines of `pending + data`; (the incomplete rest, whether the stream is over)."""
        lines = (pending + data).split(b"\n")
        rest = lines.pop()
        for line in lines:
            if self._on_line(line, state, record):
                return rest, True
        return rest, False

    def _on_line(self, line: bytes, state: _StreamState, record: RequestRecord) -> bool:
        """Apply one SSE line; True when the stream is over (`[DONE]`, or a chunk that ends it)."""
        if not line.startswith(b"data:"):
            return False  # blank separators, comments (keep-alives), `event:` lines
        payload = line[5:].strip()
        if payload == b"[DONE]":
            state.finish(done=True)
            return True
        obj = self._decode(payload, record)
        if obj is None or not state.on_payload(obj, self.settings.api):
            return True
        if state.completed:  # the Responses API's last event (its streams have no [DONE])
            state.finish(done=True)
            return True
        return False

    def _decode(self, payload: bytes, record: RequestRecord) -> dict[str, Any] | None:
        try:
            obj = self._decoder.decode(payload)
        except msgspec.DecodeError:
            obj = None
        if not isinstance(obj, dict):
            shown = payload[:100].decode("utf-8", "replace")
            record.fail(ERROR_INVALID_RESPONSE, f"chunk is not a JSON object: {shown!r}", record.status_code)
            return None
        return obj


async def _drain(response: aiohttp.ClientResponse) -> None:
    """Read the rest of a body whose answer is complete (its times are already recorded), so that its
    connection goes back to the pool: a body left unread closes the connection, and the next request
    would pay a new TCP (and TLS) handshake inside its TTFT. A server that keeps the body open past
    `_DRAIN_S` loses the connection instead."""
    try:
        await asyncio.wait_for(response.content.read(), _DRAIN_S)
    except (asyncio.TimeoutError, aiohttp.ClientError):
        response.close()


class _StreamState:
    """Accumulates one response's chunks into its record."""

    def __init__(self, record: RequestRecord, started: float) -> None:
        self.record = record
        self.started = started
        self.last_token_at: float | None = None
        self.pieces: list[str] = []
        self.completed = False  # the Responses API's response.completed / response.incomplete came

    def _token(self, text: str, now: float) -> None:
        record = self.record
        if self.last_token_at is None:
            record.ttft_s = now - self.started
        else:
            record.itl_s.append(now - self.last_token_at)
        self.last_token_at = now
        self.pieces.append(text)

    def on_payload(self, obj: dict[str, Any], api: str) -> bool:
        """Apply one chunk; False when the stream must stop (an error object)."""
        now = time.perf_counter()
        record = self.record
        if api == "responses":
            return self._on_event(obj, now)
        if "error" in obj and not obj.get("choices"):
            error = obj["error"]
            message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            record.fail(ERROR_STREAM_ERROR, message, record.status_code)
            return False
        for choice in obj.get("choices") or ():
            text = _choice_text(choice, api)
            if text or _carries_token(choice, api):
                self._token(text, now)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            record.prompt_tokens = usage.get("prompt_tokens")
            record.output_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                record.cached_tokens = details["cached_tokens"]
            record.token_source = "usage"
        return True

    def _on_event(self, obj: dict[str, Any], now: float) -> bool:
        """Apply one Responses API event (or a whole response, from a server that does not stream); False when
        the stream must stop (`error`, response.failed)."""
        record = self.record
        kind = obj.get("type")
        if kind in ("error", "response.failed"):
            error = (obj.get("response") or {}).get("error") if kind == "response.failed" else obj
            message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            record.fail(ERROR_STREAM_ERROR, message, record.status_code)
            return False
        if kind in _RESPONSES_TOKEN_EVENTS and isinstance(obj.get("delta"), str):
            self._token(obj["delta"], now)
            return True
        response = obj.get("response") if kind in ("response.completed", "response.incomplete") else \
            obj if kind is None and obj.get("object") == "response" else None
        if not isinstance(response, dict):
            return True
        if kind is None:  # not streamed: its text at once
            self._token(_response_text(response), now)
        details = response.get("incomplete_details") or {}
        record.finish_reason = "length" if details.get("reason") == "max_output_tokens" else \
            str(details.get("reason") or "stop")
        usage = response.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
            record.prompt_tokens = usage.get("input_tokens")
            record.output_tokens = usage["output_tokens"]
            cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            if isinstance(cached, int):
                record.cached_tokens = cached
            record.token_source = "usage"
        self.completed = True
        return True

    def finish(self, done: bool) -> None:
        record = self.record
        record.e2e_s = time.perf_counter() - self.started
        record.output_text = "".join(self.pieces)
        if record.error_kind is None and not done and record.finish_reason is None:
            record.fail(ERROR_BROKEN_STREAM, "the stream ended before a finish_reason or [DONE]",
                        record.status_code)
        if record.error_kind is None and record.ttft_s is None:
            # A stream with no token chunk at all (a server that streams text only, and an answer of special
            # tokens): the first token time is unknown, the end is the best bound.
            record.ttft_s = record.e2e_s


# Responses API events that carry generated tokens: the answer, the thinking, tool calls' arguments
_RESPONSES_TOKEN_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta",
                           "response.function_call_arguments.delta", "response.refusal.delta")


def _response_text(response: dict[str, Any]) -> str:
    """The generated text of a whole Responses API response: its reasoning, messages and calls' arguments."""
    pieces = []
    for item in response.get("output") or ():
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call":
            pieces += [v for v in (item.get("name"), item.get("arguments")) if isinstance(v, str)]
        for part in item.get("content") or ():
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                pieces.append(part["text"])
    return "".join(pieces)


def _carries_token(choice: dict[str, Any], api: str) -> bool:
    """Whether a streamed choice with no text still carries a generated token: its text is empty because the
    token has none yet (part of a character, a special token such as the EOS that ends an answer, text held
    back for a possible stop string). Servers that stream every token (vLLM, kvserve) send those, and
    vLLM's benchmark times them as tokens too. Not tokens here: a chat role chunk (a server may send it
    before the prompt runs) and a chat chunk with an empty delta (a finish on its own). A reasoning model's
    thinking comes in its own field (`_REASONING_FIELDS`), and a tool call's name and arguments in
    `tool_calls`: generated tokens like the answer."""
    if api == "chat":
        delta = choice.get("delta") or {}
        return "role" not in delta and (any(isinstance(delta.get(name), str)
                                            for name in ("content", *_REASONING_FIELDS))
                                        or bool(_tool_call_text(delta)))
    return isinstance(choice.get("text"), str)


def _choice_text(choice: dict[str, Any], api: str) -> str:
    """The generated text of a choice, a reasoning model's thinking included (it streams first, and it is
    output the server had to generate: the tokenizer fallback counts it)."""
    if api == "chat":
        delta = choice.get("delta") or choice.get("message") or {}
        return _reasoning_text(delta) + (delta.get("content") or "") + _tool_call_text(delta)
    return choice.get("text") or ""


def _tool_call_text(delta: dict[str, Any]) -> str:
    """The generated text of the tool calls in a chat delta or message: each call's name and arguments (a
    streamed call's arguments come in pieces; the name with its first)."""
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return ""
    pieces = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            pieces += [v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str)]
    return "".join(pieces)


def _reasoning_text(delta: dict[str, Any]) -> str:
    """The thinking in a chat delta or message. One field only: a server that sends both names (vLLM's
    backward-compatible deltas) sends the same text twice."""
    for name in _REASONING_FIELDS:
        if text := delta.get(name):
            return text if isinstance(text, str) else ""
    return ""


async def fetch_model_names(api_base: str, api_key: str | None, timeout_s: float = 10.0) -> list[str]:
    """The ids listed by `GET {api_base}/models` (raises httpx errors when the server is unreachable)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as http:
        response = await http.get(api_base + "/models")
        response.raise_for_status()
        data = response.json().get("data") or []
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
