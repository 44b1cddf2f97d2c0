"""What torch leaves behind after a CUDA-graph capture that fails (a host read inside it), step by step: the
graph's pool() call, ending the allocator's routing to the pool, the default generator, the pool's memory
and a later capture into the same pool. One process per case (a failed capture changes process state).
The probe keeps its 64 MiB scratch tensor alive after the failure, so its pool's memory is not freed in any
case; tests/gpu/test_gpu_piecewise.py checks the memory with the tensor gone.

    python benchmarks/capture_failure_probe.py            # runs every case in a subprocess
    python benchmarks/capture_failure_probe.py CASE       # one case in this process
"""

from __future__ import annotations

import subprocess
import sys

import torch

CASES = ("end-release", "end-release-reset", "reset-only", "nothing")


def _try(label: str, fn) -> object:  # type: ignore[no-untyped-def]
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 (the probe reports every outcome)
        print(f"  {label}: raised {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
        return exc
    print(f"  {label}: ok {out!r}"[:200])
    return out


def run(case: str) -> None:
    print(f"case {case}, torch {torch.__version__}")
    dev = torch.cuda.current_device()
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            scratch = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
            (x * scratch[: x.numel()]).sum().item()
        except Exception as exc:  # noqa: BLE001
            print(f"  in capture: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        _try("capture_end", graph.capture_end)
    _try("graph.pool()", graph.pool)
    if case.startswith("end"):
        _try("endAllocateToPool", lambda: torch._C._cuda_endAllocateToPool(dev, pool))
        _try("endAllocateToPool again", lambda: torch._C._cuda_endAllocateToPool(dev, pool))
        _try("releasePool", lambda: torch._C._cuda_releasePool(dev, pool))
    if case.endswith("reset") or case == "reset-only":
        _try("graph.reset()", graph.reset)
    if isinstance(_try("randn after", lambda: float(torch.randn(4, device="cuda").sum())), Exception):
        gen = torch.cuda.default_generators[dev]
        _try("generator state replaced by its clone", lambda: gen.graphsafe_set_state(gen.clone_state()))
        _try("randn after the clone", lambda: float(torch.randn(4, device="cuda").sum()))
    torch.cuda.synchronize()
    _try("empty_cache", torch.cuda.empty_cache)
    print(f"  reserved before {reserved >> 20} MiB, after {torch.cuda.memory_reserved() >> 20} MiB")
    del graph
    import gc

    gc.collect()
    _try("randn after del", lambda: float(torch.randn(4, device="cuda").sum()))

    def again() -> float:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            g.capture_begin(pool=pool)
            y = x * 3
            g.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        g.replay()
        torch.cuda.synchronize()
        return float(y[0] / x[0])

    _try("capture into the same pool", again)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for case in CASES:
            subprocess.run([sys.executable, __file__, case], check=False)
