"""The API process's engine: tokenizer + OutputProcessor + a client of the engine-core process.

The asyncio counterpart of `LLMEngine`: `generate()` queues one user request (all its n samples) in the
engine core and yields `RequestOutput` updates as the core's steps arrive. Each user request has an
asyncio queue; the client's reader task detokenizes every step's outputs (`OutputProcessor`) and puts
each request's update on its queue, so a slow client never stalls the others.

Leaving the `generate()` iterator early (client disconnect, cancellation) aborts the request in the
engine core, which frees its KV blocks in its next loop iteration.

The engine core knows each request by an id of its own, the caller's id with a suffix unique to this
process and request (`<id>-<process index>-<serial>`, n>1 samples prefixed as usual). The caller's id is only
a label (updates carry it; `has_request` and `abort` go by it): several live requests may share it, as the
prompts of one multi-prompt completion do, and requests whose ids clients chose cannot collide in the core
whatever those ids are. The core's abort of a finished or abandoned request is still on its way when the
caller may reuse the id (a client's own X-Request-Id): the old request's late outputs and failures then match
no live request instead of the new one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from kvserve.config import EngineConfig
from kvserve.core.outputs import SchedulerStats
from kvserve.engine.core_client import EngineAttachment, EngineCoreClient, EngineDeadError
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.output_processor import OutputProcessor, child_request_id
from kvserve.metrics.stats import IterationStats, RequestStatsTracker, StatLogger
from kvserve.model.tokenizer import load_tokenizer
from kvserve.protocol.core_messages import EngineOutputs, EngineReady, RequestFailed
from kvserve.protocol.outputs import RequestOutput
from kvserve.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestFailedError(ValueError):
    """The engine core refused the request (it can never be served); `param` names the cause."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class _RequestState:
    request_id: str  # the caller's
    core_id: str  # the engine core's (and the OutputProcessor's) id of the request
    queue: asyncio.Queue[RequestOutput | Exception]
    child_ids: list[str]  # the engine core's ids of its samples
    finished_children: set[str]


def merge_updates(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One update for two consecutive updates of a request: `later` with `earlier`'s deltas in front of its
    own. Everything else in an update is cumulative, so `later`'s is already right."""
    later_outputs = {c.index: c for c in later.outputs}
    for before in earlier.outputs:
        completion = later_outputs[before.index]  # every update carries all of its request's samples
        completion.text_delta = before.text_delta + completion.text_delta
        completion.token_ids_delta = before.token_ids_delta + completion.token_ids_delta
    return later


class AsyncLLM:
    """Use from one event loop: `await start()`, then `generate()` from any number of tasks."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None = None,
        stat_loggers: list[StatLogger] | None = None,
        log_level: str = "INFO",
        api_server_count: int = 1,
        attach: EngineAttachment | None = None,
    ) -> None:
        """`tokenizer` None: `start()` loads the model's (while the engine process loads the model).
        `api_server_count` and `attach`: see `EngineCoreClient`."""
        self.config = config
        self._tokenizer = tokenizer
        self.stat_loggers = list(stat_loggers or [])
        self.client = EngineCoreClient(config, self, log_level, api_server_count, attach)
        self._output_processor: OutputProcessor | None = None
        self._input_processor: InputProcessor | None = None
        self.ready: EngineReady | None = None
        self.last_stats: SchedulerStats | None = None
        self._by_core_id: dict[str, _RequestState] = {}  # every live request
        self._num_by_request_id: dict[str, int] = {}  # live requests per caller's id
        self._by_child_id: dict[str, _RequestState] = {}
        self._serials = itertools.count()
        self._tracker = RequestStatsTracker()
        self._aborted_all = False  # abort_all has run: every later request ends at once (see there)
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> EngineReady:
        """Start the engine-core process and wait until it is ready. Raises EngineDeadError when the engine
        fails to start, ModelLoadError when the tokenizer cannot be loaded (the engine is shut down then)."""
        engine_started = asyncio.ensure_future(self.client.start())
        try:
            if self._tokenizer is None:
                model = self.config.model_config
                self._tokenizer = await asyncio.to_thread(load_tokenizer, model.tokenizer, model.chat_template)
            self.ready = await engine_started
            # max_model_len auto, lowered by the engine: this process's config says so too (tests' fakes have none)
            config: EngineConfig | None = self.config
            if config is not None and self.ready.max_model_len < config.model_config.max_model_len:
                self.config = config.with_max_model_len(self.ready.max_model_len)
        except BaseException:
            engine_started.cancel()
            await self.client.shutdown()
            raise
        self._output_processor = OutputProcessor(self._tokenizer)
        self._input_processor = InputProcessor(self._tokenizer, self.ready.max_model_len, self.ready.eos_token_ids,
                                               self.ready.vocab_size)
        return self.ready

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        assert self._tokenizer is not None, "start() first"
        return self._tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        assert self._input_processor is not None, "start() first"
        return self._input_processor

    @property
    def output_processor(self) -> OutputProcessor:
        assert self._output_processor is not None, "start() first"
        return self._output_processor

    async def shutdown(self) -> None:
        await self.client.shutdown()

    @property
    def is_alive(self) -> bool:
        return self.client.is_alive

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.client.dead_error

    @property
    def max_model_len(self) -> int:
        assert self.ready is not None, "start() first"
        return self.ready.max_model_len

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._by_core_id)

    def has_request(self, request_id: str) -> bool:
        """Whether a live request has the caller's id `request_id`."""
        return request_id in self._num_by_request_id

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        self._dead_callbacks.append(callback)

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        prompt_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its updates; the last one has `finished=True`.

        Each update's CompletionOutputs carry that update's `text_delta` / `token_ids_delta`; their
        `logprobs` list is cumulative and consistent with the update (the last `len(token_ids_delta)`
        entries belong to the delta). An update covers one engine step, or every step that arrived
        since the caller last asked, when it falls behind. Raises EngineDeadError when the engine is gone and
        RequestFailedError when the core refuses the request. Closed before its last update, it aborts the request
        (finish reason "abort" in the metrics); an exception thrown in at an update (`athrow`: the caller failed)
        ends it as failed ("error"), as the engine's own failures do. After `abort_all`, ends the request at once
        (finish reason "abort"; see there). `request_id` need not be unique (module
        docstring). `prompt_only`: the prompt runs
        (for its prompt_logprobs) and the request ends with no token, finish_reason "length".
        """
        if self.dead_error is not None:
            raise self.dead_error
        self.input_processor.check_token_ids(params)
        params = self.input_processor.resolve_bad_words(params)
        # (the server truncates while preparing, to count the kept tokens; the Triton backend does not)
        prompt_token_ids = self.input_processor.truncate(prompt_token_ids, params)
        now = time.time()
        core_id = f"{request_id}-{self.client.index}-{next(self._serials)}"
        children = self.output_processor.add_request(core_id, prompt, prompt_token_ids, params, now)
        group_key = core_id if params.n > 1 else None
        requests = [
            self.input_processor.make_engine_request(
                child_id, prompt_token_ids, child_params, cache_salt, group_key, now, priority, prompt_only
            )
            for child_id, child_params in children
        ]
        state = _RequestState(request_id, core_id, asyncio.Queue(), [c for c, _ in children], set())
        self._num_by_request_id[request_id] = self._num_by_request_id.get(request_id, 0) + 1
        self._by_core_id[core_id] = state
        for request in requests:
            self._by_child_id[request.req_id] = state
        self._tracker.add_group([r.req_id for r in requests], now, len(prompt_token_ids), requests[0].max_tokens)
        finished = False
        engine_failed = False  # the engine died under it: it failed rather than was aborted
        caller_failed = False  # the caller's own error, thrown in at an update: failed too (not a disconnect)
        failure: Exception | None = None
        try:
            if self._aborted_all:
                # Prepared while abort_all ran (the server's drain ran out of time while the prompt was being
                # tokenized): it ends as abort_all ended those before it, and never reaches the core, which is
                # about to stop.
                final = self._abort(state, in_core=False)
                assert final is not None
                final.request_id = request_id
                finished = True
                yield final
                return
            await self.client.add_requests(requests)
            while True:
                item = failure if failure is not None else await state.queue.get()
                if isinstance(item, Exception):
                    engine_failed = isinstance(item, EngineDeadError)
                    raise item
                # Updates of several engine steps queue up when this consumer falls behind (the reader
                # handles the waiting steps for up to a slice before the consumers run): they go out as one
                # update, so a lagging server writes fewer, larger chunks instead of falling further behind.
                while not item.finished and not state.queue.empty():
                    later = state.queue.get_nowait()
                    if isinstance(later, Exception):
                        failure = later  # raised after what came before it
                        break
                    item = merge_updates(item, later)
                finished = item.finished
                try:
                    yield item
                except Exception:
                    # The caller failed while handling the request (`serving_common.closing_updates` throws its
                    # error in here): counted as failed ("error"), not as aborted, which a client that left is.
                    caller_failed = True
                    raise
                if finished:
                    return
        finally:
            if not finished:
                self._abort(state, failed=engine_failed, caller_failed=caller_failed)
            self._forget(state)

    def abort(self, request_id: str) -> None:
        """Abort every live request with the caller's id `request_id` (all their samples). Each one's
        `generate()` iterator, when another task reads it, gets a last update: finished, each unfinished sample
        with finish reason "abort"."""
        if request_id not in self._num_by_request_id:
            return
        for state in [s for s in self._by_core_id.values() if s.request_id == request_id]:
            final = self._abort(state)
            if final is not None:
                final.request_id = request_id
                state.queue.put_nowait(final)

    def abort_all(self) -> int:
        """Abort every live request as `abort` does (each one's iterator gets its last update, finish reason
        "abort" for its unfinished samples); returns how many there were. The server's drain calls it when
        --shutdown-timeout runs out, so that the responses still in flight end.

        From then on `generate()` ends every new request the same way at once (its one update: finished, each
        sample with finish reason "abort" and no token), without sending it to the core: the requests the
        server was still preparing (tokenizing) then end like the others instead of starting to run in an
        engine that is about to stop (and being cut off when the server exits)."""
        self._aborted_all = True
        states = list(self._by_core_id.values())
        for state in states:
            final = self._abort(state)
            if final is not None:
                final.request_id = state.request_id
                state.queue.put_nowait(final)
        return len(states)

    def _abort(self, state: _RequestState, in_core: bool = True, failed: bool = False,
               caller_failed: bool = False) -> RequestOutput | None:
        """End a live request: its samples counted as aborted (as failed with `failed`: see
        `RequestStatsTracker.fail`; with `caller_failed`, the caller's own error, every live sample as "error",
        also one the core had not run yet: none was refused), the core told (unless `in_core` is False: it was
        never sent there), the request forgotten. Returns its last update (None if it had ended)."""
        child_ids, final = self.output_processor.abort_request_with_output(state.core_id)
        if in_core:
            self.client.abort_requests(child_ids)
        now = time.time()
        iteration = IterationStats()
        for child_id in child_ids:
            if caller_failed:
                self._tracker.finish(child_id, "error", now, iteration)
            elif failed:
                self._tracker.fail(child_id, now, iteration)
            else:
                self._tracker.finish(child_id, "abort", now, iteration)
        self._record(None, iteration)
        self._forget(state)
        return final

    def _forget(self, state: _RequestState) -> None:
        if self._by_core_id.pop(state.core_id, None) is None:
            return  # forgotten already
        num_left = self._num_by_request_id.pop(state.request_id) - 1
        if num_left:
            self._num_by_request_id[state.request_id] = num_left
        for child_id in state.child_ids:
            del self._by_child_id[child_id]

    # ------------------------------------------------------------------ EngineMessageHandler

    def on_engine_outputs(self, message: EngineOutputs) -> None:
        now = time.time()
        self.last_stats = message.stats
        iteration = IterationStats()
        for out in message.outputs:
            self._tracker.on_output(out, now, iteration)
        updates, stopped_by_string = self.output_processor.process_outputs(message.outputs, now)
        if stopped_by_string:
            self.client.abort_requests(stopped_by_string)
        for update in updates:
            state = self._by_core_id.get(update.request_id)
            n = len(update.outputs)
            for completion in update.outputs:
                child_id = child_request_id(update.request_id, completion.index, n)
                if completion.logprobs is not None:
                    # The live list keeps growing; the consumer may read this update later.
                    completion.logprobs = list(completion.logprobs)
                if completion.finished and state is not None and child_id not in state.finished_children:
                    state.finished_children.add(child_id)
                    self._tracker.finish(child_id, completion.finish_reason or "stop", now, iteration)
            if state is not None:
                update.request_id = state.request_id
                state.queue.put_nowait(update)
        self._record(message.stats, iteration)

    def on_request_failed(self, message: RequestFailed) -> None:
        state = self._by_child_id.get(message.req_id)
        if state is None:
            return
        # Its samples end without counting an abort: as failed if they ran (a grammar that failed while
        # generating), uncounted if not (refused on arrival). The core aborted them already when it refused
        # the request on arrival, not when it dropped one later (a grammar that failed to compile): abort
        # them there too (ids it no longer has are ignored).
        children = self.output_processor.abort_request(state.core_id)
        now = time.time()
        iteration = IterationStats()
        for child_id in children:
            self._tracker.fail(child_id, now, iteration)
        self._record(None, iteration)
        if children:
            self.client.abort_requests(children)
        state.queue.put_nowait(RequestFailedError(message.message, message.param))

    def on_engine_dead(self, error: EngineDeadError) -> None:
        for state in self._by_core_id.values():
            state.queue.put_nowait(error)
        for callback in self._dead_callbacks:
            callback(error)

    def _record(self, stats: SchedulerStats | None, iteration: IterationStats) -> None:
        if stats is None and iteration.is_empty:
            return
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats, iteration)
            except Exception:  # metrics must never take the server down
                logger.exception("stat logger %r failed", stat_logger)
