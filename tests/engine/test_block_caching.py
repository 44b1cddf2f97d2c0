"""The engine core hashes a step's new prompt blocks while the step runs (`DEFERRED_BLOCK_CACHING` in
`kvserve.core.kv_cache_manager`): when the runner is called, a fresh prompt has only its first block hashed
(its lookup's miss); by the time the engine waits for the step's result, every full block of the prompt is
in the prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvserve.config import EngineArgs
from kvserve.core.request import Request
from kvserve.engine.engine_core import EngineCore
from kvserve.protocol.engine import EngineCoreRequest
from kvserve.protocol.sampling_params import SamplingParams


def test_prompt_blocks_are_hashed_between_the_launch_and_the_wait(tiny_model_dir: Callable[..., str]) -> None:
    args = EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len=256, kv_cache_memory="8MiB")
    core = EngineCore(args.create_engine_config())
    kv = core.scheduler.kv
    prompt = [(7 * i) % 200 + 3 for i in range(100)]
    full_blocks = len(prompt) // kv.block_size
    assert full_blocks >= 2
    seen: list[tuple[str, int, int]] = []  # (when, the prompt's hashes, cached blocks)
    launch = core.runner.execute_model_async

    def recording(scheduler_output: Any) -> Any:
        request = scheduler_output.requests["a"]
        seen.append(("launch", len(request.block_hashes), len(kv.pool.cached)))
        pending = launch(scheduler_output)
        result = pending.result

        def waited() -> Any:
            seen.append(("wait", len(request.block_hashes), len(kv.pool.cached)))
            return result()

        pending.result = waited
        return pending

    core.runner.execute_model_async = recording  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest(req_id="a", prompt_token_ids=prompt, sampling_params=params, max_tokens=4))
    core.step()
    assert seen[:2] == [("launch", 1, 0), ("wait", full_blocks, full_blocks)]
    _, num_hit_tokens = kv.get_computed_blocks(Request("b", prompt, params))
    assert num_hit_tokens == full_blocks * kv.block_size


def test_the_per_step_check_walks_a_large_pool_only_when_due_and_finds_an_untouched_corruption_by_the_runs_end(
    tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`check_invariants_every_step` checks the block pool incrementally (BlockPool.check_invariants): on the tiny
    model's 131,072-block pool, a walk of the whole pool at the first check, after 64 incremental ones and when the
    pool idles (the run's end). A corruption of a free block no step touches (a hash missing from the map) is
    found then."""
    args = EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len=128, block_size=16)
    core = EngineCore(args.create_engine_config())
    pool = core.scheduler.kv.pool
    assert pool.num_blocks == 131072
    walks: list[int] = []
    check_all = pool._check_all
    monkeypatch.setattr(pool, "_check_all", lambda: walks.append(len(walks)) or check_all())
    core.check_invariants_every_step = True
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def run(req_id: str) -> int:
        core.add_request(EngineCoreRequest(req_id=req_id, prompt_token_ids=list(range(3, 40)), sampling_params=params,
                                           max_tokens=20))
        steps = 0
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        return steps

    assert run("a") == 20
    assert len(walks) == 2  # the first check and the idle pool's at the end; the 18 between, incremental
    far = pool.blocks[100_000]  # in the middle of the free list: no step writes it or its neighbours
    assert far.ref_cnt == 0 and far.block_hash is None
    far.block_hash = b"not in the map".ljust(16, b".")  # outside the pool's methods: not recorded
    with pytest.raises(AssertionError, match="carries a hash missing from the map"):
        run("b")  # the first steps' incremental checks miss it; the idle pool's walk after the last step does not
    assert len(walks) == 3
