"""`kvserve route`: one address in front of several OpenAI-compatible servers (kvserve replicas, or any).

Every request under /v1/ (and /tokenize, /detokenize, /version) goes to one healthy backend, chosen by
the policy (`router.policies`), and its answer comes back as the backend sends it: status, headers and
body, streamed chunk by chunk (server-sent events pass through unchanged). The client's Authorization
header is forwarded, so backends started with --api-key check it themselves.

* A backend that refuses the connection, or answers 503 (draining, or its engine is gone), before any of
  the answer was sent, is skipped and the request goes to the next one: nothing was generated yet. It is
  marked unhealthy until its /health answers 200 again. Once an answer has started, an error is the
  client's to see (it is passed on, or the stream ends).
* Each backend's /health is polled every `--health-check-interval` seconds.
* A client that disconnects ends its request: the router closes the backend connection, which the
  backend takes as an abort.
* `GET /health`: 200 while at least one backend is healthy, else 503 (OpenAI's error body).
  `GET /router/backends`: each backend's state (JSON). `GET /metrics`: the router's own Prometheus
  series (requests by backend and status, retries, in-flight and health per backend).
* SIGTERM / SIGINT: stop accepting, let requests in flight finish (up to 60 s), exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvserve.router.policies import Backend, Router, prefix_key

logger = logging.getLogger("kvserve.router")

# Request headers not forwarded (hop-by-hop, or set again by the client session).
_DROP_REQUEST = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                 "proxy-authorization", "proxy-connection"}
# Response headers not copied back (the router frames the body itself).
_DROP_RESPONSE = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
HEALTH_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 60.0
PROXIED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/version")


def _error(status: int, message: str) -> web.Response:
    from kvserve.entrypoints.openai.errors import error_body

    return web.json_response(error_body(status, message), status=status)


class RouterApp:
    def __init__(self, router: Router, health_check_interval_s: float = 5.0) -> None:
        self.router = router
        self.health_check_interval_s = health_check_interval_s
        self.registry = CollectorRegistry()
        self.requests = Counter("kvserve_router:requests", "Requests answered, by backend and HTTP status.",
                                ["backend", "code"], registry=self.registry)
        self.retries = Counter("kvserve_router:retries", "Requests sent on to another backend after one failed.",
                               registry=self.registry)
        in_flight = Gauge("kvserve_router:requests_in_flight", "Requests in flight, by backend.", ["backend"],
                          registry=self.registry)
        healthy = Gauge("kvserve_router:backend_healthy", "1 while the backend is healthy.", ["backend"],
                        registry=self.registry)
        for backend in router.backends:
            in_flight.labels(backend.url).set_function(lambda b=backend: b.in_flight)
            healthy.labels(backend.url).set_function(lambda b=backend: 1.0 if b.healthy else 0.0)
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ app

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/router/backends", self.backends)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
            auto_decompress=False,
        )
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def _stop(self, _: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ health

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self.router.backends))

    async def _check(self, backend: Backend) -> None:
        assert self.session is not None
        try:
            async with self.session.get(backend.url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as response:
                ok, why = response.status == 200, f"/health answered {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        self._set_health(backend, ok, why)

    def _set_health(self, backend: Backend, ok: bool, why: str) -> None:
        if ok and not backend.healthy:
            logger.info("backend %s is healthy again", backend.url)
        elif not ok and backend.healthy:
            logger.warning("backend %s is unhealthy (%s)", backend.url, why)
        backend.healthy = ok
        if not ok:
            backend.last_error = why

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            await self.check_health()

    async def health(self, _: web.Request) -> web.Response:
        live = len(self.router.healthy())
        if not live:
            return _error(503, f"no healthy backend (of {len(self.router.backends)})")
        return web.json_response({"status": "ok", "healthy_backends": live, "backends": len(self.router.backends)})

    async def backends(self, _: web.Request) -> web.Response:
        return web.json_response({"policy": self.router.policy, "backends": [
            {"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "served": b.served,
             "failures": b.failures, "last_error": b.last_error} for b in self.router.backends]})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    # ------------------------------------------------------------------ proxy

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        if not request.path.startswith(PROXIED_PREFIXES):
            return _error(404, f"not found: {request.path} (the router forwards /v1/*, /tokenize, /detokenize, "
                          "/version)")
        body = await request.read()
        key = None
        if self.router.policy == "prefix" and body:
            try:
                key = prefix_key(json.loads(body))
            except ValueError:
                key = None  # not JSON: the backend will say so
        candidates = self.router.order(key)
        if not candidates:
            return _error(503, f"no healthy backend (of {len(self.router.backends)}); see /router/backends")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        errors: list[str] = []
        for i, backend in enumerate(candidates):
            last = i == len(candidates) - 1
            response = await self._forward(request, backend, body, headers, errors, last)
            if response is not None:
                return response
            self.retries.inc()
        return _error(503, "every backend failed: " + "; ".join(errors))

    async def _forward(self, request: web.Request, backend: Backend, body: bytes, headers: dict[str, str],
                       errors: list[str], last: bool) -> web.StreamResponse | None:
        """The backend's answer streamed to the client, or None when it could not take the request (try
        the next)."""
        assert self.session is not None
        backend.in_flight += 1
        backend.served += 1
        try:
            try:
                upstream = await self.session.request(request.method, backend.url + request.path_qs, data=body,
                                                      headers=headers)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                why = f"{backend.url}: {type(exc).__name__}: {exc}"
                backend.failures += 1
                self._set_health(backend, False, why)
                errors.append(why)
                return None
            try:
                if upstream.status == 503 and not last:
                    text = (await upstream.read())[:300].decode(errors="replace")
                    why = f"{backend.url}: 503 {text}"
                    backend.failures += 1
                    self._set_health(backend, False, why)
                    errors.append(why)
                    return None
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for name, value in upstream.headers.items():
                    if name.lower() not in _DROP_RESPONSE:
                        response.headers.add(name, value)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                self.requests.labels(backend.url, str(upstream.status)).inc()
                return response
            finally:
                # Closing (not releasing) the connection: if the client left mid-answer, the backend sees the
                # disconnect and aborts the request.
                upstream.close()
        finally:
            backend.in_flight -= 1


def run_router(backends: Sequence[str], policy: str, host: str, port: int, health_check_interval_s: float) -> int:
    router = RouterApp(Router(backends, policy), health_check_interval_s)
    logging.getLogger("kvserve").setLevel(logging.INFO)
    logger.info("routing http://%s:%d to %d backends (%s): %s", host, port, len(backends), policy,
                ", ".join(b.url for b in router.router.backends))
    web.run_app(router.make_app(), host=host, port=port, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                handler_cancellation=True, print=None, access_log=None)
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
            urls.append(part.rstrip("/"))
    return urls
