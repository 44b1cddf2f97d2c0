"""Every KVSERVE_* environment variable, typed. Nothing else in kvserve reads os.environ for settings."""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _str(name: str, default: str | None) -> str | None:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else raw


# KV cache budget on CPU in GiB when --kv-cache-memory is not given.
KVSERVE_CPU_KVCACHE_SPACE_GIB: int = _int("KVSERVE_CPU_KVCACHE_SPACE", 1)
# API key for the OpenAI-compatible server when --api-key is not given.
KVSERVE_API_KEY: str | None = _str("KVSERVE_API_KEY", None)
# Log level of the kvserve logger.
KVSERVE_LOGGING_LEVEL: str = _str("KVSERVE_LOGGING_LEVEL", "INFO") or "INFO"
# One-prompt prefills at least this long use cuDNN's attention kernel (0: never, the default). cuDNN builds
# an execution graph for every new sequence length, so only set it where prompt lengths repeat; see
# docs/perf_notes.md, entry 15.
KVSERVE_SDPA_CUDNN_MIN_TOKENS: int = _int("KVSERVE_SDPA_CUDNN_MIN_TOKENS", 0)
