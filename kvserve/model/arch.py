"""The model's shape and flavour (`ArchConfig`), read from an HF `config.json` or from GGUF metadata.

One frozen dataclass describes every supported decoder: Llama, Qwen2 (bias on q/k/v), Qwen3 (RMSNorm on
each q/k head, head_dim independent of hidden_size / num_heads), and the mixture-of-experts Qwen3-MoE (Qwen3's
attention), Qwen2-MoE (Qwen2's, and a shared expert beside the routed ones) and Mixtral (Llama's), whose MLP is a
routed set of experts in the layers `moe_layers` names. Model
code reads only these fields, never the architecture name, so a GGUF and a safetensors checkpoint of one model
build the same network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.layers.activation import supported_activations
from kvserve.layers.quantization import QuantConfig, is_kv_cache_only, parse_quant_config
from kvserve.layers.rotary import check_rope_scaling
from kvserve.model.gguf import GGUFInfo, check_tensor_types, read_gguf_info
from kvserve.model.gguf_rope import rope_scaling_from_gguf
from kvserve.model.paths import ModelLoadError
from kvserve.model.registry import is_supported_architecture, supported_architectures


@dataclass(frozen=True)
class ArchConfig:
    """Hyper-parameters of a decoder-only transformer, in HF's names.

    rope_scaling: None for plain RoPE, else {"rope_type": "linear" | "llama3" | "yarn", <its parameters>}.
    rope_freq_factors: per-frequency divisors (GGUF `rope_freqs`), or None.
    attention_bias / o_proj_bias / mlp_bias: bias on the q/k/v, o and MLP projections respectively.
    qk_norm: RMSNorm over head_dim on every q and k head before RoPE (Qwen3).
    eos_token_ids: every id that ends generation (config.json and generation_config.json merged).
    quantization: how the checkpoint's linear layers are quantized (AWQ / GPTQ), None for dense weights.
    config_dtype: the checkpoint's dtype as its config.json says (`dtype`, or the older `torch_dtype`):
    "float16", "bfloat16" or "float32"; None where it says none, or for a GGUF file (--dtype auto reads it).
    kv_cache_scheme: the quantization_config declares per-layer KV-cache scales (compressed-tensors'
    `kv_cache_scheme`), which the checkpoint's tensors should then carry.
    num_experts / num_experts_per_tok / moe_intermediate_size / norm_topk_prob: a mixture-of-experts model's
    experts, how many each token is routed to, each expert's MLP width, and whether the chosen experts' weights
    are renormalised to sum to 1 (Mixtral always; Qwen3-MoE's `norm_topk_prob`). moe_layers: the layers whose
    MLP is the experts (the others have the dense MLP of `intermediate_size`); empty for a dense model.
    shared_expert_intermediate_size: the width of the dense SiLU-gated MLP every MoE layer runs beside its routed
    experts (Qwen2-MoE's shared expert, its output scaled by a sigmoid gate); 0 for none.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    o_proj_bias: bool = False
    mlp_bias: bool = False
    rope_freq_factors: tuple[float, ...] | None = None
    quantization: QuantConfig | None = None
    config_dtype: str | None = None
    kv_cache_scheme: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    # Every layer attends within this many tokens (Mixtral's `sliding_window`), None for full attention. kvserve
    # has no windowed attention: the engine config refuses a max_model_len past it (up to it the two are equal).
    sliding_window: int | None = None
    # A --max-model-len past `max_positions` that the user allowed (KVSERVE_ALLOW_LONG_MAX_MODEL_LEN): the RoPE
    # table is built that long (set by the loader, never read from a checkpoint).
    long_max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in supported_activations():
            raise ModelLoadError(
                f"model config: hidden_act {self.hidden_act!r} is not supported; supported: "
                f"{', '.join(supported_activations())}"
            )
        try:
            check_rope_scaling(self.rope_scaling)
        except ValueError as exc:
            raise ModelLoadError(f"model config: {exc}") from None
        if self.moe_layers:
            self._check_experts()
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelLoadError(
                f"rope_freqs has {len(self.rope_freq_factors)} values, expected head_dim/2 = "
                f"{self.head_dim // 2}"
            )

    def _check_experts(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelLoadError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ModelLoadError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) is more than the "
                                 f"model's {self.num_experts} experts")
        shared = self.shared_expert_intermediate_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ModelLoadError(f"model config: shared_expert_intermediate_size must be a non-negative integer, got "
                                 f"{shared!r}")
        if self.hidden_act != "silu":
            raise ModelLoadError(f"model config: hidden_act {self.hidden_act!r} in a mixture-of-experts model is not "
                                 "supported (its experts run SiLU-gated MLPs)")

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return bool(self.moe_layers)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer's MLP is the dense one (of `intermediate_size`)."""
        return len(self.moe_layers) < self.num_hidden_layers

    @property
    def max_positions(self) -> int:
        """The longest context the model's RoPE covers: the size of the cos/sin table and the largest
        max_model_len, derived as vLLM derives it. A scaling that stretches positions by its factor extends
        the length by it: YaRN from its original_max_position_embeddings (32768 * 4 for Qwen2.5, whose
        config.json keeps max_position_embeddings 32768), linear from max_position_embeddings. Llama 3's
        scaling leaves max_position_embeddings as it is (its config.json already states the extended
        length), as does no scaling."""
        scaling = self.rope_scaling
        if scaling is not None and scaling["rope_type"] == "yarn":
            return int(scaling["original_max_position_embeddings"] * scaling["factor"])
        if scaling is not None and scaling["rope_type"] == "linear":
            return int(self.max_position_embeddings * scaling["factor"])
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_cache_bytes_per_token(self, element_size_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * element_size_bytes


@dataclass(frozen=True)
class _Family:
    """Defaults HF's config class applies when config.json omits a key, plus fixed per-family traits."""

    max_position_embeddings: int
    head_dim: int | None  # None: hidden_size // num_attention_heads
    # When config.json lacks the key (an explicit null is num_attention_heads for every family, as in HF's
    # config classes). None: num_attention_heads (LlamaConfig's); Qwen2Config and Qwen3Config default it to 32.
    num_key_value_heads: int | None
    bos_token_id: int | None
    eos_token_id: int | None
    qkv_bias_always: bool  # Qwen2 hard-codes q/k/v bias; others follow `attention_bias`
    o_proj_bias_follows_attention_bias: bool
    qk_norm: bool
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # "qwen3_moe" / "qwen2_moe" / "mixtral": a mixture-of-experts family, whose config keys `_moe_fields` reads;
    # None: dense.
    moe: str | None = None
    attention_bias_key: bool = True  # False: the family's attention has no bias whatever config.json says
    # True: q/k/v bias follows config.json's `qkv_bias`, default true (Qwen2MoeConfig's; `attention_bias` unread)
    qkv_bias_key: bool = False
    # The config class's intermediate_size where config.json lacks the key (the dense MLP's width; Mixtral's
    # experts'); None: the key is required.
    intermediate_size: int | None = None


_FAMILIES: dict[str, _Family] = {
    "LlamaForCausalLM": _Family(
        max_position_embeddings=2048, head_dim=None, num_key_value_heads=None, bos_token_id=1, eos_token_id=2,
        qkv_bias_always=False, o_proj_bias_follows_attention_bias=True, qk_norm=False, intermediate_size=11008,
    ),
    "Qwen2ForCausalLM": _Family(
        max_position_embeddings=32768, head_dim=None, num_key_value_heads=32, bos_token_id=None, eos_token_id=None,
        qkv_bias_always=True, o_proj_bias_follows_attention_bias=False, qk_norm=False, intermediate_size=22016,
    ),
    "Qwen3ForCausalLM": _Family(
        max_position_embeddings=32768, head_dim=128, num_key_value_heads=32, bos_token_id=None, eos_token_id=None,
        qkv_bias_always=False, o_proj_bias_follows_attention_bias=True, qk_norm=True, intermediate_size=22016,
    ),
    # Qwen3MoeConfig: no head_dim default (hidden_size / num_attention_heads), 4 KV heads.
    "Qwen3MoeForCausalLM": _Family(
        max_position_embeddings=32768, head_dim=None, num_key_value_heads=4, bos_token_id=None, eos_token_id=None,
        qkv_bias_always=False, o_proj_bias_follows_attention_bias=True, qk_norm=True, moe="qwen3_moe",
        intermediate_size=6144,
    ),
    # Qwen2MoeConfig: Qwen2's attention (q/k/v bias by `qkv_bias`, default true; no o_proj bias), head_dim hidden /
    # heads unless config.json names one, 16 KV heads.
    "Qwen2MoeForCausalLM": _Family(
        max_position_embeddings=32768, head_dim=None, num_key_value_heads=16, bos_token_id=None, eos_token_id=None,
        qkv_bias_always=False, o_proj_bias_follows_attention_bias=False, qk_norm=False, moe="qwen2_moe",
        attention_bias_key=False, qkv_bias_key=True, intermediate_size=5632,
    ),
    # MixtralConfig: Llama's attention without any bias, RoPE theta 1e6, eps 1e-5, 8 KV heads.
    "MixtralForCausalLM": _Family(
        max_position_embeddings=4096 * 32, head_dim=None, num_key_value_heads=8, bos_token_id=1, eos_token_id=2,
        qkv_bias_always=False, o_proj_bias_follows_attention_bias=False, qk_norm=False, rope_theta=1e6,
        rms_norm_eps=1e-5, moe="mixtral", attention_bias_key=False, intermediate_size=14336,
    ),
}

# GGUF architectures of mixture-of-experts models kvserve does not load from GGUF (it loads "qwen3moe", and Mixtral,
# which llama.cpp writes as "llama" with an `expert_count`).
GGUF_MOE_ARCHITECTURES = ("mixtral", "qwen2moe")

# GGUF `general.architecture` -> HF architecture name ("llama" with experts: `GGUF_LLAMA_MOE_ARCHITECTURE`).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
GGUF_LLAMA_MOE_ARCHITECTURE = "MixtralForCausalLM"
# A mixture-of-experts layer's GGUF tensors (blk.N.<name>.weight): the router, and the experts stacked per
# projection (older Mixtral files: each expert apart, blk.N.ffn_gate.E.weight and so on).
_GGUF_ROUTER = "ffn_gate_inp"
_GGUF_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6


def load_arch_config(path: str) -> ArchConfig:
    """ArchConfig of an HF model directory or a .gguf file (as resolved by `resolve_model_path`)."""
    if path.endswith(".gguf"):
        return _from_gguf(path)
    return _from_hf_dir(path)


# ---------------------------------------------------------------------------------------------- HF dir


def _from_hf_dir(path: str) -> ArchConfig:
    cfg = _read_json(os.path.join(path, "config.json"))
    if cfg is None:
        raise ModelLoadError(f"model directory {path} has no config.json")
    architectures = cfg.get("architectures") or []
    if not architectures:
        raise ModelLoadError(
            f"{path}/config.json has no 'architectures' entry; supported: "
            f"{', '.join(supported_architectures())}"
        )
    architecture = architectures[0]
    family = _family(architecture)
    sliding = _sliding_layers(cfg, family) if family.moe is None else _moe_sliding_layers(cfg, family)
    if sliding:
        raise ModelLoadError(f"{path}: sliding-window attention layers are not supported yet (config.json gives "
                             f"{len(sliding)} layer(s) a window of {cfg.get('sliding_window', 4096)} tokens: "
                             f"use_sliding_window, max_window_layers / layer_types)")

    def require(key: str) -> Any:
        if cfg.get(key) is None:
            raise ModelLoadError(f"{path}/config.json lacks {key!r}")
        return cfg[key]

    hidden_size = require("hidden_size")
    num_heads = require("num_attention_heads")
    max_position = int(cfg.get("max_position_embeddings") or family.max_position_embeddings)
    rope_theta, rope_scaling = _rope_from_hf_config(cfg, max_position, family.rope_theta)
    head_dim = cfg.get("head_dim") or family.head_dim or hidden_size // num_heads
    attention_bias = family.attention_bias_key and bool(cfg.get("attention_bias", False))
    moe = _moe_fields(cfg, family, path)

    generation = _read_json(os.path.join(path, "generation_config.json")) or {}
    raw_quant, quant_file = cfg.get("quantization_config"), "config.json"
    if not raw_quant:
        raw_quant, quant_file = _legacy_quant_config(path)
    mlx = cfg.get("quantization")
    if not raw_quant and isinstance(mlx, dict) and "bits" in mlx:
        raise ModelLoadError(
            f"{path}/config.json: 'quantization' {mlx} describes an MLX-quantized checkpoint (mlx-lm's packed weights "
            f"with scales and biases), which kvserve does not load; use the unquantized checkpoint, or an AWQ / GPTQ "
            f"/ GGUF one"
        )
    kv_cache_scheme = bool(raw_quant and raw_quant.get("kv_cache_scheme"))
    if raw_quant and is_kv_cache_only(raw_quant, f"{path}/{quant_file}"):
        raw_quant = None  # dense weights; the checkpoint's KV-cache scales are loaded with them
    quantization = parse_quant_config(raw_quant, f"{path}/{quant_file}") if raw_quant else None
    if quantization is not None and family.moe is not None:
        raise ModelLoadError(
            f"{path}: {architecture} is a mixture-of-experts model, and kvserve does not load quantized "
            f"({quantization.method}) checkpoints of those yet: use the unquantized (bfloat16 / float16) checkpoint"
        )
    eos_ids = _merge_ids(generation.get("eos_token_id"), cfg.get("eos_token_id", family.eos_token_id))
    return ArchConfig(
        architecture=architecture,
        vocab_size=require("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_intermediate_size(cfg, family, path),
        num_hidden_layers=require("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=_num_kv_heads(cfg, family, num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", family.rms_norm_eps)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family.qkv_bias_always or attention_bias or (family.qkv_bias_key
                                                                     and bool(cfg.get("qkv_bias", True))),
        o_proj_bias=family.o_proj_bias_follows_attention_bias and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        bos_token_id=cfg.get("bos_token_id", family.bos_token_id),
        eos_token_ids=eos_ids,
        hidden_act=cfg.get("hidden_act", "silu"),
        quantization=quantization,
        config_dtype=_config_dtype(cfg),
        kv_cache_scheme=kv_cache_scheme,
        **moe,
    )


def _intermediate_size(cfg: dict[str, Any], family: _Family, path: str) -> Any:
    """config.json's intermediate_size, or, where it lacks the key, the family's config class default, as HF reads
    it (a MoE model whose every layer is MoE never uses it, but Mixtral's experts are that wide)."""
    value = cfg.get("intermediate_size", family.intermediate_size)
    if value is None:
        raise ModelLoadError(f"{path}/config.json lacks 'intermediate_size'")
    return value


def _moe_fields(cfg: dict[str, Any], family: _Family, path: str) -> dict[str, Any]:
    """ArchConfig's mixture-of-experts fields from config.json, with HF's config classes' defaults for missing
    keys ({} for a dense family). Qwen3-MoE (Qwen3MoeConfig): num_experts (128; saved by Transformers 5 as
    `num_local_experts`, its attribute_map's name), num_experts_per_tok (8), moe_intermediate_size (768),
    norm_topk_prob (false), and layer i is MoE unless listed in mlp_only_layers, and when (i + 1) %
    decoder_sparse_step == 0 (step 1) and num_experts > 0, as Qwen3MoeDecoderLayer decides. Qwen2-MoE
    (Qwen2MoeConfig): the same keys and layer rule with 60 experts, 4 per token, width 1408, and a shared expert
    of shared_expert_intermediate_size (5632) in every MoE layer. Mixtral
    (MixtralConfig): num_local_experts (8), num_experts_per_tok (2), each expert intermediate_size wide, every
    layer MoE, weights always renormalised."""
    if family.moe is None:
        return {}
    num_layers = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else 0
    if family.moe == "mixtral":
        return {
            "num_experts": cfg.get("num_local_experts", cfg.get("num_experts", 8)),
            "num_experts_per_tok": cfg.get("num_experts_per_tok", 2),
            "moe_intermediate_size": _intermediate_size(cfg, family, path),
            "norm_topk_prob": True,
            "moe_layers": tuple(range(num_layers)),
            "sliding_window": _mixtral_window(cfg, path),
        }
    qwen2 = family.moe == "qwen2_moe"
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 60 if qwen2 else 128))
    step = cfg.get("decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ModelLoadError(f"{path}/config.json: decoder_sparse_step must be a positive integer, got {step!r}")
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ModelLoadError(f"{path}/config.json: mlp_only_layers must be a list of layer indices, got {dense!r}")
    sparse = isinstance(num_experts, int) and num_experts > 0
    layers = tuple(i for i in range(num_layers) if sparse and i not in dense and (i + 1) % step == 0)
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": cfg.get("num_experts_per_tok", 4 if qwen2 else 8),
        "moe_intermediate_size": cfg.get("moe_intermediate_size", 1408 if qwen2 else 768),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "moe_layers": layers,
    }
    if qwen2:
        fields["shared_expert_intermediate_size"] = cfg.get("shared_expert_intermediate_size", 5632)
    return fields


def _mixtral_window(cfg: dict[str, Any], path: str) -> int | None:
    """Mixtral's `sliding_window` (every layer's; null in the released checkpoints): None, or the window, which
    the engine config holds max_model_len to (`ArchConfig.sliding_window`)."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"{path}/config.json: sliding_window must be a positive integer or null, got {window!r}")
    return window


def _moe_sliding_layers(cfg: dict[str, Any], family: _Family) -> list[int]:
    """The sliding-window layers of a config with `use_sliding_window` and a `sliding_window` (default 4096):
    Qwen3-MoE's every layer (Qwen3MoeConfig has no max_window_layers); Qwen2-MoE's those `layer_types` marks
    "sliding_attention", else, as Qwen2MoeConfig places them, every other layer (0, 2, ...) below
    max_window_layers (28). Mixtral's window is `ArchConfig.sliding_window`, not refused here."""
    if family.moe not in ("qwen3_moe", "qwen2_moe") or not cfg.get("use_sliding_window"):
        return []
    if cfg.get("sliding_window", _DEFAULT_SLIDING_WINDOW) is None:
        return []
    num_layers = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else 0
    if family.moe == "qwen3_moe":
        return list(range(num_layers))
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    first_full = cfg.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
    first_full = first_full if isinstance(first_full, int) else 0
    return [i for i in range(num_layers) if i % 2 == 0 and i < first_full]


def _num_kv_heads(cfg: dict[str, Any], family: _Family, num_heads: int) -> Any:
    """num_key_value_heads as HF Transformers' config class reads config.json: the family's default when the key is
    missing (32 for Qwen2 and Qwen3, whatever their number of attention heads), num_attention_heads when it is
    null. (A checkpoint whose K/V projections do not fit that number fails to load in Transformers too.)"""
    if "num_key_value_heads" not in cfg:
        default = family.num_key_value_heads or num_heads
        if isinstance(num_heads, int) and num_heads > 0 and num_heads % default:
            raise ModelLoadError(
                f"model config: no num_key_value_heads, and this family's default ({default}, as HF Transformers "
                f"reads such a config) does not divide num_attention_heads ({num_heads}); add "
                "num_key_value_heads to config.json (num_attention_heads for a model without grouped-query "
                "attention)")
        return default
    value = cfg["num_key_value_heads"]
    return num_heads if value is None else value


# HF Transformers' Qwen2 / Qwen3 config defaults for the keys that place sliding-window layers.
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28


def _sliding_layers(cfg: dict[str, Any], family: _Family) -> list[int]:
    """The layers that attend within a sliding window, as HF Transformers places them: for Qwen2 / Qwen3 only
    with `use_sliding_window` and a `sliding_window` (null: none), then the layers `layer_types` marks
    "sliding_attention", else those from `max_window_layers` on (so a config with use_sliding_window true and
    max_window_layers >= num_hidden_layers has none). A Llama config naming either is taken as sliding
    everywhere (Transformers' Llama has no such layers: such a checkpoint is likely another model's)."""
    num_layers = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else 0
    layer_types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else None
    if not family.qk_norm and not family.qkv_bias_always:  # Llama
        named = cfg.get("use_sliding_window") or "sliding_attention" in (layer_types or [])
        return list(range(num_layers)) if named else []
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window", _DEFAULT_SLIDING_WINDOW) is None:
        return []
    if layer_types is not None:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    first = cfg.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
    return list(range(first if isinstance(first, int) else 0, num_layers))


# Keys only AutoAWQ's own settings file has (GPTQ's name them bits / group_size).
_AWQ_KEYS = ("w_bit", "q_group_size", "zero_point", "version")


def _legacy_quant_config(path: str) -> tuple[dict[str, Any] | None, str]:
    """(settings, file name) of a quantized checkpoint whose config.json has no quantization_config: older
    exports keep them in a file of their own, without the quant_method key, AutoGPTQ in quantize_config.json
    and AutoAWQ in quant_config.json (w_bit, q_group_size, zero_point, version), the files vLLM reads for
    them. (None, "") where neither is there."""
    for name in ("quantize_config.json", "quant_config.json"):
        raw = _read_json(os.path.join(path, name))
        if raw is None:
            continue
        if "quant_method" not in raw:
            awq = name == "quant_config.json" or any(key in raw for key in _AWQ_KEYS)
            raw = {**raw, "quant_method": "awq" if awq else "gptq"}
        return raw, name
    return None, ""


# config.json's dtype names (Transformers writes torch's name without "torch."; a few older exports keep it).
_CONFIG_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32",
                  "float": "float32"}


def _config_dtype(cfg: dict[str, Any]) -> str | None:
    """The checkpoint's dtype: `dtype` (Transformers 5) or `torch_dtype`, at the top or in `text_config`; None
    for a missing or unknown value (--dtype auto then takes the device's default)."""
    for source in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if isinstance(value, str):
                name = _CONFIG_DTYPES.get(value.lower().removeprefix("torch."))
                if name is not None:
                    return name
    return None


def _rope_from_hf_config(
    cfg: dict[str, Any], max_position: int, default_theta: float = 10000.0
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers-5 `rope_parameters` or the older `rope_theta` +
    `rope_scaling` (whose type key is `type` or `rope_type`). Where config.json has both, a `rope_scaling`
    replaces `rope_parameters` whole, as Transformers 5 reads it: it is what users add to a config to turn on
    YaRN (Qwen2.5's instructions), also to one a newer Transformers saved with default `rope_parameters`; its
    theta is then the top level's `rope_theta` (or the default)."""
    source = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    params: dict[str, Any] = dict(source) if isinstance(source, dict) else {}
    if any(isinstance(value, dict) for value in params.values()):
        raise ModelLoadError("per-layer-type rope parameters are not supported")
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or default_theta
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        return float(theta), None
    if rope_type in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
        # The pre-training length from the rope parameters, else the model config's top level, else (as HF
        # falls back) the model's own length.
        params["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings") or max_position
    return float(theta), {"rope_type": rope_type, **params}


# ------------------------------------------------------------------------------------------------ GGUF


def _from_gguf(path: str) -> ArchConfig:
    info = read_gguf_info(path)
    meta = info.metadata
    parts = meta.get("split.count")
    if isinstance(parts, int) and parts > 1:
        # llama.cpp's gguf-split: the metadata is in the first part, the tensors spread over all of them
        part = meta.get("split.no")
        which = f"part {part + 1} of {parts}" if isinstance(part, int) else f"one of {parts} parts"
        raise ModelLoadError(
            f"{os.path.basename(path)} is {which} of a split GGUF model (llama.cpp's gguf-split); kvserve loads a "
            f"single file: merge the parts with `llama-gguf-split --merge <first part> merged.gguf` and pass merged.gguf"
        )
    gguf_arch = meta.get("general.architecture")
    experts = meta.get(f"{gguf_arch}.expert_count")
    has_experts = isinstance(experts, int) and experts > 0
    if gguf_arch in GGUF_MOE_ARCHITECTURES or (has_experts and gguf_arch not in ("llama", "qwen3moe")):
        raise ModelLoadError(
            f"{os.path.basename(path)}: a mixture-of-experts GGUF file (architecture {gguf_arch!r}"
            f"{f', {experts} experts' if isinstance(experts, int) else ''}): kvserve loads only Qwen3-MoE "
            "(qwen3moe) and Mixtral (llama with experts) from GGUF; use the model's HF safetensors checkpoint (Qwen2-MoE loads from those)"
        )
    architecture = GGUF_LLAMA_MOE_ARCHITECTURE if gguf_arch == "llama" and has_experts \
        else GGUF_ARCHITECTURES.get(gguf_arch or "")
    if architecture is None:
        raise ModelLoadError(
            f"{os.path.basename(path)}: GGUF architecture {gguf_arch!r} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    family = _family(architecture)
    check_tensor_types(path, info.tensor_types)

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{gguf_arch}.{name}", default)

    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    if not isinstance(num_heads, int) or not isinstance(hidden_size, int):
        raise ModelLoadError(
            f"{path}: GGUF metadata lacks {gguf_arch}.embedding_length or {gguf_arch}.attention.head_count"
        )
    embedding_shape = info.tensor_shapes.get("token_embd.weight")
    if embedding_shape is None:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    tensors = info.tensor_types
    max_position = key("context_length", family.max_position_embeddings)
    try:
        rope_scaling = rope_scaling_from_gguf(meta, gguf_arch, max_position)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{os.path.basename(path)}: {exc}") from None
    eos_ids = _merge_ids(
        meta.get("tokenizer.ggml.eos_token_id"),
        meta.get("tokenizer.ggml.eot_token_id"),
        meta.get("tokenizer.ggml.eom_token_id"),
    )
    return ArchConfig(
        architecture=architecture,
        vocab_size=embedding_shape[0],
        hidden_size=hidden_size,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=key("attention.head_count_kv", num_heads),
        head_dim=key("attention.key_length") or key("rope.dimension_count") or hidden_size // num_heads,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", _DEFAULT_RMS_NORM_EPS)),
        rope_theta=float(key("rope.freq_base", _DEFAULT_ROPE_THETA)),
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position,
        # The converter drops output.weight exactly when the model ties it to the embedding.
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_down.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        rope_freq_factors=info.rope_freqs,
        **_gguf_moe_fields(path, info, family, key),
    )


def _gguf_moe_fields(path: str, info: GGUFInfo, family: _Family, key: Callable[..., Any]) -> dict[str, Any]:
    """ArchConfig's mixture-of-experts fields from GGUF metadata ({} for a dense family): `expert_count`,
    `expert_used_count`, each expert's width (`expert_feed_forward_length`; Mixtral's files give only
    `feed_forward_length`, every expert's), and the MoE layers: those holding a router (`ffn_gate_inp`), whose
    experts must all be there. Renormalising the chosen experts' weights: `expert_weights_norm` where the file
    has it; where not (llama.cpp's converter writes none for Qwen3-MoE), yes, as llama.cpp's qwen3moe graph always
    renormalises (every released Qwen3-MoE has norm_topk_prob true); Mixtral always renormalises."""
    if family.moe is None:
        return {}
    name = os.path.basename(path)
    layers = tuple(layer for layer in range(key("block_count", 0))
                   if f"blk.{layer}.{_GGUF_ROUTER}.weight" in info.tensor_types)
    if not layers:
        raise ModelLoadError(f"{name}: a mixture-of-experts GGUF file without any router tensor "
                             f"(blk.N.{_GGUF_ROUTER}.weight)")
    num_experts = key("expert_count")
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ModelLoadError(f"{name}: a mixture-of-experts GGUF file whose metadata gives no expert_count")
    for layer in layers:
        for tensor in _GGUF_EXPERT_TENSORS:
            if f"blk.{layer}.{tensor}.weight" in info.tensor_types:
                continue
            apart = f"blk.{layer}.{tensor.replace('_exps', '')}.{{}}.weight"
            if not all(apart.format(e) in info.tensor_types for e in range(num_experts)):
                raise ModelLoadError(f"{name}: layer {layer} has a router ({_GGUF_ROUTER}) but no "
                                     f"blk.{layer}.{tensor}.weight tensor (its experts' "
                                     f"{tensor.split('_')[1]} projections): the file is incomplete")
    norm = key("expert_weights_norm")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length") or key("feed_forward_length"),
        "norm_topk_prob": True if family.moe == "mixtral" or norm is None else bool(norm),
        "moe_layers": layers,
    }


# --------------------------------------------------------------------------------------------- helpers


def _family(architecture: str) -> _Family:
    if not is_supported_architecture(architecture) or architecture not in _FAMILIES:
        raise ModelLoadError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return _FAMILIES[architecture]


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _merge_ids(*sources: int | list[int] | None) -> tuple[int, ...]:
    """Token ids from several int-or-list sources, first occurrence order, duplicates dropped."""
    ids: list[int] = []
    for source in sources:
        values = source if isinstance(source, list) else [source]
        for value in values:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    return tuple(ids)
