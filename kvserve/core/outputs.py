"""Typed contracts between the scheduler, the model runner and the engine core's clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.core.request import Request


@dataclass
class NewRequestData:
    """Sent once, the first time a request is scheduled; the runner keeps it until the request finishes."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The ids that end the request as EOS (the model's and its tokenizer's): min_tokens holds them back.
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass
class ScheduledRequest:
    """One request's share of a step, in batch order."""

    req_id: str
    token_ids: list[int]  # the tokens whose K/V this step computes, in order
    num_computed_tokens: int  # tokens already in the cache before this step
    new_block_ids: list[int]  # appended to the request's block table
    reset_block_table: bool  # the table starts over (first schedule or resumed after preemption)
    sample: bool  # the step reaches the request's last known token: sample the next one


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # the runner may drop their state
    num_preempted: int = 0
    # Structured output: the token mask of each scheduled request that samples this step and has a grammar
    # (int32 words, one bit per token id; `kvserve.structured_output`).
    grammar_bitmask: dict[str, bytes] = field(default_factory=dict)
    # The scheduler's own objects of the scheduled requests (in-process only): a token sampled for a
    # request that was aborted and whose id was reused meanwhile must not reach the new request.
    requests: dict[str, Request] = field(default_factory=dict, repr=False, compare=False)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one sampled token: token_ids[0]/logprobs[0] are the sampled token, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the sampled token in the model's distribution (1 = most likely)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of the requests with `sample=True`, in batch order."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # per request with prompt_logprobs, the prompt tokens this step computed logprobs for, in prompt order
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request (crosses the engine-core process boundary)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    # time.time() when the request was first scheduled; set on its first output only (0 elsewhere), for
    # the API process's queue-time metric.
    first_scheduled_time: float = 0.0
    # prompt_logprobs: those of prompt tokens 1.. (token 0 has none), on the request's first output only
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """Engine-side gauges and counters; the API process turns them into Prometheus metrics."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative tokens
    prefix_cache_hits: int = 0  # cumulative tokens
    num_preemptions: int = 0  # cumulative
    num_blocks: int = 0
    num_free_blocks: int = 0
