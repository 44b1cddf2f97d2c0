"""The engine-core process: `EngineCore`'s busy loop behind two ZMQ sockets.

Started by `EngineCoreClient` with the multiprocessing *spawn* context (a fresh interpreter: no inherited
CUDA state, locks or sockets). Three threads:

* the **main thread** runs ``schedule -> execute -> update`` (`EngineCore.step`) while any request is
  unfinished, and blocks on the input queue when idle;
* an **input thread** owns the PULL socket: it decodes `EngineInput` messages and queues them;
* an **output thread** owns the PUSH sockets: it encodes and sends `EngineMessage`s.

With several API processes (`--api-server-count`) the PULL socket connects to each one's input address
and there is a PUSH socket per API process: a request's outputs and failure go to the process that added
it (`AddRequests.client_index`), everything else (ready, stats, death) to all of them.

ZMQ sockets are not thread-safe, so each belongs to exactly one thread; msgpack encoding and decoding
happen in the IO threads and overlap with the model's forward (which releases the GIL).

Exit codes: 0 after `Shutdown`; 1 when start-up or a step failed (an `EngineDead` message saying why is
sent first) or when the parent process disappeared.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from kvserve.config import EngineConfig
from kvserve.core.outputs import EngineCoreOutput, SchedulerStats
from kvserve.engine.heap import freeze_startup_heap
from kvserve.protocol.core_messages import (
    AbortRequests,
    AddRequests,
    ClientGone,
    EngineDead,
    EngineInput,
    EngineMessage,
    EngineOutputs,
    EngineReady,
    RequestFailed,
    Shutdown,
    UnreadableRequests,
    make_input_decoder,
    unreadable_requests,
)

logger = logging.getLogger(__name__)

# How often an idle or busy loop checks that the API process is still there.
_PARENT_CHECK_INTERVAL_S = 1.0
# The start of the name of the IPC sockets' directory, made by the API process that starts the engine
# (core_client.make_ipc_dir: `kvserve-ipc-XXXXXXXX`, in a data-parallel replica `kvserve-ipc-<tag>-XXXXXXXX`).
IPC_DIR_PREFIX = "kvserve-ipc-"
# How long queued output messages may take to leave when the process exits.
_SEND_LINGER_MS = 5000
# Pause after a step that scheduled nothing (cannot happen with a sane scheduler; guards the loop anyway).
_IDLE_STEP_SLEEP_S = 0.001
# The target of an outgoing message: every API process.
ALL_CLIENTS = -1


class _Close:
    """Queued for an API process that exited: the output thread closes its socket (without lingering)."""


CLOSE = _Close()
Outgoing = tuple[int, EngineMessage | _Close]


def run_engine_core(config: EngineConfig, input_addresses: list[str], output_addresses: list[str],
                    log_level: str, parent_pid: int | None = None) -> None:
    """Process entry point (must be importable: spawn pickles it by name). Never returns normally.
    `output_addresses[i]` is API process i's; messages for it are queued as `(i, message)`. `parent_pid`: the
    API process's pid, as it passed it (by default this process's parent now, which is already init, or a
    subreaper, when the API process died while this one was still importing: it would then wait forever)."""
    # Ctrl-C reaches the whole process group, and a service manager's SIGTERM often does too; the API process
    # decides when the engine stops (it drains first), so the engine ignores both and waits for `Shutdown`
    # (it also exits by itself within a second of losing the API process; SIGKILL still stops it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if parent_pid is None:
        parent_pid = os.getppid()
    # Start-up (the model load, minutes for a large one) checks nothing else: leave as soon as the API process
    # is gone rather than load for nobody (and hold the GPU) until the loop's own check.
    started = threading.Event()
    threading.Thread(target=_exit_if_orphaned_before, args=(parent_pid, started, input_addresses), daemon=True,
                     name="engine-start-watch").start()
    outbox: queue.Queue[Outgoing | None] = queue.Queue()
    inbox: queue.Queue[EngineInput | UnreadableRequests] = queue.Queue()
    # The sender has a context of its own: terminating it at exit flushes the last messages (EngineDead)
    # without waiting for the input socket, whose thread may be blocked in recv().
    sender = threading.Thread(target=_send_loop, args=(zmq.Context(), output_addresses, outbox), daemon=True,
                              name="engine-output")
    sender.start()
    exit_code = 1
    try:
        try:
            core = _start_core(config, outbox)
        finally:
            started.set()
        if core is not None:
            threading.Thread(target=_receive_loop, args=(zmq.Context(), input_addresses, inbox), daemon=True,
                             name="engine-input").start()
            exit_code = EngineCoreProc(core, inbox, outbox, parent_pid, len(output_addresses)).run()
    except BaseException as e:  # noqa: BLE001 - any failure must reach the API process as a message
        logger.error("engine core failed:\n%s", traceback.format_exc())
        outbox.put((ALL_CLIENTS, EngineDead(f"engine core failed: {type(e).__name__}: {e}")))
    finally:
        outbox.put(None)
        sender.join(timeout=_SEND_LINGER_MS / 1000 + 1)
    if os.getppid() != parent_pid:
        remove_ipc_dir(input_addresses)
    # The input thread may be blocked in recv(); os._exit does not wait for it.
    logging.shutdown()
    os._exit(exit_code)


def _exit_if_orphaned_before(parent_pid: int, started: threading.Event, input_addresses: list[str]) -> None:
    """Until `started` is set: exit the process once the API process `parent_pid` is gone."""
    while not started.wait(_PARENT_CHECK_INTERVAL_S):
        if os.getppid() != parent_pid:
            logger.error("the API process (pid %d) is gone; engine core exiting during start-up", parent_pid)
            remove_ipc_dir(input_addresses)
            logging.shutdown()
            os._exit(1)


def remove_ipc_dir(input_addresses: list[str]) -> None:
    """Remove the IPC sockets' directory that the API process made (`IPC_DIR_PREFIX`), for when that process
    died without removing it (SIGKILL, an out-of-memory kill): else every such death leaves one in the
    temporary directory. Any other address is left alone."""
    if not input_addresses or not input_addresses[0].startswith("ipc://"):
        return
    directory = os.path.dirname(input_addresses[0][len("ipc://"):])
    if os.path.basename(directory).startswith(IPC_DIR_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)


def _start_core(config: EngineConfig, outbox: queue.Queue[Outgoing | None]) -> Any:
    """Build the EngineCore (loads the model, allocates the KV cache); send `EngineReady` or `EngineDead`."""
    # Imported here: the API process imports this module for the entry point's name only, and must not
    # import the model code.
    from kvserve.engine.engine_core import EngineCore

    try:
        core = EngineCore(config)
    except Exception as e:  # noqa: BLE001 - reported to the API process, which exits with it
        logger.debug("engine start-up failed:\n%s", traceback.format_exc())
        outbox.put((ALL_CLIENTS, EngineDead(f"{type(e).__name__}: {e}")))
        return None
    freeze_startup_heap("engine core")
    cap = core.capacity
    outbox.put((ALL_CLIENTS, EngineReady(
            pid=os.getpid(),
            num_blocks=cap.num_blocks,
            block_size=cap.block_size,
            max_model_len=core.max_model_len,
            eos_token_ids=list(core.eos_token_ids),
            vocab_size=core.vocab_size,
            startup_s=core.startup_s,
            capacity_description=cap.describe(),
        )))
    return core


class EngineCoreProc:
    """The busy loop: apply queued inputs, step while there is work, report every change."""

    def __init__(
        self,
        core: Any,
        inbox: queue.Queue[EngineInput | UnreadableRequests],
        outbox: queue.Queue[Outgoing | None],
        parent_pid: int,
        num_clients: int = 1,
    ) -> None:
        self.core = core  # kvserve.engine.engine_core.EngineCore (not imported at module level)
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.num_clients = num_clients
        # The API process each unfinished request came from (the keys are the core's unfinished requests).
        self._owner: dict[str, int] = {}
        self._gone: set[int] = set()  # API processes that exited (`ClientGone`)
        self._changed = False  # an add/abort changed the scheduler's state since the last report
        self._last_stats: SchedulerStats | None = None  # the stats last sent
        self._last_parent_check = time.monotonic()

    def run(self) -> int:
        while True:
            if not self.core.has_unfinished_requests():
                try:
                    message = self.inbox.get(timeout=_PARENT_CHECK_INTERVAL_S)
                except queue.Empty:
                    if not self._parent_alive():
                        return 1
                    continue
                if self._handle(message):
                    return 0
            while True:
                try:
                    message = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if self._handle(message):
                    return 0
            if self.core.has_unfinished_requests():
                self._step()
            elif self._changed:
                # Nothing left to run (e.g. the last request was aborted): report the freed blocks now,
                # there will be no step to carry the stats.
                self._last_stats = self.core.make_stats()
                self._send_outputs([], self._last_stats)
                self._changed = False
            if self.core.check_invariants_every_step:
                self.check_invariants()
            now = time.monotonic()
            if now - self._last_parent_check > _PARENT_CHECK_INTERVAL_S:
                self._last_parent_check = now
                if not self._parent_alive():
                    return 1

    def _handle(self, message: EngineInput | UnreadableRequests) -> bool:
        """Apply one input message. Returns True on `Shutdown`."""
        if isinstance(message, AddRequests):
            self._add(message)
        elif isinstance(message, AbortRequests):
            # Request ids are unique within an API process only (a client may choose its own): a process
            # aborts its own requests.
            own = [r for r in message.req_ids if self._owner.get(r) == message.client_index]
            self.core.abort_requests(own)
            for req_id in own:
                del self._owner[req_id]
        elif isinstance(message, ClientGone):
            self._client_gone(message.client_index)
        elif isinstance(message, UnreadableRequests):
            for req_id in message.req_ids:
                self.outbox.put((message.client_index, RequestFailed(
                    req_id, f"the engine could not read this request: {message.error}", None)))
        elif isinstance(message, Shutdown):
            return True
        self._changed = True
        return False

    def _add(self, message: AddRequests) -> None:
        added: list[str] = []
        for request in message.requests:
            try:
                self.core.add_request(request)
            except ValueError as e:  # RequestRejected (has .param) or a malformed request
                # The samples of one n>1 request stand or fall together.
                self.core.abort_requests(added)
                for req_id in added:
                    del self._owner[req_id]
                for other in message.requests:
                    self.outbox.put((message.client_index,
                                     RequestFailed(other.req_id, str(e), getattr(e, "param", None))))
                return
            added.append(request.req_id)
            self._owner[request.req_id] = message.client_index

    def _step(self) -> None:
        """One engine step; its outputs (or the stats when they changed) and failures to the API processes."""
        result = self.core.step()
        self._send_failures()
        if result.outputs or self._changed or result.stats != self._last_stats:
            self._send_outputs(result.outputs, result.stats)
            self._last_stats = result.stats
        elif result.num_scheduled_tokens == 0:
            # Unfinished requests but nothing could be scheduled: don't spin a core flat out.
            time.sleep(_IDLE_STEP_SLEEP_S)
        self._changed = False

    def _send_failures(self) -> None:
        """Requests the core dropped (a grammar that failed to compile): an error to the API process."""
        for req_id, message, param in self.core.pop_failed():
            client = self._owner.pop(req_id, None)
            if client is not None and client not in self._gone:
                self.outbox.put((client, RequestFailed(req_id, message, param)))

    def _client_gone(self, client: int) -> None:
        """An API process exited: nobody reads its requests' outputs any more."""
        if client in self._gone or not 0 < client < self.num_clients:
            return
        self._gone.add(client)
        orphans = [r for r, owner in self._owner.items() if owner == client]
        self.core.abort_requests(orphans)
        for req_id in orphans:
            del self._owner[req_id]
        if orphans:
            logger.warning("API process %d exited; aborted its %d unfinished requests", client, len(orphans))
        self.outbox.put((client, CLOSE))

    def _send_outputs(self, outputs: list[EngineCoreOutput], stats: SchedulerStats) -> None:
        """One `EngineOutputs` for each API process: its own requests' outputs, and the stats for all."""
        now = time.time()
        if self.num_clients == 1:
            for output in outputs:
                if output.finish_reason is not None:
                    self._owner.pop(output.req_id, None)
            self.outbox.put((0, EngineOutputs(outputs, stats, now)))
            return
        by_client: list[list[EngineCoreOutput]] = [[] for _ in range(self.num_clients)]
        for output in outputs:
            if output.finish_reason is not None:
                owner = self._owner.pop(output.req_id, 0)
            else:
                owner = self._owner.get(output.req_id, 0)
            by_client[owner].append(output)
        for client, own in enumerate(by_client):
            if client not in self._gone:
                self.outbox.put((client, EngineOutputs(own, stats, now)))

    def check_invariants(self) -> None:
        """Every unfinished request of the core has an owner, and only those."""
        assert set(self._owner) == self.core.unfinished_req_ids(), "request owners differ from the core's requests"
        assert all(0 <= c < self.num_clients and c not in self._gone for c in self._owner.values()), \
            "a request owned by no live API process"

    def _parent_alive(self) -> bool:
        # Reparented (to init or a subreaper) means the API process is gone: nobody will read our output.
        alive = os.getppid() == self.parent_pid
        if not alive:
            logger.error("the API process (pid %d) is gone; engine core exiting", self.parent_pid)
        return alive


def _receive_loop(ctx: zmq.Context, addresses: list[str],
                  inbox: queue.Queue[EngineInput | UnreadableRequests]) -> None:
    socket = ctx.socket(zmq.PULL)
    for address in addresses:  # fair-queued across the API processes
        socket.connect(address)
    decoder = make_input_decoder()
    while True:
        frame = socket.recv(copy=False)
        try:
            inbox.put(decoder.decode(frame.buffer))
        except msgspec.DecodeError as e:
            # Only our own client writes to this socket; a bad frame is a bug, not a reason to die. The
            # requests of an add get an error (instead of no answer).
            logger.exception("dropping an undecodable engine input message")
            unreadable = unreadable_requests(frame.buffer, e)
            if unreadable is not None:
                inbox.put(unreadable)


def _send_loop(ctx: zmq.Context, addresses: list[str], outbox: queue.Queue[Outgoing | None]) -> None:
    sockets: list[zmq.Socket | None] = []
    for address in addresses:
        socket = ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, _SEND_LINGER_MS)
        # No high-water mark: a send never blocks, so an API process that lags (or has not bound its socket
        # yet) cannot hold back the others' outputs; what it has not read waits in its queue.
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.connect(address)
        sockets.append(socket)
    encoder = msgspec.msgpack.Encoder()
    while True:
        item = outbox.get()
        if item is None:
            break
        client, message = item
        if isinstance(message, _Close):
            closing = sockets[client]
            if closing is not None:
                closing.close(linger=0)  # what it has not read would otherwise hold the exit for LINGER
                sockets[client] = None
            continue
        frame = encoder.encode(message)
        for socket in sockets if client == ALL_CLIENTS else [sockets[client]]:
            if socket is not None:
                socket.send(frame, copy=False)
    for socket in sockets:
        if socket is not None:
            socket.close()
    ctx.term()  # returns once queued messages are delivered (or LINGER has passed)
