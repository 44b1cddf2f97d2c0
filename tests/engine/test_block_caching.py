"""The engine core hashes a step's new prompt blocks while the step runs (`DEFERRED_BLOCK_CACHING` in
`kvserve.core.kv_cache_manager`): when the runner is called, a fresh prompt has only its first block hashed
(its lookup's miss); by the time the engine waits for the step's result, every full block of the prompt is
in the prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
