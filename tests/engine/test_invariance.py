"""kvserve against itself: settings that must not change greedy output.

Prefix caching on/off, block size 16/32, a small step budget (chunked prefill), a KV pool so small
that requests get preempted and recomputed, and async scheduling (pipelined steps) must all give the same
greedy tokens as the default engine; async scheduling must not change sampled output either.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model import llama

SYSTEM = (
    "You are a careful assistant. Answer briefly and precisely, and say when you are unsure. "
    "Use plain words. "
)
PROMPTS = [
    SYSTEM + "What is the capital of France?",
    SYSTEM + "Name three primary colours.",
    "Hello, my name is",
    SYSTEM + "What is the capital of France?",  # an exact repeat: a full prefix hit
    "今天天气很好，我们",
    SYSTEM + "Explain what a KV cache is in one sentence.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    # The scheduler's, KV cache manager's, block pool's and sampler's invariants are checked after every step.
    llm.engine.core.check_invariants_every_step = True
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.engine.core.check_invariants_every_step = False


@pytest.fixture(scope="module")
def reference_tokens(default_llm: LLM) -> list[list[int]]:
    tokens = _tokens(default_llm)
    assert all(len(t) == 24 for t in tokens)
    return tokens


@pytest.mark.parametrize(
    "settings",
    [
        {"enable_prefix_caching": False},
        {"block_size": 32},
        {"block_size": 16, "max_num_batched_tokens": 24},  # prompts are prefilled over several steps
        {"max_num_seqs": 2},
        {"async_scheduling": True},
        {"async_scheduling": True, "max_num_batched_tokens": 24, "max_num_seqs": 3},
    ],
    ids=["no-prefix-cache", "block32", "chunked-prefill", "max-num-seqs-2", "async", "async-chunked"],
)
def test_greedy_output_unchanged(settings: dict, reference_tokens: list[list[int]]) -> None:
    llm = LLM(max_model_len=512, **settings)
    assert _tokens(llm) == reference_tokens


@pytest.fixture(scope="module")
def preempting_llms() -> dict[bool, LLM]:
    """{async_scheduling: engine} with 12 blocks of 16 tokens: one request needs up to 5 blocks here, so six at
    once cannot all fit and the newest running requests are preempted and recomputed. Shared by the tests
    that preempt (each checks that its own run preempted: the engine's count is cumulative)."""
    return {pipelined: LLM(max_model_len=192, num_kv_blocks=12, block_size=16, async_scheduling=pipelined)
            for pipelined in (False, True)}


def _preemptions(llm: LLM) -> int:
    return llm.engine.core.scheduler.num_preemptions


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_output_unchanged_under_preemption(
    reference_tokens: list[list[int]], preempting_llms: dict[bool, LLM], async_scheduling: bool
) -> None:
    llm = preempting_llms[async_scheduling]
    before = _preemptions(llm)
    assert _tokens(llm) == reference_tokens
    stats = llm.engine.last_stats
    assert stats is not None and stats.num_preemptions > before, "the pool was meant to force preemption"
    assert stats.num_free_blocks == stats.num_blocks


def test_penalised_greedy_output_same_with_kept_counts_lists_and_preemption(
    default_llm: LLM, reference_tokens: list[list[int]], preempting_llms: dict[bool, LLM],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repetition, frequency and presence penalties: the counts the sampler keeps per request across steps
    give the same greedy tokens as counting the whole token lists every step, also when requests are
    preempted and recomputed; the kept counts belong only to the runner's live requests (invariants after
    every step)."""
    from kvserve.layers.sampler import SamplingRow
    from kvserve.worker import model_runner

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.2)
    kept = _tokens(default_llm, params)
    assert kept != reference_tokens  # the penalties change the output
    assert default_llm.engine.core.runner.sampler.penalty_counts is not None  # the kept counts were used
    preempting = preempting_llms[False]
    before = _preemptions(preempting)
    assert _tokens(preempting, params) == kept
    assert _preemptions(preempting) > before, "the pool was meant to force preemption"
    # Pipelined too: a request preempted with a token in flight, resumed by recomputing, its newest token
    # counted from the device while the host has not read it.
    from helpers.sampling import record_pending_rows

    pending = record_pending_rows(monkeypatch)
    pipelined = preempting_llms[True]
    before = _preemptions(pipelined)
    assert _tokens(pipelined, params) == kept
    assert _preemptions(pipelined) > before and sum(pending) > 0
    monkeypatch.undo()
    monkeypatch.setattr(model_runner, "SamplingRow", lambda **kw: SamplingRow(**{**kw, "req_id": None}))
    assert _tokens(default_llm, params) == kept


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["stepwise", "pipelined"])
def test_min_tokens_holds_off_a_forced_end_exactly(tiny_model_dir, async_scheduling: bool) -> None:
    """EOS made certain by logit_bias: the request gets exactly min_tokens tokens, then EOS, pipelined as step
    by step (the pipelined sampler counts a request's newest token from the device)."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=128, async_scheduling=async_scheduling)
    eos = llm.get_tokenizer().eos_token_id
    params = [SamplingParams(temperature=0.0, max_tokens=20, min_tokens=k, logit_bias={eos: 100.0}) for k in (0, 1, 2, 5, 9)]
    outs = llm.generate(["Hello, my name is"] * len(params), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 6, 10]
    assert all(o.outputs[0].token_ids[-1] == eos and o.outputs[0].finish_reason == "stop" for o in outs)


def test_last_layer_pruning_keeps_greedy_output(
    reference_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps with prefill tokens hand the model the rows they sample (it computes only those past the last
    layer's cache write); decode steps, where every row samples, hand it none. Computing every row and
    selecting afterwards gives the same greedy tokens."""
    llm = LLM(max_model_len=512, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    forward = model.forward
    asked: list[tuple[int, int | None]] = []  # (tokens in the step, rows asked for or None)

    def recording(input_ids, positions, kv_caches, attn_metadata, output_rows=None):  # noqa: ANN001, ANN202
        asked.append((input_ids.shape[0], None if output_rows is None else output_rows.shape[0]))
        return forward(input_ids, positions, kv_caches, attn_metadata, output_rows)

    monkeypatch.setattr(model, "forward", recording)
    # A few tokens show the rows asked for (the prefill step and decode steps); the whole run with pruning on
    # is the reference itself (the default engine prunes) and test_greedy_output_unchanged[no-prefix-cache]
    # (these engine settings).
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(PROMPTS, short, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t[:3] for t in reference_tokens]
    prefill_steps = [(n, rows) for n, rows in asked if rows is not None]
    assert prefill_steps and all(rows < n for n, rows in prefill_steps)
    assert any(rows is None for _, rows in asked)  # the decode steps
    monkeypatch.setattr(llama, "_prune_last_layer", False)
    assert _tokens(llm) == reference_tokens


def test_prefix_cache_hits_reported(default_llm: LLM) -> None:
    # A few tokens: what is reported is counted at the prefill; that a full prefix hit keeps greedy output is
    # also test_greedy_output_unchanged's (PROMPTS repeats one exactly).
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = default_llm.generate([SYSTEM + "Say hi.", SYSTEM + "Say bye."], params, use_tqdm=False)
    # Both share the SYSTEM prefix with earlier prompts run on this engine.
    assert all(o.num_cached_tokens >= 16 for o in outs)
    again = default_llm.generate([SYSTEM + "Say hi."], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    # n=3 of a prompt new to the cache (its own salt): the samples share its blocks, but none was in the cache.
    three = SamplingParams(n=3, temperature=0.0, max_tokens=1)
    assert default_llm.generate([SYSTEM + "Say hi."], three, use_tqdm=False, cache_salt="n3")[0].num_cached_tokens == 0


def test_cache_salt_isolates_prefix_cache(default_llm: LLM) -> None:
    prompt = SYSTEM + "A salted prompt about owls."
    first = default_llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt="tenant-a")[0]
    other_tenant = default_llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt="tenant-b")[0]
    same_tenant = default_llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt="tenant-a")[0]
    assert first.num_cached_tokens == 0
    assert other_tenant.num_cached_tokens == 0
    assert same_tenant.num_cached_tokens > 0
    assert first.outputs[0].token_ids == other_tenant.outputs[0].token_ids == same_tenant.outputs[0].token_ids


def test_async_scheduling_keeps_sampled_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded sampling with logprobs, n>1, EOS, stop-token and stop-string stops, penalties and min_tokens
    give the same output pipelined as step by step. Penalties and min_tokens pipeline too: their newest token
    is counted from the previous step's sampled ids while the host has not read it yet."""
    from helpers.sampling import record_pending_rows

    prompts = [SYSTEM + "Tell me a story about a fox.", "Hello, my name is", "今天天气很好，我们"]
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=16),
        SamplingParams(temperature=0.0, max_tokens=30),  # may stop at EOS
        SamplingParams(temperature=0.7, seed=5, max_tokens=12, stop_token_ids=[13, 28]),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[".", "。", ","]),  # stop strings: aborts
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.9, seed=11, max_tokens=10, min_tokens=8),
    ]

    # Each group's requests run together (a step of the 135M model costs about the same whatever its batch, so
    # a group takes as many steps as its longest request, not the sum): the logprobs, compared bit for bit, on
    # their own; the stops (EOS, stop tokens, stop strings), penalties and min_tokens together.
    groups = [params[:1], params[1:]]
    # Per sampler call: rows with penalties or min_tokens whose newest token is pending.
    pending_seen = record_pending_rows(monkeypatch, history_only=True)

    def run(llm: LLM) -> list:
        llm.engine.core.check_invariants_every_step = True
        pending_seen.clear()
        try:
            results = []  # per parameter set, per prompt, as if each parameter set ran on its own
            for group in groups:
                outs = llm.generate([prompt for _ in group for prompt in prompts],
                                    [p for p in group for _ in prompts], use_tqdm=False)
                for out in outs:
                    results.append([(c.token_ids, c.finish_reason, c.logprobs) for c in out.outputs])
            return results
        finally:
            llm.engine.core.check_invariants_every_step = False

    # Two fresh engines: their prefix caches then evolve alike (a prefix hit changes float rounding).
    pipelined = LLM(max_model_len=2048, async_scheduling=True)
    stepwise = LLM(max_model_len=2048, async_scheduling=False)
    assert pipelined.engine.core.async_scheduling and not stepwise.engine.core.async_scheduling
    stepwise_results = run(stepwise)
    assert not any(pending_seen)
    assert run(pipelined) == stepwise_results
    assert sum(n > 0 for n in pending_seen) >= 8  # the penalised and min_tokens requests decoded pipelined
    # The runner's set of requests that read their history was checked after every step; a stale entry fails.
    runner = pipelined.engine.core.runner
    runner._history_req_ids.add("finished-long-ago")
    with pytest.raises(AssertionError, match="history requests"):
        runner.check_invariants()
