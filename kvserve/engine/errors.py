"""Errors shared by the in-process engine and the engine-core process's clients (no heavy imports)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can serve no more requests: its engine-core process is gone (or failed to start), or, in
    this process, a tensor-parallel step failed while the other ranks ran it. The message says why when it is
    known. As vLLM's: make a new engine (LLM) to go on."""
