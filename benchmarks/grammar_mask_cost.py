"""Host cost of structured output a step: N requests under a JSON schema, each walking its grammar by a random
allowed token a step. Times, per step, the engine core's mask rows for all N (`StructuredOutputs.bitmasks`:
llguidance's threads for N > 1), the matchers' advance (`accept`), and the sampler's masking of N rows of the
model's vocabulary (`apply_grammar_masks_`, on the chosen device; on CUDA until the masked logits are ready).
A request whose grammar ends starts over with a fresh compile (not timed). Prints a table of medians in
milliseconds and writes JSON (machine, commit, date, settings).

  python benchmarks/grammar_mask_cost.py --requests 1 8 64 --steps 100 [--tokenizer DIR_OR_GGUF] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.layers.sampler import apply_grammar_masks_  # noqa: E402
from kvserve.model.paths import default_model_path  # noqa: E402
from kvserve.model.tokenizer import load_tokenizer  # noqa: E402
from kvserve.protocol.sampling_params import StructuredOutputsParams  # noqa: E402
from kvserve.structured_output import GrammarCompiler, StructuredOutputs, grammar_for  # noqa: E402

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "price", "address"],
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "price": {"type": "number"}, "in_stock": {"type": "boolean"},
        "address": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "pattern": "[0-9]{5}"}}},
    },
}


def allowed_tokens(mask: bytes) -> list[int]:
    words = torch.frombuffer(bytearray(mask), dtype=torch.uint8)
    bits = ((words.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()
    return bits.nonzero().flatten().tolist()


def run(num: int, args: argparse.Namespace, compiler: GrammarCompiler, grammar: str, vocab: int,
        device: torch.device) -> dict[str, float]:
    rng = random.Random(num)
    outputs = StructuredOutputs(compiler)
    req_ids = [f"r{i}" for i in range(num)]
    for req_id in req_ids:
        outputs.add(req_id, compiler.compile(grammar))
    logits = torch.randn(num, vocab, device=device)
    eos = compiler.eos_token_ids
    times: dict[str, list[float]] = {"masks": [], "accept": [], "apply": []}
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        masks = outputs.bitmasks(req_ids)
        mask_s = time.perf_counter() - start
        rows = [i for i, r in enumerate(req_ids) if r in masks]
        work = logits.clone()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        apply_grammar_masks_(work, rows, [masks[req_ids[i]] for i in rows])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        apply_s = time.perf_counter() - start
        chosen = {}
        for req_id in req_ids:
            choices = [t for t in allowed_tokens(masks[req_id])] if req_id in masks else []
            text = [t for t in choices if t not in eos]  # walk on while the text can go on
            chosen[req_id] = rng.choice(text) if text else None
        start = time.perf_counter()
        for req_id, token in chosen.items():
            if token is not None:
                outputs.accept(req_id, [token])
        accept_s = time.perf_counter() - start
        for req_id, token in chosen.items():
            if token is None or outputs.ended(req_id):  # the object is complete: a new request in its place
                outputs.release([req_id])
                outputs.add(req_id, compiler.compile(grammar))
        if step >= args.warmup:
            times["masks"].append(mask_s)
            times["apply"].append(apply_s)
            times["accept"].append(accept_s)
    assert outputs.num_refused_tokens == 0
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tokenizer", default=None, help="HF directory or .gguf (default: the default model's)")
    parser.add_argument("--vocab", type=int, default=None, help="logits' width (default: the tokenizer's size)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    device = torch.device(args.device)
    path = args.tokenizer or default_model_path()
    start = time.perf_counter()
    tokenizer = load_tokenizer(path)
    load_s = time.perf_counter() - start
    vocab = args.vocab or len(tokenizer)
    compiler = GrammarCompiler(lambda: tokenizer, vocab, [tokenizer.eos_token_id])
    grammar = grammar_for(StructuredOutputsParams(json=SCHEMA))
    start = time.perf_counter()
    compiler.tokenizer()
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(grammar)
    compile_s = time.perf_counter() - start
    results = [{"requests": n, **run(n, args, compiler, grammar, vocab, device)} for n in args.requests]
    compiler.shutdown()
    print(f"tokenizer {path}: {len(tokenizer)} tokens, logits width {vocab}; HF load {load_s:.2f} s, "
          f"grammar engine's tokenizer {build_s:.2f} s, first compile {1e3 * compile_s:.1f} ms")
    print(f"medians over {args.steps} steps, ms a step ({args.device}):")
    print(f"{'requests':>9} {'masks':>8} {'accept':>8} {'apply':>8}")
    for r in results:
        print(f"{r['requests']:>9} {r['masks']:>8.3f} {r['accept']:>8.3f} {r['apply']:>8.3f}")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        Path(args.out).write_text(json.dumps({
            "machine": platform.node(), "cpu": platform.processor(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "settings": {**vars(args), "tokenizer": str(path), "vocab": vocab},
            "setup_s": {"hf_load": load_s, "llguidance_tokenizer": build_s, "first_compile": compile_s},
            "results": results,
        }, indent=2))


if __name__ == "__main__":
    main()
