"""Shared pieces of the GPU benchmarks: model configs written to disk, an engine-core driver, JSON results.

The engine core is driven with token ids (random, so no two prompts share a prefix unless a benchmark
makes them), with the model's weights random (`load_format="dummy"`): no weight files, no tokenizer.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvserve.config import EngineArgs  # noqa: E402
from kvserve.engine.engine_core import EngineCore  # noqa: E402
from kvserve.engine.heap import CollectionTimer, freeze_startup_heap  # noqa: E402
from kvserve.protocol.engine import EngineCoreRequest  # noqa: E402
from kvserve.protocol.sampling_params import SamplingParams  # noqa: E402

# Qwen2.5-7B-Instruct's config.json (the fields kvserve and HF read).
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "torch_dtype": "bfloat16",
}
# Qwen2.5-0.5B-Instruct's shape (head dim 64, tied embeddings): a model whose engine streams tokens faster
# than the 7B's, for loading the server's API process.
QWEN25_05B = {**QWEN25_7B, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_window_layers": 24}
# The same structure, small: for trying the scripts on a CPU.
TINY = {**QWEN25_7B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 4096}
# SmolLM2-135M-Instruct's shape, the default model's (Llama, head dim 64, tied embeddings), at bf16.
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
    "rope_theta": 100000.0, "rms_norm_eps": 1e-05, "vocab_size": 49152, "tie_word_embeddings": True,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
# Qwen3-30B-A3B's config.json (a mixture of experts: 128 experts of width 768, 8 a token, in all 48 layers).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "vocab_size": 151936, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False, "torch_dtype": "bfloat16",
}
# Its structure, small: for trying the scripts on a CPU.
TINY_MOE = {**QWEN3_30B_A3B, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
            "num_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 49152, "max_position_embeddings": 4096}
MODEL_CONFIGS = {"qwen2.5-7b": QWEN25_7B, "qwen2.5-0.5b": QWEN25_05B, "smollm2-135m": SMOLLM2_135M, "tiny": TINY,
                 "qwen3-30b-a3b": QWEN3_30B_A3B, "tiny-moe": TINY_MOE}

COPY_TBPS = 4.28  # measured device-to-device copy on the H200 (PERFORMANCE.md)


# `quantization_config` entries of 4-bit checkpoints as their exporters write them (group size 128, the usual).
QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
}


# --quantization fp8: the engine quantizes its (random, bf16) weights at load; the checkpoint's config stays
# unquantized. One byte a projection weight and a float32 scale per output row (layers.linear.quantize_fp8).
FP8_WEIGHTS: dict[str, Any] = {"quant_method": "fp8", "bits": 8}
BENCH_QUANTIZATIONS = (*sorted(QUANT_CONFIGS), "fp8")


def quant_settings(quantization: str | None) -> dict[str, Any] | None:
    """What `decode_floor_ms` counts for a benchmark's --quantization (None: the model's dtype)."""
    if quantization == "fp8":
        return FP8_WEIGHTS
    return QUANT_CONFIGS[quantization] if quantization else None


def write_config_dir(name: str, quantization: str | None = None, remove_at_exit: bool = False) -> str:
    """A directory holding the shape's config.json (with QUANT_CONFIGS[quantization] when given; fp8 is
    quantized at load, so its config is the unquantized one). `remove_at_exit`: removed when this process
    exits (for a script's own use; a directory printed for a shell to use must stay)."""
    directory = tempfile.mkdtemp(prefix=f"kvserve-{name}-")
    if remove_at_exit:
        atexit.register(shutil.rmtree, directory, True)
    config = dict(MODEL_CONFIGS[name])
    if quantization in QUANT_CONFIGS:
        config["quantization_config"] = QUANT_CONFIGS[quantization]
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def write_served_model_dir(name: str) -> str:
    """A directory `kvserve serve --load-format dummy` can serve: the shape's config.json plus the default
    model's tokenizer (SmolLM2's; from .carry/tok when that copy exists, as on the GPU machine)."""
    directory = write_config_dir(name)
    if os.path.isdir(".carry/tok"):
        for entry in os.listdir(".carry/tok"):
            shutil.copy(os.path.join(".carry/tok", entry), directory)
    else:
        from kvserve.model.paths import default_model_path
        from kvserve.model.tokenizer import load_tokenizer

        load_tokenizer(default_model_path()).save_pretrained(directory)
    return directory


def decode_floor_ms(config: dict[str, Any], batch: int, context: int, dtype_bytes: int = 2,
                    quantization: dict[str, Any] | None = None) -> float:
    """Bytes a decode step must read (every weight but the gathered embedding, plus the KV of every
    sequence) over the measured copy bandwidth. With a `quantization_config` (QUANT_CONFIGS), the decoder's
    projections count bits / 8 bytes a weight plus a 2-byte scale and a 1-byte zero point per group and
    column, as kvserve stores them; with FP8_WEIGHTS one byte a weight and a 4-byte scale per output row."""
    h, i, layers, v = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = config["num_key_value_heads"] * head_dim
    q = heads * head_dim
    mlp = 3 * h * i
    if config.get("num_experts"):
        # A mixture of experts (every layer's, as in QWEN3_30B_A3B): the router, and the experts the batch's tokens
        # reach, counted as if each token picked its experts uniformly at random (the expected number of distinct
        # ones), as the benchmarks' random weights route them about.
        experts, top_k = config["num_experts"], config["num_experts_per_tok"]
        reached = experts * (1 - (1 - top_k / experts) ** batch)
        mlp = h * experts + reached * 3 * h * config["moe_intermediate_size"]
    projections = h * (q + 2 * kv) + q * h + mlp
    projection_bytes = projections * dtype_bytes
    if quantization and quantization.get("quant_method") == "fp8":
        projection_bytes = projections + ((h + 2 * kv) + h + 2 * i + h) * 4  # + a float32 scale per output row
    elif quantization:
        projection_bytes = projections * (quantization["bits"] / 8 + 3 / quantization["group_size"])
    per_layer = projection_bytes + ((h + 2 * kv) + 2 * h) * dtype_bytes  # + q/k/v bias and the two norms
    weights = layers * per_layer + (h + v * h) * dtype_bytes  # + final norm + lm_head
    kv_bytes = batch * context * layers * 2 * kv * dtype_bytes
    return (weights + kv_bytes) / (COPY_TBPS * 1e12) * 1e3


def git_commit() -> str:
    """The commit the benchmark ran: KVSERVE_BENCH_COMMIT when set (the device machine's copy of the tree can
    carry stale git metadata, so run_h200.sh callers pass the local HEAD), else `git rev-parse` here."""
    if os.environ.get("KVSERVE_BENCH_COMMIT"):
        return os.environ["KVSERVE_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "uncommitted working tree"
    except Exception:
        return "unknown"


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"


def write_result(out_dir: Path, name: str, settings: dict[str, Any], results: Any, device: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "settings": settings,
        "results": results,
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def sustained(fn: Callable[[], object], seconds: float, energy: GpuEnergy) -> tuple[float, float | None, int | None]:
    """(ms per call of fn, J per call or None, SM MHz at the end) over `seconds` of back-to-back replays of a
    CUDA graph of one call, after as long again of the same work, so that the GPU runs at the clock its power
    cap allows for this work: what a long prefill meets, unlike a short timing on a cool GPU."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (first-use set-up)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    reps = max(3, int(seconds / max(time.perf_counter() - begin, 1e-6)))
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    start_mj = energy.read_mj()
    begin = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - begin) * 1e3 / reps
    end_mj = energy.read_mj()
    joules = None if start_mj is None or end_mj is None else (end_mj - start_mj) / 1e3 / reps
    return ms, joules, energy.sm_clock_mhz()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate_timer(model: Any, ids: torch.Tensor, device: str) -> Callable[[int], float]:
    """A function timing HF `generate` of exactly `n` new greedy tokens for the static batch `ids` (seconds,
    synchronized; EOS cannot stop it early)."""

    def generate(new: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)
        sync(device)
        assert out.shape[1] == ids.shape[1] + new
        return time.perf_counter() - start

    return generate


def make_engine(model_dir: str, device: str, **kwargs: Any) -> tuple[EngineCore, float]:
    """An engine core on random weights; returns it and its start-up seconds (wall, synchronized).

    Its start-up heap is frozen out of the garbage collector's reach, as the engine-core process of `kvserve
    serve` does (`freeze_startup_heap`; KVSERVE_GC_FREEZE=0 turns both off). Engines dropped before the call
    are collected first, since frozen reference cycles are never collected."""
    gc.unfreeze()
    gc.collect()
    sync(device)
    start = time.perf_counter()
    args = EngineArgs(model=model_dir, load_format="dummy", device=device, **kwargs)
    core = EngineCore(args.create_engine_config())
    sync(device)
    start_s = time.perf_counter() - start  # (as the server's engine-ready time: without the freeze)
    freeze_startup_heap("benchmark engine")
    return core, start_s


@dataclass
class RunStats:
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float]  # per request, from submission
    step_s: list[float] = field(default_factory=list)  # wall time of every engine step
    step_tokens: list[int] = field(default_factory=list)  # scheduled tokens of every step
    step_reqs: list[int] = field(default_factory=list)  # scheduled requests of every step
    # per step (schedule, execute_model, update_from_output) seconds, when run with phases=True
    phase_s: list[tuple[float, float, float]] = field(default_factory=list)
    # the garbage collector's collections during the run: (generation, seconds)
    gc_pauses: list[tuple[int, float]] = field(default_factory=list)
    # each request's output token ids, in submission order (run with collect_tokens=True)
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s


@contextlib.contextmanager
def gc_pauses() -> Iterator[list[tuple[int, float]]]:
    """Record each garbage collection inside the block as (generation, seconds) in the yielded list (filled
    when the block ends)."""
    pauses: list[tuple[int, float]] = []
    with CollectionTimer() as timer:
        yield pauses
    pauses.extend((gen, seconds) for _, gen, seconds in timer.collections)


def summarize_gc_pauses(pauses: list[tuple[int, float]]) -> dict[str, dict[str, float]]:
    """Per generation ('gen0', ...): how many collections, their total and the longest, in ms (what the
    results JSON keeps: a long run has hundreds of young collections)."""
    out: dict[str, dict[str, float]] = {}
    for gen in sorted({g for g, _ in pauses}):
        times = [s * 1e3 for g, s in pauses if g == gen]
        out[f"gen{gen}"] = {"count": len(times), "total_ms": sum(times), "max_ms": max(times)}
    return out


def describe_gc_pauses(pauses: list[tuple[int, float]]) -> str:
    """`summarize_gc_pauses` as text, e.g. 'gen0 12 (4.8 ms in all, max 0.6); gen2 1 (85.0 ms in all, max
    85.0)'."""
    parts = [f"{gen} {v['count']:.0f} ({v['total_ms']:.1f} ms in all, max {v['max_ms']:.1f})"
             for gen, v in summarize_gc_pauses(pauses).items()]
    return "; ".join(parts) or "no collection"


class Driver:
    """Submits token-id prompts to an EngineCore and steps it to completion, timing each step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._next_id = 0

    def run(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        params: SamplingParams | None = None,
        phases: bool = False,
        on_step: Callable[[int], None] | None = None,
        collect_tokens: bool = False,
    ) -> RunStats:
        """phases: step the engine's parts one by one (what EngineCore.step does, minus its stats) and
        time each: scheduler, model runner (ends with the step's one host sync), scheduler update. Ignored
        with async scheduling (the parts overlap): steps are then timed whole.
        on_step: called after each step with its number of scheduled tokens, outside the step's timing.
        collect_tokens: keep each request's output token ids (RunStats.token_ids)."""
        # (With tensor parallelism too: the other ranks follow core.step(), not the runner called directly.)
        phases = phases and not self.core.async_scheduling and self.core.workers is None
        base = params or SamplingParams(temperature=0.0, ignore_eos=True)
        submitted: dict[str, float] = {}
        first: dict[str, float] = {}
        start = time.perf_counter()
        for prompt, n in zip(prompts, max_tokens, strict=True):
            req_id = f"b{self._next_id}"
            self._next_id += 1
            sp = dataclasses.replace(base, max_tokens=n)
            self.core.add_request(
                EngineCoreRequest(req_id=req_id, prompt_token_ids=prompt, sampling_params=sp, max_tokens=n)
            )
            submitted[req_id] = time.perf_counter()
        num_out = 0
        step_s: list[float] = []
        step_tokens: list[int] = []
        phase_s: list[tuple[float, float, float]] = []
        step_reqs: list[int] = []
        collected: dict[str, list[int]] = {}
        core = self.core
        with gc_pauses() as pauses:
            while core.has_unfinished_requests():
                t0 = time.perf_counter()
                if phases:
                    sched_out = core.scheduler.schedule()
                    ta = time.perf_counter()
                    runner_out = core.runner.execute_model(sched_out)
                    tb = time.perf_counter()
                    core.scheduler.cache_scheduled_blocks()  # (after the wait here: counted in the update phase)
                    outputs = core.scheduler.update_from_output(sched_out, runner_out)
                    num_scheduled = sched_out.total_num_scheduled_tokens
                    step_reqs.append(len(sched_out.scheduled))
                else:
                    result = core.step()
                    outputs, num_scheduled = result.outputs, result.num_scheduled_tokens
                    step_reqs.append(result.num_scheduled_reqs)
                t1 = time.perf_counter()
                if phases:
                    phase_s.append((ta - t0, tb - ta, t1 - tb))
                step_s.append(t1 - t0)
                step_tokens.append(num_scheduled)
                for out in outputs:
                    if out.new_token_ids and out.req_id not in first:
                        first[out.req_id] = t1
                    num_out += len(out.new_token_ids)
                    if collect_tokens:
                        collected.setdefault(out.req_id, []).extend(out.new_token_ids)
                if on_step is not None:
                    on_step(num_scheduled)
            elapsed = time.perf_counter() - start
        return RunStats(
            elapsed_s=elapsed,
            prompt_tokens=sum(len(p) for p in prompts),
            output_tokens=num_out,
            ttft_s=[first[r] - submitted[r] for r in submitted if r in first],
            step_s=step_s,
            step_tokens=step_tokens,
            phase_s=phase_s,
            step_reqs=step_reqs,
            gc_pauses=list(pauses),
            token_ids=[collected.get(r, []) for r in submitted] if collect_tokens else [],
        )


def random_prompts(generator: torch.Generator, lengths: list[int], vocab: int) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


class GpuEnergy:
    """The GPU's energy counter through NVML (`nvmlDeviceGetTotalEnergyConsumption`, millijoules since the
    driver loaded), read with ctypes from the driver's libnvidia-ml: no Python package needed. The GPU is
    found by the PCI address of torch's CUDA `device` (NVML does not follow CUDA_VISIBLE_DEVICES). The
    counter updates coarsely (tens of ms): read it over spans of a second or more, or over many requests.
    `available` is False where the library, the device or the counter is missing; then the reads return
    None."""

    def __init__(self, device: str | int | None = None) -> None:
        import ctypes

        self._ctypes = ctypes
        self._handle = ctypes.c_void_p()
        self._lib: Any = None
        self.available = False
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return
            props = torch.cuda.get_device_properties(torch.device("cuda", torch.cuda.current_device())
                                                     if device is None else torch.device(device))
            bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
            if lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id, ctypes.byref(self._handle)) != 0:
                return
            self._lib = lib
            self.available = self.read_mj() is not None
        except (OSError, AttributeError, RuntimeError, AssertionError):  # no library, symbol or CUDA device
            self._lib = None

    def read_mj(self) -> int | None:
        if self._lib is None:
            return None
        value = self._ctypes.c_ulonglong()
        if self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, self._ctypes.byref(value)) != 0:
            return None
        return int(value.value)

    def sm_clock_mhz(self) -> int | None:
        if self._lib is None:
            return None
        value = self._ctypes.c_uint()
        # NVML_CLOCK_SM = 1
        if self._lib.nvmlDeviceGetClockInfo(self._handle, 1, self._ctypes.byref(value)) != 0:
            return None
        return int(value.value)
