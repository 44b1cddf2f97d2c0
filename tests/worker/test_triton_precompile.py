"""Start-up's Triton precompile, without a GPU: the discovery hook, the parallel compile's bookkeeping (with a
fake Triton runtime and fake kernels that queue work as Triton's `preload` does under its asynchronous compile
mode), the count of variants loaded late, and the graph forwards the discovery runs. The real compile and the
engine's start are tested on the GPU (tests/gpu/test_gpu_precompile.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvserve.kernels import triton_precompile
from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.worker.cuda_graph import CUDAGraphRunner

pytest.importorskip("triton.runtime._async_compile", reason="a Triton without the asynchronous compile mode")


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A fake `triton.knobs.runtime` and a fresh count of loaded variants."""
    fake = SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None)
    monkeypatch.setattr(triton_precompile, "_knobs", lambda: fake)
    monkeypatch.setattr(triton_precompile, "_loaded", [])
    monkeypatch.setattr(triton_precompile, "_watching", False)
    monkeypatch.setattr(triton_precompile.envs, "TRITON_INTERPRET", False)
    return fake


def _cache_hook_call(runtime: SimpleNamespace, kernel: object, spec: str) -> Any:
    """What Triton's launch does for a variant it has not loaded: ask the cache hook (True: skip it)."""
    info = SimpleNamespace(module="m", name=getattr(kernel, "name", "k"), jit_function=kernel)
    return runtime.jit_cache_hook(key=spec, repr=spec, fn=info, compile={"specialization_data": spec},
                                  is_manual_warmup=False, already_compiled=False)


def test_discover_records_each_variant_once_skips_it_and_restores_the_hook(runtime: SimpleNamespace) -> None:
    def previous(**kwargs: Any) -> bool:
        return False

    runtime.jit_cache_hook = previous
    a, b = object(), object()
    with triton_precompile.discover() as found:
        assert _cache_hook_call(runtime, a, "a1") is True  # Triton neither compiles nor launches it
        assert _cache_hook_call(runtime, a, "a1") is True
        assert _cache_hook_call(runtime, b, "b1") is True
        assert _cache_hook_call(runtime, a, "a2") is True
    assert found == {"a1": a, "b1": b, "a2": a}
    assert runtime.jit_cache_hook is previous


def test_discover_restores_the_hook_when_the_block_fails(runtime: SimpleNamespace) -> None:
    with pytest.raises(RuntimeError, match="boom"), triton_precompile.discover():
        raise RuntimeError("boom")
    assert runtime.jit_cache_hook is None


class FakeKernel:
    """Queues its compile as Triton's preload does under AsyncCompileMode; the finalize (main thread, at the
    mode's exit) calls the post-compile hook, as Triton's does."""

    def __init__(self, runtime: SimpleNamespace, name: str, fail: set[str] | None = None) -> None:
        self.runtime, self.name, self.fail = runtime, name, fail or set()
        self.compiled_on: dict[str, str] = {}
        self.cache: dict[str, str] = {}

    def preload(self, spec: str) -> None:
        from triton.runtime import _async_compile

        mode = _async_compile.active_mode.get()
        assert mode is not None, "compile_all must preload inside the asynchronous compile mode"

        def compile_fn() -> str:
            if spec in self.fail:
                raise RuntimeError(f"cannot compile {spec}")
            self.compiled_on[spec] = threading.current_thread().name
            return f"binary of {spec}"

        def finalize(binary: str) -> None:
            self.cache[spec] = binary
            hook = self.runtime.jit_post_compile_hook
            hook(key=spec, repr=spec, fn=SimpleNamespace(module="m", name=self.name, jit_function=self),
                 compile={}, is_manual_warmup=True, already_compiled=False)

        def cleanup(future_kernel: object) -> None:
            self.cache.pop(spec, None)

        self.cache[spec] = "pending"
        mode.submit(spec, compile_fn, finalize, cleanup)


def test_compile_all_compiles_on_worker_threads_and_counts_what_loaded(runtime: SimpleNamespace) -> None:
    kernel = FakeKernel(runtime, "attn", fail={"bad"})
    other = FakeKernel(runtime, "gemm")
    variants = {"v1": kernel, "v2": kernel, "bad": kernel, "g1": other}
    assert triton_precompile.compile_all(variants, workers=3) == 3  # the failing one is left out
    assert kernel.cache == {"v1": "binary of v1", "v2": "binary of v2"}
    assert other.cache == {"g1": "binary of g1"}
    threads = set(kernel.compiled_on.values()) | set(other.compiled_on.values())
    assert all(t.startswith("triton-compile") for t in threads), threads
    assert sorted(triton_precompile.loaded_since(0)) == ["attn", "attn", "gemm"]


def test_compile_all_goes_on_past_a_variant_that_cannot_be_queued(runtime: SimpleNamespace) -> None:
    class Unreadable:
        name = "old"

        def preload(self, spec: str) -> None:
            raise RuntimeError("specialization data for another target")

    good = FakeKernel(runtime, "good")
    assert triton_precompile.compile_all({"x": Unreadable(), "y": good}, workers=2) == 1
    assert good.cache == {"y": "binary of y"}


def test_watch_counts_loads_once_installed_and_chains_the_previous_hook(runtime: SimpleNamespace) -> None:
    seen: list[str] = []
    runtime.jit_post_compile_hook = lambda **kwargs: seen.append(kwargs["key"])
    assert triton_precompile.loaded_count() == 0
    assert triton_precompile.watch() is True
    hook = runtime.jit_post_compile_hook
    assert triton_precompile.watch() is True and runtime.jit_post_compile_hook is hook  # idempotent
    for key, name in (("k1", "rms_norm"), ("k2", "decode"), ("k3", "decode")):
        hook(key=key, fn=SimpleNamespace(name=name))
    assert seen == ["k1", "k2", "k3"]
    assert triton_precompile.loaded_count() == 3
    assert triton_precompile.loaded_since(1) == ["decode", "decode"]


def test_nothing_applies_under_the_interpreter(runtime: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_precompile.envs, "TRITON_INTERPRET", True)
    assert triton_precompile.available() is False
    assert triton_precompile.watch() is False
    assert runtime.jit_post_compile_hook is None


class RecordingModel:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, list[int], list[int]]] = []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: AttentionMetadata) -> torch.Tensor:
        slots = metadata.slot_mapping
        assert bool((slots == -1).all()), "a graph's forward must write nothing to the cache"
        self.calls.append((input_ids.shape[0], metadata.max_query_len, metadata.common_prefix_len,
                           list(metadata.query_start_loc_cpu), list(metadata.seq_lens_cpu)))
        return torch.zeros(input_ids.shape[0], 4)


def _runner(model: Callable[..., torch.Tensor], sizes: list[int], prefill: list[int], cache: list[int],
            cascade_min: int | None) -> CUDAGraphRunner:
    n = 512
    buffers = {name: torch.zeros(n, dtype=torch.int64) for name in ("input_ids", "positions", "slot_mapping")}
    buffers |= {"query_start_loc": torch.zeros(n + 1, dtype=torch.int32), "seq_lens": torch.zeros(n, dtype=torch.int32),
                "common_prefix_len": torch.zeros(1, dtype=torch.int32)}
    return CUDAGraphRunner(model, [], buffers, torch.zeros(n, 8, dtype=torch.int32), sizes, 1024,  # type: ignore[arg-type]
                           cascade_min_size=cascade_min, prefill_sizes=prefill, cache_prefill_sizes=cache)


def test_run_eagerly_runs_every_graph_forward_that_capture_captures() -> None:
    model = RecordingModel()
    runner = _runner(model, [1, 2, 4, 8, 16], prefill=[128, 256], cache=[128], cascade_min=8)
    keys: list[tuple[tuple[int, bool], bool]] = []
    runner._for_each_variant(lambda key, is_prefill, forward: keys.append((key, is_prefill)))
    assert keys == [((256, False), True), ((128, True), True), ((128, False), True),
                    ((16, True), False), ((16, False), False), ((8, True), False), ((8, False), False),
                    ((4, False), False), ((2, False), False), ((1, False), False)]
    runner.run_eagerly()
    assert [c[0] for c in model.calls] == [256, 128, 128, 16, 16, 8, 8, 4, 2, 1]
    assert model.calls[0][1:] == (256, 0, [0, 256], [256])  # one fresh prompt
    assert model.calls[1][1:] == (128, 0, [0, 127, 128], [128, 0])  # the cache graph: a request, then padding
    assert [c[2] for c in model.calls[3:]] == [1, 0, 1, 0, 0, 0, 0]  # cascade variants select the cascade kernels
    assert all(c[1] == 1 and c[4] == [1024] * c[0] for c in model.calls[3:])  # decode at max_model_len
