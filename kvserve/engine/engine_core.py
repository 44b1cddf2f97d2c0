"""The engine core: schedule -> execute -> update, one step at a time.

The same class runs in-process under the offline `LLM` (and tests) and inside the engine-core process
behind the server. It knows token ids only: tokenization, detokenization and stop strings live with the
caller (`OutputProcessor`).

With async scheduling (`--async-scheduling`, on by default on GPUs) a step launches step n+1 before it
reads step n's sampled tokens: the host's scheduling, input preparation and output handling then run
while the GPU computes, instead of between GPU steps. Each `step()` returns the outputs of the step
before the one it launched. The next input tokens are taken on the device, and so is the newest token of a
request whose sampling reads its own earlier output (penalties, min_tokens: the sampler counts it from the
previous step's sampled ids), so a request's tokens are computed exactly as step by step. What can differ is
the batches: a request that stopped on EOS or a stop string is computed for one more step (its output
dropped), and a request that will surely finish keeps its slot until its last token arrives. Batch
composition changes floating-point rounding (logprobs in the last digits, near-tied tokens), as other
requests coming and going do in either mode; unseeded draws from the shared generator shift too.

Structured output (`kvserve.structured_output`): a request with a grammar waits outside the scheduler while
its grammar compiles in a worker thread, then enters it. A step's token masks need the previous step's
tokens: for a step that samples a request its grammar still constrains, `step()` launches the forward pass,
then reads the previous step's tokens, advances the grammars and computes the masks while the GPU runs it,
and then launches the sampling with them. Other steps pipeline as usual.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvserve import distributed
from kvserve.config import ConfigError, EngineConfig, memory_size_text
from kvserve.core.outputs import EngineCoreOutput, SchedulerOutput, SchedulerStats
from kvserve.core.request import Request
from kvserve.core.scheduler import RequestRejected, Scheduler
from kvserve.engine.errors import EngineDeadError
from kvserve.executor.multiproc import TPWorkers
from kvserve.kernels import triton_precompile
from kvserve.model.tokenizer import load_tokenizer
from kvserve.protocol.engine import EngineCoreRequest
from kvserve.structured_output import GrammarCompiler, GrammarError, StructuredOutputs, grammar_for
from kvserve.worker.memory import gpu_capacity_hint
from kvserve.worker.model_runner import ModelRunner, PendingOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Where kvserve's Triton kernels live: variants loaded late are counted for these only.
KERNEL_MODULES = "kvserve."


@dataclass
class KVCapacity:
    num_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: named in the description unless "auto"

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens fit at once."""
        return self.num_tokens / self.max_model_len

    def describe(self) -> str:
        stored = "" if self.kv_cache_dtype == "auto" else f" ({self.kv_cache_dtype})"
        return (
            f"KV cache{stored}: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens; "
            f"max concurrency at max_model_len={self.max_model_len}: {self.max_concurrency:.2f}x"
        )


def capacity_hint(runner: ModelRunner, config: EngineConfig, blocks_needed: int) -> str:
    """Which flag to raise, and to what, for the KV cache to hold `blocks_needed` blocks (`runner`: rank 0's, whose
    memory profile sized it)."""
    per_block = runner.kv_cache_bytes_per_block()
    profile = runner.memory_profile
    if config.cache_config.num_blocks:  # set by the user: the sizing flags do not apply
        return f"raise --num-gpu-blocks-override (num_kv_blocks) to at least {blocks_needed}"
    if config.device_config.device == "cpu" or config.cache_config.gpu_kv_cache_memory_bytes is not None:
        return f"raise --kv-cache-memory to at least {memory_size_text(blocks_needed * per_block)}"
    if profile is not None:
        return gpu_capacity_hint(profile, config.cache_config.gpu_memory_utilization, per_block, blocks_needed)
    return f"raise --num-gpu-blocks-override (num_kv_blocks) to at least {blocks_needed}"


@dataclass
class EngineStepResult:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    num_scheduled_tokens: int
    num_scheduled_reqs: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        # Seconds spent in each start-up phase (benchmarks report them).
        self.startup_phases: dict[str, float] = {}
        # Tensor parallelism: the other ranks, which mirror every runner call below (executor.multiproc).
        self.workers: TPWorkers | None = None
        # Why the engine can take no more requests or steps (a tensor-parallel step failed while the other
        # ranks ran it: `_lockstep`; or `shutdown`), once it cannot.
        self._dead: str | None = None
        if config.tensor_parallel_size > 1:
            self.workers = TPWorkers(config)
        elif distributed.tp_size() > 1:
            # Layers read the process's group when built: this engine would be built as one rank of it.
            raise RuntimeError("a tensor-parallel engine is still running in this process: call its shutdown() "
                               "(LLM.shutdown) before starting another engine")
        try:
            self._start(config, start)
        except BaseException:
            self.shutdown()
            raise
        if self.workers is not None:
            self.workers.mark_started()

    def _start(self, config: EngineConfig, start: float) -> None:
        # Building the models meets no other rank (no collective): a rank that fails meanwhile is an error here,
        # however long the builds take.
        with self.workers.local_phase() if self.workers is not None else contextlib.nullcontext():
            self.runner = ModelRunner(config)
            if self.workers is not None:
                self.workers.gather()  # every rank has built its model
        self._mark_phase("model_init", start)
        cache = config.cache_config
        # Every rank's cache gets the smallest rank's block count; max_model_len auto follows from that number.
        num_blocks = cache.num_blocks or min(self._on_all_ranks("determine_num_blocks"))
        self._mark_phase("memory_profile", start)
        config = self._fit_max_model_len(config, num_blocks)
        self.capacity = KVCapacity(num_blocks, cache.block_size, config.model_config.max_model_len,
                                   cache.kv_cache_dtype)
        self._check_capacity(config)
        self.config = config.with_num_blocks(num_blocks)
        self._on_all_ranks("initialize_kv_cache", num_blocks)
        self._mark_phase("kv_cache_alloc", start)
        # Triton kernel variants loaded so far in this process (None: not counted, off CUDA).
        self._variants_seen: int | None = None
        precompiled = 0
        if self.runner.device.type == "cuda":
            triton_precompile.watch()
            self._on_all_ranks("precompile_kernels")
            self._mark_phase("triton_precompile", start)
            precompiled = triton_precompile.loaded_count()
            self._on_all_ranks("warm_up_kernels")
            self._mark_phase("kernel_warm_up", start)
            self._on_all_ranks("tune_gemms")
            self._mark_phase("gemm_tuning", start)
        self._on_all_ranks("capture_cuda_graphs")
        self._mark_phase("cuda_graph_capture", start)
        if self.runner.device.type == "cuda":
            self._on_all_ranks("warm_up_sampled_rows")
            self._mark_phase("sampled_rows_warm_up", start)
        # Variants the warm-up and capture loaded themselves (the precompile missed them), and those that
        # steps load later (the warm-up missed them: each stalls the step that first needs it). The count is
        # the process's: another engine starting in this process meanwhile adds its own loads to both.
        self.startup_late_variants: list[str] = []
        self.late_kernel_variants: list[str] = []
        if self.runner.device.type == "cuda":
            self.startup_late_variants = triton_precompile.loaded_since(precompiled, KERNEL_MODULES)
            self._variants_seen = triton_precompile.loaded_count()
        self.scheduler = Scheduler(
            self.config.scheduler_config,
            num_blocks=num_blocks,
            block_size=cache.block_size,
            enable_prefix_caching=cache.enable_prefix_caching,
        )
        model_config = config.model_config
        self.structured = StructuredOutputs(GrammarCompiler(
            lambda: load_tokenizer(model_config.tokenizer, model_config.chat_template),
            self.runner.arch.vocab_size, self.runner.eos_token_ids,
        ))
        # Requests with a grammar, until it is compiled: (request, group key, the compile). They enter the
        # scheduler then; the others go on meanwhile.
        self._awaiting_grammar: dict[str, tuple[Request, str | None, concurrent.futures.Future]] = {}
        # Requests whose grammar failed to compile, or failed while generating: (req_id, message, param), for the
        # caller (`pop_failed`).
        self._failed: list[tuple[str, str, str]] = []
        # Requests that end with no token once their prompt has run (the forward pass gives their
        # prompt_logprobs), with their finish reason: the one token they are scheduled for is dropped
        # (`_finish_in_flight`). A grammar that allows only EOS held back by min_tokens (`_admit_compiled`),
        # a request that asks for none (`EngineCoreRequest.prompt_only`).
        self._prompt_only: dict[str, str] = {}
        # Tests turn this on to run every stateful manager's invariant checks after each step.
        self.check_invariants_every_step = False
        self.async_scheduling = config.async_scheduling
        # The launched step whose sampled tokens the scheduler has not read yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None
        self.startup_s = time.perf_counter() - start
        logger.info("%s (engine ready in %.1f s)", self.capacity.describe(), self.startup_s)

    def _on_all_ranks(self, method: str, *args: Any) -> list[Any]:
        """Run a runner method on every rank at once (their forwards meet in the all-reduces): the results
        in rank order."""
        if self.workers is not None:
            self.workers.call(method, *args)
        result = getattr(self.runner, method)(*args)
        return [result, *(self.workers.gather() if self.workers is not None else [])]

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one). The core takes no requests or steps
        after: they raise EngineDeadError."""
        if self._dead is None:
            self._dead = "the engine was shut down"
        if hasattr(self, "structured"):
            self.structured.compiler.shutdown()
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def _mark_phase(self, name: str, start: float) -> None:
        if self.runner.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.runner.device)
        self.startup_phases[name] = time.perf_counter() - start - sum(self.startup_phases.values())

    def _fit_max_model_len(self, config: EngineConfig, num_blocks: int) -> EngineConfig:
        """max_model_len auto (vLLM's auto / -1): `config` with max_model_len lowered to the longest length one
        request can hold in `num_blocks` blocks (num_blocks x block_size, the length `_check_capacity` accepts:
        a whole number of blocks) when the model's own length does not fit, with a warning; on every rank, so that
        their CUDA graphs and checks are those of an engine started with that length. `config` itself otherwise:
        not auto, the model's length fits (an info line says so), or no length that a prompt can run in fits
        (fewer than 2 tokens: `_check_capacity` refuses it as for any length)."""
        model_len = config.model_config.max_model_len
        if not config.model_config.max_model_len_auto:
            return config
        fitted = num_blocks * config.cache_config.block_size
        if fitted >= model_len:
            logger.info("max_model_len auto: the KV cache holds %d tokens, enough for one request of the model's "
                        "length: max_model_len=%d", fitted, model_len)
            return config
        if fitted < 2:
            return config
        blocks_needed = -(-model_len // config.cache_config.block_size)
        fp8 = ("" if config.cache_config.num_blocks or config.cache_config.kv_cache_dtype.startswith("fp8") else
               ", or pass --kv-cache-dtype fp8 (one byte a value: twice the tokens in the same memory)")
        logger.warning(
            "max_model_len auto: the KV cache holds %d tokens (%d blocks x %d), fewer than one request of the "
            "model's length (%d) needs: max_model_len is lowered to %d. For the model's length: %s%s",
            fitted, num_blocks, config.cache_config.block_size, model_len, fitted,
            capacity_hint(self.runner, config, blocks_needed), fp8)
        self._on_all_ranks("set_max_model_len", fitted)
        return config.with_max_model_len(fitted)

    def _check_capacity(self, config: EngineConfig) -> None:
        cap = self.capacity
        if cap.num_tokens >= cap.max_model_len:
            return
        hint = capacity_hint(self.runner, config, -(-cap.max_model_len // cap.block_size))
        note = self.runner.gguf_capacity_note() if config.device_config.device != "cpu" else ""
        raise ConfigError(
            f"the KV cache holds {cap.num_tokens} tokens ({cap.num_blocks} blocks), fewer than one request "
            f"of max_model_len={cap.max_model_len} needs: {hint}, or lower --max-model-len{note}"
        )

    @property
    def eos_token_ids(self) -> list[int]:
        return self.runner.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.config.model_config.max_model_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (the logits' width): prompt and allowed token ids must be below it."""
        return self.runner.arch.vocab_size

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises RequestRejected when it can never be served, EngineDeadError when the engine
        has died or was shut down."""
        self._check_alive()
        vocab_size = self.vocab_size
        # A token id past the embedding table would crash the forward pass of the whole batch (and with
        # it the engine process): refuse it here. Tokenizers can be larger than the model's vocabulary.
        if request.prompt_token_ids and not 0 <= min(request.prompt_token_ids) <= max(request.prompt_token_ids) < vocab_size:
            raise RequestRejected(
                f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary size)", "prompt"
            )
        allowed = request.sampling_params.allowed_token_ids
        if allowed and max(allowed) >= vocab_size:
            # The sampler would mask every token out of such an id's row.
            raise RequestRejected(
                f"allowed_token_ids must be in [0, {vocab_size}) (the model's vocabulary size)", "allowed_token_ids"
            )
        core_request = Request(
            req_id=request.req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_ids=request.eos_token_ids,
            max_tokens=request.max_tokens,
            cache_salt=request.cache_salt,
            arrival_time=request.arrival_time or None,
            priority=request.priority,
        )
        if request.prompt_only:
            # NOTE: the prompt runs for one token (its step gives the prompt_logprobs), which
            # `_finish_in_flight` drops as it ends the request; no grammar constrains a token nobody sees.
            core_request.max_tokens = 1
            core_request.sampling_params = replace(request.sampling_params, structured_outputs=None)
        spec = core_request.sampling_params.structured_outputs
        if spec is None:
            if request.req_id in self._awaiting_grammar:
                raise RequestRejected(f"request id {request.req_id!r} is already in use", "request_id")
            self.scheduler.add_request(core_request, group_key=request.group_key)
            if request.prompt_only:
                self._prompt_only[request.req_id] = "length"
            return
        if request.req_id in self._awaiting_grammar or request.req_id in self.scheduler.requests:
            raise RequestRejected(f"request id {request.req_id!r} is already in use", "request_id")
        self.scheduler.check_request(core_request)
        try:
            grammar = grammar_for(spec)
        except GrammarError as e:
            raise RequestRejected(str(e), "structured_outputs") from None
        self._awaiting_grammar[request.req_id] = (core_request, request.group_key, self.structured.compiler.submit(grammar))

    def set_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """The tokenizer grammars are compiled against, when the caller has it already (in-process engines):
        the core then does not load its own."""
        self.structured.compiler.set_tokenizer_loader(lambda: tokenizer)

    def abort_requests(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            awaiting = self._awaiting_grammar.pop(req_id, None)
            if awaiting is not None:
                awaiting[2].cancel()
            self._prompt_only.pop(req_id, None)
        self.scheduler.abort_requests(req_ids)
        self.structured.release(req_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._awaiting_grammar)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's stats, with the requests whose grammar compiles counted as waiting (as vLLM counts
        them): they are queued, only not in the scheduler yet."""
        stats = self.scheduler.make_stats()
        stats.num_waiting_reqs += len(self._awaiting_grammar)
        return stats

    def unfinished_req_ids(self) -> set[str]:
        """The requests the core has taken and not finished: in the scheduler or waiting for their grammar."""
        return set(self.scheduler.requests) | set(self._awaiting_grammar)

    def pop_failed(self) -> list[tuple[str, str, str]]:
        """Requests dropped since the last call because their grammar failed to compile or failed while
        generating: (req_id, message, param). Their callers get the message as the request's error."""
        failed, self._failed = self._failed, []
        return failed

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move requests whose grammar is compiled into the scheduler. When nothing else can run, wait a
        little for a compile instead of spinning. Returns the outputs of requests that ended on admission."""
        awaiting = self._awaiting_grammar
        ended: list[EngineCoreOutput] = []
        if not awaiting:
            return ended
        if not self.scheduler.has_unfinished_requests() and self._in_flight is None:
            concurrent.futures.wait([f for _, _, f in awaiting.values()], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for req_id in [r for r, (_, _, future) in awaiting.items() if future.done()]:
            request, group_key, future = awaiting.pop(req_id)
            try:
                matcher = future.result()
            except Exception as e:  # GrammarError, or the tokenizer failed to load
                logger.warning("request %s: its grammar could not be compiled: %s", req_id, e)
                self._failed.append((req_id, str(e), "structured_outputs"))
                continue
            # The grammar's end is its EOS: where the model knows none, the one llguidance picked must end the
            # request too (known EOS ids are the request's already).
            request.eos_token_ids = request.eos_token_ids | self.structured.compiler.grammar_eos_token_ids
            self.structured.add(req_id, matcher)
            if self._min_tokens_hold_eos(request) and self.structured.ended(req_id):
                # The grammar allows only EOS from the first token on (its language is the empty text), which
                # min_tokens holds back: sampling would leave the grammar. It wins, as when it ends later
                # (`_finish_in_flight`): the request ends with no token.
                self.structured.release([req_id])
                if request.prompt_logprobs is None:
                    ended.append(EngineCoreOutput(req_id, [], finish_reason="stop"))
                    continue
                # NOTE: its prompt_logprobs come only from running the prompt: it runs, without the grammar,
                # for one token, which `_finish_in_flight` drops as it ends the request.
                request.sampling_params = replace(request.sampling_params, structured_outputs=None)
                request.max_tokens = 1
                self._prompt_only[req_id] = "stop"
            try:
                self.scheduler.add_request(request, group_key=group_key)
            except RequestRejected as e:  # checked on arrival; defensive
                self.structured.release([req_id])
                self._prompt_only.pop(req_id, None)
                self._failed.append((req_id, str(e), e.param))
        return ended

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry; only when no request is live or in flight. Returns whether it was
        done (vLLM's `reset_prefix_cache`)."""
        if self.has_unfinished_requests():
            return False
        return self.scheduler.kv.reset_prefix_cache()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    @contextlib.contextmanager
    def _lockstep(self) -> Iterator[None]:
        """A part of a step that the other tensor-parallel ranks run with rank 0: sending them the step, and
        rank 0's own launches (their forwards meet in the collectives). An exception here (out of memory, a
        bad input, Ctrl-C, a rank gone) leaves the ranks out of step: the others may wait in a collective rank
        0 will never join, or have run a step rank 0 did not, and the next step's collectives would pair with
        the wrong ones (a hang, a crash, or wrong tokens). Nothing brings them back in step, so the failure
        ends the engine, as vLLM's does: the other ranks are stopped at once (a rank blocked in a collective
        reads no message), and every later step raises EngineDeadError. The engine-core process
        exits on the error itself (the server reports the engine dead). With one rank, nothing happens here."""
        workers = self.workers
        if workers is None:
            yield
            return
        workers.in_step = True
        try:
            yield
        except BaseException as e:
            gone = workers.exited()
            self._dead = (f"a tensor-parallel step failed while the other ranks ran it ({type(e).__name__}: {e}"
                          f"{'; ' + ', '.join(gone) + ' had exited' if gone else ''}); the ranks are out of step "
                          "and were stopped: make a new engine")
            logger.error("%s", self._dead)
            self.workers = None
            workers.close(kill=True)
            raise
        finally:
            workers.in_step = False  # after close: the monitor reads it to tell a failing step (see _watch)

    def step(self) -> EngineStepResult:
        """Schedule and launch one step; return the outputs of the step whose tokens arrived (this one
        without async scheduling, the previous one with it). With tensor parallelism, Ctrl-C (SIGINT) in the
        main thread raises KeyboardInterrupt when this returns (`_interrupts_deferred`), so that it leaves the
        ranks in step; a second one raises at once (which ends the engine inside `_lockstep`, and is an ordinary
        interrupt elsewhere: the ranks are in step there)."""
        self._check_alive()
        if self.workers is None:
            return self._step()
        with _interrupts_deferred():
            return self._step()

    def _step(self) -> EngineStepResult:
        outputs = self._admit_compiled()
        scheduler_output = self.scheduler.schedule()
        sampling = [s.req_id for s in scheduler_output.scheduled if s.sample] if len(self.structured) else []
        # A grammar's mask for this step needs the previous step's tokens when that step is in flight: the
        # masks are computed after the forward's launch, the sampling's launch waits for them.
        masks_later = self._in_flight is not None and self.structured.constrains_any(sampling)
        if sampling and not masks_later:
            scheduler_output.grammar_bitmask = self.structured.bitmasks(sampling)
        with self._lockstep():
            if self.workers is not None:
                self.workers.step(scheduler_output, finish_previous_first=self._in_flight is None,
                                  masks_follow=masks_later)
            if masks_later:
                launched = self.runner.launch_forward(scheduler_output)
            else:
                pending = self.runner.execute_model_async(scheduler_output)
        if masks_later:
            try:
                self.scheduler.cache_scheduled_blocks()
                # The GPU runs the forward: read the previous step's tokens and advance the grammars meanwhile.
                outputs.extend(self._finish_in_flight())
                scheduler_output.grammar_bitmask = self.structured.bitmasks(sampling)
            except BaseException:
                # The other ranks wait for this step's masks: the step is sampled without them and dropped
                # (as a step launched before a failure is), so that every rank stays in step.
                with self._lockstep():
                    if self.workers is not None:
                        self.workers.send_masks({})
                    self.runner.sample(launched, {})
                raise
            with self._lockstep():
                if self.workers is not None:
                    self.workers.send_masks(scheduler_output.grammar_bitmask)
                pending = self.runner.sample(launched, scheduler_output.grammar_bitmask)
        else:
            # The step's new blocks are hashed for the prefix cache here, while the GPU computes, instead of
            # before the launch. Before the wait below, so the hashing overlaps the GPU.
            self.scheduler.cache_scheduled_blocks()
            # The GPU now works on this step: read the previous one's tokens meanwhile.
            if self._in_flight is not None:
                outputs.extend(self._finish_in_flight())
        self._in_flight = (scheduler_output, pending)
        if not self.async_scheduling or scheduler_output.is_empty:
            outputs.extend(self._finish_in_flight())
        if self.check_invariants_every_step:
            self.check_invariants(incremental=True)
        if self._variants_seen is not None and triton_precompile.loaded_count() != self._variants_seen:
            self._note_late_variants()
        return EngineStepResult(
            outputs=outputs,
            stats=self.make_stats(),
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            num_scheduled_reqs=len(scheduler_output.scheduled),
        )

    def check_invariants(self, incremental: bool = False) -> None:
        """Every stateful manager's invariants. `incremental` (after each step): the block pool checks only what
        its methods changed since its last check, and walks the whole pool when due (`BlockPool.check_invariants`)."""
        self.scheduler.check_invariants(incremental)
        self.runner.check_invariants()
        assert not set(self._awaiting_grammar) & set(self.scheduler.requests), "a request both queued and compiling"
        self.structured.check_invariants(self.scheduler.requests)
        assert set(self._prompt_only) <= set(self.scheduler.requests), \
            f"prompt-only requests that are not live: {sorted(set(self._prompt_only) - set(self.scheduler.requests))}"
        # Exact, with or without async scheduling, between steps: each schedule()'s output is applied by the runner
        # at its launch, within the same step. A request finished since (while its step was in flight, or aborted)
        # stays in the runner until the next output's finished_req_ids releases it (with no further step, as on
        # an idle engine, until the next request's), and the scheduler counts it among those meanwhile.
        held, told = set(self.runner.requests), self.scheduler.runner_req_ids()
        assert held == told, (
            f"the runner holds requests {sorted(held - told)} the scheduler does not count on it holding, "
            f"and lacks {sorted(told - held)}"
        )

    def _note_late_variants(self) -> None:
        assert self._variants_seen is not None
        before, count = self._variants_seen, triton_precompile.loaded_count()
        late = triton_precompile.loaded_since(before, KERNEL_MODULES)
        self._variants_seen = count
        if not late:
            return  # another Triton user in this process
        self.late_kernel_variants.extend(late)
        keys = "; ".join(triton_precompile.keys_since(before))
        logger.warning("a step loaded %d Triton kernel variant(s) that start-up did not warm up (%s); the step "
                       "waited for their compile%s", len(late), ", ".join(late), f" (keys: {keys})" if keys else "")

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        assert self._in_flight is not None
        scheduler_output, pending = self._in_flight
        self._in_flight = None
        outputs = self.scheduler.update_from_output(scheduler_output, pending.result())
        if self._prompt_only:
            for output in outputs:
                if output.req_id in self._prompt_only:  # its prompt has run: it ends with no token
                    output.finish_reason = self._prompt_only.pop(output.req_id)
                    output.new_token_ids, output.new_logprobs, output.stop_token_id = [], None, None
        structured = self.structured
        if len(structured):
            failed: set[str] = set()
            for output in outputs:
                if output.req_id not in structured:
                    continue
                if not output.finished:
                    error = structured.accept(output.req_id, output.new_token_ids)
                    if error is not None:
                        # It cannot follow its grammar any more: it fails, rather than going on unconstrained
                        # to a text outside the grammar that would end as if it were whole.
                        spec = self.scheduler.requests[output.req_id].sampling_params.structured_outputs
                        if spec is not None:
                            structured.compiler.forget(grammar_for(spec))
                        self.abort_requests([output.req_id])
                        self._failed.append((output.req_id, f"the structured output's grammar failed while "
                                             f"generating: {error}", "structured_outputs"))
                        failed.add(output.req_id)
                        continue
                    if structured.ended(output.req_id) and self._min_tokens_hold_eos(
                            self.scheduler.requests[output.req_id]):
                        # The grammar allows only EOS, which min_tokens holds back: nothing could follow but
                        # a token outside the grammar. The grammar wins: the request ends here.
                        self.scheduler.stop_request(output.req_id)
                        output.finish_reason = "stop"
                if output.finished:
                    structured.release([output.req_id])
            if failed:
                outputs = [output for output in outputs if output.req_id not in failed]
        return outputs

    @staticmethod
    def _min_tokens_hold_eos(request: Request) -> bool:
        """Whether min_tokens keeps EOS from being the request's next token (the sampler's rule)."""
        params = request.sampling_params
        return not params.ignore_eos and len(request.output_token_ids) < params.min_tokens


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C (SIGINT) inside the block raises KeyboardInterrupt when the block ends instead of wherever it
    lands (between two of a step's collectives, say); a second one inside raises at once. Only in the main
    thread with Python's own SIGINT handler (the engine-core process ignores SIGINT; a handler the user set
    is left alone)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    interrupted = False

    def defer(signum: int, frame: object) -> None:
        nonlocal interrupted
        if interrupted:
            raise KeyboardInterrupt
        interrupted = True

    signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        raise KeyboardInterrupt
