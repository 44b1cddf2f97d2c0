"""Triton kernel variants at start-up: compiled on a thread pool as the start-up forwards find them; late ones
counted.

A Triton kernel compiles one variant per specialisation (constexpr values, dtypes, integer and pointer
specialisations, launch options) at its first launch with it, on the launching thread. On the H200's hosts
that is 0.5-1 s a variant, and the engine's warm-up and CUDA graph capture need a few dozen of them, one after
another (docs/perf_notes.md, entry 29). So the engine runs its start-up forwards once under `Precompiler`
first:

* A launch that needs a variant this process has not loaded returns without compiling or launching (Triton's
  cache hook, asked only on a cache miss), and the variant's compile starts at once on the pool: a worker
  calls the kernel's `preload` with Triton's serialized specialisation, which compiles it as the launch would
  have and puts it in the kernel's cache. Launches of loaded variants (earlier ones, or ones a worker has
  finished) run as usual.
* The torch ops around a skipped kernel run over whatever its output buffer held: the pass may feed such
  values to kernels and matmuls, never to host decisions or indices.
* Leaving the block waits for the compiles. The warm-up and capture that follow find every variant loaded.

Triton's compiler releases the GIL in its MLIR passes and runs ptxas as a subprocess, so a few threads
overlap most of the work (their Python code generation still takes turns).

`watch()` installs a post-compile hook for the life of the process that counts every variant loaded
(compiled, or read from Triton's disk cache): the engine reports the ones loaded after its start (a variant
the warm-up missed stalls the step that first needs it), and the GPU tests assert there are none.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from kvserve import envs

logger = logging.getLogger(__name__)


def _knobs() -> Any:
    from triton import knobs

    return knobs.runtime


def available() -> bool:
    """True when Triton can skip a launch and compile its variant elsewhere (its cache hooks and `preload`;
    not the interpreter)."""
    if envs.TRITON_INTERPRET:
        return False
    try:
        from triton.runtime.jit import JITFunction

        runtime = _knobs()
    except ImportError:
        return False
    return hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook") and hasattr(
        JITFunction, "preload"
    )


def default_workers() -> int:
    """Compile threads: KVSERVE_TRITON_PRECOMPILE_WORKERS, else the host's cores, at most 8 (more threads
    gained nothing on the H200's hosts: their Python code generation takes turns on the GIL)."""
    if envs.KVSERVE_TRITON_PRECOMPILE_WORKERS > 0:
        return envs.KVSERVE_TRITON_PRECOMPILE_WORKERS
    return max(1, min(8, os.cpu_count() or 1))


# Benchmarks' A/B switches (see `Precompiler`).
OVERLAP = True
SWITCH_INTERVAL_S = 0.0

_worker = threading.local()  # .compiling: this thread is a Precompiler worker inside `preload`


class Precompiler:
    """While active (a context manager), launches of variants not loaded are skipped and compiled on
    `workers` threads; the exit waits for the compiles. Afterwards: `variants` (kernel names found, in
    order), `durations` (each compile's seconds), `failed` (names whose compile raised: their launch will
    compile them again and report the error there)."""

    def __init__(self, workers: int | None = None, device_index: int | None = None, overlap: bool | None = None,
                 switch_interval_s: float | None = None) -> None:
        self.workers = workers or default_workers()
        # Compile while the block still runs (True), or queue the variants and compile them at exit.
        self.overlap = OVERLAP if overlap is None else overlap
        # The interpreter's GIL switch interval inside the block (None: as it is).
        self.switch_interval_s = SWITCH_INTERVAL_S if switch_interval_s is None else switch_interval_s
        self._queued: list[tuple[Any, str, str]] = []
        self._saved_interval: float | None = None
        self.device_index = device_index
        self.variants: list[str] = []
        self.durations: list[float] = []
        self.failed: list[str] = []
        self._seen: set[str] = set()
        self._futures: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._previous: Any = None

    def __enter__(self) -> Precompiler:
        watch()
        runtime = _knobs()
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="triton-compile")
        self._previous = runtime.jit_cache_hook
        runtime.jit_cache_hook = self._hook
        if self.switch_interval_s:
            self._saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval_s)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            assert self._pool is not None
            for job in self._queued:
                self._futures.append(self._pool.submit(self._compile, *job))
            wait(self._futures)
        finally:
            _knobs().jit_cache_hook = self._previous
            if self._saved_interval is not None:
                sys.setswitchinterval(self._saved_interval)
            assert self._pool is not None
            self._pool.shutdown(wait=True)

    def _hook(self, **kwargs: Any) -> bool:
        if getattr(_worker, "compiling", False):
            return False  # a worker's preload: compile
        spec = kwargs["compile"]["specialization_data"]
        if spec not in self._seen:
            self._seen.add(spec)
            info = kwargs["fn"]
            self.variants.append(info.name)
            assert self._pool is not None
            if self.overlap:
                self._futures.append(self._pool.submit(self._compile, info.jit_function, info.name, spec))
            else:
                self._queued.append((info.jit_function, info.name, spec))
        return True  # skip the launch (Triton neither compiles nor launches)

    def _compile(self, kernel: Any, name: str, spec: str) -> None:
        start = time.perf_counter()
        _worker.compiling = True
        try:
            if self.device_index is not None:
                import torch

                torch.cuda.set_device(self.device_index)  # (the current device is per thread)
            kernel.preload(spec)
        except Exception:
            logger.debug("precompiling a Triton variant of %s failed", name, exc_info=True)
            with _lock:
                self.failed.append(name)
        finally:
            _worker.compiling = False
            with _lock:
                self.durations.append(time.perf_counter() - start)


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
