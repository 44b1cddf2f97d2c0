"""End-to-end engine benchmarks at the Qwen2.5-7B shape with random bf16 weights built on the GPU.

Sections (--sections, default all but hf, each isolated: a failure is recorded and the next one runs):

* start     engine start (model init, memory profile, KV allocation, graph capture), per phase;
* decode    decode step latency at batch 1/8/64 x context 1k/4k: median wall time of steady-state steps
            (scheduler + input prep + forward + sampling + the host sync), with the bandwidth floor;
* seeds     the seeds' workload: 50 sequences, 512 in, 256 out, EOS ignored (output tok/s);
* random256 256 sequences, input and output lengths uniform in [100, 1024];
* ttft      time to first token of one 1024- and one 8192-token prompt (median of repeats; --ttft-lengths);
* ttftrand  time to first token of 8 prompts of new lengths in [1024, 8192], two passes (per-length set-up
            costs show as first pass minus second);
* prefillprof  the host side of a one-prompt prefill step (1024 tokens): cProfile of the launch, by function;
* ttftprefix time to first token of one request whose 1000-token prefix is cached (64 and 512 new tokens, --ttftprefix-new);
* ttftdiag  where a one-prompt TTFT goes: host launch time, GPU span, readback, garbage-collector pauses,
            with the collector as is and after `gc.freeze()`;
* prefix    prefix caching on vs off: 256 x 1064 unique tokens (0 % hits) and 256 x (shared 1000 + own 64),
            128 out each; needs a second engine with caching off;
* hf        HF Transformers static-batch `generate` on the seeds' workload (same shapes, its own random
            init: weights differ from kvserve's, which does not matter for a throughput comparison);
* kprofile  GPU time by kernel over 10 steady steps (--kprofile-cases: bN / bNxC decode, pN one prefill,
            shared256), with a GPU timeline: busy time, idle gaps and the host phase during each gap;
* hostprof  host time per steady decode step by engine phase (--hostprof-cases, default batch 1 and 64 at
            1k, 64 at 4k);
* structured the seeds' shapes with every request under a JSON schema: async (pipelined) against step by step,
            and without the grammar;
* trace     per-step breakdown of the seeds', 256-sequence and shared-prefix workloads by step kind;
* tprofile  the 256-sequence workload with windows of steps profiled (GPU only, --tprofile-windows): each
            window's batch sizes, GPU busy time against the wall time, and GPU time by kernel;
* mixed     prompts arriving every 4th step while requests decode, piecewise graphs on and off;
* poisson   requests arriving at Poisson times (the server benchmark's load without HTTP): TTFT, TPOT and
            the arrival steps, piecewise graphs on and off in one engine;
* prefixab, shared, profile: see their methods.

The start section also reports the decode graphs' times measured at capture and which sizes replay a
larger graph.

The hf section (in the defaults, last) frees the engine first and then runs HF Transformers on the seeds
section's prompts in a fresh process (`hf_probe.py`; `--hf-in-process`: in this one, after kvserve), for the
issue's "same prompts in the same run" and the ratio, against the fastest of HF's steady runs (`--hf-runs`);
alone (`--sections hf`) it draws fresh prompts and reports no ratio. Prints a table last and writes JSON per
section under --out.

    python benchmarks/engine_benchmarks.py --out benchmarks/results/h200            # GPU
    python benchmarks/engine_benchmarks.py --model tiny --device cpu --scale 0.02 --out /tmp/x   # try on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import gzip
import inspect
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    BENCH_QUANTIZATIONS,
    MODEL_CONFIGS,
    Driver,
    decode_floor_ms,
    describe_gc_pauses,
    hf_generate_timer,
    make_engine,
    quant_settings,
    random_prompts,
    summarize_gc_pauses,
    sync,
    write_config_dir,
    write_result,
)

# Seconds without GPU work before each prompt of the ttft section's idle-GPU runs.
TTFT_IDLE_S = 1.0
SECTIONS = ("start", "decode", "seeds", "random256", "ttft", "ttftrest", "ttftrand", "ttftprefix", "ttftdiag", "prefillprof", "prefix", "prefixab", "shared", "hf", "profile",
            "trace", "tprofile", "kprofile", "hostprof", "mixed", "poisson", "firstpass", "structured")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.config = MODEL_CONFIGS[args.model]
        self.model_dir = write_config_dir(args.model, args.quantization, remove_at_exit=True)
        self.quant_config = quant_settings(args.quantization)
        self.vocab = self.config["vocab_size"]
        self.gen = torch.Generator().manual_seed(0)
        self.rows: list[tuple[str, str, str]] = []  # (measure, value, note) for the final table
        self.results: dict[str, Any] = {}
        self.core: Any = None
        self.driver: Driver | None = None
        self.seeds_prompts: list[list[int]] | None = None  # the seeds section's timed prompts, for the hf section
        self.late_variants: list[str] = []  # Triton variants loaded by steps of the engines freed so far
        self.host_copy_times: list[tuple[int, float, float]] = []  # --time-host-copies

    def n(self, count: int) -> int:
        return max(1, int(round(count * self.args.scale)))

    def length(self, tokens: int) -> int:
        return max(2, int(round(tokens * self.args.length_scale)))

    def engine_kwargs(self, **overrides: Any) -> dict[str, Any]:
        a = self.args
        kw = dict(dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                  max_num_batched_tokens=a.max_num_batched_tokens, gpu_memory_utilization=a.gpu_memory_utilization,
                  enforce_eager=a.enforce_eager, async_scheduling=a.async_scheduling,
                  cascade_attn=a.cascade_attn, tensor_parallel_size=a.tensor_parallel_size)
        if a.cuda_graph_sizes:
            kw["cuda_graph_sizes"] = [int(v) for v in a.cuda_graph_sizes.split(",")]
        if a.device == "cpu":
            kw["kv_cache_memory"] = "512MiB"
        if a.kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = a.kv_cache_dtype
        if a.quantization == "fp8":  # quantized at load (AWQ / GPTQ are read from the config written above)
            kw["quantization"] = "fp8"
        kw.update(overrides)
        return kw

    def engine(self) -> Driver:
        if self.driver is None:
            self.core, start_s = make_engine(self.model_dir, self.args.device, **self.engine_kwargs())
            self.driver = Driver(self.core)
            if self.args.sync_debug and self.args.device.startswith("cuda"):
                _watch_syncs()  # after start-up, whose syncs are deliberate
            if self.args.time_host_copies:
                _time_host_copies(self.core.runner, self.host_copy_times)
            graphs = self.core.runner.graphs
            self.results["start"] = {"start_s": start_s, "phases_s": dict(self.core.startup_phases),
                                     "num_blocks": self.core.capacity.num_blocks,
                                     "capacity": self.core.capacity.describe(),
                                     "graph_sizes": list(graphs.sizes) if graphs is not None else [],
                                     "graph_size_ms": dict(graphs.size_ms) if graphs is not None else {},
                                     "graph_padding": {s: graphs.padded_size(s) for s in graphs.sizes}
                                     if graphs is not None else {},
                                     "gemm_tuning": [dataclasses.asdict(r) for r in self.core.runner.gemm_tuning],
                                     "startup_late_variants": list(self.core.startup_late_variants)}
            if self.core.runner.gemm_tuning:
                by_rows: dict[int, list[str]] = {}
                for r in self.core.runner.gemm_tuning:
                    by_rows.setdefault(r.rows, []).append(
                        f"{r.n}x{r.k}:{'torch' if r.choice < 0 else r.choice}"
                        + ("" if r.cached or r.untimed else f"({r.torch_us:.1f}->{r.chosen_us:.1f})"))
                print("matmul tuning (rows: N x K: choice (torch us -> chosen us, when timed))", flush=True)
                for rows, items in by_rows.items():
                    print(f"  {rows:5d}: " + " ".join(items), flush=True)
        return self.driver

    def free_engine(self) -> None:
        if self.core is not None:
            self.late_variants.extend(self.core.late_kernel_variants)
        self.driver = None
        self.core = None
        gc.unfreeze()  # (make_engine froze the engine's start-up heap; frozen cycles are never collected)
        gc.collect()
        if self.args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def prompts(self, lengths: list[int]) -> list[list[int]]:
        return random_prompts(self.gen, lengths, self.vocab)

    def warm_up(self) -> None:
        """Compile the prefill/mixed kernels at a few shapes so the timed runs do not include JIT time."""
        d = self.engine()
        d.run(self.prompts([self.length(512)] * self.n(50)), [4] * self.n(50))
        d.run(self.prompts([self.length(1000)] * 3), [2] * 3)

    # ------------------------------------------------------------------ sections

    def section_start(self) -> None:
        d = self.engine()
        r = self.results["start"]
        # The first requests after start against the same again: a kernel variant the warm-up missed stalls
        # the first (a compile: 0.2-1 s).
        firsts = []
        for _ in range(2):
            batch = d.run(self.prompts([self.length(1000)] * 3), [8] * 3)
            one = d.run(self.prompts([self.length(1000)]), [8])
            firsts.append((batch.elapsed_s * 1e3, one.elapsed_s * 1e3))
        r["first_requests_ms"] = firsts
        self.rows.append(("first requests after start (ms)", f"{firsts[0][0]:.1f}",
                          f"3 x 1000 in / 8 out, then 1: {firsts[0][0]:.1f}, {firsts[0][1]:.1f}; again: "
                          f"{firsts[1][0]:.1f}, {firsts[1][1]:.1f}"))
        phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases_s"].items())
        self.rows.append(("engine start (s)", f"{r['start_s']:.1f}", phases))
        self.rows.append(("KV cache", f"{r['num_blocks']} blocks", r["capacity"]))
        graphs, pieces = self.core.runner.graphs, self.core.runner.piecewise
        if graphs is not None:
            r["graph_pool_mib"] = graphs.pool_bytes / (1 << 20)
            r["piecewise_capture_s"] = pieces.capture_s if pieces is not None else None
            self.rows.append(("CUDA graph pool (MiB)", f"{r['graph_pool_mib']:.0f}",
                              f"capture {graphs.capture_s:.1f} s, of which piecewise "
                              + (f"{pieces.capture_s:.1f} s ({len(pieces.sizes)} sizes)" if pieces else "none")))
        pre = self.core.runner.precompile_stats
        r["precompile"] = pre
        if pre:
            times = pre["compile_s"]
            self.rows.append(("Triton precompile (s)", f"{pre['total_s']:.1f}",
                              f"{pre['variants']} variants ({len(pre['failed'])} failed) on {pre['workers']} threads; "
                              f"warm-up batches done at {pre['batches_s']:.1f} s, graph forwards at "
                              f"{pre['find_s']:.1f} s; compiles {sum(times):.1f} s in all, longest "
                              + " ".join(f"{t:.1f}" for t in times[:6])))
            self.rows.append(("  its warm-up batches (s)", f"{pre['batches_s']:.1f}",
                              ", ".join(f"{k} {v:.2f}" for k, v in pre["batch_times_s"].items())))
        late = r["startup_late_variants"]
        self.rows.append(("Triton variants the precompile missed", f"{len(late)}",
                          ", ".join(sorted(set(late))) or "(compiled at warm-up or capture)"))
        if r["graph_size_ms"]:
            moved = {s: t for s, t in r["graph_padding"].items() if t != s}
            self.rows.append(("decode graphs timed at start (ms)", f"{len(r['graph_size_ms'])} sizes",
                              " ".join(f"{s}:{t:.2f}" for s, t in r["graph_size_ms"].items())
                              + f"; padded further: {moved or 'none'}"))

    def section_decode(self) -> None:
        d = self.engine()
        self.warm_up()
        out = []
        for context in self.args.decode_contexts:
            for batch in self.args.decode_batches:
                ctx = self.length(context)
                # Early requests decode while later ones still prefill: give every request enough tokens
                # that all of them decode together for decode_steps steps.
                prefill_steps = -(-batch * ctx // self.args.max_num_batched_tokens) + 1
                steps = self.args.decode_steps + prefill_steps
                measure_graph, graph_ms = self.graph_probe(batch)
                stats = d.run(self.prompts([ctx] * batch), [steps] * batch, phases=True, on_step=measure_graph)
                decode = [i for i, t in enumerate(stats.step_tokens) if t == batch]
                decode = decode[3:] or decode
                timed = [stats.step_s[i] for i in decode]
                ms = statistics.median(timed) * 1e3
                if stats.phase_s:
                    sched, execute, update = (statistics.median(stats.phase_s[i][k] for i in decode) * 1e3
                                              for k in range(3))
                else:  # async scheduling: the parts overlap the GPU, no per-part times
                    sched = execute = update = float("nan")
                gpu_ms = graph_ms.get("ms")
                floor = decode_floor_ms(self.config, batch, context, quantization=self.quant_config)
                out.append({"batch": batch, "context": context, "median_step_ms": ms, "floor_ms": floor,
                            "fraction_of_floor": floor / ms, "num_steps_timed": len(timed),
                            "p90_step_ms": sorted(timed)[int(0.9 * (len(timed) - 1))] * 1e3,
                            "schedule_ms": sched, "execute_model_ms": execute, "update_ms": update,
                            "graph_replay_gpu_ms": gpu_ms})
                gpu = f", graph GPU {gpu_ms:.2f}" if gpu_ms else ""
                parts = (f"sched {sched:.2f} exec {execute:.2f} update {update:.2f}" if stats.phase_s
                         else "host parts overlap the GPU (async; hostprof times them)")
                self.rows.append((f"decode b{batch} ctx{context} (ms/step)", f"{ms:.2f}",
                                  f"floor {floor:.2f} -> {floor / ms:.0%}; {parts}{gpu}"))
        self.results["decode"] = out

    def section_profile(self) -> None:
        """torch.profiler over steady decode steps at batch 64, context 1k: where a step's CPU time goes."""
        from torch.profiler import ProfilerActivity, profile

        d = self.engine()
        batch, ctx = 64, self.length(1024)
        prefill_steps = -(-batch * ctx // self.args.max_num_batched_tokens) + 1
        d.run(self.prompts([ctx] * batch), [prefill_steps + 2] * batch)  # warm-up at these shapes
        core = self.core
        self.start_steady_decode(batch, ctx, "p", steady_steps=40)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.args.device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            for _ in range(10):
                core.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        while core.has_unfinished_requests():
            core.step()
        self.results["profile"] = {"table": table}
        print(table, flush=True)

    def section_trace(self) -> None:
        """Per-step breakdown of the seeds' and the 256-sequence workloads: steps grouped by kind (decode-only
        or mixed) and size, with their count, total wall seconds (and mean host phases when steps run one
        by one). With async scheduling a step's wall time mostly waits for the previous step's GPU work,
        so the step kinds' times are shifted by one step at the boundaries between kinds."""
        d = self.engine()
        self.warm_up()
        workloads = {"seeds": ([self.length(512)] * self.n(50), [self.length(256)] * self.n(50))}
        workloads["random256"] = self.random256_lengths(seed=1)
        num = len(workloads["random256"][0])
        # The shared-prefix workload of the prefix section: 256 x (one shared 1000-token prefix + 64 own).
        shared = self.prompts([self.length(1000)])[0]
        shared_prompts = [shared + own for own in self.prompts([self.length(64)] * num)]
        workloads["shared_prefix"] = ([len(p) for p in shared_prompts], [self.length(128)] * num)
        wanted = self.args.trace_workloads
        out: dict[str, Any] = {}
        for name, (ins, outs) in workloads.items():
            if wanted and name not in wanted:
                continue
            prompts = shared_prompts if name == "shared_prefix" else self.prompts(ins)
            stats = d.run(prompts, outs, phases=True)
            groups: dict[str, list[int]] = {}
            for i, (tokens, reqs) in enumerate(zip(stats.step_tokens, stats.step_reqs, strict=True)):
                if tokens == reqs:
                    kind = "decode b<=64" if reqs <= 64 else "decode b>64"
                else:
                    kind = next(f"mixed t<={b}" for b in (256, 1024, 4096, 1 << 30) if tokens <= b)
                groups.setdefault(kind, []).append(i)
            rows = {}
            for kind, idx in sorted(groups.items()):
                total = sum(stats.step_s[i] for i in idx)
                rows[kind] = {"steps": len(idx), "total_s": total, "mean_ms": total / len(idx) * 1e3,
                              "mean_tokens": sum(stats.step_tokens[i] for i in idx) / len(idx)}
                if stats.phase_s:
                    for k, part in enumerate(("sched", "exec", "update")):
                        rows[kind][f"mean_{part}_ms"] = statistics.mean(stats.phase_s[i][k] for i in idx) * 1e3
                self.rows.append((f"trace {name}: {kind}", f"{total:.3f} s",
                                  f"{len(idx)} steps, {rows[kind]['mean_ms']:.2f} ms/step, "
                                  f"{rows[kind]['mean_tokens']:.0f} tok/step"))
            out[name] = {"elapsed_s": stats.elapsed_s, "output_tok_s": stats.output_tok_s, "groups": rows}
            self.rows.append((f"trace {name} (output tok/s)", f"{stats.output_tok_s:.0f}",
                              f"{stats.elapsed_s:.2f} s, {len(stats.step_s)} steps"))
        self.results["trace"] = out

    def start_steady_decode(self, batch: int, context: int, prefix: str, steady_steps: int,
                            prompts: list[list[int]] | None = None) -> None:
        """Add `batch` greedy requests of `context` prompt tokens (or `prompts`) that run `steady_steps`
        decode steps past their prefill, and step the core until all of them decode together."""
        from kvserve.protocol.engine import EngineCoreRequest
        from kvserve.protocol.sampling_params import SamplingParams

        prefill_steps = -(-batch * context // self.args.max_num_batched_tokens) + 1
        max_tokens = prefill_steps + steady_steps
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        for i, prompt in enumerate(prompts or self.prompts([context] * batch)):
            self.core.add_request(EngineCoreRequest(req_id=f"{prefix}-{i}", prompt_token_ids=prompt,
                                                    sampling_params=params, max_tokens=max_tokens))
        for _ in range(prefill_steps + 5):
            self.core.step()

    def section_tprofile(self) -> None:
        """The 256-sequence workload (the trace section's lengths: seed 1, where random256 runs seed 0) with a few
        windows of steps under
        torch.profiler, CUDA activity only (no host op recording, so the host runs as unprofiled): per window
        the steps' batch sizes, the GPU's busy time against the window's wall time, and the kernels' GPU
        time. Tells whether the workload's steps wait on the GPU or on the host, and where the GPU's time
        goes at the batch sizes and contexts the workload really has."""
        from torch.profiler import ProfilerActivity, profile

        d = self.engine()
        self.warm_up()
        ins, outs = self.random256_lengths(seed=1)  # the trace section's draw, to compare with its steps
        prompts = self.prompts(ins)
        windows = sorted(self.args.tprofile_windows)
        length = self.args.tprofile_steps
        state: dict[str, Any] = {"step": 0, "prof": None, "t0": 0.0, "batches": []}
        done: list[dict[str, Any]] = []

        def on_step(num_scheduled: int) -> None:
            state["step"] += 1
            step = state["step"]
            if state["prof"] is not None:
                state["batches"].append(num_scheduled)
                if len(state["batches"]) == length:
                    sync(self.args.device)
                    wall_us = (time.perf_counter() - state["t0"]) * 1e6
                    prof = state["prof"]
                    prof.stop()
                    state["prof"] = None
                    done.append({"first_step": step - length + 1, "prof": prof, "wall_us": wall_us,
                                 "batches": list(state["batches"])})
            elif step in windows:
                sync(self.args.device)
                state["batches"] = []
                # CPU activity only where there is no GPU (a dry run of the section on CPU), or asked for
                # (--tprofile-host: the gaps then name the host functions running when each began).
                cuda = str(self.args.device).startswith("cuda")
                activities = [ProfilerActivity.CUDA] if cuda else []
                if not cuda or self.args.tprofile_host:
                    activities.append(ProfilerActivity.CPU)
                prof = profile(activities=activities)
                prof.start()
                state["prof"], state["t0"] = prof, time.perf_counter()

        memory_before = _allocator_counts(self.args.device)
        with _labelled_phases(self.core) if self.args.tprofile_host else contextlib.nullcontext():
            stats = d.run(prompts, outs, on_step=on_step)
        memory_after = _allocator_counts(self.args.device)
        if state["prof"] is not None:
            state["prof"].stop()
        if memory_before:
            changes = {k: memory_after[k] - v for k, v in memory_before.items()}
            self.rows.append(("tprofile allocator events during the run", f"{sum(changes.values())}",
                              ", ".join(f"{k} {v}" for k, v in changes.items())))
        out = []
        for w in done:
            prof, n = w["prof"], len(w["batches"])
            timeline = _gpu_timeline(prof, num_steps=n)
            events = sorted((e for e in prof.key_averages() if _self_device_us(e) > 0), key=_self_device_us,
                            reverse=True)
            compact = [f"{_self_device_us(e) / n:9.1f} us/step {e.count / n:6.1f}/step  {e.key[:80]}"
                       for e in events[:16]]
            batches = w["batches"]
            label = f"steps {w['first_step']}-{w['first_step'] + n - 1}"
            summary = (f"{label}: scheduled tokens {min(batches)}-{max(batches)} (mean "
                       f"{statistics.mean(batches):.0f}); wall {w['wall_us'] / n:.1f} us per step; "
                       f"{timeline['summary']}")
            print(f"tprofile {summary}", flush=True)
            print("\n".join(compact), flush=True)
            out.append({"first_step": w["first_step"], "batches": batches, "wall_us_per_step": w["wall_us"] / n,
                        "timeline": timeline, "compact": compact,
                        "gpu_us_per_step": _kernel_us(events) / n})
            self.rows.append((f"tprofile {label} (us/step)", f"{w['wall_us'] / n:.0f}",
                              f"tokens {statistics.mean(batches):.0f}; GPU busy "
                              f"{timeline.get('busy_us_per_step', 0.0):.0f} us/step"))
        self.rows.append(("tprofile 256 sequences (output tok/s)", f"{stats.output_tok_s:.0f}",
                          f"{stats.elapsed_s:.2f} s with the profiled windows"))
        self.results["tprofile"] = {"windows": out, "output_tok_s": stats.output_tok_s}

    def section_kprofile(self) -> None:
        """GPU kernel time by kernel over steady decode steps (batch 1 and 64, context 1k), from
        torch.profiler: what the graph replay, the LM head and sampling spend on the GPU. With programmatic
        dependent launch a kernel's time includes its wait for the one before, so the sums overstate the
        step; `--no-pdl` gives per-kernel times."""
        from torch.profiler import ProfilerActivity, profile

        from kvserve.kernels import triton_pdl

        if triton_pdl.enabled(torch.device(self.args.device)):
            print("kernel profile: PDL is on, so kernel times include waits and sums exceed the step "
                  "(--no-pdl for per-kernel times)", flush=True)

        from kvserve.protocol.engine import EngineCoreRequest
        from kvserve.protocol.sampling_params import SamplingParams

        d = self.engine()
        self.warm_up()
        core = self.core
        out = {}
        for case in self.args.kprofile_cases:
            if case.startswith("p"):  # pN: the prefill step of one fresh N-token prompt (the TTFT step)
                prompt = self.prompts([self.length(int(case[1:]))])[0]
                params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    core.add_request(EngineCoreRequest(req_id=f"kp{case}", prompt_token_ids=prompt,
                                                       sampling_params=params, max_tokens=1))
                    while core.has_unfinished_requests():
                        core.step()
                sync(self.args.device)
                events = sorted((e for e in prof.key_averages() if _self_device_us(e) > 0), key=_self_device_us,
                                reverse=True)
                compact = [f"{_self_device_us(e):9.1f} us {e.count:6d}x  {e.key[:80]}" for e in events[:24]]
                total_us = _kernel_us(events)
                out[case] = {"compact": compact, "gpu_us": total_us}
                # The timeline too (GPU idle gaps and what the host did meanwhile), gzipped next to the JSON.
                self.args.out.mkdir(parents=True, exist_ok=True)
                trace = self.args.out / f"trace_{case}.json"
                prof.export_chrome_trace(str(trace))
                with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                trace.unlink()
                print(f"kernel profile {case}: {total_us:.1f} us GPU for the prompt", flush=True)
                print("\n".join(compact), flush=True)
                continue
            if case == "shared256":  # the shared-prefix workload: 256 x (shared 1000 + own 64)
                batch, shared = self.n(256), self.prompts([self.length(1000)])[0]
                prompts = [shared + own for own in self.prompts([self.length(64)] * batch)]
                self.start_steady_decode(batch, len(prompts[0]), "ks", steady_steps=30, prompts=prompts)
            else:  # bN or bNxC: N random C-token prompts (C = 1024 unless given), steady decode
                batch_s, _, context_s = case.removeprefix("b").partition("x")
                batch = int(batch_s)
                context = self.length(int(context_s) if context_s else 1024)
                self.start_steady_decode(batch, context, f"k{case}", steady_steps=30)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, _labelled_phases(core):
                for _ in range(10):
                    core.step()
            sync(self.args.device)
            timeline = _gpu_timeline(prof, num_steps=10)
            print(f"timeline {case}: {timeline['summary']}", flush=True)
            for line in timeline["gaps"]:
                print(f"  {line}", flush=True)
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70)
            while core.has_unfinished_requests():
                core.step()
            compact = []
            events = [e for e in prof.key_averages() if _self_device_us(e) > 0]
            events.sort(key=_self_device_us, reverse=True)
            total_us = _kernel_us(events)
            for e in events[:24]:
                compact.append(f"{_self_device_us(e) / 10:9.1f} us/step {e.count / 10:6.1f}/step  {e.key[:80]}")
            out[case] = {"table": table, "compact": compact, "gpu_us_per_step": total_us / 10, "timeline": timeline}
            print(f"kernel profile {case}: {total_us / 10:.1f} us GPU per step", flush=True)
            print("\n".join(compact), flush=True)
        del d
        self.results["kprofile"] = out

    def section_hostprof(self) -> None:
        """Where a steady decode step's wall time goes on the host (batch 1 and 64 at context 1k, 64 at 4k): the engine's
        parts are wrapped with timers, and every CUDA event wait is timed apart, so host work = wall - waits.
        With async scheduling a step is GPU-bound when its waits are long and host-bound when they are ~0."""
        import collections

        d = self.engine()
        self.warm_up()
        core = self.core
        times: dict[str, list[float]] = collections.defaultdict(list)

        def timed(name: str, call: Callable[[], Any]) -> Any:
            t = time.perf_counter()
            try:
                return call()
            finally:
                times["event_wait" if name == "synchronize" else name].append(time.perf_counter() - t)

        targets = [(core.scheduler, "schedule"), (core.scheduler, "update_from_output"),
                   (core.runner, "execute_model_async"), (torch.cuda.Event, "synchronize")]
        out = {}
        with _around_methods(targets, timed):
            for batch, context in self.args.hostprof_cases:
                self.start_steady_decode(batch, self.length(context), f"h{batch}x{context}", steady_steps=40)
                times.clear()
                num_steps = 30
                t0 = time.perf_counter()
                for _ in range(num_steps):
                    core.step()
                wall = (time.perf_counter() - t0) / num_steps
                # Read the timers before draining: the drain's steps must not count.
                per_step = {k: sum(v) / num_steps * 1e3 for k, v in times.items()}
                while core.has_unfinished_requests():
                    core.step()
                per_step["wall"] = wall * 1e3
                per_step["host_busy"] = per_step["wall"] - per_step.get("event_wait", 0.0)
                out[f"b{batch}x{context}"] = per_step
                self.rows.append((f"host profile b{batch} ctx{context} (ms/step)", f"{per_step['wall']:.2f}",
                                  ", ".join(f"{k} {v:.2f}" for k, v in per_step.items() if k != "wall")))
        del d
        self.results["hostprof"] = out

    def section_mixed(self) -> None:
        """Prompts arriving while requests decode: `batch` requests decode at `context` tokens while a prompt
        of `prompt` tokens (max_tokens 1: it leaves after its prefill) arrives every 4th step. Windows of
        `--mixed-cycles` arrivals alternate the piecewise graphs on and off in the same engine (the runner's
        `piecewise` set aside), two of each. Per window: the mean step (each decoding request gets one token a
        step, so this is their mean inter-token latency) and the median over arrivals of the longest step
        around it (the latency spike an arrival causes)."""
        self.engine()
        self.warm_up()
        core = self.core
        runner = core.runner
        pieces = runner.piecewise
        from kvserve.protocol.engine import EngineCoreRequest
        from kvserve.protocol.sampling_params import SamplingParams

        every, cycles, rounds = 4, self.args.mixed_cycles, 4
        out = []
        for batch, context, prompt in self.args.mixed_cases:
            ctx, plen = self.length(context), self.length(prompt)
            self.start_steady_decode(batch, ctx, f"mx{batch}x{prompt}", steady_steps=rounds * cycles * every + 30)
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
            windows: dict[str, list[dict[str, float]]] = {}
            for rnd in range(rounds):
                mode = "piecewise" if rnd % 2 == 0 and pieces is not None else "eager"
                runner.piecewise = pieces if mode == "piecewise" else None
                steps_ms: list[float] = []
                spikes: list[float] = []
                mixed_steps = 0  # steps with prefill tokens beside other requests (an arrival's prompt and the decodes)
                replays = pieces.replays if pieces is not None else 0
                for c, new_prompt in enumerate(self.prompts([plen] * cycles)):
                    core.add_request(EngineCoreRequest(req_id=f"mx{batch}x{prompt}-{rnd}-{c}",
                                                       prompt_token_ids=new_prompt, sampling_params=params,
                                                       max_tokens=1))
                    cycle = []
                    for _ in range(every):
                        t0 = time.perf_counter()
                        result = core.step()
                        cycle.append((time.perf_counter() - t0) * 1e3)
                        mixed_steps += result.num_scheduled_tokens > result.num_scheduled_reqs > 1
                    steps_ms.extend(cycle)
                    spikes.append(max(cycle))
                served = (pieces.replays - replays) if pieces is not None else 0
                windows.setdefault(mode, []).append({"mean_step_ms": statistics.mean(steps_ms),
                                                     "median_spike_ms": statistics.median(spikes),
                                                     "piecewise_steps": served, "mixed_steps": mixed_steps})
            runner.piecewise = pieces
            while core.has_unfinished_requests():
                core.step()
            case = {"batch": batch, "context": context, "prompt": prompt, "windows": windows}
            out.append(case)
            for mode, ws in windows.items():
                self.rows.append((f"mixed b{batch} ctx{context} +{prompt} {mode} (ms/step)",
                                  " / ".join(f"{w['mean_step_ms']:.2f}" for w in ws),
                                  "arrival spike " + " / ".join(f"{w['median_spike_ms']:.1f}" for w in ws)
                                  + f" ms; piecewise steps {[w['piecewise_steps'] for w in ws]}"))
        self.results["mixed"] = out

    def section_poisson(self) -> None:
        """Requests arriving at Poisson times (--poisson-rate a second for --poisson-duration s, --poisson-in
        prompt tokens, --poisson-out output tokens, EOS ignored), added as their times pass and stepped as a
        server's engine loop steps them: the server benchmark's load on the engine alone. Rounds with the
        piecewise graphs on and off alternate in one engine (the runner's `piecewise` set aside), each with
        the same arrival times and fresh prompts. Per round: TTFT (from the arrival time) and TPOT, and the
        wall time of the step calls that waited for a step with prefill tokens beside other requests (an
        arrival; under async scheduling that is the call after the one that launched it) and of the others.
        The decoding requests pay the mean step, not these medians: TPOT is the measure of an arrival's cost
        to them."""
        self.engine()
        self.warm_up()
        core = self.core
        runner = core.runner
        pieces = runner.piecewise
        from kvserve.protocol.engine import EngineCoreRequest
        from kvserve.protocol.sampling_params import SamplingParams

        a = self.args
        plen, olen = self.length(a.poisson_in), self.length(a.poisson_out)
        draw = random.Random(a.poisson_seed)
        arrivals: list[float] = []
        t = draw.expovariate(a.poisson_rate)
        while t < a.poisson_duration:
            arrivals.append(t)
            t += draw.expovariate(a.poisson_rate)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=olen)

        def pct(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

        def summary(values: list[float]) -> dict[str, float]:
            if not values:  # (no arrival in --poisson-duration)
                return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
            return {"mean": statistics.mean(values), "median": statistics.median(values), "p99": pct(values, 0.99)}

        out: list[dict[str, Any]] = []
        for rnd in range(2 * a.poisson_rounds):
            mode = "piecewise" if rnd % 2 == 0 and pieces is not None else "eager"
            runner.piecewise = pieces if mode == "piecewise" else None
            replays = pieces.replays if pieces is not None else 0
            prompts = self.prompts([plen] * len(arrivals))
            arrived: dict[str, float] = {}
            first: dict[str, float] = {}
            last: dict[str, float] = {}
            count: dict[str, int] = {}
            arrival_ms: list[float] = []
            other_ms: list[float] = []
            i = 0
            previous_mixed = False  # under async scheduling a step call waits for the step launched before it
            start = time.perf_counter()
            while i < len(arrivals) or core.has_unfinished_requests():
                now = time.perf_counter() - start
                while i < len(arrivals) and arrivals[i] <= now:
                    req_id = f"po{rnd}-{i}"
                    core.add_request(EngineCoreRequest(req_id=req_id, prompt_token_ids=prompts[i],
                                                       sampling_params=params, max_tokens=olen))
                    arrived[req_id] = start + arrivals[i]
                    i += 1
                if not core.has_unfinished_requests():
                    time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
                    continue
                t0 = time.perf_counter()
                result = core.step()
                t1 = time.perf_counter()
                mixed = result.num_scheduled_tokens > result.num_scheduled_reqs > 1
                waited_for_mixed = previous_mixed if core.async_scheduling else mixed
                previous_mixed = mixed
                (arrival_ms if waited_for_mixed else other_ms).append((t1 - t0) * 1e3)
                for o in result.outputs:
                    if o.new_token_ids:
                        first.setdefault(o.req_id, t1)
                        last[o.req_id] = t1
                        count[o.req_id] = count.get(o.req_id, 0) + len(o.new_token_ids)
            ttft = [(first[r] - arrived[r]) * 1e3 for r in arrived if r in first]
            tpot = [(last[r] - first[r]) * 1e3 / (count[r] - 1) for r in arrived if count.get(r, 0) > 1]
            record = {
                "mode": mode, "requests": len(arrived), "completed": len(tpot),
                "ttft_ms": summary(ttft), "tpot_ms": summary(tpot),
                "arrival_steps": len(arrival_ms),
                "arrival_step_ms": {"median": summary(arrival_ms)["median"], "p90": pct(arrival_ms, 0.9)},
                "other_step_ms": {"median": summary(other_ms)["median"], "p90": pct(other_ms, 0.9)},
                "piecewise_steps": (pieces.replays - replays) if pieces is not None else 0,
                "elapsed_s": time.perf_counter() - start,
            }
            out.append(record)
            self.rows.append((
                f"poisson {a.poisson_rate:g}/s {plen} in {olen} out, {mode} (TPOT ms)",
                f"{record['tpot_ms']['mean']:.2f}",
                f"median {record['tpot_ms']['median']:.2f}, P99 {record['tpot_ms']['p99']:.2f}; TTFT mean "
                f"{record['ttft_ms']['mean']:.1f}, median {record['ttft_ms']['median']:.1f}, P99 "
                f"{record['ttft_ms']['p99']:.1f}; {record['arrival_steps']} arrival steps, median "
                f"{record['arrival_step_ms']['median']:.1f} ms (P90 {record['arrival_step_ms']['p90']:.1f}), other "
                f"steps {record['other_step_ms']['median']:.2f}; {record['requests']} requests; piecewise steps "
                f"{record['piecewise_steps']}"))
        runner.piecewise = pieces
        self.results["poisson"] = {"arrivals": len(arrivals), "rate": a.poisson_rate, "input_len": plen,
                                   "output_len": olen, "rounds": out}

    def graph_probe(self, batch: int) -> tuple[Callable[[int], None], dict[str, float | None]]:
        """A Driver.run `on_step` callback that times the decode graph of `batch` once, at the 8th step of
        `batch` decode tokens (the requests still live), and the dict that receives it under "ms"."""
        seen = 0
        result: dict[str, float | None] = {}

        def on_step(num_scheduled: int) -> None:
            nonlocal seen
            seen += num_scheduled == batch
            if seen == 8 and "ms" not in result:
                result["ms"] = self.graph_gpu_ms(batch)

        return on_step, result

    def graph_gpu_ms(self, batch: int) -> float | None:
        """GPU time of one replay of the decode graph serving `batch` (CUDA events, median of 20), over
        what the buffers hold from the last step: the model forward alone, no logits or sampling. Call it
        while that step's requests are live: a replay recomputes the step (its cache writes put back the
        same values), while after they finish their blocks may be reused or the rows stale."""
        graphs = self.core.runner.graphs
        size = graphs.padded_size(batch) if graphs is not None else None
        if size is None or self.core.workers is not None:  # a replay on rank 0 alone would wait for the others
            return None
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs.replay(size)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def section_firstpass(self) -> None:
        """The first burst of prompts on a fresh engine against the next ones: the seeds' 50 x 512-token prompts
        (4 tokens out) `--firstpass-passes` times, each pass's step times, cudaMalloc calls and Triton variants
        loaded; with `--firstpass-profile`, every pass under torch.profiler, its top host-side ops printed. Run
        it as the first section: a server's first burst after start held its requests ~100 ms longer."""
        d = self.engine()
        num, ins = self.n(50), self.length(512)
        cuda = self.args.device.startswith("cuda")
        passes = []
        for k in range(self.args.firstpass_passes):
            prompts = self.prompts([ins] * num)
            before = torch.cuda.memory_stats() if cuda else {}
            late_before = len(self.core.late_kernel_variants)
            if self.args.firstpass_profile:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=activities, record_shapes=True) as prof:
                    stats = d.run(prompts, [4] * num)
                table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
                print(f"--- firstpass pass {k + 1}: top ops by CPU time\n{table}", flush=True)
                # The single calls that held the host longest, in order, with their input shapes.
                events = [e for e in prof.events() if e.name.startswith(("aten::", "cuda", "cu"))
                          and e.name not in ("aten::linear", "aten::matmul")]
                slow = sorted(sorted(events, key=lambda e: -e.cpu_time_total)[:12], key=lambda e: e.time_range.start)
                for e in slow:
                    print(f"firstpass slow call pass {k + 1}: {e.name} {e.cpu_time_total / 1e3:.1f} ms at "
                          f"{(e.time_range.start - slow[0].time_range.start) / 1e3:.1f} ms shapes {e.input_shapes}",
                          flush=True)
            else:
                stats = d.run(prompts, [4] * num)
            after = torch.cuda.memory_stats() if cuda else {}
            steps = [(round(t * 1e3, 1), n) for t, n in zip(stats.step_s, stats.step_tokens, strict=True)]
            allocs = after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0)
            late = self.core.late_kernel_variants[late_before:]
            passes.append({"elapsed_s": stats.elapsed_s, "steps_ms_tokens": steps, "cuda_mallocs": allocs,
                           "late_variants": late})
            self.rows.append((f"firstpass pass {k + 1} (ms)", f"{stats.elapsed_s * 1e3:.0f}",
                              f"steps (ms/tokens): {' '.join(f'{t}/{n}' for t, n in steps[:6])}; cudaMalloc "
                              f"{allocs}; late Triton variants {len(late)}"))
        self.results["firstpass"] = {"num_seqs": num, "input_len": ins, "profiled": self.args.firstpass_profile,
                                     "passes": passes}

    def section_seeds(self) -> None:
        d = self.engine()
        num, ins, outs = self.n(50), self.length(512), self.length(256)
        d.run(self.prompts([ins] * num), [4] * num, self.workload_params())  # warm-up at the same shapes
        self.seeds_prompts = self.prompts([ins] * num)
        stats = d.run(self.seeds_prompts, [outs] * num, self.workload_params())
        self.results["seeds"] = {"num_seqs": num, "input_len": ins, "output_len": outs,
                                 "elapsed_s": stats.elapsed_s, "output_tokens": stats.output_tokens,
                                 "output_tok_s": stats.output_tok_s,
                                 "gc_pauses": summarize_gc_pauses(stats.gc_pauses)}
        self.rows.append(("seeds' workload (output tok/s)", f"{stats.output_tok_s:.0f}",
                          f"{num} x {ins} in / {outs} out in {stats.elapsed_s:.2f} s; "
                          f"{describe_gc_pauses(stats.gc_pauses)}"))

    def section_structured(self) -> None:
        """The seeds' shapes (50 x 512 in / 256 out, greedy) with every request under a JSON schema (an array of
        at least 64 records: no output ends before 256 tokens), the grammars compiled against the default model's
        tokenizer (.carry/tok where that copy exists), masks as wide as the model's vocabulary. Three runs:
        without the grammar, with it under async scheduling (each step's forward launched before the previous
        step's tokens are read; the masks computed while it runs), and with it step by step. The two grammar
        runs must give the same tokens."""
        import os

        from kvserve.model.paths import default_model_path
        from kvserve.model.tokenizer import load_tokenizer
        from kvserve.protocol.sampling_params import SamplingParams, StructuredOutputsParams

        d = self.engine()
        core = self.core
        core.set_tokenizer(load_tokenizer(".carry/tok" if os.path.isdir(".carry/tok") else default_model_path()))
        record = {"type": "object", "additionalProperties": False, "required": ["id", "name", "price"],
                  "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                                 "price": {"type": "number"}, "tags": {"type": "array", "maxItems": 3,
                                                                        "items": {"enum": ["new", "sale", "eco"]}}}}
        schema = {"type": "array", "minItems": 64, "items": record}
        spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        num, ins, outs = self.n(50), self.length(512), self.length(256)
        plain = SamplingParams(temperature=0.0, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, structured_outputs=spec)
        d.run(self.prompts([ins] * num), [4] * num, constrained)  # warm-up: the tokenizer's view, the compile
        if core.pop_failed():
            raise RuntimeError("the grammar failed to compile (see the log)")
        prompts = self.prompts([ins] * num)
        out: dict[str, Any] = {"num_seqs": num, "input_len": ins, "output_len": outs, "schema": schema}
        tokens: dict[str, list[list[int]]] = {}
        was_async = core.async_scheduling
        for label, params, pipelined in (("plain", plain, was_async), ("grammar, async", constrained, True),
                                         ("grammar, step by step", constrained, False)):
            core.async_scheduling = pipelined
            refused = core.structured.num_refused_tokens
            stats = d.run(prompts, [outs] * num, params, collect_tokens=True)
            failed = core.pop_failed()
            if failed:
                raise RuntimeError(f"{len(failed)} grammar(s) failed to compile, the first: {failed[0][1]}")
            if stats.output_tokens != num * outs:
                raise RuntimeError(f"{label}: {stats.output_tokens} output tokens, {num * outs} expected")
            tokens[label] = stats.token_ids
            out[label] = {"elapsed_s": stats.elapsed_s, "output_tokens": stats.output_tokens,
                          "output_tok_s": stats.output_tok_s, "num_steps": len(stats.step_s),
                          "median_step_ms": statistics.median(stats.step_s) * 1e3,
                          "refused_tokens": core.structured.num_refused_tokens - refused}
            self.rows.append((f"seeds' shapes, {label} (output tok/s)", f"{stats.output_tok_s:.0f}",
                              f"{stats.output_tokens} tokens in {stats.elapsed_s:.2f} s, median step "
                              f"{statistics.median(stats.step_s) * 1e3:.2f} ms"))
        core.async_scheduling = was_async
        same = tokens["grammar, async"] == tokens["grammar, step by step"]
        out["grammar_tokens_equal"] = same
        self.rows.append(("grammar runs' tokens equal (async vs step by step)", "yes" if same else "NO",
                          f"tokens the grammars refused: {core.structured.num_refused_tokens} (should be 0)"))
        self.results["structured"] = out

    def workload_params(self) -> Any:
        """The seeds' and 256-sequence workloads' sampling: greedy, no EOS, and --repetition-penalty (1.05 is
        what Qwen2.5-Instruct's generation config gives every request)."""
        from kvserve.protocol.sampling_params import SamplingParams

        return SamplingParams(temperature=0.0, ignore_eos=True, repetition_penalty=self.args.repetition_penalty)

    def random256_lengths(self, seed: int) -> tuple[list[int], list[int]]:
        """The 256-sequence workload's input and output lengths, uniform in [100, 1024] (scaled), from a
        generator of their own seeded with `seed`."""
        lo, hi = self.length(100), self.length(1024)
        num = self.n(256)
        gen = torch.Generator().manual_seed(seed)
        return (torch.randint(lo, hi + 1, (num,), generator=gen).tolist(),
                torch.randint(lo, hi + 1, (num,), generator=gen).tolist())

    def section_random256(self) -> None:
        d = self.engine()
        # The lengths from a generator of their own: the same workload whichever sections ran before (drawn
        # from the shared generator they changed with the sections before it; the lengths now are those that
        # `--sections start,random256` drew, 141,343 output tokens at full scale).
        ins, outs = self.random256_lengths(seed=0)
        num = len(ins)
        runs = []
        for label in ("first", "second"):  # the same lengths twice (fresh prompts): first-use costs show
            stats = d.run(self.prompts(ins), outs, self.workload_params())
            runs.append({"run": label, "elapsed_s": stats.elapsed_s, "prompt_tokens": stats.prompt_tokens,
                         "output_tokens": stats.output_tokens, "output_tok_s": stats.output_tok_s,
                         "num_steps": len(stats.step_s),
                         "slowest_steps_s": sorted(stats.step_s, reverse=True)[:10],
                         "gc_pauses": summarize_gc_pauses(stats.gc_pauses)})
            self.rows.append((f"256 seqs U[100,1024], {label} run (output tok/s)", f"{stats.output_tok_s:.0f}",
                              f"{stats.output_tokens} tokens in {stats.elapsed_s:.2f} s, {len(stats.step_s)} steps, "
                              f"slowest step {max(stats.step_s) * 1e3:.0f} ms; {describe_gc_pauses(stats.gc_pauses)}"))
        self.results["random256"] = {"num_seqs": num, "runs": runs}

    def _ttft_runs(self, d: Any, n: int, repeats: int, rest: float) -> list[float]:
        """TTFT (ms) of `repeats` fresh n-token prompts, one at a time, each after `rest` s without work."""
        times = []
        for _ in range(repeats):
            time.sleep(rest)
            times.append(d.run(self.prompts([n]), [1]).ttft_s[0] * 1e3)
        return times

    def section_ttft(self) -> None:
        """TTFT of one prompt on an idle engine, two ways: on an idle GPU (1 s without work before each prompt,
        as a request reaching an idle server finds it) and back to back (each prompt right after the last, the
        GPU still under its power cap's recent load: 2-3 ms slower at 1k, 5-8 at 8k, entry 27 of
        docs/perf_notes.md)."""
        d = self.engine()
        out: dict[str, dict[str, Any]] = {}
        for tokens in self.args.ttft_lengths:
            repeats = 5 if tokens <= 4096 else 3
            n = self.length(tokens)
            d.run(self.prompts([n]), [1])  # warm-up at this shape
            for label, rest in (("idle GPU", TTFT_IDLE_S), ("back to back", 0.0)):
                times = self._ttft_runs(d, n, repeats, rest)
                out[f"{tokens} {label}"] = {"median_ms": statistics.median(times), "all_ms": times, "idle_s": rest}
                self.rows.append((f"TTFT {tokens} tokens, {label} (ms)", f"{statistics.median(times):.1f}",
                                  f"min {min(times):.1f}, {repeats} runs"))
        self.results["ttft"] = out

    def section_ttftrest(self) -> None:
        """TTFT of one prompt against how long the GPU idled before it (0, 0.3 and 1 s, twice in turn): the
        ttft section sends its prompts back to back, right after the sections before it, while a request reaching
        an idle server finds the GPU rested. Under its power cap the GPU's clock depends on the recent load
        (docs/perf_notes.md, entry 22), so the two can differ; this measures by how much."""
        d = self.engine()
        for tokens in self.args.ttft_lengths:
            d.run(self.prompts([self.length(tokens)]), [1])  # warm-up at this shape
        out: dict[str, list[float]] = {}
        for round_ in range(2):
            for rest in (0.0, 0.3, 1.0):
                for tokens in self.args.ttft_lengths:
                    times = self._ttft_runs(d, self.length(tokens), 5 if tokens <= 4096 else 3, rest)
                    out[f"{tokens} {rest} {round_}"] = times
                    self.rows.append((f"TTFT {tokens}, {rest:.1f} s idle before, round {round_} (ms)",
                                      f"{statistics.median(times):.1f}",
                                      f"min {min(times):.1f}; all {[round(t, 1) for t in times]}"))
        self.results["ttftrest"] = out

    def section_ttftrand(self) -> None:
        """TTFT over prompts of new lengths (uniform in [1024, 8192], none repeated), twice: the first pass pays
        any per-length set-up (cuDNN attention builds a graph per sequence length), the second does not."""
        d = self.engine()
        rng = random.Random(1234)
        lengths = rng.sample(range(self.length(1024), self.length(8192) + 1), 8)
        d.run(self.prompts([self.length(2000)]), [1])  # warm-up at another length
        passes = {}
        for label in ("first", "second"):
            times = [d.run(self.prompts([n]), [1]).ttft_s[0] * 1e3 for n in lengths]
            passes[label] = times
            self.rows.append((f"TTFT new lengths, {label} pass (mean ms)", f"{statistics.mean(times):.1f}",
                              f"{len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens, "
                              f"max {max(times):.1f} ms"))
        self.results["ttftrand"] = {"lengths": lengths, **passes}

    def section_ttftprefix(self) -> None:
        """One request at a time whose first 1000 tokens are in the prefix cache (a shared system prompt at
        low load): TTFT with 64 and with 512 new tokens, median of 5 (needs prefix caching, the default)."""
        d = self.engine()
        shared = self.prompts([self.length(1000)])[0]
        d.run([shared + self.prompts([self.length(64)])[0]], [1])  # the prefix goes into the cache
        out = {}
        for own in self.args.ttftprefix_new:
            n = self.length(own)
            d.run([shared + self.prompts([n])[0]], [1])  # warm-up at this shape
            times = [d.run([shared + self.prompts([n])[0]], [1]).ttft_s[0] * 1e3 for _ in range(5)]
            out[str(own)] = {"median_ms": statistics.median(times), "all_ms": times}
            self.rows.append((f"TTFT cached 1000 + {own} new tokens (ms)", f"{statistics.median(times):.1f}",
                              f"min {min(times):.1f}, 5 runs"))
        self.results["ttftprefix"] = out

    def section_ttftdiag(self) -> None:
        """One prompt of 1024 and of 8192 tokens, 4 runs each, per collector mode ('as is', then 'frozen':
        `gc.collect(); gc.freeze()`, then both again). Per run: TTFT (submit to the step that returns the
        token); the host time of the prefill's `execute_model_async` (input preparation and every launch);
        the GPU span from that call's entry to its last enqueued work (CUDA events: the GPU is idle at entry,
        so this is launch delay plus kernels); the collector's pauses during the run."""
        d = self.engine()
        runner = self.core.runner
        original = runner.execute_model_async
        spans: list[tuple[float, Any, Any]] = []

        cuda = self.args.device.startswith("cuda")

        def timed(*a: Any, **k: Any) -> Any:
            start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda \
                else (None, None)
            t = time.perf_counter()
            if start is not None:
                start.record()
            try:
                return original(*a, **k)
            finally:
                if end is not None:
                    end.record()
                spans.append((time.perf_counter() - t, start, end))

        out: dict[str, Any] = {}
        was_frozen = gc.get_freeze_count() > 0  # (make_engine freezes, as the served engine process does)
        runner.execute_model_async = timed
        try:
            for tokens in (1024, 8192):
                n = self.length(tokens)
                d.run(self.prompts([n]), [1])  # warm-up at this shape
            for round_ in range(2):
                for mode in ("as is", "frozen"):
                    if mode == "frozen":
                        gc.collect()
                        gc.freeze()
                    else:
                        gc.unfreeze()
                    for tokens in (1024, 8192):
                        n = self.length(tokens)
                        runs = []
                        for _ in range(4):
                            spans.clear()
                            stats = d.run(self.prompts([n]), [1])
                            sync(self.args.device)
                            host_s, start, end = spans[0]
                            runs.append({"ttft_ms": stats.ttft_s[0] * 1e3, "launch_ms": host_s * 1e3,
                                         "gpu_span_ms": start.elapsed_time(end) if cuda else float("nan"),
                                         "gc_pause_ms": sum(p for _, p in stats.gc_pauses) * 1e3,
                                         "gc_collections": [g for g, _ in stats.gc_pauses]})
                        key = f"{tokens} {mode} {round_}"
                        out[key] = runs
                        med = {k: statistics.median(r[k] for r in runs)
                               for k in ("ttft_ms", "launch_ms", "gpu_span_ms", "gc_pause_ms")}
                        self.rows.append((f"TTFT {tokens}, gc {mode}, round {round_} (ms)", f"{med['ttft_ms']:.1f}",
                                          f"launch {med['launch_ms']:.1f}, GPU span {med['gpu_span_ms']:.1f}, "
                                          f"gc {med['gc_pause_ms']:.1f} ms; all {[round(r['ttft_ms'], 1) for r in runs]}"))
        finally:
            gc.unfreeze()
            if was_frozen:  # the later sections run on the engine as it was
                gc.collect()
                gc.freeze()
            runner.execute_model_async = original
        self.results["ttftdiag"] = out

    def section_prefillprof(self) -> None:
        """Where the host spends a one-prompt prefill's launch (the step is host-bound at 1k tokens): the
        prefill step's `execute_model_async` under cProfile, 5 prompts of 1024 tokens, functions by own time
        and by cumulative time."""
        import cProfile
        import io
        import pstats

        d = self.engine()
        n = self.length(1024)
        d.run(self.prompts([n]), [1])
        runner = self.core.runner
        original = runner.execute_model_async
        prof = cProfile.Profile()
        calls: list[float] = []

        def profiled(*a: Any, **k: Any) -> Any:
            if calls:  # the prefill step only (the request's first step)
                return original(*a, **k)
            t = time.perf_counter()
            prof.enable()
            try:
                return original(*a, **k)
            finally:
                prof.disable()
                calls.append(time.perf_counter() - t)

        runner.execute_model_async = profiled
        launch_ms = []
        try:
            for _ in range(5):
                calls.clear()
                d.run(self.prompts([n]), [1])
                launch_ms.append(calls[0] * 1e3)
        finally:
            runner.execute_model_async = original
        text = {}
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(35)
            text[key] = buf.getvalue()
            print(f"prefill host profile by {key} (5 steps):\n{text[key]}", flush=True)
        self.rows.append(("prefill launch under cProfile (ms/step)", f"{statistics.median(launch_ms):.1f}",
                          f"all {[round(v, 1) for v in launch_ms]}"))
        self.results["prefillprof"] = {"launch_ms": launch_ms, **text}

    def _prefix_runs(self, d: Driver, label: str) -> dict[str, float]:
        num, out_len = self.n(256), self.length(128)
        shared_len, own_len = self.length(1000), self.length(64)
        unique = d.run(self.prompts([shared_len + own_len] * num), [out_len] * num)
        shared = self.prompts([shared_len])[0]
        own = self.prompts([own_len] * num)
        with_prefix = d.run([shared + o for o in own], [out_len] * num)
        result = {"unique_output_tok_s": unique.output_tok_s, "unique_elapsed_s": unique.elapsed_s,
                  "shared_output_tok_s": with_prefix.output_tok_s, "shared_elapsed_s": with_prefix.elapsed_s}
        self.rows.append((f"prefix cache {label}: 0% hits (output tok/s)", f"{unique.output_tok_s:.0f}",
                          f"{num} x {shared_len + own_len} unique, {out_len} out"))
        self.rows.append((f"prefix cache {label}: shared {shared_len} (output tok/s)",
                          f"{with_prefix.output_tok_s:.0f}", f"{num} x ({shared_len} shared + {own_len}), {out_len} out"))
        return result

    def section_prefix(self) -> None:
        on = self._prefix_runs(self.engine(), "on")
        self.free_engine()
        core, start_s = make_engine(self.model_dir, self.args.device,
                                    **self.engine_kwargs(enable_prefix_caching=False))
        d = Driver(core)
        d.run(self.prompts([self.length(512)] * self.n(50)), [4] * self.n(50))  # warm-up
        off = self._prefix_runs(d, "off")
        del d, core
        slowdown = off["unique_output_tok_s"] / on["unique_output_tok_s"] - 1
        self.results["prefix"] = {"on": on, "off": off, "cache_off_engine_start_s": start_s,
                                  "slowdown_on_vs_off_at_0pct": slowdown}
        self.rows.append(("prefix caching cost at 0% hits", f"{slowdown:+.1%}",
                          "off/on - 1, one run each, cache-on engine first (prefixab alternates engines)"))

    def section_shared(self) -> None:
        """The shared-prefix workload alone (256 x (shared 1000 + own 64), 128 out), three times on one warmed
        engine: for A/B runs of the decode-attention settings without the prefix section's other runs."""
        d = self.engine()
        d.run(self.prompts([self.length(512)] * self.n(50)), [4] * self.n(50))  # warm-up
        num, out_len = self.n(256), self.length(128)
        runs, pauses, slowest = [], [], []
        for i in range(3):
            shared = self.prompts([self.length(1000)])[0]
            prompts = [shared + own for own in self.prompts([self.length(64)] * num)]
            stats = d.run(prompts, [out_len] * num)
            runs.append(stats.output_tok_s)
            pauses.append(summarize_gc_pauses(stats.gc_pauses))
            slowest.append(sorted(stats.step_s, reverse=True)[:4])
            self.rows.append((f"shared run {i + 1}: garbage collections", describe_gc_pauses(stats.gc_pauses),
                              "slowest steps (ms) " + " ".join(f"{x * 1e3:.1f}" for x in slowest[-1])))
        tracked = len(gc.get_objects())
        t0 = time.perf_counter()
        gc.collect()
        full_ms = (time.perf_counter() - t0) * 1e3
        self.rows.append(("shared: a full collection after the runs (ms)", f"{full_ms:.1f}",
                          f"{tracked} objects tracked, {len(gc.get_objects())} after; frozen {gc.get_freeze_count()}"))
        self.results["shared"] = {"output_tok_s": runs, "gc_pauses": pauses, "slowest_steps_s": slowest,
                                  "full_collection_ms": full_ms, "tracked_objects": tracked}
        self.rows.append(("shared 1000 + 64, 3 runs (output tok/s)", " ".join(f"{x:.0f}" for x in runs),
                          f"median {statistics.median(runs):.0f}"))

    def section_prefixab(self) -> None:
        """Prefix caching on vs off at 0 % hits, alternating engines (on, off, on, off, ...) so drift between
        runs shows up as spread rather than as a difference; each engine is warmed up before it is timed."""
        num, out_len, prompt_len = self.n(256), self.length(128), self.length(1064)
        runs: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(self.args.ab_repeats):
            for label in ("on", "off"):
                self.free_engine()
                core, _ = make_engine(self.model_dir, self.args.device,
                                      **self.engine_kwargs(enable_prefix_caching=label == "on"))
                d = Driver(core)
                d.run(self.prompts([self.length(512)] * self.n(50)), [4] * self.n(50))  # warm-up
                d.run(self.prompts([prompt_len] * self.n(16)), [4] * self.n(16))
                runs[label].append(d.run(self.prompts([prompt_len] * num), [out_len] * num).output_tok_s)
                del d, core
        on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
        self.results["prefixab"] = {"on_tok_s": runs["on"], "off_tok_s": runs["off"],
                                    "median_cost_on_vs_off": off / on - 1}
        self.rows.append(("prefix cache 0% hits, on (tok/s, each run)", " ".join(f"{x:.0f}" for x in runs["on"]), ""))
        self.rows.append(("prefix cache 0% hits, off (tok/s, each run)", " ".join(f"{x:.0f}" for x in runs["off"]), ""))
        self.rows.append(("prefix caching cost at 0% hits (medians)", f"{off / on - 1:+.1%}", "off/on - 1"))

    def section_hf(self) -> None:
        # The engine's KV cache holds most of the GPU: HF runs after it is gone.
        self.free_engine()
        num, ins, outs = self.n(50), self.length(512), self.length(256)
        # The seeds section's prompts when it ran before (the issue's "same prompts in the same run").
        same_prompts = self.seeds_prompts is not None
        prompts = self.seeds_prompts if same_prompts else self.prompts([ins] * num)
        # HF's first run through the output lengths is slower (on the H200, SDPA runs cuDNN attention, which
        # builds a graph for each new key length: 14.2 s against 5.0-5.1 s for the runs after it, hf_probe.py).
        # The runs after it are HF's steady state; the ratio uses the fastest of them (the baseline at its best).
        if self.args.hf_in_process:
            runs, init_s = self._hf_in_process(prompts, outs)
        else:
            runs, init_s = self._hf_in_fresh_process(prompts, outs)
        first_s, steady = runs[0], runs[1:]
        elapsed = min(steady)
        tok_s = num * outs / elapsed
        where = "this process, after kvserve" if self.args.hf_in_process else "a fresh process"
        self.results["hf"] = {"num_seqs": num, "input_len": ins, "output_len": outs, "elapsed_s": elapsed,
                              "output_tok_s": tok_s, "init_s": init_s, "batch_size": num, "runs_s": runs,
                              "first_run_s": first_s, "first_run_output_tok_s": num * outs / first_s,
                              "same_prompts_as_seeds": same_prompts, "process": where,
                              "note": "HF random init from the same config: weights differ from kvserve's"}
        self.rows.append(("HF generate, seeds' workload (output tok/s)", f"{tok_s:.0f}",
                          f"static batch {num}, fastest of runs 2-{len(runs)} {elapsed:.2f} s (runs "
                          + " ".join(f"{r:.2f}" for r in runs) + ")"
                          + (", the seeds section's prompts" if same_prompts else ", fresh prompts") + f", in {where}"))
        if "seeds" in self.results:
            ratio = self.results["seeds"]["output_tok_s"] / tok_s
            self.results["hf"]["kvserve_over_hf"] = ratio
            self.rows.append(("seeds' workload, kvserve / HF", f"{ratio:.2f}x", "target >= 4x"))

    def _hf_in_process(self, prompts: list[list[int]], outs: int) -> tuple[list[float], float]:
        """(seconds of each timed HF generate run, model build seconds), HF in this process."""
        from transformers import AutoConfig, AutoModelForCausalLM

        device = self.args.device
        config = AutoConfig.from_pretrained(self.model_dir)
        t0 = time.perf_counter()
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, self.args.dtype)).eval()
        sync(device)
        init_s = time.perf_counter() - t0
        generate = hf_generate_timer(model, torch.tensor(prompts, device=device), device)
        generate(4)  # warm-up
        return [generate(outs) for _ in range(self.args.hf_runs)], init_s

    def _hf_in_fresh_process(self, prompts: list[list[int]], outs: int) -> tuple[list[float], float]:
        """The same in a fresh Python process (hf_probe.py on these prompts), free of anything kvserve left
        in this one. HF's steady run varied from 5.19 to 8.72 s between processes on the same H200 hosts, in
        either way of running it (docs/perf_notes.md entry 61); within one process its steady runs agree."""
        with tempfile.TemporaryDirectory() as tmp:
            prompt_file = Path(tmp) / "prompts.json"
            prompt_file.write_text(json.dumps(prompts))
            cmd = [sys.executable, str(Path(__file__).with_name("hf_probe.py")), "--out", tmp,
                   "--model", self.args.model, "--device", self.args.device, "--dtype", self.args.dtype,
                   "--prompts", str(prompt_file), "--output-len", str(outs), "--repeats", str(self.args.hf_runs)]
            proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr)
                raise RuntimeError(f"hf_probe.py failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
            result = json.loads((Path(tmp) / "hf_probe.json").read_text())["results"]
        sys.path.insert(0, str(Path(__file__).parent))
        from hf_probe import prompt_digest

        if result["prompt_digest"] != prompt_digest(prompts):
            raise RuntimeError("hf_probe.py ran other prompts than it was given")
        return result["runs_s"], result["init_s"]


def _self_device_us(event: Any) -> float:
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


class _CallProxy:
    """`target` with its calls made through `call` (`_around_methods`), every other attribute its own."""

    def __init__(self, target: Any, call: Callable[..., Any]) -> None:
        self._target, self._call = target, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


@contextlib.contextmanager
def _around_methods(targets: list[tuple[Any, str]], around: Callable[[str, Callable[[], Any]], Any]) -> Iterator[None]:
    """Route every call of each (object, method name) in targets through around(name, call) while the
    context lasts, then put the objects back as they were (an instance attribute only where one was)."""
    saved = []
    for obj, name in targets:
        original = getattr(obj, name)
        saved.append((obj, name, vars(obj).get(name)))

        def routed(*a: Any, _f: Any = original, _n: str = name, **k: Any) -> Any:
            return around(_n, lambda: _f(*a, **k))

        # A callable object (the runner's sampler) keeps its other attributes (`release`, ...) behind a proxy.
        setattr(obj, name, routed if inspect.isroutine(original) else _CallProxy(original, routed))
    try:
        yield
    finally:
        for obj, name, own in reversed(saved):
            if own is None:
                delattr(obj, name)  # the method came from the class
            else:
                setattr(obj, name, own)


def _labelled_phases(core: Any) -> contextlib.AbstractContextManager[None]:
    """Name the engine's host phases in a profiler trace (scheduling, the step's launch, the wait for a
    step's tokens, output bookkeeping), so a GPU idle gap can be attributed to what the host was doing."""
    from torch.profiler import record_function

    def labelled(name: str, call: Callable[[], Any]) -> Any:
        with record_function(f"kv::{name}"):
            return call()

    targets = [(core.scheduler, "schedule"), (core.scheduler, "update_from_output"),
               (core.runner, "execute_model_async"), (core.runner.inputs, "prepare"),
               (core.runner, "sampler"), (torch.cuda.Event, "synchronize"),
               (core.runner, "_update_states"), (core.runner.block_table, "apply"), (core.runner, "_to_host"),
               (core.runner.model, "forward"), (core.runner.model, "compute_logits")]
    return _around_methods(targets, labelled)


def _allocator_counts(device: str) -> dict[str, int]:
    """The CUDA caching allocator's counters whose change marks a host stall: retries after a failed
    allocation (each frees the cache, synchronizing the device), and device allocations and frees."""
    if not device.startswith("cuda"):
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                             "num_sync_all_streams")}


def _gpu_timeline(prof: Any, num_steps: int) -> dict[str, Any]:
    """From a profiler run over `num_steps` steps: the GPU's busy time (the union of kernel and copy
    intervals, so PDL overlaps count once) against the span from the first to the last one, and the largest
    idle gaps with the innermost host functions (Python or torch ops) that were running when each began."""
    device_events, host_events = [], []
    for e in prof.events():
        start, end = e.time_range.start, e.time_range.end
        if end <= start:
            continue
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            if not e.name.startswith(("kv::", "ProfilerStep")):  # record_function ranges shown on the GPU
                device_events.append((start, end, e.name))
        elif not e.name.startswith(("cuda", "Activity")):
            host_events.append((start, end, e.name))
    if not device_events:
        return {"summary": "no device events", "gaps": []}
    device_events.sort()
    busy, gaps = 0.0, []
    cur_start, cur_end = device_events[0][0], device_events[0][1]
    for start, end, _ in device_events[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_end))
            cur_start = start
        cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = cur_end - device_events[0][0]
    gaps.sort(reverse=True)
    lines = []
    for length, at in gaps[:12]:
        running = [h for h in host_events if h[0] <= at < h[1]]
        inner = sorted(running, key=lambda h: h[1] - h[0])[:3]
        lines.append(f"gap {length:8.1f} us; host in: " + " < ".join(h[2][:60] for h in inner))
    idle = span - busy
    summary = (f"GPU busy {busy / num_steps:.1f} us of {span / num_steps:.1f} us per step "
               f"(idle {idle / num_steps:.1f} us per step in {len(gaps)} gaps over {num_steps} steps)")
    return {"summary": summary, "busy_us_per_step": busy / num_steps, "span_us_per_step": span / num_steps,
            "gaps": lines}


# Profiler rows that carry the device time of kernels listed on their own as well.
_LAUNCH_ROWS = ("aten::", "cuLaunchKernel", "cudaLaunchKernel")


def _kernel_us(events: list[Any]) -> float:
    """Device time of the kernels and copies alone: torch.profiler also gives an aten op (aten::mm, cuDNN
    attention, ...) the device time of the kernel it launched, which a plain sum would count twice, and at
    times a launch call of the driver API (cuLaunchKernelEx, which every kernel of an 8k prefill went
    through in session 19's profiles) part of its kernels' time too."""
    return sum(_self_device_us(e) for e in events if not e.key.startswith(_LAUNCH_ROWS))


# Host syncs torch reported while --sync-debug was on: (the innermost kvserve frame, torch's message) -> count.
_SYNCS: dict[tuple[str, str], int] = {}


def _time_host_copies(runner: Any, out: list[tuple[int, float, float]]) -> None:
    """Record, for every step the runner launches, (scheduled tokens, host seconds in the copy of its
    sampled ids to the host, host seconds in the whole launch), without a profiler: a copy that returns
    only once the GPU has drained shows as a long call."""
    launch, to_host = runner.execute_model_async, runner._to_host
    current: dict[str, float] = {}

    def timed_copy(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return to_host(*args, **kwargs)
        finally:
            current.setdefault("copy", time.perf_counter() - start)  # the sampled ids' copy: the first

    def timed_launch(scheduler_output: Any) -> Any:
        current.clear()
        start = time.perf_counter()
        pending = launch(scheduler_output)
        if "copy" in current:
            out.append((scheduler_output.total_num_scheduled_tokens, current["copy"], time.perf_counter() - start))
        return pending

    runner._to_host, runner.execute_model_async = timed_copy, timed_launch


def _host_copy_rows(times: list[tuple[int, float, float]]) -> list[tuple[str, str, str]]:
    """Table rows of `_time_host_copies`' records, by kind of step (tokens past 2,048: eager; else not)."""
    rows = []
    for label, keep in (("steps of > 2048 tokens", lambda n: n > 2048), ("steps of <= 2048 tokens", lambda n: n <= 2048)):
        picked = [(c * 1e3, t * 1e3) for n, c, t in times if keep(n)]
        if not picked:
            continue
        copies, launches = sorted(c for c, _ in picked), sorted(t for _, t in picked)
        rows.append((f"host copy of sampled ids, {label} (ms)", f"{statistics.median(copies):.3f}",
                     f"{len(picked)} steps; copy max {copies[-1]:.2f}, top 5 " + " ".join(f"{c:.2f}" for c in copies[-5:])
                     + f"; whole launch median {statistics.median(launches):.2f}, max {launches[-1]:.2f}"))
    return rows


def _watch_syncs() -> None:
    """Count every synchronizing torch call from now on (torch.cuda.set_sync_debug_mode("warn")) by the
    innermost kvserve or benchmark frame that made it. Diagnostic only: the warnings slow the host. Event
    waits (the step's one planned wait) are not reported by torch's mode, so what is listed are the others."""
    import traceback
    import warnings

    if torch.cuda.get_sync_debug_mode() != 0:
        return
    here = str(Path(__file__).resolve().parents[1])
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" not in text:
            shown(message, category, filename, lineno, file, line)
            return
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(here)
                  and not f.filename.endswith("engine_benchmarks.py")]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        key = (where, text.split(".")[0][:60])
        _SYNCS[key] = _SYNCS.get(key, 0) + 1

    warnings.showwarning = record
    warnings.simplefilter("always", UserWarning)
    torch.cuda.set_sync_debug_mode("warn")


def _move_sampled_rows_warm_up(where: str) -> None:
    """--sampled-rows-warmup: the warm-up of the sampled rows' part of a step at every row count left out
    ("none") or run at the end of the kernel warm-up, before the graph capture ("before-capture"), instead of
    last."""
    from kvserve.worker.model_runner import ModelRunner

    warm_up_rows, warm_up_kernels = ModelRunner.warm_up_sampled_rows, ModelRunner.warm_up_kernels
    ModelRunner.warm_up_sampled_rows = lambda self: None  # type: ignore[method-assign]
    if where == "before-capture":
        def kernels_then_rows(self: ModelRunner) -> list[int]:
            lengths = warm_up_kernels(self)
            warm_up_rows(self)
            return lengths

        ModelRunner.warm_up_kernels = kernels_then_rows  # type: ignore[method-assign]


def _use_divisor_split_rule() -> None:
    """The skinny matmul's split-K rule before the eighth session, for A/B runs: the fewest splits that
    divide K's chunks and give 1.5 programs per SM (4 for qkv, o_proj and down on the H200)."""
    import dataclasses

    from kvserve.kernels import triton_gemm

    resident_rule = triton_gemm.pick_config

    def divisor_rule(m: int, n: int, k: int, num_sms: int, max_shared: int = 227 * 1024) -> object:
        config = resident_rule(m, n, k, num_sms, max_shared)
        if config is None:
            return None
        tiles, chunks = n // config.block_n, k // config.block_k
        divisors = [s for s in range(1, 17) if chunks % s == 0]
        split = next((s for s in divisors if tiles * s * 2 >= 3 * num_sms), divisors[-1])
        return dataclasses.replace(config, split_k=split)

    triton_gemm.pick_config = divisor_rule


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="qwen2.5-7b", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sections", default="start,decode,seeds,random256,ttft,prefix,hf")
    p.add_argument("--hf-runs", type=int, default=4,
                   help="timed HF generate runs: the first (cold) and the steady ones, whose fastest is the baseline")
    p.add_argument("--hf-in-process", action="store_true",
                   help="run the hf section in this process after kvserve (as before session 43), not a fresh one")
    p.add_argument("--ab-repeats", type=int, default=3, help="on/off pairs of the prefixab section")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--cuda-graph-sizes", default="", help="decode graph sizes, comma-separated (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV cache dtype (auto: the model's; fp8)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the engine's model splits over")
    p.add_argument("--quantization", choices=BENCH_QUANTIZATIONS, default=None,
                   help="awq / gptq: random 4-bit weights in this format (group size 128) instead of bf16 ones; fp8: "
                   "random bf16 weights quantized to fp8 at load (--quantization fp8)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="default: the engine's (on with a GPU)")
    p.add_argument("--cascade-attn", action=argparse.BooleanOptionalAction, default=True,
                   help="cascade attention for decode batches sharing a prefix (the shared-prefix workload)")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="the seeds' and 256-sequence workloads' repetition penalty (default 1.0: none)")
    p.add_argument("--firstpass-passes", type=int, default=3, help="firstpass section: bursts of prompts")
    p.add_argument("--sampled-rows-warmup", choices=["last", "before-capture", "none"], default="last",
                   help="ModelRunner.warm_up_sampled_rows: last at start (the engine's), before the graph "
                        "capture, or not at all")
    p.add_argument("--firstpass-profile", action="store_true", help="firstpass section: each pass under torch.profiler")
    p.add_argument("--scale", type=float, default=1.0, help="multiply request counts (CPU trials)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply token lengths (CPU trials)")
    p.add_argument("--decode-batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 64])
    p.add_argument("--decode-contexts", type=lambda v: [int(x) for x in v.split(",")], default=[1024, 4096])
    p.add_argument("--ttft-lengths", type=lambda v: [int(x) for x in v.split(",")], default=[1024, 8192])
    p.add_argument("--ttftprefix-new", type=lambda v: [int(x) for x in v.split(",")], default=[64, 512],
                   help="ttftprefix section: new tokens after the cached 1000")
    p.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                   help="override the longest prompt a one-prompt prefill CUDA graph serves (0: none)")
    p.add_argument("--decode-programs-per-sm", type=int, default=None, help="override ops.DECODE_PROGRAMS_PER_SM")
    p.add_argument("--kprofile-cases", type=lambda v: [x for x in v.split(",") if x], default=["b1", "b64"],
                   help="kprofile section: bN or bNxC (N random prompts of C tokens, 1k by default), pN (one N-token "
                        "prefill), shared256")
    p.add_argument("--tprofile-windows", type=lambda v: [int(x) for x in v.split(",") if x],
                   default=[100, 400, 800], help="tprofile section: the steps where profiled windows start")
    p.add_argument("--tprofile-steps", type=int, default=20, help="tprofile section: steps per window")
    p.add_argument("--tprofile-host", action="store_true",
                   help="tprofile section: record host activity too, with the engine's phases labelled (slower host; "
                   "names the host work at each GPU gap)")
    p.add_argument("--hostprof-cases", type=lambda v: [tuple(int(y) for y in x.split("x")) for x in v.split(",") if x],
                   default=[(1, 1024), (64, 1024), (64, 4096)],
                   help="hostprof section: BATCHxCONTEXT cases (default 1x1024,64x1024,64x4096)")
    p.add_argument("--mixed-cases", type=lambda v: [tuple(int(y) for y in x.split("x")) for x in v.split(",") if x],
                   default=[(16, 1024, 128), (32, 1024, 256), (64, 1024, 512)],
                   help="mixed section: BATCHxCONTEXTxPROMPT, comma-separated")
    p.add_argument("--mixed-cycles", type=int, default=12, help="mixed section: arrivals per window")
    p.add_argument("--poisson-rate", type=float, default=16.0, help="poisson section: arrivals a second")
    p.add_argument("--poisson-duration", type=float, default=20.0, help="poisson section: seconds of arrivals")
    p.add_argument("--poisson-in", type=int, default=512, help="poisson section: prompt tokens (scaled)")
    p.add_argument("--poisson-out", type=int, default=256, help="poisson section: output tokens (scaled)")
    p.add_argument("--poisson-rounds", type=int, default=2, help="poisson section: rounds of each mode")
    p.add_argument("--poisson-seed", type=int, default=16, help="poisson section: the arrival times' seed")
    p.add_argument("--graph-capture", choices=["lean", "torch"], default=None,
                   help="capture graphs with capture_begin/capture_end (lean, the default) or through "
                        "torch.cuda.graph, which syncs and empties the caches before each capture (A/B)")
    p.add_argument("--time-host-copies", action="store_true",
                   help="time each step's copy of its sampled ids to the host and its whole launch (host clock)")
    p.add_argument("--piecewise-max-tokens", type=int, default=None,
                   help="override model_runner.PIECEWISE_GRAPH_MAX_TOKENS (0: no piecewise graphs)")
    p.add_argument("--trace-workloads", type=lambda v: [x for x in v.split(",") if x], default=[],
                   help="trace section: seeds,random256,shared_prefix (default all)")
    p.add_argument("--elementwise-backend", default="triton", choices=["triton", "torch", "compile"])
    p.add_argument("--skinny-gemm", action=argparse.BooleanOptionalAction, default=True,
                   help="Triton matmul for small-row batches (off: cuBLAS for every matmul)")
    p.add_argument("--rotary-cache-fusion", action=argparse.BooleanOptionalAction, default=True,
                   help="the rotary embedding writes the KV cache in its launch (off: two launches)")
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=True,
                   help="programmatic dependent launch of the Triton kernels (sm_90+; off: plain launches)")
    p.add_argument("--sdpa-cudnn-bucket", type=int, default=None, help="override ops.SDPA_CUDNN_BUCKET")
    p.add_argument("--sdpa-torch-order", action="store_true",
                   help="one-prompt prefill: torch's own SDPA backend order (no flash/cuDNN choice by kvserve)")
    p.add_argument("--penalty-kernel", action=argparse.BooleanOptionalAction, default=True,
                   help="penalised rows: the one-pass Triton kernel (default) or the torch reference (A/B)")
    p.add_argument("--gate-up-silu-fusion", action=argparse.BooleanOptionalAction, default=True,
                   help="small batches: SiLU-and-mul in the gate/up matmul's epilogue")
    p.add_argument("--decode-gate-up-tma", action=argparse.BooleanOptionalAction, default=True,
                   help="33-64 rows (sm_90+): the gate/up matmul as one Triton TMA launch with SiLU-and-mul")
    p.add_argument("--prefill-gate-up-fusion", action=argparse.BooleanOptionalAction, default=False,
                   help="prefill-sized batches (sm_90+): the gate/up matmul as one Triton launch with SiLU-and-mul")
    p.add_argument("--prefill-qkv-padding", action=argparse.BooleanOptionalAction, default=True,
                   help="one-prompt cuDNN prefill: the rotary launch writes q/k/v padded (off: copied after it)")
    p.add_argument("--prefill-copy-always", action="store_true",
                   help="with --no-prefill-qkv-padding: copy q/k/v for cuDNN even when already in its layout "
                   "(the code before the padded launch, for A/B)")
    p.add_argument("--last-layer-pruning", action=argparse.BooleanOptionalAction, default=True,
                   help="steps that sample some rows only: the last layer past its cache write on those rows alone "
                   "(off: every row, then select)")
    p.add_argument("--sampled-row-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="with pruning: the last layer's attention for the sampled rows alone, as decode queries "
                   "over the cache (off: every row attends, then select)")
    p.add_argument("--deferred-block-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="hash a step's new prompt blocks for the prefix cache once the step is launched (off: "
                   "inside schedule(), before the launch)")
    p.add_argument("--qkv-rope-fusion", action=argparse.BooleanOptionalAction, default=True,
                   help="small batches: rotary embedding and cache write in the q/k/v matmul's epilogue")
    p.add_argument("--skinny-max-rows", type=int, default=None, help="override ops.SKINNY_GEMM_MAX_ROWS")
    p.add_argument("--skinny-split-rule", default="resident", choices=["resident", "divisor"],
                   help="split-K of the Triton matmul: as many splits as stay resident at once (default), or the "
                   "earlier rule (the fewest splits dividing K for 1.5 programs per SM)")
    p.add_argument("--decode-prefetch-ids", action=argparse.BooleanOptionalAction, default=None,
                   help="override triton_attention.DECODE_PREFETCH_IDS (decode attention loads block ids a tile ahead)")
    p.add_argument("--decode-busy-programs-per-sm", type=int, default=None,
                   help="override triton_attention.DECODE_BUSY_PROGRAMS_PER_SM (a large value: never the busy tiling)")
    p.add_argument("--decode-launch", default="", help="TILE_N,warps,stages of split decode attention launches")
    p.add_argument("--decode-launch-one-split", default="",
                   help="TILE_N,warps,stages of non-busy one-split decode launches (busy ones: DECODE_LAUNCH_ONE_SPLIT_BUSY)")
    p.add_argument("--decode-fused-merge-max-splits", type=int, default=None,
                   help="override triton_attention.DECODE_FUSED_MERGE_MAX_SPLITS: split decode attention up to this "
                   "many splits merges in its last program (0: always a reduce launch)")
    p.add_argument("--gemm-tuning", action=argparse.BooleanOptionalAction, default=None,
                   help="override KVSERVE_GEMM_TUNING: time cuBLASLt's candidates for the model's matmuls at start "
                   "at the decode graph sizes (instead of the stored or shipped decode-size choices)")
    p.add_argument("--prefill-gemm-tuning", type=int, choices=(0, 1, 2), default=None,
                   help="override KVSERVE_PREFILL_GEMM_TUNING: the sustained matmul choices at the step budget's rows "
                   "(0 off, 1 stored or shipped, 2 also timed at start where none is); this process only: "
                   "tensor-parallel workers read KVSERVE_PREFILL_GEMM_TUNING")
    p.add_argument("--no-shipped-gemm-choices", action="store_true",
                   help="the matmul tuning ignores kvserve's shipped choices, at the step budget's rows (times the "
                   "candidates instead where KVSERVE_CACHE_DIR holds none, with --prefill-gemm-tuning 2) and at the "
                   "decode sizes (torch's picks where KVSERVE_CACHE_DIR holds none); this process only")
    p.add_argument("--gemm-tuning-rows", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="the decode rows of the matmul tuning: exactly these row counts instead of the decode graph "
                   "sizes (timed briefly with --gemm-tuning, else the stored or shipped sustained choices; the step "
                   "budget's rows stay with theirs unless --prefill-gemm-tuning 0); this process only")
    p.add_argument("--decode-gemm-choices", action=argparse.BooleanOptionalAction, default=None,
                   help="override KVSERVE_DECODE_GEMM_CHOICES: the stored or shipped sustained matmul choices at the "
                   "decode graph sizes; this process only: tensor-parallel workers read KVSERVE_DECODE_GEMM_CHOICES")
    p.add_argument("--sync-debug", action="store_true",
                   help="count the synchronizing torch calls after start-up by call site (slows the host: "
                   "diagnostic runs only)")
    p.add_argument("--sdpa-cudnn-min-tokens", type=int, default=None,
                   help="override ops.SDPA_CUDNN_MIN_TOKENS: one-prompt prefills this long use cuDNN attention "
                   "(0: never; default: 1024 on sm_90+)")
    p.add_argument("--pairs-32-row-tiles", action="store_true",
                   help="4-bit paired matmul in 32-row tiles past 32 rows (A/B of its 64-row tiles of two dots)")
    args = p.parse_args()
    if args.hf_runs < 2:
        p.error("--hf-runs must be at least 2 (a cold run, then the steady ones)")
    from kvserve.kernels import ops, triton_quant

    triton_quant.PAIRS_TWO_DOTS = not args.pairs_32_row_tiles

    ops.set_elementwise_backend(args.elementwise_backend)
    ops.set_skinny_gemm(args.skinny_gemm)
    ops.set_rotary_cache_fusion(args.rotary_cache_fusion)
    from kvserve.kernels import triton_pdl

    triton_pdl.set_enabled(args.pdl)
    if args.sdpa_cudnn_bucket is not None:
        ops.SDPA_CUDNN_BUCKET = args.sdpa_cudnn_bucket
    if args.sdpa_torch_order:
        import contextlib

        ops._sdpa_order = lambda cudnn: contextlib.nullcontext  # type: ignore[assignment]
    ops.set_gate_up_silu_fusion(args.gate_up_silu_fusion)
    ops.set_penalty_kernel(args.penalty_kernel)
    ops.set_prefill_gate_up_fusion(args.prefill_gate_up_fusion)
    ops.set_prefill_qkv_padding(args.prefill_qkv_padding)
    if args.prefill_copy_always:
        def _copy_always(t: Any, num_tokens: int) -> Any:
            out = t.new_empty((num_tokens, *t.shape[1:]))
            out[: t.shape[0]].copy_(t)
            out[t.shape[0] :].zero_()
            return out

        ops._pad_tokens = _copy_always
    ops.set_decode_gate_up_tma(args.decode_gate_up_tma)
    from kvserve.model import llama

    llama.set_last_layer_pruning(args.last_layer_pruning)
    llama.set_sampled_row_attention(args.sampled_row_attention)
    from kvserve.core import kv_cache_manager

    kv_cache_manager.DEFERRED_BLOCK_CACHING = args.deferred_block_caching
    ops.set_qkv_rope_fusion(args.qkv_rope_fusion)
    if args.skinny_max_rows is not None:
        ops.SKINNY_GEMM_MAX_ROWS = args.skinny_max_rows
    if args.skinny_split_rule == "divisor":
        _use_divisor_split_rule()
    from kvserve.kernels import triton_attention

    if args.decode_busy_programs_per_sm is not None:
        triton_attention.DECODE_BUSY_PROGRAMS_PER_SM = args.decode_busy_programs_per_sm
    if args.decode_prefetch_ids is not None:
        triton_attention.DECODE_PREFETCH_IDS = args.decode_prefetch_ids
    for text, launch in ((args.decode_launch, triton_attention.DECODE_LAUNCH),
                         (args.decode_launch_one_split, triton_attention.DECODE_LAUNCH_ONE_SPLIT)):
        if text:
            tile, warps, stages = (int(v) for v in text.split(","))
            launch.update(TILE_N=tile, num_warps=warps, num_stages=stages)
    if args.decode_fused_merge_max_splits is not None:
        triton_attention.DECODE_FUSED_MERGE_MAX_SPLITS = args.decode_fused_merge_max_splits
    if args.sdpa_cudnn_min_tokens is not None:
        ops.SDPA_CUDNN_MIN_TOKENS = args.sdpa_cudnn_min_tokens
    if args.gemm_tuning is not None:
        from kvserve import envs

        envs.KVSERVE_GEMM_TUNING = args.gemm_tuning
    if args.prefill_gemm_tuning is not None:
        from kvserve import envs

        envs.KVSERVE_PREFILL_GEMM_TUNING = args.prefill_gemm_tuning
    if args.no_shipped_gemm_choices:
        from kvserve.kernels import cublaslt

        cublaslt.SHIPPED_CHOICES_PATH = None
    if args.gemm_tuning_rows is not None:
        from kvserve.worker.model_runner import ModelRunner

        rows = sorted(set(args.gemm_tuning_rows))
        ModelRunner.gemm_tuning_rows = lambda self: rows  # type: ignore[method-assign]
    if args.decode_gemm_choices is not None:
        from kvserve import envs

        envs.KVSERVE_DECODE_GEMM_CHOICES = args.decode_gemm_choices
    if args.prefill_graph_max_tokens is not None:
        from kvserve.worker import model_runner

        model_runner.PREFILL_GRAPH_MAX_TOKENS = args.prefill_graph_max_tokens
    if args.graph_capture is not None:
        from kvserve.worker import cuda_graph

        cuda_graph.LEAN_CAPTURE = args.graph_capture == "lean"
    if args.piecewise_max_tokens is not None:
        from kvserve.worker import model_runner

        model_runner.PIECEWISE_GRAPH_MAX_TOKENS = args.piecewise_max_tokens
    if args.decode_programs_per_sm is not None:
        ops.DECODE_PROGRAMS_PER_SM = args.decode_programs_per_sm
    if args.sampled_rows_warmup != "last":
        _move_sampled_rows_warm_up(args.sampled_rows_warmup)
    bench = Bench(args)
    sections = [s for s in args.sections.split(",") if s]
    if args.tensor_parallel_size > 1 and set(sections) - TP_SECTIONS:
        # The others call rank 0's runner directly, or start several engines in this process.
        raise SystemExit(f"with --tensor-parallel-size > 1 only these sections run: {sorted(TP_SECTIONS)}")
    errors: dict[str, str] = {}
    for name in sections:
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; choose from {SECTIONS}")
        t0 = time.perf_counter()
        try:
            getattr(bench, f"section_{name}")()
        except Exception:
            errors[name] = traceback.format_exc()
            print(f"section {name} failed:\n{errors[name]}", file=sys.stderr, flush=True)
        print(f"[section {name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    if "start" in bench.results:
        late = bench.late_variants + (list(bench.core.late_kernel_variants) if bench.core is not None else [])
        bench.results["start"]["serving_late_variants"] = list(late)
        bench.rows.append(("Triton variants loaded by steps", f"{len(late)}", ", ".join(sorted(set(late)))
                           or "none since start"))
    if args.time_host_copies:
        bench.results["host_copies"] = [{"tokens": n, "copy_s": c, "launch_s": t} for n, c, t in bench.host_copy_times]
        bench.rows.extend(_host_copy_rows(bench.host_copy_times))
    if args.sync_debug:
        bench.results["syncs"] = [{"where": w, "what": m, "count": c} for (w, m), c in
                                  sorted(_SYNCS.items(), key=lambda kv: -kv[1])]
        for (where, what), count in sorted(_SYNCS.items(), key=lambda kv: -kv[1]):
            bench.rows.append(("host sync (count)", f"{count}", f"{where}: {what}"))
        if not _SYNCS:
            bench.rows.append(("host sync (count)", "0", "torch reported none after start-up"))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    for name, value in bench.results.items():
        write_result(args.out, f"engine_{name}", settings, value, args.device)
    if errors:
        write_result(args.out, "engine_errors", settings, errors, args.device)
    print(f"\n{'measure':<48} {'value':>12}  note")
    for measure, value, note in bench.rows:
        print(f"{measure:<48} {value:>12}  {note}")
    return 1 if errors else 0


# Sections that drive the engine through EngineCore.step() alone, on one engine (tensor parallelism).
TP_SECTIONS = {"start", "decode", "seeds", "random256", "ttft"}

if __name__ == "__main__":
    sys.exit(main())
