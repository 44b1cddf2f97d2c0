"""CPU time of the API process's per-step work for every streamed token: `AsyncLLM.on_engine_outputs`
(detokenization, stop checks, stats, each request's update) for N streams over S steps, with hand-made engine
messages and no engine process; the streams' consumers take their updates between steps. Prints microseconds
per token for the reader's work and for everything (the consumers too). `--profile` prints cProfile's top
functions of the reader's work.

  python benchmarks/api_reader_cost.py --streams 256 --steps 100
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.config import EngineConfig  # noqa: E402
from kvserve.core.outputs import EngineCoreOutput, SchedulerStats  # noqa: E402
from kvserve.engine import async_llm  # noqa: E402
from kvserve.model.paths import default_model_path  # noqa: E402
from kvserve.model.tokenizer import load_tokenizer  # noqa: E402
from kvserve.protocol.core_messages import EngineOutputs, EngineReady  # noqa: E402
from kvserve.protocol.sampling_params import SamplingParams  # noqa: E402


class _NoEngine:
    """What AsyncLLM asks of its engine-core client, with no process behind it."""

    def __init__(self, *args: Any) -> None:
        self.dead_error = None

    async def start(self) -> EngineReady:
        return EngineReady(pid=0, num_blocks=1, block_size=16, max_model_len=1 << 20, eos_token_ids=[],
                           vocab_size=49152, startup_s=0.0, capacity_description="")  # the default model's

    async def add_requests(self, requests: list[Any]) -> None:
        pass

    def abort_requests(self, req_ids: list[str]) -> None:
        pass


async def run(args: argparse.Namespace) -> None:
    async_llm.EngineCoreClient = _NoEngine  # type: ignore[misc,assignment]
    llm = async_llm.AsyncLLM(cast(EngineConfig, None), load_tokenizer(default_model_path()))
    await llm.start()
    rng = random.Random(0)
    vocab = len(llm.tokenizer)
    prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
    params = SamplingParams(max_tokens=args.steps, ignore_eos=True)

    async def consume(i: int) -> None:
        async for _ in llm.generate(f"r{i}", prompt, params):
            pass

    consumers = [asyncio.ensure_future(consume(i)) for i in range(args.streams)]
    await asyncio.sleep(0)
    steps = [[rng.randrange(100, vocab) for _ in range(args.streams)] for _ in range(args.steps)]
    profile = cProfile.Profile() if args.profile else None
    reader_s = 0.0
    start = time.perf_counter()
    for s, ids in enumerate(steps):
        finish = "length" if s == args.steps - 1 else None
        message = EngineOutputs([EngineCoreOutput(f"r{i}", [t], finish_reason=finish) for i, t in enumerate(ids)],
                                SchedulerStats(), time.time())
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        llm.on_engine_outputs(message)
        if profile is not None:
            profile.disable()
        reader_s += time.perf_counter() - t0
        await asyncio.sleep(0)  # the consumers take this step's updates
    await asyncio.gather(*consumers)
    tokens = args.streams * args.steps
    print(f"{args.streams} streams x {args.steps} steps: reader {1e6 * reader_s / tokens:.1f} us a token, "
          f"with the consumers {1e6 * (time.perf_counter() - start) / tokens:.1f}")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--profile", action="store_true")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
