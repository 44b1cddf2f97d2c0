"""cuBLASLt called directly (ctypes), so that a matmul can run an algorithm chosen by timing instead of the
library's first heuristic pick.

torch's `linear` on CUDA asks cuBLASLt's heuristic for one algorithm and runs it. For the decode batch sizes
the heuristic's first pick is not always its fastest candidate (docs/perf_notes.md, entry 28). This module
holds a `LtMatmul` per (rows, N, K, dtype, bias): its matrix layouts, the heuristic's candidates, and the one
to run. `LtMatmul.run(x, weight, bias, out)` computes `torch.nn.functional.linear(x, weight, bias)` into
`out` on the current stream (CUDA-graph capturable: no host sync, a fixed workspace).

The library is the one torch already loaded (found in the process's mapped files), so there is no second
copy and no build step. Anything unavailable (no CUDA, no cuBLASLt found, a call that fails) raises
`LtUnavailable`, and callers fall back to torch.

Layout: torch's row-major `y[M, N] = x[M, K] @ w[N, K]^T` is cuBLAS's column-major `y^T[N, M] =
op(w)[N, K] @ x^T[K, M]` with op = transpose, so cuBLASLt sees m = N, n = M, k = K.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field

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
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_HeuristicResult),
                                           ctypes.POINTER(i32)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i32, vp, sz, ctypes.POINTER(sz)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp],
    }
    for name, argtypes in protos.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int


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
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


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


@dataclass
class LtMatmul:
    """`linear` at one (rows, N, K, dtype, bias) as a cuBLASLt matmul: the descriptors, the heuristic's
    candidate algorithms (best first, as the heuristic ranks them) and `chosen`, the index `run` uses."""

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

    def check_operands(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       out: torch.Tensor) -> bool:
        """Whether run() computes linear(x, weight, bias) into out for these tensors (shapes, dtypes, dense
        rows, the device this plan was made for)."""
        tensors = [x, weight, out] + ([bias] if bias is not None else [])
        return (
            (bias is not None) == self.has_bias
            and all(t.dtype == self.dtype and t.is_cuda and t.device.index == self.device_index for t in tensors)
            and tuple(x.shape) == (self.rows, self.k) and x.is_contiguous()
            and tuple(weight.shape) == (self.n, self.k) and weight.is_contiguous()
            and tuple(out.shape) == (self.rows, self.n) and out.is_contiguous()
            and (bias is None or (tuple(bias.shape) == (self.n,) and bias.is_contiguous()))
        )

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            candidate: int | None = None) -> torch.Tensor:
        """out[rows, N] = x[rows, K] @ weight[N, K]^T (+ bias[N]) with candidate `candidate` (default: chosen),
        on the current stream. The caller has checked the operands (`check_operands`)."""
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
