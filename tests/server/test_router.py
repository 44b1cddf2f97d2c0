"""`kvserve route`: the policies (pure), the proxy against in-process fake backends (streaming, failover,
health, disconnects), and the command in front of a real tiny kvserve server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.parser import text_string_to_metric_families

from kvserve.entrypoints.openai.errors import NotFoundError
from kvserve.router import app as router_app
from kvserve.router.app import END_IN_FLIGHT_S, RouterApp, RouterConfig, parse_backends
from kvserve.router.exposition import merge_expositions
from kvserve.router.policies import LOAD_FACTOR, PREFIX_KEY_CHARS, Router, prefix_key

from .conftest import REPO_ROOT, ServerProcess, free_port, wait_for

# ------------------------------------------------------------------------------------------ policies


def test_round_robin_takes_turns_over_healthy_backends() -> None:
    router = Router(["http://a", "http://b", "http://c"], "round-robin")
    assert [router.order()[0].url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    router.backends[1].healthy = False
    assert {router.order()[0].url for _ in range(4)} == {"http://a", "http://c"}


def test_least_requests_picks_the_least_busy() -> None:
    router = Router(["http://a", "http://b"], "least-requests")
    router.backends[0].in_flight = 3
    assert router.order()[0].url == "http://b"
    router.backends[1].in_flight = 5
    assert [b.url for b in router.order()] == ["http://a", "http://b"]


def test_prefix_policy_keeps_a_prefix_on_one_backend_and_moves_few_keys() -> None:
    urls = [f"http://h{i}" for i in range(4)]
    router = Router(urls, "prefix")
    keys = [f"system prompt {i}" for i in range(400)]
    first = {k: router.order(k)[0].url for k in keys}
    assert first == {k: router.order(k)[0].url for k in keys}  # stable
    counts = {u: sum(v == u for v in first.values()) for u in urls}
    assert min(counts.values()) > 50, counts  # spread over all backends
    router.backends[2].healthy = False  # only h2's keys move
    moved = [k for k in keys if router.order(k)[0].url != first[k]]
    assert moved and all(first[k] == "http://h2" for k in moved)


def test_prefix_policy_bounds_a_hot_prefix() -> None:
    router = Router(["http://a", "http://b", "http://c"], "prefix")
    for _ in range(60):  # 60 requests with one prompt start, none finishing
        chosen = router.order("the same long system prompt")[0]
        chosen.in_flight += 1
        total = sum(b.in_flight for b in router.backends)
        assert max(b.in_flight for b in router.backends) <= total / 3 * LOAD_FACTOR + 1
    router.check_invariants()


def test_with_no_backend_healthy_the_policy_still_spreads_the_requests() -> None:
    """Every backend marked by its health checks alone (a /health that timed out on each in a load spike, a pause)
    while they serve: the requests are spread by the policy, as over healthy backends; those a request could not be
    sent to since they were healthy last come after. (The fewest failures first, all 0, sent every request to the
    first backend listed until a health check passed.) With some healthy, the others stay last resorts."""
    for policy in ("round-robin", "least-requests", "prefix"):
        router = Router(["http://a", "http://b", "http://c"], policy)
        for backend in router.backends:
            backend.healthy = False
        firsts = []
        for i in range(30):
            chosen = router.order(f"prompt {i}")[0]
            chosen.in_flight += 1  # (none finishing)
            firsts.append(chosen.url)
        assert {u: firsts.count(u) for u in set(firsts)} == {"http://a": 10, "http://b": 10, "http://c": 10}, policy
        router.backends[0].refused = True  # a request could not be sent to it
        assert all(router.order(f"prompt {i}")[-1].url == "http://a" for i in range(10)), policy
        router.backends[1].healthy = True
        router.backends[0].failures, router.backends[2].failures = 3, 1
        assert [b.url for b in router.order("prompt")] == ["http://b", "http://c", "http://a"], policy


def test_prefix_key_reads_completions_and_chats() -> None:
    long = "x" * (PREFIX_KEY_CHARS + 50)
    assert prefix_key({"prompt": long}) == long[:PREFIX_KEY_CHARS]
    assert prefix_key({"prompt": ["first", "second"]}) == "first"
    assert prefix_key({"prompt": [1, 2, 3]}) == "1,2,3"
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prefix_key(chat) == "system:be brief\nuser:hi\n"
    # Later turns of the conversation have the same key, so they keep the backend's cached prefix.
    later = {"messages": chat["messages"] + [{"role": "assistant", "content": "hello"},
                                             {"role": "user", "content": "and then?"}]}
    assert prefix_key(later) == prefix_key(chat)
    assert prefix_key({"model": "m"}) is None and prefix_key([1]) is None
    # The Responses API's instructions and input, as the chat messages they render as.
    assert prefix_key({"instructions": "be brief", "input": "hi"}) == prefix_key(chat)
    items = [{"role": "developer", "content": "be brief"}, {"type": "message", "role": "user",
                                                             "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert prefix_key({"input": items}) == prefix_key(chat)
    assert prefix_key({"input": 5}) is None


def test_a_conversation_keeps_its_backend_turn_after_turn() -> None:
    router = Router([f"http://h{i}" for i in range(4)], "prefix")
    for n in range(200):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {n}"}]
        first = router.order(prefix_key({"messages": messages}))[0]
        for turn in range(3):
            messages += [{"role": "assistant", "content": f"answer {turn}"},
                         {"role": "user", "content": f"follow-up {turn}"}]
            assert router.order(prefix_key({"messages": messages}))[0] is first


def test_bad_router_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        Router(["http://a"], "random")
    with pytest.raises(ValueError, match="at least one backend"):
        Router([], "prefix")
    with pytest.raises(ValueError, match="listed twice"):
        Router(["http://a/", "http://a"], "prefix")
    assert parse_backends(["10.0.0.1:8000,http://b:9000/", " https://c "]) == [
        "http://10.0.0.1:8000", "http://b:9000", "https://c"]
    with pytest.raises(ValueError, match="not an http"):
        parse_backends(["ftp://x"])
    # A key no header can carry (a key file's last newline): it failed at the first health check, in aiohttp's words.
    for key in ("sekret\n", "sek\x00ret", "sekret\x7f"):
        with pytest.raises(ValueError, match="the API key holds a control character"):
            RouterConfig(api_key=key)
    for key, why in [(" sekret", "white space"), ("sekret ", "white space"), ("sekrét", "outside ASCII")]:
        with pytest.raises(ValueError, match=why):
            RouterConfig(api_key=key)
    assert RouterConfig(api_key="sek ret\t!").api_key == "sek ret\t!"
    assert parse_backends(["http://[::1]:8000", "http://gw/replica-1/"]) == ["http://[::1]:8000", "http://gw/replica-1"]
    # Each request's path is added to a backend's URL: one these refuse was taken, and every request and health check
    # missed (a client's base_url ending in /v1 sent /v1/v1/completions), or failed in aiohttp as a 500.
    for url, why in [("http://a:notaport", "not a valid URL"), ("http://a:99999", "not a valid URL"),
                     ("http://", "has no host"), ("http://a:0", "port 0"), ("http://a:1?x=1", "no query or fragment"),
                     ("http://a:1#top", "no query or fragment"), ("http://user:pw@a:1", "credentials"),
                     ("http://a:1/v1", r"without /v1 \(e.g. http://a:1\)"),
                     ("http://gw/replica-1/v1/", r"without /v1 \(e.g. http://gw/replica-1\)")]:
        with pytest.raises(ValueError, match=why):
            parse_backends([url])


# ------------------------------------------------------------------------------------------ proxy


class FakeBackend:
    """An OpenAI-ish server: /health, and /v1/completions streaming `chunks` SSE events, one every `delay_s`
    (or answering `status`; a request with `"stream": false` gets one JSON body after as long; one for a model
    not in `models`, the server's 404); records each request's headers and whether its client went away
    mid-answer."""

    def __init__(self, name: str, chunks: int = 5, delay_s: float = 0.01, models: list[str] | None = None) -> None:
        self.name, self.chunks, self.delay_s = name, chunks, delay_s
        self.models = models or ["m"]
        self.stall_s = 0.0
        self.status = 200
        self.healthy = True
        self.api_key: str | None = None  # /v1/models asks for it
        self.models_auth: list[str | None] = []  # the Authorization header of each /v1/models request
        self.health_auth: list[str | None] = []  # the Authorization header of each /health request
        # /v1/models answers: "list" (`models`), "garbage" (a 200 whose body is no list), "drop" (no answer),
        # "hang" (nothing, for `hang_s`).
        self.models_answer = "list"
        self.break_after: int | None = None  # chunks sent before the connection is dropped mid-answer
        self.break_inside = b""  # sent (the start of an event) just before that drop
        self.die_before_answer = False  # the connection is dropped once the request has come (no answer)
        # A request on a connection that carried one before finds it closed (as a server closes an idle connection
        # when its keep-alive timeout ends, just as the request goes out); counted in `closed_reused`.
        self.close_reused = False
        self.closed_reused = 0
        self._carried: set[object] = set()  # the transports that carried a request
        # An answer of `status` whose body breaks off ("break": its connection dropped) or hangs ("hang") after
        # its start; None: its whole body.
        self.error_body_end: str | None = None
        self.hang_after: int | None = None  # chunks sent (`chunks`: and [DONE]) before the answer hangs
        self.hang_inside = 0  # bytes of the next event sent before that hang (its rest after)
        self.hang_s = 60.0
        self.padding = 0  # characters of padding in each event
        # A stream's body as written, one write a piece (each its own chunk of the answer), in place of the
        # events above; then the answer ends ("end"), its connection is dropped ("break"), or it hangs ("hang").
        self.script: list[bytes] | None = None
        self.script_end = "end"
        # Each completion waits (up to 5 s) until this many are in flight at once; the most seen is recorded.
        self.hold_until = 0
        self.in_flight = self.peak_in_flight = 0
        self._all_arrived = asyncio.Event()
        self.seen: list[dict[str, Any]] = []
        self.stored: list[str] = []  # the Responses API's responses this backend made (and stores)
        self.disconnected = asyncio.Event()
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(middlewares=[self._close_reused])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.retrieve_model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/ping", self.ping)
        app.router.add_route("*", "/v1/responses{tail:.*}", self.responses)
        app.router.add_route("*", "/{tail:.*}", self.other)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    @web.middleware
    async def _close_reused(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.close_reused and request.transport in self._carried and request.transport is not None:
            self.closed_reused += 1
            request.transport.close()
            return web.Response()
        self._carried.add(request.transport)
        return await handler(request)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def health(self, request: web.Request) -> web.Response:
        self.health_auth.append(request.headers.get("Authorization"))
        return web.Response(status=200 if self.healthy else 503)

    async def other(self, request: web.Request) -> web.Response:
        """Any other path: which one it was (404 for /metrics: this backend has none)."""
        if request.path == "/metrics":
            return web.Response(status=404)
        return web.json_response({"path": request.path_qs})

    async def responses(self, request: web.Request) -> web.Response:
        """The Responses API as a server with its store on answers it: a response it made (named by the path or
        by previous_response_id) or its 404; a new one is `resp_<name>-<count>`, stored here."""
        body = await request.json() if request.can_read_body else {}
        named, param = request.path[len("/v1/responses/"):].split("/")[0], "response_id"
        if request.path == "/v1/responses":
            named, param = body.get("previous_response_id"), "previous_response_id"
        self.seen.append({"path": request.path, "body": body})
        mark = {"X-Backend": self.name}
        if named is not None and named not in self.stored:
            return web.json_response(NotFoundError(f"no response with id {named!r} is stored on this server",
                                                   param).to_body(), status=404, headers=mark)
        if request.path == "/v1/responses":
            self.stored.append(f"resp_{self.name}-{len(self.stored)}")
            return web.json_response({"id": self.stored[-1], "previous_response_id": named}, headers=mark)
        return web.json_response({"id": named, "method": request.method}, headers=mark)

    async def ping(self, _: web.Request) -> web.Response:
        return web.json_response({"pong": self.name})

    async def list_models(self, request: web.Request) -> web.Response:
        self.models_auth.append(request.headers.get("Authorization"))
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad key", "code": 401}}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})  # (as the server's 401)
        if self.models_answer == "garbage":
            return web.Response(text="<html>models</html>", content_type="text/html")
        if self.models_answer == "hang":
            await asyncio.sleep(self.hang_s)
        if self.models_answer == "drop" and request.transport is not None:
            request.transport.close()
            return web.Response()
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model not in self.models:  # as the server answers it
            return web.json_response(NotFoundError(f"The model `{model}` does not exist.", "model").to_body(),
                                     status=404)
        return web.json_response({"id": model, "object": "model"}, headers={"X-Backend": self.name})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.in_flight += 1
        try:
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            if self.in_flight >= self.hold_until:
                self._all_arrived.set()
            if self.hold_until:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._all_arrived.wait(), 5.0)
            return await self._answer(request, body)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, body: Any) -> web.StreamResponse:
        await asyncio.sleep(self.stall_s)
        self.seen.append({"headers": dict(request.headers), "body": body})
        if self.die_before_answer and request.transport is not None:
            request.transport.close()  # the backend dies before its answer
            return web.Response()
        if self.status != 200 and self.error_body_end is not None:
            response = web.StreamResponse(status=self.status, headers={"Content-Type": "application/json",
                                                                       "Content-Length": "100"})
            await response.prepare(request)
            await response.write(b'{"error": {"mess')
            if self.error_body_end == "hang":
                await asyncio.sleep(self.hang_s)
            elif request.transport is not None:
                request.transport.close()
            return response
        if self.status != 200:
            return web.json_response({"error": {"message": "draining", "code": self.status}}, status=self.status)
        model = body.get("model")
        if model and model not in self.models:  # as the server answers it (ServingContext.check_model)
            return web.json_response(NotFoundError(f"The model `{model}` does not exist.", "model").to_body(),
                                     status=404)
        if body.get("stream") is False:  # as a server answers one: the whole answer at its end
            try:
                await asyncio.sleep(self.chunks * self.delay_s)
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
            return web.json_response({"backend": self.name, "chunks": self.chunks}, headers={"X-Backend": self.name})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Backend": self.name})
        await response.prepare(request)
        if self.script is not None:
            return await self._scripted(request, response, self.script)
        try:
            for i in range(self.chunks):
                if i == self.break_after and request.transport is not None:
                    if self.break_inside:
                        await response.write(self.break_inside)
                    request.transport.close()  # the backend dies mid-answer
                    return response
                data = {"backend": self.name, "i": i, **({"pad": "x" * self.padding} if self.padding else {})}
                event = f"data: {json.dumps(data)}\n\n".encode()
                if i == self.hang_after:
                    if self.hang_inside:
                        await response.write(event[:self.hang_inside])
                    await asyncio.sleep(self.hang_s)
                    event = event[self.hang_inside:]
                await response.write(event)
                await asyncio.sleep(self.delay_s)
            await response.write(b"data: [DONE]\n\n")
            if self.hang_after == self.chunks:
                await asyncio.sleep(self.hang_s)
            if self.break_after == self.chunks and request.transport is not None:
                request.transport.close()  # dies after its [DONE], before the answer's end
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise
        return response

    async def _scripted(self, request: web.Request, response: web.StreamResponse,
                        script: list[bytes]) -> web.StreamResponse:
        try:
            for piece in script:
                await response.write(piece)
                await asyncio.sleep(0.002)  # (so that the pieces come apart, as separate reads, to the router)
            if self.script_end == "break" and request.transport is not None:
                request.transport.close()  # the backend dies mid-answer
            elif self.script_end == "hang":
                await asyncio.sleep(self.hang_s)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise
        return response


@asynccontextmanager
async def routed(backends: list[FakeBackend], policy: str = "least-requests", interval_s: float = 0.2,
                 timeout_s: float | None = 60.0, dead_urls: tuple[str, ...] = (),
                 **settings: Any) -> AsyncIterator[tuple[RouterApp, str]]:
    """A router in front of `backends` (started here) and `dead_urls` (backends nothing listens on)."""
    for b in backends:
        await b.start()
    config = RouterConfig(health_check_interval_s=interval_s, request_timeout_s=timeout_s, **settings)
    app = RouterApp(Router([*dead_urls, *[b.url for b in backends]], policy), config)
    runner = web.AppRunner(app.make_app(), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        for b in backends:
            await b.stop()


def _run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())  # type: ignore[arg-type]


def _run_quietly(coro: Callable[[], Awaitable[None]], caplog: pytest.LogCaptureFixture) -> str:
    """`_run` with the log captured: no record may carry an error or a traceback. Returns the log's text."""
    with caplog.at_level(logging.INFO):
        _run(coro)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text
    return caplog.text


async def _post(session: aiohttp.ClientSession, base: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with session.post(base + "/v1/completions", json={"model": "m", "prompt": "hello", "stream": True},
                            headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


def test_streams_pass_through_unchanged_with_the_callers_key() -> None:
    async def body() -> None:
        backend = FakeBackend("a", chunks=4)
        async with routed([backend]) as (_, base), aiohttp.ClientSession() as session:
            status, headers, data = await _post(session, base, Authorization="Bearer k1")
            direct = await _post(session, backend.url)
        assert status == 200 and headers["Content-Type"] == "text/event-stream" and headers["X-Backend"] == "a"
        assert data == direct[2] and data.endswith(b"data: [DONE]\n\n") and data.count(b"data: ") == 5
        assert backend.seen[0]["headers"]["Authorization"] == "Bearer k1"
        assert backend.seen[0]["body"]["prompt"] == "hello"
    _run(body)


def test_a_dead_or_draining_backend_is_skipped_and_marked() -> None:
    async def body() -> None:
        dead, draining, live = FakeBackend("dead"), FakeBackend("draining"), FakeBackend("live")
        draining.status = 503
        async with routed([dead, draining, live], "round-robin", interval_s=60) as (app, base):
            await dead.stop()  # refuses connections from now on; the router still thinks it healthy
            async with aiohttp.ClientSession() as session:
                results = [await _post(session, base) for _ in range(3)]
                state = await (await session.get(base + "/router/backends")).json()
                metrics = await (await session.get(base + "/metrics")).text()
        assert all(status == 200 and headers["X-Backend"] == "live" for status, headers, _ in results)
        healthy = {b["url"]: b["healthy"] for b in state["backends"]}
        assert healthy == {dead.url: False, draining.url: False, live.url: True}
        assert draining.seen, "the draining backend was tried"
        assert "kvserve_router:retries_total 2.0" in metrics
        assert f'kvserve_router:requests_total{{backend="{live.url}",code="200"}} 3.0' in metrics
        app.router.check_invariants()
    _run(body)


def test_an_error_answer_other_than_a_503_is_passed_on_as_it_came_and_not_sent_again() -> None:
    """A backend's 4xx or 5xx answer other than a 503 is the client's (the request may be at fault, or ran): passed
    on as it came, the request not sent to another backend, the backend not marked."""
    async def body() -> None:
        for status in (400, 401, 413, 422, 429, 500, 502, 504):
            failing, other = FakeBackend("failing"), FakeBackend("other")
            failing.status = status
            async with routed([failing, other], "round-robin", interval_s=60) as (app, base), \
                    aiohttp.ClientSession() as session:
                via = await session.post(base + "/v1/completions", json={"prompt": "x", "stream": True})
                direct = await session.post(failing.url + "/v1/completions", json={"prompt": "x", "stream": True})
                metrics = await (await session.get(base + "/metrics")).text()
                assert via.status == direct.status == status
                assert await via.read() == await direct.read() and via.content_type == "application/json"
            assert len(failing.seen) == 2 and not other.seen, status  # (the router's, then the direct one)
            assert app.router.backends[0].healthy and "kvserve_router:retries_total 0.0" in metrics, metrics
            assert f'kvserve_router:requests_total{{backend="{failing.url}",code="{status}"}} 1.0' in metrics
    _run(body)


def test_with_every_backend_marked_by_its_health_check_the_requests_are_spread() -> None:
    """Backends whose /health timed out (a load spike) while they serve: the next requests are spread over them by
    the policy until a check passes; they all went to the first backend listed. One that refuses a request is then
    tried after the others; a passing health check clears that."""
    async def body() -> None:
        backends = [FakeBackend(name, chunks=1, delay_s=0.2) for name in "abc"]
        async with routed(backends, "least-requests", interval_s=60) as (app, base), \
                aiohttp.ClientSession() as session:
            for backend in app.router.backends:
                app._set_health(backend, False, "/health failed: TimeoutError")
            answers = await asyncio.gather(*(session.post(base + "/v1/completions", json={"prompt": "x",
                                                                                          "stream": False})
                                             for _ in range(12)))
            assert [response.status for response in answers] == [200] * 12
            assert [len(b.seen) for b in backends] == [4, 4, 4]
            await backends[0].stop()  # refuses from now on
            for _ in range(3):
                assert (await _post(session, base))[0] == 200
            assert app.router.backends[0].refused and app.router.order()[-1] is app.router.backends[0]
            await backends[0].start()
            await app.check_health()
            assert app.router.backends[0].healthy and not app.router.backends[0].refused
    _run(body)


def test_unreachable_backends_are_a_503_and_health_comes_back() -> None:
    async def body() -> None:
        backend = FakeBackend("a")
        backend.healthy = False
        async with routed([backend], interval_s=0.1) as (app, base), aiohttp.ClientSession() as session:
            assert not app.router.backends[0].healthy  # the first check ran before serving
            assert (await session.get(base + "/health")).status == 503
            # Marked unhealthy but reachable: tried anyway as the last resort (it may have recovered).
            assert (await _post(session, base))[0] == 200
            port = backend.port
            await backend.stop()
            response = await session.post(base + "/v1/completions", json={"prompt": "x"})
            error = await response.json()
            assert response.status == 503 and error["error"]["code"] == 503
            assert "every backend failed" in error["error"]["message"]
            backend.port, backend.healthy = port, True
            await backend.start()
            for _ in range(50):
                if (await session.get(base + "/health")).status == 200:
                    break
                await asyncio.sleep(0.05)
            assert app.router.backends[0].healthy
            missing = await session.get(base + "/admin")
            assert missing.status == 404 and "forwards /v1/*" in (await missing.json())["error"]["message"]
            metrics = await (await session.get(base + "/metrics")).text()
        assert 'kvserve_router:requests_total{backend="none",code="503"} 1.0' in metrics
        assert "kvserve_router:retries_total 0.0" in metrics  # one backend: nothing to retry on
    _run(body)


def test_requests_go_to_the_backends_serving_their_model() -> None:
    async def body() -> None:
        a, b = FakeBackend("a", models=["m1"]), FakeBackend("b", models=["m2"])
        async with routed([a, b], "round-robin") as (_, base), aiohttp.ClientSession() as session:
            for model, name in [("m1", "a"), ("m2", "b"), ("m1", "a"), ("m2", "b")]:
                async with session.post(base + "/v1/completions", json={"model": model, "prompt": "x"}) as r:
                    assert r.status == 200 and r.headers["X-Backend"] == name
            unknown = await session.post(base + "/v1/completions", json={"model": "m3", "prompt": "x"})
            error = (await unknown.json())["error"]
            assert unknown.status == 404 and error["message"] == \
                "The model `m3` does not exist. It is not served by any backend (served: m1, m2)"
            assert error["param"] == "model" and error["type"] == "NotFoundError"  # as the server's own 404
            accented = await session.post(base + "/v1/completions", json={"model": "modèle", "prompt": "x"})
            text = await accented.text()  # compact and unescaped, as the server's own bodies
            assert '"param":"model"' in text and "`modèle` does not exist." in text
            listed = await (await session.get(base + "/v1/models")).json()
        assert sorted(m["id"] for m in listed["data"]) == ["m1", "m2"]
    _run(body)


def test_a_model_only_unreached_backends_might_serve_is_a_503_that_says_so() -> None:
    """A backend never reached (its model list unknown) is tried for any model; when it is the only candidate
    and fails, while the backends whose lists are known lack the model, the answer stays a 503 (clients retry
    it, and a backend still loading may serve the model), and its message says no backend that answered lists
    the model and names the one not reached. A model the live backend lists still goes there."""
    async def body() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        async with routed([FakeBackend("a", models=["m1"])], "round-robin", dead_urls=(dead,)) as (app, base), \
                aiohttp.ClientSession() as session:
            assert app.router.backends[0].models is None and app.router.backends[1].models == {"m1"}
            state = await (await session.get(base + "/router/backends")).json()
            assert [b["models"] for b in state["backends"]] == [None, ["m1"]]  # null: not known
            for _ in range(2):  # round-robin: the dead backend first or second, the same answer
                unknown = await session.post(base + "/v1/completions", json={"model": "nope", "prompt": "x"})
                error = (await unknown.json())["error"]
                assert unknown.status == 503 and error["type"] == "ServiceUnavailableError"
                assert "'nope' is not listed by any backend that answered (served: m1)" in error["message"]
                assert dead in error["message"]
            async with session.post(base + "/v1/completions", json={"model": "m1", "prompt": "x"}) as r:
                assert r.status == 200 and r.headers["X-Backend"] == "a"
        # No backend's list known (the only one down): nothing says the model is missing, a 503 as before.
        async with routed([], dead_urls=(dead,)) as (_, base), aiohttp.ClientSession() as session:
            response = await session.post(base + "/v1/completions", json={"model": "nope", "prompt": "x"})
            assert response.status == 503
    _run(body)


def test_a_connect_timeout_goes_to_the_next_backend() -> None:
    """A backend that cannot be reached in time (aiohttp's ConnectionTimeoutError, a TimeoutError too) is
    refused like a refused connection, not answered with the 504 of a silent backend."""
    async def body() -> None:
        unreachable, live = FakeBackend("unreachable"), FakeBackend("live")
        async with routed([unreachable, live], "round-robin") as (app, base), aiohttp.ClientSession() as session:
            assert app.session is not None
            request = app.session.request

            def connect(method: str, url: str, **kwargs: Any) -> Any:
                if url.startswith(unreachable.url):
                    raise aiohttp.ConnectionTimeoutError(f"connect to {url} timed out")
                return request(method, url, **kwargs)

            app.session.request = connect  # type: ignore[method-assign]
            results = [await _post(session, base) for _ in range(2)]
        assert [(status, headers["X-Backend"]) for status, headers, _ in results] == [(200, "live")] * 2
        assert not app.router.backends[0].healthy and "ConnectionTimeoutError" in app.router.backends[0].last_error
    _run(body)


def test_a_silent_backend_times_out() -> None:
    async def body() -> None:
        backend = FakeBackend("slow", chunks=3, delay_s=0.0)
        backend.stall_s = 5.0
        async with routed([backend], timeout_s=0.5) as (_, base), aiohttp.ClientSession() as session:
            started = time.monotonic()
            response = await session.post(base + "/v1/completions", json={"prompt": "x"})
            error = await response.json()
            assert time.monotonic() - started < 4
        assert response.status == 504 and "--request-timeout" in error["error"]["message"]
    _run(body)


def test_more_than_a_hundred_requests_reach_the_backend_at_once() -> None:
    """The router holds no request back: aiohttp's default pool (100 connections) must not cap what is in flight
    at the backends."""
    async def body() -> None:
        backend = FakeBackend("a", chunks=1, delay_s=0.0)
        backend.hold_until = 150  # every completion waits until all 150 are in flight at the backend
        connector = aiohttp.TCPConnector(limit=0)  # nor may the test's own client cap them
        async with routed([backend]) as (_, base), aiohttp.ClientSession(connector=connector) as session:
            results = await asyncio.gather(*(_post(session, base) for _ in range(150)))
        assert [status for status, _, _ in results] == [200] * 150
        assert backend.peak_in_flight == 150
    _run(body)


def test_no_request_timeout_lets_a_slow_answer_through() -> None:
    async def body() -> None:
        backend = FakeBackend("slow", chunks=1, delay_s=0.0)
        backend.stall_s = 0.3
        async with routed([backend], timeout_s=None) as (app, base), aiohttp.ClientSession() as session:
            assert app.config.request_timeout_s is None
            assert (await _post(session, base))[0] == 200
    _run(body)


def test_a_body_over_the_limit_is_a_413_with_openais_error_body() -> None:
    async def body() -> None:
        backend = FakeBackend("a")
        async with routed([backend], max_body_bytes=1000) as (_, base), aiohttp.ClientSession() as session:
            response = await session.post(base + "/v1/completions", json={"prompt": "x" * 2000})
            error = await response.json()
            small = await session.post(base + "/v1/completions", json={"prompt": "x" * 500})
        assert response.status == 413 and response.content_type == "application/json"
        assert error["error"]["code"] == 413 and error["error"]["type"] == "PayloadTooLargeError"
        assert "over the limit of 1000 bytes" in error["error"]["message"]
        assert small.status == 200 and len(backend.seen) == 1
    _run(body)


def test_health_checks_send_the_routers_key_and_learn_the_models(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        locked, open_ = FakeBackend("locked", models=["a"]), FakeBackend("open", models=["b"])
        locked.api_key = "k"
        async with routed([locked, open_], interval_s=60, api_key="k") as (app, _):
            assert [b.models for b in app.router.backends] == [{"a"}, {"b"}]
        assert locked.models_auth == ["Bearer k"] and open_.models_auth == ["Bearer k"]
        assert locked.health_auth == ["Bearer k"] and open_.health_auth == ["Bearer k"]
        # Without the key the locked backend's models stay unknown (its /v1/models answers 401), which a warning
        # says once.
        locked.models_auth.clear()
        async with routed([locked], interval_s=60) as (app, _):
            await app.check_health()
            assert app.router.backends[0].models is None and locked.models_auth == [None, None]
    text = _run_quietly(body, caplog)
    assert text.count("answers 401 to the router's /v1/models") == 1
    assert "give the router its API key (--api-key)" in text


def test_listing_the_models_with_a_key_a_backend_refuses_passes_its_answer_on() -> None:
    """GET /v1/models with a key a backend refuses: its 401 is the answer, as it came (body and headers, its
    WWW-Authenticate included: it was left out)."""
    async def body() -> None:
        locked = FakeBackend("locked")
        locked.api_key = "k"
        async with routed([locked], interval_s=60, api_key="k") as (_, base), aiohttp.ClientSession() as session:
            via = await session.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"})
            direct = await session.get(locked.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
            assert via.status == direct.status == 401
            assert await via.read() == await direct.read()
            assert via.headers["WWW-Authenticate"] == "Bearer" and via.content_type == "application/json"
            allowed = await session.get(base + "/v1/models", headers={"Authorization": "Bearer k"})
            assert allowed.status == 200 and [m["id"] for m in (await allowed.json())["data"]] == ["m"]
    _run(body)


def _complete(session: aiohttp.ClientSession, base: str, model: str) -> Awaitable[aiohttp.ClientResponse]:
    return session.post(base + "/v1/completions", json={"model": model, "prompt": "x", "stream": False})


def test_a_backend_whose_models_are_unknown_and_lacks_the_model_sends_the_request_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """A backend started with --api-key, in front of a router without it: its models stay unknown, so it is tried
    for any model. Its 404 saying the model does not exist sends the request to the next candidate (not to the
    client); only when every candidate says so does the client get a 404. Another 404 from it is passed on, and so
    is a 404 from a backend whose list names the model."""
    async def body() -> None:
        locked, smol = FakeBackend("locked", models=["tiny"]), FakeBackend("smol", models=["smol"])
        locked.api_key = "sekret"
        async with routed([locked, smol], "round-robin", interval_s=60) as (app, base), \
                aiohttp.ClientSession() as session:
            assert [b.models for b in app.router.backends] == [None, {"smol"}]
            for _ in range(4):  # round-robin: the locked backend first every other time
                async with _complete(session, base, "smol") as response:
                    assert response.status == 200 and response.headers["X-Backend"] == "smol"
            assert [s["body"]["model"] for s in locked.seen] == ["smol", "smol"]
            async with _complete(session, base, "tiny") as response:
                assert response.status == 200 and response.headers["X-Backend"] == "locked"
            async with _complete(session, base, "huge") as response:  # no candidate serves it
                error = (await response.json())["error"]
                assert response.status == 404 and error["type"] == "NotFoundError" and error["param"] == "model"
                # vLLM's words first (a client, or a router in front of this one, reads them as a server's)
                assert error["message"] == "The model `huge` does not exist. It is not served by any backend " \
                       f"(served: smol; nor by those whose lists are unknown: {locked.url})"
                assert router_app._model_missing(json.dumps({"error": error}).encode(), "huge")
                assert not router_app._model_missing(json.dumps({"error": error}).encode(), "hug")
            locked.status = 404  # a 404 of another kind: the client's to see, as it came
            async with _complete(session, base, "tiny") as response:
                assert response.status == 404 and await response.json() == {"error": {"message": "draining",
                                                                                       "code": 404}}
            locked.status = 200
            # smol's list (known: it names smol) goes stale: its 404 for smol is passed on as it came.
            smol.models = ["other"]
            async with _complete(session, base, "smol") as response:
                error = (await response.json())["error"]
                assert response.status == 404 and error["message"] == "The model `smol` does not exist."
            metrics = await (await session.get(base + "/metrics")).text()
        assert f'kvserve_router:requests_total{{backend="{smol.url}",code="200"}} 4.0' in metrics
        assert f'kvserve_router:requests_total{{backend="{locked.url}",code="404"}} 1.0' in metrics
        assert 'kvserve_router:requests_total{backend="none",code="404"} 1.0' in metrics
        assert all(b.healthy and not b.failures for b in app.router.backends)  # a 404 is no failure
        assert "kvserve_router:retries_total 0.0" in metrics  # nor is going on past it a retry after a failure
    _run_quietly(body, caplog)


def test_retrieving_a_model_goes_to_a_backend_that_serves_it(caplog: pytest.LogCaptureFixture) -> None:
    """GET /v1/models/{model} (the openai client's models.retrieve) has no body naming the model: the path
    does, and routes it as a request's model does, also past a backend whose list is unknown."""
    async def body() -> None:
        locked, smol = FakeBackend("locked", models=["tiny"]), FakeBackend("smol", models=["smol"])
        locked.api_key = "sekret"
        async with routed([locked, smol], "round-robin", interval_s=60) as (_, base), \
                aiohttp.ClientSession() as session:
            for _ in range(4):
                async with session.get(base + "/v1/models/smol") as response:
                    assert response.status == 200 and response.headers["X-Backend"] == "smol"
                    assert (await response.json())["id"] == "smol"
            async with session.get(base + "/v1/models/tiny") as response:
                assert response.status == 200 and response.headers["X-Backend"] == "locked"
            async with session.get(base + "/v1/models/huge") as response:
                error = (await response.json())["error"]
                assert response.status == 404 and error["param"] == "model" and "`huge`" in error["message"]
    _run_quietly(body, caplog)


def test_a_stored_response_is_found_on_the_backend_that_made_it(caplog: pytest.LogCaptureFixture) -> None:
    """Responses API: each backend (or -dp replica) stores the responses it made. A request naming one (GET /
    DELETE /v1/responses/{id}, a new response's previous_response_id) goes on past the backends that answer that
    they do not store it, without counting a failure or a retry; a response no backend has is the last 404."""
    async def body() -> None:
        a, b = FakeBackend("a"), FakeBackend("b")
        async with routed([a, b], "round-robin", interval_s=60) as (app, base), aiohttp.ClientSession() as session:
            made = []
            for _ in range(2):  # round-robin: one made by each backend
                async with session.post(base + "/v1/responses", json={"model": "m", "input": "hi"}) as response:
                    made.append((await response.json())["id"])
            assert made == ["resp_a-0", "resp_b-0"]
            for _ in range(2):  # whichever backend's turn it is, each is found where it lives
                for rid, owner in (("resp_a-0", "a"), ("resp_b-0", "b")):
                    async with session.get(f"{base}/v1/responses/{rid}") as response:
                        assert response.status == 200 and response.headers["X-Backend"] == owner
                    follow = {"model": "m", "input": "more", "previous_response_id": rid}
                    async with session.post(base + "/v1/responses", json=follow) as response:
                        assert response.status == 200 and response.headers["X-Backend"] == owner
                        assert (await response.json())["previous_response_id"] == rid
            async with session.delete(f"{base}/v1/responses/resp_b-0") as response:
                assert response.status == 200 and (await response.json()) == {"id": "resp_b-0", "method": "DELETE"}
            async with session.get(f"{base}/v1/responses/resp_zz") as response:
                error = (await response.json())["error"]
                assert response.status == 404 and error["param"] == "response_id" and "resp_zz" in error["message"]
            async with session.post(base + "/v1/responses", json={"input": "x"}) as response:  # names none: one try
                assert response.status == 200
            metrics = await (await session.get(base + "/metrics")).text()
        assert all(backend.healthy and not backend.failures for backend in app.router.backends)
        assert "kvserve_router:retries_total 0.0" in metrics
        # a plain new response was never sent on: each backend saw it once at most
        assert sum(1 for backend in (a, b) for seen in backend.seen if seen["body"] == {"input": "x"}) == 1
    _run_quietly(body, caplog)


def test_a_reason_without_a_message_is_its_type_alone() -> None:
    # aiohttp's timeouts carry no message: "/health failed: TimeoutError: " read as if one was cut off
    assert router_app._describe(asyncio.TimeoutError()) == "TimeoutError"
    assert router_app._describe(ConnectionResetError("reset by peer")) == "ConnectionResetError: reset by peer"


def test_a_port_in_use_is_an_error_line_and_exit_code_1(caplog: pytest.LogCaptureFixture) -> None:
    import socket

    from kvserve.router.app import serve_router

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        router = RouterApp(Router(["http://127.0.0.1:9"], "round-robin"), RouterConfig(health_check_interval_s=60))
        with caplog.at_level(logging.ERROR):
            assert asyncio.run(serve_router(router, "127.0.0.1", port)) == 1
    assert f"cannot listen on 127.0.0.1:{port}:" in caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text


def test_a_model_only_unknown_lists_might_serve_is_a_503_when_one_of_them_is_down() -> None:
    """Backends whose lists are unknown: one answers that it lacks the model, another cannot be reached (it may be
    loading the model): a 503, which clients retry, naming both."""
    async def body() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        locked = FakeBackend("locked", models=["tiny"])
        locked.api_key = "sekret"
        async with routed([locked], "round-robin", dead_urls=(dead,)) as (_, base), aiohttp.ClientSession() as session:
            for _ in range(2):
                async with _complete(session, base, "huge") as response:
                    error = (await response.json())["error"]
                    assert response.status == 503, error
                    assert f"{locked.url}: 404, does not serve the model" in error["message"]
                    assert dead in error["message"]
    _run(body)


def test_a_models_poll_that_is_no_list_forgets_the_list_and_one_without_answer_keeps_it() -> None:
    """A backend restarted with another model and a key the router lacks: its /v1/models answers 401, and the list
    it answered before is forgotten (unknown: tried for any model), so that the model it serves now is not a 404
    and the one it served before is not sent there. A 200 whose body is no list forgets it too; a poll without an
    answer keeps it."""
    async def body() -> None:
        backend, other = FakeBackend("a", models=["old"]), FakeBackend("b", models=["old"])
        async with routed([backend, other], "round-robin", interval_s=60) as (app, base), \
                aiohttp.ClientSession() as session:
            assert app.router.backends[0].models == {"old"}
            backend.models, backend.api_key = ["new"], "sekret"  # restarted so
            await app.check_health()
            assert app.router.backends[0].models is None
            async with _complete(session, base, "new") as response:
                assert response.status == 200 and response.headers["X-Backend"] == "a"
            for _ in range(2):
                async with _complete(session, base, "old") as response:
                    assert response.status == 200 and response.headers["X-Backend"] == "b"
            backend.api_key = None
            await app.check_health()
            assert app.router.backends[0].models == {"new"}
            backend.models_answer = "drop"
            await app.check_health()
            assert app.router.backends[0].models == {"new"} and app.router.backends[0].healthy
            backend.models_answer = "garbage"
            await app.check_health()
            assert app.router.backends[0].models is None
    _run(body)


def test_listing_the_models_leaves_out_a_backend_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /v1/models asks the backends at once, each for up to HEALTH_TIMEOUT_S: one that hangs (still marked
    healthy) is left out of the list. It held the answer for --request-timeout (for ever without one), one backend
    after another. The answer counts as the router's own in /metrics (it was not counted)."""
    monkeypatch.setattr(router_app, "HEALTH_TIMEOUT_S", 0.3)

    async def body() -> None:
        stuck, live = FakeBackend("stuck", models=["m1"]), FakeBackend("live", models=["m2"])
        async with routed([stuck, live], interval_s=60, timeout_s=None) as (app, base), \
                aiohttp.ClientSession() as session:
            stuck.models_answer = "hang"
            assert app.router.backends[0].healthy
            response = await asyncio.wait_for(session.get(base + "/v1/models"), 10)
            listing = await response.json()
            live.models_answer = "garbage"
            response = await asyncio.wait_for(session.get(base + "/v1/models"), 10)
            error = (await response.json())["error"]
            metrics = await (await session.get(base + "/metrics")).text()
        assert [m["id"] for m in listing["data"]] == ["m2"], listing
        assert response.status == 503 and error["code"] == 503, error
        assert f"{stuck.url}: TimeoutError" in error["message"] and f"{live.url}: " in error["message"], error
        assert 'kvserve_router:requests_total{backend="none",code="200"} 1.0' in metrics, metrics
        assert 'kvserve_router:requests_total{backend="none",code="503"} 1.0' in metrics, metrics
    _run(body)


def test_route_command_reads_its_api_key_as_the_server_reads_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """--api-key, else KVSERVE_API_KEY (set empty: none), else VLLM_API_KEY: the key of the router's own polls."""
    from kvserve import envs
    from kvserve.entrypoints.cli import build_parser

    configs: list[RouterConfig] = []
    monkeypatch.setattr(router_app, "run_router", lambda *args: configs.append(args[-1]) or 0)

    def key(argv: list[str], kvserve_env: str | None, vllm_env: str | None) -> str | None:
        monkeypatch.setattr(envs, "KVSERVE_API_KEY", kvserve_env)
        monkeypatch.setattr(envs, "VLLM_API_KEY", vllm_env)
        ns = build_parser().parse_args(["route", "--backend", "http://127.0.0.1:1", *argv])
        assert ns.func(ns) == 0
        return configs[-1].api_key

    assert key(["--api-key", "flag"], "kv", "vllm") == "flag"
    assert key([], "kv", "vllm") == "kv"
    assert key([], "", "vllm") is None
    assert key([], None, "vllm") == "vllm"
    assert key([], None, None) is None
    assert not configs[-1].engine_metrics
    ns = build_parser().parse_args(["route", "--backend", "http://127.0.0.1:1", "--engine-metrics"])
    assert ns.func(ns) == 0 and configs[-1].engine_metrics  # (what it does: the test of engine_metrics)
    # The request body limit: the server's default, and its flag (the router's was fixed: backends started with a
    # larger --max-request-body-bytes could not be sent what they take).
    assert configs[-1].max_body_bytes == 32 << 20
    ns = build_parser().parse_args(["route", "--backend", "http://127.0.0.1:1", "--max-request-body-bytes", "1000"])
    assert ns.func(ns) == 0 and configs[-1].max_body_bytes == 1000  # (what it does: the test of the 413)
    ns = build_parser().parse_args(["route", "--backend", "http://127.0.0.1:1", "--max-request-body-bytes", "0"])
    with pytest.raises(ValueError, match="--max-request-body-bytes must be positive, got 0"):
        ns.func(ns)


def test_ping_goes_to_a_backend() -> None:
    async def body() -> None:
        async with routed([FakeBackend("a")]) as (_, base), aiohttp.ClientSession() as session:
            response = await session.get(base + "/ping")
            assert response.status == 200 and await response.json() == {"pong": "a"}
    _run(body)


def test_paths_under_the_backends_root_path_are_forwarded_as_they_came() -> None:
    async def body() -> None:
        async with routed([FakeBackend("a")], root_path="/llm") as (_, base), aiohttp.ClientSession() as session:
            for path in ("/llm/v1/chat/completions?x=1", "/llm/ping", "/v1/files/m"):
                response = await session.get(base + path)
                assert response.status == 200 and await response.json() == {"path": path}, path
            for path in ("/llm/admin", "/llmx/v1/models", "/llm"):
                assert (await session.get(base + path)).status == 404, path
    _run(body)


def _events(data: bytes) -> list[str]:
    """The data fields of a server-sent event stream's events."""
    return [event.removeprefix("data: ") for event in data.decode().split("\n\n") if event]


def test_a_backend_that_breaks_off_mid_stream_ends_the_clients_stream_with_an_error_event(
        caplog: pytest.LogCaptureFixture) -> None:
    """A replica that dies mid-stream (cut between two events): the client's stream ends as the server ends one
    it cannot finish, with an error event in the OpenAI format and [DONE], not cut off."""
    async def body() -> None:
        backend = FakeBackend("a", chunks=5, delay_s=0.0)
        backend.break_after = 2
        async with routed([backend]) as (app, base), aiohttp.ClientSession() as session:
            status, headers, data = await _post(session, base)
            metrics = await (await session.get(base + "/metrics")).text()
        assert status == 200 and headers["Content-Type"] == "text/event-stream"
        events = _events(data)
        assert [json.loads(e) for e in events[:2]] == [{"backend": "a", "i": 0}, {"backend": "a", "i": 1}], data
        assert events[3:] == ["[DONE]"], data
        error = json.loads(events[2])["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and backend.url in error["message"]
        assert f'kvserve_router:requests_total{{backend="{backend.url}",code="stream_error"}} 1.0' in metrics
    assert "broke off (ClientPayloadError): ending the client's stream with an error event" in _run_quietly(body, caplog)


def test_a_backend_that_breaks_off_after_its_done_event_ends_the_clients_stream_as_it_was() -> None:
    async def body() -> None:
        backend = FakeBackend("a", chunks=2, delay_s=0.0)
        backend.break_after = 2
        async with routed([backend]) as (_, base), aiohttp.ClientSession() as session:
            status, _, data = await _post(session, base)
        assert status == 200 and _events(data) == ['{"backend": "a", "i": 0}', '{"backend": "a", "i": 1}', "[DONE]"]
    _run(body)


def _data_lines(data: bytes) -> list[Any]:
    """The data fields of a server-sent event stream framed in any of its line ends (LF, CRLF, CR), each parsed:
    JSON, or "[DONE]". A field that is no JSON (part of an event) fails the test."""
    values: list[Any] = []
    for line in re.split(rb"\r\n|\r|\n", data):
        if line.startswith(b"data:"):
            text = line.removeprefix(b"data:").removeprefix(b" ")
            values.append("[DONE]" if text == b"[DONE]" else json.loads(text))
    return values


def _stream_events(n: int, newline: bytes = b"\n") -> list[bytes]:
    """`n` events as a server frames them, with `newline` as the line end."""
    return [b'data: {"backend": "a", "i": %d}' % i + newline * 2 for i in range(n)]


async def _scripted_answer(backend: FakeBackend) -> tuple[bytes, str]:
    """A stream through the router from `backend` (its script): what the client got, and the router's metrics."""
    async with routed([backend]) as (_, base), aiohttp.ClientSession() as session:
        status, headers, data = await _post(session, base)
        metrics = await (await session.get(base + "/metrics")).text()
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    return data, metrics


def _event_ends(data: bytes) -> set[int]:
    """Where `data[:p]` ends at an event's end (just past a blank line, or its CRLF's LF) or just past a comment
    line (":" first; its CRLF's LF too) that comes between events, per the SSE spec's lines: the reference for
    `_EventStream`, a byte at a time."""
    ends, line, first, after_cr, cr_ended, between = {0}, 0, 0, False, False, True
    for i, byte in enumerate(data):
        if byte == 0x0A and after_cr:  # the LF of a CRLF
            after_cr = False
            if cr_ended:
                ends.add(i + 1)
        elif byte in (0x0A, 0x0D):
            if line == 0 or (first == 0x3A and between):  # a blank line, or a comment line between events
                ends.add(i + 1)
                between, cr_ended = True, byte == 0x0D
            else:
                between, cr_ended = False, False
            after_cr, line = byte == 0x0D, 0
        else:
            first = byte if line == 0 else first
            after_cr, line = False, line + 1
    return ends


def _random_stream(rng: random.Random) -> bytes:
    """An event stream as the SSE spec allows it: LF, CRLF and CR framings mixed, comment lines between events (with
    no blank line, as keep-alives) and inside them, events of several lines, a [DONE] event (maybe with other
    fields, then a comment or blank lines), a last event without its blank line."""
    parts = []
    for _ in range(rng.randint(0, 5)):
        newline = rng.choice(["\n", "\r\n", "\r"])
        if rng.random() < 0.3:
            parts.append("".join(f": ping {rng.randint(0, 9)}{newline}" for _ in range(rng.randint(1, 3))))
        lines = [f'data: {{"i": {rng.randint(0, 99)}}}' for _ in range(rng.randint(1, 2))]
        if rng.random() < 0.2:
            lines.insert(rng.randint(0, len(lines)), ": c")
        parts.append(newline.join(lines) + newline * rng.randint(2, 3))
    if rng.random() < 0.3:
        newline = rng.choice(["\n", "\r\n", "\r"])
        parts.append(newline.join([rng.choice(["data: [DONE]", "data:[DONE]", "data: [DONE]\nid: 3"]), "", ""]))
        parts.append(rng.choice(["", ": bye" + newline * 2, newline * 30]))
    return ("".join(parts) + rng.choice(["", "data: last", ": x\r", ": x", "\n"])).encode()


def test_an_event_stream_is_passed_on_in_whole_events_however_it_is_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_EventStream` against the spec's line rules, on random streams (`_random_stream`) cut into random chunks:
    what it passes on always ends at an event's end, or after a comment line between events, all it can (the LF of
    a CRLF whose CR it passed on included), unless an event outgrew the limit; it knows a [DONE] line passed on;
    with what it holds at the end, it is the stream unchanged."""
    rng = random.Random(7)
    for _ in range(4000):
        monkeypatch.setattr(router_app, "MAX_HELD_EVENT_BYTES", rng.choice([1 << 20, 24]))
        data = _random_stream(rng)
        ends, stream, passed, pos = _event_ends(data), router_app._EventStream(), b"", 0
        while pos < len(data):
            n = rng.randint(1, 12)
            passed += stream.take(data[pos:pos + n])
            pos += n
            assert data.startswith(passed) and len(stream.held) <= router_app.MAX_HELD_EVENT_BYTES
            if not stream.inside:
                assert len(passed) == max(end for end in ends if end <= pos), (data, passed)
            if router_app.MAX_HELD_EVENT_BYTES > len(data):
                assert stream.done == (re.search(rb"(^|[\r\n])data: ?\[DONE\][\r\n]", passed) is not None), data
        assert passed + stream.flush() == data


def test_a_responses_api_stream_is_done_at_its_last_event() -> None:
    """The Responses API's streams have no [DONE]: their end is response.completed / incomplete / failed. Once it is
    passed on the stream is done (nothing is added after it, and a client that then hangs up was served); an
    event merely naming such a type in its data is not the end."""
    events = [b'event: response.created\ndata: {"type":"response.created"}\n\n',
              b'event: response.output_text.delta\ndata: {"type":"x","delta":"event: response.completed\\n"}\n\n',
              b'event: response.completed\ndata: {"type":"response.completed"}\n\n']
    for end in ("completed", "incomplete", "failed"):
        stream, data = router_app._EventStream(), b"".join(events).replace(b"response.completed\nd",
                                                                           f"response.{end}\nd".encode())
        for k in range(0, len(data), 7):
            stream.take(data[k:k + 7])
            assert stream.done == (k + 7 >= len(data)), (end, k)
        assert stream.end({"error": {"message": "x"}}) == b""
    unfinished = router_app._EventStream()
    unfinished.take(b"".join(events[:2]))
    assert not unfinished.done and unfinished.end({"error": {"message": "x"}}).endswith(b"data: [DONE]\n\n")


def test_a_backend_that_breaks_off_inside_an_event_ends_the_clients_stream_with_whole_events(
        caplog: pytest.LogCaptureFixture) -> None:
    """Cut inside an event, the stream is ended as one cut between two: the router passes on whole events only
    (it held the event's start back), drops that part and ends the stream with the error event and [DONE]; every
    data line the client got parses."""
    async def body() -> None:
        backend = FakeBackend("a", chunks=5, delay_s=0.0)
        backend.break_after, backend.break_inside = 2, b'data: {"backend": "a", "i"'
        data, metrics = await _scripted_answer(backend)
        values = _data_lines(data)  # (no broken JSON)
        assert values[:2] == [{"backend": "a", "i": 0}, {"backend": "a", "i": 1}] and values[3:] == ["[DONE]"], data
        assert values[2]["error"]["code"] == 503 and backend.url in values[2]["error"]["message"], data
        assert data.startswith(b"".join(_stream_events(2))) and data.endswith(b"\n\ndata: [DONE]\n\n"), data
        assert f'kvserve_router:requests_total{{backend="{backend.url}",code="stream_error"}} 1.0' in metrics
    text = _run_quietly(body, caplog)
    assert "broke off (ClientPayloadError): ending the client's stream with an error event" in text
    assert "broke off: dropping the 26 bytes of an unfinished event" in text
    assert [r.levelno for r in caplog.records if "dropping the" in r.getMessage()] == [logging.WARNING]


@pytest.mark.parametrize(("newline", "cut"), [
    *[pytest.param(newline, cut, id=f"{name}-{cut.replace(' ', '-')}")
      for newline, name in ((b"\r\n", "crlf"), (b"\r", "cr"))
      for cut in ("between", "in the data line", "before the blank line")],
    pytest.param(b"\r\n", "in the blank line", id="crlf-in-the-blank-line"),
    pytest.param(b"\r\n", "after the blank line's cr", id="crlf-blank-line-lf-apart")])
def test_a_stream_framed_in_crlf_or_cr_that_breaks_off_ends_in_its_framing(newline: bytes, cut: str) -> None:
    """Events framed in CRLF (or CR, as the SSE spec allows), cut between two events or anywhere inside one: the
    client gets the whole events as they came, then the error event and [DONE] framed as the backend framed its
    own (no broken JSON, no mixed line ends). A blank line's CRLF that comes in two reads, its LF apart, reaches
    the client whole."""
    whole = _stream_events(2, newline)
    partial = {"between": b"", "in the data line": b'data: {"backend": "a", "i"',
               "before the blank line": b'data: {"backend": "a", "i": 2}' + newline,
               "in the blank line": b"", "after the blank line's cr": b""}[cut]
    if cut == "in the blank line":  # the blank line's CRLF cut in two: its CR came, its LF not
        whole[-1] = whole[-1][:-1]
    elif cut == "after the blank line's cr":  # its LF comes as a chunk of its own
        whole[-1:] = [whole[-1][:-1], b"\n"]

    async def body() -> None:
        backend = FakeBackend("a")
        backend.script, backend.script_end = [*whole, *([partial] if partial else [])], "break"
        data, _ = await _scripted_answer(backend)
        assert data.startswith(b"".join(whole)), data
        rest = data[len(b"".join(whole)):]
        values = _data_lines(data)
        assert values[:2] == [{"backend": "a", "i": 0}, {"backend": "a", "i": 1}] and values[3:] == ["[DONE]"], data
        assert values[2]["error"]["code"] == 503, data
        assert re.fullmatch(rb"data: \{.*\}" + newline * 2 + rb"data: \[DONE\]" + newline * 2, rest), rest
    _run(body)


def test_keep_alive_comment_lines_between_events_pass_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """Comment lines between events with no blank line after them (the SSE spec's keep-alive, `: ping` sent while
    a server has nothing else) reach the client at once, not held back until an event's end; a backend that breaks
    off after them ends the stream with the error event and [DONE], nothing dropped."""
    first = _stream_events(1)[0]

    async def body() -> None:
        backend = FakeBackend("a")
        backend.script, backend.script_end = [first, b": ping\n", b": ping\r\n: pi", b"ng\r"], "hang"
        async with routed([backend]) as (_, base), aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                wanted, got = first + b": ping\n: ping\r\n: ping\r", b""

                async def read() -> None:
                    nonlocal got
                    while got != wanted and (chunk := await response.content.readany()):
                        got += chunk

                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(read(), 10)  # (the backend sends nothing more)
                assert got == wanted, got
        backend.script, backend.script_end = [first, b": ping\n", b": ping\n"], "break"
        data, _ = await _scripted_answer(backend)
        assert data.startswith(first + b": ping\n: ping\ndata: {") and data.endswith(b"\n\ndata: [DONE]\n\n"), data
        values = _data_lines(data)
        assert values[0] == {"backend": "a", "i": 0} and values[1]["error"]["code"] == 503 and values[2:] == ["[DONE]"]
    text = _run_quietly(body, caplog)
    assert "dropping the" not in text and "broke off (ClientPayloadError): ending the client's stream" in text


def test_an_event_split_across_many_chunks_passes_unchanged() -> None:
    """Events that come a byte at a time (LF, CRLF and CR framings, a comment): at the stream's end the client
    has every byte as the backend sent it."""
    sent = b"".join([*_stream_events(2), b": keep-alive\r\n\r\n", *_stream_events(2, b"\r\n"),
                     *_stream_events(1, b"\r"), b"data: [DONE]\r\n\r\n"])

    async def body() -> None:
        backend = FakeBackend("a")
        backend.script = [sent[i:i + 1] for i in range(len(sent))]
        data, _ = await _scripted_answer(backend)
        assert data == sent
    _run(body)


@pytest.mark.parametrize("last", [b'data: {"backend": "a", "i": 9}', b'data: {"backend": "a", "i": 9}\n',
                                  b"data: [DONE]\r\n", b"data: [DONE]\r"],
                         ids=["no-line-end", "one-lf", "done-one-crlf", "done-one-cr"])
def test_a_last_event_without_its_blank_line_passes_unchanged_at_the_end(last: bytes) -> None:
    """A backend whose last event lacks its blank line (or part of it): at the answer's normal end the router
    passes on what it held back as it came."""
    sent = [*_stream_events(2, b"\r\n" if b"\r" in last else b"\n"), last[:5], last[5:]]

    async def body() -> None:
        backend = FakeBackend("a")
        backend.script = sent
        data, _ = await _scripted_answer(backend)
        assert data == b"".join(sent)
    _run(body)


@pytest.mark.parametrize(("done", "after"), [
    (b"data: [DONE]\r\n\r\n", b""), (b"data: [DONE]\r\n\r\n", b": ping"),
    (b"data: [DONE]\r\nid: 3\r\n\r\n", b""), (b"data: [DONE]\r\n\r\n: bye\r\n\r\n", b""),
    (b"data: [DONE]\r\n\r\n" + b"\r\n" * 20, b"")],
    ids=["at-once", "inside-a-comment", "another-field-in-its-event", "then-a-comment-event", "then-blank-lines"])
def test_a_crlf_stream_that_breaks_off_after_its_done_event_ends_as_it_was(done: bytes, after: bytes) -> None:
    """Cut after its [DONE] (CRLF framing; then at once or inside a last comment; the [DONE] event with another
    field, or followed by a comment event or blank lines): nothing is added (no second [DONE])."""
    whole = [*_stream_events(2, b"\r\n"), done]

    async def body() -> None:
        backend = FakeBackend("a")
        backend.script, backend.script_end = [*whole, *([after] if after else [])], "break"
        data, _ = await _scripted_answer(backend)
        assert data == b"".join(whole)
    _run(body)


@pytest.mark.parametrize("framing", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_a_done_line_after_another_data_line_of_its_event_does_not_end_the_stream(framing: bytes) -> None:
    """An event whose data is `x` then `[DONE]` is not the end for clients (they read its data, "x\n[DONE]"):
    a break after it still ends the client's stream with the error event and [DONE]."""
    event = framing.join([b'data: {"i": 0}', b"data: [DONE]", b"", b""])

    async def body() -> None:
        backend = FakeBackend("a")
        backend.script, backend.script_end = [*_stream_events(1, framing), event], "break"
        data, _ = await _scripted_answer(backend)
        assert data.startswith(b"".join([*_stream_events(1, framing), event])), data
        rest = data[len(b"".join([*_stream_events(1, framing), event])):]
        assert b'"code":503' in rest and rest.endswith(b"data: [DONE]" + framing * 2), rest
    _run(body)


def test_an_event_over_the_held_limit_passes_as_it_comes_and_a_break_inside_it_cuts(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The router holds back at most MAX_HELD_EVENT_BYTES of an event: a longer one passes as it comes (whole at
    a normal end); a break inside such an event cuts the client's stream (it never looks complete)."""
    monkeypatch.setattr(router_app, "MAX_HELD_EVENT_BYTES", 64)
    big = b'data: {"pad": "' + b"x" * 300 + b'"}\n\n'
    pieces = [*_stream_events(1), *[big[i:i + 50] for i in range(0, len(big), 50)], *_stream_events(1)]
    backend = FakeBackend("a")

    async def body() -> None:
        backend.script = [*pieces, *pieces]  # two such events: one warning
        data, _ = await _scripted_answer(backend)
        assert data == b"".join(pieces) * 2
        backend.script, backend.script_end = pieces[:4], "break"  # 100 bytes into the big event
        async with routed([backend]) as (_, base), aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                got = b""
                with pytest.raises(aiohttp.ClientPayloadError):  # not an answer that looks complete
                    while chunk := await response.content.readany():
                        got += chunk
        assert got == b"".join(pieces[:4]), got  # (the big event's start: passed on as it came)
    text = _run_quietly(body, caplog)
    over = [r.getMessage() for r in caplog.records if "over 64 bytes (MAX_HELD_EVENT_BYTES)" in r.getMessage()]
    assert len(over) == 2, over  # once a stream (two streams)
    assert all(m.startswith(f"POST /v1/completions: the answer from {backend.url}: ") for m in over), over
    assert "passed on as it comes" in over[0]
    assert "broke off (ClientPayloadError): cutting the client's stream" in text


def test_a_backend_silent_mid_stream_ends_the_clients_stream_with_a_504_event() -> None:
    async def body() -> None:
        backend = FakeBackend("slow", chunks=3, delay_s=30.0)  # silent after its first event
        async with routed([backend], timeout_s=0.3) as (_, base), aiohttp.ClientSession() as session:
            status, _, data = await asyncio.wait_for(_post(session, base), 10)
        events = _events(data)
        assert status == 200 and json.loads(events[0]) == {"backend": "slow", "i": 0} and events[2:] == ["[DONE]"]
        error = json.loads(events[1])["error"]
        assert error["code"] == 504 and "--request-timeout" in error["message"], error
    _run(body)


def test_a_backend_that_dies_before_answering_is_retried_or_a_503() -> None:
    """A replica that dies with a request in flight, before its answer: the request goes to another backend
    (nothing was sent to the client yet); with none left, the router's 503 in the OpenAI format."""
    async def body() -> None:
        dying, live = FakeBackend("dying"), FakeBackend("live")
        dying.die_before_answer = True
        async with routed([dying, live], "round-robin", interval_s=60) as (_, base), \
                aiohttp.ClientSession() as session:
            results = [await _post(session, base) for _ in range(2)]
        assert [(status, headers["X-Backend"]) for status, headers, _ in results] == [(200, "live")] * 2
        assert dying.seen, "the dying backend was tried"
        alone = FakeBackend("dying")
        alone.die_before_answer = True
        async with routed([alone]) as (_, base), aiohttp.ClientSession() as session:
            response = await session.post(base + "/v1/completions", json={"prompt": "x", "stream": True})
            error = (await response.json())["error"]
        assert response.status == 503 and error["code"] == 503 and set(error) == {"message", "type", "param", "code"}
        assert "every backend failed" in error["message"] and "ServerDisconnectedError" in error["message"], error
    _run(body)


def test_an_error_answer_whose_body_breaks_off_goes_to_the_next_backend(caplog: pytest.LogCaptureFixture) -> None:
    """A 503 (or a 404 from a backend whose model list is unknown) that the router reads whole to tell whether to
    try the next backend, and that breaks off or goes silent before its body's end: nothing was sent to the client,
    so the next backend takes the request; with none left, the router's 503 in the OpenAI format. (It was aiohttp's
    plain-text 500 with a traceback in the log, or an empty 504, each counted as "client_closed".)"""
    async def body() -> None:
        for end in ("break", "hang"):
            broken, live = FakeBackend("broken"), FakeBackend("live")
            broken.status, broken.error_body_end = 503, end
            async with routed([broken, live], "round-robin", interval_s=60, timeout_s=0.3) as (app, base), \
                    aiohttp.ClientSession() as session:
                results = [await _post(session, base) for _ in range(2)]
                metrics = await (await session.get(base + "/metrics")).text()
            assert [(status, headers["X-Backend"]) for status, headers, _ in results] == [(200, "live")] * 2, results
            assert broken.seen and not app.router.backends[0].healthy
            assert "kvserve_router:retries_total 1.0" in metrics and 'code="client_closed"' not in metrics, metrics
        alone = FakeBackend("alone")
        alone.status, alone.error_body_end, alone.models_answer = 404, "break", "garbage"  # its models unknown
        async with routed([alone]) as (_, base), aiohttp.ClientSession() as session:
            response = await session.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
            error = (await response.json())["error"]
            metrics = await (await session.get(base + "/metrics")).text()
        assert response.status == 503 and error["code"] == 503 and "every backend failed" in error["message"], error
        assert 'backend="none",code="503"} 1.0' in metrics and 'code="client_closed"' not in metrics, metrics
    _run_quietly(body, caplog)


@asynccontextmanager
async def _not_http(health: bool) -> AsyncIterator[str]:
    """A backend whose answers are no HTTP (a port of another protocol: an SSH banner here), bar a 200 to /health
    when `health`; its URL."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            head = await reader.readuntil(b"\r\n\r\n")
            ok = health and head.startswith(b"GET /health ")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" if ok else b"SSH-2.0-OpenSSH_8.9\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def test_a_backend_whose_answer_is_no_http_is_skipped_and_marked(caplog: pytest.LogCaptureFixture) -> None:
    """A backend whose answer aiohttp cannot read (no HTTP: a port of another protocol, a gRPC one say): no answer
    began, so the request goes to the next backend, the backend marked unhealthy; with none left, the router's
    503 in the OpenAI format. (It was aiohttp's plain-text 500 with a traceback in the log, counted as
    "client_closed", and the next backend was not tried.)"""
    async def body() -> None:
        async with _not_http(health=True) as odd:
            live = FakeBackend("live")
            async with routed([live], "round-robin", interval_s=60, dead_urls=(odd,)) as (app, base), \
                    aiohttp.ClientSession() as session:
                assert app.router.backends[0].healthy
                results = [await _post(session, base) for _ in range(2)]
                state = (await (await session.get(base + "/router/backends")).json())["backends"]
                metrics = await (await session.get(base + "/metrics")).text()
        assert [(status, headers["X-Backend"]) for status, headers, _ in results] == [(200, "live")] * 2, results
        assert not state[0]["healthy"] and "Bad status line" in state[0]["last_error"], state
        assert "kvserve_router:retries_total 1.0" in metrics and 'code="client_closed"' not in metrics, metrics
        async with _not_http(health=False) as odd, routed([], dead_urls=(odd,)) as (_, base), \
                aiohttp.ClientSession() as session:
            response = await session.post(base + "/v1/completions", json={"prompt": "x", "stream": True})
            error = (await response.json())["error"]
            metrics = await (await session.get(base + "/metrics")).text()
        assert response.status == 503 and set(error) == {"message", "type", "param", "code"}, error
        assert "every backend failed" in error["message"] and "could not be read" in error["message"], error
        assert "\n" not in error["message"] and 'code="client_closed"' not in metrics, metrics
    _run_quietly(body, caplog)


def test_a_pooled_connection_the_backend_closed_is_sent_again_on_another(caplog: pytest.LogCaptureFixture) -> None:
    """A backend that closes an idle connection as a request goes out on it (uvicorn's keep-alive timeout, 5 s,
    kvserve's and vLLM's, ending at that moment) did not take the request: it goes again on another connection, and
    the backend stays healthy. The router took it for a failed backend: marked unhealthy, and with no other one
    the client got a 503 (seen about once in 60 requests sent near the keep-alive timeout)."""
    async def body() -> None:
        backend = FakeBackend("a", chunks=2, delay_s=0.0)
        backend.close_reused = True
        async with routed([backend], interval_s=60) as (app, base), aiohttp.ClientSession() as session:
            results = [await _post(session, base) for _ in range(4)]
            metrics = await (await session.get(base + "/metrics")).text()
        assert [status for status, _, _ in results] == [200] * 4, results
        assert backend.closed_reused and len(backend.seen) == 4  # each request taken once
        assert app.router.backends[0].healthy and app.router.backends[0].failures == 0
        assert f'kvserve_router:requests_total{{backend="{backend.url}",code="200"}} 4.0' in metrics, metrics
    _run_quietly(body, caplog)


def test_ending_the_requests_in_flight_leaves_a_stream_whose_done_is_out_as_it_was() -> None:
    """`end_in_flight` (the router's second signal) on a stream whose [DONE] is out: only its end, no error
    event after the [DONE]; a request that comes later gets the 503 at once."""
    async def body() -> None:
        backend = FakeBackend("a", chunks=2, delay_s=0.0)
        backend.hang_after = 2  # after its [DONE]
        async with routed([backend]) as (app, base), aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                data = await response.content.readuntil(b"data: [DONE]\n\n")
                assert app.end_in_flight() == 1
                data += await asyncio.wait_for(response.content.read(), 5)
            late = await session.post(base + "/v1/completions", json={"prompt": "x", "stream": True})
            error = (await late.json())["error"]
            await asyncio.wait_for(backend.disconnected.wait(), 5)  # its request was closed: it aborts it
        assert _events(data) == ['{"backend": "a", "i": 0}', '{"backend": "a", "i": 1}', "[DONE]"]
        assert late.status == 503 and error["message"] == "the router is shutting down", error
    _run(body)


def _reads_at_the_router(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every chunk that aiohttp's StreamReader.readany hands out from now on (the router's reads of its backends'
    answers among them), so that a test can wait until the router has a given piece."""
    reads: list[bytes] = []
    original = aiohttp.StreamReader.readany

    async def readany(self: aiohttp.StreamReader) -> bytes:
        chunk = await original(self)
        reads.append(chunk)
        return chunk

    monkeypatch.setattr(aiohttp.StreamReader, "readany", readany)
    return reads


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_ending_the_requests_in_flight_drops_the_part_of_an_event_held_back(
        newline: bytes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stream ended (the router's second signal) while its backend has sent part of an event and then nothing:
    the router held that part back, so the client gets the whole events, then (at once) the error event and
    [DONE] in the backend's framing; the part is dropped."""
    whole = _stream_events(2, newline)
    partial = b'data: {"backend": "a", "i": 2' + (newline if newline == b"\r\n" else b"")
    reads = _reads_at_the_router(monkeypatch)

    async def body() -> None:
        backend = FakeBackend("a")
        backend.script, backend.script_end = [*whole, partial], "hang"
        async with routed([backend]) as (app, base), aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                data = await response.content.readuntil(whole[-1])

                async def read_by_the_router() -> None:
                    while partial not in reads:
                        await asyncio.sleep(0.01)

                await asyncio.wait_for(read_by_the_router(), 10)  # the router has it
                assert app.end_in_flight() == 1
                data += await asyncio.wait_for(response.content.read(), 5)
        assert data.startswith(b"".join(whole)), data
        values = _data_lines(data)
        assert values[:2] == [{"backend": "a", "i": 0}, {"backend": "a", "i": 1}] and values[3:] == ["[DONE]"], data
        assert values[2]["error"]["message"] == "the router is shutting down", data
        assert data.endswith(newline * 2 + b"data: [DONE]" + newline * 2), data
    text = _run_quietly(body, caplog)
    assert f"the router is shutting down: dropping the {len(partial)} bytes of an unfinished event" in text


def test_ending_the_requests_in_flight_again_ends_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """More signals (or the drain's time over) while a stream's end is under way: each request is ended once,
    so no second answer (a 503's status line and headers) is written into the stream, and its end is not cut
    short."""
    original = RouterApp._end_started

    async def slow_end(self: RouterApp, *args: Any) -> None:
        await asyncio.sleep(1.0)  # the end under way (as one that waits for a slow client) while signals come
        await original(self, *args)

    monkeypatch.setattr(RouterApp, "_end_started", slow_end)

    async def body() -> None:
        backend = FakeBackend("a", chunks=5, delay_s=0.0)
        backend.hang_after, backend.hang_inside, backend.hang_s = 2, 10, 1.0  # 10 bytes of event 2 (held back)
        async with routed([backend]) as (app, base):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
            payload = json.dumps({"prompt": "x", "stream": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            data = b""
            while b'"i": 1}' not in data:
                data += await reader.read(65536)
            await asyncio.sleep(0.2)  # 10 bytes of event 2 out, its rest held back
            for _ in range(3):
                app.end_in_flight()
                await asyncio.sleep(0.2)

            async def rest() -> None:  # up to the chunked body's end (the connection stays open)
                nonlocal data
                while not data.endswith(b"\r\n0\r\n\r\n") and (chunk := await reader.read(65536)):
                    data += chunk

            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rest(), 10)
            writer.close()
        assert data.endswith(b"\r\n0\r\n\r\n") and data.count(b"HTTP/1.1 ") == 1, data
        assert b"[DONE]" in data and data.index(b"shutting down") < data.index(b"[DONE]"), data
    _run(body)


def test_route_command_on_port_0_says_the_port_it_got() -> None:
    """--port 0 (the system picks one, as the server takes it): the router says which, as the server does; it said
    "routing http://127.0.0.1:0", the port it listened on to be found with ss or lsof."""
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "route", "--backend", "127.0.0.1:9", "--port", "0"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    try:
        lines: list[str] = []
        while not any("listening on port" in line for line in lines):
            line = proc.stdout.readline().decode()
            assert line, lines
            lines.append(line)
        found = re.search(r"listening on port (\d+) \(--port 0: the system's pick\)", lines[-1])
        assert found, lines
        health = httpx.get(f"http://127.0.0.1:{found.group(1)}/health", timeout=5)
        assert health.status_code == 503 and "no healthy backend" in health.text  # (the router's own answer)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_route_command_a_signal_during_start_up_stops_it_cleanly() -> None:
    """A SIGTERM while the start-up health checks wait on a backend that does not answer: the router stops
    without serving, exits 0, with no traceback."""
    async def body() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        backend_port = server.sockets[0].getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "kvserve", "route", "--backend", f"127.0.0.1:{backend_port}",
                                 "--port", str(free_port())], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        try:
            lines = []
            while not any("routing http://" in line for line in lines):  # logged as its loop starts
                line = (await asyncio.to_thread(proc.stdout.readline)).decode()
                assert line, lines
                lines.append(line)
            await asyncio.sleep(0.5)  # its start-up health check waits on the silent backend (2 s at most)
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 20)
            output = "".join(lines) + proc.stdout.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
            server.close()
        assert code == 0, (code, output)
        assert "Traceback" not in output, output
    _run(body)


def test_ending_the_requests_in_flight_cuts_a_stream_inside_an_event_over_the_held_limit(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Its backend silent inside an event longer than MAX_HELD_EVENT_BYTES (passed on as it came), a stream
    cannot take another: it is cut (never looks complete)."""
    monkeypatch.setattr(router_app, "MAX_HELD_EVENT_BYTES", 10)

    async def body() -> None:
        backend = FakeBackend("a", chunks=3, delay_s=0.0)
        backend.hang_after, backend.hang_inside = 1, 20  # silent after 20 bytes of event 1
        async with routed([backend]) as (app, base), aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                await response.content.readuntil(b'"i": 0}\n\n')
                await response.content.readexactly(20)
                app.end_in_flight()
                with pytest.raises(aiohttp.ClientPayloadError):  # not an answer that looks complete
                    await asyncio.wait_for(response.content.read(), 5)
    assert "cutting the client's answer (inside an event over 10 bytes)" in _run_quietly(body, caplog)


def test_ending_the_requests_in_flight_is_bounded_for_a_client_that_does_not_read(
        caplog: pytest.LogCaptureFixture) -> None:
    """A client that stops reading cannot take the stream's end: its connection is closed after END_IN_FLIGHT_S
    (else the router's exit would wait on it)."""
    async def body() -> None:
        backend = FakeBackend("big", chunks=200, delay_s=0.0)
        backend.padding = 1024 * 1024  # 200 MiB in all: the buffers between the router and the client fill
        async with routed([backend]) as (app, base), aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                await response.content.readuntil(b'"i"')  # then reads no more
                for _ in range(100):  # until the router's writes wait for the client
                    await asyncio.sleep(0.05)
                    if response.content.total_bytes > 0 and app.router.backends[0].in_flight == 1:
                        written = response.content.total_bytes
                        await asyncio.sleep(0.2)
                        if response.content.total_bytes == written:
                            break
                started = time.monotonic()
                assert app.end_in_flight() == 1
                while app.requests_in_flight:
                    assert time.monotonic() - started < END_IN_FLIGHT_S + 2, "the request did not end"
                    await asyncio.sleep(0.05)
                with pytest.raises(aiohttp.ClientPayloadError):  # cut: what it gets never looks complete
                    await asyncio.wait_for(response.content.read(), 10)
    assert "cutting the client's answer (its end could not be sent within 1 s)" in _run_quietly(body, caplog)


async def _backend_request_ended(app: Any, backend: FakeBackend) -> None:
    """The router closed its request to `backend` (the only one) and counts nothing in flight there."""
    await asyncio.wait_for(backend.disconnected.wait(), 5)
    for _ in range(50):
        if app.router.backends[0].in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert app.router.backends[0].in_flight == 0


def test_a_client_that_leaves_mid_stream_ends_the_backend_request() -> None:
    async def body() -> None:
        backend = FakeBackend("a", chunks=500, delay_s=0.02)
        async with routed([backend]) as (app, base):
            async with aiohttp.ClientSession() as session:
                async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                    await response.content.readline()  # the first event arrived; now hang up
            await _backend_request_ended(app, backend)
    _run(body)


def test_a_client_that_leaves_after_the_done_is_counted_as_served() -> None:
    """A client that hangs up once it has read `data: [DONE]` (as clients do: the OpenAI SDK stops reading there)
    before the backend's answer has ended got the whole answer: the request counts under the backend's status, not
    as "client_closed". Seen in a soak through the router: about 1 complete stream in 6 was counted so, which
    inflated the count of clients that left mid-answer."""
    async def body() -> None:
        backend = FakeBackend("a", chunks=2, delay_s=0.0)
        backend.hang_after = 2  # its [DONE] is out, the answer's end comes later
        async with routed([backend]) as (app, base):
            async with aiohttp.ClientSession() as session:
                async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                    await response.content.readuntil(b"data: [DONE]\n\n")
            await _backend_request_ended(app, backend)
            async with aiohttp.ClientSession() as session:
                metrics = await (await session.get(base + "/metrics")).text()
        assert f'kvserve_router:requests_total{{backend="{backend.url}",code="200"}} 1.0' in metrics, metrics
        assert 'code="client_closed"' not in metrics, metrics
    _run(body)


def test_a_client_gone_before_a_chunk_is_written_ends_quietly(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The race of a client that leaves while a chunk is on its way: the chunk arrives and the client's close
    (or reset) closes its transport in the same loop pass, before the disconnect cancels the handler, so the
    write finds the transport closing. Seen under load through `kvserve serve -dp 2` as aiohttp's "Error
    handling request" traceback; forced here by closing the transport just before the router's second write."""
    original_write = web.StreamResponse.write
    router_port: list[int] = []

    async def write(self: web.StreamResponse, data: bytes) -> None:
        request = self._req
        transport = request.transport if request is not None else None
        if transport is not None and transport.get_extra_info("sockname")[1] in router_port:
            self.writes = getattr(self, "writes", 0) + 1
            if self.writes == 2:
                transport.abort()  # closing now; connection_lost (and the cancellation) come a loop pass later
        await original_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)

    async def body() -> None:
        backend = FakeBackend("a", chunks=500, delay_s=0.02)
        async with routed([backend]) as (app, base):
            router_port.append(int(base.rsplit(":", 1)[1]))
            async with aiohttp.ClientSession() as session:
                with contextlib.suppress(aiohttp.ClientError):
                    await _post(session, base)
            await _backend_request_ended(app, backend)
            router_port.clear()
            async with aiohttp.ClientSession() as session:
                metrics = await (await session.get(base + "/metrics")).text()
        assert f'kvserve_router:requests_total{{backend="{backend.url}",code="client_closed"}} 1.0' in metrics
    _run_quietly(body, caplog)


def test_engine_metrics_merge_each_backends_series_under_its_engine_label() -> None:
    """`engine_metrics` (the replicas of `kvserve serve -dp N`): /metrics holds each backend's series labelled
    by its position, once per family, and leaves out a backend whose /metrics does not answer."""
    async def body() -> None:
        a, b, c = FakeBackend("a"), FakeBackend("b"), FakeBackend("c")
        for backend in (a, b, c):
            await backend.start()
        for backend, tokens in ((a, 3), (b, 5)):  # c has no /metrics (404)
            app = web.Application()
            exposition = ("# HELP kvserve:generation_tokens_total Tokens.\n"
                          "# TYPE kvserve:generation_tokens_total counter\n"
                          f'kvserve:generation_tokens_total{{model_name="m"}} {tokens}.0\n')
            app.router.add_get("/metrics", lambda _, text=exposition: web.Response(text=text))
            app.router.add_get("/health", backend.health)
            assert backend.runner is not None
            await backend.runner.cleanup()  # the same port, now with /metrics
            backend.runner = web.AppRunner(app)
            await backend.runner.setup()
            await web.TCPSite(backend.runner, "127.0.0.1", backend.port).start()
        router = RouterApp(Router([a.url, b.url, c.url], "prefix"),
                           RouterConfig(health_check_interval_s=60, engine_metrics=True))
        runner = web.AppRunner(router.make_app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:
                text = await (await session.get(f"http://127.0.0.1:{port}/metrics")).text()
        finally:
            await runner.cleanup()
            for backend in (a, b, c):
                await backend.stop()
        assert text.count("# TYPE kvserve:generation_tokens_total counter") == 1
        assert 'kvserve:generation_tokens_total{engine="0",model_name="m"} 3.0' in text
        assert 'kvserve:generation_tokens_total{engine="1",model_name="m"} 5.0' in text
        assert 'engine="2"' not in text and "# TYPE kvserve_router:requests_total counter" in text
    _run(body)


def test_engine_metrics_of_a_data_parallel_backend_stay_one_series_a_replica() -> None:
    """A backend that is itself `kvserve serve -dp 2` labels its replicas' series engine="0" and "1": behind a
    router with `engine_metrics` they stay two series (engine "<backend>.<replica>"), not one given twice."""
    replicas = ("# HELP kvserve:num_requests_running Running.\n"
                "# TYPE kvserve:num_requests_running gauge\n"
                'kvserve:num_requests_running{engine="0",model_name="m"} 2.0\n'
                'kvserve:num_requests_running{engine="1",model_name="m"} 3.0\n'
                "# HELP kvserve_router:retries_total Retries.\n"
                "# TYPE kvserve_router:retries_total counter\n"
                "kvserve_router:retries_total 1.0\n")
    plain = ("# HELP kvserve:num_requests_running Running.\n"
             "# TYPE kvserve:num_requests_running gauge\n"
             'kvserve:num_requests_running{model_name="m"} 4.0\n')
    text = merge_expositions([({"engine": "0"}, replicas), ({"engine": "1"}, plain)]).decode()
    samples = [(s.name, tuple(sorted(s.labels.items())), s.value)
               for family in text_string_to_metric_families(text) for s in family.samples]
    assert sorted(samples) == [
        ("kvserve:num_requests_running", (("engine", "0.0"), ("model_name", "m")), 2.0),
        ("kvserve:num_requests_running", (("engine", "0.1"), ("model_name", "m")), 3.0),
        ("kvserve:num_requests_running", (("engine", "1"), ("model_name", "m")), 4.0),
        ("kvserve_router:retries_total", (("engine", "0"),), 1.0),
    ]


# ------------------------------------------------------------------------------------------ the command


def test_route_command_in_front_of_a_real_server(tiny_server: ServerProcess) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "route", "--backend", tiny_server.base_url,
                             "--port", str(port), "--health-check-interval", "0.5"], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 30, "the router to answer /health")
        from openai import OpenAI

        request = {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 12, "temperature": 0}
        via = OpenAI(base_url=base + "/v1", api_key="x")
        direct = OpenAI(base_url=tiny_server.base_url + "/v1", api_key="x")
        streamed = "".join(c.choices[0].text for c in via.completions.create(**request, stream=True))
        assert streamed == direct.completions.create(**request).choices[0].text
        models = via.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        # A browser's request: the merged list carries the server's CORS answer (it had none: the browser could not
        # read it, where it reads the server's own).
        browser = {"Origin": "http://example.com"}
        direct_list, routed_list = (httpx.get(url + "/v1/models", headers=browser, timeout=10)
                                    for url in (tiny_server.base_url, base))
        assert routed_list.status_code == 200 and direct_list.headers["access-control-allow-origin"] == "*"
        assert routed_list.headers["access-control-allow-origin"] == "*", routed_list.headers
        assert "access-control-allow-origin" not in httpx.get(base + "/v1/models", timeout=10).headers
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0 and time.monotonic() - start < 30
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read().decode() if proc.stdout else ""
    assert "routing http://127.0.0.1:" in output and "to 1 backends (prefix)" in output


@asynccontextmanager
async def _route_process(backend: FakeBackend) -> AsyncIterator[tuple[subprocess.Popen[bytes], str]]:
    """A `kvserve route` process in front of `backend` (started here), answering; killed at the end if it still
    runs (its output: proc.stdout)."""
    await backend.start()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "route", "--backend", backend.url, "--port", str(port),
                             "--health-check-interval", "60"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                assert proc.poll() is None, "the router exited during start-up"
                with contextlib.suppress(aiohttp.ClientError):
                    if (await session.get(base + "/health")).status == 200:
                        break
                await asyncio.sleep(0.05)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        await asyncio.to_thread(proc.wait, 10)
        await backend.stop()


async def _refused(base: str) -> None:
    """Until a new connection to `base` is refused (the router stopped accepting: its drain began). A connection
    made as the listening socket closes is reset instead: the same."""
    host, port = base.removeprefix("http://").split(":")
    for _ in range(100):
        try:
            _, writer = await asyncio.open_connection(host, int(port))
        except (ConnectionRefusedError, ConnectionResetError):
            return
        writer.close()
        await asyncio.sleep(0.05)
    raise AssertionError("the router kept accepting connections")


async def _two_requests_then_a_signal(session: aiohttp.ClientSession, base: str, backend: FakeBackend,
                                     proc: subprocess.Popen) -> tuple[aiohttp.ClientResponse, bytes, asyncio.Task]:
    """A stream (its first event read) and a non-stream request in flight at `backend`, then a SIGTERM to the
    router, which stops accepting: (the stream's response, its first event, the other request's task)."""
    stream = await session.post(base + "/v1/completions", json={"prompt": "x", "stream": True})
    first = await stream.content.readuntil(b"\n\n")
    unstreamed = asyncio.create_task(session.post(base + "/v1/completions", json={"prompt": "y", "stream": False}))
    for _ in range(100):
        if len(backend.seen) == 2:
            break
        await asyncio.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    await _refused(base)
    return stream, first, unstreamed


def test_route_command_a_second_signal_ends_the_requests_in_flight_in_the_openai_format() -> None:
    """`kvserve route` given a second SIGTERM while the first one's drain waits on requests in flight: they end
    as the server ends its own (a JSON 503 in the OpenAI format; a stream's error event, then [DONE]) within
    about a second, and the router exits 0."""
    async def body() -> None:
        backend = FakeBackend("slow", chunks=400, delay_s=0.05)  # 20 s an answer
        async with _route_process(backend) as (proc, base), aiohttp.ClientSession() as session:
            stream, first, unstreamed = await _two_requests_then_a_signal(session, base, backend, proc)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = await asyncio.wait_for(stream.content.read(), 5)
            response = await asyncio.wait_for(unstreamed, 5)
            error = (await response.json())["error"]
            ended_in = time.monotonic() - started
            code = await asyncio.to_thread(proc.wait, 15)
        assert json.loads(first.decode().removeprefix("data: ")) == {"backend": "slow", "i": 0}
        events = _events(first + rest)
        assert events[-1] == "[DONE]" and json.loads(events[-3]).get("backend") == "slow", events
        streamed = json.loads(events[-2])["error"]
        for got in (streamed, error):
            assert set(got) == {"message", "type", "param", "code"}, got
            assert got["code"] == 503 and got["type"] == "ServiceUnavailableError", got
            assert "shutting down" in got["message"], got
        assert response.status == 503 and response.content_type == "application/json"
        assert ended_in < 3 and code == 0, (ended_in, code)  # (at once: the 20 s answers did not run on)
        assert backend.disconnected.is_set()  # the backend's requests were closed (it aborts them)
    _run(body)


def test_the_requests_still_in_flight_when_the_drain_time_is_over_end_in_the_openai_format(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """`serve_router` (the command's loop, here in this process with its time shortened): a signal drains; what
    is still in flight when SHUTDOWN_TIMEOUT_S is over ends as at a second signal, and it returns 0."""
    monkeypatch.setattr(router_app, "SHUTDOWN_TIMEOUT_S", 0.5)

    async def body() -> None:
        backend = FakeBackend("slow", chunks=400, delay_s=0.05)  # 20 s an answer
        await backend.start()
        port = free_port()
        app = RouterApp(Router([backend.url], "prefix"), RouterConfig(health_check_interval_s=60))
        serving = asyncio.create_task(router_app.serve_router(app, "127.0.0.1", port))
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(100):
                    with contextlib.suppress(aiohttp.ClientError):
                        if (await session.get(f"http://127.0.0.1:{port}/health")).status == 200:
                            break
                    await asyncio.sleep(0.05)
                async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                        json={"prompt": "x", "stream": True}) as response:
                    data = await response.content.readuntil(b"\n\n")
                    signal.raise_signal(signal.SIGTERM)
                    data += await asyncio.wait_for(response.content.read(), 5)
            assert await asyncio.wait_for(serving, 5) == 0
        finally:
            serving.cancel()
            await backend.stop()
        events = _events(data)
        assert json.loads(events[-2])["error"]["message"] == "the router is shutting down" and events[-1] == "[DONE]"
        assert 2 < len(events) < 100, events
    text = _run_quietly(body, caplog)
    assert "signal 15: stopping (no new connections; the 1 requests in flight may finish, up to 0.5 s)" in text
    assert "shutdown timeout: ending the 1 requests still in flight" in text


def test_route_command_a_signal_lets_the_requests_in_flight_finish() -> None:
    """SIGTERM: the router stops accepting, the requests in flight finish (a stream to its [DONE]), then it
    exits 0."""
    async def body() -> None:
        backend = FakeBackend("slow", chunks=10, delay_s=0.1)  # a second an answer
        async with _route_process(backend) as (proc, base), aiohttp.ClientSession() as session:
            stream, first, unstreamed = await _two_requests_then_a_signal(session, base, backend, proc)
            rest = await asyncio.wait_for(stream.content.read(), 10)
            response = await asyncio.wait_for(unstreamed, 10)
            answer = await response.json()
            code = await asyncio.to_thread(proc.wait, 10)
        events = _events(first + rest)
        assert [json.loads(e)["i"] for e in events[:-1]] == list(range(10)) and events[-1] == "[DONE]", events
        assert response.status == 200 and answer == {"backend": "slow", "chunks": 10}
        assert code == 0
    _run(body)
