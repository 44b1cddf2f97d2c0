"""What users get back from `LLM.generate` / `LLM.chat` (and what the server turns into JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token under the model
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request. `text` / `token_ids` are cumulative; `*_delta` hold what the latest
    update added (for streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: sampled + top-k
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def copy(self) -> CompletionOutput:
        """A shallow copy (`dataclasses.replace(self)` is several times slower, and the API process copies
        every streaming sample at every step)."""
        return CompletionOutput(self.index, self.text, self.token_ids, self.cumulative_logprob, self.logprobs,
                                self.finish_reason, self.stop_reason, self.text_delta, self.token_ids_delta)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with prompt_logprobs: per prompt token, its logprob and the top-k at its position (None for the first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # vLLM's fields for encoder-decoder models and LoRA, which kvserve does not serve: always None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    lora_request: None = None
    # vLLM's per-request stats object (a RequestStateStats, only with LLM(disable_log_stats=False), which
    # kvserve takes and ignores): always None, as in vLLM's offline API by default; code that tests it for None
    # before reading it runs unchanged (an empty dict was neither None nor that object).
    metrics: None = None
