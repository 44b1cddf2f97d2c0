"""Tiny random checkpoints built with HF Transformers' own classes: the oracle side of differential tests.

`make_tiny_checkpoint(dir, variant)` writes a 2-layer model (hidden 64, 4 heads / 2 KV heads, intermediate
128, the SmolLM2 tokenizer, vocab 49152) as `config.json` + `model.safetensors` + tokenizer files, and
returns `dir`. Weights are drawn from a seeded generator (same variant + seed -> same bytes), with biases
and norm weights randomised too so that loading them wrongly changes the output.

`write_default_checkpoint(dir, dtype)` writes the default GGUF model (SmolLM2-135M-Instruct) as such an HF
checkpoint, for engine settings a GGUF file is refused (`--quantization fp8`).

`write_gguf(checkpoint_dir, gguf_path)` re-exports such a checkpoint as a GGUF file the way llama.cpp's
converter lays it out (tensor names, metadata including RoPE scaling, and the q/k row permutation for the
llama architecture), with float32 tensors, so a model loaded from it must reproduce the HF checkpoint's
logits. Mixture-of-experts checkpoints (Qwen3-MoE as "qwen3moe", Mixtral as "llama" with an expert_count) get
their experts stacked per projection as llama.cpp's converter stacks them, optionally as F16 or Q8_0.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np
import torch

from kvserve.model.paths import default_model_path

# variant -> (HF model_type, config overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    # Llama 3.1 scaling with a short pre-training length so all three frequency bands (kept, divided,
    # interpolated) occur at head_dim 16.
    "llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    # YaRN as Qwen2.5's documentation sets it (factor 4, default betas and attention factor), with a short
    # pre-training length (64; max_model_len up to 64 * 4 = 256) so that prompts pass it quickly and, at
    # head_dim 16, some frequencies are kept, some interpolated and one ramped between.
    "qwen2-yarn": (
        "qwen2",
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # YaRN with every optional parameter set otherwise than its default (mscale / mscale_all_dim for the
    # attention factor, betas, no truncation of the ramp's ends).
    "llama-yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            },
        },
    ),
    # YaRN with the optional parameters a GGUF file carries (betas, an explicit attention factor) otherwise
    # than their defaults, and max_position_embeddings at the pre-training length as in "qwen2-yarn". At
    # head_dim 16 the betas put the ramp over dimensions 1..2 where the defaults' spans 0..3, so each one
    # changes a frequency.
    "llama-yarn-explicit": (
        "llama",
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 3.0,
                "beta_slow": 2.0,
                "attention_factor": 1.25,
            },
        },
    ),
    # head_dim 32 != hidden / heads = 16: catches code deriving head_dim from hidden_size.
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3-yarn": (
        "qwen3",
        {
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # Mixture of experts: 8 experts of width 32, 2 per token. Qwen3-MoE over 4 layers with layer 0 dense
    # (mlp_only_layers, its MLP of intermediate_size 128) and renormalised router weights; the "-step" variant
    # without renormalisation and with decoder_sparse_step 2 (layers 1 and 3 MoE, 0 and 2 dense).
    "qwen3-moe": ("qwen3_moe", {"head_dim": 32, "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [0]}),
    "qwen3-moe-step": ("qwen3_moe", {"head_dim": 32, "num_hidden_layers": 4, "num_experts": 8,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False,
                                     "decoder_sparse_step": 2}),
    # Qwen2-MoE: Qwen2's attention (q/k/v bias), 4 layers with layer 0 dense (mlp_only_layers), 8 experts of width
    # 32, 2 per token, and a shared expert of width 96 in every MoE layer; renormalised router weights, and the
    # "-nonorm" variant without.
    "qwen2-moe": ("qwen2_moe", {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 96,
                                "norm_topk_prob": True, "mlp_only_layers": [0]}),
    "qwen2-moe-nonorm": ("qwen2_moe", {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 96,
                                       "norm_topk_prob": False, "mlp_only_layers": [0]}),
    # Mixtral: every layer MoE, each expert intermediate_size (32) wide.
    "mixtral": ("mixtral", {"num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2,
                            "intermediate_size": 32}),
}

_BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@functools.lru_cache(maxsize=1)
def smollm_tokenizer() -> Any:
    """The default GGUF's tokenizer as HF Transformers loads it (about 4 s; built once per process)."""
    from transformers import AutoTokenizer

    gguf_path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


@functools.lru_cache(maxsize=1)
def smollm_tokenizer_dir() -> str:
    """A directory holding `smollm_tokenizer()` saved with `save_pretrained` (written once per process, removed
    when the process exits)."""
    out = tempfile.mkdtemp(prefix="kvserve-smollm-tokenizer-")
    atexit.register(shutil.rmtree, out, True)
    smollm_tokenizer().save_pretrained(out)
    return out


def write_default_checkpoint(directory: str, dtype: torch.dtype = torch.float32) -> str:
    """The default GGUF (SmolLM2-135M-Instruct, Q4_1) as an HF checkpoint in `directory`: config.json (HF
    Transformers' LlamaConfig of the file's metadata), model.safetensors (the Q4_1 weights dequantized, then
    cast to `dtype`) and the tokenizer (`smollm_tokenizer_dir`); returns `directory`. For what a GGUF file
    cannot be given: `--quantization fp8` refuses GGUF checkpoints.

    The weights come from `kvserve.model.gguf.iter_gguf_weights` (the q/k rows un-permuted), whose float32
    values are bit-identical to HF Transformers' GGUF loader's (checked tensor by tensor when this was written;
    tests/models/test_model_forward.py checks the logits): about 5 s here, against 15-45 s for
    `AutoModelForCausalLM.from_pretrained(gguf_file=...)` + `save_pretrained`, which parses the file twice."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from kvserve.model.arch import load_arch_config
    from kvserve.model.gguf import iter_gguf_weights

    gguf_path = default_model_path()
    arch = load_arch_config(gguf_path)
    assert arch.architecture == "LlamaForCausalLM" and arch.rope_scaling is None, arch
    config = AutoConfig.for_model(
        "llama", vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        max_position_embeddings=arch.max_position_embeddings, tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=arch.bos_token_id, eos_token_id=arch.eos_token_ids[0], dtype=dtype,
        architectures=[arch.architecture],
    )
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    weights = iter_gguf_weights(gguf_path, unpermute_qk=True, num_heads=arch.num_attention_heads,
                                num_kv_heads=arch.num_key_value_heads)
    save_file({name: tensor.to(dtype) for name, tensor in weights}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer_dir = smollm_tokenizer_dir()
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), directory)
    return directory


def make_tiny_checkpoint(directory: str, arch: str = "llama", seed: int = 0, **config_overrides: Any) -> str:
    """Write a tiny random HF checkpoint of `arch` (a key of VARIANTS) into `directory`; returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, variant_overrides = VARIANTS[arch]
    tokenizer_dir = smollm_tokenizer_dir()
    tokenizer = smollm_tokenizer()
    settings = {
        **_BASE_CONFIG,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        **variant_overrides,
        **config_overrides,
    }
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), directory)
    return directory


def with_generation_config(checkpoint_dir: str, directory: str, settings: dict[str, Any]) -> str:
    """A copy of `checkpoint_dir` in `directory` whose generation_config.json also holds `settings`
    (sampling defaults, as model makers ship them)."""
    out = os.path.join(directory, "model")
    shutil.copytree(checkpoint_dir, out)
    path = os.path.join(out, "generation_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **settings}, f, indent=2)
    return out


def make_bare_checkpoint(directory: str, model_type: str, seed: int, **overrides: Any) -> str:
    """A small random HF checkpoint of `model_type` (config.json + safetensors, no tokenizer: engines driven with
    token ids), 3 layers of hidden 256 unless overridden, weights of order-1 logits; returns `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **overrides,
    }
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(directory)
    return directory


def write_byte_tokenizer(directory: str) -> str:
    """A byte-level BPE tokenizer with no merges beside a bare checkpoint: ids 0-2 are <unk>, <s>, </s> (the
    bare checkpoints' BOS and EOS), 3 + b is byte b. For engines that need text (structured output's grammars)
    without the default model's tokenizer; returns `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte-to-character table: printable bytes stand for themselves, the others for 256 + n.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chars[b]: 3 + b for b in range(256)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    return directory


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Scale-aware random weights: logits of order 1, and no parameter left at a neutral value (HF inits
    biases to 0 and norms to 1, which would hide a bias or norm weight that is not loaded)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


# ------------------------------------------------------------------------------------------------ GGUF

_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
# HF model_type -> llama.cpp's architecture name, where they differ.
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
# One expert's projection in a checkpoint -> llama.cpp's stacked tensor of that projection.
_EXPERT_TENSOR = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _HF_TO_GGUF_GLOBAL:
        return f"{_HF_TO_GGUF_GLOBAL[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[rest]}.{kind}"


def _converter_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Llama q/k permutation: rotate-half rows -> interleaved pairs."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# rope_type -> the HF rope parameters llama.cpp's converter carries into the GGUF file (it drops the others).
_CONVERTED_ROPE_PARAMETERS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "yarn": frozenset(
        {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow"}
    ),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
}


def _add_rope_scaling(writer: Any, rope: dict[str, Any], head_dim: int) -> list[float] | None:
    """Write `rope` (a checkpoint's rope_parameters) as convert_hf_to_gguf.py's TextModel does; returns the
    `rope_freqs` divisors for Llama 3.1 scaling (LlamaModel.generate_extra_tensors), else None. Raises
    ValueError for a parameter the converter would drop: the file would hold another model."""
    import gguf

    rope_type = rope.get("rope_type", "default")
    dropped = sorted(set(rope) - {"rope_type", "rope_theta"} - _CONVERTED_ROPE_PARAMETERS[rope_type])
    if dropped:
        raise ValueError(f"llama.cpp's converter drops the rope parameters {dropped}")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif rope_type == "llama3":
        return _llama3_rope_freqs(rope, head_dim)
    return None


def _llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> list[float]:
    """The converter's Llama 3.1 divisors: 1 for the kept frequencies, `factor` for the divided ones, and the
    inverse of HF's smooth interpolation weight in between (float32 arithmetic on each frequency, as
    there)."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, old_context_len = rope["factor"], rope["original_max_position_embeddings"]
    low_freq_factor, high_freq_factor = rope["low_freq_factor"], rope["high_freq_factor"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    divisors: list[Any] = []
    for freq in freqs:  # 0-dim float32 tensors
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            divisors.append(1)
        elif wavelen > low_freq_wavelen:
            divisors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32).tolist()


def write_gguf(checkpoint_dir: str, gguf_path: str, rope_freqs: list[float] | None = None,
               expert_type: str = "F32", leave_out: tuple[str, ...] = (), stack_experts: bool = True) -> str:
    """Re-export a tiny checkpoint (from `make_tiny_checkpoint`) as a float32 GGUF file; returns its path.

    A mixture-of-experts checkpoint's experts are stacked per projection (blk.N.ffn_gate_exps / ffn_up_exps
    [E, I, H], ffn_down_exps [E, H, I]) and written as `expert_type` ("F32", "F16" or "Q8_0"); its router is
    blk.N.ffn_gate_inp. llama.cpp's converter writes no `expert_weights_norm` for Qwen3-MoE (llama.cpp then
    renormalises); it is written here, false, for a checkpoint with norm_topk_prob false, so that the file holds
    the same model. GGUF tensors named in `leave_out` are not written (for tests of incomplete files).
    `stack_experts` false writes each expert apart (blk.N.ffn_gate.E.weight, ...), as older llama.cpp Mixtral
    files hold them.

    RoPE scaling is written as llama.cpp's converter writes it: linear and YaRN as `{arch}.rope.scaling.*`
    metadata, Llama 3.1's as the `rope_freqs.weight` tensor of per-frequency divisors. Explicit `rope_freqs`
    are written instead of the checkpoint's scaling, whatever it is.
    """
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(checkpoint_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    arch = _GGUF_ARCH.get(cfg["model_type"], cfg["model_type"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}

    writer = gguf.GGUFWriter(gguf_path, arch)
    if rope_freqs is None:
        rope_freqs = _add_rope_scaling(writer, rope, head_dim)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    num_experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg["model_type"] == "qwen3_moe" and not cfg.get("norm_topk_prob", False):
            writer.add_expert_weights_norm(False)

    tensors: dict[str, np.ndarray] = {}
    for file in sorted(os.listdir(checkpoint_dir)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(checkpoint_dir, file)))
    experts: dict[str, dict[int, np.ndarray]] = {}  # stacked GGUF name -> expert -> its projection
    for hf_name, value in sorted(tensors.items()):
        value = value.astype(np.float32)
        match = _EXPERT_TENSOR.fullmatch(hf_name)
        if match is not None:
            layer, expert, part = match.groups()
            experts.setdefault(f"blk.{layer}.{_GGUF_EXPERTS[part]}.weight", {})[int(expert)] = value
            continue
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            value = _converter_permute(value, heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            value = _converter_permute(value, kv_heads)
        if _gguf_name(hf_name) not in leave_out:
            writer.add_tensor(_gguf_name(hf_name), np.ascontiguousarray(value))
    for name, by_expert in sorted(experts.items()):
        if not stack_experts:
            for expert, value in sorted(by_expert.items()):
                writer.add_tensor(name.replace("_exps.", f".{expert}."), np.ascontiguousarray(value))
        elif name not in leave_out:
            _add_stacked_experts(writer, name, np.stack([by_expert[e] for e in sorted(by_expert)]), expert_type)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def _add_stacked_experts(writer: Any, name: str, stacked: np.ndarray, expert_type: str) -> None:
    """Write a stacked experts tensor [E, rows, cols] as `expert_type` ("F32", "F16" or "Q8_0", quantized
    row by row with gguf's own quantizer, as llama.cpp's converter does)."""
    import gguf

    if expert_type == "Q8_0":
        qtype = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(stacked, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, np.ascontiguousarray(stacked.astype({"F32": np.float32, "F16": np.float16}[expert_type])))


def _small_gguf_writer(gguf_path: str, arch: str, context_length: int = 64) -> Any:
    """A GGUF writer with a one-layer model's metadata of `arch`, for files made to test tokenizers."""
    import gguf

    writer = gguf.GGUFWriter(gguf_path, arch)
    writer.add_context_length(context_length)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    return writer


def _finish_small_gguf(writer: Any, vocab_size: int, gguf_path: str) -> str:
    """Adds a zero embedding for `vocab_size` tokens and writes the file."""
    writer.add_tensor("token_embd.weight", np.zeros((vocab_size, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def write_tokenizer_gguf(gguf_path: str, add_bos_token: bool) -> str:
    """A GGUF file holding a small SentencePiece-style vocabulary (special tokens, 256 byte tokens, a few
    pieces of "hello world") and one embedding tensor: enough for Transformers to build its tokenizer in
    well under a second, with llama.cpp's add_bos_token switch as given. Returns its path."""
    pieces = ["\u2581", "\u2581h", "\u2581hello", "\u2581world", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "hello"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *pieces]
    writer = _small_gguf_writer(gguf_path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    # gguf's token types: 2 unknown, 3 control, 6 byte, 1 normal.
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos_token)
    return _finish_small_gguf(writer, len(tokens), gguf_path)


def write_bpe_tokenizer_gguf(gguf_path: str, chat_template: str) -> str:
    """A Qwen2-style GGUF (byte-level BPE, llama.cpp's "qwen2" pre-tokenizer) with a small vocabulary: the 256
    byte symbols, five merges of " hello", the ChatML special tokens and two tool-call tags (not special),
    and `chat_template`. Transformers builds its tokenizer as a Qwen2Tokenizer. Returns its path."""
    # GPT-2's byte-to-symbol table: printable bytes stand for themselves, the rest follow from 256 on.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    symbols = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
    merged = ["\u0120h", "\u0120he", "ll", "\u0120hell", "\u0120hello"]
    merges = ["\u0120 h", "\u0120h e", "l l", "\u0120he ll", "\u0120hell o"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tags = ["<tool_call>", "</tool_call>"]
    tokens = [*symbols, *merged, *specials, *tags]
    first_special = len(symbols) + len(merged)
    writer = _small_gguf_writer(gguf_path, "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    # gguf's token types: 1 normal, 3 control, 4 user-defined.
    writer.add_token_types([1] * first_special + [3] * len(specials) + [4] * len(tags))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(first_special)
    writer.add_eos_token_id(first_special + 2)
    writer.add_pad_token_id(first_special)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
    return _finish_small_gguf(writer, len(tokens), gguf_path)


def write_config_gguf(gguf_path: str, arch: str, metadata: dict[str, Any], context_length: int = 64) -> str:
    """A one-layer GGUF file of `arch` (no weights but the embedding) whose metadata also holds `metadata`,
    keys without the `{arch}.` prefix (`{"rope.scaling.type": "yarn"}`), each stored in the type llama.cpp's
    converter gives it: str as string, bool as bool, int as uint32, float as float32. For config tests."""
    writer = _small_gguf_writer(gguf_path, arch, context_length)
    for name, value in metadata.items():
        key = f"{arch}.{name}"
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, float(value))
    return _finish_small_gguf(writer, 16, gguf_path)
