"""Property test: random add / step / abort sequences under a small KV pool and small budgets.

Steps run synchronously or, as the engine core does with async scheduling, pipelined: step n+1 is
scheduled and executed before step n's output reaches the scheduler.

After every operation the scheduler's invariants hold (the block pool's checked incrementally, then in full: the
incremental check finds no fault the full walk does not) and the fake runner finds the KV cache it simulates
consistent with every SchedulerOutput (prefix hits, preemption and chunking included). At the end the
scheduler drains within a bound of steps (no livelock), no block leaks, the runner is told about every
finished request, every request finishes exactly once and its outputs obey the stop rules.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.core.request import Request
from kvserve.core.scheduler import RequestRejected, Scheduler
from kvserve.protocol.sampling_params import SamplingParams
from tests.unit.fake_runner import FakeModelRunner, check_limits

EOS = 0
STOP = 3
# Shared prefixes so that prefix hits happen; prompt suffixes and sampled tokens come from 1..4.
PREFIXES = [[100 * (k + 1) + i for i in range(16)] for k in range(3)]


@dataclass(frozen=True)
class Add:
    prefix: int
    prefix_len: int
    suffix: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    use_stop_token: bool
    salt: str | None
    num_samples: int  # > 1: siblings sharing a group key
    priority: int  # used under the priority policy (0 otherwise)


@dataclass(frozen=True)
class Step:
    pass


@dataclass(frozen=True)
class Abort:
    index: int  # into the ids added so far (finished ones included: aborting them is a no-op)


@dataclass(frozen=True)
class Setup:
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    async_scheduling: bool
    priority_policy: bool


adds = st.builds(
    Add,
    prefix=st.integers(0, len(PREFIXES) - 1),
    prefix_len=st.integers(0, 12),
    suffix=st.lists(st.integers(1, 4), max_size=5).map(tuple),
    max_tokens=st.integers(1, 16),
    min_tokens=st.integers(0, 2),
    ignore_eos=st.booleans(),
    use_stop_token=st.booleans(),
    salt=st.sampled_from([None, None, "s"]),
    num_samples=st.sampled_from([1, 1, 1, 2, 3]),
    priority=st.integers(-2, 2),
)
steps = st.just(Step())
aborts = st.builds(Abort, st.integers(0, 50))
# Adds and steps dominate; a few aborts. The leading adds give every example some traffic.
ops = st.tuples(
    st.lists(adds, min_size=1, max_size=6),
    st.lists(
        st.one_of(adds, adds, steps, steps, steps, aborts),
        min_size=4,
        max_size=50,
    ),
).map(lambda pair: pair[0] + pair[1])


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    block_size = draw(st.sampled_from([1, 2, 4]))
    pool_tokens = draw(st.integers(12, 32))  # some requests need more than the pool: rejected
    max_model_len = draw(st.integers(12, 40))
    chunked = draw(st.booleans())
    if chunked:
        budget = draw(st.integers(1, 24))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 8))
    return Setup(
        block_size=block_size,
        num_blocks=-(-pool_tokens // block_size),
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 6)),
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        priority_policy=draw(st.booleans()),
    )


@dataclass
class Tracker:
    """What the test knows independently of the scheduler."""

    requests: dict[str, Request] = field(default_factory=dict)
    emitted: dict[str, list[int]] = field(default_factory=dict)
    finishes: dict[str, list[str]] = field(default_factory=dict)

    def live(self) -> list[str]:
        return [r for r in self.requests if not self.finishes[r]]


def _is_stop(request: Request, token_id: int) -> bool:
    params = request.sampling_params
    return (token_id == EOS and not params.ignore_eos) or token_id in (params.stop_token_ids or ())


class Driver:
    def __init__(self, setup: Setup, seed: int, flushes: bool = True) -> None:
        self.setup = setup
        self.flushes = flushes  # call cache_scheduled_blocks after each launch, as the engine core does
        self.config = SchedulerConfig(
            max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            max_model_len=setup.max_model_len,
            enable_chunked_prefill=setup.enable_chunked_prefill,
            scheduling_policy="priority" if setup.priority_policy else "fcfs",
        )
        self.sched = Scheduler(
            self.config, setup.num_blocks, setup.block_size, enable_prefix_caching=setup.enable_prefix_caching
        )
        # The incremental check never walks the whole pool here (it would for these small pools): it looks at
        # the blocks each operation wrote only, before the full check that follows it.
        self.sched.kv.pool._full_check_due = lambda touched: False  # type: ignore[method-assign]
        rng = random.Random(seed)
        # Random tokens from 1..4, EOS one time in ten.
        self.runner = FakeModelRunner(
            setup.block_size, lambda req_id, i: EOS if rng.random() < 0.1 else rng.randint(1, 4)
        )
        self.track = Tracker()
        self.num_ids = 0
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def add(self, op: Add) -> None:
        prompt = PREFIXES[op.prefix][: op.prefix_len] + list(op.suffix) or [1]
        params = SamplingParams(
            min_tokens=min(op.min_tokens, op.max_tokens),
            ignore_eos=op.ignore_eos,
            stop_token_ids=[STOP] if op.use_stop_token else None,
        )
        group_key = f"g{self.num_ids}" if op.num_samples > 1 else None
        for _ in range(op.num_samples):
            req_id = f"r{self.num_ids}"
            self.num_ids += 1
            request = Request(
                req_id, prompt, params, eos_token_ids=(EOS,), max_tokens=op.max_tokens, cache_salt=op.salt,
                priority=op.priority if self.setup.priority_policy else 0,
            )
            if self._must_reject(len(prompt), op.max_tokens):
                try:
                    self.sched.add_request(request, group_key=group_key)
                except RequestRejected:
                    continue
                # Accepted: only legitimate if it can in fact be served.
                raise AssertionError(f"{request} accepted though it cannot fit")
            self.sched.add_request(request, group_key=group_key)
            self.track.requests[req_id] = request
            self.track.emitted[req_id] = []
            self.track.finishes[req_id] = []

    def _must_reject(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        """A request that could never be served: the prompt leaves no room under max_model_len, or the
        pool cannot hold the prompt plus one token or the longest sequence it may reach (whose last
        token is never cached)."""
        s = self.setup
        capacity = s.num_blocks * s.block_size
        longest = min(num_prompt_tokens + max_tokens, s.max_model_len)
        return (
            num_prompt_tokens >= s.max_model_len
            or num_prompt_tokens + 1 > capacity
            or longest - 1 > capacity
        )

    def step(self) -> SchedulerOutput:
        """One engine-core step (EngineCore.step's order, with the fake runner)."""
        out = self.sched.schedule()
        self.sched.check_invariants(incremental=True)
        self.sched.check_invariants()
        check_limits(out, self.config)
        runner_output = self.runner.execute(out)
        if self.flushes:
            self.sched.cache_scheduled_blocks()
        if self.in_flight is not None:
            self._deliver()
        self.in_flight = (out, runner_output)
        if not self.setup.async_scheduling or out.is_empty:
            self._deliver()
        return out

    def _deliver(self) -> None:
        assert self.in_flight is not None
        out, runner_output = self.in_flight
        self.in_flight = None
        for output in self.sched.update_from_output(out, runner_output):
            self._record(output)

    def _record(self, output: EngineCoreOutput) -> None:
        request = self.track.requests[output.req_id]
        assert not self.track.finishes[output.req_id], f"{output.req_id} produced output after finishing"
        assert output.num_cached_tokens < request.num_prompt_tokens
        assert output.num_cached_tokens % self.setup.block_size == 0
        self.track.emitted[output.req_id] += output.new_token_ids
        if output.finish_reason is not None:
            self.track.finishes[output.req_id].append(output.finish_reason)

    def check_invariants(self) -> None:
        """The scheduler's invariants, and (between steps, as EngineCore.check_invariants) that the runner holds
        exactly the requests the scheduler counts on it holding."""
        self.sched.check_invariants(incremental=True)
        self.sched.check_invariants()
        assert set(self.runner.requests) == self.sched.runner_req_ids(), (
            f"runner holds {sorted(self.runner.requests)}, scheduler counts {sorted(self.sched.runner_req_ids())}"
        )

    def abort(self, op: Abort) -> None:
        ids = list(self.track.requests)
        if not ids:
            return
        req_id = ids[op.index % len(ids)]
        was_live = not self.track.finishes[req_id]
        aborted = self.sched.abort_requests([req_id])
        assert [r.req_id for r in aborted] == ([req_id] if was_live else [])
        if was_live:
            self.track.finishes[req_id].append("abort")

    def drain(self) -> None:
        # Each step the first running request (the oldest; under the priority policy the first in (priority,
        # arrival) order; with none running, the head of the queue) computes at least one token and is never
        # preempted, since it fits the pool alone; so a request is served in at most prompt + max_tokens steps
        # once it is at the front. During the drain no request arrives, so the front only moves forward.
        live = [self.track.requests[r] for r in self.track.live()]
        bound = sum(r.num_prompt_tokens + r.max_tokens for r in live) + 1
        for _ in range(bound + 2):
            if not self.sched.has_unfinished_requests() and self.in_flight is None:
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), (
            f"not drained in {bound} steps: {self.sched.requests}"
        )
        out = self.step()  # delivers the last finished ids to the runner
        assert out.scheduled == []

    def check_final(self) -> None:
        sched, kv = self.sched, self.sched.kv
        self.check_invariants()
        assert kv.pool.num_free_blocks == kv.num_blocks, "blocks leaked"
        assert kv.req_to_blocks == {} and not sched.waiting and not sched.running
        assert self.runner.requests == {}, "the runner was not told that some requests finished"
        assert kv.stats.num_hits <= kv.stats.num_queries
        s = self.setup
        for req_id, request in self.track.requests.items():
            assert len(self.track.finishes[req_id]) == 1, f"{req_id} finished {self.track.finishes[req_id]}"
            (reason,) = self.track.finishes[req_id]
            emitted = self.track.emitted[req_id]
            assert emitted == request.output_token_ids
            sampled = self.runner.sampled.get(req_id, [])
            # Pipelined steps may sample once more for a request whose stop was not known yet.
            extra = len(sampled) - len(emitted)
            assert sampled[: len(emitted)] == emitted and 0 <= extra <= int(s.async_scheduling)
            assert len(emitted) <= request.max_tokens
            assert request.num_prompt_tokens + len(emitted) <= s.max_model_len
            min_tokens = request.sampling_params.min_tokens
            # Whether the stop rule fires on each token (eos/stop token, not before min_tokens).
            stops = [count >= min_tokens and _is_stop(request, t) for count, t in enumerate(emitted, start=1)]
            assert not any(stops[:-1]), f"{req_id} ran past a stop: {emitted}"
            at_length = len(emitted) == request.max_tokens or request.num_tokens == s.max_model_len
            if reason == "stop":
                assert stops[-1]
            elif reason == "length":
                assert at_length and not stops[-1]
            else:
                assert reason == "abort"
                assert not at_length and not any(stops), f"{req_id} should have finished before the abort"


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), operations=ops, seed=st.integers(0, 2**32 - 1))
def test_random_add_step_abort_sequences(setup: Setup, operations: list, seed: int) -> None:
    driver = Driver(setup, seed)
    for op in operations:
        if isinstance(op, Add):
            driver.add(op)
        elif isinstance(op, Step):
            driver.step()
        else:
            driver.abort(op)
        driver.check_invariants()
    driver.drain()
    driver.check_final()


def _run(setup: Setup, operations: list, seed: int, flushes: bool) -> tuple[list[object], Driver]:
    """The workload's SchedulerOutputs, each followed by the prefix cache ({hash: block id}) and the free
    list's order as the step left them (after every other operation too)."""
    driver = Driver(setup, seed, flushes)
    kv = driver.sched.kv
    record: list[object] = []

    def snapshot() -> None:
        kv.flush()  # (what any reader of the map would do first)
        record.append(({h: b.block_id for h, b in kv.pool.cached.items()}, [b.block_id for b in kv.pool.free_queue]))

    for op in operations:
        if isinstance(op, Add):
            driver.add(op)
        elif isinstance(op, Step):
            record.append(driver.step())
        else:
            driver.abort(op)
        driver.check_invariants()
        snapshot()
    for _ in range(10_000):
        if not driver.sched.has_unfinished_requests() and driver.in_flight is None:
            break
        record.append(driver.step())
        snapshot()
    return record, driver


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), operations=ops, seed=st.integers(0, 2**32 - 1), flushes=st.booleans())
def test_deferred_block_caching_schedules_as_caching_in_schedule(
    setup: Setup, operations: list, seed: int, flushes: bool
) -> None:
    """Hashing the scheduled blocks after the launch (`DEFERRED_BLOCK_CACHING`) changes no step: the same
    workload gives equal SchedulerOutputs (prefix hits, block ids, preemptions), prefix caches, free-list
    orders, tokens and hit counts with the hashing inside schedule(), whether or not the caller flushes
    after each launch."""
    from kvserve.core import kv_cache_manager

    runs = []
    try:
        for deferred in (True, False):
            kv_cache_manager.DEFERRED_BLOCK_CACHING = deferred
            runs.append(_run(setup, operations, seed, flushes))
    finally:
        kv_cache_manager.DEFERRED_BLOCK_CACHING = True
    (record_a, a), (record_b, b) = runs
    assert record_a == record_b
    assert a.track.emitted == b.track.emitted
    assert (a.sched.kv.stats.num_queries, a.sched.kv.stats.num_hits) == (b.sched.kv.stats.num_queries,
                                                                          b.sched.kv.stats.num_hits)
    assert a.sched.kv.pool.num_evictions == b.sched.kv.pool.num_evictions
