"""Driving an `EngineCore` directly in tests: greedy runs that keep each step's top logprobs, for differential
checks between engine settings (fp8 weights or KV cache against the model's dtype, ...)."""

from __future__ import annotations

from typing import Any

from kvserve.engine.engine_core import EngineCore
from kvserve.protocol.engine import EngineCoreRequest
from kvserve.protocol.sampling_params import SamplingParams


def greedy_with_logprobs(core: EngineCore, prompts: list[list[int]], max_tokens: int,
                         check_invariants: bool = True, logprobs: int = 5) -> list[tuple[list[int], list[Any]]]:
    """Runs `prompts` greedily for exactly `max_tokens` tokens each (EOS ignored, top-`logprobs` logprobs)
    until the core has nothing left; (tokens, TokenLogprobs per token) per prompt, in order. With
    `check_invariants`, the core's managers check their invariants after every step."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(req_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                           max_tokens=max_tokens))
    core.check_invariants_every_step = check_invariants
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    tops: dict[str, list[Any]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.req_id].extend(out.new_token_ids)
            tops[out.req_id].extend(out.new_logprobs or [])
    return [(tokens[str(i)], tops[str(i)]) for i in range(len(prompts))]


def top_logprobs(lp: Any) -> dict[int, float]:
    """A step's top-k alternatives (token id -> logprob), without the sampled token's own entry (the first)."""
    return dict(zip(lp.token_ids[1:], lp.logprobs[1:], strict=True))
