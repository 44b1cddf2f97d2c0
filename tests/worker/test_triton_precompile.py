"""Start-up's Triton precompile, without a GPU: skipped launches and their compiles on worker threads (a fake
Triton runtime and fake kernels that consult the cache hook as Triton's launch and `preload` do), the count of
variants loaded late, and the graph forwards the precompile runs. The real compile and the engine's start are
tested on the GPU (tests/gpu/test_gpu_precompile.py)."""

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


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A fake `triton.knobs.runtime` and a fresh count of loaded variants."""
    fake = SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None)
    monkeypatch.setattr(triton_precompile, "_knobs", lambda: fake)
    monkeypatch.setattr(triton_precompile, "_loaded", [])
    monkeypatch.setattr(triton_precompile, "_keys", [])
    monkeypatch.setattr(triton_precompile, "_watching", False)
    monkeypatch.setattr(triton_precompile.envs, "TRITON_INTERPRET", False)
    return fake


class FakeKernel:
    """What the precompile relies on in a Triton JIT function: a launch of a variant not in the cache asks the
    cache hook (True: skip), else compiles and caches it; `preload(spec)` goes the same way; a compile ends
    with the post-compile hook."""

    def __init__(self, runtime: SimpleNamespace, name: str, fail: set[str] | None = None) -> None:
        self.runtime, self.name, self.fail = runtime, name, fail or set()
        self.cache: dict[str, str] = {}
        self.compiled_on: dict[str, str] = {}
        self.ran: list[str] = []

    def _info(self) -> SimpleNamespace:
        return SimpleNamespace(module="m", name=self.name, jit_function=self)

    def _do_compile(self, spec: str) -> str | None:
        hook = self.runtime.jit_cache_hook
        if hook is not None and hook(key=spec, repr=spec, fn=self._info(), compile={"specialization_data": spec},
                                     is_manual_warmup=False, already_compiled=False):
            return None
        if spec in self.fail:
            raise RuntimeError(f"cannot compile {spec}")
        self.compiled_on[spec] = threading.current_thread().name
        self.cache[spec] = f"binary of {spec}"
        post = self.runtime.jit_post_compile_hook
        if post is not None:
            post(key=spec, repr=spec, fn=self._info(), compile={}, is_manual_warmup=False, already_compiled=False)
        return self.cache[spec]

    def launch(self, spec: str) -> None:
        if spec in self.cache or self._do_compile(spec) is not None:
            self.ran.append(spec)

    def preload(self, spec: str) -> str | None:
        return self._do_compile(spec)


def test_precompiler_skips_new_variants_then_compiles_each_once_on_workers_and_restores_the_hook(
    runtime: SimpleNamespace,
) -> None:
    def previous(**kwargs: Any) -> bool:
        return False

    runtime.jit_cache_hook = previous
    attn, gemm = FakeKernel(runtime, "attn"), FakeKernel(runtime, "gemm")
    with triton_precompile.Precompiler(workers=3) as pre:
        for spec in ("a1", "a1", "a2", "a1"):
            attn.launch(spec)
        gemm.launch("g1")
        assert attn.ran == [] and gemm.ran == []  # skipped
        assert attn.cache == {} and gemm.cache == {}  # and not compiled inside the block
    assert runtime.jit_cache_hook is previous
    assert pre.variants == ["attn", "attn", "gemm"] and pre.failed == [] and len(pre.durations) == 3
    assert attn.cache == {"a1": "binary of a1", "a2": "binary of a2"} and gemm.cache == {"g1": "binary of g1"}
    threads = set(attn.compiled_on.values()) | set(gemm.compiled_on.values())
    assert all(t.startswith("triton-compile") for t in threads), threads
    assert sorted(triton_precompile.loaded_since(0)) == ["attn", "attn", "gemm"]
    attn.launch("a1")  # now loaded: launches without a compile
    assert attn.ran == ["a1"] and triton_precompile.loaded_count() == 3


def test_a_variant_loaded_before_the_block_launches_inside_it(runtime: SimpleNamespace) -> None:
    kernel = FakeKernel(runtime, "norm")
    kernel.launch("n1")  # compiled and run before
    with triton_precompile.Precompiler(workers=2) as pre:
        kernel.launch("n1")
        kernel.launch("n2")
    assert kernel.ran == ["n1", "n1"] and pre.variants == ["norm"] and set(kernel.cache) == {"n1", "n2"}


def test_a_failed_compile_is_reported_and_the_others_load(runtime: SimpleNamespace) -> None:
    kernel = FakeKernel(runtime, "attn", fail={"bad"})
    with triton_precompile.Precompiler(workers=2) as pre:
        for spec in ("ok", "bad", "ok2"):
            kernel.launch(spec)
    assert pre.failed == ["attn"]
    assert set(kernel.cache) == {"ok", "ok2"}
    assert runtime.jit_cache_hook is None


def test_the_hook_is_restored_when_the_block_fails(runtime: SimpleNamespace) -> None:
    kernel = FakeKernel(runtime, "attn")
    with pytest.raises(RuntimeError, match="boom"), triton_precompile.Precompiler(workers=1):
        kernel.launch("x")
        raise RuntimeError("boom")
    assert runtime.jit_cache_hook is None
    assert kernel.cache == {}  # a failed pass compiles nothing (the warm-up will)


def test_other_threads_launch_as_usual_during_the_block(runtime: SimpleNamespace) -> None:
    asked: list[str] = []

    def previous(**kwargs: Any) -> bool:
        asked.append(kwargs["key"])
        return False

    runtime.jit_cache_hook = previous
    kernel = FakeKernel(runtime, "attn")
    with triton_precompile.Precompiler(workers=1) as pre:
        other = threading.Thread(target=kernel.launch, args=("theirs",))
        other.start()
        other.join()
        kernel.launch("ours")
        assert kernel.ran == ["theirs"] and asked == ["theirs"]  # compiled and run, through the hook set before
    assert pre.variants == ["attn"] and set(kernel.cache) == {"theirs", "ours"}


def test_a_second_precompiler_waits_for_the_first(runtime: SimpleNamespace) -> None:
    kernel = FakeKernel(runtime, "attn")
    entered = threading.Event()
    order: list[str] = []

    def second() -> None:
        entered.set()
        with triton_precompile.Precompiler(workers=1):
            order.append("second in")
            kernel.launch("b")

    with triton_precompile.Precompiler(workers=1) as first:
        thread = threading.Thread(target=second)
        thread.start()
        assert entered.wait(10)
        thread.join(0.2)
        assert thread.is_alive() and order == []  # blocked until the first exits
        kernel.launch("a")
        order.append("first out")
    thread.join(10)
    assert order == ["first out", "second in"]
    assert first.variants == ["attn"] and set(kernel.cache) == {"a", "b"}
    assert runtime.jit_cache_hook is None  # each restored what it found


def test_watch_counts_loads_once_installed_and_chains_the_previous_hook(runtime: SimpleNamespace) -> None:
    seen: list[str] = []
    runtime.jit_post_compile_hook = lambda **kwargs: seen.append(kwargs["key"])
    assert triton_precompile.loaded_count() == 0
    assert triton_precompile.watch() is True
    hook = runtime.jit_post_compile_hook
    assert triton_precompile.watch() is True and runtime.jit_post_compile_hook is hook  # idempotent
    for key, module, name in (("k1", "kvserve.kernels.a", "rms_norm"), ("k2", "kvserve.kernels.b", "decode"),
                              ("k3", "user_code", "decode")):
        hook(key=key, fn=SimpleNamespace(module=module, name=name))
    assert seen == ["k1", "k2", "k3"]
    assert triton_precompile.loaded_count() == 3
    assert triton_precompile.loaded_since(1) == ["decode", "decode"]
    assert triton_precompile.loaded_since(0, "kvserve.") == ["rms_norm", "decode"]
    assert triton_precompile.keys_since(1) == ["k2", "k3"]  # what tells a late variant's specialisation


def test_nothing_applies_under_the_interpreter(runtime: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_precompile.envs, "TRITON_INTERPRET", True)
    assert triton_precompile.available() is False
    assert triton_precompile.watch() is False
    assert runtime.jit_post_compile_hook is None


class RecordingModel:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, list[int], list[int]]] = []
        self.output_rows: list[list[int] | None] = []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: AttentionMetadata, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        slots = metadata.slot_mapping
        assert bool((slots == -1).all()), "a graph's forward must write nothing to the cache"
        self.calls.append((input_ids.shape[0], metadata.max_query_len, metadata.common_prefix_len,
                           list(metadata.query_start_loc_cpu), list(metadata.seq_lens_cpu)))
        self.output_rows.append(None if output_rows is None else output_rows.tolist())
        return torch.zeros(input_ids.shape[0] if output_rows is None else output_rows.shape[0], 4)


def _runner(model: Callable[..., torch.Tensor], sizes: list[int], prefill: list[int], cache: list[int],
            cascade_min: int | None) -> CUDAGraphRunner:
    n = 512
    buffers = {name: torch.zeros(n, dtype=torch.int64) for name in ("input_ids", "positions", "slot_mapping")}
    buffers |= {"query_start_loc": torch.zeros(n + 1, dtype=torch.int32), "seq_lens": torch.zeros(n, dtype=torch.int32),
                "common_prefix_len": torch.zeros(1, dtype=torch.int32),
                "logits_indices": torch.full((n,), 7, dtype=torch.int64)}
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
    # The prefill graphs return one row (the one logits_indices[0] names: 0 while capturing); decode, every row.
    assert model.output_rows == [[0]] * 3 + [None] * 7


def test_engine_reports_its_own_late_variants_only(
    tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvserve.config import EngineArgs
    from kvserve.engine.engine_core import EngineCore

    args = EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len=256, kv_cache_memory="8MiB")
    core = EngineCore(args.create_engine_config())
    assert core._variants_seen is None  # nothing counted off CUDA
    loaded = [("kvserve.kernels.triton_attention", "_paged_attention_kernel")]
    monkeypatch.setattr(triton_precompile, "_loaded", loaded)
    core._variants_seen = 1
    loaded.append(("user_code", "their_kernel"))
    core.step()  # an idle step: only another Triton user loaded a variant
    assert core.late_kernel_variants == [] and core._variants_seen == 2
    loaded.append(("kvserve.kernels.triton_gemm", "_skinny_gemm_kernel"))
    with caplog.at_level("WARNING"):
        core.step()
    assert core.late_kernel_variants == ["_skinny_gemm_kernel"] and core._variants_seen == 3
    assert "_skinny_gemm_kernel" in caplog.text
