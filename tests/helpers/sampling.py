"""Watching the sampler from engine tests."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.layers.sampler import Sampler


def record_pending_rows(monkeypatch: pytest.MonkeyPatch, history_only: bool = False) -> list[int]:
    """Patch Sampler.__call__ (in this process) to append, per call, how many rows had their newest token
    still on the device (`SamplingRow.pending_row`); with `history_only`, counting only rows whose sampling
    reads their output history. Returns the list it appends to."""
    counts: list[int] = []
    call = Sampler.__call__

    def recording(self: Sampler, logits: Any, rows: Any, eos_token_ids: Any, pending_ids: Any = None) -> Any:
        counts.append(sum(r.pending_row is not None for r in rows
                          if not history_only or r.params.needs_output_history))
        return call(self, logits, rows, eos_token_ids, pending_ids)

    monkeypatch.setattr(Sampler, "__call__", recording)
    return counts
