"""Times kvserve's mixture-of-experts kernels (`kvserve/kernels/triton_moe.py`, `fused_moe`) at Qwen3-30B-A3B's
expert shape (H = 2048, I = 768, E = 128, k = 8; `--inter` for a tensor-parallel slice), bf16, routing ids
uniformly at random (k distinct experts per token).

Each timing is a CUDA graph of one call (as decode steps run), replayed after warm-up replays; the median of
the per-replay CUDA-event times. GB/s counts the expert weights read: distinct experts hit x one expert's
bytes (3 H I x 2), the floor on the memory traffic of a call.

    python benchmarks/moe_kernel_bench.py --out /tmp/moe [--tokens 1,8,64] [--config 16:32:64:128:4:3]

`--config` (repeatable) times the given tilings (block_m:block_n_gate_up:block_n_down:block_k:warps:stages)
instead of `pick_config`'s, each checked first against the default tiling's result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvserve.kernels import triton_moe  # noqa: E402
from kvserve.kernels.triton_moe import MoeConfig  # noqa: E402


def time_graph_median(fn: object, warmup: int = 10, reps: int = 50) -> float:
    """Median µs per replay of a CUDA graph that runs fn once (fn also run once outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # type: ignore[operator]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1000.0


def parse_config(text: str) -> MoeConfig:
    bm, bng, bnd, bk, warps, stages = (int(v) for v in text.split(":"))
    return MoeConfig(block_m=bm, block_n_gate_up=bng, block_n_down=bnd, block_k=bk, num_warps=warps,
                     num_stages=stages)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for moe_kernel_bench.json")
    parser.add_argument("--tokens", default="1,8,64,256,2048,8192")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--config", action="append", type=parse_config, default=[])
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    hidden, inter, num_experts, top_k = args.hidden, args.inter, args.experts, args.top_k
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) * inter**-0.5).to(dtype)
    expert_bytes = 3 * hidden * inter * w13.element_size()
    results = []
    print(f"{torch.cuda.get_device_name()}  H={hidden} I={inter} E={num_experts} k={top_k} bf16")
    print(f"{'T':>6} {'tiling':>22} {'experts':>7} {'us':>9} {'GB/s':>8}")
    for num_tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(num_tokens, hidden, device=device).to(dtype)
        topk_ids = torch.rand(num_tokens, num_experts, device=device).argsort(dim=1)[:, :top_k].to(torch.int32)
        topk_weights = torch.softmax(torch.randn(num_tokens, top_k, device=device), dim=-1)
        hit = int(torch.unique(topk_ids).numel())
        default = triton_moe.pick_config(num_tokens, top_k, num_experts)
        expected = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, config=default)
        for config in args.config or [default]:
            label = ":".join(str(v) for v in (config.block_m, config.block_n_gate_up, config.block_n_down,
                                              config.block_k, config.num_warps, config.num_stages))
            try:
                got = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, config=config)
                torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-6)
                us = time_graph_median(partial(triton_moe.fused_moe, x, w13, w2, topk_weights, topk_ids,
                                               config=config))
            except Exception as exc:  # a tiling that does not compile (shared memory) or does not match
                print(f"{num_tokens:>6} {label:>22} skipped: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            gbps = hit * expert_bytes / us / 1000.0
            print(f"{num_tokens:>6} {label:>22} {hit:>7} {us:>9.1f} {gbps:>8.0f}")
            results.append(dict(tokens=num_tokens, tiling=label, default=config == default, experts_hit=hit,
                                us=round(us, 2), weight_gbps=round(gbps, 1)))
    args.out.mkdir(parents=True, exist_ok=True)
    payload = dict(benchmark="moe_kernel_bench", device=torch.cuda.get_device_name(), torch=torch.__version__,
                   shape=dict(hidden=hidden, inter=inter, experts=num_experts, top_k=top_k, dtype="bf16"),
                   results=results)
    path = args.out / "moe_kernel_bench.json"
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
