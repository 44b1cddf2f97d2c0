"""kvserve vs HF Transformers: greedy tokens identical in float32.

Every prompt runs through kvserve in one mixed batch (different prompt lengths, prefill and decode of
different requests in the same steps) and through HF one prompt at a time (no padding). Both suppress EOS
for the first `max_tokens` tokens (kvserve `min_tokens`, HF `min_new_tokens`) so the full length is compared.
The tiny checkpoints' HF side runs `generate`; the default model's is teacher-forced (`_hf_greedy_agrees`):
one forward over the prompt and kvserve's tokens, whose every next-token argmax must be kvserve's token,
which holds exactly when HF's greedy decoding gives those tokens, in one forward of the 135M model instead of
one per token.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserve import LLM, SamplingParams
from kvserve.model.arch import load_arch_config

NUM_NEW_TOKENS = 32

DEFAULT_MODEL_PROMPTS = [
    "Hello, my name is",
    "The three most important inventions of the twentieth century were",
    "请用一句话介绍一下北京。",
    "今天天气很好，我们一起去",
]


def _hf_greedy(model: torch.nn.Module, prompt_ids: list[int], num_new: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def _hf_greedy_agrees(model: torch.nn.Module, prompt_ids: list[int], token_ids: list[int]) -> list[int]:
    """HF's greedy choices along `prompt_ids` + `token_ids` (teacher-forced, one forward, EOS suppressed as
    `min_new_tokens` does): the token HF picks after the prompt and after each of `token_ids[:i]`. Equal to
    `token_ids` exactly when HF greedy generation from the prompt gives `token_ids` (by induction over i)."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.inference_mode():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt_ids) - 1 : -1].clone()
        logits[:, model.generation_config.eos_token_id] = float("-inf")
    return logits.argmax(dim=-1).tolist()


def _kvserve_greedy(llm: LLM, prompts: list, num_new: int) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=num_new, min_tokens=num_new)
    return llm.generate(prompts, params, use_tqdm=False)


def test_default_gguf_model_matches_hf(default_llm: LLM, hf_gguf_model: torch.nn.Module) -> None:
    chat = default_llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "解释PagedAttention的工作原理"}], tokenize=False, add_generation_prompt=True
    )
    prompts = DEFAULT_MODEL_PROMPTS + [chat]
    outs = _kvserve_greedy(default_llm, prompts, NUM_NEW_TOKENS)
    for out in outs:
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == NUM_NEW_TOKENS
        assert tokens == _hf_greedy_agrees(hf_gguf_model, list(out.prompt_token_ids), tokens), f"prompt {out.prompt!r}"


@pytest.mark.parametrize("arch", ["llama", "llama3", "llama-tied", "qwen2", "qwen3"])
def test_tiny_checkpoints_match_hf(arch: str, tiny_model_dir) -> None:
    path = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, max_model_len=256, block_size=16)
    prompts = [
        "Hi",
        "A longer prompt that spans more than one block of sixteen tokens, so that block tables matter here.",
        "中文提示词也要一样。",
        list(range(1000, 1040)),
    ]
    outs = _kvserve_greedy(llm, prompts, 20)
    for out in outs:
        expected = _hf_greedy(hf, out.prompt_token_ids, 20)
        assert out.outputs[0].token_ids == expected, f"{arch}: prompt {out.prompt!r}"
    assert outs[0].prompt_token_ids == tok("Hi")["input_ids"]


def test_qwen2_config_without_num_key_value_heads_reads_as_hf(tmp_path, tiny_model_dir) -> None:
    """A Qwen2 config.json without num_key_value_heads: Qwen2Config defaults it to 32 (not num_attention_heads, as
    LlamaConfig does), and kvserve read it as num_attention_heads (64 here), so the checkpoint's K/V projections of
    32 heads did not load. 64 heads of head_dim 8 keep the checkpoint tiny."""
    source = tiny_model_dir("qwen2", num_attention_heads=64, num_key_value_heads=32, head_dim=8)
    path = shutil.copytree(source, tmp_path / "no-kv-heads")
    config = json.loads((path / "config.json").read_text())
    del config["num_key_value_heads"]
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.config.num_key_value_heads == 32
    assert load_arch_config(str(path)).num_key_value_heads == 32
    llm = LLM(str(path), max_model_len=64, block_size=16)
    outs = _kvserve_greedy(llm, ["Hi", list(range(1000, 1020))], 8)
    for out in outs:
        assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids, 8), f"prompt {out.prompt!r}"


@pytest.mark.parametrize("arch", ["qwen2-yarn", "llama-yarn", "qwen3-yarn"])
def test_yarn_checkpoints_match_hf_past_the_original_length(arch: str, tiny_model_dir) -> None:
    """YaRN rope scaling (original_max_position_embeddings 64, factor 4): greedy tokens equal HF's, for prompts
    shorter than the pre-training length and longer than it (up to the 256 positions YaRN extends it to, which
    is max_model_len's default for the Qwen2 variant whose max_position_embeddings is 64, as Qwen2.5's is
    32768)."""
    path = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    llm = LLM(path, block_size=16)
    assert llm.config.model_config.max_model_len == 256
    prompts = [
        "Hi",
        "A prompt of a few words.",
        list(range(1000, 1100)),  # 100 tokens: past the original 64 before the first generated one
        list(range(2000, 2210)),  # 210 tokens, generating up to position 229
    ]
    outs = _kvserve_greedy(llm, prompts, 20)
    for out in outs:
        expected = _hf_greedy(hf, out.prompt_token_ids, 20)
        assert out.outputs[0].token_ids == expected, f"{arch}: prompt {out.prompt!r}"


@pytest.mark.parametrize("arch", ["qwen2-yarn", "qwen3-yarn", "llama-yarn-explicit", "llama3"])
def test_scaled_rope_ggufs_match_hf_past_the_original_length(
    arch: str, tiny_model_dir, tiny_gguf_path
) -> None:
    """A GGUF file with RoPE scaling as llama.cpp's converter writes it (YaRN as `rope.scaling.*` metadata,
    with betas and an attention factor for "llama-yarn-explicit"; Llama 3.1's as the `rope_freqs` tensor)
    generates HF's greedy tokens from the safetensors checkpoint it was converted from, for prompts past the
    pre-training length of 64. With YaRN, max_model_len defaults to original_context_length x factor = 256
    as for the checkpoint (context_length is 64 for the Qwen2 and Llama variants, as Qwen2.5's is 32768)."""
    checkpoint, gguf_path = tiny_model_dir(arch), tiny_gguf_path(arch)
    from_gguf, from_hf = load_arch_config(gguf_path), load_arch_config(checkpoint)
    if arch == "llama3":
        assert from_gguf.rope_scaling is None and from_gguf.rope_freq_factors is not None
    else:
        assert from_gguf.rope_scaling["rope_type"] == "yarn"
        assert from_gguf.rope_scaling == from_hf.rope_scaling
    assert from_gguf.max_positions == from_hf.max_positions == 256
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    llm = LLM(gguf_path, block_size=16, tokenizer=checkpoint)
    assert llm.config.model_config.max_model_len == 256
    prompts = [
        "A prompt of a few words.",
        list(range(1000, 1100)),  # 100 tokens: past the original 64 before the first generated one
        list(range(2000, 2210)),  # 210 tokens, generating up to position 229
    ]
    outs = _kvserve_greedy(llm, prompts, 20)
    for out in outs:
        expected = _hf_greedy(hf, out.prompt_token_ids, 20)
        assert out.outputs[0].token_ids == expected, f"{arch} GGUF: prompt {out.prompt!r}"


def test_tiny_gguf_matches_its_safetensors_twin(tiny_model_dir, tiny_gguf_path) -> None:
    """The GGUF loader (names, Q/K un-permutation) gives the same model as the safetensors loader."""
    st = LLM(tiny_model_dir("llama"), max_model_len=128)
    gg = LLM(tiny_gguf_path("llama"), max_model_len=128, tokenizer=tiny_model_dir("llama"))
    prompts = ["Hello there", "The same tokens through two loaders"]
    a = [o.outputs[0].token_ids for o in _kvserve_greedy(st, prompts, 12)]
    b = [o.outputs[0].token_ids for o in _kvserve_greedy(gg, prompts, 12)]
    assert a == b
    assert os.path.getsize(tiny_gguf_path("llama")) > 0


def test_a_max_model_len_past_the_models_allowed_by_the_environment(tmp_path, monkeypatch, caplog) -> None:
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN (vLLM's switch; kvserve's name too): --max-model-len past the model's
    max_position_embeddings is refused without it, naming it; with it the RoPE table is built that long, so a
    prompt past the model's length gives HF's greedy tokens (HF computes RoPE at any position)."""
    from kvserve import envs
    from kvserve.config import ConfigError
    from tests.helpers.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "short"), "llama", seed=3, max_position_embeddings=64)
    with pytest.raises(ConfigError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        LLM(path, max_model_len=160)
    monkeypatch.setattr(envs, "KVSERVE_ALLOW_LONG_MAX_MODEL_LEN", True)
    llm = LLM(path, max_model_len=160, block_size=16)
    assert "outputs past 64 tokens may be wrong" in caplog.text
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompt_ids = [(7 * i + 11) % 1000 + 5 for i in range(100)]
    out = _kvserve_greedy(llm, [{"prompt_token_ids": prompt_ids}], 24)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, prompt_ids, 24)
