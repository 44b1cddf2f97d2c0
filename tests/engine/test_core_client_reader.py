"""EngineCoreClient's reader lets other tasks run while it works through engine messages that are already
waiting, at least every `read_slice_s`, without pausing after each message; an engine that exits while the
reader is behind is declared dead only after what it sent before, with the reason it gave (no engine
process: a test socket sends the messages)."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import time
from typing import Any, cast

import msgspec
import zmq

from kvserve.config import EngineConfig
from kvserve.core.outputs import EngineCoreOutput, SchedulerStats
from kvserve.engine.core_client import EngineCoreClient
from kvserve.protocol.core_messages import EngineDead, EngineOutputs

MESSAGES = 20
HANDLER_S = 0.005


class _SlowHandler:
    def __init__(self) -> None:
        self.ticks_seen: list[int] = []  # the other task's run count when each message was handled
        self.ticks = 0
        self.dead: tuple[int, str] | None = None  # (messages handled by then, the reason)

    def on_engine_outputs(self, message: EngineOutputs) -> None:
        self.ticks_seen.append(self.ticks)
        time.sleep(HANDLER_S)  # the work of a step's outputs

    def on_request_failed(self, message: Any) -> None:
        raise AssertionError("not sent")

    def on_engine_dead(self, error: Exception) -> None:
        self.dead = (len(self.ticks_seen), str(error))


class _ExitedProcess:
    exitcode = 1

    def join(self, timeout: float | None = None) -> None:
        pass


def _run(read_slice_s: float, messages: int = MESSAGES, then_dead: str | None = None) -> _SlowHandler:
    """`messages` outputs (and an EngineDead saying `then_dead`, with the process gone) wait in the reader's
    socket before it starts; returns once the reader handled them all (and the death was declared)."""
    handler = _SlowHandler()

    async def main() -> None:
        client = EngineCoreClient(cast(EngineConfig, None), handler)
        client.read_slice_s = read_slice_s
        address = f"ipc://{os.path.join(client._ipc_dir, 'output')}"
        client._output.bind(address)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(address)
        for i in range(messages):
            step = EngineOutputs([EngineCoreOutput(f"r{i}", [i])], SchedulerStats(), 0.0)
            push.send(msgspec.msgpack.encode(step))
        if then_dead is not None:
            push.send(msgspec.msgpack.encode(EngineDead(then_dead)))
        deadline = time.monotonic() + 10
        while not client._output.get(zmq.EVENTS) & zmq.POLLIN and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # every message waits in the reader's socket before the reader starts

        async def other() -> None:
            while True:
                handler.ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(other())
        if then_dead is not None:  # the process's sentinel fired: it has exited
            client._process = _ExitedProcess()  # type: ignore[assignment]
            asyncio.ensure_future(client._after_exit())
        await asyncio.sleep(0)
        reader = asyncio.ensure_future(client._read_loop())
        while len(handler.ticks_seen) < messages or (then_dead is not None and handler.dead is None):
            await asyncio.sleep(0.01)
        reader.cancel()
        ticker.cancel()
        push.close(linger=0)
        client._input.close(linger=0)
        client._output.close(linger=0)
        client._ctx.term()
        shutil.rmtree(client._ipc_dir, ignore_errors=True)

    asyncio.run(main())
    return handler


def test_reader_lets_other_tasks_run_within_a_slice_of_waiting_messages() -> None:
    seen = _run(read_slice_s=0.02).ticks_seen
    pauses = sum(1 for a, b in itertools.pairwise(seen) if b > a)
    # It pauses while messages still wait, and not after every message: each takes at least 5 ms, so about
    # every 4th message at a 20-ms slice (the bound leaves room for sleeps that overshoot on a busy machine).
    assert 1 <= pauses <= MESSAGES - 2


def test_the_slice_is_what_lets_them_run() -> None:
    seen = _run(read_slice_s=float("inf")).ticks_seen
    assert len(set(seen)) == 1  # no pause until every waiting message was handled


def test_an_engine_that_exits_while_the_reader_is_behind_is_dead_after_its_last_outputs() -> None:
    # 150 messages of 5 ms each: the reader is still busy when the 0.5-s grace after the exit ends.
    handler = _run(read_slice_s=0.02, messages=150, then_dead="CUDA out of memory in step 123")
    assert handler.dead == (150, "CUDA out of memory in step 123")
