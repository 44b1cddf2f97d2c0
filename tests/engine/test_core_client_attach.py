"""An API process that attached to an engine another process started (`--api-server-count`) notices the
engine's exit on its own: through a pidfd, or by polling the pid where pidfds are not available. A stand-in
process plays the engine (it never sends a message), so start() ends with the death, not with EngineReady."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from kvserve.config import EngineConfig
from kvserve.engine import core_client
from kvserve.engine.core_client import EngineAttachment, EngineCoreClient, EngineDeadError


class _Handler:
    def on_engine_outputs(self, message: Any) -> None:
        raise AssertionError("not sent")

    def on_request_failed(self, message: Any) -> None:
        raise AssertionError("not sent")

    def on_engine_dead(self, error: Exception) -> None:
        raise AssertionError("start() gets the death, not the handler")


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_an_attached_client_sees_the_engine_exit(pidfd: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not pidfd:
        def no_pidfd(pid: int) -> int:
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(core_client.os, "pidfd_open", no_pidfd)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def kill_soon() -> None:
        time.sleep(0.5)
        engine.kill()
        engine.wait()  # reaped, as the first API process reaps its child

    attach = EngineAttachment(1, f"ipc://{tmp_path / 'input-1'}", f"ipc://{tmp_path / 'output-1'}", engine.pid)
    client = EngineCoreClient(cast(EngineConfig, None), _Handler(), attach=attach)

    async def start() -> float:
        threading.Thread(target=kill_soon, daemon=True).start()
        began = time.monotonic()
        try:
            with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                await asyncio.wait_for(client.start(), 10)
            return time.monotonic() - began
        finally:
            await client.shutdown()

    try:
        took = asyncio.run(start())
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert not client.is_alive and took < 5


def test_an_engine_gone_before_the_attach_is_dead_at_once(tmp_path: Path) -> None:
    engine = subprocess.Popen([sys.executable, "-c", "pass"])
    engine.wait()
    attach = EngineAttachment(1, f"ipc://{tmp_path / 'input-1'}", f"ipc://{tmp_path / 'output-1'}", engine.pid)
    client = EngineCoreClient(cast(EngineConfig, None), _Handler(), attach=attach)

    async def start() -> None:
        try:
            with pytest.raises(EngineDeadError, match=f"pid {engine.pid}\\) is gone"):
                await asyncio.wait_for(client.start(), 5)
        finally:
            await client.shutdown()

    asyncio.run(start())
