"""`kvserve triton-repo`: write a Triton Inference Server model repository that serves a model with kvserve.

    models/<name>/config.pbtxt         backend "python", inputs/outputs, batching, instance group
    models/<name>/1/model.py           loads kvserve.integrations.triton.model.TritonPythonModel
    models/<name>/1/kvserve.json       the engine arguments (the same names as `kvserve serve`'s flags)

Then `tritonserver --model-repository models` (kvserve installed in the Python that Triton's Python backend
uses). Decoupled by default, so `stream=true` requests get their text piece by piece (over gRPC streaming or
the generate_stream endpoint); `--no-decoupled` gives one response per request, with Triton's dynamic
batching grouping requests that arrive together.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.config import ModelConfig

_MODEL_PY = '''"""Triton Python-backend entry point written by `kvserve triton-repo`: the model is kvserve's."""

from kvserve.integrations.triton.model import TritonPythonModel  # noqa: F401
'''


# The model's inputs and outputs: vLLM's Triton backend's names, types and shapes (its clients carry over).
# Written into config.pbtxt, and added by the model's auto_complete_config to a config that leaves them out.
INPUTS: list[dict[str, Any]] = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    # the flags of vLLM's backend's optional outputs (below)
    *({"name": f"return_{name}", "data_type": "TYPE_BOOL", "dims": [1], "optional": True}
      for name in ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")),
]
OUTPUTS: list[dict[str, Any]] = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
]


def _tensor_pbtxt(tensor: dict[str, Any]) -> str:
    optional = ", optional: true" if tensor.get("optional") else ""
    return (f'  {{ name: "{tensor["name"]}", data_type: {tensor["data_type"]}, '
            f'dims: [ {", ".join(map(str, tensor["dims"]))} ]{optional} }}')


def config_pbtxt(name: str, max_batch_size: int, decoupled: bool, instances: int, kind: str,
                 gpus: list[int] | None, parameters: dict[str, str] | None = None) -> str:
    """The model's config.pbtxt. `instances` is Triton's instance-group count: per listed GPU with KIND_GPU,
    in all with KIND_CPU and KIND_MODEL. `parameters`: the model's string parameters (model_config's)."""
    group = f"    count: {instances}\n    kind: {kind}\n"
    if kind == "KIND_GPU" and gpus:
        group += f"    gpus: [ {', '.join(map(str, gpus))} ]\n"
    batching = ("dynamic_batching {\n  max_queue_delay_microseconds: 1000\n}\n" if max_batch_size > 0 else "")
    params = "".join(f'parameters {{\n  key: "{key}"\n  value: {{ string_value: "{value}" }}\n}}\n'
                     for key, value in (parameters or {}).items())
    return (
        f'name: "{name}"\n'
        'backend: "python"\n'
        f"max_batch_size: {max_batch_size}\n"
        f"model_transaction_policy {{\n  decoupled: {'true' if decoupled else 'false'}\n}}\n"
        f"{batching}"
        "input [\n"
        + ",\n".join(map(_tensor_pbtxt, INPUTS)) + "\n"
        "]\n"
        "output [\n"
        + ",\n".join(map(_tensor_pbtxt, OUTPUTS)) + "\n"
        "]\n"
        f"instance_group [\n  {{\n{group}  }}\n]\n"
        f"{params}"
    )


# The model parameter naming a tensor-parallel engine's GPUs (KIND_MODEL: Triton places no such instance).
GPUS_PARAMETER = "kvserve_gpus"


def instance_group(device: str, instances: int, gpus: list[int] | None, tensor_parallel_size: int,
                   gpu_memory_utilization: float, kv_cache_memory_given: bool
                   ) -> tuple[str, list[int] | None, dict[str, str]]:
    """(kind, gpus, model parameters) of the instance group, or ValueError for a placement that cannot run.

    * CPU: KIND_CPU, `instances` engines in all.
    * One GPU an engine: KIND_GPU on `gpus` (default GPU 0), `instances` engines on each of them (Triton's
      count is per listed GPU; with no list it would be per GPU of the host). Engines on one GPU share it, so
      their --gpu-memory-utilization shares must fit in it (or --kv-cache-memory size each cache).
    * Tensor parallelism: KIND_MODEL, one instance, whose engine takes `gpus` (default 0 .. N-1) through the
      `kvserve_gpus` parameter: Triton places a KIND_GPU instance on one GPU only."""
    if instances < 1:
        raise ValueError("--instances must be >= 1")
    if device == "cpu":
        if gpus:
            raise ValueError("--gpus needs --device cuda")
        return "KIND_CPU", None, {}
    if gpus is not None and (not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0):
        raise ValueError(f"--gpus must list distinct GPU ids >= 0, got {gpus}")
    if tensor_parallel_size > 1:
        if instances != 1:
            raise ValueError("with --tensor-parallel-size > 1 the repository holds one engine (--instances 1); "
                             "write one repository per engine, each with its own --gpus")
        chosen = gpus if gpus is not None else list(range(tensor_parallel_size))
        if len(chosen) != tensor_parallel_size:
            raise ValueError(f"--gpus lists {len(chosen)} GPUs for --tensor-parallel-size {tensor_parallel_size}")
        return "KIND_MODEL", None, {GPUS_PARAMETER: ",".join(map(str, chosen))}
    if instances > 1 and not kv_cache_memory_given and instances * gpu_memory_utilization > 1.0:
        raise ValueError(f"{instances} engines on each GPU share it: give each --gpu-memory-utilization at most "
                         f"{1.0 / instances:.2f} (it is {gpu_memory_utilization}), or size each KV cache with "
                         "--kv-cache-memory")
    return "KIND_GPU", gpus if gpus is not None else [0], {}


def with_resolved_paths(engine_args: dict[str, Any], model_config: ModelConfig) -> dict[str, Any]:
    """`engine_args` with the model and tokenizer as the local paths they resolved to here (`model_config`,
    from those arguments): a Hugging Face repo id becomes its cached snapshot's directory, and no revision or
    cache directory is left to resolve it again, so Triton loads what was checked here whatever Hugging Face
    cache it has, or none. The tokenizer is written when it is not the model's own directory."""
    args = dict(engine_args)
    if args.get("model") is not None:  # None: the default model, from the kvserve install where Triton runs
        args["model"] = model_config.model
    named = args.get("tokenizer") is not None or args.get("tokenizer_revision") is not None
    args["tokenizer"] = model_config.tokenizer if named and model_config.tokenizer != model_config.model else None
    for key in ("revision", "tokenizer_revision", "download_dir"):
        args[key] = None
    return args


def write_repository(out_dir: str, name: str, engine_args: dict[str, Any], max_batch_size: int = 0,
                     decoupled: bool = True, instances: int = 1, gpus: list[int] | None = None,
                     device: str = "cuda") -> str:
    """Write the repository's model directory; returns it. ValueError on a bad name, an existing model or a
    placement that cannot run (`instance_group`)."""
    from kvserve.config import CacheConfig

    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"model name {name!r} may hold letters, digits, '_', '.', '-' only")
    if max_batch_size < 0:
        raise ValueError("max_batch_size must be >= 0")
    kind, group_gpus, parameters = instance_group(
        device, instances, gpus, int(engine_args.get("tensor_parallel_size") or 1),
        float(engine_args.get("gpu_memory_utilization") or CacheConfig.gpu_memory_utilization),
        engine_args.get("kv_cache_memory") is not None or engine_args.get("kv_cache_memory_bytes") is not None)
    model_dir = os.path.join(out_dir, name)
    if os.path.exists(os.path.join(model_dir, "config.pbtxt")):
        raise ValueError(f"{model_dir} already holds a model (config.pbtxt); remove it or pick another --name")
    os.makedirs(os.path.join(model_dir, "1"), exist_ok=True)
    with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
        f.write(config_pbtxt(name, max_batch_size, decoupled, instances, kind, group_gpus, parameters))
    with open(os.path.join(model_dir, "1", "model.py"), "w") as f:
        f.write(_MODEL_PY)
    args = {k: v for k, v in engine_args.items() if v is not None}
    with open(os.path.join(model_dir, "1", "kvserve.json"), "w") as f:
        json.dump(args, f, indent=2)
        f.write("\n")
    return model_dir
