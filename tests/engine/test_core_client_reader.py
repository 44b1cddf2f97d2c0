"""EngineCoreClient's reader lets other tasks run while it works through engine messages that are already
waiting, at least every `read_slice_s`, without pausing after each message (no engine process: a test
socket sends the messages)."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any, cast

import msgspec
import zmq

from kvserve.config import EngineConfig
from kvserve.core.outputs import EngineCoreOutput, SchedulerStats
from kvserve.engine.core_client import EngineCoreClient
from kvserve.protocol.core_messages import EngineOutputs

MESSAGES = 20
HANDLER_S = 0.005


class _SlowHandler:
    def __init__(self) -> None:
        self.ticks_seen: list[int] = []  # the other task's run count when each message was handled
        self.ticks = 0

    def on_engine_outputs(self, message: EngineOutputs) -> None:
        self.ticks_seen.append(self.ticks)
        time.sleep(HANDLER_S)  # the work of a step's outputs

    def on_request_failed(self, message: Any) -> None:
        raise AssertionError("not sent")

    def on_engine_dead(self, error: Exception) -> None:
        raise AssertionError(f"reader failed: {error}")


def _run(read_slice_s: float) -> list[int]:
    handler = _SlowHandler()

    async def main() -> None:
        client = EngineCoreClient(cast(EngineConfig, None), handler)
        client.read_slice_s = read_slice_s
        address = f"ipc://{os.path.join(client._ipc_dir, 'output')}"
        client._output.bind(address)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(address)
        for i in range(MESSAGES):
            step = EngineOutputs([EngineCoreOutput(f"r{i}", [i])], SchedulerStats(), 0.0)
            push.send(msgspec.msgpack.encode(step))
        deadline = time.monotonic() + 10
        while not client._output.get(zmq.EVENTS) & zmq.POLLIN and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # every message waits in the reader's socket before the reader starts

        async def other() -> None:
            while True:
                handler.ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(other())
        await asyncio.sleep(0)
        reader = asyncio.ensure_future(client._read_loop())
        while len(handler.ticks_seen) < MESSAGES:
            await asyncio.sleep(0.01)
        reader.cancel()
        ticker.cancel()
        push.close(linger=0)
        client._input.close(linger=0)
        client._output.close(linger=0)
        client._ctx.term()

    asyncio.run(main())
    return handler.ticks_seen


def test_reader_lets_other_tasks_run_within_a_slice_of_waiting_messages() -> None:
    seen = _run(read_slice_s=0.02)
    pauses = sum(1 for a, b in itertools.pairwise(seen) if b > a)
    # Each message takes at least 5 ms, so the reader pauses after every 4th at the most often, and it does
    # pause while messages are still waiting.
    assert 1 <= pauses <= MESSAGES // 4


def test_the_slice_is_what_lets_them_run() -> None:
    seen = _run(read_slice_s=float("inf"))
    assert len(set(seen)) == 1  # no pause until every waiting message was handled
