"""Turns engine-core token outputs into text outputs: detokenization, stop strings, logprobs, n>1 groups.

Runs next to the tokenizer (the offline `LLM`, or the API process). A stop string ends a request here, so
the caller must abort it in the engine core: `process_outputs` returns those ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from kvserve.core.outputs import EngineCoreOutput
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.stop_checker import StopChecker
from kvserve.protocol.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.protocol.sampling_params import SamplingParams


@dataclass
class _SampleState:
    """One engine request = one sample (index) of a user request."""

    parent: _ParentState
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker | None
    output: CompletionOutput
    emitted_chars: int = 0


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_SampleState] = field(default_factory=list)
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.output.finished for s in self.samples)

    def snapshot(self) -> RequestOutput:
        """A copy whose deltas and text stay as they are now; cumulative token_ids/logprobs lists are
        shared with the live state until the request finishes (streaming readers use the deltas)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output.copy() for s in self.samples],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._samples: dict[str, _SampleState] = {}
        self._parents: dict[str, _ParentState] = {}
        # each token id's text, decoded once (a prompt's logprobs decode thousands of mostly repeated ids)
        self._token_texts: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a user request; returns the (engine request id, params) of each of its samples."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        parent = _ParentState(request_id, prompt, list(prompt_token_ids), arrival_time=arrival_time)
        children = []
        for index in range(params.n):
            child_params = params.for_sample(index) if params.n > 1 else params
            child_id = child_request_id(request_id, index, params.n)
            stop = child_params.stop_strings
            sample = _SampleState(
                parent=parent,
                index=index,
                params=child_params,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=child_params.skip_special_tokens,
                    spaces_between_special_tokens=child_params.spaces_between_special_tokens,
                ),
                stop_checker=StopChecker(stop, child_params.include_stop_str_in_output) if stop else None,
                output=CompletionOutput(
                    index=index,
                    logprobs=[] if child_params.logprobs is not None else None,
                    cumulative_logprob=0.0 if child_params.logprobs is not None else None,
                ),
            )
            parent.samples.append(sample)
            self._samples[child_id] = sample
            children.append((child_id, child_params))
        self._parents[request_id] = parent
        return children

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def parent_of(self, child_id: str) -> str | None:
        """The user request an engine request id (a sample) belongs to, while it is live."""
        sample = self._samples.get(child_id)
        return sample.parent.request_id if sample is not None else None

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a user request; returns the engine ids of its samples still to abort in the core."""
        return self.abort_request_with_output(request_id)[0]

    def abort_request_with_output(self, request_id: str) -> tuple[list[str], RequestOutput | None]:
        """`abort_request`, with the request's last update: finished, its unfinished samples with finish
        reason "abort" and no new text (None when the request is not live)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return [], None
        ids = []
        for sample in parent.samples:
            child_id = child_request_id(request_id, sample.index, len(parent.samples))
            self._samples.pop(child_id, None)
            if not sample.output.finished:
                sample.output.finish_reason = "abort"
                ids.append(child_id)
            sample.output.text_delta = ""
            sample.output.token_ids_delta = []
        return ids, parent.snapshot()

    def process_outputs(
        self, engine_outputs: Sequence[EngineCoreOutput], now: float = 0.0
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns (updated user requests, engine ids to abort for stop strings).

        Each returned RequestOutput carries this step's deltas in its CompletionOutputs; finished user
        requests are forgotten after being returned.
        """
        updated: dict[str, _ParentState] = {}
        to_abort: list[str] = []
        for out in engine_outputs:
            sample = self._samples.get(out.req_id)
            if sample is None or sample.output.finished:
                continue
            parent = sample.parent
            if parent.first_token_time is None and out.new_token_ids:
                parent.first_token_time = now
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
                decode = sample.params.detokenize
                parent.prompt_logprobs = [None] + [self._logprob_dict(e.token_ids, e.logprobs, e.rank, decode)
                                                   for e in out.prompt_logprobs]
            stopped_by_string = self._apply(sample, out)
            if stopped_by_string and not out.finished:
                to_abort.append(out.req_id)
            updated[parent.request_id] = parent
        results = []
        for parent in updated.values():
            results.append(parent.snapshot())
            # Deltas belong to this step's snapshot only: a sample with no output next step must not
            # repeat them (n>1 samples finish at different steps).
            for s in parent.samples:
                s.output.text_delta = ""
                s.output.token_ids_delta = []
            if parent.finished:
                del self._parents[parent.request_id]
                for s in parent.samples:
                    self._samples.pop(child_request_id(parent.request_id, s.index, len(parent.samples)), None)
        return results, to_abort

    def _apply(self, sample: _SampleState, out: EngineCoreOutput) -> bool:
        """Fold one engine output into the sample. Returns True when a stop string ended it."""
        output = sample.output
        output.token_ids_delta = list(out.new_token_ids)
        output.text_delta = ""
        output.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and output.logprobs is not None:
            for entry in out.new_logprobs:
                output.logprobs.append(self._logprob_dict(entry.token_ids, entry.logprobs, entry.rank,
                                                          sample.params.detokenize))
                output.cumulative_logprob = (output.cumulative_logprob or 0.0) + entry.logprobs[0]
        shown = out.new_token_ids
        if out.finished and out.stop_token_id is not None and shown and not sample.params.include_stop_str_in_output:
            # The engine ended it on a token (EOS or a stop_token_ids entry): that token is not shown as text.
            # (A "stop" without one, a grammar that ended, shows all of its tokens.)
            shown = shown[:-1]
        if not sample.params.detokenize:  # token ids only (stop strings need text: refused with this)
            if out.finished:
                self._finish_as_engine(sample, out)
            return False
        sample.detokenizer.add_tokens(shown)
        if out.finished:
            # Nothing more will come to complete a held-back partial character: show it as it is.
            sample.detokenizer.flush()
        text = sample.detokenizer.output_text
        stopped = False
        # Stop strings count from the token after min_tokens on, as vLLM checks them.
        if sample.stop_checker is not None and len(output.token_ids) > sample.params.min_tokens:
            result = sample.stop_checker.check(text, len(text) - len(output.text))
            if result is not None:
                text = result.text
                output.finish_reason = "stop"
                output.stop_reason = result.stop_str
                stopped = True
        if not stopped and out.finished:
            self._finish_as_engine(sample, out)
        output.text = text
        # Stream only what can no longer turn out to be part of a stop string.
        if output.finished or sample.stop_checker is None:
            emit_upto = len(text)
        else:
            emit_upto = sample.stop_checker.safe_emit_len(text)
        if emit_upto > sample.emitted_chars:
            output.text_delta = text[sample.emitted_chars : emit_upto]
            sample.emitted_chars = emit_upto
        return stopped

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _finish_as_engine(self, sample: _SampleState, out: EngineCoreOutput) -> None:
        sample.output.finish_reason = out.finish_reason
        # vLLM's stop_reason: the id of the token that ended it (a stop_token_ids entry, or one of the generation
        # config's EOS ids beyond the tokenizer's), except the tokenizer's own EOS, which vLLM checks first: None
        # (unless ignore_eos, when only a stop_token_ids entry can have ended it).
        token = out.stop_token_id
        primary_eos = token is not None and token == self.tokenizer.eos_token_id and not sample.params.ignore_eos
        sample.output.stop_reason = None if primary_eos else token

    def _logprob_dict(self, token_ids: list[int], logprobs: list[float], rank: int,
                      decode: bool = True) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
            if tid in entry:
                continue
            entry[tid] = Logprob(
                logprob=lp,
                rank=rank if i == 0 else i,
                decoded_token=self._token_text(tid) if decode else None,
            )
        return entry
