"""What stays reserved after a CUDA-graph capture that fails inside kvserve's capture_graph (a host read in the
capture), with each new segment's live blocks and their allocation stacks. Cases: lean capture or torch's
context manager; fn raising or the capture's end failing; with or without a graph captured and kept first
(as an engine keeps its graphs). One process per case (a failed capture changes process state).

    python benchmarks/capture_failure_residue.py                      # every case, each in a subprocess
    python benchmarks/capture_failure_residue.py LEAN FAILING KEPT    # one case: 1|0 fn|capture_end 1|0
"""

from __future__ import annotations

import subprocess
import sys

import torch

from kvserve.worker import cuda_graph


def segments() -> dict[int, dict]:
    return {s["address"]: s for s in torch.cuda.memory._snapshot()["segments"]}


def run(lean: bool, failing: str, kept_first: bool) -> None:
    cuda_graph.LEAN_CAPTURE = lean
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="all")
    kept: list[object] = []  # alive until the process ends
    x = torch.randn(1 << 20, device="cuda")
    if kept_first:
        s0 = torch.cuda.Stream()
        s0.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s0):
            kept.append(cuda_graph.capture_graph(lambda: x * 2, torch.cuda.graph_pool_handle(), s0))
        torch.cuda.current_stream().wait_stream(s0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    before = segments()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def invalid() -> torch.Tensor:
        scratch = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
        product = x * scratch[: x.numel()]
        try:
            product.sum().item()
        except RuntimeError:
            if failing == "fn":
                raise
        return product

    try:
        cuda_graph.capture_graph(invalid, torch.cuda.graph_pool_handle(), stream)
    except RuntimeError as exc:
        print("  capture failed:", str(exc).splitlines()[0][:100])
    noise = torch.randn(1000, device="cuda")
    float(noise.std())
    torch.cuda.synchronize()
    del noise
    torch.cuda.empty_cache()
    diff = torch.cuda.memory_reserved() - reserved
    print(f"lean={lean} failing={failing} kept_first={kept_first}: reserved diff {diff} B")
    for addr, s in segments().items():
        if addr in before:
            continue
        print(
            f"  new segment {addr:#x} size {s['total_size']} pool {s.get('segment_pool_id')} stream {s.get('stream')}"
        )
        for b in s["blocks"]:
            if b["state"] != "inactive":
                print(f"    block {b['size']} B {b['state']}")
                for f in (b.get("frames") or [])[:25]:
                    print(f"      {f.get('name')} {f.get('filename', '')}:{f.get('line', '')}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1] == "1", sys.argv[2], sys.argv[3] == "1")
    else:
        for kept in ("0", "1"):
            for lean in ("1", "0"):
                for failing in ("fn", "capture_end"):
                    subprocess.run([sys.executable, __file__, lean, failing, kept], check=False)
