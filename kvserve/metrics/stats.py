"""Per-request timing and token counts, measured in the API process (plain data; no prometheus here).

`RequestStatsTracker` follows each engine request (one sample of a user request) from arrival to finish
and turns every batch of engine outputs into an `IterationStats`: the TTFTs, inter-token latencies,
token counts and finished requests of that batch. A `StatLogger` (Prometheus, a log line) consumes them
together with the engine's `SchedulerStats`.

All times are wall-clock seconds (`time.time()`): the queue time subtracts the engine process's
first-scheduled timestamp from the API process's arrival timestamp, so both must use the same clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvserve.core.outputs import EngineCoreOutput, SchedulerStats


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time_s: float | None  # None: never scheduled (aborted while waiting)
    prefill_time_s: float | None  # first scheduled -> first token
    decode_time_s: float | None  # first token -> last token
    max_tokens: int


@dataclass
class IterationStats:
    """What one batch of engine outputs added (all lists may be empty)."""

    num_prompt_tokens: int = 0  # prompts whose prefill completed in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # (n, the most tokens one of its samples generated) of each request whose samples have all finished
    finished_groups: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.num_prompt_tokens or self.num_generation_tokens or self.finished or self.finished_groups)


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None: ...


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    prompt_counted: bool = False  # its prompt tokens are in an IterationStats
    group: _Group | None = None  # the request's samples (all of them, n of them)


@dataclass
class _Group:
    """A request's samples: how many are still live, and the most tokens a finished one generated."""

    n: int
    live: int
    max_generation_tokens: int = 0
    counted: bool = False  # a sample of it has gone to IterationStats.finished


class RequestStatsTracker:
    """Timing state of every live engine request (keyed by engine request id)."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}

    def add(self, req_id: str, arrival_time: float, num_prompt_tokens: int, max_tokens: int) -> None:
        """One engine request: a request alone (n=1). `add_group` adds a request's n samples together."""
        self.add_group([req_id], arrival_time, num_prompt_tokens, max_tokens)

    def add_group(self, req_ids: list[str], arrival_time: float, num_prompt_tokens: int, max_tokens: int) -> None:
        """The n engine requests of one request's samples; when the last of them finishes, the request's n and
        the most tokens a sample generated go to IterationStats.finished_groups (vLLM's request_params_n and
        request_max_num_generation_tokens)."""
        group = _Group(len(req_ids), len(req_ids))
        for req_id in req_ids:
            self._requests[req_id] = _RequestTimes(arrival_time, num_prompt_tokens, max_tokens, group=group)

    def __len__(self) -> int:
        return len(self._requests)

    def on_output(self, out: EngineCoreOutput, now: float, iteration: IterationStats) -> None:
        """Account one engine output received at `now` (finishing is reported separately).

        The output of the step that ran a request's prompt counts its prompt tokens and records when it was
        first scheduled (its queue time), also where it carries no token: a prompt-only request (prompt_logprobs
        asked, a grammar that allows only EOS held back by min_tokens) ends there with none. It has no TTFT,
        no token having been produced, and so no prefill time either."""
        times = self._requests.get(out.req_id)
        if times is None:
            return
        if out.first_scheduled_time and times.first_scheduled_time is None:
            times.first_scheduled_time = out.first_scheduled_time
        if not times.prompt_counted and (out.new_token_ids or out.first_scheduled_time):
            times.prompt_counted = True
            iteration.num_prompt_tokens += times.num_prompt_tokens
        if not out.new_token_ids:
            return
        if times.first_token_time is None:
            times.first_token_time = now
            iteration.time_to_first_tokens_s.append(now - times.arrival_time)
        else:
            assert times.last_token_time is not None
            iteration.inter_token_latencies_s.append(now - times.last_token_time)
        times.last_token_time = now
        times.num_generation_tokens += len(out.new_token_ids)
        iteration.num_generation_tokens += len(out.new_token_ids)

    def finish(self, req_id: str, finish_reason: str, now: float, iteration: IterationStats) -> None:
        """The request ended (engine finish, stop string, or abort); unknown ids are ignored."""
        times = self._requests.pop(req_id, None)
        if times is None:
            return
        queue_s = prefill_s = decode_s = None
        if times.first_scheduled_time is not None:
            queue_s = max(times.first_scheduled_time - times.arrival_time, 0.0)
            if times.first_token_time is not None:
                prefill_s = max(times.first_token_time - times.first_scheduled_time, 0.0)
        if times.first_token_time is not None and times.last_token_time is not None:
            decode_s = times.last_token_time - times.first_token_time
        group = times.group
        if group is not None:
            group.counted = True
            self._leave_group(group, times, iteration)
        iteration.finished.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency_s=now - times.arrival_time,
                num_prompt_tokens=times.num_prompt_tokens,
                num_generation_tokens=times.num_generation_tokens,
                queue_time_s=queue_s,
                prefill_time_s=prefill_s,
                decode_time_s=decode_s,
                max_tokens=times.max_tokens,
            )
        )

    def fail(self, req_id: str, now: float, iteration: IterationStats) -> None:
        """The engine dropped the request (its grammar failed, the engine died). One that had run (its prompt
        counted) ends with finish reason "error", vLLM's for a request that failed in the engine; one that
        never ran (refused on arrival: its client gets a 400) is forgotten uncounted, as requests the server
        refuses before the engine are. Unknown ids are ignored."""
        times = self._requests.get(req_id)
        if times is None:
            return
        if times.prompt_counted:
            self.finish(req_id, "error", now, iteration)
            return
        del self._requests[req_id]
        if times.group is not None:
            self._leave_group(times.group, times, iteration)

    @staticmethod
    def _leave_group(group: _Group, times: _RequestTimes, iteration: IterationStats) -> None:
        """One of the group's samples has ended; the last one reports the group (if a sample of it counted)."""
        group.live -= 1
        group.max_generation_tokens = max(group.max_generation_tokens, times.num_generation_tokens)
        if group.live == 0 and group.counted:
            iteration.finished_groups.append((group.n, group.max_generation_tokens))
