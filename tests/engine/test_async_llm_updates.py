"""AsyncLLM.generate's updates, driven with hand-made engine messages (no engine process): one update per step
while the consumer keeps up; when it falls behind, the queued steps come as one update whose deltas are theirs
joined, and an error that arrives after them is raised only after they are delivered."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any, TypeVar, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config import EngineConfig
from kvserve.core.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
from kvserve.engine import async_llm
from kvserve.engine.async_llm import AsyncLLM, RequestFailedError
from kvserve.engine.errors import EngineDeadError
from kvserve.metrics.prometheus import PrometheusStatLogger
from kvserve.protocol.core_messages import EngineOutputs, EngineReady, RequestFailed
from kvserve.protocol.outputs import Logprob, RequestOutput
from kvserve.protocol.sampling_params import SamplingParams

T = TypeVar("T")


class _FakeClient:
    """What AsyncLLM needs of EngineCoreClient, with no process behind it."""

    def __init__(self, config: Any, handler: Any, *args: Any) -> None:
        self.index = 0
        self.dead_error = None
        self.is_alive = True
        self.added: list[str] = []
        self.requests: list[Any] = []  # the EngineCoreRequests as sent
        self.aborted: list[str] = []

    async def start(self) -> EngineReady:
        return EngineReady(pid=0, num_blocks=64, block_size=16, max_model_len=256, eos_token_ids=[],
                           vocab_size=49152, startup_s=0.0, capacity_description="")

    async def add_requests(self, requests: list[Any]) -> None:
        self.added += [r.req_id for r in requests]
        self.requests += requests

    def abort_requests(self, req_ids: list[str]) -> None:
        self.aborted += req_ids

    async def shutdown(self) -> None:
        pass


def _step(*outputs: EngineCoreOutput) -> EngineOutputs:
    return EngineOutputs(outputs=list(outputs), stats=SchedulerStats(), timestamp=0.0)


async def _engine(monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> AsyncLLM:
    monkeypatch.setattr(async_llm, "EngineCoreClient", _FakeClient)
    llm = AsyncLLM(cast(EngineConfig, None), tokenizer)
    await llm.start()
    return llm


async def _started(items: AsyncIterator[T], into: list[T | Exception]) -> asyncio.Task[None]:
    """Consume `items` (a request's updates, or a stream's events) into `into` in a task; returns once the
    request is queued in the (fake) core."""

    async def consume() -> None:
        try:
            async for item in items:
                into.append(item)
        except Exception as e:
            into.append(e)

    task = asyncio.ensure_future(consume())
    for _ in range(5):
        await asyncio.sleep(0)
    return task


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_one_update_per_step_while_the_consumer_keeps_up(monkeypatch, smollm_tokenizer) -> None:
    ids = _ids(smollm_tokenizer, " one two three")

    async def run() -> list[RequestOutput | Exception]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        got: list[RequestOutput | Exception] = []
        task = await _started(llm.generate("r", [1, 2], SamplingParams(max_tokens=3)), got)
        (core_id,) = llm.client.added
        for i, token in enumerate(ids):
            llm.on_engine_outputs(_step(EngineCoreOutput(core_id, [token], finish_reason="length" if i == 2 else None)))
            await asyncio.sleep(0)  # the consumer runs before the next step
        await asyncio.wait_for(task, 5)
        return got

    got = asyncio.run(run())
    assert len(ids) == 3
    assert [u.request_id for u in got] == ["r"] * 3  # type: ignore[union-attr]
    assert [u.outputs[0].token_ids_delta for u in got] == [[t] for t in ids]  # type: ignore[union-attr]
    assert "".join(u.outputs[0].text_delta for u in got) == " one two three"  # type: ignore[union-attr]


def test_priority_and_bad_words_go_into_every_samples_request(monkeypatch, smollm_tokenizer) -> None:
    """The engine-core requests of an n=2 request carry its priority, and its bad words as token sequences."""

    async def run() -> list[Any]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        got: list[RequestOutput | Exception] = []
        params = SamplingParams(n=2, max_tokens=3, bad_words=["hello"])
        task = await _started(llm.generate("r", [1, 2], params, priority=-4), got)
        sent = list(llm.client.requests)
        task.cancel()  # the consumer goes away: the request is aborted
        await asyncio.gather(task, return_exceptions=True)
        assert sorted(llm.client.aborted) == sorted(r.req_id for r in sent)
        return sent

    sent = asyncio.run(run())
    assert len(sent) == 2 and [r.priority for r in sent] == [-4, -4]
    hello = _ids(smollm_tokenizer, "hello")
    assert all(hello in r.sampling_params.bad_words_token_ids for r in sent)


def test_steps_queued_behind_a_slow_consumer_come_as_one_update(monkeypatch, smollm_tokenizer) -> None:
    ids = _ids(smollm_tokenizer, " one two three four five")
    assert len(ids) == 5
    top = [TokenLogprobs(token_ids=[t, t + 1], logprobs=[-0.5 - i, -2.0], rank=1) for i, t in enumerate(ids)]

    async def run() -> list[RequestOutput | Exception]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        got: list[RequestOutput | Exception] = []
        task = await _started(llm.generate("r", [1, 2], SamplingParams(max_tokens=5, logprobs=1)), got)
        (r,) = llm.client.added
        # Three steps arrive before the consumer runs (the reader handles every message that is there).
        for i in range(3):
            llm.on_engine_outputs(_step(EngineCoreOutput(r, [ids[i]], new_logprobs=[top[i]])))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        llm.on_engine_outputs(_step(EngineCoreOutput(r, [ids[3]], new_logprobs=[top[3]])))
        await asyncio.sleep(0)
        llm.on_engine_outputs(_step(EngineCoreOutput(r, [ids[4]], new_logprobs=[top[4]], finish_reason="length")))
        await asyncio.wait_for(task, 5)
        return got

    got = asyncio.run(run())
    updates = cast(list[RequestOutput], got)
    assert [u.outputs[0].token_ids_delta for u in updates] == [ids[:3], [ids[3]], [ids[4]]]
    assert [u.outputs[0].text_delta for u in updates] == [" one two three", " four", " five"]
    assert [u.finished for u in updates] == [False, False, True]
    merged = updates[0].outputs[0]
    assert merged.text == " one two three"  # (token_ids is the live list: it grows with later steps)
    # The cumulative logprobs agree with the update: its last len(delta) entries are the delta's tokens'.
    assert merged.logprobs is not None and len(merged.logprobs) == 3
    assert [next(iter(entry)) for entry in merged.logprobs[-3:]] == ids[:3]
    assert merged.cumulative_logprob == pytest.approx(-0.5 - 1.5 - 2.5)


def test_an_error_after_queued_steps_is_raised_after_them(monkeypatch, smollm_tokenizer) -> None:
    ids = _ids(smollm_tokenizer, " one two")

    async def run() -> list[RequestOutput | Exception]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        got: list[RequestOutput | Exception] = []
        task = await _started(llm.generate("r", [1, 2], SamplingParams(max_tokens=8)), got)
        (r,) = llm.client.added
        for token in ids:
            llm.on_engine_outputs(_step(EngineCoreOutput(r, [token])))
        llm.on_request_failed(RequestFailed(req_id=r, message="refused", param="max_tokens"))
        await asyncio.wait_for(task, 5)
        return got

    got = asyncio.run(run())
    assert len(got) == 2
    first, error = got
    assert isinstance(first, RequestOutput) and first.outputs[0].token_ids_delta == ids
    assert isinstance(error, RequestFailedError) and error.param == "max_tokens"


def test_a_sample_the_core_drops_later_takes_its_siblings_with_it(monkeypatch, smollm_tokenizer) -> None:
    """A grammar that fails to compile fails one sample in the core, after the others were added: the request
    fails, and its other samples are aborted in the core."""

    async def run() -> tuple[list[RequestOutput | Exception], list[str], list[str]]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        got: list[RequestOutput | Exception] = []
        task = await _started(llm.generate("r", [1, 2], SamplingParams(n=3, max_tokens=4)), got)
        sent = [r.req_id for r in llm.client.requests]
        llm.on_request_failed(RequestFailed(req_id=sent[1], message="no tokenizer", param="structured_outputs"))
        await asyncio.wait_for(task, 5)
        return got, sent, list(llm.client.aborted)

    got, sent, aborted = asyncio.run(run())
    assert len(got) == 1 and isinstance(got[0], RequestFailedError) and got[0].param == "structured_outputs"
    assert set(sent) <= set(aborted)


def test_a_reused_id_gets_nothing_of_the_request_that_had_it_before(monkeypatch, smollm_tokenizer) -> None:
    """A client reuses its request id as soon as the old request ended on a stop string, while the core, whose
    abort is still on its way, sends one more token and then a failure for the old one: the new request sees
    only its own outputs."""
    ids = _ids(smollm_tokenizer, " one. two three")
    assert len(ids) == 4

    async def run() -> tuple[list[RequestOutput | Exception], list[RequestOutput | Exception], list[str], list[str]]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        first: list[RequestOutput | Exception] = []
        task = await _started(llm.generate("x", [1, 2], SamplingParams(max_tokens=8, stop=["."])), first)
        (old,) = llm.client.added
        for token in ids[:2]:
            llm.on_engine_outputs(_step(EngineCoreOutput(old, [token])))
        await asyncio.wait_for(task, 5)
        assert llm.client.aborted == [old] and not llm.has_request("x")
        second: list[RequestOutput | Exception] = []
        task = await _started(llm.generate("x", [1, 2], SamplingParams(max_tokens=2)), second)
        new = llm.client.added[1]
        llm.on_engine_outputs(_step(EngineCoreOutput(old, [ids[2]])))  # sampled before the abort arrived
        llm.on_request_failed(RequestFailed(req_id=old, message="late", param=None))
        llm.on_engine_outputs(_step(EngineCoreOutput(new, [ids[3]])))
        llm.on_engine_outputs(_step(EngineCoreOutput(new, [ids[2]], finish_reason="length")))
        await asyncio.wait_for(task, 5)
        return first, second, list(llm.client.added), list(llm.client.aborted)

    first, second, added, aborted = asyncio.run(run())
    assert cast(RequestOutput, first[-1]).outputs[0].text == " one"
    assert all(isinstance(u, RequestOutput) for u in second), second
    updates = cast(list[RequestOutput], second)
    assert updates and {u.request_id for u in updates} == {"x"}
    assert updates[-1].finished and updates[-1].outputs[0].token_ids == [ids[3], ids[2]]
    assert len(set(added)) == 2 and all(a.startswith("x-") for a in added)
    assert aborted == added[:1]  # the second finished in the core: nothing to abort


def test_an_abort_from_another_task_ends_the_request_with_a_last_update(monkeypatch, smollm_tokenizer) -> None:
    """The reader of generate() gets a finished update (finish reason "abort", nothing new) instead of waiting
    forever; the core is told."""
    ids = _ids(smollm_tokenizer, " one two")

    async def run() -> tuple[list[RequestOutput | Exception], list[str], list[str]]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        got: list[RequestOutput | Exception] = []
        task = await _started(llm.generate("x", [1, 2], SamplingParams(max_tokens=8)), got)
        (core_id,) = llm.client.added
        llm.on_engine_outputs(_step(EngineCoreOutput(core_id, [ids[0]])))
        await asyncio.sleep(0)
        llm.abort("x")
        llm.on_engine_outputs(_step(EngineCoreOutput(core_id, [ids[1]])))  # late: already on its way
        await asyncio.wait_for(task, 5)
        assert not llm.has_request("x") and llm.num_unfinished_requests == 0
        return got, list(llm.client.added), list(llm.client.aborted)

    got, added, aborted = asyncio.run(run())
    assert aborted == added
    first, last = cast(list[RequestOutput], got)
    assert first.outputs[0].token_ids_delta == ids[:1]
    assert last.finished and last.request_id == "x"
    assert (last.outputs[0].finish_reason, last.outputs[0].token_ids_delta, last.outputs[0].text_delta) == (
        "abort", [], "")
    assert last.outputs[0].token_ids == ids[:1]


def test_abort_all_ends_every_live_request_with_a_last_update(monkeypatch, smollm_tokenizer) -> None:
    """The server's drain at --shutdown-timeout: every request (each sample of an n>1 one) is aborted in the
    core, and each reader gets its finished update instead of waiting for tokens that will not come; a request
    that comes later gets that update at once."""
    ids = _ids(smollm_tokenizer, " one")

    async def run() -> tuple[list[list[RequestOutput | Exception]], int, list[str], list[str], int]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        got: list[list[RequestOutput | Exception]] = [[], []]
        tasks = [await _started(llm.generate("a", [1, 2], SamplingParams(max_tokens=8)), got[0]),
                 await _started(llm.generate("b", [3], SamplingParams(max_tokens=8, n=2)), got[1])]
        llm.on_engine_outputs(_step(EngineCoreOutput(llm.client.added[0], [ids[0]])))
        await asyncio.sleep(0)
        aborted = llm.abort_all()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        # A request that comes after it (one the server was still preparing) ends at once the same way,
        # without reaching the core.
        late: list[RequestOutput | Exception] = []
        got.append(late)
        await asyncio.wait_for(await _started(llm.generate("c", [4], SamplingParams(max_tokens=8, n=2)), late), 5)
        return got, aborted, list(llm.client.added), list(llm.client.aborted), llm.num_unfinished_requests

    got, num_aborted, added, aborted, unfinished = asyncio.run(run())
    assert num_aborted == 2 and unfinished == 0
    assert sorted(aborted) == sorted(added) and len(added) == 3
    assert len(got[2]) == 1 and cast(RequestOutput, got[2][0]).request_id == "c"
    assert [(o.token_ids, o.text) for o in cast(RequestOutput, got[2][0]).outputs] == [([], ""), ([], "")]
    for updates in got:
        last = updates[-1]
        assert isinstance(last, RequestOutput) and last.finished
        assert {o.finish_reason for o in last.outputs} == {"abort"}
    assert cast(RequestOutput, got[0][-1]).outputs[0].token_ids == ids[:1]
    assert len(cast(RequestOutput, got[1][-1]).outputs) == 2


def test_requests_that_share_a_callers_id_run_side_by_side(monkeypatch, smollm_tokenizer) -> None:
    """The caller's id is a label (a multi-prompt completion runs all its prompts under its response's id):
    each request has its own core id and gets its own outputs; the id is in use until the last one ends, and
    `abort` by it aborts every request that has it."""
    a, b = _ids(smollm_tokenizer, " one two"), _ids(smollm_tokenizer, " red green")

    async def run() -> tuple[list[RequestOutput | Exception], list[RequestOutput | Exception],
                             list[RequestOutput | Exception], list[str], list[str]]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        first: list[RequestOutput | Exception] = []
        second: list[RequestOutput | Exception] = []
        task_a = await _started(llm.generate("x", [1, 2], SamplingParams(max_tokens=2)), first)
        task_b = await _started(llm.generate("x", [3], SamplingParams(max_tokens=3)), second)
        core_a, core_b = llm.client.added
        for i in range(2):
            llm.on_engine_outputs(_step(EngineCoreOutput(core_a, [a[i]], finish_reason="length" if i else None),
                                        EngineCoreOutput(core_b, [b[i]])))
        await asyncio.wait_for(task_a, 5)
        assert llm.has_request("x") and llm.num_unfinished_requests == 1  # the second still runs
        llm.on_engine_outputs(_step(EngineCoreOutput(core_b, [b[0]], finish_reason="length")))
        await asyncio.wait_for(task_b, 5)
        assert not llm.has_request("x") and llm.num_unfinished_requests == 0
        aborted: list[RequestOutput | Exception] = []
        tasks = [await _started(llm.generate("y", [5], SamplingParams(max_tokens=4)), aborted) for _ in range(2)]
        llm.abort("y")
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert not llm.has_request("y")
        return first, second, aborted, list(llm.client.added), list(llm.client.aborted)

    first, second, aborted, added, aborted_ids = asyncio.run(run())
    assert len(set(added)) == 4
    assert aborted_ids == added[2:]
    assert all(isinstance(u, RequestOutput) and u.request_id == "x" for u in first + second)
    assert cast(RequestOutput, first[-1]).outputs[0].token_ids == a
    assert cast(RequestOutput, second[-1]).outputs[0].token_ids == [b[0], b[1], b[0]]
    assert [cast(RequestOutput, u).outputs[0].finish_reason for u in aborted] == ["abort", "abort"]


def test_merged_samples_keep_their_own_deltas_and_an_early_finish(monkeypatch, smollm_tokenizer) -> None:
    a = _ids(smollm_tokenizer, " red green blue")
    b = _ids(smollm_tokenizer, " cat dog")

    async def run() -> list[RequestOutput | Exception]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        got: list[RequestOutput | Exception] = []
        task = await _started(llm.generate("r", [1, 2], SamplingParams(n=2, max_tokens=3, seed=1)), got)
        c0, c1 = llm.client.added
        llm.on_engine_outputs(_step(EngineCoreOutput(c0, [a[0]]), EngineCoreOutput(c1, [b[0]])))
        llm.on_engine_outputs(_step(EngineCoreOutput(c0, [a[1]]), EngineCoreOutput(c1, [b[1]], finish_reason="stop",
                                                                                   stop_token_id=b[1])))
        llm.on_engine_outputs(_step(EngineCoreOutput(c0, [a[2]], finish_reason="length")))
        await asyncio.wait_for(task, 5)
        return got

    got = asyncio.run(run())
    assert len(got) == 1  # all three steps queued before the consumer ran, the last one finishing the request
    update = cast(RequestOutput, got[0])
    assert update.finished
    s0, s1 = update.outputs
    assert (s0.token_ids_delta, s0.text_delta, s0.finish_reason) == (a, " red green blue", "length")
    # " dog" is the token that ended the sample (a stop token): not shown as text.
    assert (s1.token_ids_delta, s1.text_delta, s1.finish_reason) == (b, " cat", "stop")


@pytest.mark.parametrize("merged", [False, True])
def test_streamed_text_offsets_are_the_full_answers_whatever_the_chunking(monkeypatch, smollm_tokenizer, merged):
    """A completions stream's logprobs `text_offset`s count the tokens' texts, as the non-streamed answer does:
    the same with one chunk a step and with steps merged, also while text is held back (a possible stop
    string)."""
    from kvserve.entrypoints.openai.serving_common import ServingContext, completion_logprobs
    from kvserve.entrypoints.openai.serving_completion import (
        PreparedCompletion,
        PreparedPrompt,
        completion_stream,
    )

    ids = _ids(smollm_tokenizer, " cat dog STRAY bird STOP fish")
    top = [TokenLogprobs(token_ids=[t], logprobs=[-1.0], rank=1) for t in ids]

    async def run() -> list[int]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        params = SamplingParams(max_tokens=len(ids), stop=["STOP"], logprobs=0)
        prepared = PreparedCompletion("cmpl-1", "m", [PreparedPrompt([1, 2], "p")], params, False)
        events: list[str | Exception] = []
        task = await _started(completion_stream(ServingContext(llm, ["m"], "m"), prepared, False, False), events)
        (core_id,) = llm.client.added
        for i, token in enumerate(ids):
            llm.on_engine_outputs(_step(EngineCoreOutput(core_id, [token], new_logprobs=[top[i]])))
            if not merged or i in (2, 4):  # merged: the steps go out in three chunks
                for _ in range(5):
                    await asyncio.sleep(0)
        await asyncio.wait_for(task, 5)
        offsets: list[int] = []
        assert events[-1] == "data: [DONE]\n\n"
        for event in events[:-1]:
            assert isinstance(event, str)
            for choice in json.loads(event.removeprefix("data: "))["choices"]:
                offsets += choice["logprobs"]["text_offset"] if choice["logprobs"] else []
        return offsets

    offsets = asyncio.run(run())
    stopped_at = next(i for i in range(len(ids)) if "STOP" in smollm_tokenizer.decode(ids[: i + 1]))
    full = completion_logprobs(smollm_tokenizer, ids[: stopped_at + 1], [{t: Logprob(-1.0, 1)} for t in
                                                                          ids[: stopped_at + 1]], 0, 0)
    assert offsets == full["text_offset"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_still_being_prepared_when_the_drain_aborts_ends_as_aborted(monkeypatch, smollm_tokenizer, stream):
    """The drain's abort (`abort_all`, when --shutdown-timeout runs out) while a request is still being prepared
    (tokenized, off the event loop): its response ends as the others do, finish reason "abort" (a 200 with the
    choice's finish, or the stream's finish chunk and [DONE]), and it never reaches the engine, which is about
    to stop. It used to escape the abort and start running, to be cut off when the server exited."""
    from types import SimpleNamespace

    import httpx

    from kvserve.entrypoints.openai import api_server
    from kvserve.entrypoints.openai.middleware import ServerState
    from kvserve.entrypoints.openai.serving_common import ServingContext

    entered, release = threading.Event(), threading.Event()
    real_prepare = api_server.prepare_completion

    def slow_prepare(*args: Any) -> Any:  # on the preparation thread
        entered.set()
        release.wait(timeout=10)
        return real_prepare(*args)

    monkeypatch.setattr(api_server, "prepare_completion", slow_prepare)

    async def run() -> tuple[httpx.Response, list[str]]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        ctx = ServingContext(llm, ["m"], "m", log_requests=False)
        app = api_server.build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                body = {"model": "m", "prompt": "Tell me everything:", "max_tokens": 8, "stream": stream}
                response = asyncio.ensure_future(client.post("/v1/completions", json=body))
                while not entered.is_set():
                    await asyncio.sleep(0.01)
                assert llm.abort_all() == 0  # nothing in the engine yet
                release.set()
                return await asyncio.wait_for(response, 10), list(llm.client.added)
        finally:
            release.set()
            ctx.prepare_pool.shutdown()

    response, added = asyncio.run(run())
    assert response.status_code == 200, response.text
    assert added == []
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert "".join(c["choices"][0]["text"] for c in chunks) == ""
    else:
        choice = response.json()["choices"][0]
        assert (choice["finish_reason"], choice["text"]) == ("abort", "")
        assert response.json()["usage"]["completion_tokens"] == 0


def _finished_by_reason(logger: PrometheusStatLogger) -> dict[str, float]:
    return {s.labels["finished_reason"]: s.value
            for family in text_string_to_metric_families(logger.generate_latest().decode())
            for s in family.samples if s.name == "kvserve:request_success_total"}


def _e2e_count(logger: PrometheusStatLogger) -> float:
    return next(s.value for family in text_string_to_metric_families(logger.generate_latest().decode())
                for s in family.samples if s.name == "kvserve:e2e_request_latency_seconds_count")


@pytest.mark.parametrize("failure", ["request_failed", "engine_dead"])
def test_a_request_that_fails_while_generating_counts_as_error(monkeypatch, smollm_tokenizer, failure) -> None:
    """vLLM's finish reason "error": a request the engine dropped after it ran (its grammar failed while
    generating, or the engine died) is counted once as such, not as an abort, nor left out. One refused on
    arrival, never run (a 400 to its client), counts nowhere."""

    async def run() -> PrometheusStatLogger:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        logger = PrometheusStatLogger("m", 256)
        llm.stat_loggers.append(logger)
        got: list[RequestOutput | Exception] = []
        task = await _started(llm.generate("r", [1, 2], SamplingParams(max_tokens=8)), got)
        (r,) = llm.client.added
        llm.on_engine_outputs(_step(EngineCoreOutput(r, [5], first_scheduled_time=1.0)))
        llm.on_engine_outputs(_step(EngineCoreOutput(r, [6])))
        refused: list[RequestOutput | Exception] = []
        refused_task = await _started(llm.generate("q", [1, 2], SamplingParams(max_tokens=8)), refused)
        q = llm.client.added[1]
        llm.on_request_failed(RequestFailed(req_id=q, message="refused", param="max_tokens"))
        if failure == "request_failed":
            llm.on_request_failed(RequestFailed(req_id=r, message="grammar failed", param="structured_outputs"))
        else:
            llm.on_engine_dead(EngineDeadError("engine core process died"))
        await asyncio.wait_for(asyncio.gather(task, refused_task), 5)
        assert isinstance(got[-1], Exception) and isinstance(refused[-1], RequestFailedError)
        return logger

    logger = asyncio.run(run())
    assert _finished_by_reason(logger) == {"stop": 0.0, "length": 0.0, "abort": 0.0, "error": 1.0}
    assert _e2e_count(logger) == 1.0


@pytest.mark.parametrize("api", ["completions", "chat", "responses"])
def test_a_stream_that_fails_in_the_server_counts_as_error_not_abort(monkeypatch, smollm_tokenizer, api) -> None:
    """A streamed request whose server code fails after its response started (a 500 error event after the first
    chunk) is counted as finished reason "error", as a request the engine drops is: it was counted as "abort",
    as if its client had gone away. A client that goes away still counts as "abort"."""
    from types import SimpleNamespace

    import httpx

    from kvserve.entrypoints.openai import api_server, serving_chat, serving_completion, serving_responses
    from kvserve.entrypoints.openai.middleware import ServerState
    from kvserve.entrypoints.openai.serving_common import ServingContext, closing_updates

    def fail_on_second_update(module: Any, name: str) -> None:
        real, calls = getattr(module, name), []

        def failing(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("the server broke")
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, failing)

    if api == "completions":  # the chunks' SSE bodies
        fail_on_second_update(serving_completion, "sse")
    else:
        fail_on_second_update(serving_chat if api == "chat" else serving_responses, "_choice_deltas")
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}[api]
    body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 8}
    if api == "completions":
        body["prompt"] = "Tell me everything:"
    elif api == "chat":
        body["messages"] = [{"role": "user", "content": "Tell me everything:"}]
    else:
        body["input"] = "Tell me everything:"

    async def run() -> tuple[httpx.Response, PrometheusStatLogger, list[str]]:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        logger = PrometheusStatLogger("m", 256)
        llm.stat_loggers.append(logger)
        ctx = ServingContext(llm, ["m"], "m", log_requests=False)
        app = api_server.build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                response = asyncio.ensure_future(client.post(path, json=body))
                while not llm.client.added:
                    await asyncio.sleep(0.01)
                (r,) = llm.client.added
                for token in _ids(smollm_tokenizer, " one two three"):
                    llm.on_engine_outputs(_step(EngineCoreOutput(r, [token], first_scheduled_time=1.0)))
                    await asyncio.sleep(0.01)
                answer = await asyncio.wait_for(response, 10)
            # A client that leaves: the response's generator is closed after an update.
            async with closing_updates(llm.generate("left", [1, 2], SamplingParams(max_tokens=8))) as updates:
                first = asyncio.ensure_future(updates.__anext__())
                while len(llm.client.added) < 2:
                    await asyncio.sleep(0.01)
                llm.on_engine_outputs(_step(EngineCoreOutput(llm.client.added[1], [5], first_scheduled_time=1.0)))
                await asyncio.wait_for(first, 10)
        finally:
            ctx.prepare_pool.shutdown()
        return answer, logger, list(llm.client.aborted)

    answer, logger, aborted = asyncio.run(run())
    assert answer.status_code == 200
    assert "the server broke" in answer.text
    assert len(aborted) == 2  # both ended in the core
    assert _finished_by_reason(logger) == {"stop": 0.0, "length": 0.0, "abort": 1.0, "error": 1.0}


def test_samples_not_yet_run_of_a_request_the_caller_fails_count_as_error(monkeypatch, smollm_tokenizer) -> None:
    """An n=2 request whose server code fails after the first sample's first token, while the second still waits
    in the core: both samples are counted, as "error" (the waiting one was not refused, as `fail` assumes of a
    request that never ran; closed by a client that left, both count as "abort")."""
    from kvserve.entrypoints.openai.serving_common import closing_updates

    async def run() -> PrometheusStatLogger:
        llm = await _engine(monkeypatch, smollm_tokenizer)
        logger = PrometheusStatLogger("m", 256)
        llm.stat_loggers.append(logger)
        with pytest.raises(RuntimeError, match="the server broke"):
            async with closing_updates(llm.generate("r", [1, 2], SamplingParams(n=2, max_tokens=8))) as updates:
                first = asyncio.ensure_future(updates.__anext__())
                while not llm.client.added:
                    await asyncio.sleep(0.01)
                llm.on_engine_outputs(_step(EngineCoreOutput(llm.client.added[0], [5], first_scheduled_time=1.0)))
                await asyncio.wait_for(first, 5)
                raise RuntimeError("the server broke")
        assert sorted(llm.client.aborted) == sorted(llm.client.added)
        return logger

    logger = asyncio.run(run())
    assert _finished_by_reason(logger) == {"stop": 0.0, "length": 0.0, "abort": 0.0, "error": 2.0}
    assert _e2e_count(logger) == 2.0
