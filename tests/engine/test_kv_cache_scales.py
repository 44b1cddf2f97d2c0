"""Checkpoint KV-cache scales (`model.layers.N.self_attn.k_scale` / `v_scale` and the other names vLLM reads), as
checkpoints exported for vLLM's fp8 KV cache carry them: each layer's go to its attention and scale an fp8
cache; a cache in the model's dtype loads them and leaves them unused (scales of 1.0, as vLLM); a scale that is
not one positive finite value is refused, naming the tensor; an llm-compressor export of the KV cache alone
(compressed-tensors config, no config_groups) loads as dense weights with its scales.

The oracle (tests/helpers/kv_scales.py): a copy M' of a tiny random checkpoint M whose layer i has K scaled by
c_k[i] and V by c_v[i] (q_proj and o_proj divided to match: powers of two, so M' computes M's function bit for
bit) and carries c_k / c_v as its KV-cache scales. An fp8 cache that applies them stores K' / c_k = K, exactly
what M's fp8 cache with scales of 1.0 stores, and reads back c_k times it, which q' = q / c_k undoes exactly:
M' must reproduce M's fp8 run token for token and logprob for logprob. Were the scales ignored (or a layer's
given to another layer, or K's to V), the cache would hold K' or V' (or values 2^8 times too large): past
e4m3's 448 for most values, and outputs move by whole nats (checked: the oracle can fail).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.engine_runs import greedy_with_logprobs, top_logprobs
from helpers.kv_scales import SCALE_NAMES, write_scaled_checkpoint

from kvserve.config import EngineArgs, ModelConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.model.loader import load_model
from kvserve.model.paths import ModelLoadError
from kvserve.protocol.sampling_params import SamplingParams

MAX_TOKENS = 16
# Per layer of the 3-layer bare checkpoint, K's and V's factors (= their scales): any two layers' differ by 2^8 or
# more in K's or in V's, and a layer's K and V by 2^16 unless equal, so that a scale given to another layer, or
# K's to V, leaves K or V 2^8 times too large in the cache: saturated (|K|, |V| ~ 1 in M, up to about 5).
K_FACTORS = (2.0**16, 2.0**8, 1.0)
V_FACTORS = (1.0, 2.0**8, 2.0**16)


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from helpers.tiny_models import make_bare_checkpoint

    return make_bare_checkpoint(str(tmp_path_factory.mktemp("kv-scales")), "llama", seed=0)


@pytest.fixture(scope="module")
def scaled_checkpoints(bare_checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """(names, k_factors, v_factors) -> M' carrying its scales under `names` (None: without them), built once."""
    made: dict[tuple, str] = {}

    def make(names: str | None = "k_v_scale", k_factors: tuple = K_FACTORS, v_factors: tuple = V_FACTORS) -> str:
        key = (names, k_factors, v_factors)
        if key not in made:
            directory = tmp_path_factory.mktemp("scaled") / "m"
            made[key] = write_scaled_checkpoint(bare_checkpoint, str(directory), k_factors, v_factors, names)
        return made[key]

    return make


@pytest.fixture(scope="module")
def plain_runs(bare_checkpoint: str) -> Callable[[str], list]:
    """--kv-cache-dtype -> M's run (`_run`), run once."""
    runs: dict[str, list] = {}

    def run(kv_cache_dtype: str) -> list:
        if kv_cache_dtype not in runs:
            runs[kv_cache_dtype] = _run(_core(bare_checkpoint, kv_cache_dtype))
        return runs[kv_cache_dtype]

    return run


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 1024, (40,), generator=generator).tolist()
    own = [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (5, 33, 70)]
    return [*own, shared + [5, 6, 7], shared]


def _core(path: str, kv_cache_dtype: str) -> EngineCore:
    args = EngineArgs(model=path, device="cpu", kv_cache_dtype=kv_cache_dtype, max_model_len=256, num_kv_blocks=128,
                      max_num_batched_tokens=64, block_size=16)
    return EngineCore(args.create_engine_config())


def _layer_scales(core_or_model: Any) -> list[tuple[float, float]]:
    model = core_or_model.runner.model if isinstance(core_or_model, EngineCore) else core_or_model
    return [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in model.model.layers]


def _run(core: EngineCore) -> list[tuple[list[int], list[dict[int, float]]]]:
    return [(tokens, [top_logprobs(lp) for lp in lps]) for tokens, lps in greedy_with_logprobs(core, _prompts(), MAX_TOKENS)]


def _largest_gap(got: list, want: list) -> float:
    """The largest top-logprob difference over the steps before the first parting token (inf where the top
    candidates differ)."""
    largest = 0.0
    for (got_tokens, got_lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        for step, (a, b) in enumerate(zip(got_tokens, want_tokens, strict=True)):
            mine, theirs = got_lps[step], want_lps[step]
            if mine.keys() != theirs.keys():
                return math.inf
            largest = max(largest, *(abs(mine[t] - theirs[t]) for t in mine))
            if a != b:
                break
    return largest


# ------------------------------------------------------------------------------------------ the engine


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("names", ["k_v_scale", "output_scale"])
def test_fp8_cache_uses_each_layers_checkpoint_scales(plain_runs: Callable[[str], list],
                                                      scaled_checkpoints: Callable[..., str], kv_cache_dtype: str,
                                                      names: str) -> None:
    core = _core(scaled_checkpoints(names), kv_cache_dtype)
    assert _layer_scales(core) == list(zip(K_FACTORS, V_FACTORS, strict=True))
    assert _run(core) == plain_runs(kv_cache_dtype)  # exactly M's fp8 run: see the module docstring


def test_ignoring_the_scales_would_show(plain_runs: Callable[[str], list], scaled_checkpoints: Callable[..., str]) -> None:
    """The oracle can fail: M' with scales of 1.0 (its checkpoint without them), or with its scales given to the
    wrong layers or K's to V, saturates e4m3 and moves logprobs by whole nats against M's fp8 run."""
    want = plain_runs("fp8")
    unscaled = _core(scaled_checkpoints(None), "fp8")
    assert _layer_scales(unscaled) == [(1.0, 1.0)] * 3
    assert _largest_gap(_run(unscaled), want) > 1.0
    for mixed_up in ([(K_FACTORS[(i + 1) % 3], V_FACTORS[(i + 1) % 3]) for i in range(3)],  # the next layer's
                     list(zip(V_FACTORS, K_FACTORS, strict=True))):  # K's and V's swapped
        core = _core(scaled_checkpoints(), "fp8")
        for layer, (k, v) in zip(core.runner.model.model.layers, mixed_up, strict=True):
            layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale = k, v
        assert _largest_gap(_run(core), want) > 1.0


def test_auto_cache_loads_the_scales_and_leaves_them_unused(plain_runs: Callable[[str], list],
                                                            scaled_checkpoints: Callable[..., str],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """vLLM: with an unquantized cache the scales are 1.0, whatever the checkpoint carries. The same tokens
    and logprobs as the same checkpoint without scales (and as M: M' is M's function exactly)."""
    with caplog.at_level(logging.INFO, logger="kvserve.model.loader"):
        core = _core(scaled_checkpoints(), "auto")
    assert "KV-cache scales (3 of 3 layers) are loaded and not used" in caplog.text
    assert core.runner.kv_caches[0].dtype == torch.float32
    assert _layer_scales(core) == [(1.0, 1.0)] * 3
    assert [layer.self_attn.attn.checkpoint_kv_scales for layer in core.runner.model.model.layers] == list(
        zip(K_FACTORS, V_FACTORS, strict=True))
    got = _run(core)
    assert got == _run(_core(scaled_checkpoints(None), "auto"))
    assert got == plain_runs("auto")


def test_one_kv_scale_scales_k_and_v(plain_runs: Callable[[str], list], scaled_checkpoints: Callable[..., str]) -> None:
    """The older exports' single `kv_scale` a layer: both K's and V's scale (vLLM duplicates it)."""
    factors = (2.0**10, 2.0**8, 2.0**12)
    core = _core(scaled_checkpoints("kv_scale", factors, factors), "fp8")
    assert _layer_scales(core) == [(f, f) for f in factors]
    assert _run(core) == plain_runs("fp8")


def test_fp8_cache_on_two_ranks_uses_the_scales(tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    """Tensor parallelism: the scales are per layer, the same on every rank (each holds its KV heads); two ranks
    with M' and its scales give exactly M's two-rank fp8 run."""
    from kvserve import LLM

    plain = tiny_model_dir("llama")
    scaled = write_scaled_checkpoint(plain, str(tmp_path / "m"), (2.0**9, 2.0**11), (2.0**10, 2.0**7))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = ["Hello, my name is", "The three most important inventions of the twentieth century were"]
    runs = []
    for path in (plain, scaled):
        llm = LLM(path, dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory="16MiB",
                  kv_cache_dtype="fp8", max_num_batched_tokens=32)
        try:
            runs.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                         for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------ loading


def _load(path: str, kv_cache_dtype: torch.dtype | None = torch.float8_e4m3fn) -> Any:
    config = ModelConfig(model=path, tokenizer=path, dtype="float32", max_model_len=64)
    return load_model(config, torch.device("cpu"), kv_cache_dtype)


def _with_tensors(src: str, dst: Path, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of checkpoint `src` with `tensors` added."""
    from safetensors.torch import load_file, save_file

    path = write_scaled_checkpoint(src, str(dst), (1.0, 1.0), (1.0, 1.0), names=None)  # factors 1: the same model
    file = f"{path}/model.safetensors"
    save_file({**load_file(file), **tensors}, file)
    return path


@pytest.mark.parametrize("names", sorted(SCALE_NAMES))
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_every_export_naming_reaches_its_layer(tiny_model_dir: Callable[..., str], tmp_path: Path, names: str,
                                               scale_dtype: torch.dtype) -> None:
    k, v = (0.5, 4.0), (2.0, 0.125)
    if names == "kv_scale":
        v = k
    path = write_scaled_checkpoint(tiny_model_dir("qwen2"), str(tmp_path / "m"), k, v, names, scale_dtype)
    assert _layer_scales(_load(path)) == list(zip(k, v, strict=True))
    assert _layer_scales(_load(path, torch.float8_e5m2)) == list(zip(k, v, strict=True))
    model = _load(path, None)  # the model's dtype: 1.0, the checkpoint's kept aside
    assert _layer_scales(model) == [(1.0, 1.0)] * 2
    assert [layer.self_attn.attn.checkpoint_kv_scales for layer in model.model.layers] == list(zip(k, v, strict=True))


def test_scale_of_one_element_and_k_scale_alone(tiny_model_dir: Callable[..., str], tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A one-element [1] tensor is a scale (vLLM reads it); a layer with a k_scale and no v_scale uses it for
    both (vLLM duplicates it); a layer without scales uses 1.0, with a warning naming how many have them."""
    path = _with_tensors(tiny_model_dir("llama"), tmp_path / "m", {
        "model.layers.0.self_attn.k_scale": torch.tensor([0.25]),
        "model.layers.0.self_attn.v_scale": torch.tensor([[8.0]]),
        "model.layers.1.self_attn.k_scale": torch.tensor(2.0),
    })
    assert _layer_scales(_load(path)) == [(0.25, 8.0), (2.0, 2.0)]
    path = _with_tensors(tiny_model_dir("llama"), tmp_path / "m2", {"model.layers.1.self_attn.kv_scale": torch.tensor(3.0)})
    with caplog.at_level(logging.INFO, logger="kvserve.model.loader"):
        assert _layer_scales(_load(path)) == [(1.0, 1.0), (3.0, 3.0)]
    assert "KV-cache scales for 1 of 2 layers" in caplog.text and "uses 1.0" in caplog.text


@pytest.mark.parametrize("value, message", [
    (torch.tensor(0.0), r"of 0\.0: a scale must be a positive finite number"),
    (torch.tensor(-0.5), "of -0.5: a scale must be a positive finite number"),
    (torch.tensor(float("nan")), "of nan: a scale must be"),
    (torch.tensor(float("inf")), "of inf: a scale must be"),
    (torch.tensor([0.5, 0.25]), r"of shape \(2,\): only per-tensor scales \(one value per layer\) are supported"),
    (torch.ones(2, 16), r"of shape \(2, 16\)"),
], ids=["zero", "negative", "nan", "inf", "per-head", "per-channel"])
@pytest.mark.parametrize("kv_cache_dtype", [torch.float8_e4m3fn, None], ids=["fp8", "auto"])
def test_bad_scales_are_refused_naming_the_tensor(tiny_model_dir: Callable[..., str], tmp_path: Path,
                                                  value: torch.Tensor, message: str,
                                                  kv_cache_dtype: torch.dtype | None) -> None:
    """Whatever the cache: a checkpoint with a broken scale is broken."""
    path = _with_tensors(tiny_model_dir("llama"), tmp_path / "m", {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.5),
        "model.layers.1.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.1.self_attn.v_scale": value,
    })
    with pytest.raises(ValueError, match=rf"checkpoint tensor 'model\.layers\.1\.self_attn\.v_scale' is a KV-cache "
                                         rf"scale {message}"):
        _load(path, kv_cache_dtype)


@pytest.mark.parametrize("tensors, message", [
    ({"model.layers.1.self_attn.v_scale": 2.0},
     r"'model\.layers\.1\.self_attn\.v_scale' is layer 1's v_scale, but the checkpoint has no k_scale for the layer"),
    ({"model.layers.0.self_attn.kv_scale": 2.0, "model.layers.0.self_attn.k_scale": 2.0},
     "layer 0 has both a kv_scale and a k_scale / v_scale in the checkpoint"),
    ({"model.layers.0.self_attn.k_scale": 2.0, "model.layers.0.self_attn.k_proj.output_scale": 2.0},
     r"checkpoint tensors 'model\.layers\.0\.self_attn\.k_proj\.output_scale' and "
     r"'model\.layers\.0\.self_attn\.k_scale' are both layer 0's k_scale"),  # in the file's (sorted) order
    ({"model.layers.2.self_attn.k_scale": 2.0},  # past the model's 2 layers: no parameter of it
     r"checkpoint tensor 'model\.layers\.2\.self_attn\.k_scale' matches no parameter"),
    ({"model.layers.0.self_attn.q_proj.output_scale": 2.0},  # a query scale: not a KV-cache scale
     r"'model\.layers\.0\.self_attn\.q_proj\.output_scale' matches no parameter"),
], ids=["v-without-k", "kv-and-k", "k-twice", "no-such-layer", "q-scale"])
def test_inconsistent_scales_are_refused(tiny_model_dir: Callable[..., str], tmp_path: Path,
                                         tensors: dict[str, float], message: str) -> None:
    path = _with_tensors(tiny_model_dir("llama"), tmp_path / "m", {k: torch.tensor(v) for k, v in tensors.items()})
    with pytest.raises(ModelLoadError, match=message):
        _load(path)


# ------------------------------------------------------------------------------------------ KV-cache-only configs

# config.json's quantization_config of an llm-compressor (compressed-tensors) export that quantizes the KV cache
# alone: dense weights, the scales beside them.
KV_ONLY = {"quant_method": "compressed-tensors", "config_groups": {}, "format": "dense",
           "quantization_status": "compressed", "ignore": ["lm_head"],
           "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                               "symmetric": True, "group_size": None}}


def _with_quant_config(src: str, dst: Path, quant: dict[str, Any]) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return str(dst)


@pytest.mark.parametrize("names", ["output_scale", "k_v_scale"])
def test_a_kv_cache_only_compressed_tensors_checkpoint_loads(plain_runs: Callable[[str], list],
                                                             scaled_checkpoints: Callable[..., str], tmp_path: Path,
                                                             names: str) -> None:
    """Its quantization_config names compressed-tensors, otherwise refused (fp8 weights): with no config_groups
    and a kv_cache_scheme vLLM reads, the weights are dense and the scales scale the fp8 cache (vLLM alike)."""
    path = _with_quant_config(scaled_checkpoints(names), tmp_path / "m", KV_ONLY)
    core = _core(path, "fp8")
    assert core.runner.model.arch.quantization is None
    assert _layer_scales(core) == list(zip(K_FACTORS, V_FACTORS, strict=True))
    assert _run(core) == plain_runs("fp8")


@pytest.mark.parametrize("scheme, shown", [
    ({"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True}, "'type': 'int'"),
    ({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}, "'strategy': 'channel'"),
    ({"num_bits": 8, "type": "float", "strategy": "attn_head", "symmetric": True}, "'strategy': 'attn_head'"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": False}, "'symmetric': False"),
    ({"num_bits": 4, "type": "float", "strategy": "tensor", "symmetric": True}, "'num_bits': 4"),
], ids=["int8", "per-channel", "per-head", "asymmetric", "fp4"])
def test_kv_cache_schemes_vllm_does_not_read_are_refused(tiny_model_dir: Callable[..., str], tmp_path: Path,
                                                         scheme: dict[str, Any], shown: str) -> None:
    from kvserve.model.arch import load_arch_config

    path = _with_quant_config(tiny_model_dir("llama"), tmp_path / "m", {**KV_ONLY, "kv_cache_scheme": scheme})
    with pytest.raises(ModelLoadError, match=rf"config\.json: kv_cache_scheme .*{shown}.* is not supported: the "
                                             "KV-cache scales of an fp8 KV cache are 8-bit float, symmetric, one per"):
        load_arch_config(path)


def test_weights_beside_the_kv_cache_scheme(tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    """fp8 weights beside the KV-cache scheme are an fp8 checkpoint (tests/engine/test_fp8_checkpoints.py), whose
    scheme is checked as well; 4-bit integer weights are still refused."""
    from kvserve.model.arch import load_arch_config

    fp8 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}
    quant = {**KV_ONLY, "format": "float-quantized", "config_groups": fp8}
    path = _with_quant_config(tiny_model_dir("llama"), tmp_path / "fp8", quant)
    arch = load_arch_config(path)
    assert arch.quantization is not None and arch.quantization.method == "fp8"
    bad_scheme = {**quant, "kv_cache_scheme": {**KV_ONLY["kv_cache_scheme"], "strategy": "channel"}}
    path = _with_quant_config(tiny_model_dir("llama"), tmp_path / "bad", bad_scheme)
    with pytest.raises(ModelLoadError, match=r"kv_cache_scheme .*'strategy': 'channel'.* is not supported"):
        load_arch_config(path)
    int4 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}
    path = _with_quant_config(tiny_model_dir("llama"), tmp_path / "w4",
                              {**KV_ONLY, "format": "pack-quantized", "config_groups": int4})
    with pytest.raises(ModelLoadError, match="compressed-tensors format 'pack-quantized' is not supported"):
        load_arch_config(path)


def test_a_declared_kv_cache_scheme_without_scales_is_warned_of(tiny_model_dir: Callable[..., str], tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A config that declares a kv_cache_scheme over a checkpoint with no scale tensors loads (scales of 1.0, as
    before) with a warning when the cache is fp8; none for a cache in the model's dtype, for a checkpoint that has
    its scales, or for dummy weights (which have no tensors at all)."""
    warning = "declares a kv_cache_scheme, but none of its tensors is a KV-cache scale"
    path = _with_quant_config(tiny_model_dir("llama"), tmp_path / "m", KV_ONLY)
    with caplog.at_level(logging.INFO, logger="kvserve.model.loader"):
        assert _layer_scales(_load(path)) == [(1.0, 1.0), (1.0, 1.0)]
    assert warning in caplog.text and "uses 1.0 for every layer" in caplog.text
    assert [r.levelno for r in caplog.records if warning in r.getMessage()] == [logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve.model.loader"):
        _load(path, None)
        scaled = _with_tensors(path, tmp_path / "scaled", {"model.layers.0.self_attn.kv_scale": torch.tensor(2.0),
                                                            "model.layers.1.self_attn.kv_scale": torch.tensor(4.0)})
        assert _layer_scales(_load(scaled)) == [(2.0, 2.0), (4.0, 4.0)]
        dummy = ModelConfig(model=path, tokenizer=path, dtype="float32", max_model_len=64, load_format="dummy")
        load_model(dummy, torch.device("cpu"), torch.float8_e4m3fn)
    assert warning not in caplog.text
