"""Offline throughput: kvserve `LLM.generate` vs HF Transformers `generate` on the same prompts, same run.

Both generate exactly --max-tokens tokens per prompt (EOS ignored), greedy. HF runs one static batch per
--hf-batch-size prompts (left padding), as a web handler batching requests would. Prints output tok/s of
both and the ratio; writes JSON with --json.

    python benchmarks/offline_throughput.py                       # default model, 32 prompts, 128 tokens
    python benchmarks/offline_throughput.py --model /models/x --num-prompts 64 --device cuda
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import time

import torch

SENTENCES = [
    "Explain how a paged KV cache avoids memory fragmentation in LLM serving.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP? Give examples of when to use each.",
    "Summarize the causes of the French Revolution in a few sentences.",
    "请解释一下什么是连续批处理，以及它为什么能提高推理吞吐量。",
    "用三句话介绍一下长城的历史。",
    "Translate into French: The weather is lovely today and we are going to the beach.",
    "List five tips for writing clean, maintainable Python code.",
    "Describe the water cycle to a ten-year-old.",
    "如何在生产环境中监控大模型推理服务的延迟和吞吐量？",
    "Give a recipe for a simple tomato pasta sauce.",
    "Why is the sky blue? Answer with the physics involved.",
]


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        k = rng.randint(1, 3)
        prompts.append(f"Question {i}: " + " ".join(rng.choice(SENTENCES) for _ in range(k)))
    return prompts


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def run_kvserve(args: argparse.Namespace, prompts: list[str]) -> dict[str, float]:
    from kvserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
    init_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    num_in = sum(len(o.prompt_token_ids) for o in outs)
    return {"init_s": init_s, "elapsed_s": elapsed, "output_tokens": num_out, "prompt_tokens": num_in,
            "output_tok_s": num_out / elapsed}


def run_hf(args: argparse.Namespace, prompts: list[str]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.model.paths import resolve_model_path

    path = resolve_model_path(args.model)
    kwargs: dict[str, object] = {}
    if path.endswith(".gguf"):
        directory, name = os.path.split(path)
        kwargs["gguf_file"] = name
    else:
        directory = path
    dtype = {"auto": torch.float32 if args.device == "cpu" else torch.bfloat16, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    tok = AutoTokenizer.from_pretrained(directory, **kwargs)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs).to(args.device).eval()
    batch = args.hf_batch_size or len(prompts)

    def gen(chunk: list[str], max_new: int) -> int:
        enc = tok(chunk, return_tensors="pt", padding=True).to(args.device)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        return int((out.shape[1] - enc["input_ids"].shape[1]) * len(chunk))

    gen(prompts[:2], 4)  # warm-up
    if args.device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    num_out = 0
    for i in range(0, len(prompts), batch):
        num_out += gen(prompts[i : i + batch], args.max_tokens)
    if args.device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_s": num_out / elapsed,
            "batch_size": batch}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hf-batch-size", type=int, default=0, help="HF static batch size (0 = all prompts)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tqdm", action="store_true")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args()

    prompts = make_prompts(args.num_prompts, args.seed)
    result: dict[str, object] = {
        "benchmark": "offline_throughput",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if args.device != "cpu" else platform.processor() or "cpu",
        "torch_threads": torch.get_num_threads(),
        "settings": vars(args),
    }
    kv = run_kvserve(args, prompts)
    result["kvserve"] = kv
    if not args.skip_hf:
        hf = run_hf(args, prompts)
        result["hf"] = hf
        result["ratio"] = kv["output_tok_s"] / hf["output_tok_s"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"\n{'engine':<10} {'output tok/s':>14} {'elapsed s':>10} {'output tokens':>14}")
    print(f"{'kvserve':<10} {kv['output_tok_s']:>14.1f} {kv['elapsed_s']:>10.2f} {kv['output_tokens']:>14}")
    if "hf" in result:
        hf = result["hf"]
        assert isinstance(hf, dict)
        print(f"{'HF':<10} {hf['output_tok_s']:>14.1f} {hf['elapsed_s']:>10.2f} {hf['output_tokens']:>14}")
        print(f"ratio kvserve/HF: {result['ratio']:.2f}x")


if __name__ == "__main__":
    main()
