"""The request message that crosses into the engine core (in-process or over ZMQ)."""

from __future__ import annotations

import msgspec

from kvserve.protocol.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never more than max_model_len - prompt length
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    cache_salt: str | None = None
    # Samples of one n>1 request share this key so they share prompt blocks even with caching off.
    group_key: str | None = None
    priority: int = 0  # lower first, under the priority scheduling policy
    # Run the prompt (for its prompt_logprobs) and end with no token, finish_reason "length": a completion's
    # echo with max_tokens 0. The core drops the one token the prompt's step samples.
    prompt_only: bool = False
