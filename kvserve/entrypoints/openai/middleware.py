"""The ASGI layer in front of the app: body-size limit (413), API key (401), draining / dead engine (503),
the in-flight request count that SIGTERM's drain waits on, and a proper end for the responses the stopping
server cancels (a 503 in the OpenAI error format, or a stream's error event and [DONE]).

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and disconnect detection pass
through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.entrypoints.openai.errors import error_body
from kvserve.entrypoints.openai.sse import SSE_DONE, sse

_SSE_DONE_BYTES = SSE_DONE.encode()

# Paths that answer while draining (a scraper should see the last numbers).
_ALWAYS_SERVED = ("/metrics",)


@dataclass
class ServerState:
    """Mutable server-wide flags shared by the middleware, the handlers and the uvicorn loop."""

    draining: bool = False
    num_inflight: int = 0


def route_path(scope: Scope) -> str:
    """The path the router matches (below --root-path, cut only at a "/" as Starlette's router cuts it): the
    guard must judge the same path the router serves, or a crafted path could be served without the key."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
        api_key: str | None,
        max_body_bytes: int,
        request_id_headers: bool = False,
    ) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.request_id_headers = request_id_headers  # --enable-request-id-headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.request_id_headers:
            send = _with_request_id(scope, send)
        response = _ResponseSend(send)
        try:
            await self._guarded(scope, receive, response)
        except asyncio.CancelledError:
            # The server stops and cancels what still runs (a second signal, which stops it at once, or the
            # drain's grace over): uvicorn would answer a response not yet started with a plain-text 500 and
            # cut a started stream off. End it here in the OpenAI format instead; the task ends with it (and the
            # server waits for these ends before it stops the engine: `_Server.shutdown`). Within a bound: a
            # client that stops reading holds its send forever, and the server's exit would wait on it.
            try:
                ended = await asyncio.wait_for(response.end_cancelled(), END_CANCELLED_S)
            except asyncio.TimeoutError:
                ended = False
            if not ended:
                raise

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope)
        if self.state.draining and path not in _ALWAYS_SERVED:
            await _send_error(send, 503, "the server is shutting down")
            return
        if not path.startswith("/") and path:
            await _send_error(send, 400, "the request path must start with /")
            return
        if self.api_key is not None and path.startswith("/v1") and not self._authorized(scope):
            await _send_error(send, 401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                              headers=[(b"www-authenticate", b"Bearer")])
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _send_error(send, 413, f"request body of {declared} bytes is over the limit of "
                                         f"{self.max_body_bytes} bytes")
            return
        body, more_body_follows = await _read_body(receive, self.max_body_bytes)
        if more_body_follows:
            await _send_error(send, 413, f"request body is over the limit of {self.max_body_bytes} bytes")
            return
        self.state.num_inflight += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.state.num_inflight -= 1

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False


def _with_request_id(scope: Scope, send: Send) -> Send:
    """`send`, with an X-Request-Id header added to the response: the request's own X-Request-Id, else a new
    random id (as vLLM's --enable-request-id-headers)."""
    request_id = next((value for name, value in scope.get("headers", []) if name == b"x-request-id"), None)
    header = (b"x-request-id", request_id if request_id is not None else uuid.uuid4().hex.encode())

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), header]}
        await send(message)

    return send_with_id


# How long a cancelled request may take to end its response (`GuardMiddleware`) before the cancellation goes on.
END_CANCELLED_S = 1.0


class _ResponseSend:
    """`send`, noting how far the response has gone, so that a cancelled request's response can be ended."""

    CANCELLED_MESSAGE = "the server is shutting down"

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False
        self.event_stream = False
        self.done_sent = False  # a stream's last body so far ended with its [DONE] event

    async def __call__(self, message: Message) -> None:
        await self._send(message)  # (a send cancelled while it waits to write has written nothing)
        if message["type"] == "http.response.start":
            self.started = True
            self.event_stream = any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                                    for name, value in message.get("headers", []))
        elif message["type"] == "http.response.body":
            if not message.get("more_body", False):
                self.complete = True
            elif self.event_stream:
                body = message.get("body", b"")
                if body:
                    self.done_sent = body.endswith(_SSE_DONE_BYTES)

    async def end_cancelled(self) -> bool:
        """End the response of a cancelled request: a 503 error if none has started, an error event and [DONE]
        for a stream under way. Whether the response is complete now (False: a started response that is no
        stream, which cannot be ended properly)."""
        if self.complete:
            return True
        if not self.started:
            await _send_error(self, 503, self.CANCELLED_MESSAGE)
            return True
        if not self.event_stream:
            return False
        if not self.done_sent:  # (a stream whose [DONE] is out only waits for its closing body)
            event = sse(error_body(503, self.CANCELLED_MESSAGE)) + SSE_DONE
            await self({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await self({"type": "http.response.body", "body": b"", "more_body": False})
        return True


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """Read the whole body (up to `limit` bytes). Returns (body, True if there was more than `limit`)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # disconnected before the body was complete
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that yields the buffered body once, then the real channel (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
                      ) -> None:
    payload = json.dumps(error_body(status, message)).encode()
    raw_headers: list[Any] = [(b"content-type", b"application/json"),
                              (b"content-length", str(len(payload)).encode())] + (headers or [])
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
