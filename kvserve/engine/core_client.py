"""The API process's side of the engine-core process: start it, talk to it over ZMQ, notice its death.

`EngineCoreClient.start()` binds two ipc:// sockets in a private temp directory (`make_ipc_dir`; in a
data-parallel replica its name carries the replica's tag, so that the parent can remove it after killing the
replica: `remove_replica_dirs`), spawns
`core_proc.run_engine_core` and waits for `EngineReady` (or for the process to die, whose `EngineDead`
message becomes the error). After that a reader task decodes every engine message and hands it to the
`EngineMessageHandler` (the `AsyncLLM`); the process's sentinel is watched by the event loop, so an engine
that dies without a word (SIGKILL, OOM killer) is noticed at once.

With `--api-server-count N` the first API process's client starts the engine with an input and an output
address for each of the N processes; every other process's client attaches to the running engine
(`EngineAttachment`): it binds its own pair, waits for `EngineReady` as the first one does, and watches the
engine process through a pidfd instead of the sentinel of a child. Only the first client shuts the engine
down.

All methods must be called from the event loop thread that ran `start()`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from kvserve import envs
from kvserve.config import EngineConfig
from kvserve.engine.core_proc import IPC_DIR_PREFIX, run_engine_core
from kvserve.engine.errors import EngineDeadError
from kvserve.protocol.core_messages import (
    AbortRequests,
    AddRequests,
    ClientGone,
    EngineDead,
    EngineInput,
    EngineOutputs,
    EngineReady,
    RequestFailed,
    Shutdown,
    make_message_decoder,
)
from kvserve.protocol.engine import EngineCoreRequest

logger = logging.getLogger(__name__)

# After the process exits, how long to keep reading for the EngineDead message that says why.
_DEATH_MESSAGE_GRACE_S = 0.5
# The longest the reader handles engine messages that are already waiting before it lets the streams run.
# A message that is waiting is received without a pause, so a reader behind the engine would otherwise hold
# the event loop until it caught up (seconds at 256 streams of a small model), and the streams' tokens
# would go out in rare large bursts; the streams send what queued in the meantime as one chunk.
READ_SLICE_S = 0.02
# How long the reader may take after the process exited to work through what the engine sent before.
_DEATH_BACKLOG_MAX_S = 10.0
# An attached client without pidfds checks that the engine's pid exists this often.
_PID_POLL_S = 0.25


class EngineMessageHandler(Protocol):
    def on_engine_outputs(self, message: EngineOutputs) -> None: ...

    def on_request_failed(self, message: RequestFailed) -> None: ...

    def on_engine_dead(self, error: EngineDeadError) -> None: ...


@dataclass(frozen=True)
class EngineAttachment:
    """What another API process needs to attach to a running engine (picklable: sent at spawn)."""

    index: int
    input_address: str
    output_address: str
    engine_pid: int


def _addresses(ipc_dir: str, index: int) -> tuple[str, str]:
    return (f"ipc://{os.path.join(ipc_dir, f'input-{index}')}", f"ipc://{os.path.join(ipc_dir, f'output-{index}')}")


# The longest IPC socket path ZeroMQ takes, in bytes (a Unix socket's sun_path: 107 on Linux; pyzmq says 0 where
# unknown).
IPC_PATH_MAX_LEN = zmq.IPC_PATH_MAX_LEN or 107
# Where the sockets go when the temporary directory's path is too long for them.
_SHORT_TMP = "/tmp"


class IpcPathError(RuntimeError):
    """The engine's IPC socket paths would be too long for a Unix socket (TMPDIR too deep, no /tmp)."""


# The start of the name of the directory of the API processes' metrics files that a server with
# --api-server-count > 1 makes in the temporary directory (`api_server.serve`). Here beside the IPC directory's
# (`IPC_DIR_PREFIX`): both are named alike (`tagged_prefix`) and removed together (`remove_replica_dirs`).
METRICS_DIR_PREFIX = "kvserve-metrics-"
# The directories that `remove_replica_dirs` removes, by the start of their names.
REPLICA_DIR_PREFIXES = (IPC_DIR_PREFIX, METRICS_DIR_PREFIX)
# A data-parallel replica's tag, as its directories' names carry it: ASCII letters and digits, 1 to 32 of them
# (`kvserve serve -dp N` gives 8 hex digits). Nothing else: a tag never holds the `-` that ends it in a name.
_TAG = re.compile(r"[A-Za-z0-9]{1,32}")


def valid_replica_tag(tag: str) -> bool:
    """Whether `tag` is a tag that directory names may carry (`_TAG`)."""
    return _TAG.fullmatch(tag) is not None


def replica_tag() -> str | None:
    """This process's data-parallel replica tag: envs.KVSERVE_DP_REPLICA_TAG, read now (so that tests may set
    it), which `kvserve serve --data-parallel-size N` sets in each replica's environment, a random one of its
    own per replica. None when it is unset, or not a valid tag (`valid_replica_tag`): it is then ignored, and
    the names are those of a server run alone."""
    tag = envs.KVSERVE_DP_REPLICA_TAG
    return tag if tag is not None and valid_replica_tag(tag) else None


def tagged_prefix(prefix: str) -> str:
    """The start of the name of a directory this process makes in the temporary directory (`IPC_DIR_PREFIX`,
    `METRICS_DIR_PREFIX`; mkdtemp adds 8 random letters, digits or `_`): `<prefix><tag>-` in a data-parallel
    replica (`replica_tag`), so that the data-parallel parent, which kills a failed replica's process group
    (its engine core with it: neither is left to remove them), can remove that replica's directories and no
    other (`remove_replica_dirs`); `prefix` alone otherwise, as ever."""
    tag = replica_tag()
    return f"{prefix}{tag}-" if tag is not None else prefix


def ipc_dir_parents() -> list[str]:
    """Where a process with this process's environment makes its directories (`make_ipc_dir`, and the metrics
    directory): the temporary directory, and /tmp (where the IPC directory goes when the other is too deep).
    Only /tmp when there is no usable temporary directory (the process could not have made one there either)."""
    try:
        temporary = tempfile.gettempdir()
    except FileNotFoundError:
        return [_SHORT_TMP]
    return list(dict.fromkeys([temporary, _SHORT_TMP]))


def remove_replica_dirs(tag: str, parents: Iterable[str] | None = None) -> list[str]:
    """Remove the directories that the data-parallel replica tagged `tag` made (`tagged_prefix`: its IPC
    sockets' directory and its metrics directory) in `parents` (by default `ipc_dir_parents()`); returns the
    paths removed. For the data-parallel parent, once it has SIGKILLed that replica's process group: neither
    its API process nor its engine core is left to remove them. Only names of exactly `tag` (`<prefix><tag>-`
    and what mkdtemp adds: tag `abc` is not `abcd`'s), and of those only real directories of this user: never a
    symbolic link (nor where it points) or any other entry. Each replica's tag is random (32 bits), so another
    process's directory, another server's among them (the temporary directory may be shared, even by
    containers whose pids are alike), carries it only by a one-in-four-billion chance. ValueError for an
    invalid tag (`valid_replica_tag`)."""
    if not valid_replica_tag(tag):
        raise ValueError(f"not a replica tag: {tag!r}")
    # (mkdtemp's characters are letters, digits and `_`, never a `-`.)
    starts = "|".join(re.escape(f"{prefix}{tag}-") for prefix in REPLICA_DIR_PREFIXES)
    names = re.compile(f"(?:{starts})\\w+", re.ASCII)
    removed: list[str] = []
    for parent in ipc_dir_parents() if parents is None else parents:
        try:
            entries = os.listdir(parent)
        except OSError:  # (no such directory, not readable: nothing of ours there)
            continue
        for name in entries:
            if names.fullmatch(name) is None:
                continue
            path = os.path.join(parent, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
                if not os.path.lexists(path):
                    removed.append(path)
    return removed


def make_ipc_dir(api_server_count: int) -> str:
    """A new directory for the engine's IPC sockets (named by `tagged_prefix`: `kvserve-ipc-XXXXXXXX`, in a
    data-parallel replica `kvserve-ipc-<tag>-XXXXXXXX`): in the temporary directory (TMPDIR), or in /tmp when the
    sockets' paths there would be longer than ZeroMQ takes (a deep TMPDIR, as CI runners and job schedulers
    set); IpcPathError, naming TMPDIR, when neither fits."""
    longest = os.path.basename(_addresses("", api_server_count - 1)[1])  # output-N, the longest name

    def fits(directory: str) -> bool:  # (the limit is in bytes)
        return len(os.fsencode(os.path.join(directory, longest))) <= IPC_PATH_MAX_LEN

    prefix = tagged_prefix(IPC_DIR_PREFIX)
    directory = tempfile.mkdtemp(prefix=prefix)
    if fits(directory):
        return directory
    os.rmdir(directory)
    why = "its path in /tmp would be too long as well"
    if os.path.isdir(_SHORT_TMP):
        try:
            short = tempfile.mkdtemp(prefix=prefix, dir=_SHORT_TMP)
        except OSError as e:
            why = f"{_SHORT_TMP} is not writable ({e})"
        else:
            if fits(short):
                logger.info("the IPC sockets go to %s: under the temporary directory %s their paths would be "
                            "longer than %d bytes", short, os.path.dirname(directory), IPC_PATH_MAX_LEN)
                return short
            os.rmdir(short)
    else:
        why = f"there is no {_SHORT_TMP}"
    raise IpcPathError(f"the engine's IPC socket paths under the temporary directory {os.path.dirname(directory)!r} "
                       f"would be longer than the {IPC_PATH_MAX_LEN} bytes a Unix socket takes, and {why}: set "
                       "TMPDIR to a shorter directory")


class EngineCoreClient:
    def __init__(self, config: EngineConfig, handler: EngineMessageHandler, log_level: str = "INFO",
                 api_server_count: int = 1, attach: EngineAttachment | None = None) -> None:
        """`api_server_count`: how many API processes the engine serves (this one starts it). `attach`: this
        process is one of the others, and attaches to the engine another one started."""
        self.config = config
        self.handler = handler
        self.log_level = log_level
        self.ready: EngineReady | None = None
        self.dead_error: EngineDeadError | None = None
        self.api_server_count = api_server_count
        self.attach = attach
        self.index = attach.index if attach is not None else 0
        self._process: multiprocessing.process.BaseProcess | None = None
        self._pidfd: int | None = None  # attached: the engine process, readable once it exits
        self._poller: asyncio.Task[None] | None = None  # attached, where pidfds are not available
        self._engine_exited = False
        self._ipc_dir = make_ipc_dir(api_server_count) if attach is None else ""
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = make_message_decoder()
        self._reader: asyncio.Task[None] | None = None
        self._pending_sends: set[asyncio.Task[None]] = set()
        self._ready_future: asyncio.Future[EngineReady] | None = None
        self._shutting_down = False
        self.read_slice_s = READ_SLICE_S

    # ------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> int | None:
        if self.attach is not None:
            return self.attach.engine_pid
        return self._process.pid if self._process is not None else None

    @property
    def is_alive(self) -> bool:
        if self.dead_error is not None:
            return False
        if self.attach is not None:
            return not self._engine_exited
        return self._process is not None and self._process.is_alive()

    def attachment(self, index: int) -> EngineAttachment:
        """What API process `index` (1 .. api_server_count - 1) attaches with; after `start()`."""
        assert self.attach is None and self._process is not None and self._process.pid is not None
        assert 0 < index < self.api_server_count, index
        return EngineAttachment(index, *_addresses(self._ipc_dir, index), engine_pid=self._process.pid)

    async def start(self) -> EngineReady:
        """Spawn the engine core (or attach to it) and wait until it is ready. Raises EngineDeadError when it
        fails to start."""
        loop = asyncio.get_running_loop()
        self._input.setsockopt(zmq.LINGER, 0)
        self._ready_future = loop.create_future()
        if self.attach is not None:
            return await self._attach_to_engine(self.attach)
        input_address, output_address = _addresses(self._ipc_dir, 0)
        self._input.bind(input_address)
        self._output.bind(output_address)
        every = [_addresses(self._ipc_dir, i) for i in range(self.api_server_count)]
        # NOTE: spawn, never fork: the engine initializes CUDA, and a forked child of a process with
        # threads (asyncio, tokenizers) can inherit held locks.
        mp = multiprocessing.get_context("spawn")
        self._process = mp.Process(
            target=run_engine_core,
            args=(self.config, [a[0] for a in every], [a[1] for a in every], self.log_level, os.getpid()),
            name="kvserve-engine-core",
            daemon=False,
        )
        self._process.start()
        logger.info("engine core process started (pid %d); loading the model", self._process.pid)
        self._reader = loop.create_task(self._read_loop())
        loop.add_reader(self._process.sentinel, self._on_process_exit)
        self.ready = await self._ready_future
        return self.ready

    async def _attach_to_engine(self, attach: EngineAttachment) -> EngineReady:
        loop = asyncio.get_running_loop()
        self._input.bind(attach.input_address)
        self._output.bind(attach.output_address)
        self._reader = loop.create_task(self._read_loop())
        try:
            self._pidfd = os.pidfd_open(attach.engine_pid)
        except ProcessLookupError:
            self._engine_exited = True
            self._declare_dead(f"the engine core process (pid {attach.engine_pid}) is gone")
        except OSError as e:  # no pidfd here (an old kernel, a seccomp filter): look at the pid instead
            logger.debug("pidfd_open failed (%s); polling the engine's pid", e)
            self._poller = loop.create_task(self._poll_engine(attach.engine_pid))
        else:
            loop.add_reader(self._pidfd, self._on_process_exit)
        self.ready = await self._ready_future
        return self.ready

    async def _poll_engine(self, pid: int) -> None:
        while not self._shutting_down:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                self._on_process_exit()
                return
            await asyncio.sleep(_PID_POLL_S)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to exit; kill it if it does not within `timeout_s`. Idempotent."""
        if self._shutting_down:
            return
        self._shutting_down = True
        if self._pidfd is not None:  # attached: the first API process stops the engine
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._poller is not None:
            self._poller.cancel()
        process = self._process
        if process is not None:
            asyncio.get_running_loop().remove_reader(process.sentinel)
            if process.is_alive() and self.ready is None:
                # Still loading: it reads no message before it is ready and ignores SIGTERM (the API process
                # decides when it stops), and it has no request to finish: stop it now.
                logger.info("engine core still starting; killing it")
                process.kill()
            if process.is_alive():
                if self._pending_sends:  # (aborts, ClientGone) before the engine stops reading
                    await asyncio.wait(set(self._pending_sends), timeout=1.0)
                try:
                    await asyncio.wait_for(self._input.send(self._encoder.encode(Shutdown())), 1.0)
                except (asyncio.TimeoutError, zmq.ZMQError):
                    pass
                await _join(process, timeout_s)
            if process.is_alive():
                # Killed, not terminated: the engine ignores SIGTERM (core_proc: the API process decides when
                # it stops), so a SIGTERM first only added a wait of 5 s before the kill.
                logger.warning("engine core did not exit in %.0f s; killing it", timeout_s)
                process.kill()
                await _join(process, 5.0)
            logger.info("engine core stopped (exit code %s)", process.exitcode)
        if self._reader is not None:
            self._reader.cancel()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # ------------------------------------------------------------------ requests

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        await self._send(AddRequests(requests, self.index))

    def abort_requests(self, req_ids: list[str]) -> None:
        """Fire-and-forget (callable from `finally` blocks and callbacks); a dead engine needs no abort."""
        if not req_ids or self.dead_error is not None or self._shutting_down:
            return
        self._send_soon(AbortRequests(list(req_ids), self.index))

    def client_gone(self, index: int) -> None:
        """Tell the engine that API process `index` exited (the first process does): its requests are
        aborted and it is sent nothing more."""
        if self.dead_error is None and not self._shutting_down:
            self._send_soon(ClientGone(index))

    def _send_soon(self, message: EngineInput) -> None:
        task = asyncio.get_running_loop().create_task(self._send(message))
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self.ready is None:
            raise EngineDeadError("the engine core is not ready")

    async def _send(self, message: EngineInput) -> None:
        # PUSH blocks only when the engine stops reading (its queue is unbounded): that is a dead engine,
        # which the sentinel watcher reports.
        await self._input.send(self._encoder.encode(message), copy=False)

    # ------------------------------------------------------------------ engine -> API

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        busy_since: float | None = None  # when the reader last resumed after a pause
        try:
            while True:
                frame = await self._output.recv(copy=False)
                if busy_since is None:
                    busy_since = loop.time()
                self._dispatch(self._decoder.decode(frame.buffer))
                if not self._output.get(zmq.EVENTS) & zmq.POLLIN:
                    busy_since = None  # nothing waiting: the next receive pauses, and the streams run
                elif loop.time() - busy_since >= self.read_slice_s:
                    await asyncio.sleep(0)
                    busy_since = None
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError:
            if not self._shutting_down:
                self._declare_dead("the connection to the engine core broke")
        except Exception as e:  # a handler bug or an undecodable frame: the server cannot go on
            logger.exception("engine output handling failed")
            self._declare_dead(f"engine output handling failed: {type(e).__name__}: {e}")

    def _dispatch(self, message: object) -> None:
        if isinstance(message, EngineOutputs):
            self.handler.on_engine_outputs(message)
        elif isinstance(message, RequestFailed):
            self.handler.on_request_failed(message)
        elif isinstance(message, EngineReady):
            if self._ready_future is not None and not self._ready_future.done():
                self._ready_future.set_result(message)
        elif isinstance(message, EngineDead):
            self._declare_dead(message.message)

    def _on_process_exit(self) -> None:
        """The process's sentinel (or pidfd) became readable: it exited. Read what it said last, then declare."""
        loop = asyncio.get_running_loop()
        if self.attach is not None:
            if self._pidfd is not None:
                loop.remove_reader(self._pidfd)
            self._engine_exited = True
        else:
            assert self._process is not None
            loop.remove_reader(self._process.sentinel)
        if self._shutting_down:
            return
        loop.create_task(self._after_exit())

    async def _after_exit(self) -> None:
        # An engine that failed sends EngineDead before exiting; give the reader a moment to get it. A reader
        # behind the engine is still working through messages sent before it (the last tokens of requests
        # that finished, then EngineDead): wait until it has read them all, within a bound.
        loop = asyncio.get_running_loop()
        await asyncio.sleep(_DEATH_MESSAGE_GRACE_S)
        deadline = loop.time() + _DEATH_BACKLOG_MAX_S
        while (not self._shutting_down and self.dead_error is None and loop.time() < deadline
               and self._output.get(zmq.EVENTS) & zmq.POLLIN):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)  # the last message received is handled in the reader's next turn
        if self._process is None:  # attached: not our child, so no exit code
            self._declare_dead("the engine core process exited unexpectedly")
            return
        self._process.join(timeout=0)
        self._declare_dead(f"the engine core process exited unexpectedly (exit code {self._process.exitcode})")

    def _declare_dead(self, reason: str) -> None:
        if self.dead_error is not None or self._shutting_down:
            return
        self.dead_error = EngineDeadError(reason)
        logger.error("engine core is dead: %s", reason)
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.set_exception(self.dead_error)
            return
        self.handler.on_engine_dead(self.dead_error)


async def _join(process: multiprocessing.process.BaseProcess, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while process.is_alive() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    process.join(timeout=0)
