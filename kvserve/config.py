"""Engine configuration: frozen dataclasses, each validated on construction.

`EngineArgs` is the user-facing bag of optional settings (what `LLM(...)` and the CLI flags fill);
`EngineArgs.create_engine_config()` resolves defaults against the model and the machine and returns the
frozen `EngineConfig` that every component receives. Nothing else interprets user settings.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import random
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvserve import envs

logger = logging.getLogger(__name__)

GiB = 1 << 30

# dtype names accepted by --dtype, mapped to the canonical names used internally.
_DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


# --kv-cache-dtype (vLLM's values) -> the torch dtype name of the KV cache; "auto" keeps the model's dtype. "fp8"
# is vLLM's name for fp8_e4m3 (torch.float8_e4m3fn). bfloat16 and float16 are taken only where they are the
# model's dtype (the same cache as auto): the kernels read a float cache in the query's dtype.
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
KV_CACHE_MODEL_DTYPES = ("bfloat16", "float16")
# vLLM's other --kv-cache-dtype values, refused with the reason (not a bare "invalid choice").
KV_CACHE_DTYPES_REFUSED: dict[str, str] = {
    "fp8_inc": "it is the fp8 cache of Intel Gaudi (vLLM's HPU backend)",
    "fp8_ds_mla": "it is DeepSeek's fp8 layout for MLA attention, which kvserve's models do not have",
    "int8": "kvserve's attention kernels read no int8 cache",
}
# Triton converts to and from fp8 e4m3 (its fp8e4nv) only from compute capability 8.9 (Ada, Hopper) on; e5m2 is
# held to the same line, so one rule decides where an fp8 cache runs on a GPU.
FP8_KV_CACHE_MIN_CAPABILITY = (8, 9)
# --quantization fp8 (weights quantized to fp8 e4m3 at load, vLLM's online fp8): the matmul is torch._scaled_mm,
# whose fp8 tensor-core kernels need Ada (8.9) or Hopper; the per-token quantization is a Triton fp8 conversion
# (the same line as the fp8 KV cache's).
FP8_WEIGHTS_MIN_CAPABILITY = (8, 9)


# vLLM's names: "safetensors" and "gguf" load as "auto" does, once the model is checked to be of that kind.
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

# Decode batch sizes captured as CUDA graphs when EngineArgs.cuda_graph_sizes is not given (capped at
# max_num_seqs): dense where small batches are common, every 16 up to 256, then every 64. The matmuls' time is
# not monotonic in the row count (cuBLAS picks its kernel by it: on the H200, 176 rows took 5.0 ms of a step's
# matmuls and 192 rows 6.5), so finer sizes pad less and give the measured padding (worker/cuda_graph.py,
# `choose_padding`) sizes to choose from. docs/perf_notes.md, entry 24.
DEFAULT_CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240,
                            256, 320, 384, 448, 512)


class ConfigError(ValueError):
    """A setting the user gave (or its combination with the model/machine) cannot work."""


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: `model` is an HF directory or a .gguf file."""

    model: str
    tokenizer: str
    dtype: str  # "float32" | "float16" | "bfloat16" (never "auto" here)
    max_model_len: int
    seed: int = 0
    served_model_name: str = ""
    chat_template: str | None = None
    # awq / gptq / gguf (as given: what the checkpoint holds), or "fp8": quantize the weights at load
    quantization: str | None = None
    # "auto": read the weights from the checkpoint; "dummy": small random values drawn on the device
    # (benchmarks at real shapes with no weight files: only the config is read).
    load_format: str = "auto"
    # SamplingParams field -> value for what a request leaves out, from the model's generation_config.json
    # (--generation-config, --override-generation-config; kvserve.model.generation_defaults).
    sampling_defaults: dict[str, Any] = field(default_factory=dict, hash=False)
    # The most tokens a request may generate (None: only the context limits it): vLLM's override_max_tokens,
    # the override's max_new_tokens (--generation-config auto/vllm) or a --generation-config DIR's.
    max_tokens_cap: int | None = None
    # vLLM's max_model_len auto / -1: max_model_len is the model's own length until the KV cache is sized; the
    # engine then lowers it to the longest length one request can hold in the cache (`with_max_model_len`).
    max_model_len_auto: bool = False

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` tokens each (per layer, K and V)."""

    block_size: int = 16
    num_blocks: int = 0  # resolved from the memory budget at engine start; 0 = not yet known
    kv_cache_memory_bytes: int = 1 * GiB  # CPU budget (--kv-cache-memory)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # --kv-cache-memory (vLLM's --kv-cache-memory-bytes) given: on a GPU the KV cache is this size (per GPU)
    # instead of the --gpu-memory-utilization budget. None: the budget sizes it.
    gpu_kv_cache_memory_bytes: int | None = None
    # --kv-cache-dtype, one of KV_CACHE_DTYPES: "auto" or the model's own dtype's name, or an fp8 format. K and V
    # are stored as x / scale with per-layer scales: the checkpoint's KV-cache scales, else 1.0 (vLLM's default).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.kv_cache_memory_bytes <= 0:
            raise ConfigError("kv_cache_memory must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The torch dtype name the KV cache is allocated in: the model's dtype for "auto" (and for its own name), else
    the fp8 format's. ConfigError for a float dtype other than the model's."""
    name = KV_CACHE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype in KV_CACHE_MODEL_DTYPES and name != model_dtype:
        raise ConfigError(
            f"--kv-cache-dtype {kv_cache_dtype} with a {model_dtype} model is not supported: a float KV cache is held "
            f"in the model's dtype; pass --kv-cache-dtype auto (or fp8 / fp8_e5m2 for a one-byte cache)")
    return model_dtype if name is None else name


def kv_cache_dtype_name(kv_cache_dtype: str) -> str:
    """--kv-cache-dtype's value lower-cased (vLLM reads it in any case), if it is one of KV_CACHE_DTYPES;
    ConfigError otherwise, with the reason for vLLM's values kvserve does not take."""
    value = str(kv_cache_dtype).lower()
    if value in KV_CACHE_DTYPES_REFUSED:
        raise ConfigError(f"--kv-cache-dtype {value} is not supported: {KV_CACHE_DTYPES_REFUSED[value]}; choose "
                          f"{', '.join(KV_CACHE_DTYPES)} (fp8 is fp8_e4m3)")
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; choose {', '.join(KV_CACHE_DTYPES)} "
                          "(fp8 is fp8_e4m3)")
    return value


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # "fcfs": first come, first served; "priority": lower `priority` values first (vLLM's policies)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    # Decode-only batch sizes replayed from CUDA graphs (sorted, unique, each <= max_num_seqs); () = none.
    # Resolved by EngineArgs; ignored on CPU and with enforce_eager.
    cuda_graph_sizes: tuple[int, ...] = ()
    # Schedule and launch step n+1 before reading step n's tokens (see engine_core); resolved by EngineArgs.
    async_scheduling: bool = False
    # Decode batches whose requests share a long prefix attend to it once for all (Triton backend).
    cascade_attn: bool = True

    def __post_init__(self) -> None:
        sizes = self.cuda_graph_sizes
        if list(sizes) != sorted(set(sizes)) or any(s < 1 for s in sizes):
            raise ConfigError(f"cuda_graph_sizes must be sorted unique positive ints, got {sizes}")
        if sizes and sizes[-1] > self.scheduler_config.max_num_seqs:
            raise ConfigError(
                f"cuda_graph_sizes {sizes} go past max_num_seqs={self.scheduler_config.max_num_seqs}"
            )

    @property
    def use_cuda_graphs(self) -> bool:
        return bool(self.cuda_graph_sizes) and not self.enforce_eager and self.device_config.device != "cpu"

    def with_num_blocks(self, num_blocks: int) -> EngineConfig:
        """The same config with the KV pool size resolved (done once by the engine at start-up)."""
        cache = CacheConfig(**{**_asdict_shallow(self.cache_config), "num_blocks": num_blocks})
        return EngineConfig(**{**_asdict_shallow(self), "cache_config": cache})

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """The same config with max_model_len set to `max_model_len` in the model's and the scheduler's settings
        (done once by the engine at start-up, for max_model_len auto: never larger than it was)."""
        if not 1 <= max_model_len <= self.model_config.max_model_len:
            raise ValueError(f"max_model_len may only be lowered, to at least 1: {self.model_config.max_model_len} "
                             f"-> {max_model_len}")
        model = replace(self.model_config, max_model_len=max_model_len)
        scheduler = replace(self.scheduler_config, max_model_len=max_model_len)
        return replace(self, model_config=model, scheduler_config=scheduler)


def _asdict_shallow(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def parse_memory_size(value: str | int | float) -> int:
    """--kv-cache-memory's sizes: '4GiB', '512MiB', '2G', '1.5GB' or a plain number of bytes -> bytes. Suffixes
    are read without case: k, m, g, t, KiB, MiB, GiB, TiB are powers of 1024, KB, MB, GB, TB powers of 1000.
    ConfigError for anything else, and for a size that is not finite or is negative ('inf', '-1GiB')."""
    if isinstance(value, (int, float)):
        return _whole_bytes(float(value), value)
    text = value.strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 1000, "mb": 1000**2,
             "gb": 1000**3, "tb": 1000**4, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "b": 1}
    number, unit = text, 1
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            number, unit = text[: -len(suffix)], units[suffix]
            break
    try:
        amount = float(number)
    except ValueError:
        raise ConfigError(f"cannot parse memory size {value!r} (examples: 4GiB, 512MiB, 1000000)") from None
    return _whole_bytes(amount * unit, value)


def _whole_bytes(num_bytes: float, value: object) -> int:
    """`num_bytes` as an int; ConfigError (not int()'s OverflowError or ValueError) when it is not finite or is
    negative."""
    if not math.isfinite(num_bytes) or num_bytes < 0:
        raise ConfigError(f"memory size {value!r} is not a finite number of bytes of at least 0")
    return int(num_bytes)


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's integers (--max-model-len 32k): a whole number, or a number with a suffix whose case matters:
    k, m, g, t are powers of 1000 and may follow a decimal (25.6k = 25600); K, M, G, T are powers of 1024 and
    follow a whole number (1K = 1024). ConfigError otherwise (the CLI turns it into argparse's error)."""
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise ConfigError(
                f"expected a whole number, optionally with a suffix (k, m, g: x1000; K, M, G: x1024), e.g. 8192, "
                f"32k or 32K, got {text!r}") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise ConfigError(
            f"a binary suffix ({suffix}, x{_BINARY_SUFFIXES[suffix]}) takes a whole number, got {text!r}; did you "
            f"mean {number}{suffix.lower()} (x{_DECIMAL_SUFFIXES[suffix.lower()]})?")
    return int(number) * _BINARY_SUFFIXES[suffix]


AUTO_MAX_MODEL_LEN = "auto"


def is_auto_max_model_len(value: object) -> bool:
    """Whether a max_model_len asks for vLLM's automatic length: "auto" or -1 (in any case, with surrounding
    spaces; -1 as an int or a string). Not for bools (True == 1 in Python, never a length anyone meant)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value == -1
    return isinstance(value, str) and value.strip().lower() in (AUTO_MAX_MODEL_LEN, "-1")


def max_model_len_value(text: str) -> int | str:
    """--max-model-len: "auto" for vLLM's auto / -1 (the model's own length, lowered after the KV cache is sized
    to the longest that one request can hold there; `is_auto_max_model_len`), else a length as
    `human_readable_int` reads it, at least 1."""
    if is_auto_max_model_len(text):
        return AUTO_MAX_MODEL_LEN
    value = human_readable_int(text)
    if value < 1:
        raise ConfigError(f"expected a length of at least 1 token, or auto / -1 (the longest length the KV cache "
                          f"holds, at most the model's own), got {text!r}")
    return value


def parse_kv_cache_memory_bytes(value: str | int | float) -> int:
    """vLLM's --kv-cache-memory-bytes (and LLM's kv_cache_memory_bytes): bytes as vLLM reads them, with
    `human_readable_int` (8g = 8*10^9 bytes, 8G = 8 GiB, 8000000000); a size ending in a unit name (8GiB,
    512MiB, 8GB, 100B) is read as --kv-cache-memory reads it. The two kinds cannot be confused: vLLM's have no
    B."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    if value.strip()[-1:] in ("b", "B"):
        return parse_memory_size(value)
    try:
        return human_readable_int(value)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or a size with a unit name, e.g. 8GiB or 512MiB") from None


def memory_size_text(num_bytes: int) -> str:
    """A size for a flag such as --kv-cache-memory, rounded up so that it holds `num_bytes`: '3MiB', '1.26GiB'."""
    if num_bytes < 1 << 30:
        return f"{-(-num_bytes // (1 << 20))}MiB"
    return f"{-(-num_bytes * 100 // (1 << 30)) / 100:.2f}GiB"


@dataclass
class EngineArgs:
    """User-facing engine settings, named as vLLM names them. All optional but `model`."""

    model: str | None = None
    tokenizer: str | None = None
    # A repo id's snapshot in the local Hugging Face cache (vLLM's names; kvserve never downloads): the branch,
    # tag or commit (default main), the tokenizer's (default: `revision`, as vLLM), and the cache directory
    # (default HF_HUB_CACHE / HF_HOME/hub / ~/.cache/huggingface/hub). A local path ignores the revisions.
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"
    max_model_len: int | str | None = None  # a number, or as vLLM takes it: "32k" (x1000), "32K" (x1024)
    seed: int | None = 0  # None (vLLM's LLM(seed=None)): a random one, so unseeded samples differ run to run
    served_model_name: str | None = None
    chat_template: str | None = None
    quantization: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # override the memory-derived pool size (tests, tuning)
    kv_cache_memory: str | int | None = None  # '4GiB', '512MiB', bytes (parse_memory_size)
    # vLLM's name, read as vLLM reads it: 8g = 8*10^9 bytes, 8G = 8 GiB (parse_kv_cache_memory_bytes); one of the two
    kv_cache_memory_bytes: str | int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | str | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    device: str | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    # "auto": the model's generation_config.json sets the defaults of what a request leaves out; "vllm":
    # none; or a directory holding a generation_config.json. Overrides: a JSON object (or dict) on top.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | str | None = None
    cuda_graph_sizes: list[int] | None = None  # None: DEFAULT_CUDA_GRAPH_SIZES up to max_num_seqs
    async_scheduling: bool | None = None  # None: on for GPUs, off on CPU (where nothing overlaps)
    cascade_attn: bool = True  # measured on the H200: docs/perf_notes.md, entry 12
    # vLLM's --kv-cache-dtype: auto, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2; bfloat16 / float16 if the model's dtype
    kv_cache_dtype: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    def create_engine_config(self) -> EngineConfig:
        """Resolve every default against the model's own limits and the machine."""
        from kvserve.model.arch import load_arch_config
        from kvserve.model.paths import check_chat_template, resolve_model_path, resolve_tokenizer_path

        envs.check_values()  # a KVSERVE_* variable that could not be read (as its default, it would go unnoticed)
        if int(self.tensor_parallel_size) < 1:
            raise ConfigError(f"tensor_parallel_size (--tensor-parallel-size) must be >= 1, got "
                              f"{self.tensor_parallel_size}")

        if self.load_format == "dummy":
            model_path = _resolve_config_only_path(self.model, self.revision, self.download_dir)
        else:
            model_path = resolve_model_path(self.model, self.revision, self.download_dir)
            _check_load_format(self.load_format, model_path)
        tokenizer_revision = self.tokenizer_revision if self.tokenizer_revision is not None else self.revision
        # The tokenizer is the model's unless named; a --tokenizer-revision alone still picks the model's repo's
        # tokenizer at that revision (as vLLM).
        tokenizer = self.tokenizer
        if tokenizer is None and self.tokenizer_revision is not None and self.model is not None:
            tokenizer = self.model
        if tokenizer is None:
            tokenizer_path = model_path
        else:
            tokenizer_path = resolve_tokenizer_path(tokenizer, tokenizer_revision, self.download_dir)
        if self.chat_template is not None:
            check_chat_template(self.chat_template)  # refused now: the tokenizer reads it once the engine runs
        arch = load_arch_config(model_path)
        quantization = _check_quantization(self.quantization, model_path, arch)
        device = self.device or _default_device()
        _check_device(device)
        dtype = _resolve_dtype(self.dtype, device, arch.config_dtype)
        if quantization == "fp8":
            _check_fp8_weights_device(device)
        elif arch.quantization is not None and arch.quantization.method == "fp8":
            _check_fp8_weights_device(device, checkpoint=True)
        kv_cache_dtype = _check_kv_cache_dtype(self.kv_cache_dtype, device, dtype)

        model_limit = arch.max_positions
        # auto / -1: the model's own length, as when the flag is left out, until the engine has sized the KV cache
        # (EngineCore lowers it then to what one request can hold there, if that is less).
        auto_max_model_len = is_auto_max_model_len(self.max_model_len)
        if self.max_model_len is None or auto_max_model_len:
            max_model_len = model_limit
            if arch.sliding_window is not None and arch.sliding_window < model_limit:
                # The longest length served (see the refusal below): the default and auto both ask for the longest
                # there is.
                logger.warning("max_model_len %s: %s's sliding_window, %d tokens of its %d (kvserve has no "
                               "sliding-window attention and serves the model up to its window)",
                               "auto" if auto_max_model_len else "by default", arch.architecture, arch.sliding_window,
                               model_limit)
                max_model_len = arch.sliding_window
        else:
            max_model_len = _token_count("max_model_len", self.max_model_len)
            if max_model_len > model_limit and envs.KVSERVE_ALLOW_LONG_MAX_MODEL_LEN:
                logger.warning("max_model_len=%d is larger than the model supports (%d, %s in the model config): "
                               "allowed by VLLM_ALLOW_LONG_MAX_MODEL_LEN / KVSERVE_ALLOW_LONG_MAX_MODEL_LEN; outputs "
                               "past %d tokens may be wrong", max_model_len, model_limit, _model_limit_source(arch),
                               model_limit)
            elif max_model_len > model_limit:
                raise ConfigError(
                    f"max_model_len={max_model_len} is larger than the model supports "
                    f"({model_limit}, {_model_limit_source(arch)} in the model config); "
                    f"pass --max-model-len {model_limit} or less (or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow "
                    f"it, at the risk of wrong outputs past {model_limit} tokens)"
                )
        if arch.sliding_window is not None and max_model_len > arch.sliding_window:
            raise ConfigError(
                f"{arch.architecture}: its config.json sets sliding_window {arch.sliding_window}, and kvserve has no "
                f"sliding-window attention: it serves the model only up to that length (where attention within the "
                f"window is full attention); pass --max-model-len {arch.sliding_window} or less (max_model_len is "
                f"{max_model_len})")
        if self.max_num_batched_tokens is not None:
            max_batched = _token_count("max_num_batched_tokens", self.max_num_batched_tokens)
        else:
            max_batched = 8192 if self.enable_chunked_prefill else max(8192, max_model_len)

        if self.num_kv_blocks is not None and int(self.num_kv_blocks) < 1:
            raise ConfigError(f"num_kv_blocks (--num-gpu-blocks-override) must be >= 1, got {self.num_kv_blocks}")
        from kvserve.model.generation_defaults import GenerationConfigError, max_tokens_cap, sampling_defaults

        try:
            defaults = sampling_defaults(model_path, self.generation_config, self.override_generation_config)
            cap = max_tokens_cap(self.generation_config, self.override_generation_config, defaults)
        except GenerationConfigError as exc:
            raise ConfigError(str(exc)) from None

        requested_kv_bytes = self._requested_kv_cache_bytes()
        if requested_kv_bytes is not None:
            kv_bytes = requested_kv_bytes
        else:
            kv_bytes = envs.KVSERVE_CPU_KVCACHE_SPACE_GIB * GiB

        model_config = ModelConfig(
            model=model_path,
            tokenizer=tokenizer_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed if self.seed is not None else random.SystemRandom().randrange(2**63),
            served_model_name=self.served_model_name or _default_served_name(self.model, model_path),
            chat_template=self.chat_template,
            quantization=quantization,
            load_format=self.load_format,
            sampling_defaults=defaults,
            max_tokens_cap=cap,
            max_model_len_auto=auto_max_model_len,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            num_blocks=int(self.num_kv_blocks or 0),
            kv_cache_memory_bytes=kv_bytes,
            gpu_kv_cache_memory_bytes=requested_kv_bytes if device != "cpu" else None,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduling_policy=self.scheduling_policy,
        )
        _check_tensor_parallel(arch, int(self.tensor_parallel_size), device)
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            device_config=DeviceConfig(device=device),
            enforce_eager=self.enforce_eager,
            tensor_parallel_size=self.tensor_parallel_size,
            cuda_graph_sizes=resolve_cuda_graph_sizes(self.cuda_graph_sizes, self.max_num_seqs),
            async_scheduling=device != "cpu" if self.async_scheduling is None else bool(self.async_scheduling),
            cascade_attn=bool(self.cascade_attn),
        )

    def _requested_kv_cache_bytes(self) -> int | None:
        """The KV cache size asked for with kv_cache_memory or vLLM's kv_cache_memory_bytes (each read its own
        way), None when neither is given."""
        if self.kv_cache_memory is not None and self.kv_cache_memory_bytes is not None:
            raise ConfigError(
                f"the KV cache size is given twice: kv_cache_memory={self.kv_cache_memory!r} (--kv-cache-memory) "
                f"and kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} (--kv-cache-memory-bytes); pass one")
        if self.kv_cache_memory is not None:
            return parse_memory_size(self.kv_cache_memory)
        if self.kv_cache_memory_bytes is not None:
            try:
                return parse_kv_cache_memory_bytes(self.kv_cache_memory_bytes)
            except ConfigError as exc:
                raise ConfigError(f"kv_cache_memory_bytes: {exc}") from None
        return None


def _check_tensor_parallel(arch: Any, size: int, device: str) -> None:
    """ConfigError unless `size` ranks can run the model on this machine."""
    from kvserve.distributed import check_quantized_split, check_tensor_parallel

    try:
        check_tensor_parallel(arch, size)
    except ValueError as exc:
        raise ConfigError(f"{exc}; pass a --tensor-parallel-size that divides them") from None
    try:
        check_quantized_split(arch, size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if size == 1:
        return
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"with --tensor-parallel-size {size} the device must be 'cuda' or 'cpu' (rank r takes "
                          f"the r-th visible GPU), got {device!r}")
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if count < size:
            raise ConfigError(f"--tensor-parallel-size {size} needs {size} GPUs, and {count} are visible")


def resolve_cuda_graph_sizes(
    requested: list[int] | tuple[int, ...] | None, max_num_seqs: int
) -> tuple[int, ...]:
    """The decode batch sizes to capture: `requested` (or the defaults) up to `max_num_seqs`, sorted and
    unique, with `max_num_seqs` itself added when the defaults stop short of it (so every decode batch
    has a graph to pad to). An explicit empty list disables graphs."""
    if requested is not None:
        sizes = sorted({int(s) for s in requested})
        if any(s < 1 for s in sizes):
            raise ConfigError(f"cuda graph sizes must be positive, got {requested}")
        return tuple(s for s in sizes if s <= max_num_seqs)
    sizes = [s for s in DEFAULT_CUDA_GRAPH_SIZES if s <= max_num_seqs]
    if not sizes or sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return tuple(sizes)


def _check_load_format(load_format: str, model_path: str) -> None:
    """--load-format safetensors needs an HF directory, gguf a .gguf file (both then load as auto)."""
    is_gguf = os.path.isfile(model_path) and model_path.lower().endswith(".gguf")
    if load_format == "safetensors" and is_gguf:
        raise ConfigError(f"--load-format safetensors needs an HF model directory, but {model_path} is a GGUF file; "
                          "pass --load-format gguf or auto")
    if load_format == "gguf" and not is_gguf:
        raise ConfigError(f"--load-format gguf needs a .gguf file, but {model_path} is not one; pass "
                          "--load-format safetensors or auto")


def _resolve_config_only_path(model: str | None, revision: str | None, download_dir: str | None) -> str:
    """--load-format dummy: an HF directory (or a cached repo's snapshot) needs only config.json (no weights),
    a .gguf its metadata."""
    from kvserve.model.paths import ModelLoadError, locate, resolve_model_path

    if model is None:
        return resolve_model_path(model)
    path = locate(model, revision, download_dir, what="model")
    if not os.path.isdir(path):
        return resolve_model_path(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model directory {path} has no config.json")
    return path


def _default_served_name(requested: str | None, resolved: str) -> str:
    if requested:
        return requested
    return os.path.basename(resolved.rstrip("/"))


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_device(device: str) -> None:
    DeviceConfig(device=device)  # the spelling
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but this machine has no usable CUDA GPU "
                              "(or torch was built without CUDA); pass --device cpu")


def _check_kv_cache_dtype(kv_cache_dtype: str, device: str, model_dtype: str) -> str:
    """--kv-cache-dtype's value, lower-cased, if this model on this device can hold the cache in it; ConfigError
    otherwise. bfloat16 / float16 must be the model's dtype. fp8 needs a GPU of compute capability 8.9 or later
    (the Triton kernels' fp8 conversions); on CPU torch's casts store it and the reference attention reads it
    back in float32."""
    value = kv_cache_dtype_name(kv_cache_dtype)
    kv_cache_torch_dtype(value, model_dtype)  # a float dtype other than the model's: refused here, not at start
    if value == "auto" or value in KV_CACHE_MODEL_DTYPES or device == "cpu":
        return value
    _require_capability(device, FP8_KV_CACHE_MIN_CAPABILITY, f"--kv-cache-dtype {value}",
                        "fp8 conversions in the Triton kernels", "pass --kv-cache-dtype auto")
    return value


def _require_capability(device: str, minimum: tuple[int, int], flag: str, reason: str, remedy: str) -> None:
    """ConfigError naming `flag`, `reason` and `remedy` when CUDA `device` is below compute capability `minimum`."""
    import torch

    capability = tuple(torch.cuda.get_device_capability(torch.device(device)))
    if capability < minimum:
        raise ConfigError(f"{flag} needs a GPU of compute capability {minimum[0]}.{minimum[1]} or later ({reason}); "
                          f"this GPU is {capability[0]}.{capability[1]}: {remedy}")


def _check_quantization(asked: str | None, model_path: str, arch: Any) -> str | None:
    """`--quantization`: awq / gptq (or vLLM's awq_marlin / gptq_marlin) / gguf must name what the checkpoint
    holds (it is read from the checkpoint either way); fp8 asks for an unquantized checkpoint's weights to be
    quantized at load, or names an fp8 checkpoint's own. Returns the value ModelConfig keeps (as given; "fp8"
    lower-cased, None for an fp8 checkpoint: nothing is quantized at load). ConfigError otherwise."""
    from kvserve.layers.quantization import normalize_method

    if asked is None:
        return None
    held = "gguf" if model_path.endswith(".gguf") else (arch.quantization.method if arch.quantization else None)
    if asked.lower() == "fp8" and held is None and arch.is_moe:
        raise ConfigError(f"--quantization fp8 is not supported for mixture-of-experts models yet ({arch.architecture}: "
                          "its experts have no fp8 path); drop the flag to serve the model in its own dtype")
    if asked.lower() == "fp8":
        if held == "fp8":
            return None  # an fp8 checkpoint: its own weights and scales, nothing quantized at load
        if held is not None:
            raise ConfigError(f"--quantization fp8 quantizes an unquantized (bfloat16 / float16 / float32) checkpoint's "
                              f"weights at load, but {model_path} is already quantized as {held}; drop the flag")
        return "fp8"
    method = "gguf" if asked.lower() == "gguf" else normalize_method(asked)
    if method is None:
        raise ConfigError(f"quantization {asked!r} is not supported; supported: awq, gptq, gguf, compressed-tensors, "
                          "fbgemm_fp8 (read from the "
                          "checkpoint: the flag can be left out), and fp8 (an fp8 checkpoint's own weights, or an "
                          "unquantized checkpoint's weights quantized at load)")
    if method != held:
        found = f"holds {held} weights" if held else "has no quantized weights"
        hint = f" or pass --quantization {held}" if held else " (or pass --quantization fp8 to quantize it at load)"
        raise ConfigError(f"--quantization {asked} asked for, but {model_path} {found}; drop the flag{hint}")
    return asked


def _check_fp8_weights_device(device: str, checkpoint: bool = False) -> None:
    """--quantization fp8 (or an fp8 checkpoint: `checkpoint`) on a GPU needs compute capability 8.9 or later (fp8
    tensor cores for torch._scaled_mm, Triton's fp8 conversions); ConfigError below it. On CPU the torch reference
    runs (slowly: for tests)."""
    if device == "cpu":
        return
    if checkpoint:
        _require_capability(device, FP8_WEIGHTS_MIN_CAPABILITY, "an fp8 checkpoint", "fp8 matmuls: Ada, Hopper",
                            "use the unquantized checkpoint, or an AWQ / GPTQ one")
        return
    _require_capability(device, FP8_WEIGHTS_MIN_CAPABILITY, "--quantization fp8", "fp8 matmuls: Ada, Hopper",
                        "drop the flag, or use an AWQ / GPTQ checkpoint")


def _resolve_dtype(dtype: str, device: str, config_dtype: str | None = None) -> str:
    """--dtype's name (or a torch.dtype's, as vLLM's LLM takes it); 'auto' as `auto_dtype` picks it for the
    checkpoint's config dtype and this device."""
    # A torch.dtype (vLLM's LLM(dtype=torch.bfloat16)) reads as its name: str() gives "torch.bfloat16".
    name = _DTYPE_ALIASES.get(str(dtype).lower().removeprefix("torch."))
    if name is None:
        raise ConfigError(f"unknown dtype {dtype!r}; choose auto, float32, float16 or bfloat16")
    if name != "auto":
        return name
    if device == "cpu":
        return auto_dtype(config_dtype, device, None)
    import torch

    # Compute capability 8.0+ (Ampere and newer) has bf16. Reading the capability does not create a
    # CUDA context (is_bf16_supported may allocate a test tensor), which matters in the API process.
    return auto_dtype(config_dtype, device, tuple(torch.cuda.get_device_capability()))


def auto_dtype(config_dtype: str | None, device: str, capability: tuple[int, ...] | None) -> str:
    """--dtype auto, as vLLM resolves it on a GPU: the checkpoint's own dtype (config.json's `dtype` or
    `torch_dtype`) when the GPU has it, so float16 checkpoints (most AWQ/GPTQ exports) run in float16 and
    bfloat16 ones in bfloat16; a float32 checkpoint (or one that names none: a GGUF file) in bfloat16 on a
    GPU of compute capability 8.0+ (Ampere and newer), else float16; a bfloat16 checkpoint falls back to
    float16 on an older GPU. On CPU kvserve always runs float32 (where vLLM would follow the checkpoint):
    the CPU path is the exact reference the GPU's outputs are compared with."""
    if device == "cpu":
        return "float32"
    has_bf16 = capability is not None and capability[0] >= 8
    if config_dtype == "float16":
        return "float16"
    if config_dtype == "bfloat16" and has_bf16:
        return "bfloat16"
    return "bfloat16" if has_bf16 else "float16"


def _token_count(name: str, value: int | str) -> int:
    """A token count given as a number or, as vLLM takes them, a string such as '32k' (x1000) or '32K' (x1024)."""
    if isinstance(value, str):
        try:
            return human_readable_int(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    # (a bool is an int to Python: True would be a count of 1; 2.5 would be cut to 2 unsaid)
    wrong = ConfigError(f"{name} must be a whole number of tokens, got {value!r}")
    if isinstance(value, bool):
        raise wrong
    if isinstance(value, float):
        if not value.is_integer():
            raise wrong
        return int(value)
    try:
        return operator.index(value)  # int, numpy's integers
    except TypeError:
        raise wrong from None


def _model_limit_source(arch: Any) -> str:
    """Which config values set `arch.max_positions` (for error messages)."""
    rope_type = None if arch.rope_scaling is None else arch.rope_scaling["rope_type"]
    if rope_type == "yarn":
        return "YaRN's original_max_position_embeddings x factor"
    if rope_type == "linear":
        return "max_position_embeddings x the linear RoPE scaling factor"
    return "max_position_embeddings"
