"""`kvserve serve --data-parallel-size N` (`-dp N`): N replicas of the server behind one port.

This process starts N child `kvserve serve` processes with the command's own flags followed by
`--data-parallel-size 1 --host 127.0.0.1 --port P` (argparse keeps a flag's last value), each listening on
127.0.0.1 at a free port of its own and, on CUDA, on GPUs of its own: replica i gets GPUs
[i * TP, (i + 1) * TP) of those visible to this process (CUDA_VISIBLE_DEVICES, else all), TP being
--tensor-parallel-size. With device cpu the N replicas share the cores (OMP_NUM_THREADS = cores / N each,
unless it is set). Each child's output comes out of this process's stderr, each line prefixed `(replica i)`.
Each child's environment has KVSERVE_DP_REPLICA=1, so it refuses to start replicas of its own, and
KVSERVE_DP_REPLICA_TAG, a random tag of its own (`new_replica_tag`), which the directories it makes in the
temporary directory carry in their names (below).

* Start-up: the public --host/--port is bound and listening at once (a busy port fails fast, before any
  replica starts); connections wait in its backlog until every replica answers /health 200 and the router
  (`kvserve.router.app`, prefix policy) serves it from this process. A replica that exits during start-up
  stops the others, and the command exits with that replica's exit status (128 + N for a death by signal N),
  its last lines of output repeated in the error.
* Serving: the router forwards each request to a healthy replica (prompts that start alike to the same one,
  for its prefix cache), with the Authorization header, so replicas given --api-key check it; its own
  health checks send the key too. It sets no limit on how long a replica may take (as one server has none),
  refuses bodies over --max-request-body-bytes as the server does, and caps nothing in flight. /metrics holds
  every replica's series labelled engine="<i>", and the router's own.
* A replica that exits while serving stops the whole server: the others are stopped and this process exits
  1, as one server does when its engine dies (an orchestrator restarts it whole). Between a replica's engine
  dying and its process exiting (about a second), the router's health checks and its retry on 503 keep
  requests away from it. Its exit is seen at once (`_exit_code`: by the process, not by the end of its output,
  which its engine core holds for up to about 6 s after a SIGKILL), and what it left running (its process
  group: its engine core) is killed then. Until the router stops accepting, requests still go to the other
  replicas: a refused connection, or one closed before the answer began, is retried there; a stream under
  way ends with an error event (see `kvserve.router.app`).
* What a failed replica leaves: a replica's API process makes a directory for its engine's IPC sockets in
  the temporary directory (or /tmp), and with --api-server-count > 1 one for its API processes' metrics
  files, and removes them at exit; when that process is SIGKILLed (the OOM killer) its engine core removes the
  IPC one on its way out, but here the engine core is SIGKILLed with it (its process group, above), so this
  process removes them: their names carry the replica's tag (`core_client.tagged_prefix`), and for each
  replica whose process exited with a code other than 0 (killed, or failed by itself), once, this process
  SIGKILLs the replica's process group while something of it still holds its output (its engine core may
  still run) and then removes the directories that
  carry exactly that replica's tag, in the temporary directory and in /tmp (`Replica.remove_what_it_left`,
  `core_client.remove_replica_dirs`): as soon as a replica is seen to exit while serving or during start-up
  (`Replica.reap`), or as each exits while they are stopped (`_stop_replicas`). Nothing of a replica that
  exited 0 (it removed its own), and no other directory: tags are random (32 bits), so none of another
  server's (the temporary directory may be shared, even by containers whose pids are alike) carries it.
* SIGTERM / SIGINT: every replica drains (it gets one SIGTERM; new requests 503, in-flight ones finish
  within --shutdown-timeout), the router stops accepting and finishes its requests, and the process exits 0
  once every replica has exited 0. A second signal is passed on, so the replicas exit at once; the process
  then exits 0 too when each replica exited 0 or by that SIGTERM (each ends what it still runs as one server
  does: a 503 in the OpenAI format, or a stream's error event and [DONE], which the router passes on; a
  request not streamed may first be tried on another replica, which is stopping too: the router's own 503
  then says so). Unlike `kvserve route`, the router's own requests are not cancelled by that signal (this
  process handles its signals itself): the replicas' ends reach the clients. What is still in flight at the
  router --shutdown-timeout + DRAIN_ABORT_GRACE_S after the replicas were stopped (a replica that hangs) the
  router ends itself, as `kvserve route` ends what it stops (`RouterApp.end_in_flight`), before aiohttp's own
  wait would run out and cut it. A replica that dies mid-answer: see `kvserve.router.app`. The replicas run in
  sessions of their own, so a terminal's Ctrl-C reaches them once, through this process; on Linux each also
  gets SIGTERM if this process dies without stopping them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp
from aiohttp import web

from kvserve import envs
from kvserve.config import is_auto_max_model_len
from kvserve.engine.core_client import remove_replica_dirs
from kvserve.entrypoints.openai.api_server import DRAIN_ABORT_GRACE_S, LISTEN_BACKLOG, bind_listening
from kvserve.entrypoints.openai.cli_args import api_key_from
from kvserve.router.app import END_IN_FLIGHT_S, RouterApp, RouterConfig
from kvserve.router.policies import Router

logger = logging.getLogger("kvserve.data_parallel")

LOCAL_HOST = "127.0.0.1"
HEALTH_POLL_S = 0.5
ROUTER_HEALTH_CHECK_INTERVAL_S = 2.0
# Lines of each replica's output kept to repeat when it fails.
TAIL_LINES = 40
# How much of a replica's output is read at once, and the longest line kept whole (a longer one is passed on
# in pieces of this size).
OUTPUT_CHUNK_BYTES = 64 * 1024
MAX_LINE_BYTES = 1024 * 1024
# After --shutdown-timeout, how long replicas get to exit before they are killed.
EXIT_GRACE_S = 15.0
# How often each replica's process is checked for its exit (`_exit_code`).
EXIT_POLL_S = 0.1
# After a replica exited by itself, how long the rest of its output may take (`Replica.reap`).
OUTPUT_AFTER_EXIT_S = 1.0


# ----------------------------------------------------------------------------------------- pure parts


def visible_gpus(cuda_visible_devices: str | None, device_count: int) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries: the variable's list when it is set
    (indices or UUIDs), else 0 .. device_count - 1."""
    if cuda_visible_devices is None:
        return [str(i) for i in range(device_count)]
    return [entry.strip() for entry in cuda_visible_devices.split(",") if entry.strip()]


def assign_gpus(visible: Sequence[str], data_parallel_size: int, tensor_parallel_size: int) -> list[list[str]]:
    """Replica i's GPUs: visible[i * TP : (i + 1) * TP]. ValueError when there are fewer than DP * TP."""
    needed = data_parallel_size * tensor_parallel_size
    if len(visible) < needed:
        seen = f"{len(visible)} visible ({', '.join(visible)})" if visible else "none visible"
        raise ValueError(f"--data-parallel-size {data_parallel_size} x --tensor-parallel-size "
                         f"{tensor_parallel_size} needs {needed} GPUs, {seen}")
    tp = tensor_parallel_size
    return [list(visible[i * tp:(i + 1) * tp]) for i in range(data_parallel_size)]


def replica_args(serve_args: Sequence[str], port: int) -> list[str]:
    """A replica's `kvserve serve` flags: the command's (`serve_args`, those after `serve`), all of them in
    their order, plus `--data-parallel-size 1 --host 127.0.0.1 --port <port>`, before a `--` if there is one
    (after it every word is positional). argparse keeps a flag's last value, so these win however the
    command spelled its own (`-dp 2`, `-d 2`, `--data-p=2`); and since nothing is dropped, every other word
    parses as it did for the command (dropping `-dp 2` from `--served-model-name a -dp 2 MODEL` would make
    MODEL a served name)."""
    args = list(serve_args)
    end = args.index("--") if "--" in args else len(args)
    return [*args[:end], "--data-parallel-size", "1", "--host", LOCAL_HOST, "--port", str(port), *args[end:]]


def exit_status(returncode: int) -> int:
    """The command's exit status for a replica that failed with `returncode` (asyncio's: -N for a death by
    signal N): 128 + N for a signal, as a shell reports it; the code itself otherwise, 1 for 0 (a replica that
    exits during start-up has failed, whatever its code)."""
    if returncode < 0:
        return 128 - returncode
    return returncode or 1


def unexpected_exits(codes: Mapping[int, int | None], stopped_at_once: bool) -> dict[int, int | None]:
    """{replica index: exit code} of the replicas that did not stop as told: every code but 0 when they were
    asked to drain; after a second signal (`stopped_at_once`), a death by the SIGTERM that passed it on is
    what was asked for, too."""
    expected = {0, -int(signal.SIGTERM)} if stopped_at_once else {0}
    return {index: code for index, code in codes.items() if code not in expected}


def router_config(ns: argparse.Namespace) -> RouterConfig:
    """The router in front of the replicas, set as one server would be: no time limit on an answer (one
    server has none), the server's request body limit (the replicas check it too; 0, which refuses any body,
    is theirs to apply), the API key for its own polls of the replicas, and --root-path (paths under it are
    forwarded, as one server serves them)."""
    api_key, _ = api_key_from(ns.api_key, envs.KVSERVE_API_KEY, envs.VLLM_API_KEY)
    return RouterConfig(health_check_interval_s=ROUTER_HEALTH_CHECK_INTERVAL_S, request_timeout_s=None,
                        max_body_bytes=max(int(ns.max_request_body_bytes), 1), engine_metrics=True,
                        api_key=api_key, root_path=ns.root_path)


def check_data_parallel_flags(ns: argparse.Namespace) -> None:
    """ValueError for flags the replicas behind one router cannot serve."""
    if ns.ssl_certfile or ns.ssl_keyfile:
        raise ValueError("--ssl-certfile / --ssl-keyfile with --data-parallel-size > 1 are not supported: serve "
                         "HTTP and terminate TLS in front (nginx, a load balancer)")
    if ns.device not in (None, "cpu", "cuda"):
        raise ValueError(f"with --data-parallel-size > 1, --device is cpu or cuda (each replica takes its own "
                         f"GPUs), got {ns.device!r}")
    router_config(ns)  # the router's settings (an API key it cannot send, say), refused before any replica starts


# ----------------------------------------------------------------------------------------- replicas


def new_replica_tag() -> str:
    """A replica's tag (KVSERVE_DP_REPLICA_TAG): 8 random hex digits (32 bits: another process's directory in
    the temporary directory carries it only by a chance of one in four billion, and the names stay short, see
    `core_client.make_ipc_dir`'s length limit; `core_client.remove_replica_dirs`)."""
    return secrets.token_hex(4)


@dataclass
class ReplicaPlan:
    index: int
    port: int
    gpus: list[str] | None  # CUDA_VISIBLE_DEVICES entries; None on CPU
    # Its KVSERVE_DP_REPLICA_TAG, which the names of the directories it makes carry (`replica_env`).
    tag: str = field(default_factory=new_replica_tag)

    def describe(self) -> str:
        where = f"GPU {','.join(self.gpus)}" if self.gpus is not None else "CPU"
        return f"replica {self.index} on {where} at http://{LOCAL_HOST}:{self.port}"


@dataclass
class Replica:
    plan: ReplicaPlan
    process: asyncio.subprocess.Process
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    output_done: asyncio.Task[None] | None = None
    exit_wait: asyncio.Task[int] | None = None  # its exit code, once its process has exited (`_exit_code`)
    sigterms_sent: int = 0  # the first drains it, a second stops it at once
    left_removed: bool = False  # `remove_what_it_left` has run (it runs once)

    @property
    def url(self) -> str:
        return f"http://{LOCAL_HOST}:{self.plan.port}"

    def signal(self, sig: int) -> None:
        """Send `sig` unless the process is known to have exited. NOTE: os.kill, not Popen.send_signal, which
        polls first and so may reap the child before asyncio's watcher, which then reports exit code 255."""
        if self.process.returncode is None:
            if sig == signal.SIGTERM:
                self.sigterms_sent += 1
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the replica's process group: the replica and what it started (its engine core and that one's
        workers, which would otherwise hold its GPUs and its output pipe for seconds). Its own session: the
        group's id is its pid, kept while any of them lives."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    async def reap(self) -> int:
        """After the replica's process exited by itself (it died, or failed): kill what it started that still runs,
        its process group (its engine core and that one's workers, which leave by themselves only seconds after
        losing it, meanwhile holding its GPUs and its output pipe), relay the rest of its output (up to
        OUTPUT_AFTER_EXIT_S), and return its exit code. A code other than 0 also removes what it left in the
        temporary directory, its group killed first (`remove_what_it_left`)."""
        code = self.process.returncode
        assert code is not None, "the replica is still running"
        if self.output_done is not None and not self.output_done.done():  # something still holds its output
            self.kill_group()
            await asyncio.wait([self.output_done], timeout=OUTPUT_AFTER_EXIT_S)
        self.remove_what_it_left()
        return code

    def remove_what_it_left(self) -> None:
        """Once the replica's process has exited with a code other than 0 (it was killed, or failed by itself),
        and only once (`left_removed`): SIGKILL its process group while something of it still holds the
        replica's output open (its engine core may still run: its API process failed without stopping it, or
        is gone), then remove the directories it made in the temporary
        directory and in /tmp, those whose names carry its tag (`core_client.remove_replica_dirs`: its engine's
        IPC sockets' directory, its metrics directory), which neither its API process nor its engine core,
        killed, is left to remove. Once the group is SIGKILLed none of it runs any more of its code, so nothing
        uses them or makes them again. The group is killed only while a member holds the output (`output_done`
        not done): that member keeps the group's id (the replica's pid) from being reused, whereas once the
        group is empty the id is free and may be another process's group, possibly a minute later (a replica
        that failed during the router's drain is handled only afterwards). Nothing while the process runs, or
        when it exited 0: it removed its own, and stopped its engine core."""
        if self.left_removed or self.process.returncode in (None, 0):
            return
        self.left_removed = True
        if self.output_done is not None and not self.output_done.done():
            self.kill_group()
        removed = remove_replica_dirs(self.plan.tag)
        if removed:
            logger.info("removed what replica %d (pid %d, exit code %d) left in the temporary directory: %s",
                        self.plan.index, self.process.pid, self.process.returncode, ", ".join(removed))

    def failure(self, code: int, what: str) -> str:
        """'<replica> exited with code <code> <what>', then its last lines of output."""
        last = "".join(self.tail).rstrip()
        return (f"{self.plan.describe()} (pid {self.process.pid}) exited with code {code} {what}"
                + (f"; its last output:\n{last}" if last else ""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL_HOST, 0))
        return int(s.getsockname()[1])


def plan_replicas(ns: argparse.Namespace, taken_ports: Collection[int] = ()) -> list[ReplicaPlan]:
    """Each replica's port (none of `taken_ports`: the public one) and GPUs (ValueError when the GPUs do not
    suffice)."""
    dp, tp = int(ns.data_parallel_size), int(ns.tensor_parallel_size)
    device = ns.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        groups: list[list[str] | None] = [None] * dp
    else:
        import torch

        # CUDA_VISIBLE_DEVICES is read as the tensor-parallel ranks read it (kvserve.executor.multiproc).
        visible = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
        groups = list(assign_gpus(visible, dp, tp))
    ports: set[int] = set()
    while len(ports) < dp:
        port = _free_port()
        if port not in taken_ports:
            ports.add(port)
    return [ReplicaPlan(i, port, gpus) for i, (port, gpus) in enumerate(zip(sorted(ports), groups, strict=True))]


def _die_with_parent() -> Callable[[], None] | None:
    """What the child runs before exec (Linux): ask for SIGTERM when this process dies, so no replica
    outlives it, and exit at once if it already has (the request covers only a later death). libc is loaded
    here, in the parent: the forked child should only make the call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    parent = os.getpid()

    def in_child() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before the request took hold: no signal will come
            os._exit(1)

    return in_child


def replica_command(plan: ReplicaPlan, serve_args: Sequence[str]) -> list[str]:
    """The command that starts replica `plan`: this Python's `-m kvserve serve` with `replica_args`."""
    return [sys.executable, "-m", "kvserve", "serve", *replica_args(serve_args, plan.port)]


def replica_env(env: Mapping[str, str], plan: ReplicaPlan, num_replicas: int, num_cores: int) -> dict[str, str]:
    """Replica `plan`'s environment: this process's `env` plus KVSERVE_DP_REPLICA=1 (it refuses
    --data-parallel-size > 1, however its flags say it), KVSERVE_DP_REPLICA_TAG=<its tag> (the names of the
    directories it makes carry it: `Replica.remove_what_it_left`), its GPUs as CUDA_VISIBLE_DEVICES, and on
    CPU an equal share of the `num_cores` cores as OMP_NUM_THREADS (torch's thread count; else each replica
    would run as many threads as there are cores), unless `env` sets OMP_NUM_THREADS itself."""
    out = {**env, "KVSERVE_DP_REPLICA": "1", "KVSERVE_DP_REPLICA_TAG": plan.tag}
    if plan.gpus is not None:
        out["CUDA_VISIBLE_DEVICES"] = ",".join(plan.gpus)
    elif "OMP_NUM_THREADS" not in env:
        out["OMP_NUM_THREADS"] = str(max(1, num_cores // num_replicas))
    return out


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


async def _start(plan: ReplicaPlan, serve_args: Sequence[str], num_replicas: int) -> Replica:
    env = replica_env(os.environ, plan, num_replicas, _usable_cores())
    command = replica_command(plan, serve_args)
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=env, start_new_session=True, preexec_fn=_die_with_parent())
    replica = Replica(plan, process)
    assert process.stdout is not None
    replica.output_done = asyncio.create_task(
        relay_output(process.stdout, f"(replica {plan.index}) ", replica.tail, sys.stderr))
    replica.exit_wait = asyncio.create_task(_exit_code(process))
    logger.info("started %s (pid %d)", plan.describe(), process.pid)
    return replica


async def _exit_code(process: asyncio.subprocess.Process) -> int:
    """`process`'s exit code, as soon as it has exited. Not process.wait(), which (Python 3.11) returns only once
    its output pipe is closed too: a replica's engine core holds that pipe until it leaves by itself, up to about
    6 s after a SIGKILLed replica (a second to see that it is gone, then up to 5 s for its last messages), and
    the replica's death would only be noticed then."""
    while process.returncode is None:
        await asyncio.sleep(EXIT_POLL_S)
    return process.returncode


async def relay_output(stream: asyncio.StreamReader, prefix: str, tail: collections.deque[str],
                       out: TextIO) -> None:
    """Copy `stream` to `out` line by line, each prefixed, until its end; keep the last lines in `tail`.
    Read in chunks, not with readline(), whose 64 KiB limit loses the start of a longer line; a line past
    MAX_LINE_BYTES is passed on in pieces."""
    pending = b""

    def emit(line: bytes) -> None:
        for start in range(0, max(len(line), 1), MAX_LINE_BYTES):
            text = line[start:start + MAX_LINE_BYTES].decode(errors="replace") + "\n"
            tail.append(text)
            out.write(prefix + text)

    while True:
        chunk = await stream.read(OUTPUT_CHUNK_BYTES)
        if not chunk:
            if pending:
                emit(pending)
                out.flush()
            return
        *lines, pending = (pending + chunk).split(b"\n")
        if len(pending) > MAX_LINE_BYTES:  # no end in sight: pass on its whole pieces
            cut = len(pending) - len(pending) % MAX_LINE_BYTES
            lines.append(pending[:cut])
            pending = pending[cut:]
        for line in lines:
            emit(line)
        out.flush()


async def _wait_ready(replicas: Sequence[Replica], stop: asyncio.Event) -> Replica | None:
    """Until every replica answers /health 200 (None), one exits (that one), or `stop` is set (None)."""
    pending = {r.plan.index: r for r in replicas}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        while pending and not stop.is_set():
            for replica in replicas:
                if replica.process.returncode is not None:
                    return replica
            for index, replica in list(pending.items()):
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(replica.url + "/health") as response:
                        if response.status == 200:
                            del pending[index]
                            logger.info("replica %d is ready", index)
            if pending:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
    return None


async def _stop_replicas(replicas: Sequence[Replica], timeout_s: float) -> None:
    """SIGTERM each not sent one yet (they drain: a second would stop them at once), wait up to `timeout_s`,
    SIGKILL the process group of any still running, and wait up to 5 s more; their output is relayed to the end.
    Each replica whose process has exited with a code other than 0 (one exited before, one exiting now, one
    killed here) has its process group SIGKILLed and what it left in the temporary directory removed
    (`Replica.remove_what_it_left`, once per replica) as soon as its exit is seen."""
    for replica in replicas:
        if replica.sigterms_sent == 0:
            replica.signal(signal.SIGTERM)
    exits = {r.exit_wait: r for r in replicas if r.exit_wait is not None}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    killed = False
    pending: set[asyncio.Task[int]] = set(exits)
    while pending:
        done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                           return_when=asyncio.FIRST_COMPLETED)
        for task in done:  # (at once, not once the others are done: what it left running is killed now)
            exits[task].remove_what_it_left()
        if done:
            continue
        if killed:  # (still running 5 s after a SIGKILL)
            break
        for replica in replicas:
            if replica.process.returncode is None:
                logger.warning("replica %d did not stop within %.0f s: killing it (and what it started)",
                               replica.plan.index, timeout_s)
                replica.kill_group()
        killed = True
        deadline = loop.time() + 5.0
    outputs = [r.output_done for r in replicas if r.output_done is not None]
    if outputs:
        await asyncio.wait(outputs, timeout=5.0)


async def _first_model(replica: Replica, api_key: str | None) -> dict[str, Any] | None:
    """The first model replica `replica` lists (its /v1/models: id, max_model_len, ...); None when it cannot be
    read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
            async with session.get(replica.url + "/v1/models", headers=headers) as response:
                entry = (await response.json())["data"][0]
                return entry if isinstance(entry, dict) else None
    return None


def _served_length(entry: dict[str, Any] | None) -> int | None:
    """The max_model_len a replica's first listed model has (None: not read)."""
    length = None if entry is None else entry.get("max_model_len")
    return length if isinstance(length, int) else None


def unequal_lengths_warning(lengths: Mapping[int, int | None]) -> str | None:
    """With --max-model-len auto each replica lowers the length to what its own KV cache holds: when replicas
    (index -> length; None: not read) settled on different lengths, what to say (a request between the shortest
    and the longest is served by some replicas and refused by others); None when they agree."""
    known = {index: length for index, length in lengths.items() if length is not None}
    if len(set(known.values())) <= 1:
        return None
    shortest = min(known.values())
    each = ", ".join(f"replica {index}: {length}" for index, length in sorted(known.items()))
    return (f"--max-model-len auto gave the replicas different lengths ({each}): their KV caches hold different "
            f"numbers of tokens, and a request longer than {shortest} tokens is refused by some replicas and "
            f"served by others; pass --max-model-len {shortest} for one length on all")


async def serve_replicas(ns: argparse.Namespace, plans: Sequence[ReplicaPlan], serve_args: Sequence[str],
                         sock: socket.socket) -> int:
    """Start the replicas of `plans`, then serve `sock` (bound, listening) through the router once all are
    ready, until a signal or a replica's exit (see the module's docstring); returns the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    replicas: list[Replica] = []
    signals = 0

    def on_signal(sig: int) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            logger.info("signal %d: stopping the %d replicas (each drains its requests)", sig, len(plans))
            stop.set()
        else:
            logger.info("signal %d again: the replicas stop now", sig)
            for replica in replicas:
                replica.signal(signal.SIGTERM)  # their second signal: exit at once

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    shutdown_s = float(ns.shutdown_timeout)
    runner: web.AppRunner | None = None
    try:
        for plan in plans:
            replicas.append(await _start(plan, serve_args, len(plans)))
        failed = await _wait_ready(replicas, stop)
        if failed is not None:
            code = await failed.reap()
            logger.error("%s", failed.failure(code, "during start-up"))
            return exit_status(code)
        if stop.is_set():
            return 0
        config = router_config(ns)
        # (the router's series name each replica by its index, as its engine series' `engine` label does: its
        # port changes at each start, and a url label would start new series each time)
        app = RouterApp(Router([r.url for r in replicas], "prefix", [str(r.plan.index) for r in replicas]), config)
        # The replicas abort what still runs at --shutdown-timeout and their responses end within
        # DRAIN_ABORT_GRACE_S: the router's own wait covers both, so those ends reach the clients; then it ends
        # what is left itself (`overdue`), before aiohttp's wait runs out and cuts it.
        runner = web.AppRunner(app.make_app(), handle_signals=False, access_log=None, handler_cancellation=True,
                               shutdown_timeout=shutdown_s + DRAIN_ABORT_GRACE_S + END_IN_FLIGHT_S + 1)
        await runner.setup()
        # Logged before the site starts, so that a client served first (one waiting in the backlog) finds it
        # in the log.
        host, port = sock.getsockname()[:2]
        # With --max-model-len auto, every replica's length is compared (each sized its own KV cache).
        auto_length = is_auto_max_model_len(getattr(ns, "max_model_len", None))
        asked = replicas if auto_length else replicas[:1]
        entries = await asyncio.gather(*(_first_model(r, config.api_key) for r in asked))
        name = str(entries[0]["id"]) if entries[0] is not None and "id" in entries[0] else "the model"
        if auto_length:
            unequal = unequal_lengths_warning({r.plan.index: _served_length(entry)
                                               for r, entry in zip(replicas, entries, strict=True)})
            if unequal is not None:
                logger.warning("%s", unequal)
        local = " (this machine only; --host 0.0.0.0 to accept others)" if ns.host == LOCAL_HOST else ""
        logger.info("serving %s on http://%s:%d%s (OpenAI API under /v1) from %d data-parallel replicas: %s",
                    name, host, port, local, len(replicas), "; ".join(r.plan.describe() for r in replicas))
        await web.SockSite(runner, sock, backlog=LISTEN_BACKLOG).start()
        exits = {r.exit_wait: r for r in replicas if r.exit_wait is not None}
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopping, *exits], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        dead = [exits[task] for task in done if task in exits]
        if dead:
            replica = dead[0]
            logger.error("%s", replica.failure(await replica.reap(),
                                               "while serving: stopping the other replicas and exiting 1"))
        for replica in replicas:  # drain the replicas while the router finishes what it forwards
            replica.signal(signal.SIGTERM)

        def overdue() -> None:
            logger.warning("%d requests still in flight %.0f s after the replicas were stopped: ending them",
                           app.end_in_flight(), shutdown_s + DRAIN_ABORT_GRACE_S)

        deadline = loop.call_later(shutdown_s + DRAIN_ABORT_GRACE_S, overdue)
        try:
            await runner.cleanup()
        finally:
            deadline.cancel()
        runner = None
        await _stop_replicas(replicas, shutdown_s + EXIT_GRACE_S)
        if dead:
            return 1
        codes = {r.plan.index: r.process.returncode for r in replicas}
        bad = unexpected_exits(codes, stopped_at_once=signals > 1)
        if bad:
            logger.error("replicas exited with codes %s", bad)
            return 1
        if signals > 1:
            logger.info("stopped at once: replicas exited with codes %s", codes)
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()
        await _stop_replicas(replicas, shutdown_s + EXIT_GRACE_S)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_data_parallel(ns: argparse.Namespace) -> int:
    """`kvserve serve` with --data-parallel-size > 1; `ns.serve_args` holds the command's flags (after
    `serve`). Returns the exit code."""

    serve_args = getattr(ns, "serve_args", None)
    if serve_args is None:
        raise ValueError("--data-parallel-size > 1 needs the command line (run it as `kvserve serve`)")
    try:
        check_data_parallel_flags(ns)
    except ValueError as e:
        print(f"kvserve serve: error: {e}", file=sys.stderr)
        return 2
    # The public port first, listening: a busy one fails now, no other process can take it meanwhile, and
    # the replicas' ports are then chosen among the others.
    try:
        sock = bind_listening(ns.host, ns.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", ns.host, ns.port, e)
        return 1
    try:
        try:
            plans = plan_replicas(ns, taken_ports={int(sock.getsockname()[1])})
        except ValueError as e:
            print(f"kvserve serve: error: {e}", file=sys.stderr)
            return 2
        import prometheus_client

        prometheus_client.disable_created_metrics()  # the router's series, as `kvserve route`
        logger.info("starting %d data-parallel replicas: %s", len(plans), "; ".join(p.describe() for p in plans))
        return asyncio.run(serve_replicas(ns, plans, serve_args, sock))
    finally:
        sock.close()
