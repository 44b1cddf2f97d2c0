"""The priority scheduling policy (vLLM's `--scheduling-policy priority`) through the engine: requests run in
priority order, the policy changes no request's tokens, and a priority under first come, first served is
refused by name."""

from __future__ import annotations

import pytest

from kvserve.engine.llm import LLM
from kvserve.entrypoints.openai.cli_args import make_arg_parser, server_engine_args
from kvserve.protocol.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _finish_order(llm: LLM, priorities: dict[str, int]) -> list[str]:
    for i, (req_id, priority) in enumerate(priorities.items()):
        llm.engine.add_request(req_id, PROMPTS[i], GREEDY, priority=priority)
    order: list[str] = []
    for _ in range(200):
        order += [o.request_id for o in llm.engine.step() if o.finished]
        if not llm.engine.has_unfinished_requests():
            return order
    raise AssertionError("the engine did not finish")


def test_one_at_a_time_requests_finish_in_priority_order(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = LLM(path, max_model_len=128, max_num_seqs=1, scheduling_policy="priority")
    assert _finish_order(llm, {"a": 2, "b": 0, "c": 1, "d": 0}) == ["b", "d", "c", "a"]
    fcfs = LLM(path, max_model_len=128, max_num_seqs=1)
    assert _finish_order(fcfs, {"a": 0, "b": 0, "c": 0, "d": 0}) == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        fcfs.generate(PROMPTS[:1], GREEDY, use_tqdm=False, priority=[1])
    assert not fcfs.engine.has_unfinished_requests()


def test_priorities_change_no_tokens(tiny_model_dir):
    """A small KV pool, so that low-priority requests are preempted and recomputed: the same greedy tokens."""
    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    small = dict(max_model_len=48, num_kv_blocks=12, block_size=4)
    plain = LLM(path, **small).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(path, scheduling_policy="priority", **small)
    ranked = llm.generate(PROMPTS, params, use_tqdm=False, priority=[3, -1, 0, 2])
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.core.scheduler.num_preemptions > 0
    with pytest.raises(ValueError, match="priority has 1 values for 4 prompts"):
        llm.generate(PROMPTS, params, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority must be integers"):
        llm.generate(PROMPTS[:2], params, use_tqdm=False, priority=[0, None])  # type: ignore[list-item]
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)  # nothing was left behind
    assert again[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_the_scheduling_policy_flag():
    parser = make_arg_parser()
    assert server_engine_args(parser.parse_args(["m", "--scheduling-policy", "priority"]))["scheduling_policy"] == \
        "priority"
    assert server_engine_args(parser.parse_args(["m"]))["scheduling_policy"] == "fcfs"
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--scheduling-policy", "lifo"])
