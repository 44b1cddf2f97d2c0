"""The Triton penalty kernel against the torch reference: bit for bit, in place, only on the rows it is given."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference, triton_penalties  # noqa: E402


def _case(device: torch.device, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """7 logit rows, 4 of them penalised (out of order), by 4 of 6 count slots (out of order)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, vocab, generator=gen) * 4
    logits[5, :5] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0])  # signs and zero at the x > 0 boundary (row 5:
    # repetition penalty 1.3)
    seen = torch.rand(6, vocab, generator=gen) < 0.2
    seen[2, :5] = True  # row 5's slot: the boundary values are penalised
    counts = torch.randint(0, 4, (6, vocab), generator=gen).float() * (torch.rand(6, vocab, generator=gen) < 0.1)
    return dict(
        logits=logits.to(device),
        rows=torch.tensor([5, 0, 3, 6], device=device),
        slots=torch.tensor([2, 4, 0, 5], device=device),
        seen=seen.to(device),
        counts=counts.to(device),
        repetition_penalties=torch.tensor([1.3, 1.0, 0.7, 1.05], device=device),
        # products that round (0.3 * 3, 0.7 * 2, ...): a fused multiply-add would change the last bit
        frequency_penalties=torch.tensor([0.3, 0.7, -0.1, 0.1], device=device),
        presence_penalties=torch.tensor([0.2, 0.0, 1.5, -0.3], device=device),
    )


@pytest.mark.parametrize("vocab", [2048, 3001], ids=["whole-blocks", "partial-block"])
def test_penalties_match_reference_bitwise(vocab, device):
    case = _case(device, vocab)
    expected = case["logits"].clone()
    reference.penalise_rows_(expected, *[case[k] for k in list(case)[1:]])
    got = case["logits"].clone()
    triton_penalties.penalise_rows_(got, *[case[k] for k in list(case)[1:]])
    assert torch.equal(got, expected)
    untouched = [1, 2, 4]
    assert torch.equal(got[untouched], case["logits"][untouched])
    assert not torch.equal(got[[5, 0, 3, 6]], case["logits"][[5, 0, 3, 6]])  # the case does penalise


def test_penalties_read_strided_count_rows(device):
    """Count rows sliced out of wider buffers (the sampler's per-step counts are a [:, :vocab] slice), with the
    prompt marks laid out differently from the counts."""
    vocab = 1500
    case = _case(device, vocab, seed=1)
    wide = torch.zeros(6, vocab + 1, device=device)
    wide[:, :vocab] = case["counts"]
    case["counts"] = wide[:, :vocab]
    expected = case["logits"].clone()
    reference.penalise_rows_(expected, *[case[k] for k in list(case)[1:]])
    got = case["logits"].clone()
    triton_penalties.penalise_rows_(got, *[case[k] for k in list(case)[1:]])
    assert torch.equal(got, expected)


def test_penalties_refuse_what_they_cannot_read(device):
    """Every argument the kernel would misread is refused: dtypes, count rows narrower than the logits (the
    prompt marks or the counts), columns that are not contiguous."""
    case = _case(device, 64)

    def refused(match: str, **changed: torch.Tensor) -> None:
        args = {**case, **changed}
        with pytest.raises(ValueError, match=match):
            triton_penalties.penalise_rows_(*args.values())

    refused("float32", logits=case["logits"].half())
    refused("float32", counts=case["counts"].double())
    refused("bool", seen=case["seen"].to(torch.uint8))
    refused("columns", seen=case["seen"][:, :32])
    refused("columns", counts=case["counts"][:, :32])
    refused("unit-stride", logits=case["logits"].t().contiguous().t())
    refused("unit-stride", counts=case["counts"].t().contiguous().t())


def test_penalty_kernel_compiles_for_hopper(device, compiler_for):
    """A plain launch (the kernel follows the sampler's torch operations, which take no PDL launch)."""
    case = _case(device, 3001)
    hopper_compiler = compiler_for(90)
    hopper_compiler.record(
        triton_penalties,
        ["_penalise_rows_kernel"],
        partial(triton_penalties.penalise_rows_, case["logits"], *[case[k] for k in list(case)[1:]]),
    )
    hopper_compiler.compile_all()
