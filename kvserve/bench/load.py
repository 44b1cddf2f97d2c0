"""Load shapes: issue a run's requests closed loop (N workers) or open loop (timed arrivals), bounded.

`run_load(shape, dataset, client, ...)` returns every request's record, failures included, in completion
order. Both loops stop issuing at `num_prompts` requests, at `duration_s`, at `MAX_REQUESTS_PER_RUN`, when
the first `ABORT_AFTER_ALL_FAILED` requests all failed, when `ABORT_AFTER_CONNECTION_FAILURES` requests in a
row could not connect (the server went away mid-run), or when `stop` is set. Requests in flight then
finish, each bounded by the client's request timeout; with a duration, those still running
`drain_timeout_s` after it (and all of them once `stop` is set) are cancelled and recorded as `cancelled`.
So a run always ends, and no request it sent, nor any open-loop arrival it did not send yet, is missing
from its records.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.bench.client import ERROR_CANCELLED, ERROR_CONNECTION, RequestRecord, StreamClient
from kvserve.bench.config import ABORT_AFTER_ALL_FAILED, ABORT_AFTER_CONNECTION_FAILURES, LoadShape
from kvserve.bench.datasets import BenchRequest, Requests


def arrival_gaps(rate: float, burstiness: float, rng: np.random.Generator, batch: int = 1024
                 ) -> Iterator[float]:
    """Inter-arrival gaps in seconds: gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate,
    coefficient of variation 1/sqrt(burstiness) (burstiness 1 = exponential gaps = a Poisson process).
    An infinite rate gives gaps of 0. Endless: the caller bounds it."""
    if math.isinf(rate):
        while True:
            yield 0.0
    scale = 1.0 / (rate * burstiness)
    while True:
        yield from rng.gamma(burstiness, scale, size=batch).tolist()


@dataclass
class LoadResult:
    """A run's records and its clock: `run_start` is the perf_counter origin of every record's times.
    `stopped` says why the run ended early (all requests failing, drain timeout, interrupt), if it did."""

    records: list[RequestRecord]
    run_start: float
    stopped: str | None = None


class _Run:
    """State shared by the tasks of one run: which index is next, the bounds, the finished records."""

    def __init__(self, shape: LoadShape, run_start: float, on_done: Callable[[RequestRecord], None] | None
                 ) -> None:
        self.run_start = run_start
        self.max_requests = shape.max_requests
        self.deadline = run_start + shape.duration_s if shape.duration_s is not None else math.inf
        self.on_done = on_done
        self.next_index = 0
        self.succeeded = 0
        # Records that could not connect since a request sent after the latest such failure got through.
        # A request sent before the server went away may finish after many refused ones: it says nothing
        # about the server now, so it does not break the streak.
        self.unconnected_in_row = 0
        self.last_unconnected_start_s = -math.inf
        self.records: list[RequestRecord] = []
        self.stopped: str | None = None
        self.tasks: set[asyncio.Task[Any]] = set()

    def take(self) -> int | None:
        if self.stopped or self.next_index >= self.max_requests or time.perf_counter() >= self.deadline:
            return None
        index = self.next_index
        self.next_index += 1
        return index

    def finished(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.succeeded += record.success
        if record.error_kind == ERROR_CONNECTION:
            self.unconnected_in_row += 1
            self.last_unconnected_start_s = max(self.last_unconnected_start_s, record.start_s)
        elif record.start_s > self.last_unconnected_start_s:
            self.unconnected_in_row = 0
        if self.succeeded == 0 and len(self.records) >= ABORT_AFTER_ALL_FAILED and not self.stopped:
            self.stopped = (f"stopped early: the first {len(self.records)} requests all failed "
                            f"(last error: {record.error_kind}: {record.error})")
        elif self.unconnected_in_row >= ABORT_AFTER_CONNECTION_FAILURES and not self.stopped:
            self.stopped = (f"stopped early: {self.unconnected_in_row} requests in a row could not connect to the "
                            f"server (last error: {record.error})")
        if self.on_done is not None:
            self.on_done(record)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def stop(self, reason: str) -> None:
        """Issue nothing more and cancel everything in flight (each cancelled request is recorded)."""
        if not self.stopped:
            self.stopped = reason
        for task in list(self.tasks):
            task.cancel()


async def _send(run: _Run, client: StreamClient, request: BenchRequest, record: RequestRecord) -> bool:
    """Send one request and record it; False when it was cancelled (the caller stops)."""
    try:
        await client.send(request, run.run_start, record)
    except asyncio.CancelledError:
        run.finished(record)  # marked cancelled by the client
        return False
    run.finished(record)
    return True


async def run_load(
    shape: LoadShape,
    dataset: Requests,
    client: StreamClient,
    *,
    warmup: bool = False,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
    run_start: float | None = None,
    drain_timeout_s: float | None = None,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """Run one load shape to completion. `on_done` is called with each finished record (progress bar);
    `run_start` (a perf_counter time, default now) is the origin of the records' times; `drain_timeout_s`
    bounds how long requests may run past `duration_s` (None: only the request timeout); setting `stop`
    ends the run now."""
    run = _Run(shape, time.perf_counter() if run_start is None else run_start, on_done)
    if shape.closed_loop:
        assert shape.concurrency is not None
        issuing = [run.spawn(_worker(run, dataset, client, warmup)) for _ in range(shape.concurrency)]
    else:
        assert shape.request_rate is not None
        gaps = arrival_gaps(shape.request_rate, shape.burstiness, np.random.default_rng([seed, 7]))
        issuing = [run.spawn(_arrivals(run, shape, gaps, dataset, client, warmup))]
    watchdog = asyncio.get_running_loop().create_task(_watchdog(run, drain_timeout_s, stop))
    try:
        # The open loop adds request tasks while it runs: wait until none is left. A task cancelled before
        # it started ends as cancelled without running (it had sent nothing); any other exception is a bug.
        while run.tasks:
            for outcome in await asyncio.gather(*run.tasks, *issuing, return_exceptions=True):
                if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                    raise outcome
    finally:
        watchdog.cancel()
        try:
            await watchdog
        except asyncio.CancelledError:
            pass
    return LoadResult(run.records, run.run_start, run.stopped)


async def _watchdog(run: _Run, drain_timeout_s: float | None, stop: asyncio.Event | None) -> None:
    """Ends the run at the end of the drain window, or when `stop` is set, whichever comes first."""
    timeout = None
    if drain_timeout_s is not None and math.isfinite(run.deadline):
        timeout = max(0.0, run.deadline + drain_timeout_s - time.perf_counter())
    event = stop if stop is not None else asyncio.Event()
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        if run.tasks:
            run.stop(f"requests still running {drain_timeout_s:g} s after the end of the run were cancelled "
                     f"(--drain-timeout)")
        return
    run.stop("interrupted: requests in flight were cancelled")


async def _worker(run: _Run, dataset: Requests, client: StreamClient, warmup: bool) -> None:
    while (index := run.take()) is not None:
        request = dataset.get(index, warmup)
        record = RequestRecord(index, request.max_tokens, request.input_tokens)
        if not await _send(run, client, request, record):
            return


def _unsent(run: _Run, record: RequestRecord, message: str) -> None:
    """Record an arrival cancelled before it was sent: it arrived, so it counts (as cancelled), and so does its
    wait for a slot, until the cancellation (0 would hide the longest waits of an overloaded run)."""
    record.fail(ERROR_CANCELLED, message)
    record.start_s = time.perf_counter() - run.run_start
    if record.scheduled_s is not None:
        record.queued_s = max(0.0, record.start_s - record.scheduled_s)
    record.e2e_s = 0.0
    run.finished(record)


async def _arrivals(run: _Run, shape: LoadShape, gaps: Iterator[float], dataset: Requests, client: StreamClient,
                    warmup: bool) -> None:
    slots = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency is not None else None

    async def one(request: BenchRequest, record: RequestRecord, scheduled_at: float) -> None:
        try:
            if slots is not None:
                await slots.acquire()
        except asyncio.CancelledError:
            _unsent(run, record, "cancelled before it got a concurrency slot")
            return
        try:
            record.queued_s = max(0.0, time.perf_counter() - scheduled_at)
            await _send(run, client, request, record)
        finally:
            if slots is not None:
                slots.release()

    def unstarted(record: RequestRecord, task: asyncio.Task[None]) -> None:
        # A task cancelled before it first ran (a stop right after a burst of arrivals) never reached the
        # handlers in `one`; every other ending has recorded the arrival already.
        if task.cancelled() and record.e2e_s is None:
            _unsent(run, record, "cancelled before it was sent")

    def arrive(index: int, scheduled_at: float) -> None:
        request = dataset.get(index, warmup)
        record = RequestRecord(index, request.max_tokens, request.input_tokens,
                               scheduled_s=scheduled_at - run.run_start)
        run.spawn(one(request, record, scheduled_at)).add_done_callback(functools.partial(unstarted, record))

    scheduled = run.run_start
    try:
        for gap in gaps:
            scheduled += gap
            if scheduled >= run.deadline:
                return
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            index = run.take()
            if index is None:
                return
            arrive(index, scheduled)
    except asyncio.CancelledError:
        return  # stopped while waiting for the next arrival
