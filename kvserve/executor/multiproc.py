"""Tensor-parallel ranks 1..N-1: one process each, running rank 0's `ModelRunner` calls in lockstep.

Rank 0 is the engine core's own runner. `TPWorkers` starts the other ranks (spawned, one device each:
CUDA_VISIBLE_DEVICES names the rank's GPU), joins the process group with them, and then mirrors every call
the engine makes on its runner:

* start-up calls (`call` then `gather`): each rank runs the same method with the same arguments while
  rank 0 runs its own, since their forwards meet in the all-reduces; `gather` returns the ranks' results
  (the KV cache gets the smallest block count any rank can hold);
* steps (`step`): the scheduler's output goes to every rank, which launches the same forward and samples
  the same tokens as rank 0 (the ranks' logits are identical). Only rank 0's tokens reach the scheduler;
  each rank feeds its own sampled ids to its next step's placeholder inputs (async scheduling). Each rank
  records its sampled tokens in its request states at the point rank 0 does (before the next launch when
  the engine waited for them, after it otherwise), so that penalties, which read those records, see the
  same tokens on every rank. A step whose grammar masks need the previous step's tokens comes in two
  messages (`step` with masks_follow, then `send_masks`): the ranks launch its forward, record the previous
  step's tokens, and sample once the masks arrive, as rank 0 does.

A rank that fails or exits ends the engine: the rank logs its error and exits, and rank 0's monitor thread
logs which rank it was and exits the engine process (the server then reports the engine's death), unless
rank 0's step under way fails on it first (gloo's collectives do at once): a step that fails on rank 0 once
the other ranks have it ends the engine without ending the process (`EngineCore._lockstep`: the other ranks
may wait in a collective rank 0 will never join, so `close(kill=True)` stops them at once, and the engine
raises EngineDeadError from then on). During
start-up the engine raises instead (`WorkerError`, with the rank's reason) when rank 0 reaches its next
`gather` within the monitor's grace; the grace does not run while rank 0 builds its model and waits for
the others' builds (`local_phase`: no collective there), however long that takes. A rank
whose parent is gone exits by itself, so nothing is left holding a GPU. The ranks ignore SIGINT and
SIGTERM, as the engine does: they stop when the engine does.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from kvserve import distributed
from kvserve.config import EngineConfig
from kvserve.core.outputs import SchedulerOutput

logger = logging.getLogger(__name__)

# How often a rank checks that its parent (the engine core) is still there.
_PARENT_POLL_S = 1.0
# How long `close` waits for the ranks to exit before killing them.
_CLOSE_TIMEOUT_S = 10.0


class WorkerError(RuntimeError):
    """A tensor-parallel rank failed a start-up call (the message holds its traceback)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_visible_device(rank: int) -> str:
    """CUDA_VISIBLE_DEVICES for `rank`: its entry of the engine's own list, or its index."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if rank >= len(entries):
            raise ValueError(f"tensor-parallel rank {rank} has no GPU: CUDA_VISIBLE_DEVICES={visible!r}")
        return entries[rank]
    return str(rank)


def set_cpu_threads(tp_size: int) -> int:
    """On CPU, share the cores between the ranks instead of each using them all; returns the previous
    thread count."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    return previous


# A failed rank's exit during start-up is reported by `gather` (its error reply, or the closed pipe); the
# monitor ends the process only if rank 0 has not seen it within this long (it may be blocked in a
# collective that the dead rank will never join). While rank 0 is in a `local_phase` (work that meets no
# other rank: building its model, however long a large model takes) the grace is paused.
_STARTUP_FAILURE_GRACE_S = 10.0
# How often the monitor looks at whether rank 0 is in a local phase while a dead rank waits to be reported.
_LOCAL_PHASE_POLL_S = 0.2
# After start-up, how long the monitor waits for rank 0, in the part of a step the ranks run together, to fail
# it on a dead rank (and stop the ranks: `EngineCore._lockstep`) before it ends the process itself.
_STEP_FAILURE_GRACE_S = 2.0
# How often the monitor looks at whether rank 0 is still in that part meanwhile.
_STEP_POLL_S = 0.05


class TPWorkers:
    """Ranks 1..tensor_parallel_size - 1 of `config`'s engine. Constructing it also makes this process rank
    0 of the group (it returns once every rank has joined); each rank then builds its model, and `gather`
    returns once they have (rank 0 builds its own meanwhile). `close()` stops them; so does this process's
    exit, or the object's collection."""

    def __init__(self, config: EngineConfig) -> None:
        import torch

        if distributed.tp_size() > 1:
            raise RuntimeError("another tensor-parallel engine is still running in this process: call its "
                               "shutdown() (LLM.shutdown) before starting a new one")
        self.size = config.tensor_parallel_size
        self._started = False
        self._failure_seen = threading.Event()
        self._conns: list[Connection] = []
        self._processes: list[Any] = []
        self._previous_threads: int | None = None
        # Set once the ranks are being stopped on purpose (their exits are then no failure).
        self._stopping = threading.Event()
        # Whether rank 0 runs the part of a step the other ranks run too (set by `EngineCore._lockstep`), where a
        # rank's exit makes it fail the step (and stop the ranks) rather than wait: see `_watch`.
        self.in_step = False
        # Stops the ranks at interpreter exit without close(): registered after multiprocessing's own exit
        # handler, so it runs first (that handler would wait for them forever: they ignore its SIGTERM).
        self._finalizer = weakref.finalize(self, _stop_ranks, self._conns, self._processes, self._stopping)
        atexit.register(self._finalizer)
        device = torch.device(config.device_config.device)
        try:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            context = multiprocessing.get_context("spawn")
            for rank in range(1, self.size):
                parent_end, child_end = context.Pipe()
                visible = rank_visible_device(rank) if device.type == "cuda" else None
                process = context.Process(
                    target=_worker_main,
                    args=(config, rank, init_method, child_end, visible, os.getpid()),
                    name=f"kvserve-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                child_end.close()
                self._conns.append(parent_end)
                self._processes.append(process)
            self._monitor = threading.Thread(target=self._watch, name="kvserve-tp-monitor", daemon=True)
            self._monitor.start()
            if device.type == "cpu":
                self._previous_threads = set_cpu_threads(self.size)
            distributed.init_tensor_parallel(0, self.size, init_method, device)
        except BaseException:
            self.close()
            raise
        where = (f"GPUs {', '.join(rank_visible_device(r) for r in range(self.size))}" if device.type == "cuda"
                 else "CPU processes")
        logger.info("tensor parallelism: %d ranks (%s; ranks 1-%d are pids %s)", self.size, where, self.size - 1,
                    ", ".join(str(p.pid) for p in self._processes))

    @contextlib.contextmanager
    def local_phase(self) -> Iterator[None]:
        """Rank 0 does start-up work that meets no other rank (no collective), such as building its model: a
        rank that exits meanwhile is reported by the `gather` that follows, however long the work takes,
        instead of ending this process after the monitor's grace. Only around code without collectives (one
        that waited for a dead rank would hang): `distributed.all_reduce` / `all_gather` raise inside it. Not
        nested."""
        with distributed.no_collectives():
            yield

    def mark_started(self) -> None:
        """Start-up is over: from now on a rank's exit ends this process (the engine cannot go on)."""
        self._started = True

    # ------------------------------------------------------------------ calls

    def _send(self, message: tuple[Any, ...]) -> None:
        """Send `message` to every other rank, pickled once."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            conn.send_bytes(data)

    def call(self, method: str, *args: Any) -> None:
        """Start `method(*args)` on every other rank; `gather` collects the results."""
        self._send(("call", method, args))

    def gather(self) -> list[Any]:
        """Each other rank's reply to the last `call` (or to its start-up), in rank order. Replies are read as
        they come, so a rank that failed or exited is reported at once, whichever rank it is (a live rank
        still working does not hold up the report)."""
        ranks = {conn: rank for rank, conn in enumerate(self._conns, start=1)}
        results: dict[int, Any] = {}
        while len(results) < len(ranks):
            for conn in wait([c for c, r in ranks.items() if r not in results]):
                rank = ranks[conn]  # type: ignore[index]
                try:
                    status, value = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    self._failure_seen.set()
                    raise WorkerError(f"tensor-parallel rank {rank} exited") from None
                if status != "ok":
                    self._failure_seen.set()
                    raise WorkerError(f"tensor-parallel rank {rank} failed:\n{value}")
                results[rank] = value
        return [results[rank] for rank in sorted(results)]

    def step(self, scheduler_output: SchedulerOutput, finish_previous_first: bool, masks_follow: bool = False) -> None:
        """Send one step to every other rank (no reply). finish_previous_first: rank 0 read the previous
        step's tokens before launching this one. masks_follow: the step's grammar masks come after, by
        `send_masks`: the ranks launch the forward, record the previous step's tokens, then wait for them
        to sample."""
        # The scheduler's own request objects stay here (the runner never reads them).
        self._send(("step", dataclasses.replace(scheduler_output, requests={}), finish_previous_first, masks_follow))

    def send_masks(self, grammar_bitmask: dict[str, bytes]) -> None:
        """The grammar masks of the step sent last with masks_follow."""
        self._send(("masks", grammar_bitmask))

    # ------------------------------------------------------------------ life

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes, start=1)}
        ready = wait(list(sentinels))
        if self._stopping.is_set():
            return
        rank = sentinels[ready[0]]  # type: ignore[index]
        process = self._processes[rank - 1]
        process.join(timeout=1.0)  # reaped, so that its exit code is known
        code = process.exitcode
        if not self._started:
            # Start-up raises WorkerError with the rank's reason once rank 0 reaches a gather; give it the grace
            # to get there, counted only while it is outside a local phase.
            deadline: float | None = None
            while not (self._failure_seen.is_set() or self._stopping.is_set()):
                if distributed.collectives_forbidden():  # rank 0 is in a local phase
                    deadline = None
                elif deadline is None:
                    deadline = time.monotonic() + _STARTUP_FAILURE_GRACE_S
                elif time.monotonic() >= deadline:
                    break
                self._failure_seen.wait(_LOCAL_PHASE_POLL_S)
            if self._failure_seen.is_set():
                return
        else:
            # Rank 0 may be in a step's part that the ranks run together, which then fails too (gloo's collectives
            # raise once a peer is gone; a failure every rank shares is rank 0's own): it raises the error to its
            # caller and stops the ranks, and this process goes on (an offline LLM's is the user's). Wait for
            # that while rank 0 is there, within the grace; a rank 0 elsewhere (idle, or blocked waiting for the
            # GPU: NCCL waits for a dead peer forever) is ended at once.
            deadline = time.monotonic() + _STEP_FAILURE_GRACE_S
            while self.in_step and time.monotonic() < deadline:
                if self._stopping.wait(_STEP_POLL_S):
                    return
        if self._stopping.is_set():
            return
        logger.critical("tensor-parallel rank %d exited (code %s); the engine cannot continue without it and "
                        "exits", rank, code)
        logging.shutdown()
        os._exit(1)

    def exited(self) -> list[str]:
        """The ranks that have exited, as "rank R (code C)"."""
        return [f"rank {rank} (code {p.exitcode})" for rank, p in enumerate(self._processes, start=1)
                if p.exitcode is not None]

    def close(self, kill: bool = False) -> None:
        """Stop the other ranks and leave the group. kill: at once (SIGKILL), without asking them to stop and
        waiting: for ranks that may be blocked in a collective rank 0 will never join (a failed step), which
        would read no stop message."""
        if self._stopping.is_set():
            return
        if kill:
            self._stopping.set()  # before the kills: their exits are no failure for the monitor
            for process in self._processes:
                if process.is_alive():
                    process.kill()
        self._finalizer()
        atexit.unregister(self._finalizer)
        distributed.destroy_tensor_parallel()
        if self._previous_threads is not None:
            import torch

            torch.set_num_threads(self._previous_threads)


def _stop_ranks(conns: list[Connection], processes: list[Any], stopping: threading.Event) -> None:
    stopping.set()
    stop = pickle.dumps(("stop",))
    for conn in conns:
        try:
            conn.send_bytes(stop)
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + _CLOSE_TIMEOUT_S
    for process in processes:
        process.join(timeout=max(deadline - time.monotonic(), 0.1))
        if process.is_alive():
            process.kill()
            process.join(timeout=1.0)
    for conn in conns:
        conn.close()


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def _worker_main(
    config: EngineConfig, rank: int, init_method: str, conn: Connection, visible: str | None, parent_pid: int
) -> None:
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before CUDA starts in this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(name)s: %(message)s")

    import torch

    from kvserve.worker.model_runner import ModelRunner, PendingOutput

    try:
        device = torch.device(config.device_config.device)
        if device.type == "cpu":
            set_cpu_threads(config.tensor_parallel_size)
        distributed.init_tensor_parallel(rank, config.tensor_parallel_size, init_method, device)
        runner = ModelRunner(config)
    except BaseException:
        _reply_error(conn)
        sys.exit(1)
    conn.send(("ok", None))
    previous: PendingOutput | None = None  # the last launched step, its tokens not recorded yet
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        kind = message[0]
        if kind == "stop":
            break
        if kind == "call":
            _, method, args = message
            try:
                result = getattr(runner, method)(*args)
            except BaseException:
                _reply_error(conn)
                sys.exit(1)
            try:
                conn.send(("ok", result))
            except (pickle.PicklingError, TypeError, AttributeError):  # a result that cannot travel: dropped
                conn.send(("ok", None))
            continue
        _, scheduler_output, finish_previous_first, masks_follow = message
        try:
            if finish_previous_first and previous is not None:
                previous.result()
                previous = None
            if masks_follow:
                forward = runner.launch_forward(scheduler_output)
                if previous is not None:
                    previous.result()
                try:
                    follow = pickle.loads(conn.recv_bytes())
                except EOFError:
                    break
                if follow[0] == "stop":  # rank 0 failed before the masks (and is shutting down)
                    break
                assert follow[0] == "masks", f"a step's grammar masks expected, got {follow[0]!r}"
                launched = runner.sample(forward, follow[1])
            else:
                launched = runner.execute_model_async(scheduler_output)
                if previous is not None:
                    previous.result()
            previous = launched
        except BaseException:
            logger.critical("tensor-parallel rank %d failed a step:\n%s", rank, traceback.format_exc())
            logging.shutdown()
            os._exit(1)
    distributed.destroy_tensor_parallel()


def _reply_error(conn: Connection) -> None:
    text = traceback.format_exc()
    logger.error("%s", text)
    try:
        conn.send(("error", text))
    except (BrokenPipeError, OSError):
        pass
