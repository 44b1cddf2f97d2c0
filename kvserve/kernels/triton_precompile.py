"""Triton kernel variants at start-up: found in one pass, then compiled on a thread pool; late ones counted.

A Triton kernel compiles one variant per specialisation (constexpr values, dtypes, integer and pointer
specialisations, launch options) at its first launch with it, on the launching thread. On the H200's hosts
that is 0.5-1 s a variant, and the engine's warm-up and CUDA graph capture need a few dozen of them, one after
another (docs/perf_notes.md, entry 29). So the engine runs its start-up forwards once under `Precompiler`
first:

* A launch that needs a variant this process has not loaded returns without compiling or launching (Triton's
  cache hook, asked only on a cache miss), and the variant is recorded. Launches of loaded variants run as
  usual. The torch ops around a skipped kernel run over whatever its output buffer held: the pass may feed
  such values to kernels and matmuls, never to host decisions or indices.
* Leaving the block compiles the recorded variants on a thread pool: each worker calls the kernel's
  `preload` with Triton's serialized specialisation, which compiles the variant as the launch would have and
  puts it in the kernel's cache. Triton's compiler releases the GIL in its MLIR passes and runs ptxas as a
  subprocess, so a few threads overlap most of the work (their Python code generation takes turns). The
  warm-up and capture that follow find every variant loaded.

Compiling while the forwards still run was measured too: the forwards then waited for the GIL and the start
took as long (entry 29).

`watch()` installs a post-compile hook for the life of the process that counts every variant loaded
(compiled, or read from Triton's disk cache): the engine reports the ones loaded after its start (a variant
the warm-up missed stalls the step that first needs it), and the GPU tests assert there are none.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from kvserve import envs

logger = logging.getLogger(__name__)


def _knobs() -> Any:
    from triton import knobs

    return knobs.runtime


def _compiled_runtime() -> Any | None:
    """Triton's runtime knobs where kernels compile (a Triton with its NVIDIA/AMD compiler, not the
    interpreter), else None."""
    if envs.TRITON_INTERPRET:
        return None
    try:
        return _knobs()
    except ImportError:
        return None


def available() -> bool:
    """True when Triton can skip a launch and compile its variant elsewhere (its cache hooks and `preload`;
    not the interpreter)."""
    runtime = _compiled_runtime()
    if runtime is None:
        return False
    from triton.runtime.jit import JITFunction

    return hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook") and hasattr(
        JITFunction, "preload"
    )


def default_workers() -> int:
    """Compile threads: KVSERVE_TRITON_PRECOMPILE_WORKERS, else the host's cores, at most 8 (more threads
    gained nothing on the H200's hosts: their Python code generation takes turns on the GIL)."""
    if envs.KVSERVE_TRITON_PRECOMPILE_WORKERS > 0:
        return envs.KVSERVE_TRITON_PRECOMPILE_WORKERS
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


_worker = threading.local()  # .compiling: this thread is a Precompiler worker inside `preload`
_active = threading.Lock()  # one Precompiler at a time in a process (the cache hook is process-wide)


class Precompiler:
    """While active (a context manager), launches from the entering thread of variants not loaded are
    skipped and recorded; the exit compiles the recorded variants on `workers` threads and waits for them
    (not when the block raised). Other threads' launches go on as usual (to a cache hook set before, if
    any), and a second Precompiler waits for the first to finish. Afterwards: `variants` (kernel names
    found, in order), `durations` (each compile's seconds), `failed` (names whose compile raised: their
    launch will compile them again and report the error there)."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self.variants: list[str] = []
        self.durations: list[float] = []
        self.failed: list[str] = []
        self._queued: list[tuple[Any, str, str, Any]] = []  # (kernel, name, specialisation, device)
        self._seen: set[str] = set()
        self._previous: Any = None
        self._owner: int | None = None

    def __enter__(self) -> Precompiler:
        watch()
        _active.acquire()
        try:
            runtime = _knobs()
            self._previous = runtime.jit_cache_hook
            self._owner = threading.get_ident()
            runtime.jit_cache_hook = self._hook
        except BaseException:
            _active.release()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is None and self._queued:
                with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="triton-compile") as pool:
                    wait([pool.submit(self._compile, *job) for job in self._queued])
        finally:
            _knobs().jit_cache_hook = self._previous
            _active.release()

    def _hook(self, **kwargs: Any) -> bool:
        if getattr(_worker, "compiling", False):
            return False  # a worker's preload: compile
        if threading.get_ident() != self._owner:  # someone else's launch: as without us
            return bool(self._previous(**kwargs)) if self._previous is not None else False
        spec = kwargs["compile"]["specialization_data"]
        if spec not in self._seen:
            self._seen.add(spec)
            info = kwargs["fn"]
            self.variants.append(info.name)
            self._queued.append((info.jit_function, info.name, spec, kwargs["compile"].get("device")))
        return True  # skip the launch (Triton neither compiles nor launches)

    def _compile(self, kernel: Any, name: str, spec: str, device: Any) -> None:
        start = time.perf_counter()
        _worker.compiling = True
        try:
            if isinstance(device, int):
                import torch

                # The current device is per thread: preload files the variant under the worker's, which must
                # be the one the launch looked it up under.
                torch.cuda.set_device(device)
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
_loaded: list[tuple[str, str]] = []  # (module, kernel name) of each variant this process loaded after `watch`
_keys: list[tuple[int, str]] = []  # (its index in _loaded, Triton's cache key: the specialisation) where given
_watching = False


def watch() -> bool:
    """Count every Triton variant this process loads from now on (idempotent; chains a hook set before).
    False where Triton has no post-compile hook."""
    global _watching
    with _lock:
        if _watching:
            return True
        runtime = _compiled_runtime()
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        previous = runtime.jit_post_compile_hook

        def hook(**kwargs: Any) -> Any:
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or str(kwargs.get("repr", "?"))
            with _lock:
                if kwargs.get("key") is not None:
                    _keys.append((len(_loaded), str(kwargs["key"])))
                _loaded.append((str(getattr(fn, "module", "")), name))
            return previous(**kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        _watching = True
        return True


def loaded_count() -> int:
    """Variants loaded since `watch()` (0 before it)."""
    with _lock:
        return len(_loaded)


def keys_since(count: int) -> list[str]:
    """Triton's cache keys (kernel signature and specialisation) of the variants loaded after the `count`-th:
    what tells two variants of one kernel apart when a late one is reported."""
    with _lock:
        return [key for index, key in _keys if index >= count]


def loaded_since(count: int, module_prefix: str = "") -> list[str]:
    """Kernel names of the variants loaded after the `count`-th (of kernels in modules named with
    `module_prefix`: the engine counts its own, not those of other Triton users in the process)."""
    with _lock:
        return [name for module, name in _loaded[count:] if module.startswith(module_prefix)]
