"""An engine core that hangs in its shutdown (it never reads the `Shutdown` message) is killed once the client's
`timeout_s` is over. It is not sent a SIGTERM first: the engine ignores SIGTERM (the API process decides when it
stops), so that only made the process's exit wait longer. A stand-in process plays the engine."""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import time
from pathlib import Path
from typing import Any, cast

from kvserve.config import EngineConfig
from kvserve.engine.core_client import EngineCoreClient
from kvserve.protocol.core_messages import EngineReady


def _hung_engine(sigterm_marker: str, installed: Any) -> None:
    """Ignores SIGTERM as the engine core does (noting in `sigterm_marker` that one came) and never exits."""
    signal.signal(signal.SIGTERM, lambda signum, frame: Path(sigterm_marker).touch())
    installed.set()
    while True:
        time.sleep(1)


class _Handler:
    def on_engine_outputs(self, message: Any) -> None:
        raise AssertionError("not sent")

    def on_request_failed(self, message: Any) -> None:
        raise AssertionError("not sent")

    def on_engine_dead(self, error: Exception) -> None:
        raise AssertionError("a shutdown is no death")


def test_an_engine_that_hangs_in_its_shutdown_is_killed_without_a_sigterm_first(tmp_path: Path) -> None:
    mp = multiprocessing.get_context("spawn")
    installed = mp.Event()
    marker = tmp_path / "sigterm"
    process = mp.Process(target=_hung_engine, args=(str(marker), installed), daemon=True)
    process.start()
    client = EngineCoreClient(cast(EngineConfig, None), _Handler())
    try:
        assert installed.wait(60), "the stand-in engine did not start"
        client._process = process  # as start() leaves it once the engine is ready
        client.ready = EngineReady(pid=process.pid or 0, num_blocks=1, block_size=16, max_model_len=16,
                                   eos_token_ids=[], vocab_size=49152, startup_s=0.0,
                                   capacity_description="")
        asyncio.run(client.shutdown(timeout_s=0.1))
        assert not process.is_alive()
        assert process.exitcode == -signal.SIGKILL
        assert not marker.exists(), "it was sent a SIGTERM, which the engine ignores"
    finally:
        if process.is_alive():
            process.kill()
        process.join(5)
