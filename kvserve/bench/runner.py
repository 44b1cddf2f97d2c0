"""`kvserve bench` from configuration to printed report: warm-up, one run per load shape (with server
metrics sampling and the client's own health check), token-count fallback, JSON, plot, comparison."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

import httpx
from tqdm import tqdm

from kvserve.bench.client import ClientSettings, RequestRecord, StreamClient, fetch_model_names
from kvserve.bench.client_health import ClientHealthMonitor, ClientHealthReport
from kvserve.bench.config import BenchConfig, BenchConfigError, LoadShape
from kvserve.bench.datasets import BenchRequest, Dataset, Requests, RunRequests, TextTokenizer, make_dataset
from kvserve.bench.load import LoadResult, run_load
from kvserve.bench.report import format_compare, format_summary, format_sweep
from kvserve.bench.results import BenchResult, RunResult, jsonable, read_json, write_json
from kvserve.bench.server_metrics import MetricSample, ServerMetricsSampler, summarize_samples
from kvserve.bench.summary import summarize
from kvserve.engine.heap import frozen_heap


class BenchError(ValueError):
    """The benchmark cannot run (server unreachable, no model to name); the message says what to do."""


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str) -> TextTokenizer:
    from kvserve.model.paths import resolve_tokenizer_path
    from kvserve.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_tokenizer_path(path))  # a repo id: its snapshot in the local HF cache


class LazyTokenizer:
    """The local tokenizer, loaded on first use: `--tokenizer`, else the default model's. Only datasets that
    generate text and requests whose server sent no `usage` need it."""

    def __init__(self, path: str | None, log: TextIO) -> None:
        self.path = path
        self.log = log
        self._tokenizer: TextTokenizer | None = None

    def __call__(self) -> TextTokenizer:
        if self._tokenizer is None:
            path = self.path
            if path is None:
                from kvserve.model.paths import default_model_path

                path = default_model_path()
            print(f"loading tokenizer {path}", file=self.log)
            self._tokenizer = _load_tokenizer(path)
        return self._tokenizer


def count_missing_tokens(records: list[RequestRecord], dataset: Requests, tokenizer: LazyTokenizer, api: str,
                         warmup: bool = False, keep_text: bool = False) -> None:
    """Token counts of successful requests whose server sent no `usage`, with the local tokenizer. The chat
    prompt is counted through the tokenizer's chat template when it has one (the server's template may
    differ: these counts are estimates, and the report says how many requests used them)."""
    for record in records:
        if record.success and record.token_source is None:
            tok = tokenizer()
            record.output_tokens = len(tok.encode(record.output_text, add_special_tokens=False))
            request = dataset.get(record.index, warmup)
            record.prompt_tokens = _count_prompt(tok, request.messages, request.prompt(), api)
            record.token_source = "tokenizer"
        if keep_text:  # --save-detailed: vLLM's generated_texts
            record.generated_text = record.output_text
        record.output_text = ""


def _count_prompt(tok: Any, messages: tuple[dict[str, str], ...], prompt: str, api: str) -> int:
    if api in ("chat", "responses") and getattr(tok, "chat_template", None):
        try:
            ids = tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding (a mapping)
                ids = ids["input_ids"]
            return len(ids)
        except Exception:  # a template that rejects these messages: count the text instead
            pass
    return len(tok.encode(prompt, add_special_tokens=True))


class _Progress:
    """The live bar: completed requests (of `num_prompts` when known) and failures so far."""

    def __init__(self, shape: LoadShape, enabled: bool | None, desc: str) -> None:
        if shape.num_prompts is None and shape.duration_s is not None:
            desc = f"{desc} ({shape.duration_s:g} s)"
        self.bar = tqdm(total=shape.num_prompts, desc=desc, unit="req", disable=None if enabled is None else
                        not enabled, dynamic_ncols=True, leave=False, file=sys.stderr)
        self.failed = 0

    def on_done(self, record: RequestRecord) -> None:
        if not record.success:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def shape_dict(shape: LoadShape) -> dict[str, Any]:
    return jsonable(dataclasses.asdict(shape))


# Seconds between attempts while --ready-check-timeout-sec waits for the server (vLLM's interval).
READY_RETRY_S = 5.0
# Answers of a server (or a proxy before it) that is up but not serving yet: waited out like a refused connection.
_NOT_READY_STATUSES = (502, 503, 504)


async def _wait_for_models(config: BenchConfig, log: TextIO) -> list[str]:
    """The server's model listing, waiting up to `ready_check_timeout_s` for the server to come up (a refused
    connection, a timeout, or a 502/503/504): one line on `log` per attempt that failed, with the time left.
    Raises BenchError when it is not up in time (at once without a wait), httpx.HTTPStatusError for another
    error status (a server without /models)."""
    wait_s = config.ready_check_timeout_s
    start = time.monotonic()
    deadline = start + wait_s
    if wait_s > 0:
        print(f"waiting up to {wait_s:g} s for the server at {config.api_base} to come up", file=log)
    while True:
        try:
            return await fetch_model_names(config.api_base, config.api_key,
                                           timeout_s=min(10.0, max(1.0, deadline - time.monotonic())))
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code not in _NOT_READY_STATUSES or wait_s <= 0:
                raise
            reason = f"{config.api_base}/models answered {exc.response.status_code}"
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
        left = deadline - time.monotonic()
        if left <= 0:
            if wait_s <= 0:
                raise BenchError(f"cannot reach the server at {config.api_base}: {reason} (vLLM's "
                                 "--ready-check-timeout-sec N waits up to N s for it to come up)")
            raise BenchError(f"the server at {config.api_base} did not come up within {wait_s:g} s "
                             f"(--ready-check-timeout-sec); last attempt: {reason}")
        print(f"  not up yet after {time.monotonic() - start:.0f} s ({reason}); {left:.0f} s left", file=log)
        await asyncio.sleep(min(READY_RETRY_S, left))


async def _check_server(config: BenchConfig, log: TextIO) -> tuple[str, bool]:
    """Fail fast when nothing listens at the endpoint; returns the model name to send, and whether the server's
    model listing names it."""
    listing = f"{config.api_base}/models"
    try:
        names = await _wait_for_models(config, log)
    except httpx.HTTPStatusError as exc:
        # A server without /models (or behind a proxy that hides it) can still serve.
        names = []
        listing = f"{listing} answered {exc.response.status_code}"
    if config.model is not None:
        if names and config.model not in names:
            print(f"warning: the server lists {', '.join(names)}, not {config.model!r}: sending one test request",
                  file=log)
        return config.model, config.model in names
    if not names:
        raise BenchError(f"no model name to send ({listing} gives none): pass --model "
                         f"(and --api-key if the server needs one)")
    print(f"model: {names[0]} (from {config.api_base}/models)", file=log)
    return names[0], True


async def _test_request(client: StreamClient, model: str) -> None:
    """One short request before anything is measured, for a --model the server's listing does not name (or a
    server without a listing), as vLLM's benchmark sends one: a name the server does not serve then stops the
    benchmark at once with the server's reason, instead of failing every request of the run."""
    record = await client.send(BenchRequest(-1, ({"role": "user", "content": "Hello"},), max_tokens=1),
                               time.perf_counter())
    if not record.success:
        reason = error_samples([record]).get(record.error_kind or "", "")
        raise BenchError(f"the test request for model {model!r} failed ({record.error_kind}: {reason}); nothing "
                         "was measured: check --model (and --endpoint, --api-key)")


async def _warmup(config: BenchConfig, dataset: Dataset, client: StreamClient, log: TextIO,
                  stop: asyncio.Event) -> bool:
    """Send the warm-up requests; False when `stop` (Ctrl-C) ended it: the benchmark then ends too, since a
    measured run would start already stopped."""
    shape = LoadShape(concurrency=config.warmup_concurrency(), num_prompts=config.warmup)
    result = await run_load(shape, dataset, client, warmup=True, seed=config.dataset.seed, stop=stop)
    if stop.is_set():
        return False  # its cancelled requests say nothing about the server
    failed = [r for r in result.records if not r.success]
    if len(failed) == len(result.records):
        first = failed[0]
        raise BenchError(f"every warm-up request failed ({first.error_kind}: {first.error}); is --model right?")
    if failed:
        print(f"warm-up: {len(failed)} of {len(result.records)} requests failed "
              f"(first: {failed[0].error_kind}: {failed[0].error})", file=log)
    return True


# How much of a failed request's error is shown in the log (the JSON result keeps each record's whole error).
_ERROR_SAMPLE_CHARS = 300


def error_samples(records: list[RequestRecord]) -> dict[str, str]:
    """The first failed request's error of each kind (`http_404`, `timeout`, ...), in the order the kinds first
    failed: an OpenAI error body as its message, anything else as sent, cut to _ERROR_SAMPLE_CHARS."""
    samples: dict[str, str] = {}
    for record in records:
        if record.error_kind is None or record.error_kind in samples:
            continue
        text = record.error or ""
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, TypeError, KeyError, RecursionError):  # (Recursion: nested past the parser's depth)
            message = None
        samples[record.error_kind] = (message if isinstance(message, str) else text)[:_ERROR_SAMPLE_CHARS]
    return samples


def report_failures(label: str, records: list[RequestRecord], log: TextIO) -> None:
    """When requests failed, say why on `log`: how many, and the first error of each kind (the report lists only
    the kinds' counts, so a wrong --model was `http_404: 2` with the server's reason nowhere)."""
    samples = error_samples(records)
    if not samples:
        return
    failed = sum(1 for r in records if r.error_kind is not None)
    print(f"{label}: {failed} of {len(records)} requests failed; the first of each kind: "
          + "; ".join(f"{kind}: {message}" for kind, message in samples.items()), file=log)


class _Interrupt:
    """The first SIGINT/SIGTERM ends the current run gracefully (in-flight requests cancelled and recorded,
    the report still printed, no further sweep point; during the warm-up, the benchmark with nothing
    measured); a second one acts as usual. Installed only when the event loop runs in the main thread
    (signal handlers live there)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            self._loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        self.event.set()
        self.uninstall()

    def uninstall(self) -> None:
        if self._loop is not None:
            for sig in self.SIGNALS:
                self._loop.remove_signal_handler(sig)
            self._loop = None


async def _run_shape(config: BenchConfig, shape: LoadShape, dataset: Requests, client: StreamClient,
                     tokenizer: LazyTokenizer, stop: asyncio.Event) -> RunResult:
    # The client's own objects (tokenizer, torch, the prompts) out of the collector's full collections while
    # it measures: one of those stopped the event loop for 190-265 ms (heap.frozen_heap). The freeze's own
    # collection comes before the run's clock, monitors and sampler start.
    with frozen_heap():
        result, health, samples = await _measure(config, shape, dataset, client, stop)
    count_missing_tokens(result.records, dataset, tokenizer, client.settings.api, keep_text=config.save_detailed)
    records = sorted(result.records, key=lambda r: r.index)
    summary = summarize(shape.label(), records, config.goodput_ms, health,
                        summarize_samples(samples) if samples else None, result.stopped, config.metric_percentiles)
    return RunResult(shape.label(), shape_dict(shape), summary, records, samples)


async def _measure(config: BenchConfig, shape: LoadShape, dataset: Requests, client: StreamClient,
                   stop: asyncio.Event) -> tuple[LoadResult, ClientHealthReport, list[MetricSample]]:
    sampler = None
    if config.server_metrics:
        sampler = ServerMetricsSampler(config.resolved_metrics_url, config.metrics_interval_s, config.metrics_api_key)
        # Before the run's clock: the arrivals and --duration count from run_start, and a slow first scrape
        # after it would send the arrivals it delayed all at once.
        await sampler.baseline()
    run_start = time.perf_counter()
    if sampler is not None:
        sampler.start(run_start)
    progress = _Progress(shape, config.progress, shape.label())
    monitor = ClientHealthMonitor()
    monitor.start(run_start)
    try:
        result = await run_load(shape, dataset, client, seed=config.dataset.seed, on_done=progress.on_done,
                                run_start=run_start, drain_timeout_s=config.drain_timeout_s, stop=stop)
    finally:
        health = await monitor.stop()  # (first: it takes its gc callback out)
        progress.close()
        samples = await sampler.stop() if sampler is not None else []
    return result, health, samples


async def _run_all(config: BenchConfig, log: TextIO) -> BenchResult:
    model, listed = await _check_server(config, log)
    settings = ClientSettings(
        endpoint=config.endpoint, api=config.resolved_api, model=model, api_key=config.api_key,
        request_timeout_s=config.request_timeout_s, ignore_eos=config.ignore_eos,
        temperature=config.temperature, max_connections=config.pool_size(),
        sampling={k: v for k, v in config.sampling().items() if k != "temperature"},
        request_id_prefix=config.request_id_prefix, extra_body=config.extra_body,
    )
    client = StreamClient(settings)
    try:
        if not listed:
            client.id_scope = "test-"
            await _test_request(client, model)
        tokenizer = LazyTokenizer(config.tokenizer, log)
        dataset = make_dataset(config.dataset, tokenizer)
    except BaseException:
        await client.aclose()
        raise
    interrupt = _Interrupt()
    interrupt.install()
    runs: list[RunResult] = []
    try:
        shapes = config.shapes
        client.id_scope = "warmup-"
        if config.warmup and not await _warmup(config, dataset, client, log, interrupt.event):
            print("interrupted during the warm-up: nothing was measured (no report, JSON or plot)", file=log)
            shapes = ()
        for k, shape in enumerate(shapes):
            # Each run its own prompts: a sweep's later points must not hit the prefix cache that the
            # earlier ones filled (RunRequests).
            client.id_scope = f"{k}-" if k else ""
            run = await _run_shape(config, shape, RunRequests(dataset, k), client, tokenizer, interrupt.event)
            runs.append(run)
            report_failures(run.summary.label, run.records, log)
            if len(config.shapes) > 1:
                s = run.summary
                print(f"{s.label}: {s.completed} ok, {s.failed} failed, {s.output_throughput:.1f} out tok/s",
                      file=log)
            if interrupt.event.is_set():
                break
    finally:
        interrupt.uninstall()
        await client.aclose()
    return BenchResult(config=config_dict(config, model, getattr(dataset, "nonce", None)), runs=runs)


def config_dict(config: BenchConfig, model: str, run_nonce: str | None = None) -> dict[str, Any]:
    """The configuration as it ran: the model actually sent, the API used, the dataset's run nonce (with
    the seed, it regenerates the same prompts), and no API key."""
    data = dataclasses.asdict(config)
    data["model"] = model
    data["api"] = config.resolved_api
    data["api_key"] = None if config.api_key is None else "<set>"
    data["dataset"]["run_nonce"] = run_nonce
    return jsonable(data)


def run_benchmark(config: BenchConfig, log: TextIO | None = None) -> BenchResult:
    """Run every load shape of `config` and return the results (nothing printed but progress and notes,
    to `log`, default stderr)."""
    return asyncio.run(_run_all(config, log or sys.stderr))


def report(result: BenchResult, config: BenchConfig, out: TextIO | None = None, log: TextIO | None = None,
           old: BenchResult | None = None) -> None:
    """Print the result block (or the sweep table) to `out` (default stdout), then write the JSON and plot
    and print the comparison (with `old`, else the --compare file as it is now); notes go to `log` (default
    stderr). A result without runs (interrupted during the warm-up) has nothing to report."""
    out = out or sys.stdout
    log = log or sys.stderr
    if not result.runs:
        return
    summaries = [run.summary for run in result.runs]
    if len(summaries) == 1:
        print(format_summary(summaries[0], config.percentile_metrics), file=out)
    else:
        print(format_sweep(summaries), file=out)
        for s in summaries:
            for note in (s.stopped, s.client.warning() if s.client else None):
                if note:
                    print(f"{s.label}: {note}", file=out)
    if config.json_path:
        write_json(result, config.json_path, append=config.append_result)
        print(f"results {'appended' if config.append_result else 'written'} to {config.json_path}", file=log)
    if config.plot_path:
        from kvserve.bench.plot import plot_runs

        plot_runs(result.runs, config.plot_path, title=f"kvserve bench: {result.config.get('model')}")
        print(f"plot written to {config.plot_path}", file=log)
    if config.compare_path:
        old = old if old is not None else read_json(config.compare_path)
        old_by_label = {run.label: run for run in old.runs}
        for i, run in enumerate(result.runs):
            match = old_by_label.get(run.label) or (old.runs[i] if i < len(old.runs) else None)
            if match is None:
                print(f"{config.compare_path} has no run to compare with {run.label}", file=out)
                continue
            print(format_compare(match.summary, run.summary, config.compare_path), file=out)


def run_cli(config: BenchConfig, out: TextIO | None = None, log: TextIO | None = None) -> int:
    """`kvserve bench`: run, report; exit status 0 when at least one measured request succeeded, else 1
    (a Ctrl-C during the warm-up too: nothing was measured). What would fail after the run fails before it
    (BenchConfigError): an output file that cannot be written, a --compare file that cannot be read; the
    comparison is with the file as it was before the run (--json may name the same file)."""
    old = None
    if config.compare_path:
        try:
            old = read_json(config.compare_path)
        except OSError as exc:
            raise BenchConfigError(f"--compare {config.compare_path}: {exc.strerror}") from None
    for flag, path in (("--json", config.json_path), ("--plot", config.plot_path)):
        if path is not None:
            _check_writable(flag, path)
    result = run_benchmark(config, log)
    report(result, config, out, log, old)
    return 0 if any(run.summary.completed for run in result.runs) else 1


def _check_writable(flag: str, path: str) -> None:
    """Refuse, before the run, an output file that could not be written after it (the run's results were
    lost then): its directory is created if missing, as vLLM's --result-dir is."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise BenchConfigError(f"{flag} {path}: cannot create its directory: {exc.strerror}") from None
    if os.path.isdir(path):
        raise BenchConfigError(f"{flag} {path} is a directory; give a file name")
    if not os.access(path if os.path.exists(path) else directory, os.W_OK):
        raise BenchConfigError(f"{flag} {path} cannot be written (permission denied)")
