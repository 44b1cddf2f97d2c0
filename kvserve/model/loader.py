"""Build a model for a `ModelConfig` and fill it from safetensors shards or a GGUF file."""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

from kvserve import distributed
from kvserve.config import ModelConfig
from kvserve.kernels.reference import is_fp8
from kvserve.layers.attention import Attention
from kvserve.layers.linear import fp8_checkpoint_layers, quantize_fp8_layers
from kvserve.model.arch import ArchConfig, load_arch_config
from kvserve.model.gguf import dequantization_summary, iter_gguf_weights
from kvserve.model.paths import ModelLoadError
from kvserve.model.registry import CausalLM, get_model_class

__all__ = ["CausalLM", "init_dummy_weights", "iter_safetensors_weights", "iter_weights", "load_model",
           "parameter_bytes", "use_kv_cache_scales"]

logger = logging.getLogger(__name__)

# Standard deviation of dummy weights: the usual init scale of these models (HF initializer_range), so
# activations and logits have realistic magnitudes rather than near-uniform softmaxes.
_DUMMY_STD = 0.02


def load_model(model_config: ModelConfig, device: torch.device, kv_cache_dtype: torch.dtype | None = None) -> CausalLM:
    """The model of `model_config.model` on `device`, parameters in `model_config.dtype`, in eval mode, set up
    for a KV cache of `kv_cache_dtype` (None: the model's dtype): with an fp8 cache each layer's attention takes
    the checkpoint's KV-cache scales where it has them (`use_kv_cache_scales`).

    Parameters are allocated directly on `device` and each checkpoint tensor is copied (and cast) into
    place as it is read, so peak host memory is about one tensor, not one model.
    """
    arch = load_arch_config(model_config.model)
    if model_config.max_model_len > arch.max_positions:  # allowed by the user (config's check): RoPE that long
        arch = dataclasses.replace(arch, long_max_model_len=model_config.max_model_len)
    model_cls = get_model_class(arch.architecture)
    dtype = getattr(torch, model_config.dtype)
    with torch.device(device):
        model = model_cls(arch, dtype)
    with torch.no_grad():
        if model_config.load_format == "dummy":
            init_dummy_weights(model, model_config.seed)
            model.finish_loading()
        else:
            model.load_weights(iter_weights(model_config.model, arch))
            if model_config.is_gguf:
                # A user who picked a 4-bit GGUF to fit a small GPU learns here why it takes more.
                logger.info("%s", dequantization_summary(model_config.model, parameter_bytes(model),
                                                         model_config.dtype))
        summary = None
        if model_config.quantization == "fp8":
            # After every shard is in (merged and tensor-parallel layers whole), and the same for dummy weights.
            # NOTE: the model's dtype weights are all resident before this: a checkpoint must fit at load.
            summary = quantize_fp8_layers(model)
        elif arch.quantization is not None and arch.quantization.method == "fp8":
            summary = fp8_checkpoint_layers(model)
            # (once, not once per tensor-parallel worker)
            if (arch.quantization.weight_block is not None and model_config.load_format != "dummy"
                    and distributed.tp_group().rank == 0):
                logger.warning("the fp8 checkpoint's weights have block-wise scales (blocks of %d x %d): each weight was "
                               "dequantized with them at load and requantized per output channel, as --quantization fp8 "
                               "quantizes, so outputs differ slightly from an engine that applies the block scales in "
                               "its matmul", *arch.quantization.weight_block)
            if arch.quantization.static_activations:
                logger.info("the fp8 checkpoint's static activation scales are not used: where activations are "
                            "quantized (past the skinny matmul's rows), each token gets its own scale at run time")
        if summary is not None:
            (logger.warning if summary.unfit_layers else logger.info)("%s", summary.describe())
    use_kv_cache_scales(model, kv_cache_dtype is not None and is_fp8(kv_cache_dtype),
                        declared=arch.kv_cache_scheme and model_config.load_format != "dummy")
    release_load_hooks(model)
    return model.eval()


# The parameter attributes that only loading uses (layers.linear, layers.embedding, layers.quantization,
# layers.moe).
_LOAD_HOOKS = ("weight_loader", "dummy_fill", "describe_shard")


def release_load_hooks(model: torch.nn.Module) -> None:
    """Drop what only loading uses from every parameter of a loaded model: `weight_loader` and `dummy_fill`, bound
    methods or closures of the layer that holds the parameter (and the experts' `describe_shard`). Each is a
    reference cycle (layer -> parameter -> method -> layer), which reference counting cannot free: a dropped model
    (an `LLM` gone out of scope) kept its weights until the garbage collector's next full collection, which the
    few Python objects an engine makes seldom start (`LLM`s made one after another in one process grew it by
    about 400 MB each with the default model on CPU, and the test suite's workers to 6 GB)."""
    for param in model.parameters():
        for name in _LOAD_HOOKS:
            param.__dict__.pop(name, None)


def use_kv_cache_scales(model: torch.nn.Module, fp8_cache: bool, declared: bool = False) -> None:
    """Sets every attention layer's k_scale / v_scale for the cache (`Attention.use_kv_cache_scales`): with an
    fp8 cache, the checkpoint's per-layer scales (1.0 for a layer it has none for); otherwise 1.0, as vLLM
    enforces for an unquantized cache whatever the checkpoint carries. Logs what the checkpoint's scales do;
    `declared`: its config declares scales (a kv_cache_scheme), so an fp8 cache without them is warned of."""
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    for layer in layers:
        layer.use_kv_cache_scales(fp8_cache)
    scaled = [layer.checkpoint_kv_scales for layer in layers if layer.checkpoint_kv_scales is not None]
    if not scaled:
        if declared and fp8_cache:
            logger.warning("The checkpoint's quantization_config declares a kv_cache_scheme, but none of its tensors "
                           "is a KV-cache scale (k_scale / v_scale): the fp8 KV cache uses 1.0 for every layer, which "
                           "may saturate. Re-export the checkpoint with its scales, or use --kv-cache-dtype auto")
        return
    if not fp8_cache:
        logger.info("The checkpoint's KV-cache scales (%d of %d layers) are loaded and not used: they scale an fp8 KV "
                    "cache (--kv-cache-dtype fp8 / fp8_e5m2), this one holds the model's dtype", len(scaled), len(layers))
        return
    k_scales, v_scales = [k for k, _ in scaled], [v for _, v in scaled]
    described = f"k_scale {min(k_scales):.4g}..{max(k_scales):.4g}, v_scale {min(v_scales):.4g}..{max(v_scales):.4g}"
    if len(scaled) < len(layers):
        logger.warning("The checkpoint has KV-cache scales for %d of %d layers (%s); the fp8 KV cache of the other "
                       "layers uses 1.0", len(scaled), len(layers), described)
    else:
        logger.info("The fp8 KV cache uses the checkpoint's per-layer scales (%s)", described)


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter with random values drawn on its own device (no files, no host copies).

    Matrices and biases get N(0, 0.02^2); norm weights 1 + N(0, 0.02^2) so the residual stream keeps its
    scale. Deterministic in `seed` for a given device. For benchmarks at real shapes: the model computes
    nothing meaningful, but every kernel sees realistic (non-zero, non-constant) data.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        generator = generators.get(param.device)
        if generator is None:
            generator = torch.Generator(device=param.device)
            generator.manual_seed(seed)
            generators[param.device] = generator
        # normal_ has no kernel for every dtype/device pair in old torch; draw in fp32 chunks then cast.
        dummy_fill = getattr(param, "dummy_fill", None)
        if dummy_fill is not None:  # quantized layers' integers and scales (layers.quantization)
            dummy_fill(param, generator)
            continue
        flat = param.data.view(-1)
        chunk = 1 << 26
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            values = torch.empty(part.shape, dtype=torch.float32, device=part.device)
            values.normal_(0.0, _DUMMY_STD, generator=generator)
            if name.endswith("norm.weight"):
                values += 1.0
            part.copy_(values)


def iter_weights(path: str, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, CPU tensor) for every weight of an HF directory or a .gguf file."""
    if path.endswith(".gguf"):
        return iter_gguf_weights(
            path,
            # llama.cpp permutes q/k rows only for its llama architecture, Mixtral included (see
            # gguf.unpermute_qk_rows).
            unpermute_qk=arch.architecture in ("LlamaForCausalLM", "MixtralForCausalLM"),
            num_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_key_value_heads,
        )
    return iter_safetensors_weights(path)


# The index of a sharded checkpoint (as `save_pretrained` writes it): {"weight_map": {tensor: shard file}}.
SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of `model_dir`: the shards its `model.safetensors.index.json` names when it has one (as
    vLLM and HF Transformers read a sharded checkpoint; other safetensors files beside them, such as a
    consolidated copy or an adapter, are not the model's), else every `*.safetensors` file. ModelLoadError for
    an unreadable index or a shard it names that is not there (unless a one-file `model.safetensors` is: a stale
    index beside the file that replaced its shards, which HF Transformers reads too)."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if not os.path.isfile(index_path):
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise ModelLoadError(f"model directory {model_dir} has no *.safetensors weights")
        return files
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read {index_path}: {exc}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index_path} has no weight_map naming the checkpoint's shards")
    shards = sorted(set(map(str, weight_map.values())))
    missing = [shard for shard in shards if not os.path.isfile(os.path.join(model_dir, shard))]
    single = os.path.join(model_dir, "model.safetensors")
    if missing and os.path.isfile(single):
        # a stale index beside the one-file checkpoint that replaced its shards: HF Transformers reads that file
        logger.warning("%s names shards that are not there (%s); loading %s instead", index_path, missing[0], single)
        return [single]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(f"model directory {model_dir} lacks {shown}, named in {SAFETENSORS_INDEX} "
                             f"({len(missing)} of its {len(shards)} shards missing: an incomplete download?)")
    return [os.path.join(model_dir, shard) for shard in shards]


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files (`safetensors_files`), read one at a time.
    ModelLoadError naming the file for one that is not valid safetensors (truncated, not safetensors at all) or
    cannot be opened (a link to a missing blob of a Hugging Face cache)."""
    for file in safetensors_files(model_dir):
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:  # (OSError: a broken link into a cache's blobs, say)
            raise ModelLoadError(f"cannot read weights file {file}: {exc} (a corrupt or incomplete download? "
                                 "fetch the file again)") from None
