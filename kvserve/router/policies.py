"""How `kvserve route` picks a replica for a request: the backends' state and the routing policies.

Pure Python, no I/O: the proxy (`router.app`) keeps each backend's health and in-flight count here and asks
a policy for the order in which to try the healthy ones (the first that answers serves the request).

* `round-robin`: each request to the next healthy backend in turn.
* `least-requests`: the healthy backend with the fewest requests in flight (ties: the one that served
  fewer so far).
* `prefix` (the default): requests whose prompts start alike go to the same backend, so its prefix cache
  holds their shared start (system prompt, earlier turns of a conversation). The key (`prefix_key`) is a
  chat's system prompt and first user message, or a completion prompt's first `PREFIX_KEY_CHARS`
  characters; each key ranks the backends by a hash of (key, backend) (rendezvous
  hashing: adding or removing a backend moves only that backend's keys). A backend is skipped while it
  holds more than `LOAD_FACTOR` times the average in-flight count, so one hot prefix cannot pile onto one
  replica (consistent hashing with bounded loads).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("prefix", "least-requests", "round-robin")
# Characters of a prompt that decide its backend under the prefix policy: about 250 tokens, enough to tell
# system prompts apart, short enough that a conversation keeps its backend as it grows.
PREFIX_KEY_CHARS = 1024
# Under the prefix policy a backend takes no more than this times the average load (+1).
LOAD_FACTOR = 1.25


@dataclass
class Backend:
    url: str  # base URL, e.g. http://10.0.0.5:8000 (no trailing slash)
    healthy: bool = True
    in_flight: int = 0
    served: int = 0  # requests sent to it
    failures: int = 0  # requests it could not take (connection errors, 503s)
    # A request could not be sent to it (`failures`) since it was last healthy: while no backend is healthy, it is
    # tried after those marked by their health checks alone (a /health that timed out under load, say).
    refused: bool = False
    last_error: str = ""
    models: set[str] | None = None  # what its /v1/models lists (None: not known yet)
    name: str = ""  # its `backend` label in the router's metrics ("": its url)

    @property
    def label(self) -> str:
        return self.name or self.url

    def check_invariants(self) -> None:
        assert self.in_flight >= 0, f"{self.url}: negative in-flight count {self.in_flight}"
        assert self.served >= 0 and self.failures >= 0


def _rank(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest(), "big")


class Router:
    """Backends and a policy. `order(key)` lists the healthy backends in the order to try them."""

    def __init__(self, urls: Sequence[str], policy: str = "prefix", names: Sequence[str] | None = None) -> None:
        """`names`: each backend's label in the router's metrics, where its url is not the one to use (the
        replicas of `kvserve serve -dp`, on ports picked at each start)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if not urls:
            raise ValueError("kvserve route needs at least one backend")
        clean = [u.rstrip("/") for u in urls]
        if len(set(clean)) != len(clean):
            raise ValueError(f"backends listed twice: {sorted({u for u in clean if clean.count(u) > 1})}")
        if names is not None and len(names) != len(clean):
            raise ValueError(f"{len(names)} names for {len(clean)} backends")
        self.backends = [Backend(u, name=names[i] if names is not None else "") for i, u in enumerate(clean)]
        self.policy = policy
        self._turn = itertools.count()

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def serving(self, model: str | None) -> list[Backend]:
        """Backends that serve `model` (all of them for None; a backend whose models are not known yet
        counts as serving every model)."""
        if model is None:
            return list(self.backends)
        return [b for b in self.backends if b.models is None or model in b.models]

    def known_missing(self, model: str) -> bool:
        """Whether `model` is served by no backend whose list is known, while at least one list is known: only
        the backends never reached could serve it. When those fail too, the router's 503 says so (a backend
        still loading may serve it: not a 404, which clients do not retry)."""
        known = [b.models for b in self.backends if b.models is not None]
        return bool(known) and all(model not in models for models in known)

    def order(self, key: str | None = None, model: str | None = None) -> list[Backend]:
        """The backends serving `model`, first choice first: the healthy ones by the policy, then (as a last
        resort, in case they recovered since their last check) the others, fewest failures first. When none is
        healthy, the others are ordered by the policy too (those a request could not be sent to since they were
        healthy last): a /health that timed out on each (a load spike, a pause) leaves them all marked while they
        serve, and the fewest failures first (all 0: the first listed) sent every request to one backend."""
        candidates = self.serving(model)
        live = [b for b in candidates if b.healthy]
        if live:
            return self._by_policy(live, key) + sorted((b for b in candidates if not b.healthy),
                                                       key=lambda b: b.failures)
        return (self._by_policy([b for b in candidates if not b.refused], key) +
                self._by_policy([b for b in candidates if b.refused], key))

    def _by_policy(self, live: list[Backend], key: str | None) -> list[Backend]:
        if not live:
            return []
        if self.policy == "round-robin":
            start = next(self._turn) % len(live)
            return live[start:] + live[:start]
        if self.policy == "least-requests" or key is None:
            return sorted(live, key=lambda b: (b.in_flight, b.served))
        ranked = sorted(live, key=lambda b: _rank(key, b.url), reverse=True)
        total = sum(b.in_flight for b in live)
        cap = math.ceil((total + 1) / len(live) * LOAD_FACTOR)
        within = [b for b in ranked if b.in_flight < cap]
        return within + [b for b in ranked if b.in_flight >= cap]

    def check_invariants(self) -> None:
        for backend in self.backends:
            backend.check_invariants()


def prefix_key(body: object) -> str | None:
    """What decides a request's backend under the prefix policy (None when the body has no prompt).

    Chat: the messages up to and including the first user message (system prompt and first question),
    which every later turn of the conversation repeats, so the conversation keeps its backend; the Responses
    API's `instructions` and `input` are read as the messages they render as (a system message first, and a
    string input as a user message). Completion: the prompt's first `PREFIX_KEY_CHARS` characters. All cut at
    `PREFIX_KEY_CHARS`."""
    if not isinstance(body, dict):
        return None
    if "input" in body and "messages" not in body and "prompt" not in body:
        given = body.get("input")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else given
        if not isinstance(items, list):
            return None
        instructions = body.get("instructions")
        system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
        body = {"messages": system + [dict(i, role="system") if isinstance(i, dict) and i.get("role") == "developer"
                                      else i for i in items]}
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of prompts (texts or token-id lists): the first one decides
        text = prompt if isinstance(prompt, str) else ",".join(map(str, prompt)) if isinstance(prompt, list) else ""
        return text[:PREFIX_KEY_CHARS]
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role', '')}:{content if isinstance(content, str) else ''}\n")
            if message.get("role") == "user":
                break
        return "".join(parts)[:PREFIX_KEY_CHARS]
    return None
