"""kvserve: high-throughput LLM inference serving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from kvserve.engine.llm import LLM
    from kvserve.protocol.outputs import CompletionOutput, RequestOutput
    from kvserve.protocol.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy so that `import kvserve` (e.g. the CLI's --help) does not import torch.
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvserve.protocol.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from kvserve.protocol import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
