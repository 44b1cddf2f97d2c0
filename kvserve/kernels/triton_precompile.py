"""Triton kernel variants at start-up: found in one pass, compiled in parallel; late ones counted.

A Triton kernel compiles one variant per specialisation (constexpr values, dtypes, integer and pointer
specialisations, launch options) at its first launch with it, on the launching thread. On the H200's hosts
that is 0.2-1 s a variant, and the engine's warm-up and CUDA graph capture need several dozen of them, one
after another (docs/perf_notes.md, entry 29). So the engine starts in two passes:

* `discover()`: while it is active, a launch that needs a variant this process has not loaded records the
  variant and returns without compiling or launching (Triton's cache hook; launches of loaded variants run
  as usual). The torch ops around a skipped kernel run over whatever its output buffer held, so the pass
  must only feed such values to kernels and matmuls, never to host decisions. Running the start-up
  forwards under it lists the variants they need.
* `compile_all()`: compiles that list in a thread pool under Triton's asynchronous compile mode (Triton's
  compiler passes release the GIL and ptxas runs as a subprocess) and puts each result in its kernel's
  cache, as a first launch would have. The warm-up and capture that follow then find every variant loaded.

`watch()` installs a post-compile hook for the life of the process that counts every variant loaded
(compiled, or read from Triton's disk cache): the engine reports the ones loaded after its start (a variant
the warm-up missed stalls the step that first needs it), and the GPU tests assert there are none.

`available()` says whether this Triton has what the two passes need (its cache hooks, `preload` and the
asynchronous compile mode); without it the warm-up compiles one variant at a time, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserve import envs

logger = logging.getLogger(__name__)

# Variant specialisation (Triton's serialized form) -> the JIT function it belongs to.
Variants = dict[str, Any]


def _knobs() -> Any:
    from triton import knobs

    return knobs.runtime


def available() -> bool:
    """True when Triton can record variants and compile them ahead of their launch (not the interpreter)."""
    if envs.TRITON_INTERPRET:
        return False
    try:
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction

        runtime = _knobs()
    except ImportError:
        return False
    return (
        hasattr(runtime, "jit_cache_hook")
        and hasattr(runtime, "jit_post_compile_hook")
        and hasattr(JITFunction, "preload")
        and hasattr(_async_compile, "AsyncCompileMode")
    )


@contextlib.contextmanager
def discover() -> Iterator[Variants]:
    """Record, and skip, every launch of a variant this process has not loaded; yields the record (filled
    as the block runs). Any previous cache hook is set aside for the block and restored after it."""
    runtime = _knobs()
    previous = runtime.jit_cache_hook
    found: Variants = {}

    def hook(**kwargs: Any) -> bool:
        found.setdefault(kwargs["compile"]["specialization_data"], kwargs["fn"].jit_function)
        return True  # Triton then neither compiles nor launches

    runtime.jit_cache_hook = hook
    try:
        yield found
    finally:
        runtime.jit_cache_hook = previous


def default_workers() -> int:
    """Compile threads: KVSERVE_TRITON_PRECOMPILE_WORKERS, else the host's cores, at most 16 (each compile is
    mostly single-threaded)."""
    if envs.KVSERVE_TRITON_PRECOMPILE_WORKERS > 0:
        return envs.KVSERVE_TRITON_PRECOMPILE_WORKERS
    return max(1, min(16, os.cpu_count() or 1))


class _TimedPool(ThreadPoolExecutor):
    """A thread pool that records how long each submitted call ran (seconds, in `durations`)."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, thread_name_prefix="triton-compile")
        self.durations: list[float] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        def timed() -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with _lock:
                    self.durations.append(time.perf_counter() - start)

        return super().submit(timed)


def compile_all(variants: Variants, workers: int | None = None, durations: list[float] | None = None) -> int:
    """Compile `variants` on `workers` threads (default: `default_workers`) and load each into its kernel's
    cache. Returns how many were loaded; one that fails is left out (its first launch compiles it again
    and reports the error there). `durations`, if given, receives each compile's own seconds."""
    if not variants:
        return 0
    from triton.runtime._async_compile import AsyncCompileMode

    watch()
    before = loaded_count()
    with _TimedPool(workers or default_workers()) as pool:
        with AsyncCompileMode(pool, ignore_errors=True):
            for spec, kernel in variants.items():
                try:
                    kernel.preload(spec)
                except Exception:  # a specialisation this Triton cannot read back: compiled at its launch
                    logger.debug("could not queue a Triton variant of %s", getattr(kernel, "__name__", kernel),
                                 exc_info=True)
    if durations is not None:
        durations.extend(pool.durations)
    return loaded_count() - before


_lock = threading.Lock()
_loaded: list[str] = []  # kernel names, in the order this process loaded their variants (after `watch`)
_watching = False


def watch() -> bool:
    """Count every Triton variant this process loads from now on (idempotent; chains a hook set before).
    False where Triton has no post-compile hook."""
    global _watching
    with _lock:
        if _watching:
            return True
        if envs.TRITON_INTERPRET:
            return False
        try:
            runtime = _knobs()
        except ImportError:
            return False
        if not hasattr(runtime, "jit_post_compile_hook"):
            return False
        previous = runtime.jit_post_compile_hook

        def hook(**kwargs: Any) -> Any:
            fn = kwargs.get("fn")
            with _lock:
                _loaded.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?")))
            return previous(**kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        _watching = True
        return True


def loaded_count() -> int:
    """Variants loaded since `watch()` (0 before it)."""
    with _lock:
        return len(_loaded)


def loaded_since(count: int) -> list[str]:
    """Kernel names of the variants loaded after the `count`-th."""
    with _lock:
        return list(_loaded[count:])
