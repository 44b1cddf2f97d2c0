"""Tensor parallelism on the CPU (gloo): kvserve split over ranks against kvserve on one.

The ranks' partial sums are added in a different order than one rank's matmul adds them, so outputs agree to
float32 rounding: greedy tokens equal, logprobs within 1e-4. The ranks are real processes (spawned, as on
GPUs); the sharding of each fused weight is also checked directly, rank by rank, in this process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams, distributed
from kvserve.config import ConfigError, EngineArgs
from kvserve.layers.linear import Linear, MergedLinear, QKVLinear

PROMPTS = [
    "Hello, my name is",
    "The three most important inventions of the twentieth century were",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
    "今天天气很好，我们一起去",
]


def _run(path: str, tp: int, params: SamplingParams, **kwargs: object) -> list:
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, max_model_len=256, kv_cache_memory="16MiB",
              **kwargs)
    try:
        llm.engine.core.check_invariants_every_step = True
        return llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()


def _assert_same(one: list, split: list) -> None:
    for a, b in zip(one, split, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.prompt
        for la, lb in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert la.keys() == lb.keys()
            for token_id in la:
                assert abs(la[token_id].logprob - lb[token_id].logprob) < 1e-4
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for pa, pb in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (pa is None) == (pb is None)
            if pa is not None and pb is not None:
                assert pa.keys() == pb.keys()
                assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)
                # A prompt token deep in a random model's flat tail may swap places with a near-equal one.
                assert all(abs(pa[t].rank - pb[t].rank) <= (0 if pa[t].rank <= 20 else 2) for t in pa)


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20, logprobs=3)


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2", "qwen3", "qwen3-moe", "qwen2-moe", "mixtral"])
def test_two_ranks_match_one(tiny_model_dir: Callable[..., str], arch: str) -> None:
    # A small step budget: prompts are prefilled in chunks, mixed with other requests' decodes.
    path = tiny_model_dir(arch)
    _assert_same(_run(path, 1, GREEDY, max_num_batched_tokens=32), _run(path, 2, GREEDY, max_num_batched_tokens=32))


def test_prompt_logprobs_on_two_ranks_match_one(tiny_model_dir: Callable[..., str]) -> None:
    # Every rank computes the prompt's logits (the vocabulary-split LM head gathers on all of them) in the
    # same slices; rank 0's are reported.
    path = tiny_model_dir("qwen2")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    one = _run(path, 1, params, max_num_batched_tokens=32)
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in one)
    _assert_same(one, _run(path, 2, params, max_num_batched_tokens=32, async_scheduling=True))


def test_a_gguf_file_splits_as_its_safetensors_twin(tiny_model_dir: Callable[..., str],
                                                     tiny_gguf_path: Callable[..., str]) -> None:
    # GGUF's q/k rows come permuted (llama.cpp's layout) and are un-permuted over all heads before a rank
    # takes its share.
    path = tiny_gguf_path("llama")
    one = _run(tiny_model_dir("llama"), 1, GREEDY)
    _assert_same(one, _run(path, 2, GREEDY, tokenizer=tiny_model_dir("llama")))


def test_more_ranks_than_kv_heads(tiny_model_dir: Callable[..., str]) -> None:
    # 4 query heads, 2 KV heads, 4 ranks: each KV head is held by two ranks.
    path = tiny_model_dir("llama")
    _assert_same(_run(path, 1, GREEDY), _run(path, 4, GREEDY))


def test_async_scheduling_with_penalties_matches_one_rank(tiny_model_dir: Callable[..., str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Penalties read each request's earlier tokens, which every rank records at the engine's pace (a step's
    tokens read after the next is launched, or before it when nothing is in flight), and the newest of which
    every rank takes from its own previous step's sampled ids (rank 0 is seen doing so; a rank that counted
    wrong would sample, and feed itself, another token): the same tokens on 2 ranks as on 1."""
    from helpers.sampling import record_pending_rows

    from kvserve.executor.multiproc import TPWorkers

    pending = record_pending_rows(monkeypatch)

    path = tiny_model_dir("qwen2")
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.8,
                               frequency_penalty=0.5)
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=24, ignore_eos=True)
    flags: list[bool] = []
    step = TPWorkers.step

    def recording_step(self: TPWorkers, scheduler_output: object, finish_previous_first: bool,
                       masks_follow: bool = False) -> None:
        flags.append(finish_previous_first)
        step(self, scheduler_output, finish_previous_first, masks_follow)  # type: ignore[arg-type]

    monkeypatch.setattr(TPWorkers, "step", recording_step)

    def run(tp: int) -> list[list[int]]:
        llm = LLM(path, dtype="float32", tensor_parallel_size=tp, max_model_len=256, kv_cache_memory="16MiB",
                  async_scheduling=True)
        try:
            outs = llm.generate(PROMPTS * 2, [plain, penalised, seeded, plain] * 2, use_tqdm=False)
        finally:
            llm.shutdown()
        return [o.outputs[0].token_ids for o in outs]

    assert run(2) == run(1)
    assert True in flags and False in flags, flags
    assert sum(pending) > 0  # the penalised requests decoded pipelined


def test_grammar_steps_on_two_ranks_match_one(tiny_model_dir: Callable[..., str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined grammar steps reach the other ranks in two messages (the step, then its masks once rank 0
    has read the previous tokens): every rank samples under the masks and records the previous tokens
    before sampling, as rank 0 does (min_tokens with EOS pushed up shows a count off by one)."""
    from kvserve.executor.multiproc import TPWorkers
    from kvserve.protocol.sampling_params import StructuredOutputsParams

    sent: list[int] = []
    send_masks = TPWorkers.send_masks

    def recording(self: TPWorkers, grammar_bitmask: dict[str, bytes]) -> None:
        sent.append(len(grammar_bitmask))
        send_masks(self, grammar_bitmask)

    monkeypatch.setattr(TPWorkers, "send_masks", recording)
    path = tiny_model_dir("qwen2")
    spec = StructuredOutputsParams(regex=r"[ab ]{1,300}")
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(path).eos_token_id  # pushed up: the text ends once min_tokens lets it
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=16, frequency_penalty=1.5, structured_outputs=spec),
              SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6, logit_bias={eos: 30.0}),
              SamplingParams(temperature=0.0, max_tokens=16, min_tokens=5, structured_outputs=spec),
              SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5, structured_outputs=spec)]
    one = _run(path, 1, params, async_scheduling=True)
    _assert_same(one, _run(path, 2, params, async_scheduling=True))
    assert sent and max(sent) == 3  # the step's masks followed it
    assert len(one[1].outputs[0].token_ids) == 7  # min_tokens, then EOS


def test_a_failure_between_a_grammar_steps_halves_leaves_the_ranks_in_step(
        tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The other ranks wait for the masks of a step whose forward rank 0 launched: a failure on rank 0 before
    they are sent (here in the masks' computation) still sends them, and the engine serves the next call."""
    from kvserve.protocol.sampling_params import StructuredOutputsParams
    from kvserve.structured_output import StructuredOutputs
    from kvserve.worker.model_runner import ModelRunner

    between = {"now": False, "failures": 1}  # none for the one-rank engine
    launch, sample, bitmasks = ModelRunner.launch_forward, ModelRunner.sample, StructuredOutputs.bitmasks

    def launching(self: ModelRunner, scheduler_output: Any) -> Any:
        between["now"] = True
        return launch(self, scheduler_output)

    def sampling(self: ModelRunner, launched: Any, grammar_bitmask: dict[str, bytes]) -> Any:
        between["now"] = False
        return sample(self, launched, grammar_bitmask)

    def failing(self: StructuredOutputs, req_ids: Any) -> dict[str, bytes]:
        if between["now"] and not between["failures"]:
            between["failures"] += 1
            raise ValueError("injected: the masks failed")
        return bitmasks(self, req_ids)

    monkeypatch.setattr(ModelRunner, "launch_forward", launching)
    monkeypatch.setattr(ModelRunner, "sample", sampling)
    monkeypatch.setattr(StructuredOutputs, "bitmasks", failing)
    path = tiny_model_dir("qwen2")
    spec = StructuredOutputsParams(regex=r"[ab ]{1,300}")
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    one = _run(path, 1, params * 2, async_scheduling=True)
    between["failures"] = 0  # one for the two ranks' engine
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory="16MiB",
              async_scheduling=True)
    try:
        with pytest.raises(ValueError, match="injected"):
            llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert between["failures"] == 1
        _assert_same(one[:2], llm.generate(PROMPTS[:2], params, use_tqdm=False))
    finally:
        llm.shutdown()


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """call()'s result (or its exception, raised here), from a helper thread: a hang guard (ranks out of step
    may wait in a collective forever, where no signal reaches)."""
    import threading

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - raised again below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"hung for {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _fault_in_rank_0s_collectives(monkeypatch: pytest.MonkeyPatch, fault: Callable[[], None],
                                  at: tuple[int, ...]) -> dict[str, Any]:
    """Make this process's (rank 0's) all-reduces call `fault` before the ones numbered `at` (1-based) once
    armed (`state["armed"] = True`): between two collectives of a step the other ranks run too. The other
    ranks are fresh interpreters: only rank 0 is touched."""
    real = distributed.all_reduce
    state: dict[str, Any] = {"armed": False, "calls": 0}

    def faulty(x: torch.Tensor) -> torch.Tensor:
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] in at:
                fault()
        return real(x)

    monkeypatch.setattr(distributed, "all_reduce", faulty)
    return state


def _live_ranks() -> list[Any]:
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.name.startswith("kvserve-tp-rank")]


def test_a_failure_inside_rank_0s_step_ends_the_engine_instead_of_a_hang(
        tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 fails between two all-reduces of a forward (an out-of-memory error, say) that rank 1 runs too:
    rank 1 is left waiting in the next one, and nothing brings the ranks back in step (the next call's
    collectives would pair with the stale ones: a gloo size mismatch that kills rank 1 and then this process,
    a hang, or wrong tokens). The error reaches the caller, rank 1 is stopped at once, and the engine refuses
    further work with EngineDeadError instead."""
    from kvserve.engine.errors import EngineDeadError

    def oom() -> None:
        raise RuntimeError("injected: out of memory")

    state = _fault_in_rank_0s_collectives(monkeypatch, oom, at=(3,))
    llm = LLM(tiny_model_dir("qwen2"), dtype="float32", tensor_parallel_size=2, max_model_len=256,
              kv_cache_memory="16MiB")
    try:
        state["armed"] = True
        with pytest.raises(RuntimeError, match="injected: out of memory") as raised:
            _within(60, lambda: llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
        assert raised.type is RuntimeError
        assert not _live_ranks()
        assert distributed.tp_size() == 1 and not torch.distributed.is_initialized()  # free for a new engine
        with pytest.raises(EngineDeadError, match=r"(?s)a tensor-parallel step failed.*injected: out of memory"):
            _within(60, lambda: llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_ctrl_c_inside_a_step_leaves_the_ranks_in_step(tiny_model_dir: Callable[..., str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in `LLM.generate` lands between two collectives of a step (rank 1 ignores SIGINT and runs the
    step on): the KeyboardInterrupt waits for the step's end, so the call is interrupted and the next call
    gives the same tokens as a one-rank engine. A second Ctrl-C within the step raises at once, which ends
    the engine (its ranks are out of step)."""
    import os
    import signal

    from kvserve.engine.errors import EngineDeadError

    path = tiny_model_dir("qwen2")
    one = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def ctrl_c() -> None:
        os.kill(os.getpid(), signal.SIGINT)

    state = _fault_in_rank_0s_collectives(monkeypatch, ctrl_c, at=(3, 10, 11))
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory="16MiB")
    try:
        state["armed"] = True
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert state["calls"] > 3  # the step went on after the signal
        state["armed"] = False
        got = _within(60, lambda: llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
        assert [o.outputs[0].token_ids for o in got] == want
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # Twice within one step: the armed all-reduces 10 and 11 (4 a forward: this call's second step).
        state["armed"] = True
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert not _live_ranks()
        with pytest.raises(EngineDeadError, match="KeyboardInterrupt"):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


# The spawned ranks only (see _FAILING_CHILD_RANK): rank 1 fails between two all-reduces of its first step.
_RANK_FAILING_A_STEP = """
import sys
if sys.argv[-1:] == ["--multiprocessing-fork"]:
    import kvserve.distributed as d
    import kvserve.worker.model_runner as m
    real, launch, state = d.all_reduce, m.ModelRunner.launch_forward, {"armed": False, "calls": 0}
    def faulty(x):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == 3:
                raise MemoryError("rank 1 ran out of memory (injected)")
        return real(x)
    def launching(self, scheduler_output):
        state["armed"] = True
        return launch(self, scheduler_output)
    d.all_reduce, m.ModelRunner.launch_forward = faulty, launching
"""


def test_a_rank_that_fails_a_step_ends_the_engine_not_this_process(
        tiny_model_dir: Callable[..., str], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 fails between two all-reduces of a step and exits; rank 0, in the same step, fails on it (gloo's
    collectives raise once a peer is gone). The error reaches the caller and the engine refuses further work,
    and the process goes on: the monitor, which ends a process whose rank 0 does not fail the step (idle, or
    blocked in NCCL), leaves it alone once rank 0 has (its grace made long here, so that only rank 0's own
    failure lets this test's process live; without the grace the monitor raced rank 0 and ended it)."""
    import os

    from kvserve.engine.errors import EngineDeadError
    from kvserve.executor import multiproc

    (tmp_path / "sitecustomize.py").write_text(_RANK_FAILING_A_STEP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(multiproc, "_STEP_FAILURE_GRACE_S", 120.0)
    llm = LLM(tiny_model_dir("qwen2"), dtype="float32", tensor_parallel_size=2, max_model_len=256,
              kv_cache_memory="16MiB")
    try:
        with pytest.raises(RuntimeError) as raised:  # gloo's: the peer closed the connection
            _within(30, lambda: llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
        assert raised.type is not EngineDeadError
        assert not _live_ranks()
        with pytest.raises(EngineDeadError, match="a tensor-parallel step failed"):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_model_that_does_not_split_is_refused(tiny_model_dir: Callable[..., str]) -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not split the model: "
                                          r"num_attention_heads \(4\), intermediate_size \(128\).*tensor-parallel-size"):
        EngineArgs(model=tiny_model_dir("llama"), device="cpu", tensor_parallel_size=3).create_engine_config()


def test_more_ranks_than_gpus_is_refused(tiny_model_dir: Callable[..., str]) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() >= 8:
        pytest.skip("needs a machine with 1-7 GPUs")
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 8 needs 8 GPUs, and \d are visible"):
        path = tiny_model_dir("llama", num_attention_heads=8, num_key_value_heads=2)
        EngineArgs(model=path, device="cuda", tensor_parallel_size=8).create_engine_config()


def _build_rank(make: Callable[[], torch.nn.Module], rank: int, size: int) -> torch.nn.Module:
    previous = distributed.set_group_for_building(distributed.TPGroup(rank, size))
    try:
        return make()
    finally:
        distributed.set_group_for_building(previous)


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(4, 2, 2), (8, 2, 4), (4, 1, 2), (4, 4, 4)])
def test_qkv_shards_hold_each_ranks_heads(heads: int, kv_heads: int, size: int) -> None:
    hidden, head_dim = 16, 8
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(kv_heads * head_dim, hidden)
    v = torch.randn(kv_heads * head_dim, hidden)
    local_kv = max(kv_heads // size, 1)
    for rank in range(size):
        layer = _build_rank(lambda: QKVLinear(hidden, head_dim, heads // size, local_kv, False, torch.float32),
                            rank, size)
        assert isinstance(layer, QKVLinear)
        for shard, tensor in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, tensor, shard)  # type: ignore[attr-defined]
        got_q, got_k, got_v = layer.split(layer.weight.T)
        q_heads = heads // size
        assert torch.equal(got_q.T, q[rank * q_heads * head_dim:(rank + 1) * q_heads * head_dim])
        # Query head h reads KV head h // (heads // kv_heads): the rank's KV heads serve its query heads.
        first_kv = rank * q_heads // (heads // kv_heads)
        want = slice(first_kv * head_dim, (first_kv + local_kv) * head_dim)
        assert torch.equal(got_k.T, k[want]) and torch.equal(got_v.T, v[want])


def test_row_and_merged_shards_recombine(monkeypatch: pytest.MonkeyPatch) -> None:
    size, hidden, inner = 2, 6, 8
    gate, up, down = torch.randn(inner, hidden), torch.randn(inner, hidden), torch.randn(hidden, inner)
    bias = torch.randn(hidden)
    x = torch.randn(3, inner)
    partial = []
    for rank in range(size):
        merged = _build_rank(lambda: MergedLinear(hidden, [inner // size] * 2, False, torch.float32), rank, size)
        merged.weight.weight_loader(merged.weight, gate, 0)  # type: ignore[attr-defined]
        merged.weight.weight_loader(merged.weight, up, 1)  # type: ignore[attr-defined]
        rows = slice(rank * inner // size, (rank + 1) * inner // size)
        assert torch.equal(merged.weight, torch.cat([gate[rows], up[rows]]))
        row = _build_rank(lambda: Linear(inner // size, hidden, True, torch.float32, row_parallel=True), rank, size)
        assert isinstance(row, Linear) and row.row_parallel
        row.weight.weight_loader(row.weight, down, None)  # type: ignore[attr-defined]
        assert row.bias is not None
        row.bias.weight_loader(row.bias, bias, None)  # type: ignore[attr-defined]
        # The bias as this rank's matmul adds it (what the start-up matmul tuning groups shapes by).
        assert (row.applied_bias() is row.bias) == (rank == 0)
        # What each rank contributes to the all-reduce (here the identity): the bias must come in once.
        monkeypatch.setattr(distributed, "all_reduce", lambda t: t)
        partial.append(row(x[:, rows]))
    torch.testing.assert_close(sum(partial), x @ down.T + bias)


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_expert_shards_recombine(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """Each rank holds its share of every expert's intermediate dim (gate and up rows, down columns), from
    per-expert or fused checkpoint tensors; the ranks' partial outputs add up to the whole block's."""
    from kvserve.layers.moe import FUSED, SparseMoeBlock

    size, experts, hidden, inner = 2, 4, 6, 8
    generator = torch.Generator().manual_seed(0)
    gate, up = torch.randn(experts, inner, hidden, generator=generator), torch.randn(experts, inner, hidden,
                                                                                    generator=generator)
    down = torch.randn(experts, hidden, inner, generator=generator)
    router = torch.randn(experts, hidden, generator=generator)
    x = torch.randn(5, hidden, generator=generator)
    monkeypatch.setattr(distributed, "all_reduce", lambda t: t)
    blocks = []
    for rank in range(size + 1):  # the last one: a single rank holding everything
        rank_of, ranks = (rank, size) if rank < size else (0, 1)
        share = inner // ranks
        block = _build_rank(lambda: SparseMoeBlock(hidden, experts, 2, share, True, torch.float32),  # noqa: B023
                            rank_of, ranks)
        assert isinstance(block, SparseMoeBlock)
        w13, w2 = block.experts.w13, block.experts.w2
        block.gate.weight.weight_loader(block.gate.weight, router, None)  # type: ignore[attr-defined]
        if fused:
            w13.weight_loader(w13, torch.cat([gate, up], dim=1), FUSED)  # type: ignore[attr-defined]
            w2.weight_loader(w2, down, FUSED)  # type: ignore[attr-defined]
        else:
            for e in range(experts):
                w13.weight_loader(w13, gate[e], (e, "gate"))  # type: ignore[attr-defined]
                w13.weight_loader(w13, up[e], (e, "up"))  # type: ignore[attr-defined]
                w2.weight_loader(w2, down[e], (e, "down"))  # type: ignore[attr-defined]
        rows = slice(rank_of * inner // ranks, (rank_of + 1) * inner // ranks)
        assert torch.equal(w13, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(w2, down[:, :, rows])
        blocks.append(block(x))
    torch.testing.assert_close(blocks[0] + blocks[1], blocks[2])


def test_the_shared_expert_joins_the_experts_in_one_sum(monkeypatch: pytest.MonkeyPatch,
                                                        tiny_model_dir: Callable[..., str]) -> None:
    """Qwen2-MoE's MoE layer on 2 ranks: the shared expert's gate / up rows and down columns split as the dense
    MLP's, its gate is whole on each rank, and the layer all-reduces once (the shared expert's down projection not
    on its own): the ranks' partial outputs, each gated shared part included, add up to the whole layer's."""
    from kvserve.model.arch import load_arch_config
    from kvserve.model.llama import _moe_block

    arch = load_arch_config(tiny_model_dir("qwen2-moe"))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, arch.hidden_size, generator=generator)
    calls: list[int] = []
    monkeypatch.setattr(distributed, "all_reduce", lambda t: calls.append(1) or t)
    weights: dict[str, torch.Tensor] = {}
    outputs = []
    for rank, size in ((0, 2), (1, 2), (0, 1)):
        previous = distributed.set_group_for_building(distributed.TPGroup(rank, size))
        try:
            block = _moe_block(distributed.local_arch(arch), torch.float32, "model.layers.1.mlp")
        finally:
            distributed.set_group_for_building(previous)
        assert block.shared_expert is not None and block.shared_expert_gate is not None
        assert block.shared_expert.down_proj.weight.shape == (arch.hidden_size, 96 // size)
        assert block.shared_expert_gate.weight.shape == (1, arch.hidden_size)
        for name, param in block.named_parameters():
            for shard in param.shard_ids:  # type: ignore[attr-defined]
                key = f"{name}/{shard}"
                if key not in weights:  # the whole checkpoint tensor behind this shard, drawn once
                    if isinstance(shard, tuple):  # one expert's gate / up [I, H] or down [H, I]
                        shape = (32, arch.hidden_size) if shard[1] != "down" else (arch.hidden_size, 32)
                    elif name.endswith("gate_up_proj.weight"):
                        shape = (96, arch.hidden_size)
                    elif name.endswith("down_proj.weight"):
                        shape = (arch.hidden_size, 96)
                    else:
                        shape = tuple(param.shape)
                    weights[key] = torch.randn(shape, generator=generator) * 0.3
                param.weight_loader(param, weights[key], shard)  # type: ignore[attr-defined]
        calls.clear()
        outputs.append(block(x))
        assert len(calls) == (1 if size > 1 else 0), calls
    torch.testing.assert_close(outputs[0] + outputs[1], outputs[2])


def test_a_wrong_checkpoint_shape_is_refused_on_every_rank() -> None:
    layer = _build_rank(lambda: MergedLinear(6, [4, 4], False, torch.float32), 1, 2)
    with pytest.raises(ValueError, match=r"does not split into this rank's rows"):
        layer.weight.weight_loader(layer.weight, torch.randn(6, 6), 0)  # type: ignore[attr-defined]


def test_cuda_without_a_gpu_is_a_config_error(tiny_model_dir: Callable[..., str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=r"device 'cuda' asked for, but this machine has no usable CUDA GPU"):
        EngineArgs(model=tiny_model_dir("llama"), device="cuda").create_engine_config()


@pytest.mark.parametrize(("vocab", "size"), [(12, 2), (10, 4), (5, 4)])
def test_lm_head_split_by_vocabulary_gathers_the_whole_logits(monkeypatch: pytest.MonkeyPatch, vocab: int,
                                                             size: int) -> None:
    from kvserve.layers.embedding import LMHead

    hidden = 5
    full = torch.randn(vocab, hidden)
    x = torch.randn(3, hidden)
    heads = []
    for rank in range(size):
        head = _build_rank(lambda: LMHead(vocab, hidden, torch.float32), rank, size)
        assert isinstance(head, LMHead) and head.split
        head.weight.weight_loader(head.weight, full, None)  # type: ignore[attr-defined]
        heads.append(head)
    # Each rank's rows, the last one's past the vocabulary zero.
    padded = torch.cat([full, torch.zeros(size * heads[0].rows - vocab, hidden)])
    assert torch.equal(torch.cat([h.weight for h in heads]), padded)
    locals_ = [x @ h.weight.T for h in heads]
    monkeypatch.setattr(distributed, "all_gather", lambda t: torch.stack(locals_))
    torch.testing.assert_close(heads[1](x), x @ full.T)


def test_an_engine_beside_a_live_tensor_parallel_one_is_refused(tiny_model_dir: Callable[..., str]) -> None:
    path = tiny_model_dir("llama")
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory="16MiB")
    try:
        with pytest.raises(RuntimeError, match="still running in this process"):
            LLM(path, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    finally:
        llm.shutdown()
    # After the shutdown the process is free again, and the layers are whole.
    one = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    assert one.engine.core.runner.arch.num_attention_heads == 4


_SCRIPT_WITHOUT_SHUTDOWN = """
from kvserve import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM({path!r}, dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory="16MiB")
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    print("tokens", out[0].outputs[0].token_ids, flush=True)
"""

_FAILING_RANK = """
import kvserve.worker.model_runner as m
def refuse(self, config):
    raise MemoryError("rank 1 ran out of memory (injected)")
m.ModelRunner.__init__ = refuse
"""


# Rank 1 fails to build its model at once, while this script's own build (rank 0) takes longer than the
# monitor's grace (shortened to 0.5 s): the engine must still raise with rank 1's reason, not end the process.
_SLOW_RANK0_SCRIPT = """
if __name__ == "__main__":  # rank 1 imports this module too (spawn): it must not slow down or shorten anything
    import time
    import kvserve.executor.multiproc as mp
    import kvserve.worker.model_runner as m
    from kvserve import LLM
    mp._STARTUP_FAILURE_GRACE_S = 0.5
    original = m.ModelRunner.__init__
    def slow(self, config):
        time.sleep(3.0)
        original(self, config)
    m.ModelRunner.__init__ = slow
    try:
        LLM({path!r}, dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory="16MiB")
    except RuntimeError as exc:
        print("raised:", exc, flush=True)
"""

# Only the spawned ranks (their command line ends in --multiprocessing-fork) fail their build: not the script,
# nor multiprocessing's resource tracker.
_FAILING_CHILD_RANK = """
import sys
if sys.argv[-1:] == ["--multiprocessing-fork"]:
    import kvserve.worker.model_runner as m
    def refuse(self, config):
        raise MemoryError("rank 1 ran out of memory (injected)")
    m.ModelRunner.__init__ = refuse
"""


def test_a_script_that_never_calls_shutdown_still_exits(tiny_model_dir: Callable[..., str], tmp_path) -> None:
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_SCRIPT_WITHOUT_SHUTDOWN.format(path=tiny_model_dir("llama")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens [" in done.stdout


def test_a_rank_that_fails_at_start_up_is_an_error_here(tiny_model_dir: Callable[..., str], tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 (a fresh interpreter: it imports `sitecustomize` from PYTHONPATH, this process did not) fails to
    build its model; the engine raises with rank 1's reason instead of ending this process."""
    import multiprocessing
    import os

    (tmp_path / "sitecustomize.py").write_text(_FAILING_RANK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(RuntimeError, match=r"(?s)tensor-parallel rank 1 failed.*rank 1 ran out of memory"):
        LLM(tiny_model_dir("llama"), dtype="float32", tensor_parallel_size=2, max_model_len=256,
            kv_cache_memory="16MiB")
    assert distributed.tp_size() == 1
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("kvserve-tp-rank")]


def test_a_rank_that_fails_while_rank_0_still_builds_is_an_error_here(tiny_model_dir: Callable[..., str],
                                                                     tmp_path) -> None:
    """Rank 1 exits at once; rank 0 (the script) spends 3 s building its model, six times the grace the
    monitor gives a rank 0 that may be stuck in a collective. Building a model meets no other rank, so the
    monitor waits for the build and the gather after it, which raises with rank 1's reason: the script goes
    on (a large model's load must not end the user's process)."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(_FAILING_CHILD_RANK)
    script = tmp_path / "run.py"
    script.write_text(_SLOW_RANK0_SCRIPT.format(path=tiny_model_dir("llama")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "raised: tensor-parallel rank 1 failed" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "rank 1 ran out of memory (injected)" in done.stdout


def test_gather_reports_a_dead_rank_while_an_earlier_one_still_works() -> None:
    """With three or more ranks, the gather that follows the model builds must report the last rank's exit
    while rank 1 is still building (reading the ranks in order would wait on rank 1 and leave the dead rank to
    the monitor's grace, which ends the process). Rank 1's pipe stays open and silent, rank 2's is closed."""
    import multiprocessing
    import threading

    from kvserve.executor.multiproc import TPWorkers, WorkerError

    workers = object.__new__(TPWorkers)  # only what gather reads: no processes
    working, working_child = multiprocessing.Pipe()
    dead, dead_child = multiprocessing.Pipe()
    dead_child.close()
    workers._conns = [working, dead]
    workers._failure_seen = threading.Event()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            workers.gather()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=10.0)
    assert not thread.is_alive(), "gather waited on the silent rank 1"
    assert len(outcome) == 1 and isinstance(outcome[0], WorkerError), outcome
    assert str(outcome[0]) == "tensor-parallel rank 2 exited"
    assert workers._failure_seen.is_set()
    # Replies that come out of rank order are returned in rank order.
    working_child.send(("ok", "one"))
    replies, replies_child = multiprocessing.Pipe()
    replies_child.send(("ok", "two"))
    workers._conns = [working, replies]
    assert workers.gather() == ["one", "two"]
    for conn in (working, working_child, dead, replies, replies_child):
        conn.close()


def test_collectives_raise_inside_a_block_declared_free_of_them() -> None:
    """TPWorkers' local phase (rank 0's model build) relies on meeting no other rank; a collective added there
    later must fail at once, not hang on a dead rank. Outside the block (and with one rank) nothing changes."""
    x = torch.ones(3)
    previous = distributed.set_group_for_building(distributed.TPGroup(0, 2))
    try:
        with distributed.no_collectives():
            with pytest.raises(RuntimeError, match="all_reduce inside a block declared free of collectives"):
                distributed.all_reduce(x)
            with pytest.raises(RuntimeError, match="all_gather inside a block declared free of collectives"):
                distributed.all_gather(x)
    finally:
        distributed.set_group_for_building(previous)
    with distributed.no_collectives():
        assert distributed.all_reduce(x) is x  # one rank: no collective at all
