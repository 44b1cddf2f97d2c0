"""The in-process client: tokenizer + EngineCore + OutputProcessor in one loop (offline LLM, tests)."""

from __future__ import annotations

import time

from transformers import PreTrainedTokenizerBase

from kvserve.config import EngineConfig, ModelConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.input_processor import InputProcessor, PromptType
from kvserve.engine.output_processor import OutputProcessor
from kvserve.protocol.outputs import RequestOutput
from kvserve.protocol.sampling_params import SamplingParams


class RequestsFailedError(ValueError):
    """Requests the engine core dropped in one step (a grammar that failed to compile), raised by
    `LLMEngine.step`: every one is named, so that none vanishes unreported. `failures`: each failed user
    request's id -> its error message. The requests are aborted already."""

    def __init__(self, failures: dict[str, str]) -> None:
        if len(failures) == 1:
            message = next(iter(failures.values()))
        else:
            message = f"{len(failures)} requests failed: " + "; ".join(
                f"request {req_id!r}: {error}" for req_id, error in failures.items())
        super().__init__(message)
        self.failures = failures


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.core = EngineCore(config)
        self.core.set_tokenizer(tokenizer)
        self.config = self.core.config
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(tokenizer, self.core.max_model_len, self.core.eos_token_ids,
                                              self.core.vocab_size)
        self.output_processor = OutputProcessor(tokenizer)
        self.last_stats = None
        self._held_outputs: list[RequestOutput] = []

    @property
    def model_config(self) -> ModelConfig:
        """The model's settings (model, tokenizer, dtype, max_model_len, ...), where vLLM's engine has them."""
        return self.config.model_config

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Tokenize and queue a request (all its n samples). Raises ValueError for a request that can
        never be served (e.g. a prompt of max_model_len tokens or more); nothing is queued then.
        `priority`: lower first, under the priority scheduling policy (0 otherwise)."""
        processed = self.input_processor.tokenize(prompt)
        self.add_tokenized_request(request_id, processed.prompt, processed.prompt_token_ids, params, cache_salt,
                                   priority)

    def add_tokenized_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.input_processor.check_token_ids(params)
        params = self.input_processor.resolve_bad_words(params)
        prompt_token_ids = self.input_processor.truncate(prompt_token_ids, params)
        now = time.time()
        children = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, now)
        group_key = request_id if params.n > 1 else None
        added: list[str] = []
        try:
            for child_id, child_params in children:
                self.core.add_request(
                    self.input_processor.make_engine_request(
                        child_id, prompt_token_ids, child_params, cache_salt, group_key, now, priority
                    )
                )
                added.append(child_id)
        except BaseException:  # a sample the core refused (ValueError), or Ctrl-C between two samples' adds
            self.core.abort_requests(added)
            self.output_processor.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort_request(request_id))
        self._held_outputs = [o for o in self._held_outputs if o.request_id != request_id]

    def has_unfinished_requests(self) -> bool:
        return (self.core.has_unfinished_requests() or self.output_processor.has_unfinished()
                or bool(self._held_outputs))

    def step(self) -> list[RequestOutput]:
        """One engine step: the user requests it updated. RequestsFailedError when requests failed in the core
        during the step (each one named; they are aborted): the step's other outputs come with the next call."""
        if self._held_outputs:  # the outputs of the step whose failure was raised last call
            held, self._held_outputs = self._held_outputs, []
            return held
        result = self.core.step()
        self.last_stats = result.stats
        outputs, to_abort = self.output_processor.process_outputs(result.outputs, time.time())
        if to_abort:
            self.core.abort_requests(to_abort)
        failed = self.core.pop_failed()
        if failed:  # a grammar that failed to compile against the tokenizer: the request's error
            failures: dict[str, str] = {}
            for req_id, message, _ in failed:
                # A sample of an n>1 request: the whole request fails (its first failed sample's message).
                parent = self.output_processor.parent_of(req_id)
                failures.setdefault(parent if parent is not None else req_id, message)
            for request_id in failures:
                self.core.abort_requests(self.output_processor.abort_request(request_id))
            # The other requests' outputs of this step are not lost: the next call returns them. Those of the
            # failed requests are dropped (an n>1 request's other samples may have produced some): after its
            # error, a request gets no update.
            self._held_outputs = [o for o in outputs if o.request_id not in failures]
            raise RequestsFailedError(failures)
        return outputs
