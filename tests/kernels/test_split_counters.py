"""The split launches' counter buffers: zero, one per device, grown without freeing what graphs may hold."""

from __future__ import annotations

import torch

from kvserve.kernels.split_counters import SplitCounters


def test_counters_are_zero_and_shared_until_a_larger_count_is_asked():
    counters = SplitCounters("test counters", min_size=8)
    cpu = torch.device("cpu")
    first = counters.get(cpu, 3)
    assert first.dtype == torch.int32 and first.numel() == 8 and int(first.abs().sum()) == 0
    assert counters.get(cpu, 8) is first  # fits: the same buffer
    larger = counters.get(cpu, 20)
    assert larger is not first and larger.numel() == 20 and int(larger.abs().sum()) == 0
    assert counters.buffers[cpu] is larger
    assert any(kept is first for kept in counters._retired)  # a graph captured earlier may still use it
