"""fp8 checkpoints written from a dense checkpoint, for differential tests of their loading: vLLM's "fp8" format,
llm-compressor's "compressed-tensors" and FBGEMM's "fbgemm_fp8" (their `quantization_config` and tensor names).

Per output channel the weights are quantized by `ops.quantize_rows_fp8`, the function `--quantization fp8` uses
at load, so such a checkpoint holds exactly what online fp8 makes of the dense one (for float32 models: the
weights are quantized from the checkpoint's own values)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvserve.kernels import ops

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_FP8 = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
FBGEMM = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"], "activation_scale_ub": 1200.0}


def compressed_tensors(strategy: str, ignore: list[str] | None = None, dynamic: bool = True) -> dict[str, Any]:
    """llm-compressor's config for fp8 weights (`strategy` "tensor" or "channel") and fp8 activations."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore or ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
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
