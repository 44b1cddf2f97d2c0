"""cuBLASLt called directly (ctypes), so that a matmul can run an algorithm chosen by timing instead of the
library's first heuristic pick.

torch's `linear` on CUDA asks cuBLASLt's heuristic for one algorithm and runs it. That first pick is not
always the fastest candidate: at some decode batch sizes (docs/perf_notes.md, entry 28), and more often over
a long, busy run at the clock the power cap allows (entries 56, 57). Used where start-up registers a choice:
stored or shipped ones by default (`KVSERVE_PREFILL_GEMM_TUNING`, `KVSERVE_DECODE_GEMM_CHOICES`), timed ones
with `KVSERVE_GEMM_TUNING=1` or `KVSERVE_PREFILL_GEMM_TUNING=2`. This module holds a `LtMatmul` per (rows,
N, K, dtype, bias): its matrix layouts, the heuristic's candidates, and the one to run. `LtMatmul.run(x,
weight, bias, out)` computes `torch.nn.functional.linear(x, weight, bias)` into `out` on the current stream
(CUDA-graph capturable: no host sync, a fixed workspace).

The library is the one torch already loaded (found in the process's mapped files), so there is no second
copy and no build step. Anything unavailable (no CUDA, no cuBLASLt found, a call that fails) raises
`LtUnavailable`, and callers fall back to torch.

Layout: torch's row-major `y[M, N] = x[M, K] @ w[N, K]^T` is cuBLAS's column-major `y^T[N, M] =
op(w)[N, K] @ x^T[K, M]` with op = transpose, so cuBLASLt sees m = N, n = M, k = K.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# cuBLASLt enum values (cublasLt.h, library_types.h, cublas_api.h).
_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F = 0
_CUDA_DTYPES = {torch.float16: 2, torch.bfloat16: 14, torch.float32: 0}
_DESC_TRANSA = 3
_DESC_TRANSB = 4
_DESC_EPILOGUE = 7
_DESC_BIAS_POINTER = 8
_EPILOGUE_DEFAULT = 1
_EPILOGUE_BIAS = 4
_OP_N = 0
_OP_T = 1
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_REDUCTION_SCHEME_MASK = 3
_REDUCTION_SCHEMES_WITHOUT_OUTPUT_TYPE = 0x3  # in place and compute type; not the output type (0x4)
# cublasLtMatmulAlgoConfigAttributes_t: (name, value, size in bytes)
_ALGO_CONFIG_FIELDS = (("algo_id", 0, 4), ("tile_id", 1, 4), ("splitk", 2, 4), ("reduction", 3, 4),
                       ("swizzle", 4, 4), ("custom", 5, 4), ("stages_id", 6, 4), ("inner_shape", 7, 2),
                       ("cluster_shape", 8, 2))

WORKSPACE_BYTES = 32 * 1024 * 1024
# The heuristic is asked once per limit and the candidates pooled: with more workspace it offers split-K
# kernels and drops others that can be faster (torch's own pick, under its smaller workspace, was faster than
# all eight candidates of the 32 MiB query for several decode shapes on the H200).
WORKSPACE_LIMITS = (0, 1024 * 1024, 4 * 1024 * 1024, WORKSPACE_BYTES)
MAX_CANDIDATES = 32


class LtUnavailable(RuntimeError):
    """cuBLASLt cannot run this matmul here (no CUDA, library not found, or a call failed)."""


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _mapped_library(maps_text: str, stem: str) -> str | None:
    """The path of a shared library named `stem`.so* in /proc/self/maps text, or None."""
    for line in maps_text.splitlines():
        path = line.split()[-1] if line.split() else ""
        if os.path.basename(path).startswith(stem + ".so"):
            return path
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    if not torch.cuda.is_available():
        raise LtUnavailable("no CUDA device")
    # torch's CUDA build links cuBLASLt; one tiny matmul makes sure it is initialised and mapped.
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    torch.matmul(a, a)
    path = None
    try:
        with open("/proc/self/maps") as f:
            path = _mapped_library(f.read(), "libcublasLt")
    except OSError:
        pass
    names = [path] if path else ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        _declare(lib)
        return lib
    raise LtUnavailable(f"libcublasLt not found (tried {names})")


def _declare(lib: ctypes.CDLL) -> None:
    vp, sz, i32, u64, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64
    protos = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatrixLayoutDestroy": [vp],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_HeuristicResult),
                                           ctypes.POINTER(i32)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i32, vp, sz, ctypes.POINTER(sz)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp],
    }
    for name, argtypes in protos.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.cublasLtGetVersion.argtypes = []
    lib.cublasLtGetVersion.restype = ctypes.c_size_t


def library_version() -> int:
    """cuBLASLt's version number (e.g. 130100): tuning results are kept per version."""
    return int(_library().cublasLtGetVersion())


def _check(status: int, what: str) -> None:
    if status != 0:
        raise LtUnavailable(f"{what} returned cuBLAS status {status}")


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    lib = _library()
    with torch.cuda.device(device_index):
        handle = ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    _library()
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


def workspace(device: torch.device) -> torch.Tensor:
    """The workspace every tuned matmul on this device uses (allocated once, kept for the process)."""
    return _workspace(device.index if device.index is not None else torch.cuda.current_device())


def algo_config(algo: _Algo) -> dict[str, int]:
    """The algorithm's configuration (id, tile, split-K, reduction, swizzle, stages, cluster), for logs."""
    lib = _library()
    out = {}
    for name, attr, size in _ALGO_CONFIG_FIELDS:
        value = ctypes.c_uint32(0)
        written = ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), size,
                                                          ctypes.byref(written))
        out[name] = int(value.value) if status == 0 else -1
    return out


def _destroy(lib: ctypes.CDLL, desc: ctypes.c_void_p, layouts: list[ctypes.c_void_p]) -> None:
    for layout in layouts:
        if layout.value:
            lib.cublasLtMatrixLayoutDestroy(layout)
    if desc.value:
        lib.cublasLtMatmulDescDestroy(desc)


# The heuristic is asked with its default alignment assumption (256 bytes), so a plan runs only on operands
# whose addresses are that aligned (torch's allocations are; views into a buffer may not be).
ALIGNMENT_BYTES = 256


@dataclass
class LtMatmul:
    """`linear` at one (rows, N, K, dtype, bias) as a cuBLASLt matmul: the descriptors, the heuristic's
    candidate algorithms (its ranking under each workspace limit in turn, duplicates dropped) and `chosen`,
    the index `run` uses. One plan sets its bias pointer on each call, and all plans of a device share one
    workspace: calls must come from one stream at a time (as kvserve's forward passes do)."""

    rows: int
    n: int
    k: int
    dtype: torch.dtype
    has_bias: bool
    device_index: int
    candidates: list[_Algo] = field(default_factory=list)
    workspace_sizes: list[int] = field(default_factory=list)
    chosen: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _CUDA_DTYPES:
            raise LtUnavailable(f"dtype {self.dtype} not supported")
        lib = _library()
        cuda_type = _CUDA_DTYPES[self.dtype]
        self._lib = lib
        self._handle = _handle(self.device_index)
        self._workspace = _workspace(self.device_index)
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        self._set_desc(_DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set_desc(_DESC_TRANSB, ctypes.c_int32(_OP_N))
        self._set_desc(_DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_BIAS if self.has_bias else _EPILOGUE_DEFAULT))
        self._a, self._b, self._d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        # Descriptors are host objects: a captured graph keeps the kernel's parameters, not them.
        weakref.finalize(self, _destroy, lib, self._desc, [self._a, self._b, self._d])
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._a), cuda_type, self.k, self.n, self.k), "layout A")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._b), cuda_type, self.k, self.rows, self.k),
               "layout B")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._d), cuda_type, self.n, self.rows, self.n),
               "layout D")
        seen: set[tuple[int, ...]] = set()
        for limit in WORKSPACE_LIMITS:
            for algo, workspace_bytes in self._heuristic(limit):
                key = tuple(algo.data)
                if key not in seen:
                    seen.add(key)
                    self.candidates.append(algo)
                    self.workspace_sizes.append(workspace_bytes)
        if not self.candidates:
            raise LtUnavailable(f"no cuBLASLt algorithm for rows={self.rows} n={self.n} k={self.k}")
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)

    def _heuristic(self, workspace_limit: int) -> list[tuple[_Algo, int]]:
        """The heuristic's candidates (its ranking) when at most workspace_limit bytes of workspace may be
        used: the limit changes which kernels it offers (split-K ones need workspace)."""
        lib = self._lib
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(workspace_limit)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
                   "preference workspace")
            if not _reduced_precision_allowed(self.dtype):  # as torch asks the heuristic under that setting
                mask = ctypes.c_uint32(_REDUCTION_SCHEMES_WITHOUT_OUTPUT_TYPE)
                _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_REDUCTION_SCHEME_MASK,
                                                                ctypes.byref(mask), 4), "preference reduction")
            results = (_HeuristicResult * MAX_CANDIDATES)()
            count = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self._handle, self._desc, self._a, self._b, self._d,
                                                      self._d, pref, MAX_CANDIDATES, results, ctypes.byref(count)),
                   "cublasLtMatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        out = []
        for i in range(count.value):
            if results[i].state == 0 and results[i].workspace_size <= workspace_limit:
                algo = _Algo()
                ctypes.memmove(ctypes.byref(algo), ctypes.byref(results[i].algo), ctypes.sizeof(_Algo))
                out.append((algo, int(results[i].workspace_size)))
        return out

    def _set_desc(self, attr: int, value: ctypes._SimpleCData) -> None:
        _check(self._lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(value),
                                                        ctypes.sizeof(value)), f"matmul desc attribute {attr}")

    def check_inputs(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether run() computes linear(x, weight, bias) for these tensors (shapes, dtypes, dense rows, the
        device this plan was made for, 256-byte aligned addresses), into a dense [rows, N] output of the same
        dtype and device (a fresh torch allocation)."""
        tensors = [x, weight] + ([bias] if bias is not None else [])
        return (
            (bias is not None) == self.has_bias
            and all(t.dtype == self.dtype and t.is_cuda and t.device.index == self.device_index
                    and t.data_ptr() % ALIGNMENT_BYTES == 0 for t in tensors)
            and tuple(x.shape) == (self.rows, self.k) and x.is_contiguous()
            and tuple(weight.shape) == (self.n, self.k) and weight.is_contiguous()
            and (bias is None or (tuple(bias.shape) == (self.n,) and bias.is_contiguous()))
        )

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            candidate: int | None = None) -> torch.Tensor:
        """out[rows, N] = x[rows, K] @ weight[N, K]^T (+ bias[N]) with candidate `candidate` (default: chosen),
        on the current stream. The caller has checked the inputs (`check_inputs`); out is dense [rows, N]."""
        index = self.chosen if candidate is None else candidate
        if self.has_bias:
            assert bias is not None
            self._set_desc(_DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        stream = torch.cuda.current_stream(x.device).cuda_stream
        _check(self._lib.cublasLtMatmul(
            self._handle, self._desc, ctypes.byref(self._alpha), ctypes.c_void_p(weight.data_ptr()), self._a,
            ctypes.c_void_p(x.data_ptr()), self._b, ctypes.byref(self._beta), ctypes.c_void_p(out.data_ptr()),
            self._d, ctypes.c_void_p(out.data_ptr()), self._d, ctypes.byref(self.candidates[index]),
            ctypes.c_void_p(self._workspace.data_ptr()), self.workspace_sizes[index], ctypes.c_void_p(stream)),
            "cublasLtMatmul")
        return out

    def config(self, candidate: int | None = None) -> dict[str, int]:
        return algo_config(self.candidates[self.chosen if candidate is None else candidate])


# ---------------------------------------------------------------------------------------------- tuning

Key = tuple[int, int, int, int, torch.dtype, bool]  # (device index, rows, N, K, dtype, bias)
# Shapes with a registered plan; absent: torch's linear runs.
_tuned: dict[Key, LtMatmul] = {}
# Every choice made in this process, per (shape, whether torch's pick competed), kept: a second engine in the
# process runs what the first chose instead of re-timing, whose noise could flip a choice and change the
# numbers mid-process.
_decided: dict[tuple[Key, bool], TuneResult] = {}
TORCH_CHOICE = -1  # a tuning result meaning torch's own pick runs
# Part of every stored result's key: bump when what is timed or which candidates are pooled changes.
TUNING_VERSION = 1
# A candidate replaces torch's pick only when it timed at least this much faster (timing noise is about 1 %).
MIN_GAIN = 0.01
# Each timing replays its graph for at least this long (µs).
TIMING_MIN_US = 2000.0
# Sustained timing (`tune(..., sustained=True)` at start, the large prefill steps): each choice is replayed this long (µs)
# first, so that the GPU settles at the clock its power cap allows for that work, then timed over at least
# SUSTAINED_MIN_US; SUSTAINED_ROUNDS passes (the order rotated each pass), its time the mean. A matmul of
# 8,192 rows runs there in a real prefill. On the H200 a short timing on a cool GPU ranked the candidates
# otherwise and its choices made TTFT 8k slower, and 40-ms windows taken one after another without a warm-up
# of each chose candidates that did not pay either (docs/perf_notes.md, entries 28 and 56).
SUSTAINED_WARM_US = 150_000.0
SUSTAINED_MIN_US = 150_000.0
SUSTAINED_ROUNDS = 1
# Sustained choices measured for a GPU and library stack (`benchmarks/cublaslt_algos.py --sustained-s S
# --tuning-out`, entries keyed like the stored results: used only where GPU, cuBLASLt, torch and shape all
# match), taken before timing anything: a start on such a stack pays no timing. None: not consulted.
SHIPPED_CHOICES_PATH: Path | None = Path(__file__).with_name("gemm_sustained_choices.json")


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else 0


def key_of(device_index: int, rows: int, n: int, k: int, dtype: torch.dtype, has_bias: bool) -> Key:
    return (device_index, rows, n, k, dtype, has_bias)


def tuned_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> LtMatmul | None:
    """The tuned plan for linear(x, weight, bias) when one was registered for exactly these rows and shapes
    and the operands fit it (dense, aligned, same dtype and device), else None (torch's linear)."""
    if not _tuned or x.dim() != 2 or weight.dim() != 2:
        return None
    plan = _tuned.get(key_of(_device_index(x), x.shape[0], weight.shape[0], weight.shape[1], x.dtype,
                             bias is not None))
    if plan is None:
        return None
    return plan if plan.check_inputs(x, weight, bias) else None


def clear_tuning() -> None:
    _tuned.clear()
    _decided.clear()


def decided_keys() -> set[Key]:
    return {key for key, _ in _decided}


def forget(keys: set[Key]) -> None:
    """Drop these shapes' plans and choices (others stay)."""
    for key in keys:
        _tuned.pop(key, None)
    for decided in [d for d in _decided if d[0] in keys]:
        del _decided[decided]


def num_tuned() -> int:
    return len(_tuned)


def pick(times_us: dict[int, float], min_gain: float = 0.0) -> int:
    """The fastest choice of timed candidates {index: µs} (TORCH_CHOICE for torch's linear). A candidate
    must beat torch's time by min_gain (a fraction) to be taken; ties go to torch, then to the lower
    index. Non-finite times (failed runs) never win."""
    finite = {i: t for i, t in times_us.items() if t == t and t != float("inf")}
    if not finite:
        return TORCH_CHOICE
    best = min(finite, key=lambda i: (finite[i], i != TORCH_CHOICE, i))
    torch_us = finite.get(TORCH_CHOICE)
    if best != TORCH_CHOICE and torch_us is not None and finite[best] > torch_us * (1 - min_gain):
        return TORCH_CHOICE
    return best


def _capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """fn run once eagerly (lazy initialisation stays out of the capture), then captured in a CUDA graph."""
    from kvserve.worker.cuda_graph import capture_graph  # (at call time: the worker imports the kernels)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        # capture_graph cleans up after a failed capture; the error reaches tune_gemms, which starts untuned.
        graph, _ = capture_graph(fn, torch.cuda.graph_pool_handle(), stream)
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """µs per replay over reps back-to-back replays (CUDA events; waits for the last)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _time_graph_us(fn: Callable[[], None], min_us: float = TIMING_MIN_US, max_reps: int = 50) -> float:
    """µs per run of fn: captured (`_capture`), replayed once untimed, then timed over enough replays to last
    min_us (3 to max_reps)."""
    graph = _capture(fn)
    graph.replay()
    once_us = max(_replay_us(graph, 1), 1.0)
    return _replay_us(graph, min(max_reps, max(3, int(min_us / once_us) + 1)))


def _time_sustained_us(fns: dict[int, Callable[[], None]], warm_us: float | None = None,
                       min_us: float | None = None, rounds: int | None = None) -> dict[int, float]:
    """µs per run of each fn on a GPU kept busy: all captured; in each of `rounds` passes (order rotated), each
    replayed for warm_us untimed, then timed over at least min_us; the mean per fn. Unset: SUSTAINED_WARM_US,
    SUSTAINED_MIN_US, SUSTAINED_ROUNDS as they are at the call."""
    warm_us = SUSTAINED_WARM_US if warm_us is None else warm_us
    min_us = SUSTAINED_MIN_US if min_us is None else min_us
    rounds = SUSTAINED_ROUNDS if rounds is None else rounds
    graphs = {i: _capture(fn) for i, fn in fns.items()}
    once: dict[int, float] = {}
    for i, graph in graphs.items():
        _replay_us(graph, 1)  # a graph's first replay uploads it: not a timing
        once[i] = max(_replay_us(graph, 1), 1.0)
    order = list(graphs)
    totals = dict.fromkeys(order, 0.0)
    for r in range(rounds):
        shift = r % len(order)
        for i in order[shift:] + order[:shift]:
            _replay_us(graphs[i], max(1, int(warm_us / once[i])))
            totals[i] += _replay_us(graphs[i], max(3, int(min_us / once[i]) + 1))
    return {i: total / rounds for i, total in totals.items()}


def shipped_choices() -> dict[str, dict]:
    """The sustained choices shipped with kvserve (SHIPPED_CHOICES_PATH; {} when unset or unreadable)."""
    return load_cache(SHIPPED_CHOICES_PATH) if SHIPPED_CHOICES_PATH is not None else {}


@dataclass
class TuneResult:
    rows: int
    n: int
    k: int
    has_bias: bool
    torch_us: float  # per call; NaN when nothing was timed
    chosen_us: float
    choice: int  # TORCH_CHOICE or the candidate index
    num_candidates: int
    num_wrong: int
    cached: bool = False  # taken from the stored (or shipped) results
    untimed: bool = False  # torch's pick, nothing stored or shipped and timing not allowed (time_missing=False)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _reduced_precision_allowed(dtype: torch.dtype) -> bool:
    """Whether torch lets this dtype's split-K reduce in the output type (torch's own setting, honoured)."""
    matmul = torch.backends.cuda.matmul
    if dtype == torch.float16:
        return bool(matmul.allow_fp16_reduced_precision_reduction)
    if dtype == torch.bfloat16:
        return bool(matmul.allow_bf16_reduced_precision_reduction)
    return True


def cache_key(device: torch.device, rows: int, n: int, k: int, dtype: torch.dtype, has_bias: bool,
              torch_candidate: bool = True, sustained: bool = False) -> str:
    """A stored result's key: the GPU, the cuBLASLt and torch versions and torch's BLAS settings (all change
    what runs), the tuning's version, the shape and how it was timed."""
    return (f"v{TUNING_VERSION}|{_device_name(device)}|cublasLt {library_version()}|torch {torch.__version__}"
            f"|{torch.backends.cuda.preferred_blas_library()}|reduced {int(_reduced_precision_allowed(dtype))}"
            f"|{str(dtype).removeprefix('torch.')}|{rows}x{n}x{k}|bias {int(has_bias)}"
            + ("" if torch_candidate else "|cuBLASLt only") + ("|sustained" if sustained else ""))


def load_cache(path: Path) -> dict[str, dict]:
    """Tuning results saved by `save_cache` ({} when the file is missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_cache(path: Path, cache: dict[str, dict]) -> None:
    """Merge the results into the file (entries another process wrote meanwhile stay) and write it atomically:
    a concurrent reader sees the old file or the new one. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = load_cache(path)
    merged.update(cache)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(merged, indent=0, sort_keys=True))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def stored_entry(plan: LtMatmul, choice: int, torch_us: float, chosen_us: float) -> dict:
    """A stored result (`save_cache`'s entries, the shipped choices): the choice, its algorithm's data (how a
    later process finds it among the heuristic's candidates; None for torch's pick) and the times."""
    return {"choice": choice, "algo": None if choice == TORCH_CHOICE else list(plan.candidates[choice].data),
            "torch_us": torch_us, "chosen_us": chosen_us}


def _valid_entry(entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("choice"), int):
        return False
    algo = entry.get("algo")
    if entry["choice"] == TORCH_CHOICE:
        return algo is None
    return (entry["choice"] >= 0 and isinstance(algo, list) and len(algo) == 8
            and all(isinstance(v, int) and 0 <= v < 2**64 for v in algo))


def _register(key: Key, torch_candidate: bool, plan: LtMatmul | None, result: TuneResult) -> TuneResult:
    if result.choice == TORCH_CHOICE:
        _tuned.pop(key, None)
    else:
        assert plan is not None
        plan.chosen = result.choice
        _tuned[key] = plan
    _decided[(key, torch_candidate)] = result
    return result


# Results are compared with the reference this many rows at a time (the float32 copies of a whole 8,192-row
# gate/up output would take 2.5 GB).
_ERROR_CHUNK_ROWS = 1024


def _error(plan: LtMatmul, index: int, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
           out: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference between candidate `index`'s result and reference (inf when it fails; NaN
    when the result holds one)."""
    try:
        out.fill_(float("nan"))
        plan.run(x, w, b, out, candidate=index)
    except LtUnavailable:
        return float("inf")
    worst = 0.0
    for start in range(0, out.shape[0], _ERROR_CHUNK_ROWS):
        part = (out[start:start + _ERROR_CHUNK_ROWS].float() - reference[start:start + _ERROR_CHUNK_ROWS].float())
        err = float(part.abs().max().item())
        if err != err:
            return err
        worst = max(worst, err)
    return worst


def tune(rows: int, weights: list[torch.Tensor], biases: list[torch.Tensor | None], *,
         cache: dict[str, dict] | None = None, torch_candidate: bool = True, max_relative_error: float = 2e-2,
         min_gain: float = MIN_GAIN, sustained: bool = False, defaults: dict[str, dict] | None = None,
         time_missing: bool = True) -> TuneResult:
    """Time torch's linear and every cuBLASLt candidate at `rows` rows over `weights` (one call per weight per
    run: distinct weights keep a call from reading the previous one's from L2), and register the fastest for
    `tuned_plan` (a candidate must beat torch by min_gain). A candidate whose result differs from torch's by
    more than max_relative_error of its largest value is skipped. `sustained`: timed on a GPU kept busy
    (`_time_sustained_us`), as the large prefill steps run, instead of one short timing each.

    A shape decided before in this process keeps its choice, however it was decided (one plan per shape and
    row count: the first decision wins, sustained or not). With `cache`, a stored choice (of the same timing
    mode) is taken without timing when it is torch's pick, or a candidate still offered that still computes
    within the tolerance; new results are stored in it. `torch_candidate=False` leaves torch's pick out
    (tests: the cuBLASLt path always runs). `defaults` (`shipped_choices()`) is read like `cache` where `cache`
    has no entry for the shape. `time_missing=False`: where neither holds a usable choice, torch's pick (not
    stored, and not a decision: a later call may time the shape) instead of timing; with torch's pick left out
    (torch_candidate=False) the candidates are timed anyway. Raises LtUnavailable when cuBLASLt cannot be used
    for this shape."""
    w0, b0 = weights[0], biases[0]
    n, k = w0.shape
    device_index = _device_index(w0)
    key = key_of(device_index, rows, n, k, w0.dtype, b0 is not None)
    decided = _decided.get((key, torch_candidate))
    if decided is not None:
        return decided
    ckey = cache_key(w0.device, rows, n, k, w0.dtype, b0 is not None, torch_candidate, sustained)
    entry = cache.get(ckey) if cache is not None else None
    if entry is None and defaults is not None:
        entry = defaults.get(ckey)
    entry = entry if _valid_entry(entry) else None
    stored_us = float("nan")
    if entry is not None and isinstance(entry.get("chosen_us"), (int, float)):
        stored_us = float(entry["chosen_us"])
    if entry is not None and entry["choice"] == TORCH_CHOICE and torch_candidate:
        return _register(key, torch_candidate, None, TuneResult(
            rows, n, k, b0 is not None, float("nan"), stored_us, TORCH_CHOICE, 0, 0, True))
    untimed = TuneResult(rows, n, k, b0 is not None, float("nan"), float("nan"), TORCH_CHOICE, 0, 0, untimed=True)
    if entry is None and not time_missing and torch_candidate:
        return untimed  # not registered: not a decision
    plan = LtMatmul(rows, n, k, w0.dtype, b0 is not None, device_index)
    gen = torch.Generator(device=w0.device).manual_seed(rows * 7919 + n)
    x = torch.randn(rows, k, generator=gen, device=w0.device, dtype=torch.float32).to(w0.dtype)
    out = torch.empty(rows, n, device=w0.device, dtype=w0.dtype)
    reference = torch.nn.functional.linear(x, w0, b0)
    tolerance = max_relative_error * reference.abs().max().float().item()
    if entry is not None:
        found = [i for i, c in enumerate(plan.candidates) if list(c.data) == entry["algo"]]
        if found and _error(plan, found[0], x, w0, b0, out, reference) <= tolerance:
            return _register(key, torch_candidate, plan, TuneResult(
                rows, n, k, b0 is not None, float("nan"), stored_us, found[0], len(plan.candidates), 0, True))
    if not time_missing and torch_candidate:  # the stored algorithm is gone or computes wrongly now
        return untimed  # not registered: not a decision

    def run_torch() -> None:
        for w, b in zip(weights, biases, strict=True):
            torch.nn.functional.linear(x, w, b)

    runs: dict[int, Callable[[], None]] = {TORCH_CHOICE: run_torch}  # timed in any case: the report's baseline
    num_wrong = 0
    for i in range(len(plan.candidates)):
        if not _error(plan, i, x, w0, b0, out, reference) <= tolerance:
            num_wrong += 1
            continue

        def run_candidate(i: int = i) -> None:
            for w, b in zip(weights, biases, strict=True):
                plan.run(x, w, b, out, candidate=i)

        runs[i] = run_candidate
    del reference
    times = _time_sustained_us(runs) if sustained else {i: _time_graph_us(fn) for i, fn in runs.items()}
    torch_us = times[TORCH_CHOICE]
    choice = pick(times if torch_candidate else {i: t for i, t in times.items() if i != TORCH_CHOICE}, min_gain)
    if choice == TORCH_CHOICE and not torch_candidate:
        raise LtUnavailable(f"no cuBLASLt candidate ran correctly for rows={rows} n={n} k={k}")
    chosen_us = times.get(choice, torch_us)
    result = TuneResult(rows, n, k, b0 is not None, torch_us / len(weights), chosen_us / len(weights), choice,
                        len(plan.candidates), num_wrong)
    if cache is not None:
        cache[ckey] = stored_entry(plan, choice, result.torch_us, result.chosen_us)
    return _register(key, torch_candidate, plan, result)
