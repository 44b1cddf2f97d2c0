"""Server-sent events as the OpenAI API streams them: one `data:` JSON event a chunk, then `data: [DONE]`.
Plain json (no server imports): the API server, its middleware and the router write them."""

from __future__ import annotations

import json
from typing import Any


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
