"""The in-process client: tokenizer + EngineCore + OutputProcessor in one loop (offline LLM, tests)."""

from __future__ import annotations

import time

from transformers import PreTrainedTokenizerBase

from kvserve.config import EngineConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.input_processor import InputProcessor, PromptType
from kvserve.engine.output_processor import OutputProcessor
from kvserve.protocol.outputs import RequestOutput
from kvserve.protocol.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.core = EngineCore(config)
        self.core.set_tokenizer(tokenizer)
        self.config = self.core.config
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(tokenizer, self.core.max_model_len, self.core.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer)
        self.last_stats = None
        self._held_outputs: list[RequestOutput] = []

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
        except ValueError:
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
            for req_id, _, _ in failed:
                parent = self.output_processor.parent_of(req_id)
                if parent is not None:
                    self.core.abort_requests(self.output_processor.abort_request(parent))
            # The other requests' outputs of this step are not lost: the next call returns them.
            self._held_outputs = outputs
            raise ValueError(failed[0][1])
        return outputs
