"""Host time of the scheduler's steady decode step on this machine's CPU: `Scheduler.schedule` (with the
deferred block caching's flush) and `update_from_output` for N running requests, no model (each step's
sampled ids are random). Prints milliseconds a step; `--profile` adds cProfile's top functions.

  python benchmarks/scheduler_cost.py --requests 256 --steps 200
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.config import SchedulerConfig  # noqa: E402
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from kvserve.core.request import Request  # noqa: E402
from kvserve.core.scheduler import Scheduler  # noqa: E402
from kvserve.protocol.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=880)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    config = SchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=8192, max_model_len=8192)
    scheduler = Scheduler(config, num_blocks=args.requests * (args.prompt_len + args.steps + 200) // 16 + 64,
                          block_size=16, enable_prefix_caching=True)
    rng = random.Random(0)
    for i in range(args.requests):
        prompt = [rng.randrange(1, 40000) for _ in range(args.prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(ignore_eos=True), eos_token_ids=[2],
                                      max_tokens=args.steps + 100))

    def finish(step: SchedulerOutput) -> None:
        ids = [s.req_id for s in step.scheduled if s.sample]
        sampled = [rng.randrange(3, 40000) for _ in ids]
        scheduler.update_from_output(step, ModelRunnerOutput(ids, sampled, [None] * len(ids)))

    # Prefill and settle into steady decode, one step in flight as under async scheduling.
    previous = scheduler.schedule()
    scheduler.cache_scheduled_blocks()
    for _ in range(args.prompt_len * args.requests // 8192 + 20):
        step = scheduler.schedule()
        scheduler.cache_scheduled_blocks()
        finish(previous)
        previous = step
    profiler = cProfile.Profile() if args.profile else None
    schedule_s = update_s = 0.0
    for _ in range(args.steps):
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        step = scheduler.schedule()
        scheduler.cache_scheduled_blocks()
        t1 = time.perf_counter()
        finish(previous)
        t2 = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        schedule_s += t1 - t0
        update_s += t2 - t1
        previous = step
    print(f"{args.requests} running requests: schedule {schedule_s / args.steps * 1e3:.3f} ms, update_from_output "
          f"{update_s / args.steps * 1e3:.3f} ms a step ({len(step.scheduled)} scheduled in the last)")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
