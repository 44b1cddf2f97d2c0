"""A fake model runner for driving the pure-Python scheduler in tests.

It plays the runner's side of the `SchedulerOutput` contract and checks it as it goes:

* it keeps what a real runner keeps (the prompt from `NewRequestData`, the tokens it sampled, a block table
  built from `new_block_ids` / `reset_block_table`), and drops a request only when `finished_req_ids` says so;
* it simulates the paged KV cache as a map slot -> token id: every step first writes each scheduled token at
  its slot, then "attends": every request reads positions [0, num_computed_tokens + len(token_ids)) through
  its block table and each slot must hold that request's token at that position. A prefix-cache hit on the
  wrong block, a block shared while still being written, or a stale block after eviction shows up as a
  mismatch. (Real attention depends on the whole prefix, not just the token at the slot; reading every
  position of the prefix checks the same thing.)

The sampled token comes from `sample_fn(req_id, num_output_tokens)`. A placeholder token (async
scheduling) must be the last scheduled token of a request the previous step sampled, standing for that
sample; the runner substitutes what it sampled, as the real one does on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.core.scheduler import PLACEHOLDER_TOKEN_ID

SampleFn = Callable[[str, int], int]


@dataclass
class _RunnerRequest:
    token_ids: list[int]  # prompt + tokens this runner sampled for it
    block_table: list[int] = field(default_factory=list)
    num_samples: int = 0


class FakeModelRunner:
    def __init__(self, block_size: int, sample_fn: SampleFn | None = None) -> None:
        self.block_size = block_size
        self.sample_fn: SampleFn = sample_fn or (lambda req_id, i: 7)
        self.requests: dict[str, _RunnerRequest] = {}
        self.kv: dict[tuple[int, int], int] = {}  # (block_id, offset) -> token id
        self.sampled: dict[str, list[int]] = {}  # every token handed back, per request
        self.num_steps = 0
        self._prev_sampled: set[str] = set()  # requests the previous step sampled

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for req_id in out.finished_req_ids:
            assert req_id in self.requests, f"finished {req_id!r} was never sent to the runner"
            del self.requests[req_id]
        for new in out.new_requests:
            assert new.req_id not in self.requests, f"{new.req_id!r} sent twice as a new request"
            self.requests[new.req_id] = _RunnerRequest(list(new.prompt_token_ids))

        seen: set[str] = set()
        for s in out.scheduled:
            assert s.req_id not in seen, f"{s.req_id!r} scheduled twice in one step"
            seen.add(s.req_id)
            assert s.req_id in self.requests, f"{s.req_id!r} scheduled but unknown to the runner"
            state = self.requests[s.req_id]
            assert s.token_ids, f"{s.req_id!r} scheduled with no tokens"
            end = s.num_computed_tokens + len(s.token_ids)
            expected = state.token_ids[s.num_computed_tokens : end]
            token_ids = list(s.token_ids)
            if token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                assert s.req_id in self._prev_sampled, f"{s.req_id!r}: placeholder, not sampled last step"
                assert end == len(state.token_ids), f"{s.req_id!r}: placeholder is not its last sample"
                token_ids[-1] = state.token_ids[-1]
            assert PLACEHOLDER_TOKEN_ID not in token_ids, f"{s.req_id!r}: placeholder not at the end"
            assert token_ids == expected, f"{s.req_id!r}: token_ids {s.token_ids} != {expected}"
            assert s.sample == (end == len(state.token_ids)), f"{s.req_id!r}: wrong sample flag"
            if s.reset_block_table:
                state.block_table = list(s.new_block_ids)
            else:
                state.block_table.extend(s.new_block_ids)
            num_needed = -(-end // self.block_size)
            assert len(state.block_table) == num_needed, (
                f"{s.req_id!r}: block table {state.block_table} for {end} tokens"
            )
            for pos in range(s.num_computed_tokens, end):
                self.kv[self._slot(state, pos)] = state.token_ids[pos]

        # Reads after all writes, as in the model: each layer writes the whole batch's K/V first.
        for s in out.scheduled:
            state = self.requests[s.req_id]
            end = s.num_computed_tokens + len(s.token_ids)
            for pos in range(end):
                got = self.kv.get(self._slot(state, pos))
                assert got == state.token_ids[pos], (
                    f"{s.req_id!r} position {pos}: KV holds token {got}, expected {state.token_ids[pos]}"
                )

        req_ids, token_ids = [], []
        for s in out.scheduled:
            if not s.sample:
                continue
            state = self.requests[s.req_id]
            token = self.sample_fn(s.req_id, state.num_samples)
            state.num_samples += 1
            state.token_ids.append(token)
            self.sampled.setdefault(s.req_id, []).append(token)
            req_ids.append(s.req_id)
            token_ids.append(token)
        self._prev_sampled = set(req_ids)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=token_ids, logprobs=[None] * len(req_ids))

    def _slot(self, state: _RunnerRequest, pos: int) -> tuple[int, int]:
        return state.block_table[pos // self.block_size], pos % self.block_size


def check_limits(out: SchedulerOutput, config: SchedulerConfig) -> None:
    """The step respects the token budget and the sequence cap."""
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens, "token budget exceeded"
    assert len(out.scheduled) <= config.max_num_seqs, "more sequences than max_num_seqs in one step"
