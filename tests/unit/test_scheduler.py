"""Scheduler: token budget, chunked prefill, decode, preemption, abort, rejection, stop rules, prefix sharing.

Every step goes through `Harness.step`, which checks the scheduler's invariants before and after and runs
the fake runner (which checks the SchedulerOutput against its own block tables and simulated KV cache).
"""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.outputs import EngineCoreOutput, SchedulerOutput
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import RequestRejected, Scheduler
from kvserve.protocol.sampling_params import SamplingParams
from tests.unit.fake_runner import FakeModelRunner, SampleFn, check_limits

BS = 4


def make_scheduler(
    num_blocks: int = 16,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        scheduling_policy=scheduling_policy,
    )
    return Scheduler(
        config, num_blocks=num_blocks, block_size=BS, enable_prefix_caching=enable_prefix_caching
    )


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 16,
    eos_token_ids: tuple[int, ...] = (),
    priority: int = 0,
    **params: object,
) -> Request:
    params_ = SamplingParams(**params)
    return Request(req_id, prompt, params_, eos_token_ids=eos_token_ids, max_tokens=max_tokens, priority=priority)


class Harness:
    def __init__(self, sched: Scheduler, sample_fn: SampleFn | None = None) -> None:
        self.sched = sched
        self.runner = FakeModelRunner(sched.block_size, sample_fn)

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        self.sched.check_invariants()
        out = self.sched.schedule()
        self.sched.check_invariants()
        check_limits(out, self.sched.config)
        outputs = self.sched.update_from_output(out, self.runner.execute(out))
        self.sched.check_invariants()
        return out, outputs


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(req_id, num_computed_tokens, num scheduled tokens, sample) per scheduled request."""
    return [(s.req_id, s.num_computed_tokens, len(s.token_ids), s.sample) for s in out.scheduled]


def by_id(out: SchedulerOutput, req_id: str):  # noqa: ANN201
    (s,) = [s for s in out.scheduled if s.req_id == req_id]
    return s


# ---------------------------------------------------------------------------------------------- budget


def test_token_budget_chunks_the_second_prompt():
    sched = make_scheduler(max_num_batched_tokens=10)
    h = Harness(sched)
    a_prompt, b_prompt = list(range(1, 7)), list(range(11, 19))
    sched.add_request(make_request("a", a_prompt))
    sched.add_request(make_request("b", b_prompt))

    out, outputs = h.step()
    assert summary(out) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert by_id(out, "a").token_ids == a_prompt
    assert by_id(out, "b").token_ids == b_prompt[:4]
    assert [s.new_block_ids for s in out.scheduled] == [[0, 1], [2]]
    assert [s.reset_block_table for s in out.scheduled] == [True, True]
    assert [n.req_id for n in out.new_requests] == ["a", "b"]
    assert [(o.req_id, o.new_token_ids) for o in outputs] == [("a", [7])]

    out, outputs = h.step()
    assert summary(out) == [("a", 6, 1, True), ("b", 4, 4, True)]
    assert by_id(out, "a").token_ids == [7]
    assert by_id(out, "b").token_ids == b_prompt[4:]
    assert [s.new_block_ids for s in out.scheduled] == [[], [3]]
    assert [s.reset_block_table for s in out.scheduled] == [False, False]
    assert out.new_requests == []
    assert [o.req_id for o in outputs] == ["a", "b"]

    out, _ = h.step()
    assert summary(out) == [("a", 7, 1, True), ("b", 8, 1, True)]
    assert [s.new_block_ids for s in out.scheduled] == [[], [4]]


def test_running_requests_come_first_then_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=4)
    h = Harness(sched)
    sched.add_request(make_request("a", list(range(1, 11))))
    sched.add_request(make_request("b", [50, 51, 52]))

    assert summary(h.step()[0]) == [("a", 0, 4, False)]
    assert [r.req_id for r in sched.waiting] == ["b"]
    assert summary(h.step()[0]) == [("a", 4, 4, False)]
    assert summary(h.step()[0]) == [("a", 8, 2, True), ("b", 0, 2, False)]
    assert summary(h.step()[0]) == [("a", 10, 1, True), ("b", 2, 1, True)]
    sched.add_request(make_request("c", [60, 61]))
    assert summary(h.step()[0]) == [("a", 11, 1, True), ("b", 3, 1, True), ("c", 0, 2, True)]


def test_max_num_seqs_caps_the_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    h = Harness(sched)
    for req_id in "abc":
        sched.add_request(make_request(req_id, [1, 2, 3], max_tokens=2))

    out, _ = h.step()
    assert [s.req_id for s in out.scheduled] == ["a", "b"]
    assert sched.requests["c"].status == RequestStatus.WAITING
    out, outputs = h.step()
    assert [s.req_id for s in out.scheduled] == ["a", "b"]
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("a", "length"), ("b", "length")]
    out, _ = h.step()
    assert out.finished_req_ids == ["a", "b"]
    assert summary(out) == [("c", 0, 3, True)]


def test_chunked_prefill_samples_only_on_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=4)
    h = Harness(sched)
    prompt = list(range(1, 11))
    sched.add_request(make_request("a", prompt))

    chunks = []
    for _ in range(3):
        out, outputs = h.step()
        (s,) = out.scheduled
        chunks.append((s.num_computed_tokens, s.token_ids, s.new_block_ids, s.reset_block_table, s.sample))
        assert [o.new_token_ids for o in outputs] == ([[7]] if s.sample else [])
    assert chunks == [
        (0, prompt[0:4], [0], True, False),
        (4, prompt[4:8], [1], False, False),
        (8, prompt[8:10], [2], False, True),
    ]
    assert sched.requests["a"].output_token_ids == [7]


def test_decode_steps_schedule_one_token_each():
    sched = make_scheduler()
    h = Harness(sched, sample_fn=lambda req_id, i: 100 + i)
    sched.add_request(make_request("a", [1, 2, 3]))
    out, _ = h.step()
    assert summary(out) == [("a", 0, 3, True)]
    steps = []
    for _ in range(3):
        (s,) = h.step()[0].scheduled
        steps.append((s.token_ids, s.num_computed_tokens, s.new_block_ids, s.sample))
    # Position 3 still fits block 0; position 4 opens block 1.
    assert steps == [([100], 3, [], True), ([101], 4, [1], True), ([102], 5, [], True)]
    assert sched.requests["a"].output_token_ids == [100, 101, 102, 103]


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    h = Harness(sched)
    sched.add_request(make_request("a", list(range(1, 11))))
    sched.add_request(make_request("b", list(range(21, 31))))
    assert summary(h.step()[0]) == [("a", 0, 10, True)]
    assert summary(h.step()[0]) == [("a", 10, 1, True), ("b", 0, 10, True)]


# ------------------------------------------------------------------------------------------ preemption


def _two_requests_that_outgrow_four_blocks(sched: Scheduler) -> Harness:
    """A and B, 7-token prompts, one block of 4 each: after two steps each holds 2 full blocks (pool of 4
    exhausted) and has 9 tokens; A's next decode (position 8) needs a third block."""
    h = Harness(sched)
    sched.add_request(make_request("a", list(range(1, 8)), max_tokens=3))
    sched.add_request(make_request("b", list(range(11, 18)), max_tokens=8))
    out, _ = h.step()
    assert [s.new_block_ids for s in out.scheduled] == [[0, 1], [2, 3]]
    out, _ = h.step()
    assert [s.new_block_ids for s in out.scheduled] == [[], []]
    assert sched.kv.pool.num_free_blocks == 0
    return h


def test_preemption_frees_the_newest_request_which_resumes_with_a_full_recompute():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    h = _two_requests_that_outgrow_four_blocks(sched)
    b = sched.requests["b"]

    out, outputs = h.step()
    assert summary(out) == [("a", 8, 1, True)]
    assert out.num_preempted == 1
    # B's blocks [2, 3] were freed (no hash: to the head) and A took the first of them.
    assert by_id(out, "a").new_block_ids == [2]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [b]
    assert sched.kv.num_blocks_of("b") == 0
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("a", "length")]

    out, _ = h.step()
    assert out.finished_req_ids == ["a"]
    assert out.new_requests == []  # the runner already knows B
    (s,) = out.scheduled
    assert s.req_id == "b"
    assert s.reset_block_table is True
    assert s.num_computed_tokens == 0
    assert s.token_ids == list(range(11, 18)) + [7, 7]  # prompt and both outputs, recomputed
    assert s.new_block_ids == [0, 1, 2]
    assert s.sample is True
    assert b.status == RequestStatus.RUNNING

    outputs_b = [7, 7, 7]
    while sched.has_unfinished_requests():
        outputs_b += [t for o in h.step()[1] for t in o.new_token_ids]
    assert len(outputs_b) == 8
    assert sched.make_stats().num_preemptions == 1


def test_a_resumed_request_hits_its_own_blocks_that_are_still_cached():
    sched = make_scheduler(num_blocks=4)
    h = _two_requests_that_outgrow_four_blocks(sched)
    b = sched.requests["b"]

    out, _ = h.step()
    # B's blocks keep their hashes and went to the tail, last block first: free list [3, 2]. A takes
    # block 3, evicting B's second block.
    assert by_id(out, "a").new_block_ids == [3]
    assert sched.kv.pool.num_evictions == 1

    out, _ = h.step()  # A finished last step; B resumes
    (s,) = out.scheduled
    # B's first block (2) is still cached: 4 tokens hit, the other 5 are recomputed. Free list before:
    # [3 (A's partial block), 2, 1, 0]; 2 is taken as a hit, then 3 and 1 (evicting A's block 1).
    assert (s.req_id, s.reset_block_table, s.num_computed_tokens) == ("b", True, 4)
    assert s.token_ids == [15, 16, 17, 7, 7]
    assert s.new_block_ids == [2, 3, 1]
    assert sched.kv.pool.num_evictions == 2
    assert b.num_cached_tokens == 0  # as first admitted
    assert (sched.kv.stats.num_queries, sched.kv.stats.num_hits) == (7 + 7 + 9, 4)


def test_the_newest_running_requests_are_preempted_and_keep_their_order():
    sched = make_scheduler(num_blocks=4)
    h = Harness(sched)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=4))
    sched.add_request(make_request("b", [5, 6, 7, 8], max_tokens=4))
    sched.add_request(make_request("c", [9, 10, 11], max_tokens=4))
    sched.add_request(make_request("d", [12, 13, 14], max_tokens=4))
    out, _ = h.step()
    assert [s.new_block_ids for s in out.scheduled] == [[0], [1], [2], [3]]

    # A and B each need a second block: A preempts D (the newest), B preempts C.
    out, _ = h.step()
    assert summary(out) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert [s.new_block_ids for s in out.scheduled] == [[3], [2]]
    assert out.num_preempted == 2
    assert [r.req_id for r in sched.waiting] == ["c", "d"]
    assert [r.req_id for r in sched.running] == ["a", "b"]

    num_outputs = {"a": 2, "b": 2, "c": 1, "d": 1}
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        for o in h.step()[1]:
            num_outputs[o.req_id] += len(o.new_token_ids)
    assert num_outputs == {"a": 4, "b": 4, "c": 4, "d": 4}


def test_priority_policy_admits_by_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=2, scheduling_policy="priority")
    h = Harness(sched)
    for req_id, priority in (("a", 1), ("b", 0), ("c", -1), ("d", 0)):
        sched.add_request(make_request(req_id, [1, 2, 3], max_tokens=2, priority=priority))
    assert [r.req_id for r in sched.waiting] == ["c", "b", "d", "a"]
    out, _ = h.step()
    assert [s.req_id for s in out.scheduled] == ["c", "b"]
    sched.add_request(make_request("e", [4, 5], max_tokens=2, priority=-5))  # arrives later, goes first
    order = []
    for _ in range(10):
        if not sched.has_unfinished_requests():
            break
        out, _ = h.step()
        order += [s.req_id for s in out.scheduled if s.req_id not in order]
    assert order[:3] == ["c", "b", "e"] and order.index("d") < order.index("a")


def test_priority_policy_preempts_the_lowest_priority_not_the_newest():
    """Under first come, first served D (the newest) would be preempted; under priority it is B (priority 1)
    and then the newest of the priority-0 ones. The preempted wait in priority order."""
    sched = make_scheduler(num_blocks=4, scheduling_policy="priority")
    h = Harness(sched)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=4))
    sched.add_request(make_request("b", [5, 6, 7, 8], max_tokens=4, priority=1))
    sched.add_request(make_request("c", [9, 10, 11, 12], max_tokens=4))
    sched.add_request(make_request("d", [13, 14, 15], max_tokens=4))
    num_outputs = {"a": 0, "b": 0, "c": 0, "d": 0}
    out, outputs = h.step()
    assert [s.req_id for s in out.scheduled] == ["a", "c", "d", "b"]  # running in priority order
    # A and C each need a second block: B (the lowest priority) goes first, then D (the newest of the rest).
    out, more = h.step()
    assert [s.req_id for s in out.scheduled] == ["a", "c"]
    assert [r.req_id for r in sched.waiting] == ["d", "b"]
    for o in outputs + more:
        num_outputs[o.req_id] += len(o.new_token_ids)
    for _ in range(30):
        if not sched.has_unfinished_requests():
            break
        for o in h.step()[1]:
            num_outputs[o.req_id] += len(o.new_token_ids)
    assert num_outputs == {"a": 4, "b": 4, "c": 4, "d": 4}


def test_a_priority_that_is_not_an_integer_is_refused_before_anything_changes():
    sched = make_scheduler(scheduling_policy="priority")
    h = Harness(sched)
    sched.add_request(make_request("a", [1, 2, 3]))
    h.step()
    for bad in (None, "1", 1.5, True):
        with pytest.raises(RequestRejected, match="priority must be an integer"):
            sched.add_request(make_request("b", [1, 2, 3], priority=bad))  # type: ignore[arg-type]
    assert list(sched.requests) == ["a"]
    sched.add_request(make_request("b", [1, 2, 3], priority=-1))
    h.step()
    assert [r.req_id for r in sched.running] == ["b", "a"]  # in priority order


def test_a_priority_needs_the_priority_policy():
    sched = make_scheduler()
    with pytest.raises(RequestRejected, match="--scheduling-policy priority") as e:
        sched.add_request(make_request("a", [1, 2, 3], priority=2))
    assert e.value.param == "priority" and not sched.requests
    sched.add_request(make_request("b", [1, 2, 3], priority=0))


def test_a_request_that_is_itself_the_newest_preempts_itself():
    sched = make_scheduler(num_blocks=2)
    h = Harness(sched)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    sched.add_request(make_request("b", [4, 5, 6, 7], max_tokens=4))
    h.step()
    out, _ = h.step()  # A's position 3 fits its block; B's position 4 needs one: B is the newest
    assert summary(out) == [("a", 3, 1, True)]
    assert out.num_preempted == 1
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    assert sched.requests["a"].status == RequestStatus.RUNNING


def test_no_request_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=6, enable_prefix_caching=False)
    h = Harness(sched)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=8))
    sched.add_request(make_request("b", list(range(11, 19)), max_tokens=8))
    assert summary(h.step()[0]) == [("a", 0, 4, True), ("b", 0, 2, False)]
    assert summary(h.step()[0]) == [("a", 4, 1, True), ("b", 2, 5, False)]
    assert summary(h.step()[0]) == [("a", 5, 1, True), ("b", 7, 1, True)]
    assert sched.kv.pool.num_free_blocks == 0
    # B (the newest) needs a third block for position 8 and preempts itself. Its two freed blocks would
    # take a 5-token chunk of it right away, but a step that preempted admits nothing.
    out, _ = h.step()
    assert summary(out) == [("a", 6, 1, True)]
    assert out.num_preempted == 1
    assert [r.req_id for r in sched.waiting] == ["b"]
    out, _ = h.step()
    assert summary(out) == [("a", 7, 1, True), ("b", 0, 5, False)]
    assert by_id(out, "b").reset_block_table is True


# ----------------------------------------------------------------------------------------------- abort


def test_abort_of_a_waiting_request_never_seen_by_the_runner():
    sched = make_scheduler()
    h = Harness(sched)
    sched.add_request(make_request("a", [1, 2, 3]))
    (aborted,) = sched.abort_requests(["a"])
    assert aborted.req_id == "a" and aborted.status == RequestStatus.FINISHED_ABORTED
    assert aborted.status.finish_reason == "abort"
    assert not sched.has_unfinished_requests()
    out, _ = h.step()
    assert out.finished_req_ids == [] and out.scheduled == []


def test_abort_of_a_running_request_frees_its_blocks_and_tells_the_runner_once():
    sched = make_scheduler(num_blocks=8)
    h = Harness(sched)
    sched.add_request(make_request("a", list(range(1, 10))))  # 3 blocks
    sched.add_request(make_request("b", [20, 21]))  # 1 block
    h.step()
    assert sched.kv.pool.num_free_blocks == 4
    assert [r.req_id for r in sched.abort_requests(["a"])] == ["a"]
    assert sched.kv.pool.num_free_blocks == 7
    sched.check_invariants()
    out, _ = h.step()
    assert out.finished_req_ids == ["a"]
    assert [s.req_id for s in out.scheduled] == ["b"]
    out, _ = h.step()
    assert out.finished_req_ids == []
    assert "a" not in h.runner.requests


def test_abort_of_a_preempted_request():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    h = _two_requests_that_outgrow_four_blocks(sched)
    h.step()
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    assert [r.req_id for r in sched.abort_requests(["b"])] == ["b"]
    assert not sched.waiting
    sched.check_invariants()
    out, _ = h.step()  # A finished in the previous step too
    assert sorted(out.finished_req_ids) == ["a", "b"]
    assert out.scheduled == []
    assert h.runner.requests == {}
    assert sched.kv.pool.num_free_blocks == 4


def test_abort_while_the_step_runs_drops_the_sampled_token():
    sched = make_scheduler()
    h = Harness(sched)
    sched.add_request(make_request("a", [1, 2, 3]))
    sched.add_request(make_request("b", [4, 5, 6]))
    out = sched.schedule()
    runner_output = h.runner.execute(out)
    sched.abort_requests(["a"])
    outputs = sched.update_from_output(out, runner_output)
    assert [o.req_id for o in outputs] == ["b"]
    sched.check_invariants()
    assert h.step()[0].finished_req_ids == ["a"]


def test_a_token_sampled_for_an_aborted_request_never_reaches_a_new_request_with_its_id():
    sched = make_scheduler()
    h = Harness(sched)
    sched.add_request(make_request("a", [1, 2, 3]))
    out = sched.schedule()
    runner_output = h.runner.execute(out)
    sched.abort_requests(["a"])
    sched.add_request(make_request("a", [4, 5, 6]))  # the id is free again
    assert sched.update_from_output(out, runner_output) == []
    assert sched.requests["a"].output_token_ids == []
    assert sched.requests["a"].status == RequestStatus.WAITING
    sched.check_invariants()


def test_abort_of_unknown_or_finished_ids_is_ignored():
    sched = make_scheduler()
    h = Harness(sched)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    h.step()
    assert not sched.has_unfinished_requests()
    assert sched.abort_requests(["a", "nope"]) == []
    assert h.step()[0].finished_req_ids == ["a"]


# -------------------------------------------------------------------------------------------- rejection


def test_a_prompt_as_long_as_max_model_len_is_rejected():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(RequestRejected) as info:
        sched.add_request(make_request("a", list(range(20))))
    assert "20" in str(info.value) and "16" in str(info.value)
    assert info.value.param == "prompt"
    with pytest.raises(RequestRejected):
        sched.add_request(make_request("a", list(range(16))))
    sched.add_request(make_request("a", list(range(15)), max_tokens=1))
    assert list(sched.requests) == ["a"]
    sched.check_invariants()


def test_a_prompt_larger_than_the_kv_cache_is_rejected():
    sched = make_scheduler(num_blocks=2)
    with pytest.raises(RequestRejected, match="8 tokens"):
        sched.add_request(make_request("a", list(range(8)), max_tokens=1))
    assert not sched.requests


def test_a_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1]))
    with pytest.raises(RequestRejected) as info:
        sched.add_request(make_request("a", [2]))
    assert info.value.param == "request_id"
    assert sched.requests["a"].prompt_token_ids == [1]


def test_a_request_that_could_outgrow_the_kv_cache_is_rejected_instead_of_hanging():
    # Regression: a 7-token prompt with max_tokens=10 in a pool of 8 tokens was accepted; at position 8 it
    # preempted itself and was never readmitted (every later step scheduled nothing).
    sched = make_scheduler(num_blocks=2, max_model_len=100)
    with pytest.raises(RequestRejected) as info:
        sched.add_request(make_request("a", list(range(1, 8)), max_tokens=10))
    assert info.value.param == "max_tokens"
    assert "16" in str(info.value) and "8 tokens" in str(info.value)
    with pytest.raises(RequestRejected):
        sched.add_request(make_request("a", list(range(1, 8)), max_tokens=3))  # needs 9 slots
    assert not sched.requests

    # max_tokens=2 needs exactly the 8 slots: it is served.
    h = Harness(sched)
    sched.add_request(make_request("a", list(range(1, 8)), max_tokens=2))
    reasons = [o.finish_reason for _ in range(2) for o in h.step()[1]]
    assert reasons == [None, "length"]


def test_max_model_len_bounds_what_a_request_can_need():
    # max_tokens is large but max_model_len=9 stops the request at 9 tokens: 8 cached, which fits.
    sched = make_scheduler(num_blocks=2, max_model_len=9, max_num_batched_tokens=16)
    h = Harness(sched)
    sched.add_request(make_request("a", list(range(1, 8)), max_tokens=100))
    outputs = [o for _ in range(3) for o in h.step()[1]]
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([7], None), ([7], "length")]
    assert not sched.has_unfinished_requests()


# ---------------------------------------------------------------------------------------------- stops


@pytest.mark.parametrize(
    ("params", "eos", "max_tokens", "script", "expected_tokens", "reason", "stop_token_id"),
    [
        pytest.param({}, (2,), 16, [5, 2, 9], [5, 2], "stop", 2, id="eos"),
        pytest.param({"ignore_eos": True}, (2,), 3, [2, 2, 2, 2], [2, 2, 2], "length", None, id="ignore_eos"),
        pytest.param(
            {"ignore_eos": True, "stop_token_ids": [9]}, (2,), 16, [2, 9], [2, 9], "stop", 9,
            id="stop_token_id_despite_ignore_eos",
        ),
        pytest.param({"stop_token_ids": [9]}, (), 16, [5, 9], [5, 9], "stop", 9, id="stop_token_id"),
        pytest.param({"min_tokens": 3}, (2,), 16, [2, 2, 2, 2], [2, 2, 2], "stop", 2, id="min_tokens_eos"),
        pytest.param(
            {"min_tokens": 2, "stop_token_ids": [9]}, (), 16, [9, 9, 9], [9, 9], "stop", 9,
            id="min_tokens_stop_token",
        ),
        pytest.param({}, (2,), 4, [5] * 5, [5, 5, 5, 5], "length", None, id="max_tokens"),
        pytest.param({}, (2,), 2, [5, 2], [5, 2], "stop", 2, id="eos_on_the_last_allowed_token"),
    ],
)
def test_stop_rules(params, eos, max_tokens, script, expected_tokens, reason, stop_token_id):
    sched = make_scheduler()
    h = Harness(sched, sample_fn=lambda req_id, i: script[i])
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=max_tokens, eos_token_ids=eos, **params))
    outputs = []
    for _ in range(len(script) + 1):
        outputs += h.step()[1]
    assert [t for o in outputs for t in o.new_token_ids] == expected_tokens
    assert [o.finish_reason for o in outputs] == [None] * (len(expected_tokens) - 1) + [reason]
    assert outputs[-1].stop_token_id == stop_token_id
    assert not sched.has_unfinished_requests()


def test_max_model_len_stops_generation():
    sched = make_scheduler(max_model_len=8)
    h = Harness(sched)
    sched.add_request(make_request("a", list(range(1, 7)), max_tokens=100))
    outputs = [o for _ in range(3) for o in h.step()[1]]
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([7], None), ([7], "length")]


# ------------------------------------------------------------------------------------ shared prefixes


def test_same_prompt_admitted_in_one_step_shares_blocks():
    sched = make_scheduler()
    h = Harness(sched)
    prompt = list(range(1, 11))
    sched.add_request(make_request("a", prompt))
    sched.add_request(make_request("b", prompt))
    out, outputs = h.step()
    # B hits A's two full blocks although A computes them in this very step.
    assert summary(out) == [("a", 0, 10, True), ("b", 8, 2, True)]
    assert by_id(out, "b").token_ids == prompt[8:]
    assert [s.new_block_ids for s in out.scheduled] == [[0, 1, 2], [0, 1, 3]]
    assert (sched.kv.stats.num_queries, sched.kv.stats.num_hits) == (20, 8)
    assert sched.requests["b"].num_cached_tokens == 8
    assert [(o.req_id, o.num_cached_tokens) for o in outputs] == [("a", 0), ("b", 8)]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]


def test_same_prompt_without_prefix_caching_shares_nothing():
    sched = make_scheduler(enable_prefix_caching=False)
    h = Harness(sched)
    prompt = list(range(1, 11))
    sched.add_request(make_request("a", prompt))
    sched.add_request(make_request("b", prompt))
    out, _ = h.step()
    assert summary(out) == [("a", 0, 10, True), ("b", 0, 10, True)]
    assert [s.new_block_ids for s in out.scheduled] == [[0, 1, 2], [3, 4, 5]]


def test_samples_of_one_request_share_their_prompt_without_prefix_caching():
    sched = make_scheduler(enable_prefix_caching=False)
    h = Harness(sched)
    prompt = list(range(1, 11))
    sched.add_request(make_request("a-0", prompt), group_key="a")
    sched.add_request(make_request("a-1", prompt), group_key="a")
    sched.add_request(make_request("other", prompt))
    out, outputs = h.step()
    assert summary(out) == [("a-0", 0, 10, True), ("a-1", 8, 2, True), ("other", 0, 10, True)]
    assert [s.new_block_ids for s in out.scheduled] == [[0, 1, 2], [0, 1, 3], [4, 5, 6]]
    # Shared, not found in a prefix cache: no cached tokens are reported (a-1 reported its 8 sibling hits).
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    assert (sched.kv.stats.num_queries, sched.kv.stats.num_hits) == (0, 0)


def test_samples_of_one_request_report_the_prefix_cache_hits_of_the_first_admitted():
    """With prefix caching on, a later sample also hits the blocks its siblings computed: the request's own work,
    not prompt tokens found in the cache. Every sample reports the first admitted one's hits (the prefix cache's
    counters still count each sample's lookup, as vLLM's count each child request's)."""
    sched = make_scheduler()
    h = Harness(sched)
    prompt = list(range(1, 11))
    sched.add_request(make_request("earlier", prompt[:5]))
    h.step()
    sched.add_request(make_request("a-0", prompt), group_key="a")
    sched.add_request(make_request("a-1", prompt), group_key="a")
    out, outputs = h.step()
    assert [(s.req_id, s.num_computed_tokens) for s in out.scheduled if s.req_id != "earlier"] == [("a-0", 4), ("a-1", 8)]
    assert [(o.req_id, o.num_cached_tokens) for o in outputs if o.req_id != "earlier"] == [("a-0", 4), ("a-1", 4)]
    assert (sched.kv.stats.num_queries, sched.kv.stats.num_hits) == (25, 12)
    sched.abort_requests(["a-0", "a-1"])
    assert not sched._groups  # forgotten with its last sample: a later request of that key starts anew


def test_make_stats():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    h = Harness(sched)
    sched.add_request(make_request("a", list(range(1, 6))))
    sched.add_request(make_request("b", list(range(1, 6))))
    h.step()
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert (stats.num_blocks, stats.num_free_blocks) == (8, 6)
    assert stats.kv_cache_usage == pytest.approx(2 / 8)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (5, 0, 0)


# ---------------------------------------------------------------------- async scheduling (pipelined steps)


def test_async_decode_uses_a_placeholder_and_stops_at_max_tokens_without_a_wasted_step():
    from kvserve.core.scheduler import PLACEHOLDER_TOKEN_ID

    sched = make_scheduler()
    runner = FakeModelRunner(BS, lambda req_id, i: 10 + i)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=3, ignore_eos=True))
    first = sched.schedule()
    assert summary(first) == [("a", 0, 3, True)]
    first_out = runner.execute(first)
    assert sched.requests["a"].num_pending_tokens == 1
    # Step 2 is scheduled before step 1's token is known: one placeholder token at position 3.
    second = sched.schedule()
    assert summary(second) == [("a", 3, 1, True)]
    assert second.scheduled[0].token_ids == [PLACEHOLDER_TOKEN_ID]
    second_out = runner.execute(second)
    assert [o.new_token_ids for o in sched.update_from_output(first, first_out)] == [[10]]
    sched.check_invariants()
    third = sched.schedule()
    assert summary(third) == [("a", 4, 1, True)]
    third_out = runner.execute(third)
    assert [o.new_token_ids for o in sched.update_from_output(second, second_out)] == [[11]]
    # The third output is in flight and will be the last (max_tokens=3): nothing more is scheduled.
    fourth = sched.schedule()
    assert fourth.scheduled == []
    (last,) = sched.update_from_output(third, third_out)
    assert last.new_token_ids == [12] and last.finish_reason == "length"
    assert runner.sampled["a"] == [10, 11, 12]
    sched.check_invariants()


def test_async_stop_token_found_late_drops_the_extra_token():
    sched = make_scheduler()
    runner = FakeModelRunner(BS, lambda req_id, i: 0 if i == 1 else 5)  # EOS (0) as the second token
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=8, eos_token_ids=(0,)))
    first = sched.schedule()
    first_out = runner.execute(first)
    second = sched.schedule()
    second_out = runner.execute(second)
    assert [o.new_token_ids for o in sched.update_from_output(first, first_out)] == [[5]]
    third = sched.schedule()  # the EOS of step 2 is not known yet: a third token is computed
    third_out = runner.execute(third)
    (stopped,) = sched.update_from_output(second, second_out)
    assert stopped.new_token_ids == [0] and stopped.finish_reason == "stop"
    assert sched.update_from_output(third, third_out) == []
    assert runner.sampled["a"] == [5, 0, 5]
    assert sched.schedule().finished_req_ids == ["a"]
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


def test_async_preempted_request_keeps_its_in_flight_token_and_resumes_after_it():
    # 3 blocks of 4 tokens: a and b (4-token prompts) each need a second block for their first decode.
    sched = make_scheduler(num_blocks=3)
    runner = FakeModelRunner(BS, lambda req_id, i: 5)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=4, ignore_eos=True))
    sched.add_request(make_request("b", [6, 7, 8, 9], max_tokens=4, ignore_eos=True))
    first = sched.schedule()
    assert summary(first) == [("a", 0, 4, True), ("b", 0, 4, True)]
    first_out = runner.execute(first)
    second = sched.schedule()  # a takes the last free block; b cannot grow and is preempted
    assert summary(second) == [("a", 4, 1, True)]
    assert second.num_preempted == 1
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_pending_tokens == 1
    sched.check_invariants()
    second_out = runner.execute(second)
    sched.update_from_output(first, first_out)
    assert b.output_token_ids == [5] and b.num_pending_tokens == 0
    sched.check_invariants()
    sched.update_from_output(second, second_out)
    for _ in range(20):  # the rest step by step: a finishes, then b resumes with its token and finishes
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        sched.check_invariants()
    assert not sched.has_unfinished_requests()
    assert runner.sampled == {"a": [5, 5, 5, 5], "b": [5, 5, 5, 5]}


def _pipelined_run(sched: Scheduler, runner: FakeModelRunner) -> dict[str, list[int]]:
    """Step as EngineCore does with async scheduling until nothing is left; returns the tokens emitted."""
    emitted: dict[str, list[int]] = {}
    in_flight = None
    while sched.has_unfinished_requests() or in_flight is not None:
        out = sched.schedule()
        runner_output = runner.execute(out)
        if in_flight is not None:
            for o in sched.update_from_output(*in_flight):
                emitted.setdefault(o.req_id, []).extend(o.new_token_ids)
        in_flight = (out, runner_output)
        if out.is_empty:
            for o in sched.update_from_output(*in_flight):
                emitted.setdefault(o.req_id, []).extend(o.new_token_ids)
            in_flight = None
        sched.check_invariants()
    return emitted


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
def test_block_completed_by_the_last_placeholder_is_still_cached(pipelined: bool):
    # 5 prompt tokens + 4 outputs: the 4th output is never computed, so positions 0..7 fill two blocks;
    # block 1 is completed by the placeholder of step 4 (async) and must be hashed all the same.
    sched = make_scheduler()
    runner = FakeModelRunner(BS, lambda req_id, i: 10 + i)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True))
    if pipelined:
        emitted = _pipelined_run(sched, runner)
    else:
        emitted = {}
        while sched.has_unfinished_requests():
            out = sched.schedule()
            for o in sched.update_from_output(out, runner.execute(out)):
                emitted.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert emitted == {"a": [10, 11, 12, 13]}
    follow_up = make_request("b", [1, 2, 3, 4, 5, 10, 11, 12, 9, 9, 9], max_tokens=1, ignore_eos=True)
    sched.add_request(follow_up)
    sched.schedule()
    assert follow_up.num_cached_tokens == 8


def _placeholder_block_run(deferred: bool) -> tuple[dict[bytes, int], list[int]]:
    """Pipelined steps whose caller never calls `cache_scheduled_blocks`: r1 ([1, 2, 3]) is scheduled with a
    placeholder that completes its second block while r2 ([1, 2, 3, 7]) holds a block of the same tokens;
    r1's token (7) arrives before anything flushes. Returns the prefix cache ({hash: block id}) and the
    block table a later request [1, 2, 3, 7, 5] gets."""
    from kvserve.core import kv_cache_manager
    from kvserve.core.outputs import ModelRunnerOutput

    def sampled(out: SchedulerOutput, token: int) -> ModelRunnerOutput:
        ids = [s.req_id for s in out.scheduled if s.sample]
        return ModelRunnerOutput(ids, [token] * len(ids), [None] * len(ids))

    kv_cache_manager_flag = kv_cache_manager.DEFERRED_BLOCK_CACHING
    kv_cache_manager.DEFERRED_BLOCK_CACHING = deferred
    try:
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=32, enable_chunked_prefill=True)
        sched = Scheduler(config, num_blocks=10, block_size=2)
    finally:
        kv_cache_manager.DEFERRED_BLOCK_CACHING = kv_cache_manager_flag
    params = SamplingParams(ignore_eos=True)
    sched.add_request(Request("r0", [9], params, max_tokens=1))
    out0 = sched.schedule()
    sched.add_request(Request("r1", [1, 2, 3], params, max_tokens=4))
    sched.add_request(Request("r2", [1, 2, 3, 7], params, max_tokens=4))
    out1 = sched.schedule()
    sched.update_from_output(out0, sampled(out0, 8))
    out2 = sched.schedule()
    sched.update_from_output(out1, sampled(out1, 7))
    sched.update_from_output(out2, sampled(out2, 9))
    sched.kv.check_invariants()
    cached = {h: b.block_id for h, b in sched.kv.pool.cached.items()}
    sched.add_request(Request("r3", [1, 2, 3, 7, 5], params, max_tokens=2))
    sched.schedule()
    return cached, sched.kv.get_block_ids("r3")


def test_a_placeholder_completed_block_is_cached_as_without_the_deferral() -> None:
    """Deferred caching caches a request's blocks only up to the tokens it had when scheduled: a block its
    placeholder completed stays uncached until `cache_computed_blocks`, even when the token arrived before
    the flush, so r2's block keeps the hash and r3 gets the same blocks either way."""
    assert _placeholder_block_run(True) == _placeholder_block_run(False)


def _pipelined_schedule(flush_after_schedule: bool) -> list[list[tuple[str, int, int, list[int]]]]:
    """An n=3 request beside another one on a tight pool, stepped as the engine core steps under async
    scheduling (each step's tokens read after the next is scheduled), every sampled token 7."""
    from kvserve.core.outputs import ModelRunnerOutput

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=4, max_model_len=34), 6, 4)
    prefix = [100, 101, 102, 103]
    scheduler.add_request(Request("r0", prefix + [7] * 7, SamplingParams(), eos_token_ids=(0,), max_tokens=3))
    for i in (1, 2, 3):  # siblings of one n=3 request share prompt blocks through their group key
        scheduler.add_request(Request(f"r{i}", prefix + [7] * 10, SamplingParams(min_tokens=1, ignore_eos=True),
                                      eos_token_ids=(0,), max_tokens=4), group_key="g1")
    steps = []
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    for _ in range(40):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            break
        out = scheduler.schedule()
        if flush_after_schedule:
            scheduler.cache_scheduled_blocks()
        steps.append([(s.req_id, s.num_computed_tokens, len(s.token_ids), s.new_block_ids) for s in out.scheduled])
        sampled = [s.req_id for s in out.scheduled if s.sample]
        if in_flight is not None:
            scheduler.update_from_output(*in_flight)
        in_flight = (out, ModelRunnerOutput(sampled, [7] * len(sampled), [None] * len(sampled)))
        if out.is_empty:
            scheduler.update_from_output(*in_flight)
            in_flight = None
        scheduler.check_invariants()
    return steps


def test_skipping_the_flush_after_scheduling_changes_no_decision():
    # The deferred blocks must enter the hash map before a later allocation's whoever flushes them: reading a
    # token flushes even when that token completes no block of its own request (a review found the order, and
    # so later block ids and admissions, differing when it did not).
    assert _pipelined_schedule(flush_after_schedule=False) == _pipelined_schedule(flush_after_schedule=True)


def _one_scheduled() -> tuple[Scheduler, Request]:
    """Request "a" (10 tokens: two full blocks, cached) scheduled once; the invariants hold."""
    sched = make_scheduler()
    a = make_request("a", list(range(1, 11)), max_tokens=4)
    sched.add_request(a)
    sched.schedule()
    sched.cache_scheduled_blocks()
    sched.check_invariants()
    return sched, a


def test_check_invariants_matches_held_blocks_against_the_live_requests():
    """The scheduler hands its requests to the KV cache manager's check: a block re-keyed with another block's
    hash (a wrong prefix hit for a later prompt) is caught."""
    sched, a = _one_scheduled()
    b0, b1 = sched.kv.req_to_blocks["a"][:2]
    pool = sched.kv.pool
    del pool.cached[b0.block_hash], pool.cached[b1.block_hash]
    b1.block_hash, b0.block_hash = None, a.block_hashes[1]
    pool.cached[b0.block_hash] = b0
    with pytest.raises(AssertionError, match="hash of other tokens"):
        sched.check_invariants()


def _leave_known_to_runner(sched: Scheduler) -> None:
    sched._known_to_runner.add("a")


def _leave_group_key(sched: Scheduler) -> None:
    sched.kv._group_keys["a"] = "g"


def _leave_offered_count(sched: Scheduler) -> None:
    sched.kv._num_cached_blocks["a"] = 2


@pytest.mark.parametrize(
    ("leave", "message"),
    [
        (_leave_known_to_runner, "known to the runner"),
        (_leave_group_key, "sample-group key"),
        (_leave_offered_count, "holds no blocks"),
    ],
)
def test_check_invariants_catches_bookkeeping_left_by_a_finished_request(leave, message: str):
    """Each would misserve a later request of the same id: not announced to the runner (known already), in the
    old request's sample group, or with blocks counted as offered to the prefix cache."""
    sched, _ = _one_scheduled()
    sched.abort_requests(["a"])
    sched.check_invariants()
    leave(sched)
    with pytest.raises(AssertionError, match=message):
        sched.check_invariants()


def test_check_invariants_catches_the_runner_told_of_a_request_wrongly():
    sched, _ = _one_scheduled()
    sched.add_request(make_request("b", [1, 2, 3]))
    sched._known_to_runner.add("b")  # waiting, never scheduled: its first schedule would not announce it
    with pytest.raises(AssertionError, match="known to the runner"):
        sched.check_invariants()
    sched._known_to_runner -= {"a", "b"}  # running, yet its finish would not be passed on to the runner
    with pytest.raises(AssertionError, match="known to the runner"):
        sched.check_invariants()


def test_check_invariants_catches_a_request_finished_twice_since_the_last_step():
    sched, _ = _one_scheduled()
    sched.abort_requests(["a"])
    sched._finished_since_last_step.append("a")
    with pytest.raises(AssertionError, match="finished twice"):
        sched.check_invariants()


def test_a_finished_request_stays_with_the_runner_until_the_next_schedule_even_when_its_id_returns():
    """Legitimate states the checks allow: a finished request lingers in the runner until the next output
    releases it, and a new request may reuse its id meanwhile (released and announced by the same output)."""
    sched, _ = _one_scheduled()
    assert sched.runner_req_ids() == {"a"}
    sched.abort_requests(["a"])
    assert sched.runner_req_ids() == {"a"}
    sched.add_request(make_request("a", [5, 6, 7]))
    sched.check_invariants()
    out = sched.schedule()
    assert out.finished_req_ids == ["a"] and [n.req_id for n in out.new_requests] == ["a"]
    sched.check_invariants()
    assert sched.runner_req_ids() == {"a"}
