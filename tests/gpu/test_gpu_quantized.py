"""Quantized (AWQ / GPTQ) checkpoints on the GPU (skipped without CUDA).

The GPU keeps the packed weights and multiplies with the Triton quantized matmul (and, for large steps, the
dequantized weight with cuBLAS); the CPU dequantizes at load. Both must compute the same model:

* float32: greedy tokens on the GPU (CUDA graphs, prompts long enough that prefill chunks take the dense
  path and decode the fused kernel) equal the CPU's, and the logprobs agree;
* bfloat16: CUDA graphs agree with eager (logprobs close, greedy tokens parting only at near ties);
* float32, every step through the fused kernel (the dense path's threshold out of reach) equals the default
  split;
* bfloat16 with 4-bit weights in 128-row groups (the paired-dequantizing kernel, kernels/triton_quant.py):
  top-k logprobs against HF Transformers float32 on the dequantized weights, within twice HF bfloat16's own
  error (as the dense models' test in test_gpu_engine.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.engine_runs import greedy_with_logprobs

from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore
from kvserve.kernels import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 1024
CASES = {
    "awq4-qwen2": ("qwen2", {"method": "awq", "bits": 4, "group_size": 128}),
    "gptq4-llama-actorder": ("llama", {"method": "gptq", "bits": 4, "group_size": 64, "act_order": True}),
    "gptq8-qwen3": ("qwen3", {"method": "gptq", "bits": 8, "group_size": 128}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from helpers.quantized import quantize_checkpoint
    from helpers.tiny_models import make_bare_checkpoint

    out = {}
    for i, (name, (model_type, kwargs)) in enumerate(CASES.items()):
        root = tmp_path_factory.mktemp(name)
        overrides: dict[str, Any] = {"head_dim": 128} if model_type == "qwen3" else {}
        dense = make_bare_checkpoint(str(root / "dense"), model_type, seed=i, vocab_size=VOCAB, **overrides)
        quantize_checkpoint(dense, str(root / "quantized"), str(root / "dequantized"), **kwargs)
        out[name] = str(root / "quantized")
    return out


def _dequantized(path: str) -> str:
    """The checkpoint of the dense weights a quantized test checkpoint stands for (helpers.quantized)."""
    return path.removesuffix("quantized") + "dequantized"


def _prompts(num: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 400, (num,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _generate(core: EngineCore, prompts: list[list[int]], max_tokens: int,
              logprobs: int = 2) -> list[tuple[list[int], list[Any]]]:
    return greedy_with_logprobs(core, prompts, max_tokens, logprobs=logprobs)


def _core(path: str, device: str, dtype: str, enforce_eager: bool = False) -> EngineCore:
    args = EngineArgs(model=path, dtype=dtype, device=device, enforce_eager=enforce_eager, max_model_len=1024,
                      num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=512)
    return EngineCore(args.create_engine_config())


@pytest.mark.parametrize("case", list(CASES))
def test_float32_gpu_matches_cpu(checkpoints: dict[str, str], case: str) -> None:
    prompts = _prompts(6, seed=3)
    gpu_core = _core(checkpoints[case], "cuda", "float32")
    layer = gpu_core.runner.model.model.layers[0]
    assert layer.mlp.gate_up_proj.packed is not None and layer.mlp.gate_up_proj.weight is None
    gpu = _generate(gpu_core, prompts, 16)
    del gpu_core
    cpu = _generate(_core(checkpoints[case], "cpu", "float32"), prompts, 16)
    for (gt, gl), (ct, cl) in zip(gpu, cpu, strict=True):
        assert gt == ct
        assert len(gl) == len(cl) == len(gt)
        for a, b in zip(gl, cl, strict=True):  # TokenLogprobs: the sampled token, then the top 2
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=2e-3)


# bf16 logprobs of CUDA graphs and eager steps agree within this, and their greedy tokens part only where the
# top two are closer than it: bf16's own error on these models is about 0.03 (HF bfloat16 against float32
# in test_bf16_paired_kernel_logprobs_agree_with_hf), and two bf16 computations may sit on either side.
GRAPH_LOGPROB_TOL = 0.08


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_graphs_match_eager(checkpoints: dict[str, str], case: str) -> None:
    """CUDA graphs (decode graphs, piecewise graphs padding steps to 64 / 128 / ... tokens) against eager steps
    in bfloat16. Not bitwise: a decode graph's attention splits the context as its capture's max_model_len
    asks, an eager step as the batch's own longest context does (ops.decode_num_splits), and cuBLAS may round
    a 310-row step and its 320-row padding differently (session 35: logprobs first apart at an 8-row decode
    step that no padding touched, tokens parting at near ties). So: logprobs within GRAPH_LOGPROB_TOL while
    the tokens agree, a request's tokens parting only at a near tie of eager's top two, most tokens compared."""
    prompts = _prompts(8, seed=5)
    graphs = _generate(_core(checkpoints[case], "cuda", "bfloat16"), prompts, 20)
    eager = _generate(_core(checkpoints[case], "cuda", "bfloat16", enforce_eager=True), prompts, 20)
    compared, worst, ties = 0, 0.0, []
    for (g_tokens, g_lps), (e_tokens, e_lps) in zip(graphs, eager, strict=True):
        assert len(g_tokens) == len(e_tokens) == 20
        for g_token, e_token, g, e in zip(g_tokens, e_tokens, g_lps, e_lps, strict=True):
            if g_token != e_token:  # must be eager's runner-up, a near tie
                assert g_token == e.token_ids[2], (e, g)
                ties.append(e.logprobs[1] - e.logprobs[2])
                break
            compared += 1
            worst = max(worst, *(abs(a - b) for a, b in zip(g.logprobs, e.logprobs, strict=True)))
    print(f"{case}: {compared} of 160 tokens compared, logprobs at most {worst:.4f} apart; ties {ties}")
    assert worst <= GRAPH_LOGPROB_TOL
    assert all(gap <= GRAPH_LOGPROB_TOL for gap in ties)
    assert compared >= 120


def test_fused_path_alone_matches_the_default_split(checkpoints: dict[str, str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step through the fused kernel (the dense path's threshold out of reach) against the default
    split, in float32: the same greedy tokens."""
    prompts = _prompts(8, seed=7)
    path = checkpoints["awq4-qwen2"]
    default = [t for t, _ in _generate(_core(path, "cuda", "float32", enforce_eager=True), prompts, 20)]
    monkeypatch.setattr(ops, "QUANT_DENSE_MIN_ROWS", 1 << 30)
    fused_only = [t for t, _ in _generate(_core(path, "cuda", "float32", enforce_eager=True), prompts, 20)]
    assert fused_only == default


def test_groups_no_kernel_tile_fits_are_kept_dense(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Groups of 16 rows fit no tile of the quantized matmul: the layers dequantize once at load (not at every
    step) and compute what the CPU computes."""
    from helpers.quantized import quantize_checkpoint
    from helpers.tiny_models import make_bare_checkpoint

    root = tmp_path_factory.mktemp("gptq4-g16")
    dense = make_bare_checkpoint(str(root / "dense"), "llama", seed=11, vocab_size=VOCAB)
    quantize_checkpoint(dense, str(root / "quantized"), str(root / "dequantized"), method="gptq", bits=4,
                        group_size=16)
    path = str(root / "quantized")
    prompts = _prompts(4, seed=11)
    gpu_core = _core(path, "cuda", "float32")
    proj = gpu_core.runner.model.model.layers[0].mlp.gate_up_proj
    assert proj.packed is None and proj.weight is not None and proj.weight.is_cuda
    gpu = [t for t, _ in _generate(gpu_core, prompts, 12)]
    del gpu_core
    assert gpu == [t for t, _ in _generate(_core(path, "cpu", "float32"), prompts, 12)]


def test_bf16_paired_kernel_logprobs_agree_with_hf(checkpoints: dict[str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """AWQ 4-bit, groups of 128, bfloat16 with CUDA graphs: decode runs the paired-dequantizing kernel
    (asserted), prefill chunks the dense path. Teacher-forced against HF float32 on the dequantized weights:
    kvserve's top-k logprobs within 2 x HF bfloat16's error + 0.02, top-1 agreement >= 90 %."""
    from transformers import AutoModelForCausalLM

    from kvserve.kernels import triton_quant

    rows = []
    launch = triton_quant.quant_matmul_pairs
    monkeypatch.setattr(triton_quant, "quant_matmul_pairs", lambda x, *a, **kw: rows.append(x.shape[0]) or
                        launch(x, *a, **kw))
    path = checkpoints["awq4-qwen2"]
    core = _core(path, "cuda", "bfloat16")
    packed = core.runner.model.model.layers[0].mlp.gate_up_proj.packed
    assert packed is not None and packed.zero_scale is not None and packed.tile_rows == 128
    assert rows, "the decode graphs captured no paired-kernel launch"
    k = 5
    prompts = _prompts(6, seed=13)
    outs = _generate(core, prompts, 16, logprobs=k)
    dequantized = _dequantized(path)
    hf32 = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.bfloat16).cuda().eval()
    kv_err, hf_err, top1_agree, total = 0.0, 0.0, 0, 0
    for prompt, (tokens, lps) in zip(prompts, outs, strict=True):
        assert len(lps) == len(tokens) == 16
        ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
        with torch.inference_mode():
            ref = torch.log_softmax(hf32(ids).logits[0, len(prompt) - 1:].float(), dim=-1)
            hf = torch.log_softmax(hf16(ids).logits[0, len(prompt) - 1:].float(), dim=-1)
        for step, token_lp in enumerate(lps):
            top = torch.tensor(token_lp.token_ids[1:], device="cuda")
            kv_err = max(kv_err, float((torch.tensor(token_lp.logprobs[1:], device="cuda") - ref[step, top]).abs().max()))
            ref_top = ref[step].topk(k).indices
            hf_err = max(hf_err, float((hf[step, ref_top] - ref[step, ref_top]).abs().max()))
            top1_agree += int(token_lp.token_ids[1] == int(ref_top[0]))
            total += 1
    print(f"AWQ bf16: max |logprob - fp32| kvserve {kv_err:.4f}, HF bf16 {hf_err:.4f}; top-1 {top1_agree}/{total}")
    assert kv_err <= 2 * hf_err + 0.02
    assert top1_agree >= 0.9 * total
