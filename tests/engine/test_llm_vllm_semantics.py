"""vLLM offline code run unchanged: SamplingParams values and prompt forms read as vLLM reads them, and the
LLM still usable after a call that failed."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(tiny_model_dir("llama"), max_model_len=128)


def test_logprobs_true_is_one_logprob(llm: LLM) -> None:
    """vLLM reads logprobs=True (and prompt_logprobs=True) as 1; it used to reach torch.topk as a bool, which
    failed the step."""
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=True, prompt_logprobs=True)
    assert params.logprobs == 1 and params.prompt_logprobs == 1
    out = llm.generate([list(range(100, 110))], params, use_tqdm=False)[0]
    one = llm.generate([list(range(100, 110))], SamplingParams(temperature=0, max_tokens=3, logprobs=1,
                                                               prompt_logprobs=1), use_tqdm=False)[0]
    assert out.outputs[0].logprobs == one.outputs[0].logprobs and len(out.outputs[0].logprobs) == 3
    assert out.prompt_logprobs == one.prompt_logprobs
    assert SamplingParams(logprobs=False).logprobs == 0  # an int in vLLM: the sampled token's logprob only
