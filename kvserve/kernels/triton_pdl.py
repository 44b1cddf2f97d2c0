"""Programmatic dependent launch (PDL) for kvserve's Triton kernels (Hopper and later).

Without PDL a kernel starts only after the kernel before it on the stream has finished and flushed; the GPU
idles for the launch latency and for the previous kernel's last, half-empty wave. A kernel launched with PDL
may be scheduled as soon as every program of the kernel before it has signalled (or exited); it then blocks
at `griddepcontrol.wait` until that kernel has completed and its writes are visible. So:

* every kvserve kernel launched with PDL calls `pdl_wait_then_release` before its first load of anything
  another kernel writes, and signals its own dependents right after the wait: at most two kernels overlap,
  and nothing ever reads a half-written input;
* what overlaps is the next kernel's launch and ramp with the previous kernel's tail. Pulling the next
  matmul's first weight lines into L2 before its wait was measured too, and was slower (docs/perf_notes.md,
  entry 17).

A PDL launch after a kernel that never signals (cuBLAS, a torch op) simply starts when that kernel ends, as
any launch does. CUDA graphs keep the dependency (stream capture turns it into a programmatic edge).

`enabled(device)` decides per device: sm_90+, a Triton that has the intrinsics, not the interpreter, and
not switched off (`KVSERVE_PDL=0`, or `set_enabled(False)` for A/B measurements). Where it is off, kernels
compile without the instructions (the `PDL` constexpr is False) and launch as before.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from kvserve import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # a Triton before the intrinsics (3.5): PDL stays off, the names are never traced
    HAS_GDC = False
    gdc_launch_dependents = gdc_wait = None

_enabled = envs.KVSERVE_PDL


def set_enabled(flag: bool) -> None:
    """Switch PDL launches on or off for kernels launched from now on (A/B measurement; tests)."""
    global _enabled
    _enabled = flag


@functools.cache
def _device_supports(device: torch.device) -> bool:
    # (ROCm reports its own "capabilities" through the same call: PDL is CUDA's, sm_90 and later.)
    if device.type != "cuda" or not HAS_GDC or envs.TRITON_INTERPRET or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` now use PDL."""
    return _enabled and _device_supports(device)


def launch_options(use_pdl: bool) -> dict[str, Any]:
    """Extra launch keywords for a kernel whose `PDL` constexpr is `use_pdl`."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def pdl_wait_then_release(PDL: tl.constexpr):
    """Wait for the previous kernel's results, then let the next kernel be scheduled (PDL launches only)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
