"""Kernel tests run the Triton kernels compiled on a CUDA GPU, or under Triton's interpreter on CPU.

`@triton.jit` decides at decoration time (module import) whether a function is compiled or interpreted, from
`TRITON_INTERPRET` (triton 3.9 reads it through `triton.knobs.runtime.interpret`, which looks at the
environment on each access). That applies to triton's own @jit library functions too (tl.sum, tl.max, tl.cdiv,
decorated when `triton.language` is imported). So this file sets it at import, before the test modules
import triton, and if something imported triton or a kernel module earlier, it re-runs those decorators by
reloading the modules (a reload re-executes the module in the same namespace, so functions imported from
those modules earlier see the re-decorated kernels too). The kernel modules themselves cache nothing that
depends on the mode.

The interpreter runs each program in numpy: keep shapes small. It does not support bfloat16 (stored as uint16:
`tl.dot` multiplies the raw bits, fp32 -> bf16 casts truncate instead of rounding to nearest even; triton's
debugging guide says to cast bf16 to fp32 first), so bf16 cases run only on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import inspect
import json
import os
import queue
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _redecorate_triton_library() -> None:
    """Re-run the decorators of triton's own @jit library functions (tl.sum, tl.max, tl.cdiv, ...).

    Needed only when something imported triton before this file set TRITON_INTERPRET: those functions were
    then compiled-mode JITFunctions, which an interpreted kernel cannot call.
    """
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    stale = {name: value for name, value in vars(tl).items() if isinstance(value, JITFunction)}
    for module_name in sorted({value.fn.__module__ for value in stale.values()}):
        importlib.reload(sys.modules[module_name])
    for name, value in stale.items():
        setattr(tl, name, getattr(sys.modules[value.fn.__module__], value.fn.__name__))
    leftover = [name for name, value in vars(tl).items() if isinstance(value, JITFunction)]
    assert not leftover, f"triton.language functions still compiled-mode after reload: {leftover}"


if INTERPRET and "triton.language" in sys.modules:
    _redecorate_triton_library()


def _shape_invariant_interpreter_dot() -> None:
    """Make the interpreter's `tl.dot` give each output element the same bits whatever the operands' shapes.

    The interpreter computes a dot as `np.matmul(a, b, dtype=float32)`, i.e. BLAS sgemm, whose rounding can
    depend on the matrix shape: with numpy 2.4.6 (OpenBLAS 0.3.31) a [70, 256] x [256, 32] product differs
    in the last bits from the first 32 columns of [70, 256] x [256, 256], from 16 rows up. Tests that
    compare two tilings or a fused epilogue with the separate kernels bitwise then fail for the emulation,
    not for the kernels (a GPU's MMA accumulates each tile the same way whatever the grid). Summing the
    16-bit products in float64 and rounding once to the accumulator's float32 gives the same bits for every
    shape (short of a double-rounding tie, which these small sums do not meet). 8-bit operands keep Triton's
    own emulation."""
    import numpy as np
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    original = getattr(builder, "create_dot", None)
    if builder is None or handle is None or original is None or getattr(original, "_kvserve_float64", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8 or d.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return handle(product + d.data, d.dtype.scalar)

    create_dot._kvserve_float64 = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


if INTERPRET:
    _shape_invariant_interpreter_dot()
# Kernel modules imported before this point were decorated for compilation: decorate them again.
for _name in [m for m in sys.modules if m.startswith("kvserve.kernels.triton_")]:
    importlib.reload(sys.modules[_name])


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel inputs live: the GPU when kernels compile, the CPU under the interpreter."""
    if INTERPRET:
        return torch.device("cpu")
    if not CUDA:
        pytest.skip("no CUDA GPU and TRITON_INTERPRET is not 1: Triton kernels cannot run")
    return torch.device("cuda")


@pytest.fixture
def skip_bf16_on_interpreter() -> Callable[[torch.dtype], None]:
    """Call with the test's dtype: bfloat16 runs only on a GPU (see the module docstring)."""

    def check(dtype: torch.dtype) -> None:
        if dtype == torch.bfloat16 and INTERPRET:
            pytest.skip(
                "the Triton interpreter does not support bfloat16 (tl.dot on raw bits, truncating casts)"
            )

    return check


class _PoisoningTorch:
    """Stands in for `torch` inside a kernel module: every float tensor it allocates starts as NaN.

    A kernel that leaves part of an output (or a scratch buffer it later reads) unwritten then fails the
    element-wise comparison, whatever the allocator happened to hand back.
    """

    def __init__(self) -> None:
        self._torch = torch

    def __getattr__(self, name: str) -> object:
        return getattr(self._torch, name)

    @staticmethod
    def _poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self._poison(torch.empty_like(*args, **kwargs))


@pytest.fixture
def poison_allocations(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], None]:
    """Call with a kernel module to make its torch.empty / torch.empty_like return NaN-filled tensors."""

    def apply(module: ModuleType) -> None:
        monkeypatch.setattr(module, "torch", _PoisoningTorch())

    return apply


# ------------------------------------------------------------------- ahead-of-time compile for Hopper

_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}


class _LaunchRecorder:
    """Replaces a kernel in its module: `kernel[grid](*args, **kwargs)` is recorded, not run."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            self.launches.append((args, kwargs))

        return launch


def _launch_spec(
    module: ModuleType, name: str, kernel: object, args: tuple[object, ...], kwargs: dict
) -> dict:
    """What the JIT would specialise one launch on: argument types, constexprs, 16-divisibility, options."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl", "enable_fp_fusion") if k in kwargs}
    bound = dict(zip([p.name for p in params], args, strict=False))  # constexprs come as kwargs
    bound.update(kwargs)
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    divisible: list[int] = []
    for i, param in enumerate(params):
        # A constexpr left at its default is compiled with that default.
        value = bound[param.name] if param.default is inspect.Parameter.empty else bound.get(param.name, param.default)
        if param.annotation in ("tl.constexpr", "constexpr") or "constexpr" in str(param.annotation):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                divisible.append(i)
        elif type(value).__name__ == "TensorDescriptor":  # triton.tools.tensor_descriptor (TMA, host-built)
            signature[param.name] = f"tensordesc<{_TRITON_TYPES[value.base.dtype]}{list(value.block_shape)}>"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                divisible.append(i)
        else:
            raise TypeError(f"cannot type argument {param.name}={value!r}")
    return dict(
        module=module.__name__,
        kernel=name,
        signature=signature,
        constexprs=constexprs,
        divisible=divisible,
        options=options,
    )


# Runs in a fresh interpreter without TRITON_INTERPRET: once the interpreter is on, triton's own jit helpers
# (tl.cdiv, tl.sigmoid, ...) are interpreted functions that the compiler cannot inline. A worker compiles one
# launch per line of its stdin and answers each with one line (a compile that fails answers its traceback).
_COMPILE_SCRIPT = """
import json, sys, traceback
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for line in sys.stdin:
    spec = json.loads(line)
    try:
        kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        attrs = {(i,): [["tt.divisibility", 16]] for i in spec["divisible"]}
        source = ASTSource(kernel, spec["signature"], spec["constexprs"], attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", spec.get("arch", 90), 32), options=spec["options"])
        ptx = compiled.asm["ptx"]
        result = {"kernel": spec["kernel"], "shared_bytes": compiled.metadata.shared,
                  "pdl": spec["options"].get("launch_pdl", False), "num_warps": spec["options"].get("num_warps"),
                  "griddepcontrol": "griddepcontrol.wait" in ptx,
                  "block_m": spec["constexprs"].get("BLOCK_M")}
    except Exception:
        result = {"error": traceback.format_exc()}
    print("COMPILED " + json.dumps(result), flush=True)
"""


class _CompileWorker:
    """One `_COMPILE_SCRIPT` process (stderr to a file: a pipe nobody reads could fill and stall it)."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's default-change warning
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, "-c", _COMPILE_SCRIPT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)

    def compile(self, spec: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("COMPILED "):
                result = json.loads(line[len("COMPILED "):])
                assert "error" not in result, f"{spec['kernel']} did not compile:\n{result['error'][-4000:]}"
                return result
        self._stderr.seek(0)
        raise AssertionError(f"the compile worker exited ({self.proc.wait()}):\n"
                             f"{self._stderr.read().decode(errors='replace')[-4000:]}")

    def finish(self) -> None:
        """Let it exit: its loop ends at the end of its stdin."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # it died already
                self.proc.stdin.close()

    def close(self) -> None:
        self.finish()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


class _CompilePool:
    """Compile workers, one per usable CPU core (a compile is single-threaded), at most 8, started at the first
    compile and kept for the next (each start imports triton and torch: seconds) until this directory's tests
    are done. A batch of launches is spread over them as they free up."""

    def __init__(self) -> None:
        self._workers: list[_CompileWorker] = []

    def compile(self, specs: list[dict]) -> list[dict]:
        if not specs:
            return []
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        for worker in [w for w in self._workers if w.proc.poll() is not None]:  # one that died in an earlier test
            worker.close()
            self._workers.remove(worker)
        while len(self._workers) < min(len(specs), cores, 8):
            self._workers.append(_CompileWorker())
        todo: queue.SimpleQueue[tuple[int, dict]] = queue.SimpleQueue()
        for index, spec in enumerate(specs):
            todo.put((index, spec))
        results: list[dict] = [{} for _ in specs]

        def drain(worker: _CompileWorker) -> None:
            while True:
                try:
                    index, spec = todo.get_nowait()
                except queue.Empty:
                    return
                results[index] = worker.compile(spec)

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self._workers)) as threads:
            for done in [threads.submit(drain, worker) for worker in self._workers]:
                done.result()
        return results

    def close(self) -> None:
        for worker in self._workers:  # all exiting at once
            worker.finish()
        for worker in self._workers:
            worker.close()
        self._workers.clear()


_COMPILE_POOL = _CompilePool()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The compile workers stop when the tests of this directory are done."""
    if nextitem is None or Path(str(nextitem.path)).parent != Path(__file__).parent:
        _COMPILE_POOL.close()


class HopperCompiler:
    """Records kernel launches made by launcher calls, then compiles them all for sm_90 in subprocesses
    (no GPU needed: triton ships ptxas), each distinct launch once, spread over the CPU cores. Catches what
    the interpreter lets through: type and layout errors, unsupported ops, shared memory over the limit."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pdl: bool = False, arch: int = 90) -> None:
        self._monkeypatch = monkeypatch
        self.pdl = pdl  # record the launches as they are on an sm_90 GPU with programmatic dependent launch
        self.arch = arch  # the compute capability compiled for (90: Hopper; 80: Ampere, for kernels meant to run there)
        self.specs: list[dict] = []

    def record(self, module: ModuleType, kernel_names: list[str | tuple[ModuleType, str]],
               call: Callable[[], object]) -> None:
        """Record the launches `call` makes of the named kernels: names in `module`, or (module, name) for a
        kernel that `call` launches through a helper of another module."""
        from kvserve.kernels import triton_pdl

        kernels = [k if isinstance(k, tuple) else (module, k) for k in kernel_names]
        recorders = [(mod, name, _LaunchRecorder(getattr(mod, name))) for mod, name in kernels]
        with self._monkeypatch.context() as patch:
            for mod, name, recorder in recorders:
                patch.setattr(mod, name, recorder)
            patch.setattr(triton_pdl, "enabled", lambda device: self.pdl)
            call()
        for mod, name, recorder in recorders:
            assert recorder.launches, f"{name} was never launched"
            self.specs += [_launch_spec(mod, name, recorder.kernel, a, k) | {"arch": self.arch}
                           for a, k in recorder.launches]

    def compile_all(self) -> list[dict]:
        """The compile result of every recorded launch, in recording order. A launch recorded twice with the
        same specialisation is compiled once; the distinct ones are spread over the compile workers (one per
        core: a compile is single-threaded, and there are dozens of seconds of them per test on a 2-core CPU)."""
        keys = [json.dumps(spec, sort_keys=True) for spec in self.specs]
        distinct = dict(zip(keys, self.specs, strict=True))  # one spec per key, in recording order
        by_key = dict(zip(distinct, _COMPILE_POOL.compile(list(distinct.values())), strict=True))
        compiled = [by_key[key] for key in keys]
        for entry in compiled:  # a PDL launch must wait for its inputs; a plain one carries no wait
            assert entry["pdl"] == self.pdl and entry["griddepcontrol"] == self.pdl, entry
        return compiled


@pytest.fixture(params=[False, True], ids=["plain", "pdl"])
def hopper_compiler(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> HopperCompiler:
    if not INTERPRET:
        pytest.skip("the kernels run compiled on this machine; the ahead-of-time check is for CPU-only runs")
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    return HopperCompiler(monkeypatch, pdl=request.param)


@pytest.fixture
def compiler_for(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], HopperCompiler]:
    """Call with a compute capability (90, 80): a HopperCompiler of plain launches that compiles for it."""
    if not INTERPRET:
        pytest.skip("the kernels run compiled on this machine; the ahead-of-time check is for CPU-only runs")
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    return lambda arch: HopperCompiler(monkeypatch, arch=arch)
