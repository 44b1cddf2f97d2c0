"""Every KVSERVE_* environment variable, typed. Nothing else in kvserve reads os.environ for settings."""

from __future__ import annotations

import logging
import os

# Variables set to a value of the wrong kind, each with the error to report ("environment variable X must
# be ..."): read at import, where raising would end every kvserve command (--help included) with an import
# traceback; `check_values` raises the first when an engine is configured.
_INVALID: list[str] = []


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        _INVALID.append(f"environment variable {name} must be an integer, got {raw!r}")
        return default


def _log_level(name: str, default: str) -> str:
    raw = _str(name, None)
    if raw is None:
        return default
    if not isinstance(logging.getLevelName(raw.upper()), int):
        _INVALID.append(f"environment variable {name} must be a log level (DEBUG, INFO, WARNING, ERROR, CRITICAL), "
                        f"got {raw!r}")
        return default
    return raw


def _switch(name: str) -> bool:
    """A variable read as vLLM reads its switches: 1 or true (any case) on; unset, empty, 0 or false off."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("1", "true"):
        return True
    if raw not in ("", "0", "false"):
        _INVALID.append(f"environment variable {name} must be 1, true, 0 or false, got {os.environ[name]!r}")
    return False


def check_values() -> None:
    """ValueError naming the first kvserve variable set to a value of the wrong kind (the others then read as
    their defaults, which must not start an engine silently)."""
    if _INVALID:
        raise ValueError(_INVALID[0])


def _str(name: str, default: str | None) -> str | None:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else raw


# KV cache budget on CPU in GiB when --kv-cache-memory is not given.
KVSERVE_CPU_KVCACHE_SPACE_GIB: int = _int("KVSERVE_CPU_KVCACHE_SPACE", 1)
# API key for the OpenAI-compatible server when --api-key is not given. Read as set, even empty (None only
# when unset): set, it decides, and set empty it means no key (VLLM_API_KEY is then not read).
KVSERVE_API_KEY: str | None = os.environ.get("KVSERVE_API_KEY")
# vLLM's name for it, read only when --api-key is not given and KVSERVE_API_KEY is unset (a vLLM
# deployment's environment keeps its authentication).
VLLM_API_KEY: str | None = _str("VLLM_API_KEY", None)
# The OpenAI client's key variable: `kvserve bench` sends it when --api-key is not given, as the OpenAI client
# and vLLM's benchmark do (None when unset or empty). The server does not read it.
OPENAI_API_KEY: str | None = _str("OPENAI_API_KEY", None)
# Set (1) by `kvserve serve --data-parallel-size N` in the environment of each replica it starts: a replica
# refuses to start replicas of its own, whatever its command line says (not a setting for users).
KVSERVE_DP_REPLICA: bool = _int("KVSERVE_DP_REPLICA", 0) != 0
# Set by `kvserve serve --data-parallel-size N` in the environment of each replica it starts, a random tag of
# the replica's own (8 hex digits; not a setting for users): the directories the replica makes in the
# temporary directory carry it in their names (`kvserve-ipc-<tag>-...`, `kvserve-metrics-<tag>-...`), so that
# the parent can remove them, and only them, after it killed the replica's process group. This attribute is read
# when a directory is made (kvserve.engine.core_client.replica_tag), which ignores a tag that is not 1 to 32
# ASCII letters and digits.
KVSERVE_DP_REPLICA_TAG: str | None = _str("KVSERVE_DP_REPLICA_TAG", None)
# The Responses API's store (1: on): responses created with `store` are kept in the API process's memory for
# GET / DELETE /v1/responses/{id} and previous_response_id. Off by default, as in vLLM, whose variable
# VLLM_ENABLE_RESPONSES_API_STORE is read when this one is unset. Not with --api-server-count > 1 (each API
# process would keep its own).
KVSERVE_ENABLE_RESPONSES_API_STORE: bool = _int(
    "KVSERVE_ENABLE_RESPONSES_API_STORE", _int("VLLM_ENABLE_RESPONSES_API_STORE", 0)) != 0
# How many responses the store keeps (the oldest go first); vLLM's store keeps every response until restart.
KVSERVE_RESPONSES_API_STORE_SIZE: int = _int("KVSERVE_RESPONSES_API_STORE_SIZE", 10000)
# Log level of the kvserve logger.
KVSERVE_LOGGING_LEVEL: str = _log_level("KVSERVE_LOGGING_LEVEL", "INFO")
# One-prompt prefills at least this long use cuDNN's attention kernel (0: never). Unset (-1): 1024 on sm_90
# and later, 0 elsewhere. cuDNN builds an execution graph per sequence length, so such prompts are padded to
# a 256-token bucket whose graphs are all built at start; see docs/perf_notes.md, entry 18.
KVSERVE_SDPA_CUDNN_MIN_TOKENS: int = _int("KVSERVE_SDPA_CUDNN_MIN_TOKENS", -1)
# Most new tokens served by a one-request prefill CUDA graph (fresh prompts; after a cached prefix, at most
# 256; sizes in steps of 128; 0: no prefill graphs). See kvserve/worker/cuda_graph.py and
# docs/perf_notes.md, entry 21.
KVSERVE_PREFILL_GRAPH_MAX_TOKENS: int = _int("KVSERVE_PREFILL_GRAPH_MAX_TOKENS", 2048)
# Most tokens of a step served by piecewise CUDA graphs (one graph per stretch between two layers' attention,
# attention eager between them): steps that no whole-forward graph serves, such as several requests with
# prefill tokens (0: none; such steps launch eagerly). See kvserve/worker/piecewise.py.
KVSERVE_PIECEWISE_GRAPH_MAX_TOKENS: int = _int("KVSERVE_PIECEWISE_GRAPH_MAX_TOKENS", 2048)
# A decode batch replays the captured graph of the smallest size that holds it, unless a larger size's graph
# ran at least this many percent faster when timed at start (0 or less: always the smallest). See
# kvserve/worker/cuda_graph.py and docs/perf_notes.md, entry 24.
KVSERVE_GRAPH_PAD_MIN_GAIN_PCT: int = _int("KVSERVE_GRAPH_PAD_MIN_GAIN_PCT", 5)
# Programmatic dependent launch for the Triton kernels on sm_90+ (1: on, the default; 0: off). See
# kvserve/kernels/triton_pdl.py and docs/perf_notes.md, entry 17.
KVSERVE_PDL: bool = _int("KVSERVE_PDL", 1) != 0
# fp8 weights (`--quantization fp8`) at up to 16 rows with bf16 activations: the skinny matmul's dot in
# fp16, activations scaled by powers of two (1), or the weight converted to bf16 (0; the same exact products,
# float32 sums rounded in another order; slower on an H100: docs/perf_notes.md entry 71).
KVSERVE_FP8_FP16_DOT: bool = _int("KVSERVE_FP8_FP16_DOT", 1) != 0
# Launch the skinny matmul of an fp8 weight converted to bf16 (past the fp16 dot's rows, or with it off) with
# programmatic dependent launch where PDL is on (1), or without it (0, the default: faster on an H100,
# docs/perf_notes.md entry 72).
KVSERVE_FP8_CONVERT_PDL: bool = _int("KVSERVE_FP8_CONVERT_PDL", 0) != 0
# Compile the Triton kernel variants that start-up needs on a thread pool before the warm-up runs them (1: on,
# the default; 0: off, the warm-up compiles them one at a time). See kvserve/kernels/triton_precompile.py and
# docs/perf_notes.md, entry 29.
KVSERVE_TRITON_PRECOMPILE: bool = _int("KVSERVE_TRITON_PRECOMPILE", 1) != 0
# Threads for that compile (0: the cores this process may use, at most 8).
KVSERVE_TRITON_PRECOMPILE_WORKERS: int = _int("KVSERVE_TRITON_PRECOMPILE_WORKERS", 0)
# Time cuBLASLt's candidate algorithms for the model's matmuls at start (at the decode graph sizes past the
# Triton skinny matmul, instead of KVSERVE_DECODE_GEMM_CHOICES' stored ones) and run the fastest where it beats
# torch's own pick by 1 % (1: on; 0: off, the default). The choices are kept in KVSERVE_CACHE_DIR, so only
# the first start with a GPU and library versions pays the timing (about 3 s for a 7B model on the H200). Off
# by default: on the H200 it made decode 0-2 % faster, the start that timed the choices did not gain at 48-64
# rows, and the timing adds to the first start. See kvserve/kernels/cublaslt.py and docs/perf_notes.md,
# entry 28.
KVSERVE_GEMM_TUNING: bool = _int("KVSERVE_GEMM_TUNING", 0) != 0
# cuBLASLt algorithms for the model's matmuls at the step budget's token count (max_num_batched_tokens, when
# past the prefill CUDA graphs), chosen by timing on a GPU kept busy, as a long prefill runs at the clock the
# power cap allows. 0: off (torch's picks). 1 (the default): the choices stored in KVSERVE_CACHE_DIR or shipped
# with kvserve (kvserve/kernels/gemm_sustained_choices.json: "NVIDIA H200", cuBLASLt 130100, torch
# 2.11.0+cu130, the Qwen2.5-7B shapes at 8,192 rows and at the decode graph sizes; an exact match only), no
# timing; torch's picks elsewhere. 2: also time the candidates at start where neither holds a choice (12 s of
# the first start for a 7B model on the H200), stored for later starts. See docs/perf_notes.md, entry 56.
KVSERVE_PREFILL_GEMM_TUNING: int = _int("KVSERVE_PREFILL_GEMM_TUNING", 1)
# cuBLASLt algorithms for the model's matmuls at the decode graph sizes past the Triton skinny matmul, chosen
# by timing each candidate on a GPU kept busy (benchmarks/cublaslt_algos.py --sustained-s: a throughput
# workload's decode steps run at the clock the power cap allows). 1 (the default): the choices stored in
# KVSERVE_CACHE_DIR or shipped with kvserve (the file and exact-match rule above: the Qwen2.5-7B shapes at
# 48-256 rows on the H200), never timed at start; torch's picks elsewhere. 0: off. KVSERVE_GEMM_TUNING=1 times
# these sizes briefly instead. See docs/perf_notes.md, entry 57.
KVSERVE_DECODE_GEMM_CHOICES: bool = _int("KVSERVE_DECODE_GEMM_CHOICES", 1) != 0
# Where results that outlive a run are kept (the matmul tuning's choices, GGUF files' converted tokenizers):
# $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve.
KVSERVE_CACHE_DIR: str = _str("KVSERVE_CACHE_DIR", None) or os.path.join(
    _str("XDG_CACHE_HOME", None) or os.path.join(os.path.expanduser("~"), ".cache"), "kvserve")


# Let --max-model-len exceed the model's context (max_position_embeddings, or what its RoPE scaling gives):
# the RoPE table is built to --max-model-len, and outputs past the length the model was trained for may be
# wrong. vLLM's name is read too.
KVSERVE_ALLOW_LONG_MAX_MODEL_LEN: bool = _switch("KVSERVE_ALLOW_LONG_MAX_MODEL_LEN") or _switch(
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN")


# vLLM's variables with a kvserve equivalent (VLLM_API_KEY is read itself, above).
VLLM_ENV_EQUIVALENTS: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "KVSERVE_CPU_KVCACHE_SPACE",
    "VLLM_LOGGING_LEVEL": "KVSERVE_LOGGING_LEVEL",
    "VLLM_CACHE_ROOT": "KVSERVE_CACHE_DIR",
}


_VLLM_READ = ("VLLM_API_KEY", "VLLM_ENABLE_RESPONSES_API_STORE", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")  # read above


def unread_vllm_env_vars() -> list[str]:
    """The VLLM_* variables set that kvserve does not read, sorted, each with kvserve's equivalent where
    there is one ("VLLM_LOGGING_LEVEL (use KVSERVE_LOGGING_LEVEL)")."""
    names = sorted(name for name in os.environ if name.startswith("VLLM_") and name not in _VLLM_READ)
    return [f"{name} (use {VLLM_ENV_EQUIVALENTS[name]})" if name in VLLM_ENV_EQUIVALENTS else name
            for name in names]


def triton_interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter now, read as Triton reads it (1, true, on, ...).
    For a module imported after a test sets it, unlike TRITON_INTERPRET below (read when this file is)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


# Other libraries' variables that change what kvserve does (read here too, so this file lists them all):
# Triton's interpreter (kernels run on the CPU): no programmatic dependent launch.
TRITON_INTERPRET: bool = triton_interpreting()
# Set by the user: torch's choice between cuBLAS and cuBLASLt stands (kvserve otherwise prefers cuBLASLt on CUDA).
TORCH_BLAS_PREFER_CUBLASLT_SET: bool = "TORCH_BLAS_PREFER_CUBLASLT" in os.environ
# Freeze each serving process's start-up heap out of the garbage collector's reach once it is ready to
# serve, and the bench client's while a run measures (1: on, the default; 0: off). See
# kvserve/engine/heap.py and docs/perf_notes.md, entries 45 and 46.
KVSERVE_GC_FREEZE: bool = _int("KVSERVE_GC_FREEZE", 1) != 0
