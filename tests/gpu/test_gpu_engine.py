"""GPU correctness of the whole engine (skipped without CUDA). Kernel-level checks: benchmarks/gpu_kernels.py.

* CUDA-graph vs eager: greedy tokens identical (float32 tiny random models, batches that fill a captured
  size and batches that need padding); one-request prefill graphs (fresh, after a cached prefix) against
  eager prefills; piecewise graphs (prompts arriving while others decode) against eager mixed steps.
* Async scheduling (pipelined steps, next inputs filled on the device) vs step by step: identical greedy
  and seeded-sampling tokens and logprobs.
* kvserve bf16 vs HF Transformers bf16 on tiny random models: both teacher-forced on kvserve's tokens and
  compared with HF float32; kvserve's top-k logprob error must be of the size of HF bf16's own error.
* The default GGUF model (float32): greedy text on the GPU equals the CPU's (skipped when the file is not
  installed, e.g. on a GPU machine it could not be copied to).

The models here have no tokenizer: the engine core is driven with token ids directly.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore
from kvserve.protocol.engine import EngineCoreRequest
from kvserve.protocol.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 1024
MiB = 1 << 20
GiB = 1 << 30


def _tiny_checkpoint(directory: str, model_type: str, seed: int, **overrides: Any) -> str:
    from helpers.tiny_models import make_bare_checkpoint

    return make_bare_checkpoint(directory, model_type, seed, vocab_size=VOCAB, **overrides)


# (model_type, overrides): head_dim 64 with GQA 2 (Llama), head_dim 128 with GQA 4 and q/k/v bias (Qwen2).
MODELS = {
    "llama-hd64": ("llama", {}),
    "qwen2-hd128": ("qwen2", {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1}),
}


# Qwen3 (q/k RMSNorm per head, no bias; head_dim 128 with hidden 256): run where the change is about what a
# layer computes between its attention launches (the piecewise graphs), not in every test.
QWEN3 = ("qwen3", {"head_dim": 128})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for i, (name, (model_type, overrides)) in enumerate(MODELS.items()):
        out[name] = _tiny_checkpoint(str(tmp_path_factory.mktemp(name)), model_type, seed=i, **overrides)
    return out


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3")), QWEN3[0], seed=7, **QWEN3[1])


def _prompts(num: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 200, (num,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _generate(
    core: EngineCore,
    prompts: list[list[int]],
    max_tokens: int,
    logprobs: int | None = None,
    params: SamplingParams | None = None,
) -> list:
    """Greedy (unless `params`), EOS ignored; returns per prompt (token ids, list of TokenLogprobs)."""
    if params is None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    for i, prompt in enumerate(prompts):
        core.add_request(
            EngineCoreRequest(req_id=str(i), prompt_token_ids=prompt, sampling_params=params, max_tokens=max_tokens)
        )
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps: dict[str, list[Any]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.req_id].extend(out.new_token_ids)
            if out.new_logprobs:
                lps[out.req_id].extend(out.new_logprobs)
    return [(tokens[str(i)], lps[str(i)]) for i in range(len(prompts))]


def _core(path: str, dtype: str, enforce_eager: bool, **kwargs: Any) -> EngineCore:
    settings: dict[str, Any] = {
        "max_model_len": 1024,
        "num_kv_blocks": 1024,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,  # several prefill chunks per prompt batch: mixed batches too
        **kwargs,
    }
    args = EngineArgs(model=path, dtype=dtype, device="cuda", enforce_eager=enforce_eager, **settings)
    return EngineCore(args.create_engine_config())


def _assert_greedy_same_or_near_tie(got: list, want: list, tol: float = 1e-3) -> None:
    """Greedy float32 runs on two devices (`_generate` results with logprobs >= 2): each prompt's tokens are
    the same, or they part at a step where both runs list both tokens among their top 2 with logprobs within
    tol of each other (a near-tie that rounding may tip; after it the histories differ, so nothing later is
    compared)."""
    for (got_tokens, got_lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert len(got_tokens) == len(want_tokens)
        part = next((i for i, (a, b) in enumerate(zip(got_tokens, want_tokens, strict=True)) if a != b), None)
        if part is None:
            continue
        a, b = got_tokens[part], want_tokens[part]
        for lp in (got_lps[part], want_lps[part]):
            listed = dict(zip(lp.token_ids[1:], lp.logprobs[1:], strict=True))
            assert a in listed and b in listed, (part, a, b, listed)
            assert abs(listed[a] - listed[b]) < tol, (part, a, b, listed)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("num_prompts", [8, 5])
def test_cuda_graph_matches_eager(checkpoints: dict[str, str], model: str, num_prompts: int) -> None:
    prompts = _prompts(num_prompts, seed=num_prompts)
    graph_core = _core(checkpoints[model], "float32", enforce_eager=False)
    assert graph_core.runner.graphs is not None, "CUDA graphs were not captured"
    with_graphs = [t for t, _ in _generate(graph_core, prompts, 24)]
    del graph_core
    eager = [t for t, _ in _generate(_core(checkpoints[model], "float32", enforce_eager=True), prompts, 24)]
    assert with_graphs == eager


def _generate_staggered(core: EngineCore, prompts: list[list[int]], max_tokens: int, every: int) -> list[list[int]]:
    """Greedy, EOS ignored; prompt i is added after i * every steps, so prompts arrive while earlier requests
    decode (steps of several requests with prefill tokens). Returns each prompt's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while step <= (len(prompts) - 1) * every or core.has_unfinished_requests():
        if step % every == 0 and step // every < len(prompts):
            i = step // every
            core.add_request(EngineCoreRequest(req_id=str(i), prompt_token_ids=prompts[i], sampling_params=params,
                                               max_tokens=max_tokens))
        for out in core.step().outputs:
            tokens[out.req_id].extend(out.new_token_ids)
        step += 1
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("model", [*MODELS, "qwen3-qk-norm"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_piecewise_graphs_match_eager(
    checkpoints: dict[str, str],
    qwen3_checkpoint: str,
    model: str,
    async_scheduling: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts arriving while others decode, and prompts longer than a step (chunks): with the piecewise
    graphs (captured CUDA graphs between the layers' attention launches) the float32 greedy tokens equal
    those of the same engine without them, and the mixed steps did replay pieces of several sizes. Qwen3's
    per-head q/k norms run inside the pieces."""
    from kvserve.worker import model_runner
    from kvserve.worker.piecewise import piecewise_graph_sizes

    path = qwen3_checkpoint if model == "qwen3-qk-norm" else checkpoints[model]

    generator = torch.Generator().manual_seed(21)
    lengths = [7, 150, 40, 700, 90, 3, 260, 33, 512, 64, 129, 18]
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    sizes_used: list[int] = []

    def recording(replay: Any) -> Any:
        return lambda size, *args: sizes_used.append(size) or replay(size, *args)

    results = []
    for piecewise in (True, False):
        monkeypatch.setattr(model_runner, "PIECEWISE_GRAPH_MAX_TOKENS", 2048 if piecewise else 0)
        core = _core(path, "float32", enforce_eager=False, async_scheduling=async_scheduling)
        pieces = core.runner.piecewise
        if piecewise:
            assert pieces is not None and pieces.sizes == piecewise_graph_sizes(512)
            monkeypatch.setattr(pieces, "replay", recording(pieces.replay))
        else:
            assert pieces is None
        results.append(_generate_staggered(core, prompts, 20, every=3))
        del core
    assert len(set(sizes_used)) >= 3, sorted(set(sizes_used))
    assert results[0] == results[1]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("shared_prefix", [False, True], ids=["plain", "cascade"])
def test_piecewise_decode_past_the_largest_decode_graph(
    checkpoints: dict[str, str], model: str, shared_prefix: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode graphs only up to 8 requests, 12 decoding together: their decode-only steps replay the pieces
    (64 tokens, 52 of them padding), with cascade attention over a shared 300-token prefix in the "cascade"
    case. float32 greedy tokens equal those of the same engine without the pieces (those steps eager)."""
    from kvserve.worker import model_runner
    from kvserve.worker.input_batch import CASCADE_MIN_PREFIX_TOKENS

    path = checkpoints[model]
    if shared_prefix:
        generator = torch.Generator().manual_seed(23)
        shared = torch.randint(3, VOCAB, (300,), generator=generator).tolist()
        assert len(shared) >= CASCADE_MIN_PREFIX_TOKENS + 16
        prompts = [shared + p[:60] for p in _prompts(12, seed=24)]
    else:
        prompts = _prompts(12, seed=25)
    decode_steps: list[tuple[int, int, int]] = []  # (size, requests, common prefix) of decode-only replays
    results = []
    for piecewise in (True, False):
        monkeypatch.setattr(model_runner, "PIECEWISE_GRAPH_MAX_TOKENS", 2048 if piecewise else 0)
        core = _core(path, "float32", enforce_eager=False, cuda_graph_sizes=[1, 2, 4, 8], cascade_attn=shared_prefix)
        assert core.runner.graphs is not None and core.runner.graphs.sizes == [1, 2, 4, 8]
        if shared_prefix:
            _generate(core, prompts[:1], 2)  # the shared prefix goes into the cache first
        pieces = core.runner.piecewise
        if piecewise:
            assert pieces is not None
            replay = pieces.replay

            def recording(size: int, metadata: Any, rows: torch.Tensor, _replay: Any = replay) -> torch.Tensor:
                num_reqs = len(metadata.seq_lens_cpu)
                if metadata.num_tokens == num_reqs:
                    decode_steps.append((size, num_reqs, metadata.common_prefix_len))
                return _replay(size, metadata, rows)

            monkeypatch.setattr(pieces, "replay", recording)
        results.append([t for t, _ in _generate(core, prompts, 24)])
        del core
    assert results[0] == results[1]
    assert decode_steps and {size for size, _, _ in decode_steps} == {64}
    assert max(n for _, n, _ in decode_steps) == 12
    assert any(prefix > 0 for _, _, prefix in decode_steps) == shared_prefix, decode_steps[:5]


@pytest.mark.usefixtures("restores_cuda_defaults")
@pytest.mark.parametrize("stage", ["graphs", "pieces"])
def test_a_failed_capture_falls_back_and_matches_eager(
    checkpoints: dict[str, str], stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One capture at start fails, as one whose kernels read a device value on the host would (CUDA
    invalidates the capture): the first decode or prefill graph ("graphs"), after which start-up retries
    with fewer graphs, or the first piecewise graph ("pieces"), after which those steps stay eager. The
    engine starts, the process's default CUDA generator works (it stayed in capture mode before), and the
    float32 greedy tokens equal the eager engine's."""
    from kvserve.worker import cuda_graph, model_runner, piecewise

    failed: list[bool] = []

    def failing_once(capture: Any) -> Any:
        def wrapped(fn: Any, pool: Any, stream: Any) -> Any:
            if failed:
                return capture(fn, pool, stream)
            failed.append(True)

            def invalid() -> Any:
                out = fn()
                torch.zeros(1, device="cuda").item()  # not permitted while capturing
                return out

            return capture(invalid, pool, stream)

        return wrapped

    if stage == "graphs":
        monkeypatch.setattr(cuda_graph, "capture_graph", failing_once(cuda_graph.capture_graph))
    else:
        monkeypatch.setattr(model_runner, "PIECEWISE_GRAPH_MAX_TOKENS", 2048)
        monkeypatch.setattr(piecewise, "warm_up_and_capture", failing_once(piecewise.warm_up_and_capture))
    path = checkpoints["llama-hd64"]
    prompts = _prompts(6, seed=31)
    core = _core(path, "float32", enforce_eager=False)
    assert failed == [True]
    assert core.runner.graphs is not None
    torch.randn(8, device="cuda")  # the default generator is out of capture mode (it stayed in it before)
    if stage == "pieces":
        assert core.runner.piecewise is None
    with_graphs = _generate_staggered(core, prompts, 20, every=3)
    del core
    monkeypatch.undo()
    assert with_graphs == _generate_staggered(_core(path, "float32", enforce_eager=True), prompts, 20, every=3)


@pytest.mark.parametrize("model", list(MODELS))
def test_padding_to_a_larger_graph_matches_eager(checkpoints: dict[str, str], model: str) -> None:
    """The capture timed every decode size; a batch sent to a larger graph than the smallest that holds it
    (what the measured padding does where a larger size with the same attention launch is faster) gives the
    eager engine's greedy tokens."""
    prompts = _prompts(3, seed=31)
    core = _core(checkpoints[model], "float32", enforce_eager=False)
    graphs = core.runner.graphs
    assert graphs is not None, "CUDA graphs were not captured"
    if graphs.pad_min_gain > 0:  # (KVSERVE_GRAPH_PAD_MIN_GAIN_PCT=0 skips the timing)
        assert sorted(graphs.size_ms) == graphs.sizes and all(t > 0 for t in graphs.size_ms.values())
    launch = graphs.attention_launch
    assert launch is not None
    # The tiny engines' sizes 1-8 (or 1-16) all split the KV 16 ways (1024 // 64 keys): one launch group.
    largest = max(s for s in graphs.sizes if launch[s] == launch[graphs.sizes[0]])
    assert largest >= 8
    graphs.pad_min_gain = 0.05
    graphs.set_size_times({s: 1.0 if s == largest else 10.0 for s in graphs.sizes})
    replayed: list[int] = []
    replay = graphs.replay

    def recording(size: int, cascade: bool = False) -> torch.Tensor:
        replayed.append(size)
        return replay(size, cascade)

    graphs.replay = recording  # type: ignore[method-assign]
    padded = [t for t, _ in _generate(core, prompts, 24)]
    del core
    eager = [t for t, _ in _generate(_core(checkpoints[model], "float32", enforce_eager=True), prompts, 24)]
    assert padded == eager
    assert replayed and set(replayed) == {largest}


@pytest.mark.parametrize("model", list(MODELS))
def test_async_scheduling_matches_sync(checkpoints: dict[str, str], model: str) -> None:
    prompts = _prompts(11, seed=3)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=17, max_tokens=20, ignore_eos=True, logprobs=3)
    results = {}
    for async_scheduling in (True, False):
        core = _core(checkpoints[model], "float32", enforce_eager=False, async_scheduling=async_scheduling)
        assert core.async_scheduling == async_scheduling
        greedy = [t for t, _ in _generate(core, prompts, 24)]
        sample = _generate(core, prompts, 20, params=sampled)
        results[async_scheduling] = (greedy, sample)
        del core
    assert results[True] == results[False]


def test_llama3_rope_scaling_greedy_gpu_equals_cpu(tmp_path: Any) -> None:
    """A tiny Llama with Llama-3.1 rope scaling, a short pre-training length so that all three frequency bands
    occur at head dim 64: the GPU engine (fp32, CUDA graphs) gives the CPU engine's greedy tokens. The CPU
    engine's scaling is checked against HF in tests/models/test_generate_vs_hf.py."""
    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path = _tiny_checkpoint(str(tmp_path), "llama", seed=5, rope_parameters=scaling)
    prompts = _prompts(4, seed=51)
    gpu = _generate(_core(path, "float32", enforce_eager=False), prompts, 16, logprobs=2)
    args = EngineArgs(model=path, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory="64MiB",
                      max_num_seqs=16, max_num_batched_tokens=512)
    cpu = _generate(EngineCore(args.create_engine_config()), prompts, 16, logprobs=2)
    _assert_greedy_same_or_near_tie(gpu, cpu)


def test_yarn_rope_scaling_greedy_gpu_equals_cpu(tmp_path: Any) -> None:
    """A tiny Qwen2 (head dim 128, q/k/v bias) with YaRN over a short pre-training length (256, factor 4: 1024
    positions), prompts past it: the GPU engine (fp32, CUDA graphs, the Triton rotary kernel and the q/k/v
    rope epilogue reading the YaRN table) gives the CPU engine's greedy tokens. The CPU engine's YaRN is
    checked against HF in tests/models/test_generate_vs_hf.py."""
    scaling = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 256}
    _, overrides = MODELS["qwen2-hd128"]
    path = _tiny_checkpoint(str(tmp_path), "qwen2", seed=6, rope_parameters=scaling, max_position_embeddings=256,
                            **overrides)
    prompts = [p * 4 for p in _prompts(4, seed=61)]  # 20 to 800 tokens: most past position 256
    gpu = _generate(_core(path, "float32", enforce_eager=False), prompts, 16, logprobs=2)
    args = EngineArgs(model=path, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory="64MiB",
                      max_num_seqs=16, max_num_batched_tokens=512)
    cpu = _generate(EngineCore(args.create_engine_config()), prompts, 16, logprobs=2)
    _assert_greedy_same_or_near_tie(gpu, cpu)


def test_kv_cache_sized_by_gpu_memory_utilization(checkpoints: dict[str, str]) -> None:
    """Without num_kv_blocks the engine profiles a forward at max_num_batched_tokens and gives the KV cache what
    this instance's gpu_memory_utilization leaves: utilization x total - what this process added to the memory
    in use since the runner started (weights, kept state, workspaces) - the activation peak - the graph reserve;
    a utilization that leaves less than one max_model_len request fails at start with the flag to change, and
    one above the free memory is refused before the weights load."""
    from kvserve.config import ConfigError

    path = checkpoints["llama-hd64"]
    utilization = 0.05  # about 5 % of the GPU for this engine, whatever else the GPU holds
    args = EngineArgs(model=path, dtype="float32", device="cuda", max_model_len=1024, max_num_seqs=16,
                      gpu_memory_utilization=utilization)
    core = EngineCore(args.create_engine_config())
    runner = core.runner
    profile, plan = runner.memory_profile, runner.kv_plan
    assert profile is not None and plan is not None and profile.activation_peak_bytes > 0
    per_block = runner.kv_cache_bytes_per_block()
    grown = profile.in_use_bytes - profile.in_use_at_start_bytes  # this process's, since the runner's start
    assert profile.in_use_at_start_bytes > 0  # the CUDA context at least
    assert profile.weights_bytes > 0 and profile.graph_reserve_bytes > 0
    # The growth is the weights and more, unless memory counted at start was released meanwhile (an earlier
    # test's engine in this process can leave some that goes while this one starts; on an H100 the growth
    # was once 8.0 MiB against 8.8 MiB of weights): then the weights count instead.
    assert profile.process_bytes == max(grown, profile.weights_bytes)
    budget = (int(profile.total_bytes * utilization) - profile.process_bytes - profile.activation_peak_bytes
              - profile.graph_reserve_bytes)
    assert core.capacity.num_blocks == plan.num_blocks == budget // per_block > 0
    kept = runner.sampler.penalty_counts  # the profile's sampling pass left them sized for every row
    assert kept is not None and kept.counts.shape[0] >= runner.max_num_reqs and len(kept) == 0
    tokens = [t for t, _ in _generate(core, _prompts(4, seed=41), 8)]
    assert all(len(t) == 8 for t in tokens)
    del core, runner
    torch.cuda.empty_cache()
    # Rounded down from the weights, the activation peak and the graph reserve over the total: what it leaves
    # for the KV cache is at most weights - process_bytes <= 0 (at least the weights count), so no block fits.
    tight_utilization = math.floor(
        (profile.weights_bytes + profile.activation_peak_bytes + profile.graph_reserve_bytes)
        / profile.total_bytes * 1000
    ) / 1000
    assert tight_utilization > 0
    tight = EngineArgs(model=path, dtype="float32", device="cuda", max_model_len=1024, max_num_seqs=16,
                       gpu_memory_utilization=tight_utilization)
    with pytest.raises(ConfigError, match="raise --gpu-memory-utilization"):
        EngineCore(tight.create_engine_config())
    # The whole GPU is never free (this process's CUDA context): refused at start, naming the numbers.
    whole = EngineArgs(model=path, dtype="float32", device="cuda", max_model_len=1024, max_num_seqs=16,
                       gpu_memory_utilization=1.0)
    with pytest.raises(ConfigError, match=r"GiB is free at start, less than the .* GiB that "
                                          r"--gpu-memory-utilization 1\.00 asks for this instance"):
        EngineCore(whole.create_engine_config())


@contextlib.contextmanager
def _memory_held(num_bytes: int, where: str) -> Iterator[None]:
    """`num_bytes` of GPU memory held while the block runs: by a child process (its own CUDA context too), or
    by this process before the engine starts (the runner's start reading counts it as not the engine's)."""
    if where == "this process":
        block = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        try:
            yield
        finally:
            del block
            torch.cuda.empty_cache()
        return
    code = (f"import sys, torch; block = torch.empty({num_bytes}, dtype=torch.uint8, device='cuda'); "
            "torch.cuda.synchronize(); print('held', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held", "the child holds no memory"
        yield
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)


def test_kv_cache_budget_is_per_instance(checkpoints: dict[str, str]) -> None:
    """--gpu-memory-utilization is a per-instance budget, as vLLM's: with 4 GiB held by another process, or by
    this process before the engine starts, the KV cache gets what it gets without them (within 256 MiB: the
    engines' own measurements; a first engine in the process, which also makes the process's one-time
    allocations, is started and dropped first). Sizing by the device-wide memory in use gave 4 GiB less."""
    held = 4 * GiB
    utilization = 0.1
    free, total = torch.cuda.mem_get_info()
    if free < utilization * total + held + 2 * GiB:
        pytest.skip(f"needs {utilization * total / GiB + 6:.0f} GiB free, {free / GiB:.1f} GiB is")
    args = EngineArgs(model=checkpoints["llama-hd64"], dtype="float32", device="cuda", max_model_len=1024,
                      max_num_seqs=16, gpu_memory_utilization=utilization)

    def start() -> tuple[int, int]:
        """The KV budget and the memory in use at the runner's start, of an engine started and dropped."""
        core = EngineCore(args.create_engine_config())
        try:
            profile, plan = core.runner.memory_profile, core.runner.kv_plan
            assert profile is not None and plan is not None
            return plan.budget_bytes, profile.in_use_at_start_bytes
        finally:
            core.shutdown()
            del core
            gc.collect()
            torch.cuda.empty_cache()

    start()  # the process's one-time allocations (cuBLAS workspaces, loaded kernels) made here
    alone, at_start_alone = start()
    assert alone > GiB
    for where in ("other process", "this process"):
        with _memory_held(held, where):
            shared, at_start = start()
        assert at_start - at_start_alone >= held - 256 * MiB, where  # the held memory was seen at start
        assert abs(shared - alone) <= 256 * MiB, (where, shared / GiB, alone / GiB)


def test_kv_cache_sized_by_kv_cache_memory(checkpoints: dict[str, str]) -> None:
    """--kv-cache-memory (vLLM's --kv-cache-memory-bytes) on a GPU: the KV cache is that size, whatever
    gpu_memory_utilization says; more than the GPU has free, or too little for one max_model_len request,
    fails at start naming the flag."""
    from kvserve.config import ConfigError

    path = checkpoints["llama-hd64"]

    def args(size: str) -> EngineArgs:
        return EngineArgs(model=path, dtype="float32", device="cuda", max_model_len=1024, max_num_seqs=16,
                          gpu_memory_utilization=0.01, kv_cache_memory=size)

    core = EngineCore(args("64MiB").create_engine_config())
    per_block = core.runner.kv_cache_bytes_per_block()
    assert core.capacity.num_blocks == core.runner.kv_plan.num_blocks == (64 << 20) // per_block > 0
    tokens = [t for t, _ in _generate(core, _prompts(4, seed=43), 8)]
    assert all(len(t) == 8 for t in tokens)
    del core
    torch.cuda.empty_cache()
    with pytest.raises(ConfigError, match="does not fit on this GPU"):
        EngineCore(args("100000GiB").create_engine_config())
    with pytest.raises(ConfigError, match="raise --kv-cache-memory to at least"):
        EngineCore(args(str(per_block)).create_engine_config())


def test_dtype_auto_follows_the_checkpoint(checkpoints: dict[str, str], tmp_path: Any) -> None:
    """--dtype auto on a GPU: a float16 checkpoint runs in float16, a bfloat16 or float32 one in bfloat16
    (every GPU these tests run on has bfloat16)."""
    import json
    import shutil

    source = checkpoints["llama-hd64"]
    for saved, expected in (("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")):
        path = tmp_path / saved
        shutil.copytree(source, path)
        config = json.loads((path / "config.json").read_text())
        config.pop("dtype", None)
        config["torch_dtype"] = saved
        (path / "config.json").write_text(json.dumps(config))
        args = EngineArgs(model=str(path), device="cuda", max_model_len=1024)
        assert args.create_engine_config().model_config.dtype == expected, saved


@pytest.mark.parametrize("model", list(MODELS))
def test_every_sampling_option_on_the_gpu(
    checkpoints: dict[str, str], model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded top-k, top-p, min-p and logit_bias with logprobs: the same tokens and logprobs with async
    scheduling (pipelined steps) as step by step, CUDA graphs in both. The same with min_tokens and the three
    penalties added (pipelined too: the newest token is counted from the previous step's ids on the GPU).
    Penalised greedy decoding
    with the penalty counts kept on the GPU across steps gives the tokens of counting each request's token
    lists every step (the same device and kernels, so no near-tie can part them)."""
    from kvserve.layers.sampler import SamplingRow
    from kvserve.worker import model_runner

    prompts = _prompts(6, seed=31)
    pipelined = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=5, max_tokens=20,
                               ignore_eos=True, logprobs=2, logit_bias={7: 2.0})
    everything = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=5, max_tokens=20,
                                ignore_eos=True, logprobs=2, logit_bias={7: 2.0}, min_tokens=4,
                                repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
    penalised = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.5, presence_penalty=0.2)
    sampled = {}
    for async_scheduling in (True, False):
        core = _core(checkpoints[model], "float32", enforce_eager=False, async_scheduling=async_scheduling)
        sampled[async_scheduling] = (_generate(core, prompts, 20, params=pipelined),
                                     _generate(core, prompts, 20, params=everything))
        if async_scheduling:
            kept = [t for t, _ in _generate(core, prompts, 20, params=penalised)]
            assert core.runner.sampler.penalty_counts is not None
            unpenalised = [t for t, _ in _generate(core, prompts, 20)]
        del core
    assert sampled[True] == sampled[False]
    assert all(len(t) == 20 for part in sampled[True] for t, _ in part)
    assert kept != unpenalised  # the penalties change the output
    monkeypatch.setattr(model_runner, "SamplingRow", lambda **kw: SamplingRow(**{**kw, "req_id": None}))
    core = _core(checkpoints[model], "float32", enforce_eager=False)
    assert [t for t, _ in _generate(core, prompts, 20, params=penalised)] == kept
    assert core.runner.sampler.penalty_counts is None  # counted from the lists: no kept counts were made


def test_penalty_kernel_matches_torch_penalties_in_the_engine(
    checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Penalised greedy decoding (pipelined, penalties kept on the GPU) gives the same tokens with the Triton
    penalty kernel, which runs on every step, as with the torch reference: the kernel's results are the
    reference's bits."""
    from kvserve.kernels import ops, triton_penalties

    launches = []
    kernel = triton_penalties.penalise_rows_
    monkeypatch.setattr(triton_penalties, "penalise_rows_", lambda *a: (launches.append(1), kernel(*a))[1])
    prompts = _prompts(6, seed=37)
    penalised = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.4, presence_penalty=0.3)
    tokens = {}
    for use_kernel in (True, False):
        ops.set_penalty_kernel(use_kernel)
        try:
            core = _core(checkpoints["qwen2-hd128"], "float32", enforce_eager=False, async_scheduling=True)
            tokens[use_kernel] = [t for t, _ in _generate(core, prompts, 24, params=penalised)]
        finally:
            ops.set_penalty_kernel(True)
        del core
        if use_kernel:
            assert len(launches) >= 24  # one a step at least
            launches.clear()
    assert not launches  # the reference run took no kernel launch
    assert tokens[True] == tokens[False]
    assert all(len(t) == 24 for t in tokens[True])


def test_structured_output_on_the_gpu(checkpoints: dict[str, str], tmp_path: Any) -> None:
    """Grammars on the GPU (masks copied from pinned memory, applied before sampling): each output follows its
    grammar, and pipelined steps with CUDA graphs give the tokens of unpipelined eager ones."""
    import re
    import shutil

    from helpers.tiny_models import write_byte_tokenizer

    from kvserve.protocol.sampling_params import StructuredOutputsParams

    # Grammars need a tokenizer; the module's checkpoints stay without one.
    path = write_byte_tokenizer(shutil.copytree(checkpoints["llama-hd64"], str(tmp_path / "with-tokenizer")))
    specs = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), StructuredOutputsParams(choice=["yes", "no"]),
             StructuredOutputsParams(regex=r"[a-z ]{300}")]
    prompts = _prompts(6, seed=41)
    tokens = {}
    for enforce_eager, async_scheduling in ((True, False), (False, True)):
        core = _core(path, "float32", enforce_eager=enforce_eager, async_scheduling=async_scheduling)
        core.check_invariants_every_step = True
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=24, structured_outputs=specs[i % 3])
            core.add_request(EngineCoreRequest(req_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                               max_tokens=24, eos_token_ids=core.eos_token_ids))
            out[str(i)] = []
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                out[o.req_id].extend(o.new_token_ids)
        assert core.structured.num_refused_tokens == 0 and len(core.structured) == 0
        tokens[enforce_eager] = [out[str(i)] for i in range(len(prompts))]
        del core
    assert tokens[True] == tokens[False]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    patterns = [r"[0-9]{3}-[a-z]{2}", "yes|no", "[a-z ]+"]
    for i, ids in enumerate(tokens[True]):
        text = tokenizer.decode([t for t in ids if t != tokenizer.eos_token_id])
        assert re.fullmatch(patterns[i % 3], text), (i, text)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(
    "enforce_eager, async_scheduling", [(False, True), (False, False), (True, False)],
    ids=["graphs-async", "graphs-sync", "eager-sync"],
)
def test_cascade_attention_matches_plain(
    checkpoints: dict[str, str], model: str, enforce_eager: bool, async_scheduling: bool
) -> None:
    """12 requests sharing a 300-token prefix (then their own 5-60 tokens): cascade decode (graphs or eager,
    pipelined steps or not) gives the plain engine's greedy tokens, and really runs."""
    from kvserve.worker.input_batch import CASCADE_MIN_PREFIX_TOKENS, CASCADE_MIN_REQS

    generator = torch.Generator().manual_seed(21)
    shared = torch.randint(3, VOCAB, (300,), generator=generator).tolist()
    prompts = [shared + p[:60] for p in _prompts(12, seed=22)]
    assert len(prompts) >= CASCADE_MIN_REQS and len(shared) >= CASCADE_MIN_PREFIX_TOKENS + 16
    results = {}
    for cascade in (True, False):
        core = _core(checkpoints[model], "float32", enforce_eager=enforce_eager, cascade_attn=cascade,
                     async_scheduling=async_scheduling)
        _generate(core, prompts[:1], 2)  # the shared prefix goes into the cache first
        seen: list[bool] = []
        prepare = core.runner.inputs.prepare

        def spy(*args: Any, _prepare: Any = prepare, _seen: list[bool] = seen, **kwargs: Any) -> Any:
            batch = _prepare(*args, **kwargs)
            _seen.append(batch.cascade)
            return batch

        core.runner.inputs.prepare = spy  # type: ignore[method-assign]
        results[cascade] = [t for t, _ in _generate(core, prompts, 24)]
        assert any(seen) == cascade
        if cascade and not enforce_eager:
            graphs = core.runner.graphs
            assert graphs is not None and graphs.cascade_sizes and graphs.has(graphs.cascade_sizes[0], True)
        del core
    assert results[True] == results[False]


def _assert_first_token_agrees(got: Any, want: Any, tol: float) -> None:
    """bf16 runs that differ only in rounding: the first sampled token's top-5 logprobs (TokenLogprobs: the
    sampled token, then the top 5) agree within tol on the tokens both list (a near-tie may swap the fifth),
    and the sampled tokens are the same or, where rounding tipped a near-tie, within tol of each other in
    both runs."""
    got_lp = dict(zip(got.token_ids, got.logprobs, strict=True))
    want_lp = dict(zip(want.token_ids, want.logprobs, strict=True))
    common = got_lp.keys() & want_lp.keys()
    assert len(common) >= len(want_lp) - 1, (got_lp, want_lp)
    assert max(abs(got_lp[t] - want_lp[t]) for t in common) < tol, (got_lp, want_lp)
    a, b = got.token_ids[0], want.token_ids[0]
    if a != b:
        assert a in want_lp and b in got_lp, (got_lp, want_lp)
        assert abs(got_lp[a] - got_lp[b]) < tol and abs(want_lp[a] - want_lp[b]) < tol, (got_lp, want_lp)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_graphs_match_eager(checkpoints: dict[str, str], model: str, dtype: str) -> None:
    """One request at a time (every prefill a one-request step): fresh prompts with lengths on both sides of
    the 128-token buckets, then prompts that share a cached 300-token prefix. With graphs, prefills that fit
    replay a prefill graph (fresh-prompt or cache graph); the output is the eager engine's (float32: greedy
    tokens; bfloat16, where a 512-row matmul may round differently from a 130-row one and the eager last layer
    attends for the sampled row alone: the first token, or a near-tie, and its top-5 logprobs)."""
    generator = torch.Generator().manual_seed(5)
    fresh = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (2, 5, 127, 128, 129, 300, 511)]
    shared = torch.randint(3, VOCAB, (300,), generator=generator).tolist()
    # new tokens after the cached 288: 16 (the first one, fresh: all 304), 52, 212, and 392 (past the
    # largest graph after cached context: eager)
    with_prefix = [shared + torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (4, 40, 200, 380)]
    prompts = fresh + with_prefix
    results = {}
    for enforce_eager in (False, True):
        core = _core(checkpoints[model], dtype, enforce_eager=enforce_eager)
        results[enforce_eager] = [_generate(core, [p], 12, logprobs=5)[0] for p in prompts]
        graphs = core.runner.graphs
        if enforce_eager:
            assert graphs is None
        else:
            assert graphs is not None and graphs.cache_prefill_sizes == [128, 256]
            if dtype == "bfloat16":  # fresh prompts: fresh-prompt graphs (the one-prompt fast path)
                assert graphs.prefill_sizes == [128, 256, 384, 512]
                # the first prompt with the prefix is fresh; two of the others hit the cache and fit a graph
                assert graphs.prefill_replays == {False: len(fresh) + 1, True: 2}
            else:  # no fast path in float32: fresh prompts of up to 256 tokens take cache graphs too
                assert graphs.prefill_sizes == []
                assert graphs.prefill_replays == {False: 0, True: 5 + 2}
        del core
    for (tokens, lps), (eager_tokens, eager_lps) in zip(results[False], results[True], strict=True):
        if dtype == "float32":
            assert tokens == eager_tokens
        else:  # (eager steps attend for the sampled row alone: another kernel than the graphs' flash)
            _assert_first_token_agrees(lps[0], eager_lps[0], 0.05)


def test_long_prefill_graph_uses_flash_and_matches_eager(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A fresh-prompt graph of at least the cuDNN threshold (1,024 tokens on sm_90+): captured with flash
    (cuDNN stays out of captures), its first token and top-5 logprobs are the eager engine's, which runs
    cuDNN at that length on sm_90+."""
    from kvserve.kernels import ops

    model_type, overrides = MODELS["qwen2-hd128"]
    path = _tiny_checkpoint(str(tmp_path_factory.mktemp("long")), model_type, seed=7,
                            **{**overrides, "max_position_embeddings": 2048})
    generator = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, VOCAB, (1100,), generator=generator).tolist()
    results = {}
    for enforce_eager in (False, True):
        core = _core(path, "bfloat16", enforce_eager=enforce_eager, max_num_batched_tokens=1280, max_model_len=2048)
        results[enforce_eager] = _generate(core, [prompt], 4, logprobs=5)[0]
        if not enforce_eager:
            graphs = core.runner.graphs
            assert graphs is not None and graphs.prefill_sizes[-1] == 1280
            assert graphs.prefill_replays[False] == 1
        del core
    assert ops.cudnn_min_tokens(torch.device("cuda")) in (0, 1024)
    (tokens, lps), (eager_tokens, eager_lps) = results[False], results[True]
    assert tokens[0] == eager_tokens[0]
    got = dict(zip(lps[0].token_ids, lps[0].logprobs, strict=True))
    want = dict(zip(eager_lps[0].token_ids, eager_lps[0].logprobs, strict=True))
    common = got.keys() & want.keys()
    assert len(common) >= len(want) - 1
    assert max(abs(got[t] - want[t]) for t in common) < 0.05


@pytest.mark.parametrize("model", list(MODELS))
def test_padded_cudnn_prefill_matches_copied(
    tmp_path_factory: pytest.TempPathFactory, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One-prompt prefills on cuDNN (1,100 tokens, padded to 1,280; 1,024, a bucket length), eager, bf16:
    with q/k/v written padded by the rotary launch, the greedy tokens and logprobs are bitwise those of the
    path that copies them into that layout, and the padded launch ran in every layer."""
    from kvserve.kernels import ops

    if ops.cudnn_min_tokens(torch.device("cuda")) != 1024:
        pytest.skip("cuDNN prefill attention is on by default on sm_90+ only")
    model_type, overrides = MODELS[model]
    path = _tiny_checkpoint(str(tmp_path_factory.mktemp("padded")), model_type, seed=8,
                            **{**overrides, "max_position_embeddings": 2048})
    generator = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (1100, 1024)]
    calls: list[int] = []
    padded = ops.rotary_embedding_and_cache_padded

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[-1])
        return padded(*args, **kwargs)

    monkeypatch.setattr(ops, "rotary_embedding_and_cache_padded", counted)
    results, counts = {}, {}
    try:
        for on in (True, False):
            ops.set_prefill_qkv_padding(on)
            calls.clear()
            core = _core(path, "bfloat16", enforce_eager=True, max_model_len=2048, max_num_batched_tokens=2048)
            results[on] = [_generate(core, [p], 6, logprobs=3)[0] for p in prompts]
            counts[on] = sorted(set(calls)), len(calls)
            del core
    finally:
        ops.set_prefill_qkv_padding(True)
    num_layers = 2 * len(prompts)
    assert counts[True][0] == [1024, 1280] and counts[True][1] >= num_layers, counts
    assert counts[False] == ([], 0)
    assert results[True] == results[False]


def _switches() -> dict[str, Any]:
    from kvserve.kernels import ops, triton_pdl

    return {"pdl": triton_pdl.set_enabled, "silu-epilogue": ops.set_gate_up_silu_fusion,
            "rope-epilogue": ops.set_qkv_rope_fusion}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("switch", ["pdl", "silu-epilogue", "rope-epilogue"])
def test_fast_path_switches_do_not_change_output(
    checkpoints: dict[str, str], model: str, enforce_eager: bool, switch: str
) -> None:
    """bf16 (so the skinny matmul runs): programmatic dependent launch, SiLU-and-mul in the gate/up matmul and
    rotary + cache write in the q/k/v matmul each give bitwise the same greedy tokens and logprobs as without
    them, in CUDA graphs and eagerly, with cascade decode in the mix. A kernel reading its input before the
    previous kernel finished, or an epilogue pairing the wrong rows, would not."""
    from kvserve.kernels import triton_pdl

    device = torch.device("cuda")
    if switch == "pdl" and (torch.cuda.get_device_capability(device)[0] < 9 or not triton_pdl.HAS_GDC):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton with the intrinsics")
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(3, VOCAB, (300,), generator=generator).tolist()
    prompts = _prompts(9, seed=4) + [shared + p[:40] for p in _prompts(8, seed=6)]
    results = {}
    set_switch = _switches()[switch]
    try:
        for on in (True, False):
            set_switch(on)
            core = _core(checkpoints[model], "bfloat16", enforce_eager=enforce_eager)
            results[on] = _generate(core, prompts, 24, logprobs=2)
            del core
    finally:
        set_switch(True)
    assert results[True] == results[False]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampled_row_attention_matches_every_row(tmp_path: Any, model: str, dtype: str) -> None:
    """The last layer's attention for the sampled rows alone (decode queries over the cache: split-K at the
    long prompts) against every token attending and the rows then selected: a 3,000-token prompt alone (an
    eager one-prompt step), then six prompts of 7-2,100 tokens together (mixed steps with decode rows). float32: the same greedy tokens, logprobs within 1e-4. bf16 (cuDNN or flash against the Triton
    decode kernel): every prompt's first token the same or a near-tie, its top-5 logprobs within 0.05, since
    later tokens may part at near-ties."""
    from kvserve.model import llama

    model_type, overrides = MODELS[model]
    path = _tiny_checkpoint(str(tmp_path), model_type, seed=2, max_position_embeddings=4096, **overrides)
    generator = torch.Generator().manual_seed(13)
    lengths = [3000, 7, 700, 150, 2100, 40, 1300]
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    results = {}
    try:
        for on in (True, False):
            llama.set_sampled_row_attention(on)
            core = _core(path, dtype, enforce_eager=False, max_model_len=4096, max_num_batched_tokens=4096)
            # One long prompt alone (an eager one-prompt step), then the rest together (chunks, mixed steps).
            results[on] = _generate(core, prompts[:1], 12, params=params) + _generate(core, prompts[1:], 12,
                                                                                          params=params)
            del core
    finally:
        llama.set_sampled_row_attention(True)
    for (tokens, lps), (want_tokens, want_lps) in zip(results[True], results[False], strict=True):
        if dtype == "float32":
            assert tokens == want_tokens
            got = [lp.logprobs[0] for lp in lps]
            want = [lp.logprobs[0] for lp in want_lps]
            assert got == pytest.approx(want, abs=1e-4)
        else:
            _assert_first_token_agrees(lps[0], want_lps[0], 0.05)


def _teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """float32 [len(generated), vocab]: log-softmax at every position that predicted a generated token."""
    ids = torch.tensor([prompt + generated[:-1]], device="cuda")
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("batches", ["chunks", "long", "batch40"])
def test_bf16_logprobs_agree_with_hf(
    checkpoints: dict[str, str], model: str, batches: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """"chunks": 6 short prompts in 512-token steps (decode batches of 6: the skinny matmul); "long": three
    prompts of 700-1000 tokens prefilled in one step of more than ops.PREFILL_GATE_UP_MIN_ROWS rows, with the
    opt-in fused prefill gate/up matmul switched on; "batch40": 40 prompts decoding together (a 48-row
    graph), where the fused TMA gate/up matmul runs by default. Both TMA paths need sm_90+."""
    from transformers import AutoModelForCausalLM

    from kvserve.kernels import ops, triton_gate_up

    path = checkpoints[model]
    k = 5
    monkeypatch.setattr(ops, "_prefill_silu_fusion", batches == "long")  # before the engine's warm-up
    fused_rows = []  # row counts of the fused TMA gate/up launches (graph captures included, replays not)
    launch = triton_gate_up.gate_up_silu
    monkeypatch.setattr(triton_gate_up, "gate_up_silu",
                        lambda x, *a, **kw: fused_rows.append(x.shape[0]) or launch(x, *a, **kw))
    if batches == "chunks":
        prompts, core = _prompts(6, seed=11), _core(path, "bfloat16", enforce_eager=False)
    elif batches == "batch40":
        prompts, core = _prompts(40, seed=13), _core(path, "bfloat16", enforce_eager=False, max_num_seqs=48)
    else:
        generator = torch.Generator().manual_seed(12)
        prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (700, 1000, 850)]
        core = _core(path, "bfloat16", enforce_eager=False, max_num_batched_tokens=4096)
    at_start, fused_rows[:] = list(fused_rows), []  # start-up: memory profile, warm-up, graph capture
    pieces = core.runner.piecewise
    assert pieces is not None
    outs = _generate(core, prompts, 16, logprobs=k)
    # The batched prompts' steps (several requests with prefill tokens) replay the piecewise graphs, in
    # bfloat16; "long"'s one step of 2,550 tokens is past them and runs eagerly.
    assert (pieces.replays > 0) == (batches != "long"), pieces.replays
    if torch.cuda.get_device_capability()[0] >= 9:
        if batches == "batch40":  # the decode graph that 40 requests replay captured the TMA launch
            from kvserve.worker.cuda_graph import padded_batch_size

            assert core.runner.graphs is not None
            size = padded_batch_size(40, core.runner.graphs.sizes)
            assert size is not None and ops.SKINNY_GEMM_MAX_ROWS < size <= ops.TMA_GATE_UP_MAX_DECODE_ROWS, size
            assert size in at_start, sorted(set(at_start))
        if batches == "long":  # the prompts' own prefill step (eager), not only the start-up memory profile
            assert fused_rows and max(fused_rows) >= ops.PREFILL_GATE_UP_MIN_ROWS, sorted(set(fused_rows))
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    kv_err, hf_err, top1_agree, total = 0.0, 0.0, 0, 0
    for prompt, (tokens, lps) in zip(prompts, outs, strict=True):
        assert len(lps) == len(tokens) == 16
        ref = _teacher_forced_logprobs(hf32, prompt, tokens)
        hf = _teacher_forced_logprobs(hf16, prompt, tokens)
        for step, token_lp in enumerate(lps):
            ids = torch.tensor(token_lp.token_ids[1:], device="cuda")  # kvserve's top-k
            kv_values = torch.tensor(token_lp.logprobs[1:], device="cuda")
            kv_err = max(kv_err, float((kv_values - ref[step, ids]).abs().max()))
            ref_top = ref[step].topk(k).indices
            hf_err = max(hf_err, float((hf[step, ref_top] - ref[step, ref_top]).abs().max()))
            top1_agree += int(token_lp.token_ids[1] == int(ref_top[0]))
            total += 1
    print(f"{model}: max |logprob - fp32| kvserve bf16 {kv_err:.4f}, HF bf16 {hf_err:.4f}; "
          f"top-1 agreement with fp32 {top1_agree}/{total}")
    assert kv_err <= 2 * hf_err + 0.02
    assert top1_agree >= 0.9 * total


def test_default_gguf_greedy_gpu_equals_cpu() -> None:
    from kvserve.model.paths import ModelLoadError, default_model_path

    path = os.environ.get("KVSERVE_TEST_GGUF")  # a copy of the default model where it is not installed
    if not path:
        try:
            path = default_model_path()
        except ModelLoadError as exc:
            pytest.skip(str(exc))
    prompts = [[1, 9690, 28, 957, 1462, 314], list(range(100, 400)), [1, 504, 1176, 1329, 5734, 282]]

    def run(device: str) -> list[list[int]]:
        args = EngineArgs(model=path, dtype="float32", device=device, max_model_len=1024, num_kv_blocks=512)
        return [t for t, _ in _generate(EngineCore(args.create_engine_config()), prompts, 32)]

    assert run("cuda") == run("cpu")


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_tuned_cublaslt_matmuls_match_torch(
    checkpoints: dict[str, str], model: str, enforce_eager: bool, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 models with every tuned matmul forced onto a cuBLASLt candidate (torch's pick left out of the
    tuning): greedy tokens equal those of an engine without tuning, with decode batches of 40 (a 48-row graph
    past the skinny matmul) among mixed chunked-prefill steps. With graphs, the 48-row graph must have
    captured the cuBLASLt path; eagerly nothing is tuned (batches come in every size)."""
    from kvserve import envs
    from kvserve.kernels import cublaslt
    from kvserve.worker import model_runner

    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(tmp_path))
    # The untuned engine must run torch's picks: no stored decode-size choices looked up (with torch's pick
    # left out below, a lookup that finds nothing times the candidates).
    monkeypatch.setattr(envs, "KVSERVE_DECODE_GEMM_CHOICES", False)
    monkeypatch.setattr(envs, "KVSERVE_PREFILL_GEMM_TUNING", 0)
    prompts = _prompts(40, seed=11)
    results = {}
    runs: list[int] = []
    run = cublaslt.LtMatmul.run

    def counted(self: cublaslt.LtMatmul, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("candidate") is None:  # ops.linear's call (the tuning names its candidate)
            runs.append(self.rows)
        return run(self, *args, **kwargs)

    cublaslt.clear_tuning()
    try:
        for tuned in (False, True):
            monkeypatch.setattr(envs, "KVSERVE_GEMM_TUNING", tuned)
            monkeypatch.setattr(model_runner, "GEMM_TUNING_DTYPES", (torch.float32,))
            monkeypatch.setattr(model_runner, "GEMM_TUNING_TORCH_CANDIDATE", False)
            monkeypatch.setattr(cublaslt.LtMatmul, "run", counted)
            runs.clear()
            core = _core(checkpoints[model], "float32", enforce_eager=enforce_eager, max_num_seqs=48)
            at_start = list(runs)  # the tuning runs after the warm-up: these calls are the graph captures'
            if not tuned:
                assert cublaslt.num_tuned() == 0  # torch's picks only
            if tuned and not enforce_eager:
                assert 48 in at_start  # the 48-row decode graph captured the cuBLASLt path
                assert cublaslt.num_tuned() > 0
                assert (tmp_path / "gemm_tuning.json").exists()
            if enforce_eager:
                assert cublaslt.num_tuned() == 0
            results[tuned] = _generate(core, prompts, 12)
            if not tuned:
                assert not runs  # neither at start nor serving
            del core
    finally:
        cublaslt.clear_tuning()
    if not enforce_eager:
        assert set(runs) <= {48}  # nothing else is tuned (the tuned engine's calls)
    else:
        assert not runs
    assert results[True] == results[False]


def _prompt_logprob_tables(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[list[Any]]:
    """Per prompt, the engine's prompt logprobs (TokenLogprobs of tokens 1..), also checking that they come
    with the first output only."""
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(req_id=f"p{i}", prompt_token_ids=prompt, sampling_params=params,
                                           max_tokens=params.max_tokens or 1))
    tables: dict[str, list[Any]] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            if out.prompt_logprobs is not None:
                assert out.req_id not in tables
                tables[out.req_id] = out.prompt_logprobs
    return [tables[f"p{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("model", list(MODELS))
def test_prompt_logprobs_graphs_eager_and_cpu_agree(checkpoints: dict[str, str], model: str) -> None:
    """Prompt logprobs on the GPU (steps that compute them run eagerly beside captured graphs, async
    scheduling on) against the eager GPU engine and the CPU engine, float32: each prompt token's logprob, and
    the top-4 values at each position; plain requests' greedy tokens are the same alongside them."""
    prompts = _prompts(6, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=4)
    tables = {}
    for name, device, eager in (("graphs", "cuda", False), ("eager", "cuda", True), ("cpu", "cpu", True)):
        args = EngineArgs(model=checkpoints[model], dtype="float32", device=device, enforce_eager=eager,
                          max_model_len=1024, num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=512,
                          async_scheduling=True)
        core = EngineCore(args.create_engine_config())
        tables[name] = _prompt_logprob_tables(core, prompts, params)
        if name == "graphs":
            alone = [t for t, _ in _generate(core, prompts, 16)]
            plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            beside: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
            for i, prompt in enumerate(prompts):  # plain requests beside prompt-logprob ones
                core.add_request(EngineCoreRequest(req_id=f"q{i}", prompt_token_ids=prompt,
                                                   sampling_params=params, max_tokens=8))
                core.add_request(EngineCoreRequest(req_id=str(i), prompt_token_ids=prompt,
                                                   sampling_params=plain, max_tokens=16))
            while core.has_unfinished_requests():
                for out in core.step().outputs:
                    if out.req_id in beside:
                        beside[out.req_id].extend(out.new_token_ids)
            assert [beside[str(i)] for i in range(len(prompts))] == alone
        del core
    for other, tol in (("eager", 1e-4), ("cpu", 1e-3)):
        for prompt, got, want in zip(prompts, tables["graphs"], tables[other], strict=True):
            assert len(got) == len(want) == len(prompt) - 1
            for pos, (g, w) in enumerate(zip(got, want, strict=True), start=1):
                assert g.token_ids[0] == w.token_ids[0] == prompt[pos]
                assert g.logprobs[0] == pytest.approx(w.logprobs[0], abs=tol)
                assert g.logprobs[1:] == pytest.approx(w.logprobs[1:], abs=tol)


def test_max_model_len_auto_is_an_engine_started_with_the_length_the_cache_holds(tmp_path: Any) -> None:
    """max_model_len auto on a GPU with CUDA graphs: a KV cache too small for the model's 4,096 positions lowers
    the length to what it holds, the decode graphs are captured at that length, and the greedy tokens equal an
    engine given that length explicitly."""
    path = _tiny_checkpoint(str(tmp_path / "long"), "llama", seed=3, max_position_embeddings=4096)

    def core(max_model_len: int | str) -> EngineCore:
        args = EngineArgs(model=path, dtype="float32", device="cuda", max_model_len=max_model_len, max_num_seqs=16,
                          max_num_batched_tokens=512, gpu_memory_utilization=0.01, kv_cache_memory="1MiB")
        return EngineCore(args.create_engine_config())

    auto = core("auto")
    held = auto.capacity.num_blocks * auto.capacity.block_size
    assert 256 <= held < 4096, held  # room for the prompts below, short of the model's length
    assert auto.max_model_len == held == auto.scheduler.config.max_model_len
    assert auto.runner.config.model_config.max_model_len == held
    prompts = [p[:200] for p in _prompts(6, seed=44)]
    got = _generate(auto, prompts, 24, logprobs=2)
    del auto
    torch.cuda.empty_cache()
    explicit = core(held)
    want = _generate(explicit, prompts, 24, logprobs=2)
    assert [t for t, _ in got] == [t for t, _ in want]
