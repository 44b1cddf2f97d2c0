"""A serving process's start-up heap and Python's garbage collector.

A process that has loaded a model holds hundreds of thousands of long-lived objects that the collector can
track: modules, compiled kernels, captured CUDA graphs, the tokenizer (about 329,000 in the engine-core
process of a 7B model on the H200). Serving allocates steadily, so every so often the collector runs a
full collection, which walks all of them with the engine loop stopped: 120-165 ms on the H200 host, against
steps of 5-10 ms (docs/perf_notes.md, entry 45). Every running request's next token waits that long.

`freeze_startup_heap` moves what is alive once start-up is done into the collector's permanent generation
(`gc.freeze`), so later full collections walk only what serving itself made (9-15 ms there). Reference
counting still frees frozen objects as usual, but a reference cycle that passes through a frozen object is
never collected (even one that later objects join). That costs nothing while the start-up state lives as
long as the process, as it does in the two serving processes that call this: the engine core once the
engine is built (also under `AsyncLLM` outside the server), the API server once it is ready to serve. The
offline `LLM` API does not, since it runs in the caller's own process, where engines may be made and
dropped many times.

`frozen_heap` does the same for a block of code and thaws afterwards (where it can, see there): `kvserve
bench` runs each measured load inside it, since its client process holds the tokenizer's and torch's
objects too, and a full collection there stopped the client's event loop for 190-265 ms on the H200 host,
which the run then reported as inter-token gaps of the server (entry 46). `CollectionTimer` times the
collections themselves (the bench client's health report and the engine benchmarks use it).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

from kvserve import envs

logger = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Collect, then freeze every object alive now (see the module docstring). Returns how many objects
    were frozen: 0 when KVSERVE_GC_FREEZE is off."""
    if not envs.KVSERVE_GC_FREEZE:
        return 0
    start = time.perf_counter()
    gc.collect()
    before = gc.get_freeze_count()
    gc.freeze()
    frozen = gc.get_freeze_count() - before
    logger.info("%s: %d start-up objects left out of the garbage collector's full collections (%.0f ms)",
                process, frozen, (time.perf_counter() - start) * 1e3)
    return frozen


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """Collect and freeze every object alive now for the block. Yields how many objects the freeze added (0,
    doing nothing, when KVSERVE_GC_FREEZE is off). Afterwards it thaws them all, unless the process had
    frozen objects of its own before (some interpreter set-ups freeze a few hundred at start): `gc` thaws
    all or nothing, so theirs stay frozen and so do the block's."""
    if not envs.KVSERVE_GC_FREEZE:
        yield 0
        return
    gc.collect()
    before = gc.get_freeze_count()  # after the collection, which may free frozen objects through finalizers
    gc.freeze()
    try:
        yield gc.get_freeze_count() - before
    finally:
        if not before:
            gc.unfreeze()


class CollectionTimer:
    """Times each garbage collection of this process between `start()` and `stop()` (or inside `with`):
    `collections` gets (its start on `time.perf_counter()`, its generation, its seconds). A collection
    already under way at `start()` is not timed."""

    def __init__(self) -> None:
        self.collections: list[tuple[float, int, float]] = []
        self._began: float | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.collections.append((self._began, info["generation"], time.perf_counter() - self._began))
            self._began = None

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def __enter__(self) -> CollectionTimer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
