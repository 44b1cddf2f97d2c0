"""fp8 on a real model: online fp8 weights (`--quantization fp8`) and the fp8 KV cache (`--kv-cache-dtype fp8`)
keep SmolLM2-135M-Instruct (the default model as an HF checkpoint, float32, on the CPU) close to itself
unquantized, teacher-forced over text.

The measurement is benchmarks/fp8_accuracy.py's (`measure`) on the first two paragraphs of its text (198
tokens, prefilled in 64-token chunks), without its greedy runs (with fp8 weights the benchmark's greedy
answers part from the unquantized model's after 0 to 24 of 64 tokens: too early and too varied for a bound).
Measured here: fp8 weights perplexity x1.049, top-1 agreement 91.4 %, mean |logprob difference| of the text's
tokens 0.150 nats; fp8 KV cache x0.9996, 96.4 %, 0.063 (the benchmark's 538 tokens: x1.036, 90.1 %, 0.152 and
x1.004, 95.5 %, 0.066). The bounds leave 1.7-2x the measured change, and room for another machine's float32
rounding (with fp8 activations a last-bit difference can flip an activation's rounding: the same run
prefilled in one step instead of 128-token chunks gave perplexity x1.029 instead of x1.036 on the benchmark's
text). A wrong fp8 scale moves these by far more: with the weights' scales x1.5 (`Linear.quantize_fp8`) the
perplexity went x2256 (top-1 3 %), with the cache's keys read x1.5 (`reference.paged_attention`) x1.155 (top-1
76 %, mean difference 0.39 nats). About 30 s on 2 cores (the checkpoint's writing included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PARAGRAPHS = 2  # of the benchmark's text: 198 tokens

# setting -> (largest perplexity ratio, smallest top-1 agreement, largest mean |logprob difference|)
BOUNDS = {
    "fp8 weights": (1.10, 0.85, 0.25),
    "fp8 KV cache": (1.03, 0.92, 0.12),
}


@pytest.fixture(scope="module")
def results(default_gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    import torch
    from helpers.tiny_models import write_default_checkpoint

    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "benchmarks"))
        import fp8_accuracy

    model_dir = write_default_checkpoint(str(tmp_path_factory.mktemp("smollm2-hf")), torch.float32)
    text = "\n\n".join(fp8_accuracy.TEXT.split("\n\n")[:PARAGRAPHS])
    return fp8_accuracy.measure(model_dir, "float32", ["none", *BOUNDS], text=text, prompts=[], chunk=64,
                                max_model_len=512)


@pytest.mark.parametrize("setting", list(BOUNDS))
def test_fp8_keeps_the_default_model_close_to_itself(results: dict[str, dict[str, Any]], setting: str) -> None:
    max_ratio, min_top1, max_diff = BOUNDS[setting]
    r = results[setting]
    assert r["text_tokens"] == 198  # the text and the tokenizer the bounds were measured with
    assert 2 - max_ratio < r["perplexity_ratio"] < max_ratio, r
    assert r["top1_agreement"] >= min_top1, r
    assert 0.0 < r["logprob_diff_mean"] < max_diff, r  # (above 0: the setting really rounds)
