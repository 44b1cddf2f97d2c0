"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) against HF Transformers and from GGUF, and what kvserve
refuses for them.

Tiny random checkpoints (`helpers.tiny_models` variants "qwen3-moe": 4 layers, layer 0 dense through
mlp_only_layers, 8 experts, 2 per token, renormalised weights; "qwen3-moe-step": decoder_sparse_step 2, no
renormalisation; "qwen2-moe" / "qwen2-moe-nonorm": as "qwen3-moe" with Qwen2's attention and a shared expert,
with and without renormalisation; "mixtral": 3 layers, all MoE) through kvserve's offline LLM API: greedy tokens
equal HF's in float32, bfloat16 logprobs within HF bfloat16's own error of HF float32, and engine settings that
must not change the output (chunked prefill, prefix caching, preemption) leave it alone. The GGUF exports of
"qwen3-moe", "qwen3-moe-step" and "mixtral" (`helpers.tiny_models.write_gguf`: experts stacked as llama.cpp writes
them) generate the same greedy tokens.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError, EngineArgs
from kvserve.model.arch import load_arch_config
from kvserve.model.paths import ModelLoadError

MOE_VARIANTS = ["qwen3-moe", "qwen3-moe-step", "qwen2-moe", "qwen2-moe-nonorm", "mixtral"]
GGUF_MOE_VARIANTS = ["qwen3-moe", "qwen3-moe-step", "mixtral"]  # (a qwen2moe GGUF is refused)
PROMPTS: list[Any] = [
    "Hi",
    "A longer prompt that spans more than one block of sixteen tokens, so that block tables matter here.",
    "中文提示词也要一样。",
    list(range(1000, 1040)),
]


def _greedy(llm: LLM, prompts: list[Any], num_new: int = 20) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_new, min_tokens=num_new)
    llm.engine.core.check_invariants_every_step = True
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _hf_greedy(model: torch.nn.Module, prompt_ids: list[int], num_new: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                             min_new_tokens=num_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _hf(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


# ------------------------------------------------------------------------------------------------ config


def test_arch_config_reads_the_experts_as_hf_does(tiny_model_dir: Callable[..., str]) -> None:
    """Which layers are MoE follows Qwen3MoeDecoderLayer's rule (not in mlp_only_layers, and (i + 1) %
    decoder_sparse_step == 0); Transformers 5 saves num_experts as num_local_experts."""
    qwen = load_arch_config(tiny_model_dir("qwen3-moe"))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 2, 32)
    assert qwen.moe_layers == (1, 2, 3) and qwen.norm_topk_prob and qwen.qk_norm and qwen.head_dim == 32
    assert qwen.intermediate_size == 128  # the dense layer 0's
    step = load_arch_config(tiny_model_dir("qwen3-moe-step"))
    assert step.moe_layers == (1, 3) and not step.norm_topk_prob
    hf = _hf(tiny_model_dir("qwen3-moe-step"))
    hf_moe = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert hf_moe == step.moe_layers
    mixtral = load_arch_config(tiny_model_dir("mixtral"))
    assert mixtral.moe_layers == (0, 1, 2) and mixtral.norm_topk_prob and not mixtral.qk_norm
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.rope_theta) == (8, 32, 1e6)
    qwen2 = load_arch_config(tiny_model_dir("qwen2-moe"))
    assert (qwen2.num_experts, qwen2.moe_intermediate_size, qwen2.shared_expert_intermediate_size) == (8, 32, 96)
    assert qwen2.moe_layers == (1, 2, 3) and qwen2.norm_topk_prob and qwen2.attention_bias and not qwen2.qk_norm
    assert (qwen2.head_dim, qwen2.o_proj_bias, qwen.shared_expert_intermediate_size) == (16, False, 0)
    assert not load_arch_config(tiny_model_dir("qwen2-moe-nonorm")).norm_topk_prob


def test_missing_keys_take_hf_config_defaults(tmp_path: Path) -> None:
    """Qwen3MoeConfig's defaults: 128 experts, 8 per token, width 768, no renormalisation, every layer MoE, no
    head_dim default (hidden / heads), 4 KV heads; MixtralConfig's: 8 experts, 2 per token, rope_theta 1e6,
    rms_norm_eps 1e-5, 8 KV heads; Qwen2MoeConfig's: 60 experts, 4 per token, width 1408, a shared expert 5632
    wide, no renormalisation, 16 KV heads, q/k/v bias (`qkv_bias`)."""
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 8}
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps({**base, "architectures": ["Qwen3MoeForCausalLM"]}))
    qwen = load_arch_config(str(tmp_path / "q"))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (128, 8, 768)
    assert not qwen.norm_topk_prob and qwen.moe_layers == (0, 1)
    assert (qwen.head_dim, qwen.num_key_value_heads, qwen.rope_theta) == (8, 4, 10000.0)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**base, "architectures": ["MixtralForCausalLM"]}))
    mixtral = load_arch_config(str(tmp_path / "m"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 128)
    assert (mixtral.rope_theta, mixtral.rms_norm_eps, mixtral.num_key_value_heads) == (1e6, 1e-5, 8)
    assert mixtral.max_position_embeddings == 4096 * 32 and mixtral.sliding_window is None
    (tmp_path / "q2").mkdir()
    (tmp_path / "q2" / "config.json").write_text(json.dumps({**base, "num_attention_heads": 16,
                                                             "architectures": ["Qwen2MoeForCausalLM"]}))
    qwen2 = load_arch_config(str(tmp_path / "q2"))
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.moe_intermediate_size) == (60, 4, 1408)
    assert qwen2.shared_expert_intermediate_size == 5632 and not qwen2.norm_topk_prob and qwen2.moe_layers == (0, 1)
    assert (qwen2.head_dim, qwen2.num_key_value_heads, qwen2.rope_theta) == (4, 16, 10000.0)
    assert qwen2.attention_bias and not qwen2.o_proj_bias  # qkv_bias defaults to true


@pytest.mark.parametrize(("architecture", "model_type"), [
    ("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3"),
    ("Qwen3MoeForCausalLM", "qwen3_moe"), ("Qwen2MoeForCausalLM", "qwen2_moe"), ("MixtralForCausalLM", "mixtral"),
])
def test_a_missing_intermediate_size_is_hf_configs_default(architecture: str, model_type: str, tmp_path: Path) -> None:
    """config.json without intermediate_size: the config class's default, as HF Transformers reads it (it was
    refused as a missing key; Mixtral's experts are that wide)."""
    config = {"architectures": [architecture], "model_type": model_type, "vocab_size": 100, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = AutoConfig.from_pretrained(str(tmp_path)).intermediate_size
    arch = load_arch_config(str(tmp_path))
    assert arch.intermediate_size == want
    if architecture == "MixtralForCausalLM":
        assert arch.moe_intermediate_size == want
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": None}))
    with pytest.raises(ModelLoadError, match="lacks 'intermediate_size'"):
        load_arch_config(str(tmp_path))


# ------------------------------------------------------------------------------------------- vs HF


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_greedy_tokens_match_hf(variant: str, tiny_model_dir: Callable[..., str]) -> None:
    path = tiny_model_dir(variant)
    hf = _hf(path)
    llm = LLM(path, max_model_len=256, block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20), use_tqdm=False)
    for out in outs:
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, list(out.prompt_token_ids), 20), out.prompt


def _teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("variant", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_bf16_logprobs_agree_with_hf(variant: str, tiny_model_dir: Callable[..., str]) -> None:
    """kvserve in bfloat16, teacher-forced HF float32 and bfloat16 on kvserve's tokens: kvserve's top-5
    logprobs are within twice HF bfloat16's own error of float32 (plus 0.02), its greedy token HF float32's
    top-1 at 90% of the steps at least."""
    path = tiny_model_dir(variant)
    llm = LLM(path, dtype="bfloat16", max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=5),
                        use_tqdm=False)
    hf32, hf16 = _hf(path), _hf(path, torch.bfloat16)
    kv_err = hf_err = 0.0
    agree = total = 0
    for out in outs:
        prompt, tokens = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        ref = _teacher_forced_logprobs(hf32, prompt, tokens)
        hf = _teacher_forced_logprobs(hf16, prompt, tokens)
        for step, top in enumerate(out.outputs[0].logprobs):
            ids = [t for t in top if top[t].rank <= 5]
            kv_err = max(kv_err, max(abs(top[t].logprob - float(ref[step, t])) for t in ids))
            ref_top = ref[step].topk(5).indices
            hf_err = max(hf_err, float((hf[step, ref_top] - ref[step, ref_top]).abs().max()))
            agree += int(tokens[step] == int(ref_top[0]))
            total += 1
    assert kv_err <= 2 * hf_err + 0.02, (kv_err, hf_err)
    assert agree >= 0.9 * total, (agree, total)


@pytest.mark.parametrize(
    "settings",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 24},  # prompts prefilled over several steps, mixed with decodes
        {"num_kv_blocks": 10, "max_num_seqs": 4},  # too few blocks for every request: preemption
    ],
    ids=["no-prefix-cache", "chunked-prefill", "preemption"],
)
def test_engine_settings_do_not_change_greedy_output(settings: dict[str, Any],
                                                     tiny_model_dir: Callable[..., str]) -> None:
    path = tiny_model_dir("qwen3-moe")
    prompts = [*PROMPTS, PROMPTS[1]]  # a repeat: a prefix-cache hit with caching on
    reference = _greedy(LLM(path, max_model_len=128, block_size=16), prompts, 24)
    llm = LLM(path, max_model_len=128, block_size=16, **settings)
    assert _greedy(llm, prompts, 24) == reference
    if "num_kv_blocks" in settings:
        assert llm.engine.core.scheduler.num_preemptions > 0, "the pool was meant to force preemption"


def test_dummy_weights_load_every_expert(tiny_model_dir: Callable[..., str]) -> None:
    """--load-format dummy fills the stacked experts (random, non-zero) and the model generates."""
    llm = LLM(tiny_model_dir("mixtral"), load_format="dummy", max_model_len=64)
    model = llm.engine.core.runner.model
    w13 = model.model.layers[0].mlp.experts.w13
    assert w13.shape == (8, 64, 64) and bool((w13 != 0).all())
    assert len(_greedy(llm, ["Hi"], 4)[0]) == 4


# ------------------------------------------------------------------------------------------------ loader


def _rewrite(source: str, directory: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> str:
    """A copy of checkpoint `source` in `directory` whose tensors are `change`d."""
    out = shutil.copytree(source, directory)
    weights = load_file(str(out / "model.safetensors"))
    save_file(change(weights), str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _fuse_experts(weights: dict[str, torch.Tensor], num_experts: int, layers: list[int], prefix: str,
                  names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """Per-expert tensors replaced by HF Transformers 5's fused ones (gate_up_proj [E, 2I, H], down_proj [E, H,
    I]) under `model.layers.N.mlp.experts`."""
    gate, up, down = names
    for n in layers:
        expert = f"model.layers.{n}.{prefix}.experts"
        w13 = [torch.cat([weights.pop(f"{expert}.{e}.{gate}.weight"), weights.pop(f"{expert}.{e}.{up}.weight")])
               for e in range(num_experts)]
        w2 = [weights.pop(f"{expert}.{e}.{down}.weight") for e in range(num_experts)]
        weights[f"model.layers.{n}.mlp.experts.gate_up_proj"] = torch.stack(w13)
        weights[f"model.layers.{n}.mlp.experts.down_proj"] = torch.stack(w2)
        if prefix != "mlp":
            weights[f"model.layers.{n}.mlp.gate.weight"] = weights.pop(f"model.layers.{n}.{prefix}.gate.weight")
    return weights


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
def test_fused_expert_tensors_load_as_per_expert_ones(variant: str, tiny_model_dir: Callable[..., str],
                                                      tmp_path: Path) -> None:
    """`save_pretrained` writes each expert apart (checked here); a checkpoint holding the experts fused, as
    Transformers 5's modules hold them, gives the same model."""
    source = tiny_model_dir(variant)
    arch = load_arch_config(source)
    mixtral = variant == "mixtral"
    prefix, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj",
                                                                                      "down_proj"))
    keys = set(load_file(os.path.join(source, "model.safetensors")))
    layer = arch.moe_layers[0]
    assert f"model.layers.{layer}.{prefix}.experts.7.{names[1]}.weight" in keys
    fused = _rewrite(source, tmp_path / "fused",
                     lambda w: _fuse_experts(w, arch.num_experts, list(arch.moe_layers), prefix, names))
    prompts = PROMPTS[:2]
    assert _greedy(LLM(fused, max_model_len=128), prompts, 12) == _greedy(LLM(source, max_model_len=128), prompts, 12)


@pytest.mark.parametrize("missing", ["model.layers.1.mlp.shared_expert.up_proj.weight",
                                     "model.layers.3.mlp.shared_expert_gate.weight",
                                     "model.layers.2.mlp.experts.4.down_proj.weight"],
                         ids=["shared-expert", "shared-expert-gate", "expert"])
def test_a_missing_qwen2_moe_tensor_is_named_as_its_checkpoints_name_it(
        missing: str, tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    source = tiny_model_dir("qwen2-moe")
    assert missing in load_file(os.path.join(source, "model.safetensors"))
    path = _rewrite(source, tmp_path / "m", lambda w: {k: v for k, v in w.items() if k != missing})
    with pytest.raises(ModelLoadError, match=rf"checkpoint lacks weights for {missing.replace('.', '[.]')}$"):
        LLM(path, max_model_len=64)


def test_a_missing_expert_tensor_is_named(tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    source = tiny_model_dir("qwen3-moe")
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    path = _rewrite(source, tmp_path / "m", lambda w: {k: v for k, v in w.items() if k != missing})
    with pytest.raises(ModelLoadError, match=rf"checkpoint lacks weights for {missing.replace('.', '[.]')}$"):
        LLM(path, max_model_len=64)


@pytest.mark.parametrize("missing", ["model.layers.1.block_sparse_moe.experts.3.w3.weight",
                                     "model.layers.1.block_sparse_moe.gate.weight"], ids=["expert", "router"])
def test_a_missing_mixtral_tensor_is_named_as_its_checkpoints_name_it(
        missing: str, tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    """Mixtral's checkpoints hold a layer's router and experts under block_sparse_moe (ours: mlp): the message
    names the tensor the checkpoint lacks, not a name no Mixtral checkpoint has."""
    source = tiny_model_dir("mixtral")
    path = _rewrite(source, tmp_path / "m", lambda w: {k: v for k, v in w.items() if k != missing})
    with pytest.raises(ModelLoadError, match=rf"checkpoint lacks weights for {missing.replace('.', '[.]')}$"):
        LLM(path, max_model_len=64)


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
def test_a_tensor_held_twice_is_refused(variant: str, tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    """One layer's experts both apart and fused (Qwen3-MoE), or Mixtral's router under both block_sparse_moe and
    mlp: refused naming both tensors; the one read last silently replaced the other."""
    source = tiny_model_dir(variant)

    def add(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if variant == "mixtral":
            weights["model.layers.0.mlp.gate.weight"] = torch.zeros(8, 64)
        else:
            weights["model.layers.1.mlp.experts.down_proj"] = torch.zeros(8, 64, 32)
        return weights

    path = _rewrite(source, tmp_path / "m", add)
    first, second = {
        "mixtral": ("model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.mlp.gate.weight"),
        "qwen3-moe": ("model.layers.1.mlp.experts.0.down_proj.weight", "model.layers.1.mlp.experts.down_proj"),
    }[variant]
    with pytest.raises(ModelLoadError, match=r"checkpoint tensors '(.+)' and '(.+)' both hold .*a checkpoint holds "
                                             r"each expert once") as info:
        LLM(path, max_model_len=64)
    assert {first, second} <= set(str(info.value).split("'"))


def test_an_expert_past_the_configs_is_refused(tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    source = tiny_model_dir("mixtral")

    def add(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weights["model.layers.0.block_sparse_moe.experts.8.w1.weight"] = torch.zeros(32, 64)
        return weights

    path = _rewrite(source, tmp_path / "m", add)
    with pytest.raises(ModelLoadError, match=r"experts\.8\.w1\.weight'.*expert 8 is not one of the model's 8 experts"):
        LLM(path, max_model_len=64)


# ---------------------------------------------------------------------------------------------- refusals


def _with_config(source: str, directory: Path, **changes: Any) -> str:
    out = shutil.copytree(source, directory)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("quant", [
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    {"quant_method": "fp8", "activation_scheme": "dynamic"},
], ids=["awq", "gptq", "fp8"])
def test_quantized_moe_checkpoints_are_refused(quant: dict[str, Any], tiny_model_dir: Callable[..., str],
                                               tmp_path: Path) -> None:
    path = _with_config(tiny_model_dir("qwen3-moe"), tmp_path / "q", quantization_config=quant)
    with pytest.raises(ModelLoadError, match=rf"Qwen3MoeForCausalLM is a mixture-of-experts model.*quantized "
                                             rf"\({quant['quant_method']}\) checkpoints.*unquantized"):
        load_arch_config(path)


def test_online_fp8_is_refused_for_moe(tiny_model_dir: Callable[..., str]) -> None:
    with pytest.raises(ConfigError, match=r"--quantization fp8 is not supported for mixture-of-experts models yet "
                                          r"\(MixtralForCausalLM"):
        EngineArgs(model=tiny_model_dir("mixtral"), device="cpu", quantization="fp8").create_engine_config()


@pytest.mark.parametrize(("arch", "metadata"), [("qwen2moe", {}), ("olmoe", {"expert_count": 8})],
                         ids=["qwen2moe", "other-with-experts"])
def test_other_moe_gguf_files_are_refused(arch: str, metadata: dict[str, Any], tmp_path: Path) -> None:
    """kvserve loads Qwen3-MoE ("qwen3moe") and Mixtral ("llama" with an expert_count) from GGUF, no other
    mixture-of-experts architecture."""
    from helpers.tiny_models import write_config_gguf

    path = write_config_gguf(str(tmp_path / "moe.gguf"), arch, metadata)
    with pytest.raises(ModelLoadError, match=rf"a mixture-of-experts GGUF file \(architecture '{arch}'.*loads only "
                                             r"Qwen3-MoE \(qwen3moe\) and Mixtral.*HF safetensors checkpoint"):
        load_arch_config(path)


# ------------------------------------------------------------------------------------------------ GGUF


@pytest.fixture(scope="module")
def moe_gguf(tiny_model_dir: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`make(variant, **write_gguf options)`: the tiny MoE checkpoint re-exported as GGUF (cached)."""
    from helpers.tiny_models import write_gguf

    cache: dict[str, str] = {}

    def make(variant: str, **options: Any) -> str:
        key = json.dumps([variant, options], sort_keys=True)
        if key not in cache:
            path = str(tmp_path_factory.mktemp(f"gguf-{variant}") / f"{variant}.gguf")
            cache[key] = write_gguf(tiny_model_dir(variant), path, **options)
        return cache[key]

    return make


@pytest.mark.parametrize("variant", GGUF_MOE_VARIANTS)
def test_gguf_arch_config_equals_the_checkpoints(variant: str, tiny_model_dir: Callable[..., str],
                                                 moe_gguf: Callable[..., str]) -> None:
    """Qwen3-MoE's GGUF ("qwen3moe": the MoE layers are those with a router, layer 0 dense; no renormalisation
    from expert_weights_norm false) and Mixtral's ("llama" with 8 experts) read as their config.json does."""
    from_gguf, from_hf = load_arch_config(moe_gguf(variant)), load_arch_config(tiny_model_dir(variant))
    assert from_gguf.architecture == from_hf.architecture
    # GGUF stores eps as float32 and names no dtype.
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)
    assert replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps, config_dtype=from_hf.config_dtype) == from_hf


@pytest.mark.parametrize(("variant", "options"), [
    ("qwen3-moe", {}), ("qwen3-moe-step", {}), ("mixtral", {}), ("mixtral", {"stack_experts": False}),
], ids=["qwen3-moe", "qwen3-moe-step", "mixtral", "mixtral-experts-apart"])
def test_gguf_greedy_tokens_equal_the_checkpoints(variant: str, options: dict[str, Any],
                                                  tiny_model_dir: Callable[..., str],
                                                  moe_gguf: Callable[..., str]) -> None:
    """A float32 GGUF (experts stacked per projection, or each apart as older Mixtral files hold them; Mixtral's
    q/k rows permuted as for Llama) generates the safetensors checkpoint's greedy tokens."""
    checkpoint = tiny_model_dir(variant)
    from_gguf = _greedy(LLM(moe_gguf(variant, **options), tokenizer=checkpoint, max_model_len=256), PROMPTS)
    assert from_gguf == _greedy(LLM(checkpoint, max_model_len=256), PROMPTS)


@pytest.mark.parametrize("expert_type", ["F16", "Q8_0"])
@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
def test_gguf_typed_experts_load_as_gguf_dequantizes_them(variant: str, expert_type: str,
                                                          tiny_model_dir: Callable[..., str],
                                                          moe_gguf: Callable[..., str]) -> None:
    """F16 and Q8_0 stacked experts [E, I, H] / [E, H, I] dequantize whole: every expert's gate, up and down rows
    are the checkpoint's through that type's round trip (float16, or gguf's Q8_0 quantizer)."""
    import gguf
    import numpy as np

    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    path = moe_gguf(variant, expert_type=expert_type)
    model = load_model(ModelConfig(model=path, tokenizer=tiny_model_dir(variant), dtype="float32", max_model_len=64),
                       torch.device("cpu"))
    checkpoint = load_file(os.path.join(tiny_model_dir(variant), "model.safetensors"))
    block, (gate, up, down) = ("block_sparse_moe", ("w1", "w3", "w2")) if variant == "mixtral" \
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    layer = model.arch.moe_layers[-1]
    experts = model.model.layers[layer].mlp.experts

    def round_trip(part: str) -> torch.Tensor:
        stacked = torch.stack([checkpoint[f"model.layers.{layer}.{block}.experts.{e}.{part}.weight"]
                               for e in range(model.arch.num_experts)]).numpy()
        if expert_type == "F16":
            return torch.from_numpy(stacked.astype(np.float16).astype(np.float32))
        qtype = gguf.GGMLQuantizationType.Q8_0
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(stacked, qtype), qtype))

    size = model.arch.moe_intermediate_size
    torch.testing.assert_close(experts.w13[:, :size], round_trip(gate), atol=0, rtol=0)
    torch.testing.assert_close(experts.w13[:, size:], round_trip(up), atol=0, rtol=0)
    torch.testing.assert_close(experts.w2, round_trip(down), atol=0, rtol=0)
    assert not torch.equal(experts.w2, torch.stack([
        checkpoint[f"model.layers.{layer}.{block}.experts.{e}.{down}.weight"] for e in range(model.arch.num_experts)]))


@pytest.mark.parametrize("missing", ["ffn_up_exps", "ffn_down_exps"])
def test_gguf_missing_an_expert_tensor_is_a_clear_error(missing: str, moe_gguf: Callable[..., str]) -> None:
    path = moe_gguf("qwen3-moe", leave_out=(f"blk.2.{missing}.weight",))
    with pytest.raises(ModelLoadError, match=rf"qwen3-moe\.gguf: layer 2 has a router \(ffn_gate_inp\) but no "
                                             rf"blk\.2\.{missing}\.weight tensor .*the file is incomplete"):
        load_arch_config(path)


def test_an_unknown_moe_architecture_names_the_supported_ones(tiny_model_dir: Callable[..., str],
                                                              tmp_path: Path) -> None:
    path = _with_config(tiny_model_dir("qwen3-moe"), tmp_path / "d", architectures=["DeepseekV2ForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"unsupported model architecture 'DeepseekV2ForCausalLM'; supported: "
                                             r".*MixtralForCausalLM.*Qwen2MoeForCausalLM.*Qwen3MoeForCausalLM"):
        load_arch_config(path)


def test_quantized_qwen2_moe_is_refused(tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    path = _with_config(tiny_model_dir("qwen2-moe"), tmp_path / "q", quantization_config=quant)
    with pytest.raises(ModelLoadError, match=r"Qwen2MoeForCausalLM is a mixture-of-experts model.*quantized "
                                             r"\(gptq\) checkpoints"):
        load_arch_config(path)


@pytest.mark.parametrize(("changes", "layers"), [
    ({}, 2),  # Qwen2MoeConfig's placement: every other layer (0, 2) below max_window_layers
    ({"max_window_layers": 1}, 1),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]}, 1),
], ids=["alternate", "max-window-layers", "layer-types"])
def test_qwen2_moe_sliding_window_layers_are_refused(changes: dict[str, Any], layers: int,
                                                     tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    path = _with_config(tiny_model_dir("qwen2-moe"), tmp_path / "w",
                        **{"use_sliding_window": True, "sliding_window": 64, "layer_types": None, **changes})
    with pytest.raises(ModelLoadError, match=rf"sliding-window attention layers are not supported yet .*{layers} "
                                             r"layer"):
        load_arch_config(path)
    plain = _with_config(tiny_model_dir("qwen2-moe"), tmp_path / "f", use_sliding_window=False, sliding_window=64)
    assert load_arch_config(plain).moe_layers == (1, 2, 3)


def test_mixtral_sliding_window_holds_max_model_len(tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    """A Mixtral config with a sliding_window: served up to that length (where it is full attention), by default
    (it was refused, though no --max-model-len was given), refused past it with the flag to pass."""
    path = _with_config(tiny_model_dir("mixtral"), tmp_path / "w", sliding_window=64, max_position_embeddings=256)
    with pytest.raises(ConfigError, match=r"sliding_window 64.*pass --max-model-len 64 or less"):
        EngineArgs(model=path, device="cpu", max_model_len=65).create_engine_config()
    assert EngineArgs(model=path, device="cpu", max_model_len=64).create_engine_config().model_config.max_model_len == 64
    config = EngineArgs(model=path, device="cpu").create_engine_config()
    assert config.model_config.max_model_len == 64 and not config.model_config.max_model_len_auto


@pytest.mark.parametrize("value", ["auto", -1])
def test_mixtral_sliding_window_is_max_model_len_auto(value: Any, tiny_model_dir: Callable[..., str],
                                                      tmp_path: Path) -> None:
    """max_model_len auto / -1 asks for the longest length served: a Mixtral sliding_window's (it was refused as
    past the window, naming the model's 256), then lowered as usual to what the KV cache holds."""
    path = _with_config(tiny_model_dir("mixtral"), tmp_path / "w", sliding_window=64, max_position_embeddings=256)
    config = EngineArgs(model=path, device="cpu", max_model_len=value).create_engine_config()
    assert config.model_config.max_model_len == 64 and config.model_config.max_model_len_auto
    llm = LLM(path, max_model_len=value, num_gpu_blocks_override=3)  # 48 tokens: lowered past the window
    assert llm.llm_engine.model_config.max_model_len == 48


def test_qwen3_moe_sliding_window_layers_are_refused(tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    path = _with_config(tiny_model_dir("qwen3-moe"), tmp_path / "w", use_sliding_window=True, sliding_window=64)
    with pytest.raises(ModelLoadError, match=r"sliding-window attention layers are not supported yet .*4 layer"):
        load_arch_config(path)


def test_a_tensor_parallel_size_that_does_not_split_the_experts_is_refused(
        tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    path = _with_config(tiny_model_dir("mixtral"), tmp_path / "tp", intermediate_size=30)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not split the model: the experts' "
                                          r"intermediate size \(30, each expert's MLP width\) is not divisible"):
        EngineArgs(model=path, device="cpu", tensor_parallel_size=4).create_engine_config()


def test_stacked_gate_and_up_tensors_fill_their_halves_of_w13() -> None:
    """A GGUF file's ffn_gate_exps / ffn_up_exps [E, I, H] fill each expert's gate rows / up rows of w13 (and
    count as every expert's gate / up shard); a wrong shape or the w2 parameter is refused."""
    from kvserve.layers.moe import FUSED_GATE, FUSED_UP, FusedExperts, covered_shards

    experts = FusedExperts(3, 8, 4, torch.float32)
    gate, up = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    experts.weight_loader(experts.w13, gate, FUSED_GATE)
    experts.weight_loader(experts.w13, up, FUSED_UP)
    assert torch.equal(experts.w13, torch.cat([gate, up], dim=1))
    assert covered_shards(experts.w13, FUSED_UP) == ((0, "up"), (1, "up"), (2, "up"))
    with pytest.raises(ValueError, match=r"dim 1 should be the experts' intermediate size 4"):
        experts.weight_loader(experts.w13, torch.randn(3, 8, 8), FUSED_GATE)
    with pytest.raises(ValueError, match=r"expected \[3, intermediate, hidden\]"):
        experts.weight_loader(experts.w13, torch.randn(2, 4, 8), FUSED_UP)
    with pytest.raises(ValueError, match=r"not one of this parameter's"):
        experts.weight_loader(experts.w2, torch.randn(3, 4, 8), FUSED_GATE)
