"""HF Transformers `generate` at the seeds' shape (static batch 50, 512 in, 256 out), random weights at the
Qwen2.5-7B shape, with the process set up one of several ways, so that the HF baseline of
`engine_benchmarks.py --sections seeds,hf` can be checked against HF run alone.

    python benchmarks/hf_probe.py --out DIR [--blas default|cublaslt] [--after-kvserve] [--profile-steps 8]
                                  [--prompts FILE] [--dtype bfloat16]

--prompts FILE (a JSON list of token-id lists) runs those prompts instead of random ones: how
`engine_benchmarks.py --sections seeds,hf` runs HF on the seeds section's prompts in a fresh process.

--after-kvserve starts a kvserve engine and runs the seeds' workload first, then frees it (what the hf
section does when it follows the seeds section). --profile-steps N profiles one generate of N new tokens and
prints the kernels taking the most GPU time.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time
from pathlib import Path

import torch
from common import (
    MODEL_CONFIGS,
    Driver,
    hf_generate_timer,
    make_engine,
    random_prompts,
    sync,
    write_config_dir,
    write_result,
)


def prompt_digest(prompts: list[list[int]]) -> str:
    """A short digest of the prompts' token ids (the caller checks that this process ran its prompts)."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="qwen2.5-7b", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--blas", default="default", choices=["default", "cublaslt", "cublas"])
    p.add_argument("--after-kvserve", action="store_true")
    p.add_argument("--num", type=int, default=50)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed generate runs of --output-len tokens")
    p.add_argument("--reserve-gb", type=float, default=0.0,
                   help="allocate and free this much GPU memory first (kept in torch's cache, not returned)")
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the model is built")
    p.add_argument("--prompts", type=Path, default=None, help="a JSON list of token-id lists to run instead")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    device = args.device
    model_dir = write_config_dir(args.model, remove_at_exit=True)
    vocab = MODEL_CONFIGS[args.model]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    blas_before = torch.backends.cuda.preferred_blas_library() if device.startswith("cuda") else None
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    kvserve_tok_s = None
    if args.after_kvserve:
        core, _ = make_engine(model_dir, device, dtype="bfloat16", max_model_len=32768, max_num_seqs=256,
                              max_num_batched_tokens=8192, gpu_memory_utilization=0.9)
        d = Driver(core)
        d.run(random_prompts(gen, [args.input_len] * args.num, vocab), [4] * args.num)
        kvserve_tok_s = d.run(random_prompts(gen, [args.input_len] * args.num, vocab),
                              [args.output_len] * args.num).output_tok_s
        del d, core
        gc.unfreeze()  # make_engine froze the engine's start-up heap; frozen cycles are never collected
        gc.collect()
        torch.cuda.empty_cache()
    if args.reserve_gb:
        block = torch.empty(int(args.reserve_gb * 2**30), dtype=torch.uint8, device=device)
        del block
    config = AutoConfig.from_pretrained(model_dir)
    sync(device)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    sync(device)
    init_s = time.perf_counter() - t0
    prompts = json.loads(args.prompts.read_text()) if args.prompts else \
        random_prompts(gen, [args.input_len] * args.num, vocab)
    ids = torch.tensor(prompts, device=device)
    num = ids.shape[0]

    generate = hf_generate_timer(model, ids, device)

    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    generate(4)
    t_prefill = generate(1)
    runs = [generate(args.output_len) for _ in range(args.repeats)]
    elapsed = runs[-1]
    tok_s = num * args.output_len / elapsed
    step_ms = (elapsed - t_prefill) / max(1, args.output_len - 1) * 1e3
    result = {"blas_at_start": blas_before, "blas": torch.backends.cuda.preferred_blas_library().name
              if device.startswith("cuda") else None, "after_kvserve": args.after_kvserve,
              "kvserve_tok_s": kvserve_tok_s, "elapsed_s": elapsed, "output_tok_s": tok_s, "init_s": init_s,
              "num_seqs": num, "input_len": ids.shape[1], "prompt_digest": prompt_digest(prompts),
              "prefill_s": t_prefill, "decode_step_ms": step_ms, "runs_s": runs,
              "reserved_gb_after": torch.cuda.memory_reserved() / 2**30 if device.startswith("cuda") else None,
              "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    print(f"HF generate: {tok_s:.0f} output tok/s ({elapsed:.2f} s; prefill + 1 token {t_prefill * 1e3:.0f} ms, "
          f"decode step {step_ms:.1f} ms); blas {result['blas']} (at start {blas_before}); attention "
          f"{result['attn_implementation']}; after kvserve: {args.after_kvserve} (kvserve {kvserve_tok_s}); runs (s) "
          f"{' '.join(f'{r:.2f}' for r in runs)}; reserve {args.reserve_gb} GB, gc freeze {args.gc_freeze}",
          flush=True)
    if args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(args.profile_steps)
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if hasattr(
            prof.key_averages()[0], "self_cuda_time_total") else "self_device_time_total", row_limit=15)
        print(table, flush=True)
        result["profile_table"] = table
        # GPU busy time: the device-side rows (kernels, copies; an op's row repeats its kernels' time), against
        # an unprofiled generate of the same length. Far below the wall time means HF is bound by the host's
        # Python and launches, so its speed follows the host CPU. "Command Buffer Full" (the host waiting for
        # room in the launch queue: the GPU is behind) is reported apart.
        from torch.autograd import DeviceType

        def device_us(e: object) -> float:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

        averages = prof.key_averages()
        # "Command Buffer Full" is a host-side row: its own CPU time is the host's wait.
        queue_full_s = sum(e.self_cpu_time_total for e in averages if e.key == "Command Buffer Full") / 1e6
        busy_s = sum(device_us(e) for e in averages
                      if e.device_type == DeviceType.CUDA and e.key != "Command Buffer Full") / 1e6
        wall_s = generate(args.profile_steps)
        result |= {"profile_gpu_busy_s": busy_s, "profile_queue_full_s": queue_full_s,
                   "profile_steps_wall_s": wall_s}
        print(f"HF generate of {args.profile_steps} tokens: GPU busy {busy_s * 1e3:.1f} ms of {wall_s * 1e3:.1f} ms "
              f"wall unprofiled ({busy_s / wall_s:.0%}); host waited on a full launch queue "
              f"{queue_full_s * 1e3:.1f} ms (profiled)", flush=True)
    write_result(args.out, "hf_probe", vars(args) | {"out": str(args.out)}, result, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
