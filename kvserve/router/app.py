"""`kvserve route`: one address in front of several OpenAI-compatible servers (kvserve replicas, or any).

Every request under /v1/ (and /tokenize, /detokenize, /version) goes to one healthy backend, chosen by
the policy (`router.policies`), and its answer comes back as the backend sends it: status, headers and
body, streamed chunk by chunk (server-sent events pass through unchanged). The client's Authorization
header is forwarded, so backends started with --api-key check it themselves.

* A request naming a `model` goes only to backends whose /v1/models lists it (404 when none does);
  `GET /v1/models` merges the healthy backends' lists (each asked for up to HEALTH_TIMEOUT_S, with the client's
  headers: a browser's Origin gets the first answer's CORS headers, Access-Control-* and Vary, with the list), and
  `GET /v1/models/{model}` is routed by the model its path names. A backend whose list is not known (not reached yet,
  or its /v1/models does not answer the router with a list: one started with --api-key answers 401 to a
  router without that key, a warning once a backend) is tried for any model. When such a backend answers a
  404 whose OpenAI error says the model does not exist ("The model `X` does not exist.", as kvserve's and
  vLLM's servers say it), the request goes to the next candidate; the client gets a 404 (the router's own,
  as when no backend is a candidate) only when every candidate said so. Any other 404, and any 404 from a
  backend whose list names the model, is passed on. When only backends whose lists are unknown could take
  the request and they fail (or some say they lack the model), the answer stays a 503 (one that failed may
  be loading the model), whose message says that no backend that answered lists the model
  (`Router.known_missing`).
* Each health check's /v1/models answer replaces the backend's list: any answer but a 200 with a list (a
  401 or 403, a backend restarted with another model and a key the router lacks, a body not understood)
  makes it unknown again, so that a list the backend no longer serves is not kept. A poll that gets no
  answer (connection failure, timeout) keeps the list: the backend is down, or going down, which its
  /health marks, and one that comes back with another model answers the next poll.
* A request goes to the next backend only while none of an answer to it has come: its backend refused the
  connection (or did not take it within CONNECT_TIMEOUT_S), dropped it before answering (it died, or was
  killed), answered 503 (draining, or its engine is gone) or what is no HTTP (a port of another protocol).
  That backend is marked unhealthy until its /health answers 200 again; when every backend is marked, each is
  still tried, spread by the policy (`Router.order`). A dropped connection may have carried the request in:
  kvserve and vLLM abort a request whose connection closes (and a backend that died took it with it), so it
  does not run twice; only a backend whose side of the connection stays open (something in between that drops
  the router's side alone) may run it on, at the cost of its compute alone: the client, which saw none of that
  answer, gets one. A request on a pooled connection that the backend closed as it went out (its keep-alive
  timeout ending then) goes again on another connection (`RouterApp._send`); the backend is not marked.
  Nothing else is sent again (bar the 404s above): once an answer has started, an error is the client's to see
  (it is passed on, or the stream ends); a timeout is a 504, and any other status (4xx, 500) is passed on as it
  came. A backend silent for `--request-timeout` seconds (before its answer or between two chunks) ends the
  request: 504 before the answer (the replicas of `kvserve serve -dp N` have no such limit, as one server
  has none). A server-sent event stream (`text/event-stream`) is passed on in whole events: the bytes after
  its last event's end (a blank line; lines end in LF, CRLF or CR, as the SSE spec allows) are held back
  until the rest of their event comes (`_EventStream`; kvserve's backends send whole events, which pass at
  once, uncopied). Comment lines (":" first) between events pass at once, each whole, blank line or not:
  the keep-alives (`: ping`) a server sends while it has nothing else reach the client in time. A backend
  that ends its events with a single line end, no blank line (not the SSE format: kvserve, vLLM and
  sse-starlette always send the blank line), is held back until the answer's end (or MAX_HELD_EVENT_BYTES):
  without the blank line the router cannot tell an event's end from its next line's. A backend that breaks
  off (or goes silent) mid-answer: such a stream ends as the server ends one it cannot finish, with an
  error event in the OpenAI format (503, or 504 for the timeout) and `data: [DONE]` (nothing after a `data:
  [DONE]` line already sent, whatever came after it), framed as the backend framed its events (LF, CRLF or
  CR); the part of an event held back is dropped (a warning gives its size). At the answer's normal end
  what is held is passed on as it came (a last event without its blank line). An event longer than
  MAX_HELD_EVENT_BYTES is not held: it is passed on as it comes (a warning, once a stream), and a stream
  cut inside it, like any other answer that breaks off, is cut for the client too (its connection is
  closed), so that it never looks complete.
* No limit on the requests in flight: the connections to the backends are not pooled under a cap (aiohttp's
  default of 100 would queue the rest unseen); the backends' own schedulers decide what waits.
* A request body over `max_body_bytes` gets 413 with OpenAI's error body, as the server answers.
* Each backend's /health (and, while healthy, /v1/models) is polled every `--health-check-interval` s, with
  `--api-key` (`RouterConfig.api_key`) as its Authorization (as is each backend's /metrics, read with
  `engine_metrics`).
* A client that disconnects ends its request: the router closes the backend connection, which the
  backend takes as an abort.
* `GET /ping` (and POST) goes to a backend as /v1/* does: the server's liveness path, as vLLM's. With
  `root_path` (the replicas' --root-path), those paths under it are forwarded too, unchanged.
* `GET /health`: 200 while at least one backend is healthy, else 503 (OpenAI's error body).
  `GET /router/backends`: each backend's state (JSON). `GET /metrics`: the router's own Prometheus
  series (requests by backend and status, retries, in-flight and health per backend); with
  `engine_metrics` (`--engine-metrics`; the replicas of `kvserve serve --data-parallel-size`) also each
  backend's own /metrics,
  labelled `engine="<i>"` by its position (`"<i>.<j>"` for replica j of a backend that is itself a -dp
  server; a backend that does not answer within 2 s is left out).
* SIGTERM / SIGINT: stop accepting, let requests in flight finish (up to 60 s), exit 0. Those still in flight
  then, or at a second signal, end as the server ends those it stops (`RouterApp.end_in_flight`): a 503 in the
  OpenAI format when the answer has not started, a stream's error event and `data: [DONE]` (nothing after a
  [DONE] already sent; the part of an event held back is dropped, as above), each within a second (else, or
  inside an event over MAX_HELD_EVENT_BYTES, its connection is dropped); the router then exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvserve.entrypoints.openai.api_key import api_key_problem
from kvserve.entrypoints.openai.sse import SSE_DONE, sse
from kvserve.router.exposition import merge_expositions
from kvserve.router.policies import Backend, Router, prefix_key

logger = logging.getLogger("kvserve.router")

# Request headers not forwarded (hop-by-hop, or set again by the client session).
_DROP_REQUEST = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                 "proxy-authorization", "proxy-connection"}
# Response headers not copied back (the router frames the body itself).
_DROP_RESPONSE = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
HEALTH_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 5.0
# The most time a backend may stay silent (before its answer, or between two chunks of it): a long
# non-streamed completion sends nothing until it is done.
DEFAULT_REQUEST_TIMEOUT_S = 600.0
MAX_BODY_BYTES = 32 * 1024 * 1024  # as the kvserve server's own limit
SHUTDOWN_TIMEOUT_S = 60.0
# How long a request the router ends (`RouterApp.end_in_flight`) may take to send its end before its connection
# is closed: a client that stops reading would hold it forever. As the server's own bound.
END_IN_FLIGHT_S = 1.0
SHUTTING_DOWN = "the router is shutting down"
PROXIED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/version")
PROXIED_PATHS = ("/ping",)
# The longest event stream event held back whole (see the module's docstring): a longer one is passed on as it
# comes, so that the router's memory stays bounded.
MAX_HELD_EVENT_BYTES = 4 * 1024 * 1024


# How many times a request whose pooled connection the backend had closed is sent again (`RouterApp._send`): once. A
# backend that took the request and then dropped the connection (one that died on it) looks the same from here, and
# would be sent the request again each time.
STALE_CONNECTION_RETRIES = 1


@dataclass
class _Sent:
    """A request's trace context (aiohttp's trace_request_ctx): whether it went out on a pooled connection."""

    reused: bool = False


def _reuse_trace() -> aiohttp.TraceConfig:
    """Marks each request sent on a pooled connection (its `_Sent`)."""

    async def reused(_: aiohttp.ClientSession, context: Any, __: aiohttp.TraceConnectionReuseconnParams) -> None:
        if isinstance(context.trace_request_ctx, _Sent):
            context.trace_request_ctx.reused = True

    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(reused)
    return trace


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    from kvserve.entrypoints.openai.errors import error_body

    # Compact, as the server's own error bodies.
    return web.json_response(error_body(status, message, param=param), status=status,
                             dumps=lambda body: json.dumps(body, separators=(",", ":"), ensure_ascii=False))


@dataclass(frozen=True)
class RouterConfig:
    """How the router serves: `kvserve route`'s flags, or what `kvserve serve -dp N` sets for its replicas."""

    health_check_interval_s: float = 5.0
    # The most a backend may stay silent (before its answer, or between two chunks of it); None: no limit.
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S
    # Larger request bodies get 413.
    max_body_bytes: int = MAX_BODY_BYTES
    # /metrics also holds each backend's own series, labelled engine="<i>" (the replicas of -dp N).
    engine_metrics: bool = False
    # Sent with the router's own requests to the backends (/health, /v1/models, /metrics); clients' requests carry
    # their own Authorization.
    api_key: str | None = None
    # The backends' --root-path: a path under it is forwarded as it came (the backend strips it) when the
    # path below it is one the router forwards.
    root_path: str = ""

    def __post_init__(self) -> None:
        if not self.health_check_interval_s > 0:
            raise ValueError(f"the health check interval must be positive, got {self.health_check_interval_s}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"the request timeout must be positive, got {self.request_timeout_s}")
        if self.max_body_bytes < 1:
            raise ValueError(f"the request body limit must be positive, got {self.max_body_bytes}")
        problem = None if self.api_key is None else api_key_problem(self.api_key)
        if problem is not None:
            # (a control character: aiohttp refused to send it, and the router failed at its first health check,
            # with "Forbidden control character detected in headers" and no word of the key)
            raise ValueError(problem)


class RouterApp:
    def __init__(self, router: Router, config: RouterConfig | None = None) -> None:
        self.router = router
        self.config = config if config is not None else RouterConfig()
        self.registry = CollectorRegistry()
        self.requests = Counter("kvserve_router:requests", "Requests, by backend and outcome: the HTTP status "
                                "sent, client_closed, or stream_error (backend \"none\": the router's own answers).",
                                ["backend", "code"], registry=self.registry)
        self.retries = Counter("kvserve_router:retries", "Requests sent on to another backend after one failed.",
                               registry=self.registry)
        in_flight = Gauge("kvserve_router:requests_in_flight", "Requests in flight, by backend.", ["backend"],
                          registry=self.registry)
        healthy = Gauge("kvserve_router:backend_healthy", "1 while the backend is healthy.", ["backend"],
                        registry=self.registry)
        for backend in router.backends:
            in_flight.labels(backend.label).set_function(lambda b=backend: b.in_flight)
            healthy.labels(backend.label).set_function(lambda b=backend: 1.0 if b.healthy else 0.0)
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[object]] = set()  # the tasks of the requests in flight
        self._ending = False  # `end_in_flight` was called: every request still in flight ends now
        self._told_to_end: set[asyncio.Task[object]] = set()  # the tasks `end_in_flight` has cancelled
        self._refused_models: set[str] = set()  # the backends whose /v1/models refused the router's key (logged)

    # ------------------------------------------------------------------ app

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._track])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/router/backends", self.backends)
        app.router.add_get("/v1/models", self.models)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            # limit=0: no cap on the connections (aiohttp's default, 100 in all, would hold the 101st request
            # in flight back in the router, unseen by the backends' schedulers and metrics).
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                          sock_read=self.config.request_timeout_s),
            auto_decompress=False,
            trace_configs=[_reuse_trace()],
        )
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def _stop(self, _: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ ending what is in flight

    @property
    def requests_in_flight(self) -> int:
        return len(self._handlers)

    def end_in_flight(self) -> int:
        """End every request in flight now, as the server ends those it stops (a second signal, or the drain's
        time over): a 503 in the OpenAI format when its answer has not started, a stream's error event and
        `data: [DONE]` (only the end if its [DONE] is out; the part of an event held back dropped), each within
        END_IN_FLIGHT_S; an answer that cannot end so (started but no event stream, inside an event over
        MAX_HELD_EVENT_BYTES, or not within that time) is cut. Closing their backend connections aborts them
        there. Requests that arrive later get the 503 at once. Returns how many were in flight."""
        self._ending = True
        for task in self._handlers - self._told_to_end:  # once each: a second cancel would cut its end short
            task.cancel()
        self._told_to_end |= self._handlers
        return len(self._handlers)

    @web.middleware
    async def _track(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every request's task is known (`end_in_flight` cancels them); a cancelled one whose answer had not
        started gets the 503 (one whose answer had, `_forward` ends itself)."""
        if self._ending:
            return self._own(_error(503, SHUTTING_DOWN))
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if not self._ending:  # the client left (aiohttp cancels its handler)
                raise
            _uncancel(task)
            return self._own(_error(503, SHUTTING_DOWN))
        finally:
            self._handlers.discard(task)
            self._told_to_end.discard(task)

    # ------------------------------------------------------------------ health

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self.router.backends))

    async def _check(self, backend: Backend) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        try:
            async with self.session.get(backend.url + "/health", timeout=timeout, headers=self._auth) as response:
                ok, why = response.status == 200, f"/health answered {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, why = False, f"/health failed: {_describe(exc)}"
        self._set_health(backend, ok, why)
        if not ok:
            return
        try:  # which models it serves
            async with self.session.get(backend.url + "/v1/models", timeout=timeout, headers=self._auth) as response:
                status, listing = response.status, await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return  # no answer: its list is kept (it may be going down: its next /health check says so)
        backend.models = self._listed_models(backend, status, listing)

    def _listed_models(self, backend: Backend, status: int, listing: bytes) -> set[str] | None:
        """The models a /v1/models answer lists; None (unknown: the backend is tried for any model) for any other
        answer, so that a list the backend no longer answers with is not kept. A 401 or 403 (the router lacks the
        backend's key) is logged once a backend."""
        if status in (401, 403) and backend.url not in self._refused_models:
            self._refused_models.add(backend.url)
            logger.warning("backend %s answers %d to the router's /v1/models: its models stay unknown, so it is tried "
                           "for every model; give the router its API key (--api-key)", backend.url, status)
        if status != 200:
            return None
        try:
            return {m["id"] for m in json.loads(listing)["data"]}
        except (ValueError, KeyError, TypeError, RecursionError):
            return None

    def _set_health(self, backend: Backend, ok: bool, why: str) -> None:
        if ok and not backend.healthy:
            logger.info("backend %s is healthy again", backend.url)
        elif not ok and backend.healthy:
            logger.warning("backend %s is unhealthy (%s)", backend.url, why)
        backend.healthy = ok
        if ok:
            backend.refused = False
        else:
            backend.last_error = why

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            await self.check_health()

    async def health(self, _: web.Request) -> web.Response:
        live = len(self.router.healthy())
        if not live:
            return _error(503, f"no healthy backend (of {len(self.router.backends)})")
        return web.json_response({"status": "ok", "healthy_backends": live, "backends": len(self.router.backends)})

    async def backends(self, _: web.Request) -> web.Response:
        return web.json_response({"policy": self.router.policy, "backends": [
            {"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "served": b.served,
             "failures": b.failures, "last_error": b.last_error,
             "models": None if b.models is None else sorted(b.models)} for b in self.router.backends]})

    async def metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        if self.config.engine_metrics:
            texts = await asyncio.gather(*(self._scrape(b) for b in self.router.backends))
            parts = [({"engine": str(i)}, text) for i, text in enumerate(texts) if text is not None]
            body = merge_expositions([*parts, ({}, body.decode())])
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def _scrape(self, backend: Backend) -> str | None:
        """The backend's /metrics text, or None when it does not answer 200 in time."""
        assert self.session is not None
        try:
            async with self.session.get(backend.url + "/metrics", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S),
                                        headers=self._auth) as response:
                return await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
            return None

    # ------------------------------------------------------------------ proxy

    async def models(self, request: web.Request) -> web.StreamResponse:
        """The healthy backends' model lists, merged (the first backend's entry for a model id). The backends are
        asked at once, each for up to HEALTH_TIMEOUT_S (as the router's own polls of /v1/models): one that does not
        answer in time is left out, where it held the answer for --request-timeout (600 s by default, or for
        ever without one), one backend after another."""
        assert self.session is not None
        headers = _forward_headers(request)
        answers = await asyncio.gather(*(self._list_models(backend, headers)
                                         for backend in self.router.healthy() or self.router.backends))
        merged: dict[str, object] = {}
        errors = []
        cors: CIMultiDict[str] | None = None
        for answer in answers:
            if isinstance(answer, web.Response):  # the client's key refused: the backend's answer is the answer
                return self._own(answer)
            if isinstance(answer, str):
                errors.append(answer)
                continue
            entries, headers = answer
            if cors is None:
                cors = headers
            for entry in entries:
                merged.setdefault(entry["id"], entry)
        if not merged and errors:
            return self._own(_error(503, "no backend listed its models: " + "; ".join(errors)))
        listing = web.json_response({"object": "list", "data": list(merged.values())})
        if cors:  # a browser's request (its Origin forwarded): the backends' CORS answer, so that it may read this one
            listing.headers.extend(cors)
        return self._own(listing)

    async def _list_models(self, backend: Backend, headers: CIMultiDict[str]
                           ) -> tuple[list[dict[str, Any]], CIMultiDict[str]] | web.Response | str:
        """A backend's /v1/models entries for a client's GET /v1/models, with its answer's CORS headers
        (Access-Control-*, Vary); its answer when it refuses the client's key (401, 403); else why it has no list
        (a reason for the 503 when none has)."""
        assert self.session is not None
        try:
            async with self.session.get(backend.url + "/v1/models", headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as response:
                if response.status in (401, 403):  # as it came (its WWW-Authenticate, say)
                    return _copy_headers(response, web.Response(status=response.status, reason=response.reason,
                                                                body=await response.read()))
                if response.status != 200:
                    return f"{backend.url}: {response.status}"
                entries = (await response.json())["data"]
                if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("id"), str)
                                                            for e in entries):
                    raise TypeError("not a list of models")
                return entries, CIMultiDict((name, value) for name, value in response.headers.items()
                                            if name.lower().startswith("access-control-") or name.lower() == "vary")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
            return f"{backend.url}: {type(exc).__name__}"

    def _own(self, response: web.Response) -> web.Response:
        self.requests.labels("none", str(response.status)).inc()
        return response

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        path = _below_root(request.path, self.config.root_path)
        if not (path.startswith(PROXIED_PREFIXES) or path in PROXIED_PATHS):
            return self._own(_error(404, f"not found: {request.path} (the router forwards /v1/*, /tokenize, "
                                    "/detokenize, /version, /ping)"))
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._own(_error(413, f"request body is over the limit of {self.config.max_body_bytes} bytes"))
        key = model = parsed = None
        if body:
            try:
                parsed = json.loads(body)
            except (ValueError, RecursionError):
                parsed = None  # not JSON (or absurdly nested): the backend will say so
            if isinstance(parsed, dict):
                model = parsed.get("model") if isinstance(parsed.get("model"), str) else None
                if self.router.policy == "prefix":
                    key = prefix_key(parsed)
        if model is None and request.method == "GET" and path.startswith("/v1/models/") and len(path) > 11:
            model = path[len("/v1/models/"):]  # OpenAI's retrieve-model: to a backend that serves it
        # A stored response lives on the backend that made it: a backend that does not have it says so with a
        # 404, and the next is asked.
        stored_ref = _names_stored_response(path, parsed)
        candidates = self.router.order(key, model)
        if not candidates:
            return self._own(_error(404, f"{_no_such_model(model)} It is not served by any backend (served: "
                                    f"{self._served_models()})", param="model"))
        headers = _forward_headers(request)
        errors: list[str] = []
        unserved: list[str] = []  # the backends whose lists are unknown that answered that they lack `model`
        lacked_model = False  # the last backend tried answered that it does not serve the model: no failure
        lacking_response: list[str] = []  # the backends that answered that they do not store the named response
        for i, backend in enumerate(candidates):
            if i and not lacked_model:
                self.retries.inc()
            num_unserved, num_lacking = len(unserved), len(lacking_response)
            response = await self._forward(request, backend, body, headers, model, errors, unserved,
                                           last=i == len(candidates) - 1,
                                           lacking_response=lacking_response if stored_ref else None)
            if response is not None:
                return response
            lacked_model = len(unserved) > num_unserved or len(lacking_response) > num_lacking
        if len(unserved) == len(candidates):
            return self._own(_error(404, f"{_no_such_model(model)} It is not served by any backend (served: "
                                    f"{self._served_models()}; nor by those whose lists are unknown: "
                                    f"{', '.join(unserved)})", param="model"))
        if model is not None and self.router.known_missing(model):
            # Only backends whose lists are unknown were left to try, and they failed (or lack it). Still a 503,
            # which clients retry: such a backend may be one still loading that will serve the model; the message
            # says what is known.
            return self._own(_error(503, f"the model {model!r} is not listed by any backend that answered (served: "
                                    f"{self._served_models()}); the backends whose models are unknown could not "
                                    f"take it: {'; '.join(errors)}"))
        return self._own(_error(503, "every backend failed: " + "; ".join(errors)))

    async def _end_started(self, request: web.Request, response: web.StreamResponse,
                           events: _EventStream | None) -> None:
        """End an answer under way that `end_in_flight` stops, within END_IN_FLIGHT_S: an event stream (`events`)
        with an error event and [DONE] (only the end if its [DONE] is out), the part of an event it holds back
        dropped; otherwise (no event stream, one passed on inside an event over MAX_HELD_EVENT_BYTES, or past
        that time) cut it, dropping the client's connection, so that it never looks complete."""
        from kvserve.entrypoints.openai.errors import error_body

        async def end(events: _EventStream) -> None:
            transport = request.transport
            # Cancelled while it waited for the client to take the answer, a write leaves aiohttp's wait for that
            # cancelled (a next write would end at once) until the client has taken the buffer down to its
            # low-water mark: wait for that first.
            while transport is not None and transport.get_write_buffer_size() > transport.get_write_buffer_limits()[0]:
                await asyncio.sleep(0.01)
            ending = events.end(error_body(503, SHUTTING_DOWN))
            if ending:
                await response.write(ending)
            await response.write_eof()

        why = "not an event stream"
        if events is not None and events.inside:
            why = f"inside an event over {MAX_HELD_EVENT_BYTES} bytes"
        elif events is not None:
            _drop_held(request, events, "the router is shutting down")
            try:
                await asyncio.wait_for(end(events), END_IN_FLIGHT_S)
                return
            except asyncio.TimeoutError:
                why = f"its end could not be sent within {END_IN_FLIGHT_S:g} s"
            except ConnectionResetError as exc:
                why = _describe(exc)
        logger.warning("%s %s: cutting the client's answer (%s)", request.method, request.path, why)
        if request.transport is not None:
            request.transport.abort()  # at once: what it has not taken yet is dropped

    def _served_models(self) -> str:
        """The models the backends' known lists name, for an error's message."""
        return ", ".join(sorted({m for b in self.router.backends for m in (b.models or ())})) or "none known"

    def _refused(self, backend: Backend, why: str, errors: list[str]) -> str:
        """Record that `backend` could not take a request (the next one gets it): the "retried" outcome."""
        backend.failures += 1
        backend.refused = True
        self._set_health(backend, False, why)
        errors.append(f"{backend.url}: {why}")
        return "retried"

    async def _send(self, request: web.Request, backend: Backend, body: bytes,
                    headers: CIMultiDict[str]) -> aiohttp.ClientResponse:
        """The request sent to `backend`, its answer's start. A pooled connection that the backend closed as it sat
        idle (its keep-alive timeout, uvicorn's 5 s, kvserve's and vLLM's, ending as the request went out) fails with
        a disconnect or a reset, the backend not having taken the request: it goes again on another connection (once,
        STALE_CONNECTION_RETRIES; aiohttp retries only GET-like methods), and the backend is not marked."""
        assert self.session is not None
        tries = 0
        while True:
            sent = _Sent()
            try:
                return await self.session.request(request.method, backend.url + request.path_qs, data=body,
                                                  headers=headers, trace_request_ctx=sent)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if not sent.reused or tries >= STALE_CONNECTION_RETRIES:
                    raise
                tries += 1
                logger.debug("%s %s: a pooled connection to %s was closed (%s): sending again", request.method,
                             request.path, backend.url, _describe(exc))

    async def _forward(self, request: web.Request, backend: Backend, body: bytes, headers: CIMultiDict[str],
                       model: str | None, errors: list[str], unserved: list[str],
                       last: bool, lacking_response: list[str] | None = None) -> web.StreamResponse | None:
        """The backend's answer streamed to the client, or None when it could not take the request (try
        the next): why goes to `errors`, and the backend's URL to `unserved` when its list is unknown and it
        answered that it does not serve `model` (the request's), or to `lacking_response` (given for a request
        naming a stored response) when it answered that it does not store that response."""
        assert self.session is not None
        backend.in_flight += 1
        backend.served += 1
        outcome = "client_closed"  # unless the answer completes (or fails) first
        upstream: aiohttp.ClientResponse | None = None
        response: web.StreamResponse | None = None
        events: _EventStream | None = None  # an event stream's state: what it holds back, what was passed on
        finishing = False  # the answer's end is being written
        # An event stream's end (`data: [DONE]`) was written to the client: it has the whole answer, so one that
        # hangs up now (as clients do on reading it, often before the backend's answer has ended) is served, not
        # "client_closed".
        delivered = False
        try:
            try:
                upstream = await self._send(request, backend, body, headers)
            except aiohttp.ConnectionTimeoutError as exc:  # (a TimeoutError too) no connection: the next one
                outcome = self._refused(backend, _describe(exc), errors)
                return None
            except asyncio.TimeoutError:
                outcome = "504"
                return _error(504, f"{backend.url} sent nothing for {self.config.request_timeout_s:g} s "
                              "(--request-timeout)")
            except aiohttp.ClientConnectionError as exc:
                outcome = self._refused(backend, _describe(exc), errors)
                return None
            except aiohttp.ClientResponseError as exc:
                # An answer that is no HTTP (a port of another protocol, a gRPC one, say) or one aiohttp cannot read
                # (a redirect loop, a header over its limits): no answer began, as for a broken connection.
                outcome = self._refused(backend, f"its answer could not be read: {type(exc).__name__}: "
                                        f"{' '.join(str(exc.message).split())}", errors)
                return None
            # An answer the router reads whole before the client's starts (to tell whether to try the next
            # backend) that breaks off or goes silent: the backend failed before any of the answer was sent.
            read_whole = upstream.status == 503 and not last or upstream.status == 404 and (
                lacking_response is not None and not last or model is not None and backend.models is None)
            answer = b""
            if read_whole:
                try:
                    answer = await upstream.read()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                    outcome = self._refused(backend, f"its {upstream.status} answer broke off: {_describe(exc)}",
                                            errors)
                    return None
            if upstream.status == 503 and not last:
                text = answer[:300].decode(errors="replace")
                outcome = self._refused(backend, f"503 {text}", errors)
                return None
            if upstream.status == 404 and lacking_response is not None and not last:
                if _response_missing(answer):
                    errors.append(f"{backend.url}: 404, does not store the response")
                    lacking_response.append(backend.url)
                    outcome = "retried"
                    return None
                outcome = "404"
                return _copy_headers(upstream, web.Response(status=404, reason=upstream.reason, body=answer))
            if upstream.status == 404 and model is not None and backend.models is None:
                # Tried for a model it may not serve (its list unknown): if it says it does not, the next may.
                if _model_missing(answer, model):
                    errors.append(f"{backend.url}: 404, does not serve the model")
                    unserved.append(backend.url)
                    outcome = "retried"
                    return None
                outcome = "404"  # any other 404 is the client's: passed on as it came, read whole
                return _copy_headers(upstream, web.Response(status=404, reason=upstream.reason, body=answer))
            response = _copy_headers(upstream, web.StreamResponse(status=upstream.status, reason=upstream.reason))
            if upstream.content_type == "text/event-stream":
                events = _EventStream(f"{request.method} {request.path}: the answer from {backend.url}")
            await response.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientPayloadError, asyncio.TimeoutError, aiohttp.ClientConnectionError) as exc:
                    # The backend failed or went silent mid-answer (or was stopped at once).
                    outcome = "stream_error"
                    if events is not None and not events.inside:
                        # End the stream as the server ends one it cannot finish, with an error event in the
                        # OpenAI format and [DONE] (only the end, if [DONE] is out), without the part of an event
                        # held back.
                        logger.warning("%s %s: the answer from %s broke off (%s): ending the client's stream with "
                                       "an error event", request.method, request.path, backend.url,
                                       type(exc).__name__)
                        _drop_held(request, events, f"the answer from {backend.url} broke off")
                        finishing = True
                        with contextlib.suppress(ConnectionResetError):
                            ending = events.end(_error_event(backend, exc, self.config.request_timeout_s))
                            if ending:
                                await response.write(ending)
                            await response.write_eof()
                        return response
                    # Not an event stream, or cut inside an event passed on as it came: cut the client's stream
                    # too, by closing its connection, so that it sees an incomplete answer. aiohttp's write_eof
                    # then fails with a ConnectionError, which it takes quietly.
                    logger.warning("%s %s: the answer from %s broke off (%s): cutting the client's stream",
                                   request.method, request.path, backend.url, type(exc).__name__)
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if not chunk:
                    break
                if events is not None:
                    # (`events` counts it passed on before the write: cancelled in the write's wait for the client,
                    # it was handed to the transport all the same.)
                    chunk = events.take(chunk)
                    if not chunk:
                        continue
                try:
                    await response.write(chunk)
                    delivered = events is not None and events.done
                except ConnectionResetError:
                    # The client left after this chunk arrived but before the disconnect cancelled this handler
                    # (a close or reset seen in the same loop pass): "client_closed", quietly (not a 500 and a
                    # traceback in the log); closing `upstream` below aborts the backend's request.
                    return response
            finishing = True
            try:
                if events is not None and events.held:  # a last event without its blank line: as it came
                    await response.write(events.flush())
                await response.write_eof()
            except ConnectionResetError:  # (the same, at the end of the answer)
                return response
            outcome = str(upstream.status)
            return response
        except asyncio.CancelledError:
            if not self._ending:  # the client left (aiohttp cancels its handler)
                raise
            task = asyncio.current_task()
            assert task is not None
            _uncancel(task)
            if response is None or not response.prepared:
                outcome = "503"
                return _error(503, SHUTTING_DOWN)
            if not finishing:
                outcome = "stream_error"
                await self._end_started(request, response, events)
            return response
        finally:
            if upstream is not None:
                # Closing (not releasing) the connection: if the client left mid-answer (or the router ends the
                # request), the backend sees the disconnect and aborts the request.
                upstream.close()
            backend.in_flight -= 1
            if outcome == "client_closed" and delivered and upstream is not None:
                outcome = str(upstream.status)
            if outcome != "retried":
                self.requests.labels(backend.label, outcome).inc()


# Two line ends in a row (each of LF, CRLF or CR; a CRLF's CR is followed by its LF, never by another line end):
# a blank line, the end of an event. Every such pair of bytes in an event stream is one.
_BLANK_LINES = (b"\n\n", b"\n\r", b"\r\r")
# A chunk that ends so ends at an event's end (the LF of a blank line's CRLF included): it passes whole, at once.
_EVENT_ENDS = (*_BLANK_LINES, b"\n\r\n", b"\r\r\n")
# A data line of [DONE] (the line ends after it), at the start of what is searched or after a line end.
_DONE_LINE = re.compile(rb"(?:^|(?<=[\r\n]))data: ?\[DONE\](?=[\r\n])")
# The Responses API's stream has no [DONE]: its last event is one of these (an `event:` line naming it)
_RESPONSE_END_LINE = re.compile(rb"(?:^|(?<=[\r\n]))event: ?response\.(?:completed|incomplete|failed)(?=[\r\n])")
_LINE_END = re.compile(rb"\r\n|\r|\n")
_TAIL_BYTES = 32  # the end of what was passed on that is kept: room to tell the backend's line end


def _opens_its_event(out: bytes, line: int) -> bool:
    """Whether the line at `out[line]` is the first data line of its event (no `data` field between the event's
    start, or the start of `out`, and it): an event whose data only begins with [DONE] ends the stream for clients
    (they read the data `[DONE]` or `[DONE]\n...`), one whose data is `x\n[DONE]` does not."""
    start = max(out.rfind(pair, 0, line) for pair in _BLANK_LINES)
    return not any(part.startswith(b"data") for part in _LINE_END.split(out[max(start, 0):line]))


def _last_event_end(data: bytes | bytearray, start: int, before: bytes) -> int:
    """Just past the last blank line in `data` that ends after `data[start]` (the bytes before it were looked at
    before), its CRLF's LF included; -1 if none. `before`: the byte that came before `data`, when `start` is 0."""
    found = max(data.rfind(pair, max(start - 1, 0)) for pair in _BLANK_LINES)
    if found >= 0:
        end = found + 2
    elif start == 0 and before and before + data[:1] in _BLANK_LINES:
        end = 1
    else:
        return -1
    if data[end - 1:end] == b"\r" and data[end:end + 1] == b"\n":
        end += 1
    return end


def _comment_lines_end(data: bytes | bytearray, start: int) -> int:
    """Just past the whole comment lines (lines that begin with ":") that `data[start:]` begins with (a CR that ends
    the last of them counts as its line end: an LF after it is passed on when it comes); `start` if none."""
    while data[start:start + 1] == b":":
        line_end = _LINE_END.search(data, start)  # (the first: not a scan of all that follows)
        if line_end is None:
            break
        start = line_end.end()
    return start


class _EventStream:
    """An event stream passed on in whole events: `take` says what to pass on once a chunk has come, holding back
    the bytes after the last event's end until that event's end comes. The common case, a chunk of whole events,
    passes as it came, uncopied. Comment lines (":" first, such as the keep-alive `: ping` a server sends while it
    has nothing else) that come between events pass at once, each whole line (they belong to no event's data); so
    does the LF of a CRLF whose CR was passed on. An event held past MAX_HELD_EVENT_BYTES (a pathological one) is
    passed on as it comes, held part and rest (`inside` until it ends), so that what is held stays bounded.
    `where` names the answer in the log (its request and backend)."""

    def __init__(self, where: str = "an event stream") -> None:
        self.where = where
        self.held = bytearray()
        self.tail = b""  # the last bytes passed on
        self.inside = False  # what was passed on ends inside an event (one over MAX_HELD_EVENT_BYTES)
        self.done = False  # a `data: [DONE]` line was passed on (or the Responses API's last event)
        self._warned = False  # the warning of an event over MAX_HELD_EVENT_BYTES was logged (once a stream)

    def take(self, chunk: bytes) -> bytes:
        """What to pass on now, `chunk` having come."""
        out = b""
        if not self.held:
            if chunk.endswith(_EVENT_ENDS):
                return self._passed(chunk, False)
            end = _last_event_end(chunk, 0, self.tail[-1:] or b"\n")  # (the stream's start: a line's start)
            if end < 0:
                # The LF of a CRLF whose CR was passed on (a blank line's, or a comment line's) goes at once too.
                end = 1 if chunk[:1] == b"\n" and not self.inside and self.tail.endswith(b"\r") else 0
            if end or not self.inside:  # (inside an event, a ":" may begin a chunk, not a line)
                end = _comment_lines_end(chunk, end)
            if end:
                out = self._passed(chunk if end == len(chunk) else chunk[:end], False)
            self.held += chunk[end:] if end else chunk
        else:
            start = len(self.held)
            self.held += chunk
            end = _last_event_end(self.held, start, b"")
            # (Held back at its start, a comment line is unfinished: only a line end in this chunk can finish it.)
            if end >= 0 or (self.held[:1] == b":" and (b"\n" in chunk or b"\r" in chunk)):
                end = _comment_lines_end(self.held, max(end, 0))
            if end > 0:
                with memoryview(self.held)[:end] as view:
                    out = self._passed(bytes(view), False)
                del self.held[:end]
        if self.held and (self.inside or len(self.held) > MAX_HELD_EVENT_BYTES):
            if not self._warned:
                self._warned = True
                logger.warning("%s: an event is over %d bytes (MAX_HELD_EVENT_BYTES): passed on as it comes (a break "
                               "inside it cuts the client's stream; logged once a stream)", self.where,
                               MAX_HELD_EVENT_BYTES)
            rest = bytes(self.held)
            self.held.clear()
            out = out + self._passed(rest, True) if out else self._passed(rest, True)
        return out

    def flush(self) -> bytes:
        """What is held, passed on as it came (at the stream's normal end)."""
        out = bytes(self.held)
        self.held.clear()
        return self._passed(out, not out.endswith(_EVENT_ENDS)) if out else out

    def drop(self) -> int:
        """Drop what is held (the stream ends without it); returns how many bytes that was."""
        dropped = len(self.held)
        self.held.clear()
        return dropped

    def _passed(self, out: bytes, inside: bool) -> bytes:
        # [DONE] is looked for only in what holds it (a fast search): a line of it is passed on whole, bar inside an
        # event over MAX_HELD_EVENT_BYTES, where a line that begins before `out` is not taken for one.
        if not self.done and b"[DONE]" in out:
            at_line_start = not self.inside or self.tail.endswith((b"\n", b"\r"))
            self.done = any((m.start() or at_line_start) and _opens_its_event(out, m.start())
                            for m in _DONE_LINE.finditer(out))
        if not self.done and b"event: response." in out:  # (passed on in whole events: its line is in `out`)
            self.done = _RESPONSE_END_LINE.search(out) is not None
        self.inside = inside
        self.tail = out[-_TAIL_BYTES:] if len(out) >= _TAIL_BYTES else (self.tail + out)[-_TAIL_BYTES:]
        return out

    @property
    def newline(self) -> str:
        """The backend's line end (CRLF or CR where its events have it, else LF), for the events the router adds."""
        return "\r\n" if b"\r\n" in self.tail else "\r" if b"\r" in self.tail else "\n"

    def end(self, body: dict[str, Any]) -> bytes:
        """An error event with `body`, then [DONE], in the backend's framing; nothing if the stream's end (its
        [DONE], or the Responses API's last event) is out."""
        return b"" if self.done else (sse(body) + SSE_DONE).replace("\n", self.newline).encode()


def _error_event(backend: Backend, exc: BaseException, timeout_s: float | None) -> dict[str, Any]:
    """The body of the SSE error event (then [DONE]) that ends a client's stream whose backend broke off
    mid-answer: 504 when it went silent for --request-timeout, else 503 (as the server's own when its engine is
    gone)."""
    from kvserve.entrypoints.openai.errors import error_body

    if isinstance(exc, asyncio.TimeoutError) and timeout_s is not None:
        return error_body(504, f"{backend.url} sent nothing for {timeout_s:g} s (--request-timeout)")
    return error_body(503, f"the answer from {backend.url} broke off ({type(exc).__name__})")


def _drop_held(request: web.Request, events: _EventStream, why: str) -> None:
    """Drop the part of an event that `events` holds back, as its stream ends early (`why`)."""
    unfinished = bool(events.held.strip(b"\r\n"))  # (not just the LF of a CRLF that ended the last event)
    dropped = events.drop()
    if unfinished:
        logger.warning("%s %s: %s: dropping the %d bytes of an unfinished event", request.method, request.path, why,
                       dropped)


def _below_root(path: str, root: str) -> str:
    """`path` less the `root` prefix, cut only at a "/" (as the server's own guard cuts it)."""
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


def _describe(exc: BaseException) -> str:
    """An exception as a reason: its type, and its message when it has one (aiohttp's timeouts have none)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _names_stored_response(path: str, body: Any) -> bool:
    """Whether a request names a response stored by the backend that made it (the Responses API's
    /v1/responses/{id} and its sub-paths, or a new response's previous_response_id)."""
    if path.startswith("/v1/responses/"):
        return True
    return path == "/v1/responses" and isinstance(body, dict) and isinstance(body.get("previous_response_id"), str)


def _response_missing(answer: bytes) -> bool:
    """Whether a backend's 404 `answer` is kvserve's error saying that it does not store the named response."""
    try:
        body = json.loads(answer)
    except (ValueError, RecursionError):
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("param") in ("response_id", "previous_response_id")


def _no_such_model(model: str | None) -> str:
    """The first sentence of a 404 for a model not served: vLLM's and kvserve's server's words, so that a client
    (or a router in front of this one) that reads them reads the router's answer alike."""
    return f"The model `{model}` does not exist."


def _model_missing(answer: bytes, model: str) -> bool:
    """Whether a backend's 404 `answer` is its OpenAI error saying that `model` does not exist, as kvserve's and
    vLLM's servers word it, and a router's (which goes on after those words) (the error under "error", or at the
    top level as older vLLM sends it)."""
    try:
        body = json.loads(answer)
    except (ValueError, RecursionError):
        return False
    error = body.get("error", body) if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return isinstance(message, str) and (message == _no_such_model(model) or
                                         message.startswith(_no_such_model(model) + " It is not served"))


def _copy_headers(upstream: aiohttp.ClientResponse, response: web.StreamResponse) -> web.StreamResponse:
    """`response` with the backend's answer's headers (less those the router sets itself)."""
    for name, value in upstream.headers.items():
        if name.lower() not in _DROP_RESPONSE:
            response.headers.add(name, value)
    return response


def _forward_headers(request: web.Request) -> CIMultiDict[str]:
    headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST)
    peer = request.remote
    if peer:
        previous = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{previous}, {peer}" if previous else peer
    return headers


def run_router(backends: Sequence[str], policy: str, host: str, port: int, config: RouterConfig) -> int:
    import prometheus_client

    prometheus_client.disable_created_metrics()  # no *_created series (as the server)
    router = RouterApp(Router(backends, policy), config)
    logging.getLogger("kvserve").setLevel(logging.INFO)
    logger.info("routing http://%s:%d to %d backends (%s): %s", host, port, len(backends), policy,
                ", ".join(b.url for b in router.router.backends))
    return asyncio.run(serve_router(router, host, port))


def _uncancel(task: asyncio.Task[object]) -> None:
    """Task.uncancel where it exists (Python 3.11+): the task goes on after its cancellation was handled. Before
    3.11 a handled cancellation leaves no count to take back."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


async def serve_router(router: RouterApp, host: str, port: int) -> int:
    """Serve `router` on host:port until a signal; returns the exit code. The first SIGTERM / SIGINT stops
    accepting and lets the requests in flight finish, up to SHUTDOWN_TIMEOUT_S; those still in flight then, or
    at a second signal, end now (`RouterApp.end_in_flight`), as the server's do. (Not aiohttp's run_app: its
    second signal cancels the handlers, cutting every client's connection, and exits 1 with tracebacks.)"""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(sig: int) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            logger.info("signal %d: stopping (no new connections; the %d requests in flight may finish, up to "
                        "%g s)", sig, router.requests_in_flight, SHUTDOWN_TIMEOUT_S)
            stop.set()
        else:
            logger.info("signal %d again: ending the %d requests in flight now", sig, router.end_in_flight())

    def time_over() -> None:
        logger.warning("shutdown timeout: ending the %d requests still in flight", router.end_in_flight())

    # aiohttp's own wait for the handlers outlasts the drain and their end: `end_in_flight` ends them first.
    runner = web.AppRunner(router.make_app(), handle_signals=False, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S + END_IN_FLIGHT_S + 1)
    deadline: asyncio.TimerHandle | None = None
    # The handlers first: a signal while the startup health checks run stops the router before it serves.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await runner.setup()
        try:
            if not stop.is_set():
                try:
                    await web.TCPSite(runner, host, port).start()
                except OSError as e:  # (the port taken, the host not this machine's): said as the server says it
                    logger.error("cannot listen on %s:%d: %s", host, port, e)
                    return 1
                if port == 0:  # the system picked it: said, as the server says the port it serves on
                    logger.info("listening on port %d (--port 0: the system's pick)", runner.addresses[0][1])
                await stop.wait()
            deadline = loop.call_later(SHUTDOWN_TIMEOUT_S, time_over)
        finally:
            await runner.cleanup()  # stops accepting, then waits for the requests in flight
    finally:
        if deadline is not None:
            deadline.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def parse_backends(values: Sequence[str]) -> list[str]:
    """--backend values (each may be a comma-separated list) -> URLs; ValueError on a malformed one."""
    urls: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            if "://" not in part:
                part = "http://" + part
            if not part.startswith(("http://", "https://")):
                raise ValueError(f"backend {part!r} is not an http(s) URL")
            _check_backend_url(part)
            urls.append(part.rstrip("/"))
    return urls


def _check_backend_url(url: str) -> None:
    """ValueError for a backend URL the router cannot use as the base of the requests it forwards (each request's
    path and query are added to it): one aiohttp cannot parse (a port that is no number, or out of range), one
    without a host or port, with a query or fragment, or with credentials (aiohttp refuses them beside a client's
    Authorization, which is forwarded), or one that ends in /v1 (a client's base_url: the router adds the /v1 of
    each request's path itself, so every request and health check would miss)."""
    from yarl import URL

    try:
        parsed = URL(url)
        port = parsed.port
    except ValueError as exc:
        raise ValueError(f"backend {url!r} is not a valid URL: {exc}") from None
    if not parsed.host:
        raise ValueError(f"backend {url!r} has no host")
    if port == 0:
        raise ValueError(f"backend {url!r}: port 0 is no port to connect to")
    if "?" in url or "#" in url:
        raise ValueError(f"backend {url!r}: a backend's URL has no query or fragment (the router adds each "
                         "request's path and query to it)")
    if parsed.user is not None or parsed.password is not None:
        raise ValueError(f"backend {str(parsed.with_user(None))!r}: credentials in a backend's URL are not supported "
                         "(clients' Authorization headers are forwarded; --api-key is the router's own)")
    if parsed.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"backend {url!r}: give the server's address without /v1 (e.g. "
                         f"{str(parsed.with_path(parsed.path.rstrip('/')[:-3])).rstrip('/')}): the router adds each "
                         "request's path, /v1/... included")
