#!/bin/bash
# One device call: GPU correctness and benchmarks on the H200, run from the repository root.
#   bash benchmarks/run_h200.sh <step>...
# steps: pytest engine engine2 eager hf kernels elementwise ab prefix2 prefixab cascade profile diag diag2 diag3
#        async ttftab sweep serve (see the case below for what each runs)
# Needs the wheels of .whl/ (msgspec, gguf: not on the GPU image). Logs and JSON go to /tmp/kvres, packed
# into $OUT/results.tgz (the device returns at most 8 files); each step's table is printed at the end.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
R=/tmp/kvres
mkdir -p "$R" "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > "$R/nvidia_smi.txt" 2>&1
T0=$(date +%s)
for step in "$@"; do
  echo "=== $step (t=$(( $(date +%s) - T0 ))s)"
  case $step in
    pytest) timeout 200 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu > "$R/pytest_gpu.log" 2>&1 ;;
    engine) timeout 240 python3 benchmarks/engine_benchmarks.py --out "$R/engine" \
              --sections start,decode,seeds,ttft > "$R/engine.log" 2>&1 ;;
    engine2) timeout 300 python3 benchmarks/engine_benchmarks.py --out "$R/engine2" \
              --sections start,random256,prefix > "$R/engine2.log" 2>&1 ;;
    eager) timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/eager" --enforce-eager \
              --decode-steps 12 --sections start,decode,ttft > "$R/eager.log" 2>&1 ;;
    ab) for pps in 2 4 2 4; do
          timeout 60 python3 benchmarks/engine_benchmarks.py --out "$R/ab_pps$pps" --sections decode \
            --decode-programs-per-sm $pps --decode-batches 8,32,64 --decode-contexts 1024 --decode-steps 30 \
            >> "$R/ab.log" 2>&1
        done ;;
    prefix2) for i in 1 2; do
          timeout 90 python3 benchmarks/engine_benchmarks.py --out "$R/prefix$i" --sections prefix >> "$R/prefix2.log" 2>&1
        done ;;
    cascade) for mode in no-cascade cascade; do
          timeout 130 python3 benchmarks/engine_benchmarks.py --out "$R/prefix_$mode" --sections start,prefix \
            --$mode-attn >> "$R/cascade.log" 2>&1
        done
        timeout 100 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu -k cascade >> "$R/cascade.log" 2>&1
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/cascade_kprofile" --sections kprofile \
          --kprofile-cases shared256 --cascade-attn >> "$R/cascade.log" 2>&1 ;;
    profile) timeout 90 python3 benchmarks/engine_benchmarks.py --out "$R/profile" --sections profile \
              > "$R/profile.log" 2>&1 ;;
    diag) timeout 300 python3 benchmarks/engine_benchmarks.py --out "$R/diag" --sections start,trace,kprofile \
              > "$R/diag.log" 2>&1 ;;
    async) for mode in no-async async; do
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/decode_$mode" --sections start,decode \
            --$mode-scheduling --decode-batches 1,8,64 --decode-contexts 1024 --decode-steps 30 >> "$R/async.log" 2>&1
        done
        timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/work_async" --sections seeds,trace \
          >> "$R/async.log" 2>&1 ;;
    diag2) timeout 300 python3 benchmarks/engine_benchmarks.py --out "$R/diag2" \
              --sections start,decode,hostprof,kprofile,seeds,trace --decode-batches 1,8,64 --decode-contexts 1024 \
              --decode-steps 30 > "$R/diag2.log" 2>&1 ;;
    prefixab) timeout 280 python3 benchmarks/engine_benchmarks.py --out "$R/prefixab" --sections prefixab \
              > "$R/prefixab.log" 2>&1 ;;
    ttftab) for mode in no-async async no-async async; do
          timeout 60 python3 benchmarks/engine_benchmarks.py --out "$R/ttft_$mode" --sections ttft \
            --$mode-scheduling >> "$R/ttftab.log" 2>&1
        done ;;
    diag3) timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/diag3" --sections start,random256 \
              > "$R/diag3.log" 2>&1 ;;
    serve) OUT="$R/serve" PYTHONPATH=/tmp/site:$PWD timeout 280 bash benchmarks/serve_bench.sh > "$R/serve.log" 2>&1 ;;
    sweep) timeout 300 python3 benchmarks/attention_sweep.py --out "$R/attention_sweep.json" > "$R/sweep.log" 2>&1 ;;
    hf) timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/hf" --sections hf > "$R/hf.log" 2>&1 ;;
    kernels) timeout 120 python3 benchmarks/gpu_kernels.py --models qwen2.5-7b --dtypes bf16 fp16 \
              --budget-s 60 --rep-ms 20 --out "$R/gpu_kernels.json" > "$R/gpu_kernels.log" 2>&1 ;;
    elementwise) timeout 120 python3 benchmarks/elementwise_backends.py --out "$R" > "$R/elementwise.log" 2>&1 ;;
  esac
  echo "rc=$?"
done
tar czf "$OUT/results.tgz" -C "$R" .
echo "=== total $(( $(date +%s) - T0 ))s"
for f in "$R"/cascade.log "$R"/serve.log "$R"/diag3.log "$R"/ttftab.log "$R"/prefixab.log "$R"/diag2.log "$R"/async.log "$R"/sweep.log "$R"/diag.log "$R"/profile.log "$R"/pytest_gpu.log "$R"/engine.log "$R"/engine2.log "$R"/eager.log "$R"/ab.log "$R"/prefix2.log "$R"/hf.log "$R"/gpu_kernels.log "$R"/elementwise.log; do
  [ -f "$f" ] || continue
  echo "##### $(basename "$f")"
  case $(basename "$f") in
    pytest_gpu.log) grep -E "passed|failed|PASSED|FAILED|Error|error|kvserve bf16|skipped" "$f" | tail -25 ;;
    gpu_kernels.log) grep -E "FAIL|False|rows," "$f" | tail -8; tail -c 2500 "$f" ;;
    ab.log|prefix2.log) grep -E "^decode|^prefix|Error|failed" "$f" ;;
    cascade.log) grep -E "^prefix|^engine start|passed|failed|Error|^kernel profile|^ +[0-9]" "$f" | tail -40 ;;
    profile.log) tail -c 4500 "$f" ;;
    serve.log) tail -c 2500 "$f" ;;
    diag3.log) tail -c 1500 "$f" ;;
    ttftab.log) grep -E "^TTFT|Error" "$f" ;;
    prefixab.log) tail -c 800 "$f" ;;
    diag2.log) grep -E -A 16 "^kernel profile" "$f"; tail -c 2500 "$f" ;;
    async.log) grep -E "^decode|^seeds|^trace|^engine start|Error|failed" "$f" ;;
    sweep.log) tail -c 3500 "$f" ;;
    diag.log) grep -E -A 24 "^kernel profile" "$f"; tail -c 2000 "$f" ;;
    *) tail -c 2500 "$f" ;;
  esac
done
