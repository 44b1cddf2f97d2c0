"""`kvserve serve --data-parallel-size N` (`-dp N`): N replicas of the server behind one port.

This process starts N child `kvserve serve` processes with the command's own flags less --data-parallel-size,
--host and --port, each listening on 127.0.0.1 at a free port of its own and, on CUDA, on GPUs of its own:
replica i gets GPUs [i * TP, (i + 1) * TP) of those visible to this process (CUDA_VISIBLE_DEVICES, else all),
TP being --tensor-parallel-size. With device cpu the N replicas share the cores. Each child's output comes
out of this process's stderr, each line prefixed `(replica i)`.

* Start-up: the public --host/--port is bound at once (a busy port fails fast) but accepts connections only
  once every replica answers /health 200; then the router (`kvserve.router.app`, prefix policy) serves it
  from this process. A replica that exits during start-up stops the others, and the command exits with that
  replica's exit code (its last lines of output repeated in the error).
* Serving: the router forwards each request to a healthy replica (prompts that start alike to the same one,
  for its prefix cache), with the Authorization header, so replicas given --api-key check it. /metrics
  holds every replica's series labelled engine="<i>", and the router's own.
* A replica that exits while serving stops the whole server: the others are stopped and this process exits
  1, as one server does when its engine dies (an orchestrator restarts it whole). Between a replica's engine
  dying and its process exiting (about a second), the router's health checks and its retry on 503 keep
  requests away from it.
* SIGTERM / SIGINT: every replica drains (it gets one SIGTERM; new requests 503, in-flight ones finish
  within --shutdown-timeout), the router stops accepting and finishes its requests, and the process exits 0
  once every replica has exited 0. A second signal is passed on, so the replicas exit at once. The replicas
  run in sessions of their own, so a terminal's Ctrl-C reaches them once, through this process; on Linux
  each also gets SIGTERM if this process dies without stopping them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvserve import envs
from kvserve.router.app import RouterApp
from kvserve.router.policies import Router

logger = logging.getLogger("kvserve.data_parallel")

LOCAL_HOST = "127.0.0.1"
# Flags of the command that the replicas do not get (each listens where this process tells it), with
# whether they take a value.
_PARENT_ONLY_FLAGS = {"--data-parallel-size": True, "-dp": True, "--host": True, "--port": True}
HEALTH_POLL_S = 0.5
ROUTER_HEALTH_CHECK_INTERVAL_S = 2.0
# Lines of each replica's output kept to repeat when it fails.
TAIL_LINES = 40
# After --shutdown-timeout, how long replicas get to exit before they are killed.
EXIT_GRACE_S = 15.0


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
    """A replica's `kvserve serve` flags: the command's (`serve_args`, those after `serve`) less
    --data-parallel-size / -dp, --host and --port (as `--flag value`, `--flag=value`, or a long flag's
    unambiguous abbreviation, which argparse accepted), plus --host 127.0.0.1 --port `port`."""
    out: list[str] = []
    skip_value = False
    for i, arg in enumerate(serve_args):
        if skip_value:
            skip_value = False
            continue
        if arg == "--":  # the rest is positional
            out.extend(serve_args[i:])
            break
        name, has_value = arg.split("=", 1)[0], "=" in arg
        flag = _parent_only_flag(name)
        if flag is None:
            out.append(arg)
        elif _PARENT_ONLY_FLAGS[flag] and not has_value:
            skip_value = True
    return [*out, "--host", LOCAL_HOST, "--port", str(port)]


def _parent_only_flag(name: str) -> str | None:
    if name in _PARENT_ONLY_FLAGS:
        return name
    if name.startswith("--") and len(name) > 3:  # an abbreviation argparse took for the one flag it begins
        matches = [flag for flag in _PARENT_ONLY_FLAGS if flag.startswith("--") and flag.startswith(name)]
        if len(matches) == 1:
            return matches[0]
    return None


def check_data_parallel_flags(ns: argparse.Namespace) -> None:
    """ValueError for flags the replicas behind one router cannot serve."""
    if ns.ssl_certfile or ns.ssl_keyfile:
        raise ValueError("--ssl-certfile / --ssl-keyfile with --data-parallel-size > 1 are not supported: serve "
                         "HTTP and terminate TLS in front (nginx, a load balancer)")
    if ns.device not in (None, "cpu", "cuda"):
        raise ValueError(f"with --data-parallel-size > 1, --device is cpu or cuda (each replica takes its own "
                         f"GPUs), got {ns.device!r}")


# ----------------------------------------------------------------------------------------- replicas


@dataclass
class ReplicaPlan:
    index: int
    port: int
    gpus: list[str] | None  # CUDA_VISIBLE_DEVICES entries; None on CPU

    def describe(self) -> str:
        where = f"GPU {','.join(self.gpus)}" if self.gpus is not None else "CPU"
        return f"replica {self.index} on {where} at http://{LOCAL_HOST}:{self.port}"


@dataclass
class Replica:
    plan: ReplicaPlan
    process: asyncio.subprocess.Process
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    output_done: asyncio.Task[None] | None = None
    exit_wait: asyncio.Task[int] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOCAL_HOST}:{self.plan.port}"

    def signal(self, sig: int) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def failure(self, code: int, what: str) -> str:
        """'<replica> exited with code <code> <what>', then its last lines of output."""
        last = "".join(self.tail).rstrip()
        return (f"{self.plan.describe()} (pid {self.process.pid}) exited with code {code} {what}"
                + (f"; its last output:\n{last}" if last else ""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL_HOST, 0))
        return int(s.getsockname()[1])


def plan_replicas(ns: argparse.Namespace) -> list[ReplicaPlan]:
    """Each replica's port and GPUs (ValueError when the GPUs do not suffice)."""
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
        ports.add(_free_port())
    return [ReplicaPlan(i, port, gpus) for i, (port, gpus) in enumerate(zip(sorted(ports), groups, strict=True))]


def _die_with_parent() -> Callable[[], None] | None:
    """What the child runs before exec (Linux): ask for SIGTERM when this process dies, so no replica
    outlives it. libc is loaded here, in the parent: the forked child should only make the call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def in_child() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return in_child


async def _start(plan: ReplicaPlan, serve_args: Sequence[str]) -> Replica:
    env = dict(os.environ)
    if plan.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(plan.gpus)
    command = [sys.executable, "-m", "kvserve", "serve", *replica_args(serve_args, plan.port)]
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=env, start_new_session=True, preexec_fn=_die_with_parent())
    replica = Replica(plan, process)
    replica.output_done = asyncio.create_task(_relay_output(replica))
    replica.exit_wait = asyncio.create_task(process.wait())
    logger.info("started %s (pid %d)", plan.describe(), process.pid)
    return replica


async def _relay_output(replica: Replica) -> None:
    """Copy the replica's output to this process's stderr, line by line, prefixed; keep its last lines."""
    assert replica.process.stdout is not None
    prefix = f"(replica {replica.plan.index}) "
    while True:
        try:
            line = await replica.process.stdout.readline()
        except ValueError:  # a line longer than the stream's limit: the rest of it comes next
            continue
        if not line:
            return
        text = line.decode(errors="replace")
        replica.tail.append(text)
        sys.stderr.write(prefix + text)
        sys.stderr.flush()


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
    """SIGTERM each (they drain), wait, SIGKILL any still running; their output is relayed to the end."""
    for replica in replicas:
        replica.signal(signal.SIGTERM)
    waits = [r.exit_wait for r in replicas if r.exit_wait is not None]
    if waits:
        _, running = await asyncio.wait(waits, timeout=timeout_s)
        if running:
            for replica in replicas:
                if replica.process.returncode is None:
                    logger.warning("replica %d did not stop within %.0f s: killing it", replica.plan.index,
                                   timeout_s)
                    replica.signal(signal.SIGKILL)
            await asyncio.wait(running, timeout=5.0)
    outputs = [r.output_done for r in replicas if r.output_done is not None]
    if outputs:
        await asyncio.wait(outputs, timeout=5.0)


async def _served_name(replica: Replica, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
            async with session.get(replica.url + "/v1/models", headers=headers) as response:
                return str((await response.json())["data"][0]["id"])
    return None


async def _serve(ns: argparse.Namespace, plans: Sequence[ReplicaPlan], serve_args: Sequence[str],
                 sock: socket.socket) -> int:
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
            replicas.append(await _start(plan, serve_args))
        failed = await _wait_ready(replicas, stop)
        if failed is not None:
            code = await failed.process.wait()
            logger.error("%s", failed.failure(code, "during start-up"))
            return code or 1
        if stop.is_set():
            return 0
        app = RouterApp(Router([r.url for r in replicas], "prefix"), ROUTER_HEALTH_CHECK_INTERVAL_S,
                        engine_metrics=True)
        runner = web.AppRunner(app.make_app(), handle_signals=False, access_log=None, handler_cancellation=True,
                               shutdown_timeout=shutdown_s)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        host, port = sock.getsockname()[:2]
        api_key = ns.api_key or envs.KVSERVE_API_KEY or envs.VLLM_API_KEY or None
        name = await _served_name(replicas[0], api_key) or "the model"
        local = " (this machine only; --host 0.0.0.0 to accept others)" if ns.host == LOCAL_HOST else ""
        logger.info("serving %s on http://%s:%d%s (OpenAI API under /v1) from %d data-parallel replicas: %s",
                    name, host, port, local, len(replicas), "; ".join(r.plan.describe() for r in replicas))
        exits = {r.exit_wait: r for r in replicas if r.exit_wait is not None}
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopping, *exits], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        dead = [exits[task] for task in done if task in exits]
        if dead:
            replica = dead[0]
            logger.error("%s", replica.failure(await replica.process.wait(),
                                               "while serving: stopping the other replicas and exiting 1"))
        for replica in replicas:  # drain the replicas while the router finishes what it forwards
            replica.signal(signal.SIGTERM)
        await runner.cleanup()
        runner = None
        await _stop_replicas(replicas, shutdown_s + EXIT_GRACE_S)
        if dead:
            return 1
        codes = {r.plan.index: r.process.returncode for r in replicas}
        bad = {i: c for i, c in codes.items() if c != 0}
        if bad:
            logger.error("replicas exited with codes %s", bad)
            return 1
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()
        await _stop_replicas(replicas, shutdown_s + EXIT_GRACE_S)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _bind_unlistened(host: str, port: int) -> socket.socket:
    """The public socket, bound (so a busy port fails now) but not listening: connections are refused until
    every replica is ready and the router starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


def run_data_parallel(ns: argparse.Namespace) -> int:
    """`kvserve serve` with --data-parallel-size > 1; `ns.serve_args` holds the command's flags (after
    `serve`). Returns the exit code."""
    serve_args = getattr(ns, "serve_args", None)
    if serve_args is None:
        raise ValueError("--data-parallel-size > 1 needs the command line (run it as `kvserve serve`)")
    try:
        check_data_parallel_flags(ns)
        plans = plan_replicas(ns)
    except ValueError as e:
        print(f"kvserve serve: error: {e}", file=sys.stderr)
        return 2
    try:
        sock = _bind_unlistened(ns.host, ns.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", ns.host, ns.port, e)
        return 1
    import prometheus_client

    prometheus_client.disable_created_metrics()  # the router's series, as `kvserve route`
    logger.info("starting %d data-parallel replicas: %s", len(plans), "; ".join(p.describe() for p in plans))
    try:
        return asyncio.run(_serve(ns, plans, serve_args, sock))
    finally:
        sock.close()
