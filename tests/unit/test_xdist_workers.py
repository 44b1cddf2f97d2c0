"""helpers.xdist: the worker number, and each worker's share of the cores."""

from __future__ import annotations

import os

import torch
from helpers import xdist
from helpers.xdist import worker_index, worker_threads


def test_worker_names() -> None:
    for name, index in [("gw0", 0), ("gw11", 11), ("master", None), ("gwx", None), ("", None)]:
        assert worker_index({"PYTEST_XDIST_WORKER": name}) == index
    assert worker_index({}) is None


def test_each_worker_gets_its_share_of_the_cores() -> None:
    def threads(worker_count: str, cores: int, **extra: str) -> int | None:
        return worker_threads({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": worker_count, **extra},
                              cores)

    assert threads("2", 2) == 1
    assert threads("2", 16) == 8
    assert threads("4", 2) == 1  # at least one
    assert threads("2", 16, OMP_NUM_THREADS="3") is None  # the user's choice stands
    assert threads("", 16) is None
    assert worker_threads({"PYTEST_XDIST_WORKER_COUNT": "2"}, 16) is None  # not a worker


def test_this_worker_runs_its_share() -> None:
    """What tests/conftest.py applied to this process (under `make test`: a worker of two, one thread each on
    CI's 2 cores)."""
    if xdist.applied_threads is None:
        assert worker_index() is None or "PYTEST_XDIST_WORKER_COUNT" not in os.environ or \
            os.environ.get("OMP_NUM_THREADS") is not None
        return
    assert xdist.applied_threads == max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    assert torch.get_num_threads() == xdist.applied_threads
    assert os.environ["OMP_NUM_THREADS"] == str(xdist.applied_threads)
