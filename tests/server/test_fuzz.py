"""Generated requests from the server's own OpenAPI schema never get a 5xx.

Bodies are drawn from each POST operation's request schema (/openapi.json) with hypothesis: schema-valid
ones (which run in the engine; max_tokens defaults to 2 where the draw left it out, so they stay short), ones with one field replaced by
arbitrary JSON (NaN and huge integers included), missing or extra fields, and raw bytes. Every non-2xx
answer must be an OpenAI error body whose code is the status; a 200 stream must end in [DONE].
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import API_KEY, STRICT_NAME, ServerProcess, assert_openai_error

OPERATIONS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]

_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 40)
            | st.floats(allow_nan=True, allow_infinity=True) | _text)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=8)


def _from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A strategy for values valid under a (pydantic-generated) JSON schema."""
    if "$ref" in schema:
        return st.deferred(lambda: _from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "anyOf" in schema:
        return st.one_of([_from_schema(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=min(schema.get(
            "maxLength", 16), 16))
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        small = st.integers(max(lo, -3) if lo is not None else -3, min(hi, 40) if hi is not None else 40)
        return small | st.integers(lo, hi)
    if kind == "number":
        return st.floats(-3, 3) | st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        min_items = schema.get("minItems", 0)
        return st.lists(_from_schema(schema.get("items", {}), defs), min_size=min_items, max_size=max(min_items, 3))
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        if props:
            return st.fixed_dictionaries(
                {k: _from_schema(v, defs) for k, v in props.items() if k in required},
                optional={k: _from_schema(v, defs) for k, v in props.items() if k not in required},
            )
        extra = schema.get("additionalProperties", True)
        values = _json if extra is True else _from_schema(extra, defs)
        return st.dictionaries(_text, values, max_size=3)
    return _json


@pytest.fixture(scope="module")
def schemas(strict_server: ServerProcess) -> dict[str, st.SearchStrategy[Any]]:
    spec = httpx.get(strict_server.base_url + "/openapi.json", timeout=30).json()
    defs = spec["components"]["schemas"]
    out = {}
    for path in OPERATIONS:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        out[path] = _from_schema(body, defs)
    return out


@st.composite
def _request_body(draw: st.DrawFn, valid: st.SearchStrategy[Any]) -> bytes:
    mode = draw(st.sampled_from(["valid", "valid", "replace", "drop", "extra", "raw"]))
    if mode == "raw":
        return draw(st.binary(max_size=64) | _text.map(str.encode))
    body = draw(valid)
    if isinstance(body, dict):
        body.setdefault("model", STRICT_NAME)
        # Bounds the CPU time of the bodies that run; other values still come from "replace" and "drop".
        body.setdefault("max_tokens", 2)
        if mode == "replace" and body:
            body[draw(st.sampled_from(sorted(body)))] = draw(_json)
        elif mode == "drop" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif mode == "extra":
            body[draw(_text)] = draw(_json)
    return json.dumps(body).encode()  # allow_nan: NaN / Infinity literals reach the server too


@pytest.mark.parametrize("path", OPERATIONS)
def test_generated_requests_never_get_5xx(strict_server: ServerProcess, schemas, path: str):
    client = httpx.Client(base_url=strict_server.base_url, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=_request_body(schemas[path]))
    def check(body: bytes) -> None:
        with client.stream("POST", path, content=body) as response:
            response.read()
        assert response.status_code < 500, (body, response.status_code, response.text[:300])
        if response.status_code >= 400:
            assert_openai_error(response, response.status_code)
        elif response.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", (body, events[-3:])
            for event in events[:-1]:
                error = json.loads(event).get("error")
                assert error is None or error["code"] < 500, (body, error)

    with client:
        check()
    # Still healthy and idle afterwards.
    assert httpx.get(strict_server.base_url + "/health").status_code == 200
