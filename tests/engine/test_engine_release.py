"""An `LLM` dropped (out of scope, `del`) frees its weights at once, by reference counting: a loaded model's
parameters keep no loader methods of their layers, whose reference cycles kept every dropped engine's weights
until the garbage collector's next full collection (which an engine's few Python objects seldom start)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.loader import release_load_hooks


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_dropped_llm_frees_its_weights_without_the_garbage_collector(
        arch: str, tiny_model_dir: Callable[..., str]) -> None:
    llm = LLM(tiny_model_dir(arch), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory="4MiB")
    llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    model = llm.engine.core.runner.model
    params = [weakref.ref(p) for p in model.parameters()]
    assert params and not [n for n, p in model.named_parameters() if hasattr(p, "weight_loader")]
    del model
    gc.disable()
    try:
        del llm
        assert [ref() is None for ref in params] == [True] * len(params)
    finally:
        gc.enable()


def test_release_load_hooks_drops_only_the_loading_attributes() -> None:
    import torch

    layer = torch.nn.Linear(4, 4)
    layer.weight.weight_loader = lambda *args: None  # type: ignore[attr-defined]
    layer.weight.dummy_fill = lambda *args: None  # type: ignore[attr-defined]
    layer.weight.shard_ids = (None,)  # type: ignore[attr-defined]
    release_load_hooks(layer)
    assert not hasattr(layer.weight, "weight_loader") and not hasattr(layer.weight, "dummy_fill")
    assert layer.weight.shard_ids == (None,)  # type: ignore[attr-defined]
