"""Sampler: each step checked against a hand computation, sampling checked by its support and frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.kernels.reference import apply_penalties
from kvserve.layers.sampler import (
    PenaltyCounts,
    Sampler,
    SamplerOutput,
    SamplingRow,
    apply_min_p,
    apply_min_p_top_k_top_p,
    apply_top_k_top_p,
    make_generator,
    token_counts,
)
from kvserve.protocol.sampling_params import SamplingParams

VOCAB = 32
CPU = torch.device("cpu")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def row(params: SamplingParams, prompt=(), output=(), generator=None, req_id=None) -> SamplingRow:
    return SamplingRow(
        params=params, prompt_token_ids=list(prompt), output_token_ids=list(output), generator=generator,
        req_id=req_id,
    )


def gathered(kept: PenaltyCounts, rows: list[SamplingRow], pending_ids: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt marks as float32, output counts) of `rows` after `kept.update`, in row order."""
    index = torch.tensor(kept.update(rows, pending_ids), device=kept.device)
    return kept.seen[index].to(torch.float32), kept.counts[index]


def probs_to_logits(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is `probs` (zeros become -inf)."""
    return torch.tensor([math.log(p) if p > 0 else float("-inf") for p in probs], dtype=torch.float32)


def draw_many(
    logits_row: torch.Tensor,
    params: SamplingParams,
    num_draws: int,
    seed: int = 0,
    device: torch.device = CPU,
) -> torch.Tensor:
    """Sample `num_draws` times from one distribution in a single batched call (result on the CPU)."""
    sampler = Sampler(seed=seed)
    logits = logits_row.unsqueeze(0).repeat(num_draws, 1).to(device)
    out = sampler(logits, [row(params)] * num_draws, eos_token_ids=[]).sampled_token_ids
    assert out.device == logits.device
    return out.cpu()


def sample(logits: torch.Tensor, rows: list[SamplingRow], device: torch.device, eos=()) -> SamplerOutput:
    """One sampler call on `device` with CPU-made logits; every output tensor back on the CPU."""
    logits_on_device = logits.to(device)
    before = logits_on_device.clone()
    out = Sampler()(logits_on_device, rows, list(eos))
    assert torch.equal(logits_on_device, before), "the sampler modified the caller's logits"
    assert out.sampled_token_ids.device.type == device.type
    assert out.sampled_token_ids.dtype == torch.int64
    fields = (out.sampled_token_ids, out.logprobs, out.logprob_token_ids, out.sampled_ranks)
    return SamplerOutput(*(None if t is None else t.cpu() for t in fields))


# ------------------------------------------------------------------------------------------------ greedy


def test_greedy_is_argmax(device):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, VOCAB, generator=gen)
    out = sample(logits, [row(SamplingParams(temperature=0.0))] * 7, device, eos=[0])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_mixed_batch_greedy_rows_stay_argmax(device):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, VOCAB, generator=gen)
    rows = [row(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0)) for i in range(6)]
    out = sample(logits, rows, device)
    assert torch.equal(out.sampled_token_ids[0::2], logits[0::2].argmax(dim=1))


# ------------------------------------------------------------------------------------------------ seeds


def test_same_seed_same_tokens_across_calls(device):
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(1, VOCAB, generator=gen).to(device) for _ in range(20)]
    params = SamplingParams(temperature=1.0, seed=1234)

    def run() -> list[int]:
        generator = make_generator(1234, device)
        sampler = Sampler(seed=99)
        return [int(sampler(lg, [row(params, generator=generator)], []).sampled_token_ids[0]) for lg in steps]

    first, second = run(), run()
    assert first == second
    assert len(set(first)) > 1  # really sampling, not degenerate


def test_seeded_row_independent_of_batch_and_position(device):
    gen = torch.Generator().manual_seed(4)
    num_steps = 30
    target_logits = [torch.randn(VOCAB, generator=gen) for _ in range(num_steps)]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)

    # Alone.
    generator = make_generator(7, device)
    sampler = Sampler(seed=0)
    alone = [
        int(sampler(lg.unsqueeze(0).to(device), [row(params, generator=generator)], []).sampled_token_ids[0])
        for lg in target_logits
    ]

    # In a batch of 6 whose other rows (seeded and unseeded, greedy and not) change every step, and
    # with the target row at a different position each step.
    generator = make_generator(7, device)
    other_gens = [make_generator(100 + i, device) for i in range(5)]
    sampler = Sampler(seed=12345)
    in_batch = []
    for step, lg in enumerate(target_logits):
        position = step % 6
        others = [
            row(SamplingParams(temperature=1.0, seed=100 + i), generator=other_gens[i])
            if i % 2
            else row(SamplingParams(temperature=0.0 if i == 4 else 1.5, top_k=3 if i == 2 else 0))
            for i in range(5)
        ]
        rows = others[:position] + [row(params, generator=generator)] + others[position:]
        logits = torch.randn(6, VOCAB, generator=gen)
        logits[position] = lg
        in_batch.append(int(sampler(logits.to(device), rows, []).sampled_token_ids[position]))
    assert alone == in_batch
    assert len(set(alone)) > 1


# ------------------------------------------------------------------------------------------------ filters


def test_top_k_support(device):
    probs = [0.05, 0.3, 0.1, 0.25, 0.2, 0.1]
    draws = draw_many(probs_to_logits(probs), SamplingParams(temperature=1.0, top_k=3), 3000, device=device)
    assert set(draws.tolist()) == {1, 3, 4}


def test_top_p_support(device):
    # Sorted: 1 (0.4), 3 (0.3), 4 (0.15), 2 (0.1), 0 (0.05). Mass before 4 is 0.7 < 0.75 (kept), before
    # 2 it is 0.85 (dropped).
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    draws = draw_many(
        probs_to_logits(probs), SamplingParams(temperature=1.0, top_p=0.75), 3000, device=device
    )
    assert set(draws.tolist()) == {1, 3, 4}


def test_top_p_always_keeps_top_token(device):
    probs = [0.1, 0.6, 0.3]
    draws = draw_many(probs_to_logits(probs), SamplingParams(temperature=1.0, top_p=0.01), 500, device=device)
    assert set(draws.tolist()) == {1}


def test_min_p_support(device):
    # p_max = 0.4, min_p = 0.3 -> threshold 0.12: tokens 0 (0.05) and 2 (0.1) are dropped.
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    draws = draw_many(probs_to_logits(probs), SamplingParams(temperature=1.0, min_p=0.3), 3000, device=device)
    assert set(draws.tolist()) == {1, 3, 4}


def test_top_k_top_p_min_p_functions_exact(device):
    logits = torch.stack(
        [
            probs_to_logits([0.05, 0.4, 0.1, 0.3, 0.15]),
            probs_to_logits([0.2, 0.2, 0.2, 0.2, 0.2]),
            probs_to_logits([0.5, 0.25, 0.125, 0.0625, 0.0625]),
        ]
    )
    neg = float("-inf")

    def on(*values):
        return torch.tensor(values).to(device)

    # Row 0: top-k 4 drops token 0; renormalised [_, .421, .105, .316, .158]; top-p 0.7: mass before
    # token 3 is .421 (kept), before token 4 .737 (dropped). Row 1: ties at the k-th logit are all kept.
    # Row 2: everything off.
    out = apply_top_k_top_p(logits.to(device), on(4, 2, 0), on(0.7, 1.0, 1.0)).cpu()
    assert torch.isinf(out[0]).tolist() == [True, False, True, False, True]
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out[2], logits[2])

    out = apply_min_p(logits.to(device), on(0.3, 0.5, 0.2)).cpu()
    # Row 2: threshold 0.1 drops 0.0625 twice.
    assert torch.equal(out[2], torch.tensor([logits[2, 0], logits[2, 1], logits[2, 2], neg, neg]))
    assert torch.equal(out[1], logits[1])
    assert torch.isinf(out[0]).tolist() == [True, False, True, False, False]

    combined = apply_min_p_top_k_top_p(logits.to(device), on(0, 0, 2), on(1.0, 1.0, 1.0), on(0.0, 0.0, 0.6))
    # Row 2: min-p 0.6 drops 1 (0.25 < 0.3) and below; top-k 2 then keeps 0 alone.
    assert torch.isinf(combined[2]).tolist() == [False, True, True, True, True]
    assert torch.equal(combined[:2].cpu(), logits[:2])


def test_allowed_tokens_are_drawn_with_right_frequencies(device):
    probs = [0.5, 0.3, 0.2]
    num_draws = 6000
    draws = draw_many(
        probs_to_logits(probs), SamplingParams(temperature=1.0), num_draws, seed=5, device=device
    )
    freq = torch.bincount(draws, minlength=3).float() / num_draws
    # Binomial std at n=6000 is < 0.007; 0.03 is > 4 sigma.
    assert torch.allclose(freq, torch.tensor(probs), atol=0.03)


def test_low_temperature_concentrates_high_temperature_spreads(device):
    logits = probs_to_logits([0.4, 0.35, 0.25])
    cold = draw_many(logits, SamplingParams(temperature=0.1), 2000, device=device)
    hot = draw_many(logits, SamplingParams(temperature=5.0), 2000, device=device)
    cold_top = (cold == 0).float().mean().item()
    hot_top = (hot == 0).float().mean().item()
    # T=0.1: p_top = 1 / (1 + (7/8)^10 + (5/8)^10) ~ 0.79; T=5: ~ 0.35.
    assert cold_top > 0.72
    assert hot_top < 0.42
    assert (hot == 2).any()


# ------------------------------------------------------------------------------------------------ penalties


def test_token_counts(device):
    counts = token_counts([[1, 1, 3], [], [0, 4, 4, 4, 99]], 5, device)
    assert counts.device.type == device.type
    assert counts.tolist() == [[0, 2, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 3]]


def test_apply_penalties_matches_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    prompt_counts = token_counts([[0, 1]], 5, CPU)
    output_counts = token_counts([[3, 3, 1]], 5, CPU)
    out = apply_penalties(
        logits, prompt_counts, output_counts, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    expected = [
        2.0 / 2,  # prompt, positive: divided
        -1.0 * 2 - 0.5 * 1 - 0.25,  # prompt + output once, negative: multiplied, then freq + presence
        0.5,  # unseen
        3.0 / 2 - 0.5 * 2 - 0.25,  # output twice
        -2.0,  # unseen
    ]
    assert out[0].tolist() == pytest.approx(expected)


def test_sampler_penalties_only_touch_rows_that_ask(device):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    # Greedy row 0 with frequency penalty 2 on token 3 (twice): 3 - 4 = -1 -> argmax is 0. Row 1 untouched.
    rows = [
        row(SamplingParams(temperature=0.0, frequency_penalty=2.0), output=[3, 3]),
        row(SamplingParams(temperature=0.0), output=[3, 3]),
    ]
    assert sample(logits, rows, device).sampled_token_ids.tolist() == [0, 3]


def test_penalised_rows_after_unpenalised_ones_use_their_own_counts(device):
    """Rows counted from their lists (no request id) and penalised, behind a row without penalties: each gets
    its own counts (a row index used as a count row would read another row's)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]] * 3)
    rows = [
        row(SamplingParams(temperature=0.0), output=[0, 0]),  # no penalty: argmax 3
        row(SamplingParams(temperature=0.0, frequency_penalty=2.0), output=[3, 3]),  # 3 - 4 = -1: token 0
        row(SamplingParams(temperature=0.0, frequency_penalty=2.0), output=[0]),  # 2 - 2 = 0: token 3
    ]
    assert sample(logits, rows, device).sampled_token_ids.tolist() == [3, 0, 3]


def test_logit_bias_comes_before_the_penalties(device):
    # Token 1: logit -2, in the output, repetition penalty 2, bias +3 (vLLM v1's order, and HF's processors').
    # Bias then penalty: (-2 + 3) / 2 = 0.5 > 0 (token 1 wins); penalty then bias would give -2 * 2 + 3 = -1.
    logits = torch.tensor([[0.0, -2.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={1: 3.0})
    assert sample(logits, [row(params, output=[1])], device).sampled_token_ids.tolist() == [1]


def test_min_p_comes_before_top_p(device):
    """vLLM v1's order: min-p, then top-p over what it left. Probabilities .5/.25/.15/.1, min_p .25 drops .1
    (< .125); top_p .8 over the renormalised .556/.278/.167 keeps two tokens (mass before the third .833). Top-p
    first would keep three (mass before the third .75 < .8), and min-p would then drop none of them."""
    draws = draw_many(probs_to_logits([0.5, 0.25, 0.15, 0.1]), SamplingParams(temperature=1.0, min_p=0.25, top_p=0.8),
                      2000, device=device)
    assert set(draws.tolist()) == {0, 1}


def test_repetition_penalty_uses_prompt_tokens(device):
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    # Token 0 in the prompt: 2 / 1.5 = 1.33 < 1.5.
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert sample(logits, [row(params, prompt=[0])], device).sampled_token_ids.tolist() == [1]
    # Presence/frequency penalties ignore prompt tokens (OpenAI semantics).
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert sample(logits, [row(params, prompt=[0])], device).sampled_token_ids.tolist() == [0]


def test_kept_penalty_counts_match_counting_the_lists_at_every_step(device):
    """Requests come and go over 30 steps, their outputs growing by 0-3 tokens a step (ids out of range
    included, which are not counted); the counts kept across steps equal `token_counts` of the whole lists at
    every step, for the prompt (only where the repetition penalty is on) and the output; released slots are
    reused, cleared; the buffers grow past their first 8 slots."""
    gen = torch.Generator().manual_seed(0)
    kept = PenaltyCounts(VOCAB, device)
    live: dict[str, SamplingRow] = {}
    for step in range(30):
        for _ in range(int(torch.randint(0, 4, (1,), generator=gen))):  # arrivals
            req_id = f"r{step}-{len(live)}"
            prompt = torch.randint(-2, VOCAB + 2, (int(torch.randint(0, 12, (1,), generator=gen)),), generator=gen)
            params = SamplingParams(repetition_penalty=1.0 if len(live) % 3 == 0 else 1.2, frequency_penalty=0.5)
            live[req_id] = row(params, prompt.tolist(), req_id=req_id)
        for req_id in [r for r in live if torch.rand(1, generator=gen).item() < 0.1]:  # departures
            del live[req_id]
            kept.release([req_id])
        for r in live.values():
            new = torch.randint(-1, VOCAB + 1, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen)
            r.output_token_ids.extend(new.tolist())
        rows = list(live.values())
        if not rows:
            continue
        prompt_counts, output_counts = gathered(kept, rows)
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows]
        assert torch.equal((prompt_counts > 0).cpu(), (token_counts(prompts, VOCAB, CPU) > 0))
        assert torch.equal(output_counts.cpu(), token_counts([r.output_token_ids for r in rows], VOCAB, CPU))
        kept.check_invariants(set(live))
    assert kept.counts.shape[0] > 8 and len(kept) == len(live)


def test_kept_penalty_counts_recount_a_shorter_history_and_release_forgets(device):
    kept = PenaltyCounts(VOCAB, device)
    r = row(SamplingParams(frequency_penalty=1.0), output=[1, 1, 2], req_id="a")
    assert gathered(kept, [r])[1][0, :3].tolist() == [0, 2, 1]
    r.output_token_ids[:] = [2]  # not expected in the engine: counted again from the start
    assert gathered(kept, [r])[1][0, :3].tolist() == [0, 0, 1]
    kept.release(["a", "unknown"])
    kept.check_invariants(set())
    assert len(kept) == 0
    gathered(kept, [r])  # a request the caller has ended but not released is caught by the invariant check
    with pytest.raises(AssertionError, match="still holds"):
        kept.check_invariants(set())


def test_kept_penalty_counts_grow_once_for_a_batch_of_arrivals(device):
    """A batch of new requests grows the buffers once, to what it needs (the engine's memory profile sizes
    them so for max_num_seqs rows); past that they double."""
    kept = PenaltyCounts(VOCAB, device)
    params = SamplingParams(presence_penalty=1.0)
    gathered(kept, [row(params, output=[i % VOCAB], req_id=str(i)) for i in range(20)])
    assert kept.counts.shape[0] == 20 and len(kept) == 20
    prompt_counts, output_counts = gathered(kept, [row(params, output=[3, 3], req_id="new")])
    assert kept.counts.shape[0] == 40 and output_counts[0, 3].item() == 2.0 and prompt_counts.sum().item() == 0
    kept.check_invariants()


def test_sampler_with_request_ids_keeps_counts_and_samples_as_without(device):
    """Penalised rows with request ids (counts kept across calls) sample the same tokens, over several
    calls with growing outputs, as the same rows without ids (counted from the lists each call); the
    sampler releases a finished request's counts."""
    gen = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3),
              SamplingParams(temperature=0.0, frequency_penalty=2.0),
              SamplingParams(temperature=0.0)]
    with_ids = [row(p, prompt=[i, i + 1], req_id=f"q{i}") for i, p in enumerate(params)]
    without = [row(p, prompt=[i, i + 1]) for i, p in enumerate(params)]
    sampler = Sampler()
    for _ in range(12):
        logits = torch.randn(len(params), VOCAB, generator=gen)
        a = sample_with(sampler, logits, with_ids, device)
        b = sample_with(Sampler(), logits, without, device)
        assert a == b
        for r, s, token in zip(with_ids, without, a, strict=True):
            r.output_token_ids.append(token)
            s.output_token_ids.append(token)
    assert sampler.penalty_counts is not None and len(sampler.penalty_counts) == 2  # the unpenalised row: none
    sampler.release(["q0", "q1"])
    sampler.check_invariants(set())


def test_a_pending_token_on_the_device_counts_as_the_lists_next(device):
    """Async scheduling: each step a request's newest token is still on the device (the previous step's
    sampled ids, `pending_row`), not in its output list, which catches up a step later. Over 20 such steps
    (and steps where the list is complete, with no pending token), the kept counts and the counts of the
    lists' path equal counting the whole history; min_tokens counts the pending token too."""
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5)
    history: dict[str, list[int]] = {"a": [], "b": [4, 4], "c": [7]}
    host = {req_id: list(tokens) for req_id, tokens in history.items()}  # what the host's lists hold
    kept = PenaltyCounts(VOCAB, device)
    for step in range(20):
        lagging = step % 5 != 4  # every fifth step the lists are complete (no token in flight)
        previous = torch.randint(0, VOCAB, (len(history) + 2,), generator=gen)  # the previous step's ids
        rows, pending_rows = [], {}
        for i, req_id in enumerate(history):
            token_row = (i + step) % len(previous)
            if lagging:
                history[req_id].append(int(previous[token_row]))  # sampled last step, on the device only
                pending_rows[req_id] = token_row
            else:
                host[req_id] = list(history[req_id])
            r = row(params, prompt=[1, 2], output=host[req_id], req_id=req_id)
            r.pending_row = pending_rows.get(req_id)
            rows.append(r)
        want = token_counts([history[req_id] for req_id in history], VOCAB, CPU)
        _, output_counts = gathered(kept, rows, previous.to(device))
        assert torch.equal(output_counts.cpu(), want), step
        lists = Sampler()._apply_penalties(torch.zeros(len(rows), VOCAB, device=device), [
            SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, None, None, r.pending_row) for r in rows
        ], previous.to(device))
        assert torch.equal(lists.cpu(), Sampler()._apply_penalties(torch.zeros(len(rows), VOCAB, device=device), [
            row(params, prompt=[1, 2], output=history[req_id]) for req_id in history], None).cpu()), step
        kept.check_invariants(set(history))
        for req_id in history:  # the host reads the previous step's tokens after the next is launched
            host[req_id] = list(history[req_id])

    eos = 5
    logits = torch.zeros(1, 8)
    logits[0, eos] = 10.0
    almost = SamplingParams(temperature=0.0, min_tokens=3)
    pending = row(almost, output=[1])  # one token on the host, one on the device: 2 of 3
    pending.pending_row = 0
    assert Sampler()(logits.to(device), [pending], [eos], torch.zeros(1, dtype=torch.int64, device=device)
                     ).sampled_token_ids.tolist() != [eos]
    pending.output_token_ids.append(1)  # 3 of 3 with the pending one: EOS allowed
    assert Sampler()(logits.to(device), [pending], [eos], torch.zeros(1, dtype=torch.int64, device=device)
                     ).sampled_token_ids.tolist() == [eos]
    with pytest.raises(ValueError, match="pending_ids"):  # a pending row needs the ids it points into
        PenaltyCounts(VOCAB, device).update([SamplingRow(params, [1], [1], None, "x", 0)])


def sample_with(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], device: torch.device) -> list[int]:
    return sampler(logits.to(device), rows, []).sampled_token_ids.cpu().tolist()


def test_logit_bias(device):
    logits = torch.tensor([[1.0, 0.0, 0.5], [1.0, 0.0, 0.5]])
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={1: 2.0, 2: -100.0, 10_000: 5.0})),
        row(SamplingParams(temperature=0.0)),
    ]
    assert sample(logits, rows, device).sampled_token_ids.tolist() == [1, 0]
    # -100 removes a token from sampling.
    draws = draw_many(torch.zeros(3), SamplingParams(logit_bias={2: -100.0}), 1000, device=device)
    assert set(draws.tolist()) == {0, 1}


def test_allowed_token_ids(device):
    """Greedy and sampled rows draw only allowed ids (the best of them when greedy), after logit_bias; a row
    without the setting beside them is untouched; logprobs stay the raw distribution's."""
    logits = torch.tensor([[3.0, 0.0, 1.0, 2.0, -1.0]] * 3)
    rows = [
        row(SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 4], logprobs=1)),
        row(SamplingParams(temperature=0.0, allowed_token_ids=[1, 4], logit_bias={4: 5.0})),
        row(SamplingParams(temperature=0.0)),
    ]
    out = sample(logits, rows, device)
    assert out.sampled_token_ids.tolist() == [2, 4, 0]
    assert out.logprobs is not None and out.logprobs[0, 0].item() == pytest.approx(
        torch.log_softmax(logits[0], dim=0)[2].item())
    draws = draw_many(torch.zeros(6), SamplingParams(allowed_token_ids=[1, 3, 5]), 600, device=device)
    assert set(draws.tolist()) == {1, 3, 5}


# ------------------------------------------------------------------------------------------------ min_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids(device, temperature):
    eos, stop_id = 5, 6
    logits = torch.full((1, 8), -5.0)
    logits[0, eos] = 10.0
    logits[0, stop_id] = 9.0
    logits[0, 2] = 0.0
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[stop_id])
    below = sample(
        logits.repeat(50, 1), [row(params, output=[1, 1])] * 50, device, eos=[eos]
    ).sampled_token_ids
    assert not ((below == eos) | (below == stop_id)).any()
    reached = sample(logits, [row(params, output=[1, 1, 1])], device, eos=[eos]).sampled_token_ids
    if temperature == 0.0:
        assert reached.tolist() == [eos]


def test_min_tokens_holds_back_a_rows_own_eos_too(device):
    """A request's EOS ids beyond the model's (its tokenizer's EOS, which ends it as well) are held back too."""
    model_eos, own_eos = 5, 4
    logits = torch.zeros(2, 8)
    logits[:, own_eos] = 10.0
    logits[:, 2] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=2)
    rows = [SamplingRow(params, [], [], None, eos_token_ids=(own_eos,)),
            SamplingRow(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), [], [], None,
                        eos_token_ids=(own_eos,))]
    assert sample(logits, rows, device, eos=[model_eos]).sampled_token_ids.tolist() == [2, own_eos]


def test_min_tokens_with_ignore_eos_leaves_eos_alone(device):
    eos, stop_id = 5, 6
    logits = torch.zeros(1, 8)
    logits[0, eos] = 10.0
    logits[0, stop_id] = 9.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True)
    assert sample(logits, [row(params)], device, eos=[eos]).sampled_token_ids.tolist() == [eos]
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[eos], ignore_eos=True)
    # An explicit stop id is masked regardless of ignore_eos.
    assert sample(logits, [row(params)], device, eos=[eos]).sampled_token_ids.tolist() == [stop_id]


# ------------------------------------------------------------------------------------------------ bad words


def _ranked_logits(num_rows: int) -> torch.Tensor:
    """Greedy preference 7 > 6 > 5 > ... in every row."""
    return torch.arange(VOCAB, dtype=torch.float32).where(torch.arange(VOCAB) < 8, torch.tensor(-10.0)).repeat(
        num_rows, 1)


def test_bad_words_ban_a_words_last_token_after_its_other_tokens(device):
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[7], [3, 6], [1, 2, 5]])
    rows = [
        row(params),  # 7 always banned; 6 not (the output does not end with 3)
        row(params, output=[4, 3]),  # ends with 3: 6 banned too
        row(params, output=[1, 2]),  # ends with 1, 2: 5 banned only if 6 is, which it is not here
        row(params, output=[3, 1, 2]),  # ... and ends with 1, 2 but not 3
    ]
    assert sample(_ranked_logits(4), rows, device).sampled_token_ids.tolist() == [6, 5, 6, 6]
    both = SamplingParams(temperature=0.0, bad_words_token_ids=[[7], [2, 6], [1, 2, 5]])
    assert sample(_ranked_logits(1), [row(both, output=[1, 2])], device).sampled_token_ids.tolist() == [4]


def test_bad_words_past_the_models_vocabulary_are_ignored(device):
    """A tokenizer may be longer than the model's vocabulary: a word ending past it bans nothing."""
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[VOCAB + 3], [7, VOCAB], [6]])
    assert sample(_ranked_logits(1), [row(params, output=[7])], device).sampled_token_ids.tolist() == [7]


def test_bad_words_compare_a_pending_token_on_the_device(device):
    """Under async scheduling a row's newest token is on the device: a word whose next-to-last token it must
    be is banned only where it is (two conditions on one token are both honoured)."""
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 7], [4, 7], [9, 2, 7]])
    pending_ids = torch.tensor([3, 5, 2], device=device)
    rows = [
        SamplingRow(params, [], [], None, pending_row=0),  # pending 3: 7 banned (and [4, 7] does not undo it)
        SamplingRow(params, [], [], None, pending_row=1),  # pending 5: nothing banned
        SamplingRow(params, [], [9], None, pending_row=2),  # 9 then pending 2: 7 banned
        SamplingRow(params, [], [8], None, pending_row=2),  # 8 then pending 2: 7 not
    ]
    out = Sampler()(_ranked_logits(4).to(device), rows, [], pending_ids=pending_ids)
    assert out.sampled_token_ids.cpu().tolist() == [6, 7, 6, 7]


# ------------------------------------------------------------------------------------------------ logprobs


def test_logprobs_are_raw_log_softmax_with_top_k(device):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.8), prompt=[0, 1, 2]),
        row(SamplingParams(temperature=0.7, logprobs=0, logit_bias={4: 50.0})),
        row(SamplingParams(temperature=1.2, top_k=2)),
        row(SamplingParams(temperature=0.0, logprobs=1)),
    ]
    out = sample(logits, rows, device)
    expected = torch.log_softmax(logits.double(), dim=1).float()
    assert out.logprobs is not None and out.logprob_token_ids is not None and out.sampled_ranks is not None
    assert out.logprobs.shape == (4, 4) and out.logprob_token_ids.shape == (4, 4)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs[:, 0], expected.gather(1, sampled[:, None])[:, 0], atol=1e-5)
    order = expected.argsort(dim=1, descending=True)
    assert torch.equal(out.logprob_token_ids[:, 1:], order[:, :3])
    assert torch.allclose(out.logprobs[:, 1:], expected.gather(1, order[:, :3]), atol=1e-5)
    # Row 1's bias forces token 4; its logprob is still the raw one and its rank the raw rank.
    assert sampled[1].item() == 4
    raw_rank = int((expected[1] > expected[1, 4]).sum()) + 1
    assert out.sampled_ranks[1].item() == raw_rank
    assert out.sampled_ranks[3].item() == 1  # greedy, no processing: the top token


# ------------------------------------------------------------------------------------------------ syncs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_no_host_sync_on_cuda():
    device = torch.device("cuda")
    logits = torch.randn(4, VOCAB, device=device)
    rows = [
        row(
            SamplingParams(temperature=0.0, logprobs=2, frequency_penalty=1.0, repetition_penalty=1.2),
            [1],
            [2],
        ),
        row(
            SamplingParams(temperature=0.9, top_p=0.9, min_p=0.05, seed=3),
            generator=make_generator(3, device),
        ),
        row(SamplingParams(temperature=1.0, top_k=4, logit_bias={0: 1.0}, min_tokens=2, stop_token_ids=[7])),
        row(SamplingParams(temperature=1.3, presence_penalty=0.5, bad_words_token_ids=[[3], [6, 4]]),
            output=[5, 5, 6]),
    ]
    sampler = Sampler()
    sampler(logits, rows, [2])  # first call creates the shared generator and warms caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, rows, [2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (4,)
    # The same rows with request ids: penalty counts kept on the device, a slot per request, new output
    # tokens counted each call; and a request that replaces a released one reuses its slot (cleared).
    for i, r in enumerate(rows):
        r.req_id = f"r{i}"
    sampler(logits, rows, [2])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows[0].output_token_ids.append(3)
        rows[3].output_token_ids.extend([1, 1])
        sampler(logits, rows, [2])
        sampler.release(["r3"])
        rows[3].req_id = "r4"
        out = sampler(logits, rows, [2])
        # Async scheduling: the newest tokens still on the device (the last call's sampled ids) are counted
        # there, for the penalties, min_tokens and bad words (row 3's [6, 4]), without a copy to the host.
        rows[0].pending_row, rows[2].pending_row, rows[3].pending_row = 0, 2, 3
        out = sampler(logits, rows, [2], out.sampled_token_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (4,)
    sampler.check_invariants({"r0", "r1", "r2", "r4"})
