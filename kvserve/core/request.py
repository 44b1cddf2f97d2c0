"""A request as the engine core sees it: token ids, progress and status. Pure Python (no torch)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.core.outputs import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason of a finished status ("stop" | "length" | "abort"), else None."""
        return _FINISH_REASONS.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated.

    `num_computed_tokens` counts tokens whose K/V are in the cache (or scheduled to be written this step:
    the scheduler advances it when it schedules). `all_token_ids` = prompt + output; the next step must
    compute `all_token_ids[num_computed_tokens:]`.

    `num_pending_tokens` counts output tokens a scheduled step will sample but whose ids are not known yet
    (with async scheduling the next step is scheduled before the previous one's result is read: at most 1
    between steps, 2 while a step is being scheduled).
    The sequence is then `num_tokens + num_pending_tokens` long, its last token a placeholder.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        max_tokens: int = 16,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.req_id = req_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority  # lower first (the priority scheduling policy)
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        # Prompt tokens found in the prefix cache when the request was first scheduled (-1: not yet); an n>1
        # request's samples all report their first admitted sample's (`Scheduler._reported_cached_tokens`).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # prompt_logprobs: those computed so far, sent with the first output token
        self.prompt_logprobs: list[TokenLogprobs] | None = [] if sampling_params.prompt_logprobs is not None else None
        # Hashes of the full blocks of all_token_ids, filled lazily by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # The token id that stopped the request (a stop_token_id or EOS), when it did.
        self.stop_token_id: int | None = None
        # Set when first scheduled (for queue-time metrics).
        self.first_scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
