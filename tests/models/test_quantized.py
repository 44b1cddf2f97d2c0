"""AWQ and GPTQ checkpoints (layers/quantization.py) against HF Transformers on the dequantized weights.

Each case quantizes a tiny random checkpoint (tests/helpers/quantized.py, packed independently of kvserve)
and writes the dequantized weights as a dense checkpoint; kvserve on the quantized one must give HF's greedy
tokens on the dense one in float32, with close logprobs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.quantized import quantize_checkpoint
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError, EngineArgs
from kvserve.layers import quantization as quant
from kvserve.model.arch import load_arch_config
from kvserve.model.loader import load_model
from kvserve.model.paths import ModelLoadError

PROMPTS = ["Hello, my name is", "The capital of France is", "一二三四五六七八九十"]
NUM_NEW = 12

# (id, arch, quantize_checkpoint keyword arguments)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("awq4-llama", "llama", {"method": "awq", "bits": 4, "group_size": 32}),
    ("awq4-qwen2-skip-down", "qwen2", {"method": "awq", "bits": 4, "group_size": 32, "skip": ("down_proj",)}),
    ("gptq4-qwen3-actorder", "qwen3", {"method": "gptq", "bits": 4, "group_size": 32, "act_order": True}),
    ("gptq8-llama-onegroup-v2", "llama", {"method": "gptq", "bits": 8, "group_size": -1,
                                          "checkpoint_format": "gptq_v2"}),
    ("gptq2-llama-tied", "llama-tied", {"method": "gptq", "bits": 2, "group_size": 16}),
    # zero-filled biases on the projections that have none, as older GPTQ exporters save them
    ("gptq4-qwen2", "qwen2", {"method": "gptq", "bits": 4, "group_size": 32, "extra_bias": True}),
]


@pytest.fixture(scope="module")
def quantized_pair(tiny_model_dir: Callable[..., str], tmp_path_factory: pytest.TempPathFactory
                   ) -> Callable[[str], tuple[str, str]]:
    """case id -> (quantized checkpoint dir, dequantized dense dir), written once per module."""
    cache: dict[str, tuple[str, str]] = {}

    def make(case_id: str) -> tuple[str, str]:
        if case_id not in cache:
            _, arch, kwargs = next(c for c in CASES if c[0] == case_id)
            root = tmp_path_factory.mktemp(f"quant-{case_id}")
            out, deq = str(root / "quantized"), str(root / "dequantized")
            quantize_checkpoint(tiny_model_dir(arch), out, deq, **kwargs)
            cache[case_id] = (out, deq)
        return cache[case_id]

    return make


def _hf_greedy(model_dir: str, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW,
                             min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [float(torch.log_softmax(score[0].float(), -1)[t]) for score, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_quantized_checkpoint_matches_hf_on_dequantized_weights(case_id: str, quantized_pair: Callable) -> None:
    quantized_dir, dense_dir = quantized_pair(case_id)
    llm = LLM(model=quantized_dir, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        tokens, logprobs = _hf_greedy(dense_dir, out.prompt_token_ids)
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {out.prompt!r}"
        ours = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert ours == pytest.approx(logprobs, abs=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_layers_hold_no_dense_weight_before_finish(quantized_pair: Callable, dtype: torch.dtype) -> None:
    """The quantized layers load the packed tensors (not a dense weight) and, on CPU, become dense layers
    equal to the dequantized checkpoint: in bfloat16 the float32 weight rounded once (the checkpoint's
    float16 scales are not rounded to bfloat16 first)."""
    from safetensors.torch import load_file

    from kvserve.model.arch import load_arch_config
    from kvserve.model.loader import iter_safetensors_weights
    from kvserve.model.registry import get_model_class

    quantized_dir, dense_dir = quantized_pair("gptq4-qwen3-actorder")
    arch = load_arch_config(quantized_dir)
    assert arch.quantization is not None and arch.quantization.method == "gptq"
    model = get_model_class(arch.architecture)(arch, dtype)
    layer = model.model.layers[0]
    names = {n for n, _ in layer.self_attn.qkv_proj.named_parameters()}
    assert {"qweight", "qzeros", "scales", "g_idx", "bias"} - {"bias"} <= names and "weight" not in names
    model.load_weights(iter_safetensors_weights(quantized_dir))
    dense = load_file(os.path.join(dense_dir, "model.safetensors"))
    expected = torch.cat([dense[f"model.layers.0.mlp.{p}.weight"] for p in ("gate_proj", "up_proj")])
    assert torch.equal(layer.mlp.gate_up_proj.weight, expected.to(dtype))
    assert torch.equal(layer.self_attn.o_proj.weight, dense["model.layers.0.self_attn.o_proj.weight"].to(dtype))
    assert not any(n.endswith(("qweight", "qzeros", "scales", "g_idx")) for n, _ in model.named_parameters())


def test_pack_rows_round_trip_and_sign() -> None:
    for bits in (2, 4, 8):
        values = torch.randint(0, 1 << bits, (64, 5), generator=torch.Generator().manual_seed(bits))
        values[-(32 // bits):, 0] = (1 << bits) - 1  # a word whose top bit is set: negative as int32
        packed = quant.pack_rows(values, bits)
        assert packed.dtype == torch.int32 and packed.shape == (64 * bits // 32, 5)
        assert int(packed[-1, 0]) < 0
        assert torch.equal(quant.unpack_rows(packed, bits), values.to(torch.int32))


def _write_config(directory: str, quantization_config: dict[str, Any] | None, source: str) -> str:
    import shutil

    shutil.copytree(source, directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    if quantization_config is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported; supported: awq, gptq, "
                                       "fp8, compressed-tensors, fbgemm_fp8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 32}, "AWQ with 8 bits"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "GPTQ with 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 20}, "group_size 20"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "lm_head": True}, "quantized lm_head"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, "checkpoint_format"),
])
def test_unsupported_quantization_configs_fail_clearly(config: dict[str, Any], message: str, tmp_path: Any,
                                                       quantized_pair: Callable) -> None:
    directory = _write_config(str(tmp_path / "m"), config, quantized_pair("awq4-llama")[0])
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(model=directory, device="cpu").create_engine_config()


def test_quantization_flag_must_match_the_checkpoint(quantized_pair: Callable) -> None:
    quantized_dir, dense_dir = quantized_pair("awq4-llama")
    for name in ("awq", "awq_marlin", "AWQ"):
        config = EngineArgs(model=quantized_dir, device="cpu", quantization=name).create_engine_config()
        assert config.model_config.quantization == name
    with pytest.raises(ConfigError, match="holds awq weights; drop the flag or pass --quantization awq"):
        EngineArgs(model=quantized_dir, device="cpu", quantization="gptq").create_engine_config()
    with pytest.raises(ConfigError, match="has no quantized weights; drop the flag"):
        EngineArgs(model=dense_dir, device="cpu", quantization="awq").create_engine_config()
    with pytest.raises(ConfigError, match="'bitsandbytes' is not supported"):
        EngineArgs(model=dense_dir, device="cpu", quantization="bitsandbytes").create_engine_config()


def test_mismatched_checkpoint_tensors_fail_clearly(quantized_pair: Callable, tmp_path: Any) -> None:
    """A qweight of the wrong width names the tensor and the shapes instead of loading garbage."""
    from safetensors.torch import load_file, save_file

    directory = _write_config(str(tmp_path / "m"), None, quantized_pair("awq4-llama")[0])
    with open(os.path.join(quantized_pair("awq4-llama")[0], "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.mlp.up_proj.qweight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"up_proj\.qweight"):
        LLM(model=directory, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_dummy_weights_with_a_quantization_config(quantized_pair: Callable) -> None:
    """--load-format dummy on a quantized config (the GPU benchmarks' path) builds and runs the model."""
    llm = LLM(model=quantized_pair("gptq4-qwen3-actorder")[0], device="cpu", dtype="float32", max_model_len=64,
              num_kv_blocks=16, load_format="dummy")
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("case_id", ["awq4-qwen2-skip-down", "gptq4-qwen2", "gptq8-llama-onegroup-v2"])
def test_two_ranks_match_one(case_id: str, quantized_pair: Callable) -> None:
    """Each rank loads its share of the packed tensors: columns of q/k/v and gate/up (AWQ's packed eight at a
    time), rows (and their groups' scales) of o_proj and down; one group spanning all rows stays whole."""
    path = quantized_pair(case_id)[0]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=2)
    outs = []
    for tp in (1, 2):
        llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=tp, max_model_len=128,
                  kv_cache_memory="16MiB")
        try:
            outs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        finally:
            llm.shutdown()
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.prompt
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


@pytest.mark.parametrize("case_id, layer", [("awq4-llama", "o_proj"), ("awq4-qwen2-skip-down", "o_proj")])
def test_ranks_that_would_split_a_group_are_refused_before_they_start(case_id: str, layer: str,
                                                                     quantized_pair: Callable) -> None:
    """4 ranks of these tiny checkpoints take 16 of o_proj's 64 input rows each, half of a 32-row group: refused
    when the engine is configured, not by each rank's traceback at load after the ranks started."""
    with pytest.raises(ConfigError, match=rf"--tensor-parallel-size 4 does not split this AWQ checkpoint: each rank "
                                          rf"would take 16 of {layer}'s 64 input rows, not a multiple of its "
                                          r"group_size 32; pass a smaller --tensor-parallel-size"):
        EngineArgs(model=quantized_pair(case_id)[0], device="cpu", tensor_parallel_size=4).create_engine_config()
    EngineArgs(model=quantized_pair(case_id)[0], device="cpu", tensor_parallel_size=2).create_engine_config()


def test_a_layer_left_dense_is_not_checked_for_its_groups(tiny_model_dir: Callable[..., str],
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """o_proj left unquantized (modules_to_not_convert): 4 ranks split only down_proj's groups (32 of 128 rows
    each, whole groups), so they are accepted."""
    root = tmp_path_factory.mktemp("quant-awq4-skip-o")
    quantize_checkpoint(tiny_model_dir("llama"), str(root / "q"), str(root / "d"), method="awq", bits=4,
                        group_size=32, skip=("o_proj",))
    config = EngineArgs(model=str(root / "q"), device="cpu", tensor_parallel_size=4).create_engine_config()
    assert config.tensor_parallel_size == 4


ACT_ORDER_WITH_TP = (r"GPTQ act-order \(desc_act\) checkpoints are not supported with tensor parallelism yet; run "
                     r"them with --tensor-parallel-size 1")


def test_act_order_with_tensor_parallelism_is_refused_before_the_ranks_start(quantized_pair: Callable) -> None:
    """desc_act in the checkpoint's config: one message when the engine is configured, not one traceback per
    rank at load after the ranks started."""
    path = quantized_pair("gptq4-qwen3-actorder")[0]
    with pytest.raises(ConfigError, match=ACT_ORDER_WITH_TP):
        EngineArgs(model=path, device="cpu", tensor_parallel_size=2).create_engine_config()
    assert EngineArgs(model=path, device="cpu").create_engine_config().tensor_parallel_size == 1


@pytest.mark.parametrize("settings", [{"desc_act": False}, {"desc_act": True, "static_groups": True}])
def test_act_order_that_the_config_does_not_declare_is_refused_at_load(settings: dict[str, Any],
                                                                       quantized_pair: Callable,
                                                                       tmp_path: Any) -> None:
    """A config without desc_act (or with static groups, whose g_idx stays in input order) passes the check
    before the ranks start; a stored g_idx in activation order is still refused when the ranks load it."""
    source = quantized_pair("gptq4-qwen3-actorder")[0]
    with open(os.path.join(source, "config.json")) as f:
        quantization_config = {**json.load(f)["quantization_config"], **settings}
    path = _write_config(str(tmp_path / "m"), quantization_config, source)
    assert EngineArgs(model=path, device="cpu", tensor_parallel_size=2).create_engine_config().tensor_parallel_size == 2
    with pytest.raises(Exception, match=ACT_ORDER_WITH_TP):
        LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, max_model_len=64, kv_cache_memory="16MiB")


def test_zero_points_of_zero_wrap_in_the_original_gptq_format(quantized_pair: Callable) -> None:
    """GPTQ's original format stores z - 1 in `bits` bits: z = 0 reads 2 ** bits - 1 and must come back as 0
    (the 2-bit case has such zero points; its HF comparison above covers the values)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(quantized_pair("gptq2-llama-tied")[0], "model.safetensors"))
    stored = [quant.unpack_columns(t, 2) for name, t in tensors.items() if name.endswith("qzeros")]
    assert any(bool((z == 3).any()) for z in stored)


def test_quantize_config_json_without_quant_method(quantized_pair: Callable, tmp_path: Any) -> None:
    """AutoGPTQ's own quantize_config.json (no quant_method key) instead of config.json's entry: the same
    model, the same tokens."""
    source = quantized_pair("gptq4-qwen2")[0]
    directory = _write_config(str(tmp_path / "m"), None, source)
    with open(os.path.join(source, "config.json")) as f:
        settings = json.load(f)["quantization_config"]
    settings.pop("quant_method")
    with open(os.path.join(directory, "quantize_config.json"), "w") as f:
        json.dump(settings, f)
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    outs = [LLM(model=path, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
            .generate(PROMPTS, params, use_tqdm=False) for path in (source, directory)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    settings["bits"] = 3
    with open(os.path.join(directory, "quantize_config.json"), "w") as f:
        json.dump(settings, f)
    with pytest.raises(ModelLoadError, match=r"quantize_config\.json: GPTQ with 3 bits"):
        EngineArgs(model=directory, device="cpu").create_engine_config()


def test_gptq_without_g_idx(quantized_pair: Callable, tmp_path: Any) -> None:
    """A GPTQ export without g_idx tensors: not in activation order, its rows are in group order, and it loads
    as the checkpoint with them does (the same tokens; it was refused for the missing g_idx, where vLLM fills
    the order in); in activation order the order is the checkpoint's own, and its absence is refused."""
    from safetensors.torch import load_file, save_file

    def without_g_idx(case_id: str) -> str:
        directory = str(tmp_path / case_id)
        shutil.copytree(quantized_pair(case_id)[0], directory)
        path = os.path.join(directory, "model.safetensors")
        tensors = load_file(path)
        assert any(name.endswith(".g_idx") for name in tensors)
        save_file({name: t for name, t in tensors.items() if not name.endswith(".g_idx")}, path)
        return directory

    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    outs = [LLM(model=path, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
            .generate(PROMPTS, params, use_tqdm=False)
            for path in (quantized_pair("gptq4-qwen2")[0], without_g_idx("gptq4-qwen2"))]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    with pytest.raises(ModelLoadError, match=r"lacks weights for .*g_idx"):
        LLM(model=without_g_idx("gptq4-qwen3-actorder"), device="cpu", dtype="float32", max_model_len=64,
            num_kv_blocks=16)


def test_autoawq_quant_config_json(quantized_pair: Callable, tmp_path: Any) -> None:
    """Older AutoAWQ exports keep their settings in quant_config.json, in AutoAWQ's names (w_bit, q_group_size,
    version "GEMM"), and config.json has no quantization_config (vLLM reads that file): read as config.json's
    entry would be, with or without --quantization awq, and the model loads. It was not read: the packed tensors
    were refused as unknown, and the flag as naming what the checkpoint does not hold. A checkpoint that says
    nothing of its quantization is refused as such."""
    source = quantized_pair("awq4-llama")[0]
    directory = _write_config(str(tmp_path / "m"), None, source)
    with open(os.path.join(directory, "quant_config.json"), "w") as f:
        json.dump({"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}, f)
    assert load_arch_config(directory).quantization == load_arch_config(source).quantization
    EngineArgs(model=directory, device="cpu", quantization="awq").create_engine_config()
    config = EngineArgs(model=directory, device="cpu", dtype="float32", max_model_len=64).create_engine_config()
    load_model(config.model_config, torch.device("cpu"))
    os.remove(os.path.join(directory, "quant_config.json"))
    config = EngineArgs(model=directory, device="cpu", dtype="float32", max_model_len=64).create_engine_config()
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.[a-z_.]+\.(qweight|qzeros|scales)' is a packed "
                                             r"quantized .* no quantization_config"):
        load_model(config.model_config, torch.device("cpu"))


def test_gptq_modules_in_block_to_quantize_leaves_the_others_dense(tiny_model_dir: Callable[..., str],
                                                                   tmp_path: Any) -> None:
    """GPTQModel / AutoRound exports name the quantized projections in modules_in_block_to_quantize (as vLLM reads
    it) and store the others dense: o_proj and down_proj here. Their dense weights were refused as unknown
    tensors; each layer now holds the checkpoint's dense weight, or its dequantized packed one."""
    from safetensors.torch import load_file

    quantized, dense = str(tmp_path / "q"), str(tmp_path / "d")
    config = quantize_checkpoint(tiny_model_dir("llama"), quantized, dense, method="gptq", bits=4, group_size=32,
                                 skip=("o_proj", "down_proj"))
    assert config["modules_in_block_to_quantize"] == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                                                      ["mlp.gate_proj", "mlp.up_proj"]]
    engine_config = EngineArgs(model=quantized, device="cpu", dtype="float32", max_model_len=64).create_engine_config()
    model = load_model(engine_config.model_config, torch.device("cpu"))
    expected = load_file(os.path.join(dense, "model.safetensors"))
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        qkv = torch.cat([expected[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = torch.cat([expected[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        for got, want in ((layer.self_attn.qkv_proj.weight, qkv), (layer.mlp.gate_up_proj.weight, gate_up),
                          (layer.self_attn.o_proj.weight, expected[f"{prefix}.self_attn.o_proj.weight"]),
                          (layer.mlp.down_proj.weight, expected[f"{prefix}.mlp.down_proj.weight"])):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # A list that leaves out a projection the checkpoint holds packed: the packed tensors are named as such.
    path = os.path.join(quantized, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw["quantization_config"]["modules_in_block_to_quantize"] = [["mlp.gate_proj", "mlp.up_proj"]]
    with open(path, "w") as f:
        json.dump(raw, f)
    engine_config = EngineArgs(model=quantized, device="cpu", dtype="float32", max_model_len=64).create_engine_config()
    with pytest.raises(ModelLoadError, match=r"self_attn\.[kqv]_proj\.[a-z_]+' is a packed quantized .* leaves "
                                             r"its layer dense"):
        load_model(engine_config.model_config, torch.device("cpu"))
