"""What a pytest-xdist worker process (`make test` runs the suite in TEST_WORKERS of them) needs to know."""

from __future__ import annotations

import os
from collections.abc import Mapping


def worker_index(env: Mapping[str, str] = os.environ) -> int | None:
    """This process's pytest-xdist worker number (PYTEST_XDIST_WORKER="gw3" -> 3), None outside xdist."""
    name = env.get("PYTEST_XDIST_WORKER", "")
    if not name.startswith("gw") or not name[2:].isdigit():
        return None
    return int(name[2:])


def worker_threads(env: Mapping[str, str], cores: int) -> int | None:
    """The torch threads of one worker: its share of `cores`, so that the workers' threads (and those of the
    servers they start, through OMP_NUM_THREADS) do not outnumber the cores. None outside xdist or when
    OMP_NUM_THREADS is set (the user's choice)."""
    if worker_index(env) is None or "OMP_NUM_THREADS" in env:
        return None
    workers = env.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not workers.isdigit() or int(workers) < 1:
        return None
    return max(1, cores // int(workers))


applied_threads: int | None = None  # what `share_the_cores` set in this process


def share_the_cores() -> int | None:
    """In an xdist worker: set its torch threads and OMP_NUM_THREADS (for the servers it starts) to
    `worker_threads`; returns what it set (None: nothing). Called once, from tests/conftest.py."""
    global applied_threads
    import torch

    threads = worker_threads(os.environ, len(os.sched_getaffinity(0)))
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        applied_threads = threads
    return threads
