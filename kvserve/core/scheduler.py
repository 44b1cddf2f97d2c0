"""Token-budget continuous batching with chunked prefill, prefix-cache hits and recompute preemption.

There is no prefill or decode phase: every step hands each request `num_tokens - num_computed_tokens`
tokens (capped by the budget), running requests first, then waiting ones. A prompt longer than the budget
is prefilled over several steps (chunked prefill); a decode is simply a request with one token to compute.
When a running request cannot get a block, the newest running request is preempted: its blocks are freed
and it goes back to the front of the waiting queue, to be recomputed later.

Under the priority policy (`SchedulerConfig.scheduling_policy`, vLLM's) both queues are kept in the order of
(priority, arrival): the waiting request admitted next is the one with the lowest `priority` value (the
earliest among equals), running requests are scheduled in that order, and the one preempted when blocks run
out is the last of it (the lowest priority, the latest among equals). A preempted request waits in its place
in that order.

Async scheduling (the engine core schedules step n+1 before it reads step n's sampled tokens): a request
that samples in a step gets a pending token (`Request.num_pending_tokens`) until `update_from_output`
delivers it. A running request with a pending token is scheduled for one more token whose id is
`PLACEHOLDER_TOKEN_ID` (the model runner takes it from the previous step's samples on the device), unless
the pending token surely ends it by length. A request that turns out to have stopped (EOS, stop token) at
step n has then computed one token in step n+1 for nothing; that output is dropped.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, MutableSequence

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from kvserve.core.request import Request, RequestStatus

# Stands for a token sampled by a step whose result the scheduler has not read yet.
PLACEHOLDER_TOKEN_ID = -1


class RequestRejected(ValueError):
    """The request can never be served under the engine's limits; `param` names the cause."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


class _SampleGroup:
    """The samples of one n>1 request (vLLM's child requests) in this scheduler."""

    __slots__ = ("key", "num_live", "num_cached_tokens")

    def __init__(self, key: str) -> None:
        self.key = key
        self.num_live = 0
        # Prompt tokens the group's first admitted sample found in the prefix cache (-1: none admitted yet).
        self.num_cached_tokens = -1


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self._known_to_runner: set[str] = set()
        self.num_preemptions = 0
        self._by_priority = config.scheduling_policy == "priority"
        self._arrivals = itertools.count()  # ties of priority and arrival time (an n>1 request's samples)
        self._order: dict[str, tuple[int, float, int]] = {}  # req_id -> (priority, arrival time, arrival)
        # n>1 requests' live samples: group key -> group, and req_id -> its group (see `_reported_cached_tokens`).
        self._groups: dict[str, _SampleGroup] = {}
        self._group_of: dict[str, _SampleGroup] = {}

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request, group_key: str | None = None) -> None:
        """Queue a request; reject one that could never be served (rather than letting it hang)."""
        self.check_request(request)
        request.status = RequestStatus.WAITING
        self.kv.set_group(request, group_key)
        if group_key is not None:
            group = self._groups.get(group_key)
            if group is None:
                group = self._groups[group_key] = _SampleGroup(group_key)
            group.num_live += 1
            self._group_of[request.req_id] = group
        self.requests[request.req_id] = request
        self._order[request.req_id] = (request.priority, request.arrival_time, next(self._arrivals))
        if self._by_priority:
            self._insert_in_order(self.waiting, request)
        else:
            self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """RequestRejected when `add_request` would refuse the request; changes nothing."""
        max_len = self.config.max_model_len
        if request.req_id in self.requests:
            raise RequestRejected(f"request id {request.req_id!r} is already in use", "request_id")
        if type(request.priority) is not int:  # compared with others' in the queues: a clean refusal, not a
            # TypeError halfway through admitting it
            raise RequestRejected(f"priority must be an integer, got {request.priority!r}", "priority")
        if request.priority != 0 and not self._by_priority:
            raise RequestRejected(
                f"priority {request.priority} needs the priority scheduling policy (--scheduling-policy priority); "
                f"under first come, first served every request's priority is 0", "priority"
            )
        if request.num_prompt_tokens >= max_len:
            raise RequestRejected(
                f"the prompt has {request.num_prompt_tokens} tokens but max_model_len is {max_len}: "
                f"the prompt must be shorter than max_model_len to leave room for output"
            )
        if not self.kv.can_fit(request.num_prompt_tokens + 1):
            raise RequestRejected(
                f"the prompt has {request.num_prompt_tokens} tokens but the KV cache holds only "
                f"{self.kv.num_blocks * self.block_size} tokens"
            )
        # NOTE: a request that cannot hold its longest possible sequence even alone in the pool would
        # preempt itself and then never be readmitted: a hang. It stops at max_tokens outputs or at
        # max_model_len tokens, and its last sampled token never enters the cache.
        max_num_cached_tokens = min(request.num_prompt_tokens + request.max_tokens, max_len) - 1
        if not self.kv.can_fit(max_num_cached_tokens):
            raise RequestRejected(
                f"the prompt has {request.num_prompt_tokens} tokens and max_tokens is {request.max_tokens}: "
                f"the request may need {max_num_cached_tokens} tokens of KV cache but it holds only "
                f"{self.kv.num_blocks * self.block_size} tokens",
                "max_tokens",
            )

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Abort requests in any state; unknown or already finished ids are ignored."""
        aborted = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.status.is_finished:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    def stop_request(self, req_id: str) -> bool:
        """Finish a live request as stopped (finish_reason "stop") outside the stop rules: the engine core's
        call, for a grammar that has ended. Returns whether the request was live."""
        request = self.requests.get(req_id)
        if request is None or request.status.is_finished:
            return False
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return True

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.kv.forget(request)
        group = self._group_of.pop(request.req_id, None)
        if group is not None:
            group.num_live -= 1
            if group.num_live == 0:
                del self._groups[group.key]
        del self.requests[request.req_id]
        del self._order[request.req_id]
        if request.req_id in self._known_to_runner:
            self._known_to_runner.discard(request.req_id)
            self._finished_since_last_step.append(request.req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step

    def cache_scheduled_blocks(self) -> None:
        """Hash the blocks the last `schedule()` gave out and offer them to the prefix cache (deferred so
        that the hashing runs while the GPU computes the step: `kv_cache_manager.DEFERRED_BLOCK_CACHING`).
        Call right after the step is launched. Skipping it changes no scheduling decision (lookups, frees
        and evicting allocations flush first), but then the hashing runs in one of them, often inside the
        next `schedule()`."""
        self.kv.flush()

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = self.config.max_num_batched_tokens
        preempted: list[Request] = []

        # Running requests first, oldest first; the newest ones are preempted when blocks run out.
        # (Hundreds of requests a step, every step: the loop reads the lengths directly.)
        running = self.running
        allocate_slots = self.kv.allocate_slots
        max_model_len = self.config.max_model_len
        scheduled, scheduled_requests = out.scheduled, out.requests
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            pending = request.num_pending_tokens
            num_tokens = len(request.all_token_ids)
            if pending and (len(request.output_token_ids) + pending >= request.max_tokens
                            or num_tokens + pending >= max_model_len):
                i += 1  # its pending token surely finishes it (max_tokens or max_model_len)
                continue
            num_new = min(num_tokens + pending - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (cannot happen for a live request; defensive)
                i += 1
                continue
            new_blocks = allocate_slots(request, num_new)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = allocate_slots(request, num_new)
            if new_blocks is None:
                break
            scheduled.append(self._scheduled(request, num_new, [b.block_id for b in new_blocks], False))
            scheduled_requests[request.req_id] = request
            budget -= num_new
            i += 1

        # Then waiting requests, in order, while budget, sequence slots and blocks last. No admission in a
        # step that had to preempt: the pool is short and admitting would only cause more preemption.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending_tokens:  # preempted with a token in flight: resume once it is known
                break
            if request.prompt_logprobs is not None and not request.output_token_ids:
                # Every prompt position's logits are needed: no prefix-cache hits until its first token.
                hit_blocks, num_hit_tokens = [], 0
            else:
                hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            new_blocks = self.kv.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                break
            self.waiting.popleft()
            self.kv.record_admission(request, num_hit_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = self._reported_cached_tokens(request, num_hit_tokens)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if self._by_priority:
                self._insert_in_order(self.running, request)
            else:
                self.running.append(request)
            if request.req_id not in self._known_to_runner:
                self._known_to_runner.add(request.req_id)
                out.new_requests.append(
                    NewRequestData(request.req_id, list(request.prompt_token_ids), request.sampling_params,
                                   sorted(request.eos_token_ids))
                )
            block_ids = self.kv.get_block_ids(request.req_id)
            out.scheduled.append(self._scheduled(request, num_new, block_ids, True))
            out.requests[request.req_id] = request
            budget -= num_new

        out.num_preempted = len(preempted)
        return out

    def _reported_cached_tokens(self, request: Request, num_hit_tokens: int) -> int:
        """The prompt tokens a request reports as served from the prefix cache (vLLM's `num_cached_tokens`, the
        API's `usage.prompt_tokens_details.cached_tokens`), at its first admission with `num_hit_tokens` hits.

        Only prefix-cache hits count, so 0 with prefix caching off, although the samples of an n>1 request share
        their prompt blocks then (through their group key). With it on, every sample of an n>1 request reports
        the hits of the group's first admitted sample: the later ones also hit the blocks their siblings
        computed, which are the request's own work, not tokens it found in the cache."""
        if not self.kv.enable_caching:
            return 0
        group = self._group_of.get(request.req_id)
        if group is None:
            return num_hit_tokens
        if group.num_cached_tokens < 0:
            group.num_cached_tokens = num_hit_tokens
        return group.num_cached_tokens

    def _scheduled(
        self, request: Request, num_new: int, new_block_ids: list[int], reset: bool
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        num_tokens = len(request.all_token_ids)
        token_ids = request.all_token_ids[start:end]
        if end > num_tokens:  # the pending token: its id is still on the device
            token_ids.extend([PLACEHOLDER_TOKEN_ID] * (end - max(start, num_tokens)))
        sample = end == num_tokens + request.num_pending_tokens
        if sample:
            request.num_pending_tokens += 1
        scheduled = ScheduledRequest(request.req_id, token_ids, start, new_block_ids, reset, sample)
        # Advanced now so the blocks a running request owns always match its computed tokens.
        request.num_computed_tokens = start + num_new
        return scheduled

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self._by_priority:
            self._insert_in_order(self.waiting, request)
        else:
            self.waiting.appendleft(request)

    def _insert_in_order(self, queue: MutableSequence[Request], request: Request) -> None:
        """Insert `request` in (priority, arrival) order, after its equals (a scan from the back: new
        arrivals usually belong there)."""
        order = self._order
        key = order[request.req_id]
        i = len(queue)
        while i > 0 and order[queue[i - 1].req_id] > key:
            i -= 1
        queue.insert(i, request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free finished requests' blocks."""
        outputs: list[EngineCoreOutput] = []
        scheduled_requests, live = scheduler_output.requests, self.requests
        cache_computed_blocks, running = self.kv.cache_computed_blocks, RequestStatus.RUNNING
        for req_id, entries in runner_output.prompt_logprobs.items():
            request = scheduled_requests.get(req_id)
            if request is not None and live.get(req_id) is request and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(entries)
        for req_id, token_id, logprobs in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, runner_output.logprobs, strict=True
        ):
            request = scheduled_requests.get(req_id)
            if request is None or live.get(req_id) is not request:
                continue  # finished (or aborted) while the step ran: a token computed for nothing
            request.num_pending_tokens -= 1
            # RUNNING, or PREEMPTED by a later schedule while this step ran: the token is still valid.
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            if request.status == running:
                # A block completed by this token (scheduled as a placeholder) can be hashed now.
                cache_computed_blocks(request)
            status = self._check_stop(request, token_id)
            output = EngineCoreOutput(req_id, [token_id], None if logprobs is None else [logprobs],
                                      num_cached_tokens=max(request.num_cached_tokens, 0))
            if len(request.output_token_ids) == 1:
                output.first_scheduled_time = request.first_scheduled_time or 0.0
                output.prompt_logprobs = request.prompt_logprobs
                if request.prompt_logprobs is not None:
                    request.prompt_logprobs = []  # sent (a later resume computes no prompt position again)
            if status is not None:
                output.finish_reason = status.finish_reason
                output.stop_token_id = request.stop_token_id
                self._finish(request, status)
            outputs.append(output)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if (not params.ignore_eos and token_id in request.eos_token_ids) or (
                params.stop_token_ids and token_id in params.stop_token_ids
            ):
                request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------ introspection

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.stats.num_queries,
            prefix_cache_hits=self.kv.stats.num_hits,
            num_preemptions=self.num_preemptions,
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.pool.num_free_blocks,
        )

    def runner_req_ids(self) -> set[str]:
        """The requests the model runner holds state for once the last `schedule()`'s output is applied: the
        live ones it was told about, and those finished since (a request may finish while its step is in
        flight), which the next output's `finished_req_ids` releases."""
        return self._known_to_runner | set(self._finished_since_last_step)

    def check_invariants(self, incremental: bool = False) -> None:
        """`incremental`: the block pool's incremental check (see `BlockPool.check_invariants`)."""
        self.kv.check_invariants(self.requests, incremental)
        running_ids = {r.req_id for r in self.running}
        waiting_ids = {r.req_id for r in self.waiting}
        assert len(running_ids) == len(self.running), "a request is running twice"
        assert len(waiting_ids) == len(self.waiting), "a request is waiting twice"
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert running_ids | waiting_ids == set(self.requests), "tracked requests differ from the queues"
        assert len(self.running) <= self.config.max_num_seqs, "more running requests than max_num_seqs"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, f"{request} in running list"
            needed = cdiv(request.num_computed_tokens, self.block_size)
            held = self.kv.num_blocks_of(request.req_id)
            assert held == needed, f"{request} holds {held} blocks, its tokens need {needed}"
            assert request.num_computed_tokens <= request.num_tokens_with_pending
            # One pending token from the step in flight, plus one from the step just scheduled.
            assert 0 <= request.num_pending_tokens <= 2, f"{request} has {request.num_pending_tokens} pending"
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{request} waiting"
            assert request.num_computed_tokens == 0, f"{request} waiting with computed tokens"
            # Only a request preempted while its last step was in flight waits with a pending token.
            assert request.num_pending_tokens == 0 or (
                request.status == RequestStatus.PREEMPTED and request.num_pending_tokens == 1
            ), f"{request} waiting with {request.num_pending_tokens} pending tokens"
            assert self.kv.num_blocks_of(request.req_id) == 0, f"{request} waiting but holds blocks"
        assert set(self.kv.req_to_blocks) <= running_ids, "blocks held by a request that is not running"
        assert set(self._order) == set(self.requests), "the arrival order has requests that are not live"
        assert set(self._group_of) <= set(self.requests), "a sample group holds a request that is not live"
        num_live: dict[str, int] = {}
        for group in self._group_of.values():
            assert self._groups.get(group.key) is group, f"sample group {group.key!r} is not the one of its key"
            num_live[group.key] = num_live.get(group.key, 0) + 1
        assert num_live == {key: g.num_live for key, g in self._groups.items()}, \
            "the sample groups' live counts differ from their live samples"
        # The runner was told about exactly the requests admitted since they arrived: the running ones and the
        # preempted ones (a fresh request waits as WAITING, a preempted one keeps PREEMPTED until readmitted). A
        # leftover id would keep a finished request from ever being released in the runner.
        preempted_ids = {r.req_id for r in self.waiting if r.status == RequestStatus.PREEMPTED}
        assert self._known_to_runner == running_ids | preempted_ids, (
            f"requests known to the runner {sorted(self._known_to_runner)} differ from the running and preempted "
            f"ones {sorted(running_ids | preempted_ids)}"
        )
        # Finished since the last schedule(): each once, and none told to the runner again before it is released
        # (a reused id is announced by the schedule() that releases the old one).
        finished = self._finished_since_last_step
        assert len(set(finished)) == len(finished), f"a request finished twice since the last step: {finished}"
        assert not self._known_to_runner & set(finished), "a finished request still known to the runner"
        if self._by_priority:
            for name, queue in (("waiting", self.waiting), ("running", self.running)):
                keys = [self._order[r.req_id] for r in queue]
                assert keys == sorted(keys), f"the {name} queue is out of (priority, arrival) order"
        else:
            assert all(r.priority == 0 for r in self.requests.values()), "a priority under first come, first served"
