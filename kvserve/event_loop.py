"""The event loop kvserve's long-running asyncio processes run on: the API server and `kvserve bench`.

uvloop (a C implementation of asyncio's loop on libuv) when it is installed and KVSERVE_UVLOOP is not 0,
else asyncio's own loop. Both processes spend much of their CPU writing or reading one small chunk per
streamed token, and uvloop's transports do that for less CPU (docs/perf_notes.md, entry 48).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvserve import envs

T = TypeVar("T")


def uvloop_wanted() -> bool:
    """Whether `run` will use uvloop: installed, and not switched off."""
    if not envs.KVSERVE_UVLOOP:
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop described above."""
    if uvloop_wanted():
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def running_loop_name() -> str:
    """'uvloop' or 'asyncio': the package of the running loop's class (for logs)."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
