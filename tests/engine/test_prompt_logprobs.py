"""Prompt logprobs (`SamplingParams.prompt_logprobs`): against HF Transformers in float32, and against
themselves under chunked prefill, async scheduling, preemption, prefix caching and n>1."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.protocol.outputs import Logprob, RequestOutput
from kvserve.protocol.sampling_params import SamplingParamsError

K = 3
# The engines' KV pool: 256 blocks of 16 hold every test's requests here at once (the preemption test sizes its
# own). The tiny model's default pool, 131072 blocks, makes the invariant check after every step slow (~0.25 s).
POOL_BLOCKS = 256
PROMPTS: list = [
    "Hi",
    "A longer prompt that spans more than one block of sixteen tokens, so that block tables matter here.",
    "中文提示词也要一样。",
    list(range(1000, 1060)),
    [7],  # one token: nothing to report but the None of the first position
]


def _run(llm: LLM, prompts: list = PROMPTS, k: int = K, **params: object) -> list[RequestOutput]:
    llm.engine.core.check_invariants_every_step = True
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=k, **params)
        return llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.engine.core.check_invariants_every_step = False


def _table(out: RequestOutput) -> list[list[tuple[int, float, int]] | None]:
    """Per prompt position: (token id, logprob, rank) of every entry, in the dict's order."""
    assert out.prompt_logprobs is not None
    return [None if d is None else [(t, lp.logprob, lp.rank) for t, lp in d.items()] for d in out.prompt_logprobs]


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_model_dir: Callable[..., str]) -> str:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="module")
def reference(tiny_qwen2: str) -> list[RequestOutput]:
    return _run(LLM(tiny_qwen2, max_model_len=256, block_size=16, num_kv_blocks=POOL_BLOCKS))


def test_prompt_logprobs_match_hf(tiny_qwen2: str, reference: list[RequestOutput]) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation="eager").eval()
    for out in reference:
        ids = out.prompt_token_ids
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        assert out.prompt_logprobs[0] is None
        with torch.inference_mode():
            expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            assert entry is not None
            row = expected[pos - 1]
            token = ids[pos]
            # The prompt token first, with its rank; then the top K with ranks 1..K.
            first_id, first = next(iter(entry.items()))
            assert first_id == token
            assert first.logprob == pytest.approx(row[token].item(), abs=1e-4)
            # Its rank, up to tokens within rounding of its logprob (a random model's tail is flat).
            value = row[token].item()
            assert int((row > value + 1e-4).sum()) + 1 <= first.rank <= int((row > value - 1e-4).sum()) + 1
            top = row.topk(K)
            for rank, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
                assert tid in entry, f"position {pos}: top-{rank} token {tid} missing"
                assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
                if tid != token:
                    assert entry[tid].rank == rank
            assert len(entry) in (K, K + 1)  # K + 1 unless the prompt token is among the top K
            assert all(isinstance(lp, Logprob) and lp.decoded_token is not None for lp in entry.values())


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 16},  # prompts prefilled over several steps, mixed with decodes
        {"max_num_batched_tokens": 16, "async_scheduling": True},
        {"enforce_eager": True, "enable_prefix_caching": False},
    ],
    ids=["chunked", "chunked-async", "no-prefix-cache"],
)
def test_prompt_logprobs_unchanged_by_engine_settings(
    tiny_qwen2: str, reference: list[RequestOutput], settings: dict
) -> None:
    llm = LLM(tiny_qwen2, max_model_len=256, block_size=16, num_kv_blocks=POOL_BLOCKS, **settings)
    _assert_same(_run(llm), reference)


def _assert_same(outs: list[RequestOutput], reference: list[RequestOutput]) -> None:
    for out, ref in zip(outs, reference, strict=True):
        _assert_same_table(out, ref)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def _assert_same_table(out: RequestOutput, ref: RequestOutput) -> None:
    for got, want in zip(_table(out), _table(ref), strict=True):
        if want is None:
            assert got is None
            continue
        assert got is not None and [t for t, _, _ in got] == [t for t, _, _ in want]
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
        # A prompt token deep in a random model's flat tail may swap places with a near-equal one.
        assert all(abs(g - w) <= (0 if w <= 20 else 2) for (_, _, g), (_, _, w) in zip(got, want, strict=True))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_unchanged_by_preemption_within_a_prompt(tiny_qwen2: str, async_scheduling: bool) -> None:
    """Three 60-token prompts prefilled 16 tokens a step in a pool of 6 blocks of 16: the second is
    preempted while its prompt is half done and recomputed; no prompt position is lost or repeated."""
    prompts = [list(range(start, start + 60)) for start in (1000, 2000, 3000)]
    want = _run(LLM(tiny_qwen2, max_model_len=256, block_size=16, num_kv_blocks=POOL_BLOCKS), prompts)
    llm = LLM(tiny_qwen2, max_model_len=96, block_size=16, num_kv_blocks=6, max_num_batched_tokens=16,
              async_scheduling=async_scheduling)
    _assert_same(_run(llm, prompts), want)
    stats = llm.engine.last_stats
    assert stats is not None and stats.num_preemptions > 0, "the pool was meant to force preemption"


def test_prompt_logprobs_skip_prefix_cache_hits(tiny_qwen2: str, reference: list[RequestOutput]) -> None:
    """A request with prompt_logprobs takes no prefix-cache hit (it needs every position's logits) and gets
    all its prompt's logprobs; its blocks still serve later requests without them."""
    llm = LLM(tiny_qwen2, max_model_len=256, block_size=16, num_kv_blocks=POOL_BLOCKS)
    prompt = PROMPTS[3]
    first = _run(llm, [prompt])[0]
    again = _run(llm, [prompt])[0]
    assert again.num_cached_tokens == 0
    _assert_same_table(again, first)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == first.outputs[0].token_ids == reference[3].outputs[0].token_ids


def test_prompt_logprobs_with_n_and_k0(tiny_qwen2: str, reference: list[RequestOutput]) -> None:
    llm = LLM(tiny_qwen2, max_model_len=256, block_size=16, num_kv_blocks=POOL_BLOCKS)
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=4, n=3, prompt_logprobs=K)
    out = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    _assert_same_table(out, reference[1])
    # k=0: the prompt token alone at each position.
    zero = _run(llm, [PROMPTS[1]], k=0)[0]
    for row, want in zip(_table(zero)[1:], _table(reference[1])[1:], strict=True):
        assert row is not None and want is not None
        assert len(row) == 1 and row[0][0] == want[0][0] and row[0][1] == pytest.approx(want[0][1], abs=1e-4)
    plain = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 2.5])
def test_prompt_logprobs_out_of_range_refused(value: object) -> None:
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_runner_prompt_logprob_set_is_checked(tiny_qwen2: str) -> None:
    llm = LLM(tiny_qwen2, max_model_len=256, block_size=16, num_kv_blocks=POOL_BLOCKS)
    _run(llm, [PROMPTS[1]])
    runner = llm.engine.core.runner
    runner._prompt_logprob_req_ids.add("finished-long-ago")
    with pytest.raises(AssertionError, match="prompt-logprob requests"):
        runner.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prompt_only_request_ends_with_no_token(tiny_qwen2: str, reference: list[RequestOutput],
                                                  async_scheduling: bool) -> None:
    """`EngineCoreRequest.prompt_only` (a completion's echo with max_tokens 0): the prompt runs, its
    prompt_logprobs come out as a normal request's, and the request ends with no token and "length"; beside
    it a plain request keeps its tokens. Without prompt_logprobs the same, less the logprobs."""
    llm = LLM(tiny_qwen2, max_model_len=256, block_size=16, num_kv_blocks=POOL_BLOCKS,
              async_scheduling=async_scheduling, enable_prefix_caching=False)
    engine, core = llm.engine, llm.engine.core
    core.check_invariants_every_step = True
    ids = reference[1].prompt_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    make = engine.input_processor.make_engine_request
    core.add_request(make("scored", ids, params, prompt_only=True))
    core.add_request(make("bare", ids, SamplingParams(temperature=0.0, max_tokens=4), prompt_only=True))
    core.add_request(make("plain", ids, params))
    outputs: dict[str, list] = {}
    for _ in range(50):
        for out in core.step().outputs:
            outputs.setdefault(out.req_id, []).append(out)
        if not core.has_unfinished_requests():
            break
    for req_id in ("scored", "bare"):
        (only,) = outputs[req_id]
        assert only.new_token_ids == [] and only.new_logprobs is None and only.finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outputs["plain"]) == 4
    assert outputs["bare"][0].prompt_logprobs is None
    scored, plain = outputs["scored"][0].prompt_logprobs, outputs["plain"][0].prompt_logprobs
    assert scored is not None and len(scored) == len(ids) - 1
    assert [e.token_ids for e in scored] == [e.token_ids for e in plain]  # type: ignore[union-attr]
    for got, want in zip(scored, plain, strict=True):  # type: ignore[arg-type]
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert not core._prompt_only and not core.scheduler.requests
