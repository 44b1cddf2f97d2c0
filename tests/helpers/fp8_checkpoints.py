"""fp8 checkpoints written from a dense checkpoint, for differential tests of their loading: vLLM's "fp8" format,
llm-compressor's "compressed-tensors" and FBGEMM's "fbgemm_fp8" (their `quantization_config` and tensor names).

Per output channel the weights are quantized by `ops.quantize_rows_fp8`, the function `--quantization fp8` uses
at load, so such a checkpoint holds exactly what online fp8 makes of the dense one (for float32 models: the
weights are quantized from the checkpoint's own values).

Block-wise (`write_block_fp8_checkpoint`: vLLM's "fp8" with `weight_block_size`, as DeepSeek's and Qwen's FP8
releases, or compressed-tensors' "block" strategy) each bn x bk block gets its own scale; `write_dequantized_checkpoint`
writes the dense checkpoint of what such a checkpoint stands for, the oracle of its loading.

`fp8_core` / `fp8_runs`: the small CPU engine both files of these tests run, and its greedy tokens with each
step's top 5."""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from helpers.engine_runs import greedy_with_logprobs
from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore
from kvserve.kernels import ops

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_FP8 = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
FBGEMM = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"], "activation_scale_ub": 1200.0}
MAX_TOKENS = 12  # generated per prompt by `fp8_runs`


def fp8_core(path: str, quantization: str | None = None, **kwargs: Any) -> EngineCore:
    """A CPU engine of `path` (`quantization`: --quantization), small limits unless `kwargs` set them."""
    settings: dict[str, Any] = {"max_model_len": 128, "num_kv_blocks": 32, "max_num_batched_tokens": 64, **kwargs}
    return EngineCore(EngineArgs(model=path, device="cpu", quantization=quantization, **settings).create_engine_config())


def fp8_runs(core: EngineCore) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Three prompts' greedy tokens (MAX_TOKENS each) and each step's full top-5 (the sampled token's own logprob
    included); shuts `core` down."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (7, 30, 65)]
    try:
        out = greedy_with_logprobs(core, prompts, MAX_TOKENS)
    finally:
        core.shutdown()
    return [(tokens, [dict(zip(lp.token_ids, lp.logprobs, strict=True)) for lp in lps]) for tokens, lps in out]


def block_fp8_config(block: tuple[int, int]) -> dict[str, Any]:
    """vLLM's "fp8" config of a block-wise checkpoint, as Qwen's and DeepSeek's FP8 releases write it."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def compressed_tensors(strategy: str, ignore: list[str] | None = None, dynamic: bool = True,
                       block: tuple[int, int] | None = None) -> dict[str, Any]:
    """llm-compressor's config for fp8 weights (`strategy` "tensor", "channel", or "block" with `block` as its
    block_structure) and fp8 activations."""
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                               "dynamic": False}
    if block is not None:
        weights["block_structure"] = list(block)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore or ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token" if dynamic else "tensor",
                                      "dynamic": dynamic, "symmetric": True}}}}


def _per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().amax().float() / 448.0
    return (weight.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def write_fp8_checkpoint(source: str, directory: str, quant: dict[str, Any], per_tensor: bool,
                         scale_shape: str = "column", skip: tuple[str, ...] = (),
                         extra: dict[str, torch.Tensor] | None = None) -> str:
    """`source`'s checkpoint with every q/k/v/o/gate/up/down weight (but those whose names contain a part of `skip`)
    stored in e4m3 with a `weight_scale`: one per tensor (`per_tensor`, 0-dim) or per output row, [N, 1]
    (`scale_shape` "column") or [N] ("row"); a static `input_scale` beside each. config.json gets `quant`."""
    shutil.copytree(source, directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    for name in list(tensors):
        if not name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)) or any(part in name for part in skip):
            continue
        prefix = name[: -len(".weight")]
        if per_tensor:
            w8, scale = _per_tensor(tensors[name])
        else:
            w8, scale = ops.quantize_rows_fp8(tensors[name])
            scale = scale.view(-1, 1) if scale_shape == "column" else scale
        tensors[name] = w8
        tensors[f"{prefix}.weight_scale"] = scale.contiguous()
        tensors[f"{prefix}.input_scale"] = torch.tensor(0.05)
    tensors.update(extra or {})
    save_file(tensors, path)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], float32 scales [ceil(N / bn), ceil(K / bk)]): each block (the last ones
    partial) divided by its largest magnitude / 448."""
    (bn, bk), (n, k) = block, weight.shape
    w8 = torch.empty((n, k), dtype=FP8)
    scales = torch.empty((math.ceil(n / bn), math.ceil(k / bk)), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            scale = part.abs().amax() / 448.0
            scale = scale if scale > 0 else torch.tensor(1.0)
            scales[i, j] = scale
            w8[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (part / scale).clamp(-448.0, 448.0).to(FP8)
    return w8, scales


def block_dequantize(w8: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 weight a block-wise fp8 tensor stands for: each block's e4m3 values times its scale (block by
    block, the reference the loader's per-row / per-column lookup is checked against)."""
    bn, bk = block
    out = torch.empty(w8.shape, dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[rows, cols] = w8[rows, cols].float() * scales[i, j]
    return out


def write_block_fp8_checkpoint(source: str, directory: str, block: tuple[int, int], compressed: bool = False,
                               seed: int = 0, extra: dict[str, torch.Tensor] | None = None) -> str:
    """`source`'s checkpoint with every q/k/v/o/gate/up/down weight quantized block-wise (`block_quantize`), its
    scales as `weight_scale_inv` (vLLM's "fp8" config, `block_fp8_config`) or `weight_scale` (`compressed`:
    compressed-tensors' "block" strategy). Each block of the dense weight is first multiplied by 2 ** u, u drawn
    from {-2, -1.5, ..., 2} (`seed`), so that neighbouring blocks' scales differ by up to 16x and a scale applied
    to the wrong block, row or column moves the outputs."""
    shutil.copytree(source, directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    bn, bk = block
    for name in list(tensors):
        if not name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            continue
        weight = tensors[name].float()
        n, k = weight.shape
        exponents = torch.randint(-4, 5, (math.ceil(n / bn), math.ceil(k / bk)), generator=generator) / 2
        factors = (2.0 ** exponents).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        w8, scales = block_quantize(weight * factors, block)
        tensors[name] = w8
        tensors[name + ("_scale" if compressed else "_scale_inv")] = scales
    tensors.update(extra or {})
    save_file(tensors, path)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = (compressed_tensors("block", block=block) if compressed
                                     else block_fp8_config(block))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def write_dequantized_checkpoint(block_checkpoint: str, directory: str, block: tuple[int, int]) -> str:
    """The dense checkpoint a block-wise one (`write_block_fp8_checkpoint`) stands for: each weight dequantized
    (`block_dequantize`, float32) and cast to the dtype of the checkpoint's embedding, as a dense export of the
    same values holds it; no quantization_config."""
    shutil.copytree(block_checkpoint, directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    dtype = tensors["model.embed_tokens.weight"].dtype
    for name in [n for n in tensors if n.endswith((".weight_scale_inv", ".weight_scale"))]:
        scales = tensors.pop(name)
        weight_name = name[: name.rindex(".")] + ".weight"
        tensors[weight_name] = block_dequantize(tensors[weight_name], scales, block).to(dtype)
    save_file(tensors, path)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory
