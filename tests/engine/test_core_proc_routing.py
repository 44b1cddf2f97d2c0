"""The engine-core loop with several API processes: each request's outputs and failure go to the process that
added it, the stats to every process, and the owner table follows the core's unfinished requests (a fake core:
no model, the loop's message handling only)."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvserve.core.outputs import EngineCoreOutput, SchedulerStats
from kvserve.engine.core_proc import ALL_CLIENTS, CLOSE, EngineCoreProc, Outgoing, _send_loop
from kvserve.protocol.core_messages import (
    AbortRequests,
    AddRequests,
    ClientGone,
    EngineDead,
    EngineOutputs,
    RequestFailed,
    make_message_decoder,
)
from kvserve.protocol.engine import EngineCoreRequest
from kvserve.protocol.sampling_params import SamplingParams


class _Scheduler:
    def __init__(self) -> None:
        self.requests: dict[str, EngineCoreRequest] = {}

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.requests))


class _FakeCore:
    """Accepts requests, rejects those whose prompt is empty, finishes the ones a test names."""

    check_invariants_every_step = True

    def __init__(self) -> None:
        self.scheduler = _Scheduler()
        self.failed: list[tuple[str, str, str]] = []

    def unfinished_req_ids(self) -> set[str]:
        return set(self.scheduler.requests)

    def pop_failed(self) -> list[tuple[str, str, str]]:
        failed, self.failed = self.failed, []
        return failed

    def step(self) -> Any:
        """A step that computes nothing (the failures queued by `fail` go with it)."""
        from types import SimpleNamespace

        return SimpleNamespace(outputs=[], stats=self.scheduler.make_stats(), num_scheduled_tokens=0)

    def fail(self, req_id: str, message: str) -> None:
        """A request dropped by the core after it was added (a grammar that failed to compile)."""
        del self.scheduler.requests[req_id]
        self.failed.append((req_id, message, "structured_outputs"))

    def add_request(self, request: EngineCoreRequest) -> None:
        if not request.prompt_token_ids:
            raise ValueError("empty prompt")
        self.scheduler.requests[request.req_id] = request

    def abort_requests(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.scheduler.requests.pop(req_id, None)

    def finish(self, req_id: str) -> EngineCoreOutput:
        del self.scheduler.requests[req_id]
        return EngineCoreOutput(req_id, [7], finish_reason="length")


def _request(req_id: str, prompt: list[int] | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, [1, 2] if prompt is None else prompt, SamplingParams(), max_tokens=4)


def _drain(outbox: queue.Queue[Outgoing | None]) -> list[tuple[int, Any]]:
    items = []
    while not outbox.empty():
        item = outbox.get_nowait()
        assert item is not None
        items.append(item)
    return items


def _proc(num_clients: int) -> tuple[EngineCoreProc, _FakeCore, queue.Queue[Outgoing | None]]:
    core = _FakeCore()
    outbox: queue.Queue[Outgoing | None] = queue.Queue()
    return EngineCoreProc(core, queue.Queue(), outbox, parent_pid=0, num_clients=num_clients), core, outbox


def test_outputs_go_to_the_process_that_added_the_request_and_stats_to_all() -> None:
    proc, core, outbox = _proc(3)
    proc._handle(AddRequests([_request("a0"), _request("a1")], client_index=0))
    proc._handle(AddRequests([_request("c2")], client_index=2))
    proc.check_invariants()
    running = [EngineCoreOutput("a0", [5]), EngineCoreOutput("c2", [6]), EngineCoreOutput("a1", [7])]
    proc._send_outputs(running, core.scheduler.make_stats())
    sent = _drain(outbox)
    assert [client for client, _ in sent] == [0, 1, 2]  # every process hears the stats
    by_client = {client: message for client, message in sent}
    assert all(isinstance(m, EngineOutputs) and m.stats.num_running_reqs == 3 for m in by_client.values())
    assert [o.req_id for o in by_client[0].outputs] == ["a0", "a1"]
    assert by_client[1].outputs == []
    assert [o.req_id for o in by_client[2].outputs] == ["c2"]
    # A finished request is forgotten with its last output, which still reaches its process.
    proc._send_outputs([core.finish("c2")], core.scheduler.make_stats())
    sent = dict(_drain(outbox))
    assert [o.req_id for o in sent[2].outputs] == ["c2"] and sent[0].outputs == []
    proc.check_invariants()
    # An abort forgets the request too.
    proc._handle(AbortRequests(["a1"]))
    proc.check_invariants()
    assert set(proc._owner) == {"a0"}


def test_a_rejected_request_fails_at_the_process_that_sent_it() -> None:
    proc, core, outbox = _proc(2)
    # The samples of one n>1 request stand or fall together: the first was added, the second is rejected.
    proc._handle(AddRequests([_request("s0"), _request("s1", prompt=[])], client_index=1))
    sent = _drain(outbox)
    assert [(client, type(m), m.req_id) for client, m in sent] == [
        (1, RequestFailed, "s0"), (1, RequestFailed, "s1")]
    assert core.scheduler.requests == {}
    proc.check_invariants()


def test_a_request_the_core_drops_later_fails_at_its_process() -> None:
    proc, core, outbox = _proc(3)
    proc._handle(AddRequests([_request("g")], client_index=2))
    proc._handle(AddRequests([_request("h")], client_index=1))
    core.fail("g", "no tokenizer")
    proc._step()  # the loop's step sends the failures of the core's step
    assert (2, RequestFailed("g", "no tokenizer", "structured_outputs")) in _drain(outbox)
    assert proc._owner == {"h": 1}
    proc.check_invariants()
    proc._send_failures()  # reported once
    assert _drain(outbox) == []


def test_one_process_gets_everything_and_the_owner_table_stays_exact() -> None:
    proc, core, outbox = _proc(1)
    proc._handle(AddRequests([_request("x"), _request("y")]))
    proc._send_outputs([EngineCoreOutput("x", [1]), core.finish("y")], core.scheduler.make_stats())
    ((client, message),) = _drain(outbox)
    assert client == 0 and [o.req_id for o in message.outputs] == ["x", "y"]
    proc.check_invariants()


def test_a_process_aborts_only_its_own_requests() -> None:
    # Ids are unique within one API process only (a client may pick its own request_id).
    proc, core, _ = _proc(2)
    proc._handle(AddRequests([_request("mine")], client_index=0))
    proc._handle(AbortRequests(["mine"], client_index=1))
    assert "mine" in core.scheduler.requests and proc._owner == {"mine": 0}
    proc._handle(AbortRequests(["mine"], client_index=0))
    assert core.scheduler.requests == {} and proc._owner == {}
    proc.check_invariants()


def test_a_process_that_exited_loses_its_requests_and_its_messages() -> None:
    proc, core, outbox = _proc(3)
    proc._handle(AddRequests([_request("a")], client_index=0))
    proc._handle(AddRequests([_request("b1"), _request("b2")], client_index=1))
    proc._handle(ClientGone(1))
    assert set(core.scheduler.requests) == {"a"} and proc._owner == {"a": 0}
    assert _drain(outbox) == [(1, CLOSE)]  # its socket is closed, what it did not read dropped
    proc.check_invariants()
    proc._send_outputs([EngineCoreOutput("a", [3])], core.scheduler.make_stats())
    assert [client for client, _ in _drain(outbox)] == [0, 2]
    proc._handle(ClientGone(1))  # told twice: nothing more happens
    assert _drain(outbox) == []


def test_the_invariant_check_catches_a_stale_owner() -> None:
    proc, core, _ = _proc(2)
    proc._handle(AddRequests([_request("z")], client_index=1))
    core.abort_requests(["z"])  # behind the loop's back: the table still names it
    with pytest.raises(AssertionError, match="owners"):
        proc.check_invariants()


def test_the_send_loop_sends_to_one_process_or_to_all(tmp_path: Path) -> None:
    ctx = zmq.Context()
    addresses = [f"ipc://{tmp_path / f'out-{i}'}" for i in range(3)]

    def receiver(address: str) -> zmq.Socket:
        socket = ctx.socket(zmq.PULL)
        socket.bind(address)
        return socket

    receivers = [receiver(addresses[0])]
    outbox: queue.Queue[Outgoing | None] = queue.Queue()
    sender = threading.Thread(target=_send_loop, args=(zmq.Context(), addresses, outbox), daemon=True)
    sender.start()
    outbox.put((ALL_CLIENTS, EngineDead("everyone")))
    outbox.put((1, RequestFailed("r", "only the second")))
    outbox.put((2, CLOSE))  # the third exited: a broadcast no longer reaches it, and the exit does not wait
    outbox.put((ALL_CLIENTS, EngineDead("the rest")))
    time.sleep(0.2)
    receivers.append(receiver(addresses[1]))  # bound after the sends, as an API process that starts late
    outbox.put(None)
    sender.join(timeout=3)
    assert not sender.is_alive()
    decoder = make_message_decoder()

    def received(socket: zmq.Socket) -> list[object]:
        messages = []
        while socket.poll(timeout=500):
            messages.append(decoder.decode(socket.recv()))
        return messages

    assert received(receivers[0]) == [EngineDead("everyone"), EngineDead("the rest")]
    assert received(receivers[1]) == [EngineDead("everyone"), RequestFailed("r", "only the second"),
                                      EngineDead("the rest")]
    for socket in receivers:
        socket.close(linger=0)
    ctx.term()


def test_an_add_the_core_cannot_decode_fails_its_requests_at_their_process() -> None:
    """A request whose fields the API process let through with a type the engine's decoder refuses: each of
    its samples gets an error at the process that sent it, instead of no answer."""
    import msgspec

    from kvserve.protocol.core_messages import UnreadableRequests, make_input_decoder, unreadable_requests

    bad = _request("a-1")
    bad.sampling_params.n = None  # type: ignore[assignment]  (a field of the wrong type, not validated again)
    frame = msgspec.msgpack.encode(AddRequests([bad, _request("a-2")], client_index=1))
    with pytest.raises(msgspec.ValidationError) as error:
        make_input_decoder().decode(frame)
    unreadable = unreadable_requests(frame, error.value)
    assert unreadable is not None and unreadable.req_ids == ["a-1", "a-2"] and unreadable.client_index == 1
    assert unreadable_requests(msgspec.msgpack.encode(AbortRequests(["x"])), error.value) is None
    assert unreadable_requests(b"\xc1", error.value) is None  # not msgpack at all
    proc, core, outbox = _proc(2)
    assert not proc._handle(unreadable)
    sent = _drain(outbox)
    assert [(client, m.req_id) for client, m in sent] == [(1, "a-1"), (1, "a-2")]
    assert all(isinstance(m, RequestFailed) and "could not read" in m.message and "n" in m.message
               for _, m in sent)
    assert not core.scheduler.requests and isinstance(unreadable, UnreadableRequests)
