"""Peak GPU memory and time of requantizing one block-wise fp8 layer at load (`Linear.finish_loading`).

    python benchmarks/block_fp8_load_probe.py [N K ...]

For each weight shape N x K (default: a Qwen2.5-7B gate/up, down and q projection), a Linear with a
`weight_block_size` [128, 128] config gets random e4m3 rows and block scales on the GPU, then `finish_loading`
dequantizes and requantizes it per row: prints the fp8 weight's size, the peak memory allocated above what
was allocated before the call, and the call's time.
"""
from __future__ import annotations

import sys
import time

import torch

from kvserve.layers.linear import Linear
from kvserve.layers.quantization import QuantConfig


def probe(n: int, k: int) -> str:
    device = torch.device("cuda")
    with torch.device(device):
        layer = Linear(k, n, False, torch.bfloat16, quant=QuantConfig("fp8", 8, -1, weight_block=(128, 128)))
    w8 = torch.randint(0, 120, (n, k), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    scales = torch.rand((n + 127) // 128, (k + 127) // 128, device=device) + 0.5
    layer.weight_fp8.weight_loader(layer.weight_fp8, w8)
    layer.weight_scale.weight_loader(layer.weight_scale, scales)
    del w8, scales
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    layer.finish_loading()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before
    return (f"{n} x {k}: fp8 weight {n * k / 2**20:.0f} MiB, peak above it during finish_loading "
            f"{peak / 2**20:.0f} MiB, {seconds * 1e3:.1f} ms")


def main() -> None:
    dims = [int(v) for v in sys.argv[1:]] or [37888, 3584, 3584, 18944, 3584, 3584]
    for n, k in zip(dims[::2], dims[1::2], strict=True):
        probe(n, k)  # the first call compiles the quantization kernel
        print(probe(n, k), flush=True)


if __name__ == "__main__":
    main()
