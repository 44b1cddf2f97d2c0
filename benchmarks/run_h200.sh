#!/bin/bash
# One device call: GPU correctness and benchmarks on the H200, run from the repository root.
#   bash benchmarks/run_h200.sh <step>...
# steps: s63 s57 s54b s54a s53d s53c pdl53 s53b s53a s52d s52c s52b s52a s51b s51a s50e s50d s50c s50b s50a s49c ab49 s49t s49b s48 so47 so46 so45 gpu44 pen44 plp43 hfseeds43 gpu43 hf43 pen42 kernels41 final41 gpu40 kprof40 check40 final40 dab40 dsw40 dec39 check39 final39 pgt39b c1ab39 pgt39 sus39 place38 dpdl38 gap38 busy38 tma38 ncuattn36 pair36 last36 pw36 final36 ab36 fuse36 ncu36 fix35 graphs35 final35 diag35 pairs35 pairs34 lop34 swap34 quant33 tp32a tp32b tp32c asc31b asc31 api30c api30b api30 client29b api29 client29 pytest28 cublas28 firstburst28 firstpass28w firstpass28s firstpass28e firstpass28 sweep28 abclient27 gcprobe27 client27 mnbt27 rowq26 gcserve26 gc26 bisect26 hash25 capfail25b capfail25 offloop24 pytest24 rowattn24 apipath24 layers23 apipath23b apipath23 apipath poisson22 mixed22 shared22 hostcopy22 pytest22c copy22 pytest22b start22 pytest22 pytest21 pw21d pw21c serve21 pw21b pw21 host20 ph20 gaps20 pytest20 split20 diag20 ws19 prune19 dec19 kprof19 fmlp18 early17 tprof17 lpt16 abpad16 ggufa ggufb layout1 review14 gatesmall2 tmaab gatesmall gateup2 gateab2 gateup gateab l2probe hfdiag3 sdpafix hfdiag2 hfdiag final12 final11 probe coldab coldw coldprof pytestlt tuneab2 tuneab ltalgos attnab3 attnab2 attnpf rows32 ttftrest mergeab splitab gemmsplit padcheck asweep padab rows decgraph gapdiag gemmdown64 pytestengine prefillab2 prefillab prefillprof gemm4 ttftclk gemm3 blasab confirm fuseab2 ttftrand2 pdlab2 pdlgemm pdlab ttftrand modload sharedab final ggufcheck gemm gemm2 skinnyab fuseab cascade3 gemmdown pattn cascade2 pytest engine engine2 eager hf kernels elementwise ab prefix2 prefixab cascade profile diag diag2 diag3
#        async ttftab sweep serve (see the case below for what each runs)
# Pass the local commit, written in literally (the device copy's git metadata can be stale, so a $(git ...) in
# the command would read it there): KVSERVE_BENCH_COMMIT=<sha> bash ...
# Needs the wheels of .whl/ (msgspec, gguf, aiohttp and its dependencies: not on the GPU image). Logs and JSON go to /tmp/kvres, packed
# into $OUT/results.tgz (the device returns at most 8 files); each step's table is printed at the end.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
R=/tmp/kvres
rm -rf "$R"  # a machine still warm from the last call keeps its files: pack this call's only
mkdir -p "$R" "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > "$R/nvidia_smi.txt" 2>&1
T0=$(date +%s)
# The decode graph sizes past the skinny matmul's 32 rows (config.DEFAULT_CUDA_GRAPH_SIZES up to 256).
DEC_ROWS=${DEC_ROWS:-48,64,80,96,112,128,144,160,176,192,208,224,240,256}
# without_capture_cleanup LOG TEST...: each pytest node id in a process of its own (a failed capture leaves
# the process's state broken) with cuda_graph._release_failed_capture made a no-op, as before its fix.
without_capture_cleanup() {
  local log=$1 t; shift
  for t in "$@"; do
    echo "=== before the fix: $t" >> "$log"
    timeout 100 python3 -c 'import sys, pytest
from kvserve.worker import cuda_graph
cuda_graph._release_failed_capture = lambda graph, pool: None
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", sys.argv[1]]))' "$t" >> "$log" 2>&1
    echo "exit $?" >> "$log"
  done
}
# bench_load_args LOAD: kvserve bench's load flags for LOAD: seeds (50 in flight, 512 in / 256 out, 200
# prompts) or burst256 (256 requests at once, lengths uniform in about [100, 1024]). The server's temperature, as
# the runs recorded before kvserve bench's default became greedy (vLLM's).
bench_load_args() {
  if [ "$1" = seeds ]; then
    echo "--concurrency 50 --num-prompts 200 --input-len 512 --max-tokens 256 --temperature server"
  else
    echo "--request-rate inf --num-prompts 256 --input-len 562 --input-dist uniform --max-tokens 562 --output-dist uniform --range-ratio 0.82 --temperature server"
  fi
}
# serve_7b LOG [FLAGS...]: kvserve serve on the Qwen2.5-7B shape (dummy weights) on port 8000 in the
# background, served as qwen2-7b, with FLAGS; returns once /health answers (at most 120 s). Sets $server (its
# pid) and $dir (the model directory, kvserve bench's --tokenizer). Needs .carry/tok. SERVE_SITE: the
# server's wheel directory (default /tmp/site); SERVE_TREE: the kvserve tree it runs (default this one).
serve_7b() { serve_shape qwen2.5-7b "$@"; }
# serve_shape SHAPE LOG [FLAGS...]: serve_7b for a shape of benchmarks/common.py (still served as qwen2-7b).
serve_shape() {
  local shape=$1 log=$2; shift 2
  dir=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w(sys.argv[1]))' "$shape")
  local tree=${SERVE_TREE:-$PWD}  # python -m puts the working directory first on the path: run from the tree
  (cd "$tree" && PYTHONPATH=${SERVE_SITE:-/tmp/site}:$tree exec python3 -m kvserve serve "$dir" --load-format dummy \
    "$@" --served-model-name qwen2-7b --port 8000 --disable-log-requests --disable-uvicorn-access-log) > "$log" 2>&1 &
  server=$!
  for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
  api_pids=$(sed -n 's/.*started [0-9]* more API server processes (pids \([0-9, ]*\)).*/\1/p' "$log" | tr -d ,)
}
# api_ticks: CPU ticks of the server's API processes so far ($server and $api_pids from serve_shape).
api_ticks() {
  local pid total=0
  for pid in $server $api_pids; do total=$((total + $(awk '{print $14 + $15}' /proc/$pid/stat))); done
  echo $total
}
# api30_line JSON MODE N LABEL T0 T1: one summary line of a kvserve bench JSON, with the API process's CPU ticks
# T0 and T1 read around the run (/proc/PID/stat).
api30_line() {
  python3 - "$1" "$2" "$3" "$4" "$5" "$6" "$(getconf CLK_TCK)" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["runs"][-1]
s, recs = run["summary"], run["records"]
gaps = [g for r in recs for g in r["itl_s"]]
near0 = 100.0 * sum(g < 0.001 for g in gaps) / max(len(gaps), 1)
tokens = sum(r.get("output_tokens") or 0 for r in recs)
chunks = sum(len(r["itl_s"]) + 1 for r in recs if r.get("ttft_s") is not None)
api_s = (int(sys.argv[6]) - int(sys.argv[5])) / int(sys.argv[7])
print(f"server {sys.argv[3]} {sys.argv[2]:3s} {sys.argv[4]:22s}: output {s['output_throughput']:.0f} tok/s, completed "
      f"{s['completed']}/{s['num_requests']}; TTFT p50 {s['ttft']['median_ms']:.1f} P99 {s['ttft']['p99_ms']:.1f} ms; "
      f"ITL p50 {s['itl']['median_ms']:.2f} P99 {s['itl']['p99_ms']:.1f} ms, {near0:.1f} % of gaps < 1 ms; TPOT p50 "
      f"{s['tpot']['median_ms']:.2f} ms; {chunks / max(tokens, 1):.2f} chunks a token; API {api_s:.2f} CPU-s "
      f"(warm-up too), {1e6 * api_s / max(tokens, 1):.0f} us a token; client CPU {s['client']['cpu_percent']:.0f}%")
PY
}
# api30_bench JSON LOG MODE N LABEL BENCH_ARGS...: one kvserve bench process against the server on port 8000
# ($server, $dir from serve_shape), its summary line (api30_line) appended to $R/api30.log, its JSON gzipped.
api30_bench() {
  local json=$1 log=$2 mode=$3 n=$4 label=$5 t0 t1; shift 5
  t0=$(api_ticks)
  PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
    --model qwen2-7b "$@" --warmup 8 --ignore-eos --tokenizer "$dir" --no-progress --json "$json" > "$log" 2>&1
  t1=$(api_ticks)
  api30_line "$json" "$mode" "$n" "$label" "$t0" "$t1" >> "$R/api30.log" 2>&1
  gzip -f "$json"
}
# firstpass_engine STEP LABEL ENV [FLAGS...]: engine_benchmarks.py's firstpass section in a fresh engine, under
# ENV (VAR=VALUE, or "") with FLAGS, into $R/STEP_LABEL; its output and rc go to $R/STEP_full.log, its start
# time and phases to $R/STEP.log.
firstpass_engine() {
  local step=$1 label=$2 envs=$3; shift 3
  env $envs timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/${step}_$label" --sections firstpass "$@" \
    >> "$R/${step}_full.log" 2>&1
  echo "$step $label rc=$?" >> "$R/${step}_full.log"
  python3 -c "import json, sys; d = json.load(open(sys.argv[1]))['results']; print(sys.argv[2], 'start_s', round(d['start_s'], 1), {k: round(v, 2) for k, v in d['phases_s'].items()})" \
    "$R/${step}_$label/engine_start.json" "$label" >> "$R/$step.log" 2>&1
}
# awq_decode_modes LOG LABEL:FLAGS...: the AWQ engine's decode (batch 1 / 8 / 64 x 1k) in a fresh engine per
# LABEL, in turn, with its FLAGS (space-separated; none after a bare "LABEL:"), appended to $R/LOG with a
# "mode LABEL done" line and copied to $OUT after each; prints the decode lines at the end.
awq_decode_modes() {
  local log=$1 spec label flags; shift
  for spec in "$@"; do
    label=${spec%%:*}; flags=${spec#*:}
    timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/${log%.log}_$label" --quantization awq \
      --sections decode --decode-contexts 1024 $flags >> "$R/$log" 2>&1
    echo "mode $label done" >> "$R/$log"
    cp "$R/$log" "$OUT/"
  done
  grep -a -E "decode b|mode .* done|Error" "$R/$log" | cut -c1-60
}
# engine_modes STEP SECONDS "ARGS" LABEL:FLAGS...: engine_benchmarks.py with ARGS (word-split) and each LABEL's
# FLAGS in turn, a fresh process each (at most SECONDS), into $R/STEP_LABEL and the shared log $R/STEP_engine.log
# ("mode LABEL rc=N done" after each), copied to $OUT after each; prints nothing (grep the log after).
engine_modes() {
  local step=$1 limit=$2 common=$3 spec label flags; shift 3
  for spec in "$@"; do
    label=${spec%%:*}; flags=${spec#*:}
    timeout "$limit" python3 benchmarks/engine_benchmarks.py --out "$R/${step}_$label" $common $flags \
      >> "$R/${step}_engine.log" 2>&1
    echo "mode $label rc=$? done" >> "$R/${step}_engine.log"
    cp "$R/${step}_engine.log" "$OUT/"
  done
}
# quant_matmul_modes STEP ROWS LABEL:FLAGS...: quant_matmul_bench.py's table at ROWS per LABEL with its FLAGS,
# into $R/STEP_matmul_LABEL.log (copied to $OUT); prints each table's rows.
quant_matmul_modes() {
  local step=$1 rows=$2 spec label flags; shift 2
  for spec in "$@"; do
    label=${spec%%:*}; flags=${spec#*:}
    timeout 70 python3 benchmarks/quant_matmul_bench.py --out "$R/${step}_$label" --rows "$rows" --repeats 5 \
      $flags > "$R/${step}_matmul_$label.log" 2>&1
    cp "$R/${step}_matmul_$label.log" "$OUT/"
    echo "== matmul $label"; tail -$((4 * $(tr -cd , <<< "$rows" | wc -c) + 4)) "$R/${step}_matmul_$label.log" | cut -c1-80
  done
}
for step in "$@"; do
  echo "=== $step (t=$(( $(date +%s) - T0 ))s)"
  case $step in
    attnpf) for mode in old new t64s4 t128w8 old new; do
          case $mode in
            old) flags="--no-decode-prefetch-ids" ;; new) flags="" ;;
            t64s4) flags="--decode-launch-one-split 64,4,4" ;; t128w8) flags="--decode-launch-one-split 128,8,3" ;;
          esac
          timeout 90 python3 benchmarks/engine_benchmarks.py --out "$R/attnpf_$mode" --sections start,decode,seeds \
            --decode-batches 1,8,32,48,64 --decode-contexts 1024 --decode-steps 30 $flags >> "$R/attnpf.log" 2>&1
          echo "mode $mode done" >> "$R/attnpf.log"
        done
        timeout 170 python3 benchmarks/attention_sweep.py --out "$R/attn_prefetch.json" --tiles 64,128 --warps 4,8 \
          --stages 2,3,4 --prefetch-ids on,off \
          --cases 64:1024:1,48:1024:1,64:4096:1,128:1024:1,176:r:1,32:1024:3,16:1024:5,1:1024:64 \
          > "$R/attnsweep.log" 2>&1 ;;
    attnab3) for mode in rule old rule old; do
          flags=""; [ $mode = old ] && flags="--no-decode-prefetch-ids --decode-launch-one-split 128,4,3"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/attnab3_$mode" --sections start,seeds,random256 \
            $flags >> "$R/attnab3.log" 2>&1
          echo "mode $mode done" >> "$R/attnab3.log"
        done ;;
    attnab2) for mode in new old; do
          flags=""; [ $mode = old ] && flags="--no-decode-prefetch-ids --decode-launch-one-split 128,4,3"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/attnab2_$mode" --sections start,decode,random256 \
            --decode-batches 64,128 --decode-contexts 1024,4096 --decode-steps 20 $flags >> "$R/attnab2.log" 2>&1
          echo "mode $mode done" >> "$R/attnab2.log"
        done ;;
    rows32) for mode in r32 r16 r32 r16; do
          flags=""; [ $mode = r16 ] && flags="--skinny-max-rows 16"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/rows_$mode" --sections start,decode,random256 \
            --decode-batches 24,32 --decode-contexts 1024,4096 --decode-steps 30 $flags >> "$R/rows32.log" 2>&1
          echo "mode $mode done" >> "$R/rows32.log"
        done ;;
    ttftrest) timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/ttftrest" --sections start,ttft,ttftrest \
              > "$R/ttftrest.log" 2>&1 ;;
    pdlgemm) timeout 200 python3 benchmarks/gemm_sweep.py --picked --rows 1,8 \
              --out "$R/gemm_pdl.json" > "$R/pdlgemm.log" 2>&1 ;;
    pdlab) for mode in pdl no-pdl pdl64 pdl; do
          flags="--$mode"; batches=1,8,64
          [ $mode = pdl64 ] && flags="--pdl --skinny-max-rows 64" && batches=32,64
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/decode_$mode" --sections start,decode \
            --decode-batches $batches --decode-contexts 1024 --decode-steps 30 $flags >> "$R/pdlab.log" 2>&1
          echo "mode $mode done" >> "$R/pdlab.log"
        done ;;
    pdlab2) for mode in pf512 nopdl pf0 pf2048 late512 pf512 nopdl pf0; do
          case $mode in
            nopdl) flags="--no-pdl" ;; late512) flags="--pdl --late-release --prefetch-keys 512" ;;
            *) flags="--pdl --prefetch-keys ${mode#pf}" ;;
          esac
          timeout 90 python3 benchmarks/engine_benchmarks.py --out "$R/decode2_$mode" --sections start,decode \
            --decode-batches 1,8,64 --decode-contexts 1024 --decode-steps 30 $flags >> "$R/pdlab2.log" 2>&1
          echo "mode $mode done" >> "$R/pdlab2.log"
        done ;;
    blasab) for mode in lt default lt default; do
          envs=""; [ $mode = lt ] && envs="TORCH_BLAS_PREFER_CUBLASLT=1"
          env $envs timeout 80 python3 benchmarks/engine_benchmarks.py --out "$R/blas_$mode" --sections start,decode,seeds \
            --decode-batches 32,64 --decode-contexts 1024 --decode-steps 30 >> "$R/blasab.log" 2>&1
          echo "mode $mode done" >> "$R/blasab.log"
        done ;;
    confirm) for run in 1 2; do
          secs=start,decode; [ $run = 1 ] && secs=start,decode,shared
          timeout 110 python3 benchmarks/engine_benchmarks.py --out "$R/confirm$run" --sections $secs \
            --decode-batches 1,8 --decode-contexts 1024 --decode-steps 40 >> "$R/confirm.log" 2>&1
        done ;;
    fuseab2) for mode in on off silu rope on; do
          case $mode in
            on) flags="" ;; off) flags="--no-gate-up-silu-fusion --no-qkv-rope-fusion" ;;
            silu) flags="--no-qkv-rope-fusion" ;; rope) flags="--no-gate-up-silu-fusion" ;;
          esac
          timeout 90 python3 benchmarks/engine_benchmarks.py --out "$R/fuse2_$mode" --sections start,decode \
            --decode-batches 1,8,16,64 --decode-contexts 1024 --decode-steps 30 $flags >> "$R/fuseab2.log" 2>&1
          echo "mode $mode done" >> "$R/fuseab2.log"
        done ;;
    ttftrand2) for mode in flash torchorder cudnn256 cudnn1 flash; do
          case $mode in
            flash) flags="--sdpa-cudnn-min-tokens 0" ;; torchorder) flags="--sdpa-cudnn-min-tokens 0 --sdpa-torch-order" ;;
            cudnn256) flags="--sdpa-cudnn-min-tokens 1024 --sdpa-cudnn-bucket 256" ;;
            cudnn1) flags="--sdpa-cudnn-min-tokens 1024 --sdpa-cudnn-bucket 1" ;;
          esac
          timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/ttftrand2_$mode" \
            --sections start,ttftrand,ttft,kprofile --kprofile-cases p8192 $flags >> "$R/ttftrand2.log" 2>&1
          echo "mode $mode done" >> "$R/ttftrand2.log"
        done ;;
    ttftrand) for mode in flash cudnn avoid; do
          flags="--sdpa-cudnn-min-tokens 0"; envs=""
          [ $mode != flash ] && flags="--sdpa-cudnn-min-tokens 1024"
          [ $mode = avoid ] && envs="TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1"
          env $envs timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/ttftrand_$mode" \
            --sections start,ttftrand,ttft $flags >> "$R/ttftrand.log" 2>&1
          echo "mode $mode done" >> "$R/ttftrand.log"
        done ;;
    pytestlt) timeout 200 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu -k "cublaslt or tuned" \
              > "$R/pytest_lt.log" 2>&1 ;;
    probe) python3 - > "$R/probe.log" 2>&1 <<'PY'
import torch, triton
from kvserve.kernels import triton_precompile
from triton.runtime.jit import JITFunction
from triton import knobs
print("torch", torch.__version__, "triton", triton.__version__, "available", triton_precompile.available())
print("hooks", knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, hasattr(JITFunction, "preload"))
PY
        ;;
    coldab) for mode in on off on off; do
          dir=$(mktemp -d); flag=1; [ $mode = off ] && flag=0
          TRITON_CACHE_DIR=$dir KVSERVE_TRITON_PRECOMPILE=$flag timeout 150 python3 benchmarks/engine_benchmarks.py \
            --out "$R/coldab_$mode" --sections start,decode,ttft --decode-batches 1,3,64 --decode-contexts 1024 \
            --decode-steps 20 >> "$R/coldab.log" 2>&1
          echo "mode $mode done ($(find $dir -name '*.cubin' | wc -l) cubins)" >> "$R/coldab.log"
        done ;;
    coldw) for workers in ${COLD_WORKERS:-16 1 4}; do
          dir=$(mktemp -d)
          TRITON_CACHE_DIR=$dir KVSERVE_TRITON_PRECOMPILE_WORKERS=$workers timeout 100 python3 \
            benchmarks/engine_benchmarks.py --out "$R/coldw_$workers" --sections start >> "$R/coldw.log" 2>&1
          echo "workers $workers done" >> "$R/coldw.log"
        done ;;
    coldprof) TRITON_CACHE_DIR=$(mktemp -d) timeout 100 python3 -m cProfile -o "$R/start.prof" \
            benchmarks/engine_benchmarks.py --out "$R/coldprof" --sections start > "$R/coldprof.log" 2>&1
        python3 -c "import pstats; s = pstats.Stats('$R/start.prof'); s.sort_stats('tottime').print_stats(25); s.sort_stats('cumulative').print_stats(45)" \
          > "$R/coldprof_stats.txt" 2>&1 ;;
    tuneab) for mode in on off on off; do
          flags="--gemm-tuning"; [ $mode = off ] && flags="--no-gemm-tuning"
          timeout 130 python3 benchmarks/engine_benchmarks.py --out "$R/tuneab_$mode" $flags \
            --sections start,decode,seeds,random256,ttft --decode-batches 48,64,192,48,64,192 \
            --decode-contexts 1024 --decode-steps 20 >> "$R/tuneab.log" 2>&1
          echo "mode $mode done" >> "$R/tuneab.log"
          cp "${KVSERVE_CACHE_DIR:-$HOME/.cache/kvserve}/gemm_tuning.json" "$R/gemm_tuning_after_$mode.json" 2>/dev/null
        done ;;
    tuneab2) for mode in on on off; do
          flags="--gemm-tuning"; [ $mode = off ] && flags="--no-gemm-tuning"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/tuneab2_$mode" $flags \
            --sections start,decode,ttft --decode-batches 48,64,192 --decode-contexts 1024 \
            --decode-steps 20 >> "$R/tuneab2.log" 2>&1
          echo "mode $mode done" >> "$R/tuneab2.log"
          cp "${KVSERVE_CACHE_DIR:-$HOME/.cache/kvserve}/gemm_tuning.json" "$R/gemm_tuning_after_$mode.json" 2>/dev/null
        done ;;
    ltalgos) timeout 420 python3 benchmarks/cublaslt_algos.py --out "$R/lt_algos.json" \
              --rows "${LT_ROWS:-48,64,80,96,112,128,144,160,176,192,208,224,240,256,1024,2048,8192}" > "$R/ltalgos.log" 2>&1 ;;
    pytest) timeout 330 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu > "$R/pytest_gpu.log" 2>&1 ;;
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
    asweep) timeout 220 python3 benchmarks/attention_sweep.py --out "$R/attention_sweep2.json" \
              --cases 64:1024:1/2,176:r:1/2,32:1024:1/3 --tiles 64,128 --warps 4,8 --stages 2,3,4 > "$R/sweep.log" 2>&1 ;;
    sweep) timeout 300 python3 benchmarks/attention_sweep.py --out "$R/attention_sweep.json" > "$R/sweep.log" 2>&1 ;;
    gemm) timeout 300 python3 benchmarks/gemm_sweep.py --budget-s 180 --out "$R/gemm_sweep.json" > "$R/gemm.log" 2>&1 ;;
    ttftclk) nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
              --format=csv -lms 50 > "$R/clocks.csv" 2>&1 &
           smi=$!
           timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/ttftclk" --sections ttftdiag \
              --kprofile-cases p8192 > "$R/ttftclk.log" 2>&1
           kill $smi
           python3 - "$R/clocks.csv" >> "$R/ttftclk.log" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))[1:]
busy = [r for r in rows if len(r) > 5 and float(r[3].split()[0]) > 300]
if busy:
    sm = sorted(int(r[1].split()[0]) for r in busy)
    print(f"clocks while drawing > 300 W: {len(busy)} samples, SM MHz min {sm[0]} median {sm[len(sm)//2]} max {sm[-1]}")
    print("event reasons seen:", sorted({r[5].strip() for r in busy}))
PY
           ;;
    gapdiag) timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/gapdiag" --sections start,hostprof,kprofile \
              --kprofile-cases b1,b64,b64x4096,b176 > "$R/gapdiag.log" 2>&1 ;;
    splitab) timeout 100 python3 benchmarks/attention_sweep.py --out "$R/merge_sweep.json" --tiles 64 --warps 4 \
              --stages 3 --merge fused,kernel --cases 1:1024:16/64,1:4096:64,8:1024:16,16:1024:9,32:1024:5 \
              > "$R/mergesweep.log" 2>&1
        for mode in new divisor kernelmerge new; do
          case $mode in
            new) flags="" ;; divisor) flags="--skinny-split-rule divisor" ;; kernelmerge) flags="--decode-fused-merge-max-splits 0" ;;
          esac
          timeout 110 python3 benchmarks/engine_benchmarks.py --out "$R/splitab_$mode" --sections start,decode \
            --decode-batches 1,8,16,32 --decode-contexts 1024,4096 --decode-steps 30 $flags >> "$R/splitab.log" 2>&1
          echo "mode $mode done" >> "$R/splitab.log"
        done ;;
    mergeab) for mode in thr12 thr0 thr12; do
          timeout 110 python3 benchmarks/engine_benchmarks.py --out "$R/mergeab_$mode" --sections start,decode \
            --decode-batches 1,8,16,32 --decode-contexts 1024,4096 --decode-steps 30 \
            --decode-fused-merge-max-splits ${mode#thr} >> "$R/mergeab.log" 2>&1
          echo "mode $mode done" >> "$R/mergeab.log"
        done ;;
    gemmsplit) timeout 330 python3 benchmarks/gemm_sweep.py --budget-s 290 --shapes qkv,o_proj,down,gate_up \
              --rows 1,8,16 --block-ns 64 --block-ks 128 --stages 3,4 --splits 1,2,3,4,5,6,7,8,9,10,11,12,14,16 \
              --fused-only --out "$R/gemm_split.json" > "$R/gemmsplit.log" 2>&1 ;;
    gemmdown64) timeout 150 python3 benchmarks/gemm_sweep.py --budget-s 110 --shapes down --rows 64 \
              --block-ns 32,64,128 --block-ks 64,128 --stages 3,4,5 --out "$R/gemm_down64.json" > "$R/gemmdown64.log" 2>&1 ;;
    rows) timeout 200 python3 benchmarks/cublas_rows.py --skinny 64,128,4,3 --out "$R/cublas_rows.json" > "$R/rows.log" 2>&1 ;;
    decgraph) timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/decgraph" --sections start,decode,kprofile \
              --decode-batches 1,64 --decode-contexts 1024,4096 --decode-steps 30 --kprofile-cases b64,b64x4096 \
              > "$R/decgraph.log" 2>&1 ;;
    padcheck) timeout 130 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_gpu_engine.py \
              -k "larger or cuda_graph_matches" > "$R/pytest_gpu.log" 2>&1
         timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/padcheck" --sections start,decode,random256 \
           --decode-batches 1,8,32,64 --decode-contexts 1024,4096 --decode-steps 20 > "$R/padcheck.log" 2>&1 ;;
    padab) timeout 130 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_gpu_engine.py \
              -k "larger or cuda_graph_matches" > "$R/pytest_gpu.log" 2>&1
         for mode in new old new; do
           flags=""; envs=""
           [ $mode = old ] && flags="--cuda-graph-sizes 1,2,4,8,16,24,32,48,64,96,128,160,192,224,256" \
             && envs="KVSERVE_GRAPH_PAD_MIN_GAIN_PCT=0"
           env $envs timeout 130 python3 benchmarks/engine_benchmarks.py --out "$R/pad_$mode" \
             --sections start,random256,decode --decode-batches 1,64,176 --decode-contexts 1024 --decode-steps 20 \
             $flags >> "$R/padab.log" 2>&1
           echo "mode $mode done" >> "$R/padab.log"
         done ;;
    pytestengine) timeout 200 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu/test_gpu_engine.py \
              > "$R/pytest_gpu.log" 2>&1 ;;
    prefillab2) for mode in on off; do
          flags=""; [ $mode = off ] && flags="--prefill-graph-max-tokens 0"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/prefill2_$mode" \
            --sections start,ttft,ttftprefix --ttft-lengths 128,1024 $flags >> "$R/prefillab.log" 2>&1
          echo "mode $mode done" >> "$R/prefillab.log"
        done ;;
    prefillab) for mode in on off on; do
          flags=""; [ $mode = off ] && flags="--prefill-graph-max-tokens 0"
          timeout 110 python3 benchmarks/engine_benchmarks.py --out "$R/prefill_$mode" \
            --sections start,ttft,ttftprefix,ttftrand,decode --ttft-lengths 128,512,1024,2048,8192 \
            --decode-batches 1,64 --decode-contexts 1024 --decode-steps 30 $flags >> "$R/prefillab.log" 2>&1
          echo "mode $mode done" >> "$R/prefillab.log"
        done ;;
    prefillprof) timeout 90 python3 benchmarks/engine_benchmarks.py --out "$R/prefillprof" \
              --sections start,ttftdiag,prefillprof > "$R/prefillprof.log" 2>&1 ;;
    gemm4) timeout 200 python3 benchmarks/gemm_sweep.py --budget-s 160 --shapes gate_up,down --rows 64,32 \
              --block-ns 64,128,256 --block-ks 64,128 --stages 3,4,5,6 --out "$R/gemm_sweep5.json" > "$R/gemm4.log" 2>&1 ;;
    gemm3) timeout 260 python3 benchmarks/gemm_sweep.py --budget-s 220 --shapes gate_up,down,qkv,o_proj --rows 32,64 \
              --block-ns 64,128,256 --block-ks 64,128 --stages 3,4,5,6 --out "$R/gemm_sweep4.json" > "$R/gemm3.log" 2>&1 ;;
    gemm2) timeout 150 python3 benchmarks/gemm_sweep.py --budget-s 80 --shapes qkv,o_proj,down --rows 1,8,16,32 \
              --block-ns 16,32,64 --block-ks 64,128,256 --out "$R/gemm_sweep2.json" > "$R/gemm.log" 2>&1
           timeout 100 python3 benchmarks/gemm_sweep.py --budget-s 25 --shapes gate_up,lm_head --rows 16,32 \
              --out "$R/gemm_sweep3.json" >> "$R/gemm.log" 2>&1 ;;
    skinnyab) for mode in on off on2; do
          flags="--skinny-gemm --sdpa-cudnn-min-tokens 2048"; secs=start,decode,ttft,seeds
          [ $mode = on2 ] && secs=decode,ttft,kprofile
          [ $mode = off ] && flags="--no-skinny-gemm --sdpa-cudnn-min-tokens 0" && secs=start,decode,ttft
          timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/skinny_$mode" --sections $secs \
            --decode-batches 1,8,16,64 --decode-contexts 1024 --decode-steps 30 $flags >> "$R/skinnyab.log" 2>&1
        done ;;
    sharedab) for pps in 2 1 2 1; do
          timeout 80 python3 benchmarks/engine_benchmarks.py --out "$R/shared_pps$pps" --sections start,shared \
            --decode-programs-per-sm $pps >> "$R/sharedab.log" 2>&1
        done ;;
    modload) for mode in EAGER LAZY EAGER LAZY; do
          CUDA_MODULE_LOADING=$mode timeout 80 python3 benchmarks/engine_benchmarks.py --out "$R/modload_$mode" \
            --sections start,shared >> "$R/modload.log" 2>&1
          echo "CUDA_MODULE_LOADING=$mode done" >> "$R/modload.log"
        done ;;
    l2probe) timeout 150 python3 benchmarks/l2_prefetch_probe.py --out "$R/l2probe" > "$R/l2probe.log" 2>&1
        timeout 240 python3 benchmarks/engine_benchmarks.py --out "$R/diag13" --sections start,seeds,trace,kprofile \
          --kprofile-cases b64 --no-pdl > "$R/diag13.log" 2>&1 ;;
    hfdiag3) for mode in "--repeats 3" "--blas cublaslt --repeats 3" "--after-kvserve --repeats 3"; do
          echo "=== hf_probe $mode" >> "$R/hfdiag3.log"
          timeout 120 python3 benchmarks/hf_probe.py --out "$R/hfdiag3" $mode >> "$R/hfdiag3.log" 2>&1
        done ;;
    sdpafix) timeout 200 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_gpu_sdpa_settings.py \
          tests/gpu/test_gpu_ops.py -k "sdpa_settings or prefill_fast_path" > "$R/sdpafix.log" 2>&1
        if [ -f .tmp_old_ops.py ]; then  # the same probe against the code before the fix
          mkdir -p /tmp/oldtree && cp -r kvserve /tmp/oldtree/ && cp .tmp_old_ops.py /tmp/oldtree/kvserve/kernels/ops.py
          echo "=== before the fix" >> "$R/sdpafix.log"
          PYTHONPATH=/tmp/oldtree:$PYTHONPATH timeout 100 python3 -c "
import sys; sys.argv = ['x']
sys.path.insert(0, 'tests/gpu')
import test_gpu_sdpa_settings as t
t.REPO = __import__('pathlib').Path('/tmp/oldtree')
print('alone', t._backend_after('alone')); print('kvserve-first', t._backend_after('kvserve-first'))" >> "$R/sdpafix.log" 2>&1
        fi
        timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/sdpafix_bench" --sections start,seeds,ttft,hf \
          >> "$R/sdpafix.log" 2>&1 ;;
    hfdiag2) for mode in "--repeats 3" "--reserve-gb 60" "--gc-freeze" "expandable"; do
          echo "=== hf_probe $mode" >> "$R/hfdiag2.log"
          if [ "$mode" = expandable ]; then
            PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 100 python3 benchmarks/hf_probe.py \
              --out "$R/hfdiag2" >> "$R/hfdiag2.log" 2>&1
          else
            timeout 100 python3 benchmarks/hf_probe.py --out "$R/hfdiag2" $mode >> "$R/hfdiag2.log" 2>&1
          fi
        done ;;
    hfdiag) for mode in "--profile-steps 8" "--blas cublaslt" "--after-kvserve --profile-steps 8" "--blas cublas"; do
          echo "=== hf_probe $mode" >> "$R/hfdiag.log"
          timeout 100 python3 benchmarks/hf_probe.py --out "$R/hfdiag" $mode >> "$R/hfdiag.log" 2>&1
        done
        echo "=== engine_benchmarks --sections hf (HF alone, as sessions 1-11 ran it)" >> "$R/hfdiag.log"
        timeout 80 python3 benchmarks/engine_benchmarks.py --out "$R/hfdiag_alone" --sections hf >> "$R/hfdiag.log" 2>&1 ;;
    gateup) timeout 150 python3 benchmarks/gate_up_sweep.py --out "$R/gateup_sweep" --rows 256,512,1024,8192 \
              --loaders tma --group-ms 16,32 --tilings "128,128,64,4,8;128,128,64,3,8;64,128,64,4,4" \
              > "$R/gateup.log" 2>&1
        timeout 200 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu/test_gpu_ops.py \
          tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_precompile.py -k "prefill_gate_up or bf16_logprobs or switches or every_triton_variant" \
          > "$R/pytest_gateup.log" 2>&1 ;;
    layout1) timeout 300 python3 benchmarks/attention_sweep.py --out "$R/layout_sweep.json" --tiles 64,128 --warps 4,8 \
          --stages 3,4 --layouts nhd,hnd --block-orders scattered,inorder \
          --cases 64:1024:1,48:1024:1,128:1024:1,176:r:1,64:4096:1,16:1024:9,1:1024:16/64 > "$R/layout1.log" 2>&1
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/kprof15" --sections start,kprofile \
          --kprofile-cases p8192,b64 --no-pdl > "$R/kprof15.log" 2>&1 ;;
    review14) timeout 150 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu/test_gpu_ops.py \
          tests/gpu/test_gpu_engine.py -k "tma_gate_up or bf16_logprobs" > "$R/pytest_review14.log" 2>&1
        timeout 60 python3 benchmarks/gate_up_sweep.py --out "$R/review14_sweep" --rows 2048 --loaders tma \
          --tilings "128,128,64,4,8" --sustained-s 0.5 > "$R/review14.log" 2>&1 ;;
    gatesmall2) timeout 150 python3 benchmarks/gate_up_sweep.py --out "$R/gatesmall2_sweep" --rows 48,64,80,96,112 \
              --loaders tma --group-ms 8 \
              --tilings "64,64,128,4,4;64,64,128,5,4;64,64,128,3,4;64,32,128,6,4;64,128,128,3,8;128,64,128,3,8;128,64,64,4,8;128,32,128,4,4" \
              > "$R/gatesmall2.log" 2>&1 ;;
    tmaab) timeout 200 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu/test_gpu_ops.py \
          tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_precompile.py \
          -k "tma_gate_up or bf16_logprobs or switches or every_triton_variant or graph" > "$R/pytest_tma.log" 2>&1
        for mode in on off on off; do
          flags=""; [ $mode = off ] && flags="--no-decode-gate-up-tma"
          timeout 90 python3 benchmarks/engine_benchmarks.py --out "$R/tmaab_$mode" --sections start,decode,seeds,random256 \
            --decode-batches 40,48,64 --decode-contexts 1024 --decode-steps 30 $flags >> "$R/tmaab.log" 2>&1
          echo "mode $mode done" >> "$R/tmaab.log"
        done ;;
    gatesmall) timeout 240 python3 benchmarks/gate_up_sweep.py --out "$R/gatesmall_sweep" --rows 32,64,128,256 \
              --loaders tma --group-ms 8 \
              --tilings "64,64,128,4,4;64,64,64,6,4;64,32,128,5,4;64,32,256,3,4;64,128,64,4,4;64,64,256,3,4;128,64,64,4,8" \
              > "$R/gatesmall.log" 2>&1 ;;
    gateup2) timeout 200 python3 benchmarks/gate_up_sweep.py --out "$R/gateup2_sweep" --rows 8192,2048 \
              --loaders tma --group-ms 16 --tilings "128,128,64,4,8;128,128,64,3,8" --sustained-s 1.5 \
              > "$R/gateup2.log" 2>&1
        timeout 150 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu/test_gpu_engine.py -k "bf16_logprobs" \
          > "$R/pytest_gateup2.log" 2>&1 ;;
    gateab2) for mode in on off on off; do
          flags=""; [ $mode = off ] && flags="--no-prefill-gate-up-fusion"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/gateab2_$mode" --sections start,ttft \
            $flags >> "$R/gateab2.log" 2>&1
          echo "mode $mode done" >> "$R/gateab2.log"
        done ;;
    gateab) for mode in on off; do
          flags=""; [ $mode = off ] && flags="--no-prefill-gate-up-fusion"
          timeout 140 python3 benchmarks/engine_benchmarks.py --out "$R/gateab_$mode" --sections start,ttft,seeds,random256 \
            $flags >> "$R/gateab.log" 2>&1
          echo "mode $mode done" >> "$R/gateab.log"
        done ;;
    split20) # ran at 642b9ec (session 20 call 2); ops.split_attention and --split-attention were removed after it
        for mode in new old new old; do
          flags=""; [ $mode = old ] && flags="--no-split-attention"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/split20_$mode" --sections start,seeds,random256 \
            $flags >> "$R/split20.log" 2>&1
          echo "mode $mode done" >> "$R/split20.log"
        done
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/tprofh20" --sections tprofile --tprofile-windows 1 \
          --tprofile-steps 20 --tprofile-host > "$R/tprofh20.log" 2>&1 ;;
    pytest22) python3 -c "import inspect, torch; print(torch.__version__); print(inspect.getsource(torch.cuda.graph.__enter__))" \
          > "$R/pytest22.log" 2>&1
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not gguf" >> "$R/pytest22.log" 2>&1 ;;
    offloop24) # tokenization off the API's event loop (ServingContext.off_loop) against inline, new / inline / new /
        # inline on one host: the server at 16 req/s (512 in / 256 out) for 20 s, its /metrics scraped around each
        # run (the server's own TTFT histogram). Needs .carry/tok.
        dir=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w("qwen2.5-7b"))')
        cat > /tmp/serve_inline.py <<'PY'
# kvserve serve with the prompt preparation (tokenization) run inline on the event loop, as before off_loop.
import sys

from kvserve.entrypoints.cli import main
from kvserve.entrypoints.openai.serving_common import ServingContext


async def _inline(self, fn, *args):
    return fn(*args)


if __name__ == "__main__":
    ServingContext.off_loop = _inline
    sys.exit(main())
PY
        for mode in new inline new inline; do
          entry="-m kvserve"; [ $mode = inline ] && entry=/tmp/serve_inline.py
          PYTHONPATH=/tmp/site:$PWD python3 $entry serve "$dir" --load-format dummy --served-model-name qwen2-7b \
            --port 8000 --disable-log-requests --disable-uvicorn-access-log > "$R/offloop24_server_$mode.log" 2>&1 &
          server=$!
          for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
          curl -s http://127.0.0.1:8000/metrics > /tmp/m0.txt
          echo "=== server ($mode) bench 16/s" >> "$R/offloop24.log"
          PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
            --model qwen2-7b --request-rate 16 --duration 20 --warmup 8 --input-len 512 --max-tokens 256 \
            --ignore-eos --tokenizer "$dir" --no-progress --json "$R/offloop24_${mode}.json" >> "$R/offloop24.log" 2>&1
          curl -s http://127.0.0.1:8000/metrics > /tmp/m1.txt
          python3 benchmarks/metrics_delta.py /tmp/m0.txt /tmp/m1.txt | grep -E "time_to_first|queue_time|prefill_time" \
            >> "$R/offloop24.log" 2>&1
          kill -TERM $server; wait $server
        done ;;
    hash25) # a step's prompt blocks hashed after the launch (kv_cache_manager.DEFERRED_BLOCK_CACHING) against inside
        # schedule(), new / old / new / old on one host: TTFT, and ttftdiag's TTFT and GPU span (TTFT - span: host time
        # outside the prefill's GPU span)
        for mode in new old new old; do
          flags=""; [ $mode = old ] && flags="--no-deferred-block-caching"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/hash25_$mode" --sections start,ttft,ttftdiag \
            $flags >> "$R/hash25.log" 2>&1
          echo "mode $mode done" >> "$R/hash25.log"
        done ;;
    capfail25b) # the failed-capture tests after review (capture_end failing too; clean-up guarded, capture_begin
        # covered, the timing graphs of the matmul tuning through capture_graph): each test in a process of its
        # own with the clean-up disabled (the engine's "graphs" case passes either way, and the torch path's outer
        # stream context stays), then tests/gpu (the GGUF test aside)
        tests=()
        for t in lean-fn lean-capture_end torch-fn torch-capture_end; do
          tests+=("tests/gpu/test_gpu_piecewise.py::test_a_failed_capture_leaves_the_allocator_as_before[$t]")
        done
        for t in graphs pieces; do
          tests+=("tests/gpu/test_gpu_engine.py::test_a_failed_capture_falls_back_and_matches_eager[$t]")
        done
        without_capture_cleanup "$R/capfail25b_before.log" "${tests[@]}"
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not gguf" > "$R/pytest25b.log" 2>&1 ;;
    capfail25) # (ran at 55c8380 and cf02e31, whose test ids these are) a failed CUDA-graph capture: the new tests
        # with the clean-up disabled, then tests/gpu (the GGUF test aside) as committed
        without_capture_cleanup "$R/capfail25_before.log" \
          "tests/gpu/test_gpu_piecewise.py::test_a_failed_capture_leaves_the_allocator_as_before[lean]" \
          "tests/gpu/test_gpu_piecewise.py::test_a_failed_capture_leaves_the_allocator_as_before[torch]" \
          "tests/gpu/test_gpu_engine.py::test_a_failed_capture_falls_back_and_matches_eager[graphs]" \
          "tests/gpu/test_gpu_engine.py::test_a_failed_capture_falls_back_and_matches_eager[pieces]"
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not gguf" > "$R/pytest25.log" 2>&1 ;;
    pytest24) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not gguf" > "$R/pytest24.log" 2>&1 ;;
    rowattn24) # the last layer's attention for the sampled rows alone (AttentionMetadata.sampled): tests/gpu (the
        # GGUF test aside), then new / old / new / old on one host (old: --no-sampled-row-attention)
        timeout 220 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not gguf" > "$R/rowattn24_pytest.log" 2>&1
        for mode in new old new old; do
          flags=""; [ $mode = old ] && flags="--no-sampled-row-attention"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/rowattn24_$mode" --sections start,ttft,seeds,random256 \
            $flags >> "$R/rowattn24.log" 2>&1
          echo "mode $mode done" >> "$R/rowattn24.log"
        done ;;
    apipath24) # prepared in session 23, not yet run: where the server's extra TTFT at load goes. The engine alone at
        # 16 req/s; the server at 16 req/s with its /metrics scraped before and after (the server's own TTFT, queue
        # and prefill means: benchmarks/metrics_delta.py); then api_layers (one request at a time, ids and text).
        # Needs .carry/tok.
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/apipath24_engine_16" --sections poisson \
          --poisson-rate 16 --poisson-duration 30 --poisson-rounds 1 >> "$R/apipath24.log" 2>&1
        dir=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w("qwen2.5-7b"))')
        PYTHONPATH=/tmp/site:$PWD python3 -m kvserve serve "$dir" --load-format dummy --served-model-name qwen2-7b \
          --port 8000 --disable-log-requests --disable-uvicorn-access-log > "$R/apipath24_server.log" 2>&1 &
        server=$!
        for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
        PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
          --model qwen2-7b --request-rate 16 --duration 5 --input-len 512 --max-tokens 256 --ignore-eos \
          --tokenizer "$dir" --no-progress > /dev/null 2>&1  # warm-up
        curl -s http://127.0.0.1:8000/metrics > "$R/apipath24_metrics_0.txt"
        PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
          --model qwen2-7b --request-rate 16 --duration 30 --input-len 512 --max-tokens 256 --ignore-eos \
          --tokenizer "$dir" --no-progress --json "$R/apipath24_server_16.json" >> "$R/apipath24.log" 2>&1
        curl -s http://127.0.0.1:8000/metrics > "$R/apipath24_metrics_1.txt"
        echo "=== the server's own histograms over the 16 req/s run" >> "$R/apipath24.log"
        python3 benchmarks/metrics_delta.py "$R/apipath24_metrics_0.txt" "$R/apipath24_metrics_1.txt" >> "$R/apipath24.log" 2>&1
        kill -TERM $server; wait $server
        PYTHONPATH=/tmp/site:$PWD timeout 300 python3 benchmarks/api_layers.py --model qwen2.5-7b --prompt-len 1024 \
          --out "$R/apipath24_layers" >> "$R/apipath24.log" 2>&1 ;;
    layers23) # what each layer (engine core in process, AsyncLLM, HTTP with ids, HTTP with text) adds to TTFT at 1k
        PYTHONPATH=/tmp/site:$PWD timeout 400 python3 benchmarks/api_layers.py --model qwen2.5-7b --prompt-len 1024 \
          --out "$R/layers23" > "$R/layers23.log" 2>&1 ;;
    apipath23b) # the server's Nagle fix (TCP_NODELAY on accepted connections) A/B on one host: the server as
        # committed, then with its listening socket made the old way (proto 0: asyncio leaves Nagle on), each
        # at 16 and 2 requests/s; and the engine alone at 16/s. Needs .carry/tok.
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/apipath23b_engine_16" --sections poisson \
          --poisson-rate 16 --poisson-duration 30 --poisson-rounds 1 >> "$R/apipath23b.log" 2>&1
        dir=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w("qwen2.5-7b"))')
        cat > /tmp/serve_nagle.py <<'PY'
# kvserve serve with its listening socket made as before 92c7241's fix (proto 0: asyncio leaves Nagle on).
import socket
import sys

import kvserve.entrypoints.openai.api_server as api
from kvserve.entrypoints.cli import main


class _Socket:
    def __getattr__(self, name):
        return getattr(socket, name)

    @staticmethod
    def socket(family, kind, proto=0):
        return socket.socket(family, kind)


if __name__ == "__main__":
    api.socket = _Socket()
    sys.exit(main())
PY
        for mode in nodelay nagle; do
          entry="-m kvserve"; [ $mode = nagle ] && entry=/tmp/serve_nagle.py
          PYTHONPATH=/tmp/site:$PWD python3 $entry serve "$dir" --load-format dummy --served-model-name qwen2-7b \
            --port 8000 --disable-log-requests --disable-uvicorn-access-log > "$R/apipath23b_server_$mode.log" 2>&1 &
          server=$!
          for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
          for rate in 16 2; do
            dur=30; [ $rate = 2 ] && dur=20
            echo "=== server ($mode) bench $rate/s" >> "$R/apipath23b.log"
            PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
              --model qwen2-7b --request-rate $rate --duration $dur --warmup 8 --input-len 512 --max-tokens 256 \
              --ignore-eos --tokenizer "$dir" --no-progress --json "$R/apipath23b_server_${mode}_$rate.json" \
              >> "$R/apipath23b.log" 2>&1
          done
          echo "=== server ($mode) bench one client, requests one after another" >> "$R/apipath23b.log"
          PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
            --model qwen2-7b --concurrency 1 --num-prompts 20 --warmup 2 --input-len 1024 --max-tokens 64 \
            --ignore-eos --tokenizer "$dir" --no-progress --json "$R/apipath23b_server_${mode}_seq.json" \
            >> "$R/apipath23b.log" 2>&1
          kill -TERM $server; wait $server
        done ;;
    apipath23) # ran in session 23 (call 2, ca22383): the apipath comparison at 16 and at 2 requests/s (2/s: per-request cost without queueing), after
        # the server streams every token and the bench times token chunks (8daceff). Needs .carry/tok.
        for rate in 16 2; do
          dur=30; [ $rate = 2 ] && dur=20
          timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/apipath23_engine_$rate" --sections poisson \
            --poisson-rate $rate --poisson-duration $dur --poisson-rounds 1 >> "$R/apipath23.log" 2>&1
        done
        dir=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w("qwen2.5-7b"))')
        PYTHONPATH=/tmp/site:$PWD python3 -m kvserve serve "$dir" --load-format dummy --served-model-name qwen2-7b \
          --port 8000 --disable-log-requests --disable-uvicorn-access-log > "$R/apipath23_server.log" 2>&1 &
        server=$!
        for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
        for rate in 16 2; do
          dur=30; [ $rate = 2 ] && dur=20
          PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
            --model qwen2-7b --request-rate $rate --duration $dur --warmup 8 --input-len 512 --max-tokens 256 \
            --ignore-eos --tokenizer "$dir" --no-progress --json "$R/apipath23_server_$rate.json" >> "$R/apipath23.log" 2>&1
          echo "=== server bench $rate/s rc=$?" >> "$R/apipath23.log"
        done
        kill -TERM $server; wait $server ;;
    apipath) # ran in session 23 (call 1, 5aadfc9): the same Poisson load (16/s, 512 in / 256 out) on the engine
        # alone (poisson section) and through `kvserve serve` + `kvserve bench`, one host: what the HTTP/API path adds
        # to TTFT and TPOT. Needs .carry/tok.
        timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/apipath_engine" --sections poisson \
          --poisson-rate 16 --poisson-duration 30 --poisson-rounds 1 > "$R/apipath.log" 2>&1
        dir=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w("qwen2.5-7b"))')
        PYTHONPATH=/tmp/site:$PWD python3 -m kvserve serve "$dir" --load-format dummy --served-model-name qwen2-7b \
          --port 8000 --disable-log-requests --disable-uvicorn-access-log > "$R/apipath_server.log" 2>&1 &
        server=$!
        for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
        PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
          --model qwen2-7b --request-rate 16 --duration 30 --warmup 16 --input-len 512 --max-tokens 256 --ignore-eos \
          --tokenizer "$dir" --no-progress --json "$R/apipath_server.json" >> "$R/apipath.log" 2>&1
        echo "=== server bench rc=$?" >> "$R/apipath.log"
        kill -TERM $server; wait $server ;;
    poisson22) timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/poisson22" --sections poisson \
          --poisson-rate 16 --poisson-duration 20 --poisson-rounds 2 > "$R/poisson22.log" 2>&1 ;;
    mixed22) timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/mixed22" --sections mixed \
          --mixed-cases 20x1024x512,24x512x512 --mixed-cycles 8 > "$R/mixed22.log" 2>&1 ;;
    rowq26) # the last layer's q projected for the sampled rows alone (steps of 512+ tokens; at 810770d, removed after
        # this step): tests/gpu (the GGUF test aside), then start, TTFT and ttftdiag with it on / off
        # (--no-last-layer-row-q, gone with it), new / old / new / old
        timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not gguf" > "$R/pytest26.log" 2>&1
        for mode in new old new old; do
          flags=""; [ $mode = old ] && flags="--no-last-layer-row-q"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/rowq26_$mode" --sections start,ttft,ttftdiag \
            $flags >> "$R/rowq26.log" 2>&1
          echo "mode $mode done" >> "$R/rowq26.log"
        done ;;
    firstpass28) # the seeds' prompts (50 x 512, 4 out) three times on a fresh engine: step times, cudaMalloc calls and
        # late Triton variants per pass; then again in a second fresh engine with every pass under torch.profiler.
        for prof in "" "--firstpass-profile"; do
          timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/firstpass28${prof:+_prof}" --sections firstpass \
            $prof >> "$R/firstpass28.log" 2>&1
          echo "firstpass28 ${prof:-plain} rc=$?" >> "$R/firstpass28.log"
        done
        cp "$R/firstpass28.log" "$OUT/" ;;
    firstpass28e) # firstpass28's plain run under CUDA_MODULE_LOADING=EAGER and then lazy (the default), each a fresh
        # engine: does pass 1's host wait inside aten::mm (333 ms against 5-7 in later passes) go with eager module
        # loading? Also each engine's start time (engine_start.json).
        for mode in EAGER LAZY; do firstpass_engine firstpass28e $mode CUDA_MODULE_LOADING=$mode; done
        grep -E "firstpass pass|firstpass28e" "$R/firstpass28e_full.log" >> "$R/firstpass28e.log"
        cp "$R/firstpass28e.log" "$OUT/" ;;
    ncuattn36) # Nsight Compute on the bf16 decode attention at batch 64 x 1k (the engine's one-split tiling: 64 keys a
        # tile, 4 warps, 4 stages), the first launches of attention_sweep.py's check and graph.
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        timeout 200 "$NCU" --clock-control none -k regex:_paged_attention_kernel --launch-count 2 \
          --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
          --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 benchmarks/attention_sweep.py --out "$R/ncuattn36.json" --cases 64:1024:1 --tiles 64 --warps 4 \
          --stages 4 > "$R/ncuattn36.log" 2>&1
        echo "ncu rc=$?" >> "$R/ncuattn36.log"
        cp "$R/ncuattn36.log" "$OUT/"
        grep -a -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per|SM Active|Elapsed Cyc|Issue Slots|ncu rc|rror" \
          "$R/ncuattn36.log" | head -40 ;;
    s63) # Session 63 (about 450 s on any GPU): mixture-of-experts models. The MoE kernel's and the MoE model's GPU
        # tests with session 62's --max-model-len auto GPU test; the kernel's timings at Qwen3-30B-A3B's shape; the
        # engine at that shape (random bf16 weights, 61 GB): start, decode at batch 1/8/64, the seeds' workload, the
        # 256 sequences.
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_moe_model.py \
          "tests/gpu/test_gpu_engine.py::test_max_model_len_auto_is_an_engine_started_with_the_length_the_cache_holds" \
          > "$R/gpu63.log" 2>&1
        echo "pytest rc=$?" >> "$R/gpu63.log"; cp "$R/gpu63.log" "$OUT/"
        timeout 60 python3 benchmarks/moe_kernel_bench.py --out "$R/moe63" > "$R/moe63.log" 2>&1
        echo "moe_kernel_bench rc=$?" >> "$R/moe63.log"; cp "$R/moe63.log" "$OUT/"
        timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/s63_moe" --model qwen3-30b-a3b \
          --sections start,decode,seeds,random256 --decode-batches 1,8,64 --decode-contexts 1024 > "$R/s63_moe.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/s63_moe.log"; cp "$R/s63_moe.log" "$OUT/"
        grep -a -E "^FAILED|^ERROR|^SKIPPED|passed|failed|rc=" "$R/gpu63.log" | tail -20 | cut -c1-220
        tail -14 "$R/moe63.log" | cut -c1-150
        grep -a -E "^engine start|^KV cache|^decode b|^seeds|^256|rc=|Error" "$R/s63_moe.log" | cut -c1-150 ;;
    s57) # Session 57 (about 110 s on an H200, then about 330 s on any GPU): s54b's targets' sections (H200 only), then
        # the GPU tests (tests/gpu and the KV-cache sizing test) at this commit: the first GPU run since a loaded
        # model's parameters dropped their loader methods (release_load_hooks, session 56).
        if grep -q H200 "$R/nvidia_smi.txt"; then
          timeout 240 python3 benchmarks/engine_benchmarks.py --out "$R/s57_bf16" \
            --sections start,decode,seeds,random256,ttft,prefix --decode-batches 1,8,64 --decode-contexts 1024 \
            > "$R/s57_bf16.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s57_bf16.log"; cp "$R/s57_bf16.log" "$OUT/"
        else echo "not an H200: $(sed -n 2p "$R/nvidia_smi.txt"); the targets' sections skipped"; fi
        timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu tests/worker/test_kv_cache_memory_gpu.py \
          > "$R/gpu57.log" 2>&1
        echo "pytest rc=$?" >> "$R/gpu57.log"; cp "$R/gpu57.log" "$OUT/"
        [ -f "$R/s57_bf16.log" ] && grep -a -E "^engine start|^decode b|^seeds|^256|^TTFT|^prefix|rc=|Error" \
          "$R/s57_bf16.log" | cut -c1-150
        grep -a -E "^FAILED|^ERROR|^SKIPPED|passed|failed|rc=" "$R/gpu57.log" | tail -20 | cut -c1-220 ;;
    s54b) # Session 54 (about 110 s, only on an H200: on another GPU it stops at once): the targets' sections with
        # bf16 weights at this commit (start, decode at batch 1/8/64, the seeds' workload, the 256 sequences, TTFT,
        # prefix caching).
        if ! grep -q H200 "$R/nvidia_smi.txt"; then echo "not an H200: $(sed -n 2p "$R/nvidia_smi.txt")"; else
          timeout 240 python3 benchmarks/engine_benchmarks.py --out "$R/s54b_bf16" \
            --sections start,decode,seeds,random256,ttft,prefix --decode-batches 1,8,64 --decode-contexts 1024 \
            > "$R/s54b_bf16.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s54b_bf16.log"; cp "$R/s54b_bf16.log" "$OUT/"
          grep -a -E "^engine start|^decode b|^seeds|^256|^TTFT|^prefix|rc=|Error" "$R/s54b_bf16.log" | cut -c1-150
        fi ;;
    s54a) # Session 54 (about 500 s): s53d's fp8 GPU tests (the bf16-converting fp8 launches without PDL, the
        # shipped default, first GPU run; block-wise fp8 checkpoints; checkpoint KV scales through cuDNN's
        # one-prompt prefill), then the targets' sections with bf16 weights (start, decode at batch
        # 1/8/32/64, the seeds' workload, the 256 sequences, TTFT, prefix caching), fp8 weights' decode at
        # batch 1/16/17/32, and bf16 decode without PDL (KVSERVE_PDL=0) at batch 1/32/64.
        timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_gemm.py -k fp8 > "$R/pytest_s54a.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s54a.log"
        timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_kv_cache.py -k cudnn \
          >> "$R/pytest_s54a.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s54a.log"; cp "$R/pytest_s54a.log" "$OUT/"
        grep -a -E "^FAILED|^E  |passed|failed|rc=" "$R/pytest_s54a.log" | head -14 | cut -c1-200
        timeout 240 python3 benchmarks/engine_benchmarks.py --out "$R/s54a_bf16" \
          --sections start,decode,seeds,random256,ttft,prefix --decode-batches 1,8,32,64 --decode-contexts 1024 \
          > "$R/s54a_bf16.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/s54a_bf16.log"; cp "$R/s54a_bf16.log" "$OUT/"
        echo "--- bf16 targets"
        grep -a -E "^engine start|^decode b|^seeds|^256|^TTFT|^prefix|rc=|Error" "$R/s54a_bf16.log" | cut -c1-150
        timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/s54a_fp8" --quantization fp8 --sections decode \
          --decode-batches 1,16,17,32 --decode-contexts 1024 > "$R/s54a_fp8.log" 2>&1
        echo "--- fp8 shipped rc=$?"; grep -a "^decode b" "$R/s54a_fp8.log" | cut -c1-70
        KVSERVE_PDL=0 timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/s54a_bf16_pdl0" \
          --sections decode --decode-batches 1,32,64 --decode-contexts 1024 > "$R/s54a_bf16_pdl0.log" 2>&1
        echo "--- bf16, KVSERVE_PDL=0 rc=$?"; grep -a "^decode b" "$R/s54a_bf16_pdl0.log" | cut -c1-70 ;;
    s53d) # Session 53 (about 250 s; not run: the session's device time ran out in refused starts): the shipped default (the bf16-converting fp8 launches without PDL): the fp8 GPU
        # tests (no Triton variant compiled after start), fp8 decode at 1k, b1/16/17/32; then bf16 weights with PDL
        # on and off (KVSERVE_PDL=0), b1/32/64: does the bf16 skinny matmul lose to PDL as the converting one did?
        timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_gemm.py -k fp8 > "$R/pytest_s53d.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s53d.log"; cp "$R/pytest_s53d.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s53d.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s53d.log"
        timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/s53d_fp8" --quantization fp8 --sections decode \
          --decode-batches 1,16,17,32 --decode-contexts 1024 > "$R/s53d_fp8.log" 2>&1
        echo "--- fp8 shipped rc=$?"; grep -a "^decode b" "$R/s53d_fp8.log" | cut -c1-70
        for pdl in 1 0; do
          KVSERVE_PDL=$pdl timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/s53d_bf16_pdl$pdl" \
            --sections decode --decode-batches 1,32,64 --decode-contexts 1024 > "$R/s53d_bf16_pdl$pdl.log" 2>&1
          echo "--- bf16, KVSERVE_PDL=$pdl rc=$?"; grep -a "^decode b" "$R/s53d_bf16_pdl$pdl.log" | cut -c1-70
        done ;;
    s53c) # Session 53 (about 330 s): fp8 weights, the skinny matmul that converts the weight to bf16 launched with
        # PDL (KVSERVE_FP8_CONVERT_PDL=1, as before) or without (0): decode at 1k, batch 1/16/17/32 as shipped
        # (the fp16 dot up to 16 rows), then batch 1/16 with the fp16 dot off (every fp8 launch converts).
        i=0
        for run in 1_1 1_0 1_1 1_0 0_1 0_0; do
          i=$((i + 1)); dot=${run%_*}; conv=${run#*_}; b=1,16,17,32; [ $dot = 0 ] && b=1,16
          KVSERVE_FP8_FP16_DOT=$dot KVSERVE_FP8_CONVERT_PDL=$conv timeout 75 python3 benchmarks/engine_benchmarks.py \
            --out "$R/s53c_${i}_$run" --quantization fp8 --sections decode --decode-batches $b --decode-contexts 1024 \
            > "$R/s53c_${i}_$run.log" 2>&1
          echo "--- $i: fp16 dot $dot, convert PDL $conv rc=$?"; grep -a "^decode b" "$R/s53c_${i}_$run.log" | cut -c1-70
        done ;;
    pdl53) # Session 53 (ran inline at 7de251d, 78 s on a warm H100; the same loop): fp8-weight decode at batch 1 and
        # 16, context 1k, with PDL on (the default) and off, each with KVSERVE_FP8_FP16_DOT=1 (shipped) and 0.
        for pdl in on off; do for dot in 1 0; do
          f=""; [ $pdl = off ] && f="--no-pdl"
          KVSERVE_FP8_FP16_DOT=$dot timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/pdl53_${pdl}_$dot" \
            --quantization fp8 $f --sections decode --decode-batches 1,16 --decode-contexts 1024 \
            > "$R/dec_${pdl}_$dot.log" 2>&1
          echo "--- pdl $pdl dot $dot rc=$?"; grep -a "^decode b" "$R/dec_${pdl}_$dot.log" | cut -c1-70
        done; done ;;
    s53b) # Session 53 (about 400 s): checkpoint KV-cache scales and fp8 checkpoints on a GPU (the fp8 KV-cache GPU
        # tests with the new checkpoint-scale test, the fp8 KV-cache kernels, the fp8-checkpoint test), then the
        # batch-1 kernel profile with fp8 weights each way (KVSERVE_FP8_FP16_DOT=1 shipped, =0), without PDL.
        timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_kv_cache.py \
          tests/kernels/test_fp8_kv_cache_kernels.py "tests/gpu/test_gpu_fp8_weights.py::test_an_fp8_checkpoint_gives_what_quantizing_at_load_gives" \
          > "$R/pytest_s53b.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s53b.log"; cp "$R/pytest_s53b.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s53b.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s53b.log"
        for dot in 1 0; do
          KVSERVE_FP8_FP16_DOT=$dot timeout 80 python3 benchmarks/engine_benchmarks.py --out "$R/s53b_kprof$dot" \
            --quantization fp8 --no-pdl --sections kprofile --kprofile-cases b1 > "$R/s53b_kprof$dot.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s53b_kprof$dot.log"
          echo "--- kernel profile b1, KVSERVE_FP8_FP16_DOT=$dot"
          grep -a -A16 "^kernel profile b1" "$R/s53b_kprof$dot.log" | cut -c1-130; grep -a "rc=\|Error" "$R/s53b_kprof$dot.log" | tail -2
        done ;;
    s53a) # Session 53 (about 360 s): fp8 weights on an H200 with the shipped rule (the fp16 dot up to 16 rows a
        # program): the fp8 GPU tests; the engine's decode steps at batch 1, 16, 17, 32 and 64 with bf16 weights,
        # fp8 weights (shipped) and fp8 weights without the fp16 dot (KVSERVE_FP8_FP16_DOT=0); then a kernel profile
        # of batch 1 each way (without PDL: no waits inside the kernels).
        timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_gemm.py -k fp8 > "$R/pytest_s53a.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s53a.log"; cp "$R/pytest_s53a.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s53a.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s53a.log"
        for mode in bf16 dot1 dot0; do
          flags="--quantization fp8"; dot=${mode#dot}; [ $mode = bf16 ] && flags="" && dot=1
          KVSERVE_FP8_FP16_DOT=$dot timeout 90 python3 benchmarks/engine_benchmarks.py --out "$R/s53a_$mode" $flags \
            --sections decode --decode-batches 1,16,17,32,64 --decode-contexts 1024 > "$R/s53a_$mode.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s53a_$mode.log"
          echo "--- engine $mode"; grep -a -E "^decode b|rc=|Error" "$R/s53a_$mode.log" | cut -c1-150
        done
        for dot in 1 0; do
          KVSERVE_FP8_FP16_DOT=$dot timeout 80 python3 benchmarks/engine_benchmarks.py --out "$R/s53a_kprof$dot" \
            --quantization fp8 --no-pdl --sections kprofile --kprofile-cases b1 > "$R/s53a_kprof$dot.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s53a_kprof$dot.log"
          echo "--- kernel profile b1, KVSERVE_FP8_FP16_DOT=$dot"
          grep -a -A14 "^kernel profile b1" "$R/s53a_kprof$dot.log" | cut -c1-130
        done ;;
    s52d) # Session 52 (about 160 s): the shipped rule (the fp16 dot up to 16 rows a program): the fp8 GPU tests,
        # then the engine's decode steps with fp8 weights at batch 1, 16, 17 and 32.
        timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_gemm.py -k fp8 > "$R/pytest_s52d.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s52d.log"; cp "$R/pytest_s52d.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s52d.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s52d.log"
        timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/s52d" --quantization fp8 --sections decode \
          --decode-batches 1,16,17,32 --decode-contexts 1024 > "$R/s52d.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/s52d.log"
        echo "--- engine fp8"; grep -a -E "^decode b|rc=|Error" "$R/s52d.log" | cut -c1-150 ;;
    s52c) # Session 52 (about 200 s; s52b shortened when most of the device time had gone to refused starts): the
        # fp8 GPU tests with the shipped fp16 dot, then the engine's decode steps with fp8 weights, the dot in
        # bf16 (KVSERVE_FP8_FP16_DOT=0) and in fp16 (=1).
        timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_gemm.py -k fp8 > "$R/pytest_s52c.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s52c.log"; cp "$R/pytest_s52c.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s52c.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s52c.log"
        for dot in 0 1; do
          KVSERVE_FP8_FP16_DOT=$dot timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/s52c_dot$dot" \
            --quantization fp8 --sections decode --decode-batches 1,8,32 --decode-contexts 1024 \
            > "$R/s52c_dot$dot.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s52c_dot$dot.log"
          echo "--- engine fp8, KVSERVE_FP8_FP16_DOT=$dot"; grep -a -E "^decode b|rc=|Error" "$R/s52c_dot$dot.log" | cut -c1-150
        done ;;
    s52b) # Session 52 (about 420 s; not run: the device time went to refused starts, s52c ran instead): the fp16 dot for fp8 weights as shipped (per K tile, KVSERVE_FP8_FP16_DOT=1)
        # against the bf16 widening (=0): the fp8 GPU tests, then the engine's decode steps (bf16 weights once,
        # then fp8 weights 0 / 1 twice, alternating), and a kernel profile of batch 1 each way.
        timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_gemm.py -k fp8 > "$R/pytest_s52b.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s52b.log"; cp "$R/pytest_s52b.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s52b.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s52b.log"
        i=0
        for mode in bf16 dot0 dot1 dot0 dot1; do
          i=$((i + 1)); flags="--quantization fp8"; dot=${mode#dot}; [ $mode = bf16 ] && flags="" && dot=1
          KVSERVE_FP8_FP16_DOT=$dot timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/s52b_${i}_$mode" \
            $flags --sections decode --decode-batches 1,8,32 --decode-contexts 1024 > "$R/s52b_${i}_$mode.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s52b_${i}_$mode.log"
          echo "--- engine $i $mode"; grep -a -E "^decode b|rc=|Error" "$R/s52b_${i}_$mode.log" | cut -c1-150
        done
        for dot in 0 1; do  # where the step's time goes: kernel times at batch 1 without PDL (no waits inside)
          KVSERVE_FP8_FP16_DOT=$dot timeout 80 python3 benchmarks/engine_benchmarks.py --out "$R/s52b_kprof$dot" \
            --quantization fp8 --no-pdl --sections kprofile --kprofile-cases b1 > "$R/s52b_kprof$dot.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s52b_kprof$dot.log"
          echo "--- kernel profile b1, KVSERVE_FP8_FP16_DOT=$dot"
          grep -a -A12 "^kernel profile b1" "$R/s52b_kprof$dot.log" | cut -c1-130
        done ;;
    s52a) # Session 52 (ran at 0802ea8, 363 s on an H100; KVSERVE_FP8_WIDEN is gone since: 2 became the default
        # way, KVSERVE_FP8_FP16_DOT=1, and 1 was dropped): the fp8 weight widened to fp16 with activations scaled by
        # powers of two (KVSERVE_FP8_WIDEN 1: a row's over the program's K chunk; 2: each K tile's; 0: widened to
        # bf16, as before). The K loop alone (fp8_convert_probe), the launcher at the 7B shapes (fp8_matmul_bench), the
        # engine's decode steps (bf16 weights, then fp8 weights each way), then the fp8 GPU tests (default way).
        timeout 170 python3 benchmarks/fp8_convert_probe.py --out "$R/s52a_probe" --rows 1,8,32 --outlier \
          --modes bf16,cvt_bf16,cvt_fp16,fp16_row,fp16_tile --budget-s 120 > "$R/s52a_probe.log" 2>&1
        echo "fp8_convert_probe rc=$?" >> "$R/s52a_probe.log"; cp "$R/s52a_probe.log" "$OUT/"
        tail -62 "$R/s52a_probe.log" | cut -c1-150
        for widen in 0 1 2; do
          KVSERVE_FP8_WIDEN=$widen timeout 60 python3 benchmarks/fp8_matmul_bench.py --out "$R/s52a_mm$widen" \
            --rows 1,8,32 > "$R/s52a_mm$widen.log" 2>&1
          echo "fp8_matmul_bench rc=$?" >> "$R/s52a_mm$widen.log"
          echo "--- fp8_matmul_bench, KVSERVE_FP8_WIDEN=$widen"; tail -16 "$R/s52a_mm$widen.log" | cut -c1-150
        done
        for mode in bf16 w0 w1 w2; do
          flags="--quantization fp8"; widen=${mode#w}; [ $mode = bf16 ] && flags="" && widen=1
          KVSERVE_FP8_WIDEN=$widen timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/s52a_$mode" $flags \
            --sections decode --decode-batches 1,8,32 --decode-contexts 1024 > "$R/s52a_$mode.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s52a_$mode.log"
          echo "--- engine $mode"; grep -a -E "^decode b|rc=|Error" "$R/s52a_$mode.log" | cut -c1-150
        done
        timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_gemm.py -k fp8 > "$R/pytest_s52a.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s52a.log"; cp "$R/pytest_s52a.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s52a.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s52a.log" ;;
    s51b) # Session 51 (about 150 s): the GPU test files whose engine loops now use tests/helpers/engine_runs.py
        # (fp8 weights, fp8 KV cache, AWQ / GPTQ): the same assertions, invariant checks every step.
        timeout 280 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/gpu/test_gpu_fp8_kv_cache.py tests/gpu/test_gpu_quantized.py -k "not matches_the_reference and not \
          stores_the_references_bytes and not stores_torchs_bytes and not attention_over" > "$R/pytest_s51b.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s51b.log"; cp "$R/pytest_s51b.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s51b.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s51b.log" ;;
    s51a) # Session 51 (about 80 s): where the weight-only fp8 skinny matmul loses to its bytes: the widening to
        # bf16 (Triton's conversion, a hardware fp16 conversion, integer bit moves) or the stream; fp8 x fp8 dot too.
        timeout 230 python3 benchmarks/fp8_convert_probe.py --out "$R/s51a" --rows 1,32 --budget-s 150 \
          > "$R/s51a.log" 2>&1
        echo "fp8_convert_probe rc=$?" >> "$R/s51a.log"; cp "$R/s51a.log" "$OUT/"; tail -50 "$R/s51a.log" | cut -c1-150 ;;
    s50e) # Session 50 (about 120 s): after the review's fixes (graph padding keeps fp8 batches on their side of
        # FP8_SKINNY_MAX_ROWS, the _scaled_mm probe for bf16): the fp8 weights' engine GPU tests, the kernel tests,
        # and the bf16 engine's padding test.
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_fp8.py tests/gpu/test_gpu_engine.py -k "not test_gpu_engine or padding" \
          > "$R/pytest_s50e.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s50e.log"; cp "$R/pytest_s50e.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s50e.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s50e.log" ;;
    s50d) # Session 50 (about 450 s): fp8 weights with bf16's skinny tiling (s50c's sweep): the GPU tests (fp8
        # weights, the skinny matmul's and the quantization kernel's compiled), the matmul benchmark at decode
        # rows, then the engine with bf16 and with fp8 weights.
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_fp8.py tests/kernels/test_triton_gemm.py > "$R/pytest_s50d.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s50d.log"; cp "$R/pytest_s50d.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s50d.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s50d.log"
        timeout 70 python3 benchmarks/fp8_matmul_bench.py --out "$R/s50d_mm" --rows 1,8,32,64 --skinny-max-rows 64 \
          > "$R/s50d_mm.log" 2>&1
        echo "fp8_matmul_bench rc=$?" >> "$R/s50d_mm.log"; cp "$R/s50d_mm.log" "$OUT/"; tail -18 "$R/s50d_mm.log" | cut -c1-170
        for q in none fp8; do
          flags=""; [ $q = fp8 ] && flags="--quantization fp8"
          timeout 140 python3 benchmarks/engine_benchmarks.py --out "$R/s50d_$q" $flags \
            --sections start,decode,seeds,random256 --decode-batches 1,64 > "$R/s50d_$q.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s50d_$q.log"; cp "$R/s50d_$q.log" "$OUT/"
          echo "--- weights $q"
          grep -a -E "^engine start|^KV cache|^decode b|^seeds|^256 seqs|late|rc=|Error" "$R/s50d_$q.log" | cut -c1-150
        done ;;
    s50c) # Session 50 (about 480 s): the skinny matmul's tilings for fp8 weights (s50b: its 256-key default
        # streamed q/k/v and o at 1.0 TB/s where bf16 reaches 2.1-2.3), swept at 1, 8, 32 and 64 rows; then the
        # quantization kernel's two-pass rows (ONE_TILE_MAX_COLS 8,192) compiled, tested and timed at 4,096 rows.
        timeout 420 python3 benchmarks/gemm_sweep.py --weight-dtype fp8 --out "$R/s50c_sweep.json" \
          --shapes qkv,o_proj,gate_up,down --rows 1,8,32,64 --block-ns 64,128 --block-ks 128,256 --stages 3,4 \
          --splits 1,2,3,4,5,7,14 --fused-only --budget-s 330 > "$R/s50c_sweep.log" 2>&1
        echo "gemm_sweep rc=$?" >> "$R/s50c_sweep.log"; cp "$R/s50c_sweep.log" "$OUT/"; tail -60 "$R/s50c_sweep.log" | cut -c1-160
        timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_fp8.py \
          tests/gpu/test_gpu_fp8_weights.py -k "quantize" > "$R/pytest_s50c.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s50c.log"; cp "$R/pytest_s50c.log" "$OUT/"; tail -2 "$R/pytest_s50c.log"
        timeout 60 python3 benchmarks/fp8_matmul_bench.py --out "$R/s50c_mm" --rows 4096 --shapes down,qkv \
          > "$R/s50c_mm.log" 2>&1
        echo "fp8_matmul_bench rc=$?" >> "$R/s50c_mm.log"; cp "$R/s50c_mm.log" "$OUT/"; tail -5 "$R/s50c_mm.log" | cut -c1-170 ;;
    s50b) # Session 50 (about 500 s): fp8 weights in the skinny matmul (weight-only fp8 up to FP8_SKINNY_MAX_ROWS
        # rows): the GPU tests and the kernel tests compiled, the matmul benchmark with the skinny column to 256
        # rows, the quantization kernel's tilings, then the engine with fp8 weights (bf16 rerun beside it).
        timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_fp8.py tests/kernels/test_triton_gemm.py > "$R/pytest_s50b.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s50b.log"; cp "$R/pytest_s50b.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s50b.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s50b.log"
        timeout 100 python3 benchmarks/fp8_matmul_bench.py --out "$R/s50b_mm" --rows 1,8,16,32,64,128,256,4096 \
          > "$R/s50b_mm.log" 2>&1
        echo "fp8_matmul_bench rc=$?" >> "$R/s50b_mm.log"; cp "$R/s50b_mm.log" "$OUT/"; tail -36 "$R/s50b_mm.log" | cut -c1-170
        timeout 60 python3 benchmarks/fp8_quant_rows_probe.py --out "$R/s50b_q" > "$R/s50b_q.log" 2>&1
        echo "fp8_quant_rows_probe rc=$?" >> "$R/s50b_q.log"; cp "$R/s50b_q.log" "$OUT/"; tail -28 "$R/s50b_q.log"
        for q in none fp8; do
          flags=""; [ $q = fp8 ] && flags="--quantization fp8"
          timeout 140 python3 benchmarks/engine_benchmarks.py --out "$R/s50b_$q" $flags \
            --sections start,decode,seeds,random256 --decode-batches 1,64 > "$R/s50b_$q.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s50b_$q.log"; cp "$R/s50b_$q.log" "$OUT/"
          echo "--- weights $q"
          grep -a -E "^KV cache|^decode b|^seeds|^256 seqs|late|rc=|Error" "$R/s50b_$q.log" | cut -c1-150
        done ;;
    s50a) # Session 50 (about 450 s): --quantization fp8 (online fp8 weights), first GPU run: its GPU and kernel
        # tests, the matmul benchmark (bf16 ops.linear against the fp8 path at the 7B shapes), then the engine
        # with bf16 weights and with fp8 weights, one engine each, same call.
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_weights.py \
          tests/kernels/test_triton_fp8.py > "$R/pytest_s50a.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s50a.log"; cp "$R/pytest_s50a.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s50a.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s50a.log"
        timeout 100 python3 benchmarks/fp8_matmul_bench.py --out "$R/s50a_mm" > "$R/s50a_mm.log" 2>&1
        echo "fp8_matmul_bench rc=$?" >> "$R/s50a_mm.log"; cp "$R/s50a_mm.log" "$OUT/"; tail -40 "$R/s50a_mm.log" | cut -c1-140
        for q in none fp8; do
          flags=""; [ $q = fp8 ] && flags="--quantization fp8"
          timeout 140 python3 benchmarks/engine_benchmarks.py --out "$R/s50a_$q" $flags \
            --sections start,decode,seeds,random256 --decode-batches 1,64 > "$R/s50a_$q.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s50a_$q.log"; cp "$R/s50a_$q.log" "$OUT/"
          echo "--- weights $q"
          grep -a -E "^KV cache|^decode b|^seeds|^256 seqs|fp8 weights|rc=|Error" "$R/s50a_$q.log" | cut -c1-150
        done ;;
    s49c) # Session 49 (about 90 s; run as `s49c s49b`): after the fp8 one-split tiling (128-key tiles), the fp8 GPU
        # tests and the fp8 kernel tests compiled on the GPU.
        timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_kv_cache.py \
          tests/kernels/test_fp8_kv_cache_kernels.py > "$R/pytest_s49c.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s49c.log"; cp "$R/pytest_s49c.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s49c.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s49c.log" ;;
    ab49) # Session 49 (about 120 s): the bf16 decode steps at cf96ccb (before the fp8 KV cache; its kvserve and
        # benchmark scripts in .carry/old49, carried) against this tree, alternating old / new twice in one call:
        # s49b's batch-1 step read 5.57 ms where final41's had read 5.40 on another H100.
        rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree && cp -r .carry/old49/. /tmp/oldtree/ || exit 1
        for round in 1 2; do
          for mode in old new; do
            dir=.; [ $mode = old ] && dir=/tmp/oldtree
            timeout 60 python3 $dir/benchmarks/engine_benchmarks.py --out "$R/ab49_${mode}_$round" \
              --sections decode --decode-batches 1,64 --decode-contexts 1024 > "$R/ab49_${mode}_$round.log" 2>&1
            echo "rc=$?" >> "$R/ab49_${mode}_$round.log"
            echo "--- $mode $round"; grep -a -E "^decode b|^decode graphs|rc=" "$R/ab49_${mode}_$round.log" | cut -c1-140
          done
        done ;;
    s49t) # Session 49, tests (about 450 s): the fp8 KV cache's GPU tests first (kernels against the reference at
        # real shapes, the engine with an fp8 cache against the model-dtype cache, graphs on and off), then every
        # GPU test file (the fp8 change touched the attention, cache-write, rotary and q/k/v epilogue kernels of
        # the default path too; tensor-parallel tests skip on one GPU).
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_kv_cache.py \
          > "$R/pytest_s49_fp8.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s49_fp8.log"; cp "$R/pytest_s49_fp8.log" "$OUT/"
        grep -a "^FAILED\|^E  \|^SKIPPED" "$R/pytest_s49_fp8.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s49_fp8.log"
        timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu --ignore tests/gpu/test_gpu_fp8_kv_cache.py \
          > "$R/pytest_s49_gpu.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s49_gpu.log"; cp "$R/pytest_s49_gpu.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_s49_gpu.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s49_gpu.log" ;;
    s49b) # Session 49, benchmarks (about 150 s): the decode steps, the seeds' workload and the 256 sequences with
        # the KV cache in the model's dtype (bf16) and in fp8 (--kv-cache-dtype fp8), one engine each.
        for kv in auto fp8; do
          timeout 140 python3 benchmarks/engine_benchmarks.py --out "$R/s49b_$kv" --kv-cache-dtype $kv \
            --sections start,decode,seeds,random256 --decode-batches 1,64 > "$R/s49b_$kv.log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$R/s49b_$kv.log"; cp "$R/s49b_$kv.log" "$OUT/"
          echo "--- kv cache $kv"
          grep -a -E "^KV cache|^decode b|^seeds|^256 seqs|rc=" "$R/s49b_$kv.log" | cut -c1-130
        done ;;
    s48) # Session 48 (written without a GPU): the GPU tests of this session's GPU-side changes first (the
        # per-instance --gpu-memory-utilization budget, --kv-cache-memory on a GPU, --dtype auto from the
        # checkpoint, YaRN, the grammar tests of session 47), then so47's structured benchmark.
        timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_engine.py \
          -k "kv_cache or per_instance or dtype or yarn or structured" > "$R/pytest_s48.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_s48.log"; cp "$R/pytest_s48.log" "$OUT/"
        grep -a "^FAILED\|^E  \|^SKIPPED" "$R/pytest_s48.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_s48.log"
        timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/so48" --sections structured \
          > "$R/so48.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/so48.log"; cp "$R/so48.log" "$OUT/"
        grep -a -E "^seeds' shapes|^grammar runs|rc=" "$R/so48.log" | cut -c1-150 ;;
    so47) # Session 47, short of device time: so46's benchmark first (the seeds' shapes under a JSON schema,
        # async against step by step and without the grammar), then its GPU test of grammars.
        timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/so47" --sections structured \
          > "$R/so47.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/so47.log"; cp "$R/so47.log" "$OUT/"
        grep -a -E "^seeds' shapes|^grammar runs|rc=" "$R/so47.log" | cut -c1-150
        timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_engine.py -k structured \
          > "$R/pytest_so47.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_so47.log"; cp "$R/pytest_so47.log" "$OUT/"
        grep -a "^FAILED\|^E  \|^SKIPPED" "$R/pytest_so47.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_so47.log" ;;
    so46) # Session 46: grammar steps in two halves (the forward launched, then the previous step's tokens read and
        # the masks computed while it runs, then the sampling). The engine's GPU test of grammars (pipelined +
        # graphs against eager + sync, now through the split); then the seeds' shapes with every request under
        # a JSON schema, async against step by step and without the grammar (engine_benchmarks' structured
        # section; SmolLM2's tokenizer from .carry/tok, masks at the 7B vocabulary). Needs .carry/tok.
        timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_engine.py -k structured \
          > "$R/pytest_so46.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_so46.log"; cp "$R/pytest_so46.log" "$OUT/"
        grep -a "^FAILED\|^E  \|^SKIPPED" "$R/pytest_so46.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_so46.log"
        timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/so46" --sections structured \
          > "$R/so46.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/so46.log"; cp "$R/so46.log" "$OUT/"
        grep -a -E "^seeds' shapes|^grammar runs|rc=" "$R/so46.log" | cut -c1-150 ;;
    so45) # Session 45: structured output on the GPU. Its engine test (grammars' outputs, pipelined + graphs
        # against eager + sync) and the sampler's masks; then the mask's cost a step at the 7B vocabulary
        # (masks as wide as Qwen2.5's 152,064 logits; the byte-level tokenizer of the tests, so the host's
        # mask time here is not a real tokenizer's: grammar_mask_cost.py on the CPU measures that).
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_engine.py \
          tests/unit/test_grammar_masks.py -k "structured or mask" > "$R/pytest_so45.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_so45.log"; cp "$R/pytest_so45.log" "$OUT/"
        grep -a "^FAILED\|^E  \|^SKIPPED" "$R/pytest_so45.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_so45.log"
        mkdir -p /tmp/bytetok && PYTHONPATH=/tmp/site:tests python3 -c \
          'from helpers.tiny_models import write_byte_tokenizer; write_byte_tokenizer("/tmp/bytetok")'
        timeout 120 python3 benchmarks/grammar_mask_cost.py --tokenizer /tmp/bytetok --vocab 152064 --device cuda \
          --requests 1 8 64 256 --steps 50 --out "$R/grammar_mask_so45.json" > "$R/grammar_mask_so45.log" 2>&1
        echo "grammar_mask_cost rc=$?" >> "$R/grammar_mask_so45.log"; cp "$R/grammar_mask_so45.log" "$OUT/"
        tail -7 "$R/grammar_mask_so45.log" ;;
    gpu44) # Session 44: all of tests/gpu/test_gpu_engine.py with the penalty kernel in the sampler (every penalised
        # step of the engine's GPU tests runs it).
        timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_engine.py \
          > "$R/pytest_gpu44.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_gpu44.log"; cp "$R/pytest_gpu44.log" "$OUT/"
        grep -a "^FAILED\|^E  \|^SKIPPED" "$R/pytest_gpu44.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_gpu44.log" ;;
    pen44) # Session 44: the one-pass Triton penalty kernel. Its GPU tests (bit-equal to the torch reference, the
        # sampler's GPU cases, the engine's tokens with it and without it); its check and timing at the 7B
        # vocabulary; the sampler's step with it and with the torch reference; then entry 60's workloads with
        # Qwen2.5-Instruct's repetition penalty 1.05 (async) with the kernel, with the torch reference, and
        # without penalties.
        timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_penalties.py \
          tests/unit/test_sampler.py tests/gpu/test_gpu_engine.py -k "penal or sampl" > "$R/pytest_pen44.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_pen44.log"; cp "$R/pytest_pen44.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_pen44.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_pen44.log"
        timeout 60 python3 benchmarks/gpu_kernels.py --kernels penalties --out "$R/gpu_kernels_pen44.json" \
          > "$R/gpu_kernels_pen44.log" 2>&1
        echo "gpu_kernels rc=$?" >> "$R/gpu_kernels_pen44.log"; cp "$R/gpu_kernels_pen44.log" "$OUT/"
        grep -a -E "^kernel|^penalise|rc=" "$R/gpu_kernels_pen44.log" | cut -c1-160
        for shape in "256 1024" "50 512"; do
          read -r rows plen <<< "$shape"
          timeout 60 python3 benchmarks/sampler_cost.py --device cuda --rows "$rows" --prompt-len "$plen" --steps 30 \
            >> "$R/sampler_pen44.log" 2>&1
        done
        echo "sampler_cost rc=$?" >> "$R/sampler_pen44.log"; cp "$R/sampler_pen44.log" "$OUT/"; cat "$R/sampler_pen44.log"
        for run in "1.05 --penalty-kernel" "1.05 --no-penalty-kernel" "1.0 --penalty-kernel"; do
          read -r rp mode <<< "$run"
          log="$R/pen44_${rp}${mode}.log"
          timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/pen44_${rp}${mode}" --sections seeds,random256 \
            --repetition-penalty "$rp" "$mode" --async-scheduling > "$log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$log"; cp "$log" "$OUT/"
          echo "== repetition_penalty $rp $mode"
          grep -a -E "^seeds|^256 seqs|rc=" "$log" | cut -c1-130
        done ;;
    plp43) # Session 43, after the review's changes to the prompt-logprob step (pinned copies, one slice alive):
        # the GPU tests of prompt logprobs, async scheduling and graphs against eager.
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py \
          -k "prompt_logprobs or async_scheduling_matches or cuda_graph_matches_eager" > "$R/pytest_plp43.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_plp43.log"; cp "$R/pytest_plp43.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_plp43.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_plp43.log" ;;
    gpu43) # Session 43: all of tests/gpu/test_gpu_engine.py after the prompt-logprobs change (steps that compute them
        # run eagerly beside the captured graphs; the runner's sets of history and prompt-logprob requests).
        timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_engine.py \
          > "$R/pytest_gpu43.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_gpu43.log"; cp "$R/pytest_gpu43.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_gpu43.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_gpu43.log" ;;
    hf43) # Session 43: why HF's generate speed varies by host (1,289-2,550 tok/s across sessions): the host's
        # CPU, and HF's GPU busy time against its wall time over 32 decode steps (hf_probe --profile-steps).
        { lscpu | grep -E "Model name|^CPU\(s\)|MHz"; nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw \
            --format=csv; } > "$R/hf43.log" 2>&1
        # A single-thread host speed probe, comparable across hosts (a Python loop; HF's generate is Python too).
        python3 -c 'import time; t = time.perf_counter(); sum(i * i for i in range(10**7)); print(f"host probe: 10^7-term Python sum {time.perf_counter() - t:.3f} s")' >> "$R/hf43.log" 2>&1
        timeout 150 python3 benchmarks/hf_probe.py --out "$R/hf43" --repeats 2 --profile-steps 32 >> "$R/hf43.log" 2>&1
        echo "hf_probe rc=$?" >> "$R/hf43.log"; cp "$R/hf43.log" "$OUT/"
        grep -a -E "Model name|CPU\(s\)|MHz|host probe|HF generate|rc=" "$R/hf43.log" | cut -c1-300 ;;
    hfseeds43) # Session 43: the seeds' workload and HF in one engine_benchmarks run on the host of hf43, so that HF
        # after kvserve (as the ratio is measured) can be set beside HF alone on the same host.
        timeout 250 python3 benchmarks/engine_benchmarks.py --out "$R/hfseeds43" --sections seeds,hf \
          > "$R/hfseeds43.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/hfseeds43.log"; cp "$R/hfseeds43.log" "$OUT/"
        grep -a -E "^seeds|^HF|kvserve / HF|rc=" "$R/hfseeds43.log" | cut -c1-200 ;;
    pen42) # Written in session 42 (no GPU lent then; about 300 s): what async scheduling is worth to penalised
        # requests now that they pipeline (entry 60): the seeds' and 256-sequence workloads with Qwen2.5-Instruct's
        # repetition_penalty 1.05 on every request, async and step by step, and without penalties (async).
        for run in "1.05 --async-scheduling" "1.05 --no-async-scheduling" "1.0 --async-scheduling"; do
          read -r rp mode <<< "$run"
          log="$R/pen42_${rp}${mode}.log"
          timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/pen42_${rp}${mode}" --sections seeds,random256 \
            --repetition-penalty "$rp" "$mode" > "$log" 2>&1
          echo "engine_benchmarks rc=$?" >> "$log"; cp "$log" "$OUT/"
          echo "== repetition_penalty $rp $mode"
          grep -a -E "^seeds|^256 seqs|rc=" "$log" | cut -c1-130
        done ;;
    kernels41) # Written in session 41 (no GPU lent then), for the next call: the kernel-level GPU check at the current
        # decode attention (block ids a tile ahead, the split merge in the last program) for both head dims (the
        # 7B shape, 128; SmolLM2-135M, 64), bf16 and fp16; the sampler's GPU tests (kept penalty counts, no host
        # sync) and the GPU-marked attention tests; the sampler's step cost with penalties on the GPU.
        timeout 200 python3 benchmarks/gpu_kernels.py --models qwen2.5-7b smollm2-135m --dtypes bf16 fp16 \
          --budget-s 150 --rep-ms 20 --out "$R/gpu_kernels41.json" > "$R/gpu_kernels41.log" 2>&1
        echo "gpu_kernels rc=$?" >> "$R/gpu_kernels41.log"; cp "$R/gpu_kernels41.log" "$OUT/"
        tail -4 "$R/gpu_kernels41.log"
        timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_sampler.py \
          tests/kernels/test_triton_attention.py > "$R/pytest_kernels41.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_kernels41.log"; cp "$R/pytest_kernels41.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_kernels41.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_kernels41.log"
        for rows in 64 256; do
          timeout 60 python3 benchmarks/sampler_cost.py --device cuda --rows $rows --prompt-len 2048 --steps 30 \
            >> "$R/sampler41.log" 2>&1
        done
        cp "$R/sampler41.log" "$OUT/"; cat "$R/sampler41.log" ;;
    final41) # Written in session 41 (no GPU lent then; a call of its own, about 560 s): the first GPU run since the
        # tuning counts as enabled only where it can register a choice (f1983b9). The matmul tuning's GPU tests
        # and tests/gpu/test_gpu_engine.py; then the defaults with empty Triton and choice caches (the start's "matmul tuning" lines must list the shipped
        # choices at 48-256 and 8,192 rows): start, decode, seeds, 256 sequences, TTFT, prefix caching, HF.
        timeout 40 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_ops.py \
          -k "cublaslt or tuned or sustained or shipped" > "$R/pytest_final41_ops.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_final41_ops.log"; tail -2 "$R/pytest_final41_ops.log"
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_engine.py \
          > "$R/pytest_final41_engine.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_final41_engine.log"
        cp "$R"/pytest_final41_*.log "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_final41_engine.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_final41_engine.log"
        TRITON_CACHE_DIR=$(mktemp -d) KVSERVE_CACHE_DIR=$(mktemp -d) timeout 320 python3 benchmarks/engine_benchmarks.py \
          --out "$R/final41" --sections start,decode,seeds,random256,ttft,prefix,hf > "$R/final41.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/final41.log"
        cp "$R/final41.log" "$OUT/"
        grep -a -E "^ +[0-9]+: |^engine start|^decode b|^seeds|^256 seqs|^TTFT|^prefix|^HF|kvserve / HF|rc=" "$R/final41.log" | cut -c1-130 ;;
    gpu40) # After the review fixes (untimed lookups are no decision; the engine test's untuned engine keeps
        # torch's picks; a shared graph helper in the ops tests): the matmul tuning's GPU tests, then the engine
        # GPU tests (the whole file, as much as the time allows).
        timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_ops.py \
          -k "cublaslt or tuned or sustained or shipped" > "$R/pytest_gpu40_ops.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_gpu40_ops.log"; cp "$R/pytest_gpu40_ops.log" "$OUT/"
        tail -2 "$R/pytest_gpu40_ops.log"
        timeout 230 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gpu_engine.py \
          > "$R/pytest_gpu40_engine.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_gpu40_engine.log"; cp "$R/pytest_gpu40_engine.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_gpu40_engine.log" | head -8 | cut -c1-200; tail -3 "$R/pytest_gpu40_engine.log" ;;
    kprof40) # Where the final code's time goes, for the misses' "what limits" (data, no change): GPU time by kernel
        # without PDL (per-kernel times) at decode batch 48 / 64 x 1k and 160 / 256 x 768; then, with the defaults,
        # the per-step breakdown of the seeds' and 256-sequence workloads by step kind.
        timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/kprof40" --sections start,kprofile --no-pdl \
          --kprofile-cases b48,b64,b160x768,b256x768 > "$R/kprof40.log" 2>&1
        echo "kprofile rc=$?" >> "$R/kprof40.log"; cp "$R/kprof40.log" "$OUT/"
        timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/trace40" --sections start,trace \
          > "$R/trace40.log" 2>&1
        echo "trace rc=$?" >> "$R/trace40.log"; cp "$R/trace40.log" "$OUT/"
        grep -a -E "rc=" "$R/kprof40.log" "$R/trace40.log"; sed -n '/^measure/,$p' "$R/trace40.log" | cut -c1-140 | head -30 ;;
    check40) # After the shipped-choice test's fix: the matmul tuning's GPU tests; the final code's defaults on
        # another host (empty caches): start, decode batch 1 / 64 x 1k, seeds' and 256-sequence workloads, TTFT.
        timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_ops.py \
          -k "cublaslt or tuned or sustained or shipped" > "$R/pytest_check40.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_check40.log"
        cp "$R/pytest_check40.log" "$OUT/"; grep -a "^FAILED\|^E  \|SKIPPED" "$R/pytest_check40.log" | head -8 | cut -c1-200
        tail -2 "$R/pytest_check40.log"
        TRITON_CACHE_DIR=$(mktemp -d) KVSERVE_CACHE_DIR=$(mktemp -d) timeout 200 python3 benchmarks/engine_benchmarks.py \
          --out "$R/check40" --sections start,decode,seeds,random256,ttft --decode-batches 1,64 \
          --decode-contexts 1024 > "$R/check40.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/check40.log"
        cp "$R/check40.log" "$OUT/"
        grep -a -E "^engine start|^decode b|^seeds|^256 seqs|^TTFT|rc=" "$R/check40.log" | cut -c1-110 ;;
    final40) # The final code with its defaults (the shipped matmul choices at 8,192 rows and, new, at the decode
        # graph sizes), empty Triton and choice caches: the GPU tests of the matmul tuning; start, decode, the seeds'
        # and 256-sequence workloads, TTFT, prefix caching, HF; then the decode-size choices off / on twice on
        # this host (decode batch 48 / 64 x 1k, seeds' and 256-sequence workloads).
        timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_ops.py \
          -k "cublaslt or tuned or sustained or shipped" > "$R/pytest_final40.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_final40.log"
        cp "$R/pytest_final40.log" "$OUT/"; grep -a "^FAILED\|^E  " "$R/pytest_final40.log" | head -8 | cut -c1-200
        tail -2 "$R/pytest_final40.log"
        TRITON_CACHE_DIR=$(mktemp -d) KVSERVE_CACHE_DIR=$(mktemp -d) timeout 300 python3 benchmarks/engine_benchmarks.py \
          --out "$R/final40" --sections start,decode,seeds,random256,ttft,prefix,hf > "$R/final40.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/final40.log"
        cp "$R/final40.log" "$OUT/"
        grep -a -E "^ +[0-9]+: |^engine start|^decode b|^seeds|^256 seqs|^TTFT|^prefix|^HF|kvserve / HF|rc=" "$R/final40.log" | cut -c1-130
        off="--no-decode-gemm-choices"
        engine_modes final40ab 120 "--sections decode,seeds,random256 --decode-batches 48,64 --decode-contexts 1024" \
          "off1:$off" "on1:" "off2:$off" "on2:"
        grep -a -E "^decode b|^seeds|^256 seqs|mode .* done|Error" "$R/final40ab_engine.log" | cut -c1-100 ;;
    dsw40) # Ran at ac2fb17 (session 40 call 1), "on" as --sustained-gemm-rows $DEC_ROWS (the engine's
        # KVSERVE_DECODE_GEMM_CHOICES since, on by default); written with --no-decode-gemm-choices for "off" since.
        # cuBLASLt's candidates at every decode graph size past the skinny matmul's 32 rows, timed sustained
        # (0.25 s warm, 0.25 s timed; the 5 fastest by a short timing, and torch's pick before and after), written
        # as stored sustained choices; then the engine with them at those row counts against without (both keep
        # the shipped 8,192-row choices): decode batch 64 x 1k, the seeds' and the
        # 256-sequence workloads, off / on, one host.
        rm -rf /tmp/dsw40 && mkdir -p /tmp/dsw40
        timeout 330 python3 benchmarks/cublaslt_algos.py --out "$R/lt_dsw40.json" --rows "$DEC_ROWS" \
          --shapes qkv,o_proj,gate_up,down --sustained-s 0.25 --sustained-top 5 \
          --tuning-out /tmp/dsw40/gemm_tuning.json > "$R/lt_dsw40.log" 2>&1
        echo "cublaslt_algos rc=$?" >> "$R/lt_dsw40.log"
        cp "$R/lt_dsw40.log" "$OUT/"; cp /tmp/dsw40/gemm_tuning.json "$OUT/dsw40_tuning.json" 2>/dev/null
        grep -a -E "choice|rc=" "$R/lt_dsw40.log" | cut -c1-100
        if [ -s /tmp/dsw40/gemm_tuning.json ]; then
          KVSERVE_CACHE_DIR=/tmp/dsw40 engine_modes dsw40 120 \
            "--sections decode,seeds,random256 --decode-batches 64 --decode-contexts 1024" \
            "off:--no-decode-gemm-choices" "on:"
          grep -a -E "^decode b|^seeds|^256 seqs|matmul tuning|mode .* done|Error" "$R/dsw40_engine.log" | cut -c1-110
        fi ;;
    dab40) # Ran at c7fb69d (session 40 call 2) as dsw40 did; written for the engine's flags since.
        # The decode-size sustained choices of a stored file (DSW_FILE, from dsw40) in the engine against
        # without, and with them and gate/up at 33-64 rows by cuBLASLt + silu_and_mul instead of the fused TMA
        # kernel (tma_off), off / on / tma_off twice, one host: decode batch 48 / 64 x 1k, seeds' and 256-sequence
        # workloads.
        rm -rf /tmp/dab40 && mkdir -p /tmp/dab40 && cp "$DSW_FILE" /tmp/dab40/gemm_tuning.json
        off="--no-decode-gemm-choices"
        KVSERVE_CACHE_DIR=/tmp/dab40 engine_modes dab40 120 \
          "--sections decode,seeds,random256 --decode-batches 48,64 --decode-contexts 1024" \
          "off1:$off" "on1:" "tma_off1:--no-decode-gate-up-tma" \
          "off2:$off" "on2:" "tma_off2:--no-decode-gate-up-tma"
        grep -a -E "^decode b|^seeds|^256 seqs|matmul tuning|mode .* done|Error" "$R/dab40_engine.log" | cut -c1-110 ;;
    dec39) # Data for later: cuBLASLt's candidates at decode sizes (64 rows: the batch-64 target; 256: the 256-sequence
        # workload's largest batches) timed sustained (0.4 s warm, 0.4 s timed) against torch's pick. No engine run.
        timeout 200 python3 benchmarks/cublaslt_algos.py --out "$R/lt_dec39.json" --rows 64,256 \
          --shapes qkv,o_proj,gate_up,down --sustained-s 0.4 > "$R/lt_dec39.log" 2>&1
        echo "cublaslt_algos rc=$?" >> "$R/lt_dec39.log"
        cp "$R/lt_dec39.log" "$R/lt_dec39.json" "$OUT/" 2>/dev/null
        grep -a -E "choice|^(qkv|o_proj|gate_up|down) |rc=" "$R/lt_dec39.log" | cut -c1-150 ;;
    check39) # After the review fixes: the matmul tuning's GPU tests, and a default engine start (the shipped choices
        # found, nothing timed) with TTFT 8k.
        timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_ops.py -k "cublaslt or tuned or sustained" \
          > "$R/pytest_check39.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_check39.log"
        cp "$R/pytest_check39.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_check39.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_check39.log"
        KVSERVE_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/check39" \
          --sections start,ttft --ttft-lengths 8192 > "$R/check39.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/check39.log"
        cp "$R/check39.log" "$OUT/"
        grep -a -E "^ +[0-9]+: |^engine start|^TTFT|matmul tuning:|rc=" "$R/check39.log" | cut -c1-200 ;;
    final39) # The final code with its defaults (the shipped prefill matmul choices), empty Triton cache: the GPU tests
        # of the matmul tuning, then start, decode, the seeds' and 256-sequence workloads, TTFT, prefix caching, HF.
        timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_ops.py -k "cublaslt or tuned or sustained" \
          > "$R/pytest_final39.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_final39.log"
        cp "$R/pytest_final39.log" "$OUT/"; tail -2 "$R/pytest_final39.log"
        TRITON_CACHE_DIR=$(mktemp -d) KVSERVE_CACHE_DIR=$(mktemp -d) timeout 400 python3 benchmarks/engine_benchmarks.py \
          --out "$R/final39" --sections start,decode,seeds,random256,ttft,prefix,hf > "$R/final39.log" 2>&1
        echo "engine_benchmarks rc=$?" >> "$R/final39.log"
        cp "$R/final39.log" "$OUT/"
        grep -a -E "^ +[0-9]+: |^engine start|^decode b|^seeds|^256 seqs|^TTFT|^prefix|^HF|kvserve / HF|rc=" "$R/final39.log" | cut -c1-130 ;;
    pgt39b) # Ran at 24fbef1 (session 39 call 4). The engine's sustained tuning with each candidate warmed up on its own (150 ms, then 150 ms timed) and
        # the shipped choices (call 1's): GPU tests; then, one host: timed at start on a fresh choice file (shipped
        # choices ignored), the shipped choices on another fresh file, torch's picks, and again (the timed choices
        # now read from their file): start, TTFT 8k, the seeds' and the 256-sequence workloads.
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_ops.py -k "cublaslt or tuned or sustained" \
          > "$R/pytest_pgt39b.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_pgt39b.log"
        cp "$R/pytest_pgt39b.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_pgt39b.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_pgt39b.log"
        rm -rf /tmp/pgt39b_timed /tmp/pgt39b_shipped
        for spec in timed1:timed shipped1:shipped off1:off timed2:timed shipped2:shipped off2:off; do
          label=${spec%%:*}; mode=${spec#*:}
          case $mode in
            timed) flags="--prefill-gemm-tuning 2 --no-shipped-gemm-choices" ;; shipped) flags="--prefill-gemm-tuning 1" ;;
            off) flags="--prefill-gemm-tuning 0" ;;
          esac
          KVSERVE_CACHE_DIR=/tmp/pgt39b_$mode engine_modes pgt39b 150 \
            "--sections start,ttft,seeds,random256 --ttft-lengths 8192 $flags" "$label:"
        done
        cp /tmp/pgt39b_timed/gemm_tuning.json "$OUT/pgt39b_timed_tuning.json" 2>/dev/null
        grep -a -E "^TTFT|^seeds|^256 seqs|^engine start|^ +[0-9]+: |mode .* done|Error" "$R/pgt39b_engine.log" | cut -c1-150 ;;
    c1ab39) # Ran at 208686d (session 39 call 3). Call 1's sustained choices (qkv #1, gate/up #6; stored as the engine's sustained entries) and gate/up's
        # alone, read by the engine from a prepared choice file, against torch's picks, on call 2's host (whose own
        # start-up timing chose others and gained nothing): TTFT 8k, the seeds' and the 256-sequence workloads.
        d=benchmarks/results/h200-2026-12-04/session39
        for mode in c1 g6; do
          mkdir -p /tmp/c1ab39_$mode
          f=$d/call1_choices_as_sustained.json; [ $mode = g6 ] && f=$d/call1_gate_up_only_as_sustained.json
          cp "$f" /tmp/c1ab39_$mode/gemm_tuning.json
        done
        for spec in off1:off c1a:c1 g6a:g6 off2:off c1b:c1 g6b:g6; do
          label=${spec%%:*}; mode=${spec#*:}
          flags="--prefill-gemm-tuning 1"; [ $mode = off ] && flags="--prefill-gemm-tuning 0"
          KVSERVE_CACHE_DIR=/tmp/c1ab39_$mode engine_modes c1ab39 150 \
            "--sections ttft,seeds,random256 --ttft-lengths 8192 $flags" "$label:"
        done
        grep -a -E "^TTFT|^seeds|^256 seqs|^ +[0-9]+: |mode .* done|Error" "$R/c1ab39_engine.log" | cut -c1-110 ;;
    pgt39) # Ran at 9dba72a (session 39 call 2), whose start-up timing took 40-ms windows one after another after one
        # 0.3-s warm-up (each candidate warmed up on its own since), with on/off flags (written with today's since).
        # The engine's own sustained tuning at the step budget's rows (KVSERVE_PREFILL_GEMM_TUNING, on by default):
        # its GPU tests, then the engine with a fresh choice file (the timing at start shows in the start section),
        # without the tuning, and with the stored choices, off / on twice, one host: start, TTFT 8k, the seeds' and
        # the 256-sequence workloads.
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_ops.py -k "cublaslt or tuned or sustained" \
          > "$R/pytest_pgt39.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_pgt39.log"
        cp "$R/pytest_pgt39.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_pgt39.log" | head -8 | cut -c1-200; tail -2 "$R/pytest_pgt39.log"
        rm -rf /tmp/pgt39_cache
        KVSERVE_CACHE_DIR=/tmp/pgt39_cache engine_modes pgt39 150 "--sections start,ttft,seeds,random256 --ttft-lengths 8192" \
          "fresh:--prefill-gemm-tuning 2 --no-shipped-gemm-choices" "off1:--prefill-gemm-tuning 0" \
          "on1:--prefill-gemm-tuning 2" "off2:--prefill-gemm-tuning 0" "on2:--prefill-gemm-tuning 2"
        cp /tmp/pgt39_cache/gemm_tuning.json "$OUT/pgt39_tuning.json" 2>/dev/null
        grep -a -E "^TTFT|^seeds|^256 seqs|^engine start|^ +[0-9]+: |mode .* done|Error" "$R/pgt39_engine.log" | cut -c1-150 ;;
    sus39) # Ran at 131ac16 (session 39 call 1) as "--gemm-tuning --gemm-tuning-rows 8192" against "--no-gemm-tuning",
        # when the choice file's keys were the short timings'; they are the sustained choices' since (read by
        # --prefill-gemm-tuning 1).
        # cuBLASLt's candidates at 8,192 rows timed sustained (0.5 s of back-to-back calls after 0.5 s of
        # warm-up: the power cap's clock, as a long prefill meets it) against torch's pick, written as the engine's
        # stored tuning; then, when any shape chose a candidate, the engine with those choices at 8,192 rows only
        # against torch's pick: TTFT 8k, the seeds' and the 256-sequence workloads, off / on / off / on, one host.
        rm -rf /tmp/lt_sus39 && mkdir -p /tmp/lt_sus39
        timeout 300 python3 benchmarks/cublaslt_algos.py --out "$R/lt_sus39.json" --rows 8192 \
          --shapes qkv,o_proj,gate_up,down --sustained-s 0.5 --tuning-out /tmp/lt_sus39/gemm_tuning.json \
          > "$R/lt_sus39.log" 2>&1
        echo "cublaslt_algos rc=$?" >> "$R/lt_sus39.log"
        cp "$R/lt_sus39.log" "$OUT/"; cp /tmp/lt_sus39/gemm_tuning.json "$OUT/lt_sus39_tuning.json" 2>/dev/null
        grep -a -E "choice|^(qkv|o_proj|gate_up|down) |rc=" "$R/lt_sus39.log" | cut -c1-150
        if python3 -c 'import json, sys; sys.exit(0 if any(e["choice"] >= 0 for e in json.load(open(sys.argv[1])).values()) else 1)' \
            /tmp/lt_sus39/gemm_tuning.json; then
          off="off:--prefill-gemm-tuning 0" on="on:--prefill-gemm-tuning 1"
          KVSERVE_CACHE_DIR=/tmp/lt_sus39 engine_modes sus39 150 "--sections ttft,seeds,random256 --ttft-lengths 8192" \
            "${off/off:/off1:}" "${on/on:/on1:}" "${off/off:/off2:}" "${on/on:/on2:}"
          grep -a -E "^TTFT|^seeds|^256 seqs|matmul tuning|mode .* done|Error" "$R/sus39_engine.log" | cut -c1-110
        else
          echo "every shape kept torch's pick: no engine A/B"
        fi ;;
    place38) # Where a one-wave grid's programs land (benchmarks/placement_probe.py): grids of 192 / 256 programs
        # of 1 / 4 / 8 warps after a narrow or a wide, staggered predecessor, launched plainly or with PDL.
        timeout 120 python3 benchmarks/placement_probe.py --out "$R/place38.json" > "$R/place38.log" 2>&1
        echo "probe rc=$?" >> "$R/place38.log"
        cp "$R/place38.log" "$OUT/"
        cat "$R/place38.log" | cut -c1-120 ;;
    dpdl38) # ran at 78a8681 (session 38 call 4; the TMA kernel, DECODE_PDL and their flags were removed after it;
        # its loop is written with engine_modes since).
        # Decode attention launched without PDL while the other kernels keep it (call 3: the TMA kernel's loss
        # in the engine came with PDL only): the engine's decode at batch 32 / 48 / 64 x 1k / 4k and the seeds'
        # workload, pointer kernel with PDL (default) / without / the TMA kernel (1 warp, 4 stages, ids ahead)
        # without, twice, one host.
        pdl="ptr_pdl:--no-decode-tma --decode-pdl" plain="ptr_plain:--no-decode-tma --no-decode-pdl"
        tma="tma_plain:--decode-tma --decode-launch-tma 1,4,1 --no-decode-pdl"
        engine_modes dpdl38 90 "--sections decode,seeds --decode-batches 32,48,64 --decode-contexts 1024,4096" \
          "$pdl" "$plain" "$tma" "$pdl" "$plain" "$tma"
        grep -a -E "^decode b|^seeds|mode .* done|Error" "$R/dpdl38_engine.log" | cut -c1-66 ;;
    gap38) # ran at cdc62fa (session 38 call 3; the TMA kernel, the sweep's --tma and the engine's TMA flags were
        # removed after call 4). Where the TMA decode kernel loses in the engine (call 1: batch 64 x 4k 9.36 against 7.72 ms a step,
        # while the sweep had 136 against 128 us a layer): the sweep at 64 x 1k / 4k, blocks scattered and in order,
        # with and without PDL; the engine's decode at 64 x 1k / 4k and its kernel profile at 64 x 4k, without PDL
        # (per-kernel times), TMA off / on.
        for pdl in 1 0; do
          KVSERVE_PDL=$pdl timeout 120 python3 benchmarks/attention_sweep.py --out "$R/sweep_gap38_pdl$pdl.json" \
            --cases 64:4096:1,64:1024:1 --tiles 64 --warps 4 --stages 4 --block-orders scattered,inorder --tma 1:4:1 \
            > "$R/sweep_gap38_pdl$pdl.log" 2>&1
          cp "$R/sweep_gap38_pdl$pdl.log" "$OUT/"
          echo "== sweep, PDL $pdl"; grep -a -E "^batch|default|tma " "$R/sweep_gap38_pdl$pdl.log" | cut -c1-120
        done
        for mode in off on; do
          flags="--no-decode-tma"; [ $mode = on ] && flags="--decode-tma --decode-launch-tma 1,4,1"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/gap38_$mode" --sections decode,kprofile --no-pdl \
            --decode-batches 64 --decode-contexts 1024,4096 --kprofile-cases b64x4096 $flags > "$R/gap38_$mode.log" 2>&1
          echo "mode $mode rc=$? done" >> "$R/gap38_$mode.log"
          cp "$R/gap38_$mode.log" "$OUT/"
          echo "== engine, TMA $mode"; grep -a -E "^decode b|kernel profile|us/step" "$R/gap38_$mode.log" | head -14 | cut -c1-130
        done ;;
    busy38) # ran at c4ef01c (session 38 call 2; the TMA kernel and its flags were removed after call 4; its loop
        # is written with engine_modes since).
        # The TMA decode kernel for busy one-split launches only (DECODE_TMA_BUSY, 1 warp, 6 stages, ids in the
        # iteration: the sweep's best at 128 x 1k in call 1): its GPU tests with their failures shown, then the
        # engine's decode at batch 128 / 176 / 256 x 1k and the 256-sequence workload, off / on / off / on.
        timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py -k tma --tb=short \
          > "$R/pytest_busy38.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_busy38.log"
        cp "$R/pytest_busy38.log" "$OUT/"
        grep -a "^FAILED\|^E  " "$R/pytest_busy38.log" | head -12 | cut -c1-200; tail -2 "$R/pytest_busy38.log"
        off="off:--no-decode-tma --no-decode-tma-busy" on="on:--no-decode-tma --decode-tma-busy"
        engine_modes busy38 110 "--sections decode,random256 --decode-batches 128,176,256 --decode-contexts 1024" \
          "$off" "$on" "$off" "$on"
        grep -a -E "decode b|256 seq|random|mode .* done|Error" "$R/busy38_engine.log" | cut -c1-110 ;;
    tma38) # ran at c859bc8 (session 38 call 1; the TMA kernel, the sweep's --tma and the engine's TMA flags were
        # removed after call 4; its loop is written with engine_modes since). Decode attention reading K/V by TMA (DECODE_TMA): the attention kernel tests on the GPU, the sweep of
        # the TMA kernel's launch against the pointer kernel, then the engine's decode (batch 48 / 64 / 128 x 1k /
        # 4k) and seeds' workload with the sweep's best TMA launch at 64 x 1k: off / on / off / on, one host.
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py -k "tma or decode" \
          > "$R/pytest_tma38.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_tma38.log"
        cp "$R/pytest_tma38.log" "$OUT/"
        grep -a "^FAILED\|^E   " "$R/pytest_tma38.log" | head -8; tail -2 "$R/pytest_tma38.log"
        timeout 220 python3 benchmarks/attention_sweep.py --out "$R/sweep_tma38.json" \
          --cases 32:1024:1/3,48:1024:1,64:1024:1,64:4096:1,128:1024:1,176:r:1 --tiles 64,128 --warps 4 --stages 3,4 \
          --prefetch-ids on,off --tma 1:6:0,1:4:1,1:6:1,1:8:1,1:10:1,1:12:1,2:6:1,2:8:1,4:8:1 > "$R/sweep_tma38.log" 2>&1
        echo "sweep rc=$?" >> "$R/sweep_tma38.log"
        cp "$R/sweep_tma38.log" "$OUT/"
        grep -a -v "^ *best" "$R/sweep_tma38.log" | tail -75 | cut -c1-120
        best=$(python3 - "$R/sweep_tma38.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"]
        if r.get("kernel") == "tma" and r["batch"] == 64 and r["context"] == 1024 and "us_per_layer" in r]
r = min(rows, key=lambda r: r["us_per_layer"]) if rows else {"num_warps": 1, "num_stages": 6, "prefetch_ids": False}
print(f"{r['num_warps']},{r['num_stages']},{int(r['prefetch_ids'])}")
PY
)
        echo "engine A/B with the TMA launch $best (warps,stages,ids)"
        off="off:--no-decode-tma" on="on:--decode-tma --decode-tma-busy --decode-launch-tma $best"
        engine_modes tma38 100 "--sections decode,seeds --decode-batches 48,64,128 --decode-contexts 1024,4096" \
          "$off" "$on" "$off" "$on"
        grep -a -E "decode b|seeds|mode .* done|Error|late" "$R/tma38_engine.log" | cut -c1-110 ;;
    pair36) # bf16 and AWQ on one host at the final code: decode 1 / 8 / 64 x 1k and the seeds' workload, each.
        for q in bf16 awq; do
          flags=""; [ $q = awq ] && flags="--quantization awq"
          timeout 130 python3 benchmarks/engine_benchmarks.py --out "$R/pair36_$q" $flags --sections decode,seeds \
            --decode-contexts 1024 > "$R/pair36_$q.log" 2>&1
          cp "$R/pair36_$q.log" "$OUT/"
          echo "== $q"; grep -a -E "decode b|seeds" "$R/pair36_$q.log" | cut -c1-100
        done ;;
    last36) # The final code: kernel and quantized-engine GPU tests, then the AWQ engine's start, decode, TTFT and
        # seeds' workload. Logs to $OUT as each part ends.
        timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_triton_quant.py \
          tests/gpu/test_gpu_quantized.py -s > "$R/pytest_last36.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_last36.log"
        cp "$R/pytest_last36.log" "$OUT/"
        grep -a "AWQ bf16:\|tokens compared\|^FAILED\|^E   " "$R/pytest_last36.log" | head -20; tail -2 "$R/pytest_last36.log"
        timeout 170 python3 benchmarks/engine_benchmarks.py --out "$R/last36_awq" --quantization awq \
          --sections start,decode,ttft,seeds --decode-contexts 1024 > "$R/last36_awq.log" 2>&1
        cp "$R/last36_awq.log" "$OUT/"
        grep -a -E "engine start|decode b|TTFT|seeds" "$R/last36_awq.log" | cut -c1-120 ;;
    pw36) # ran at db90af7 (session 36 call 5; --pairs-pairwise and --pairs-maxnreg-64 were removed after it, both
        # slower; its loops are written with the two helpers since).
        # The paired kernel's values made a pair at a time (--pairs-pairwise) and a register cap of 168 on its
        # 64-row tiles (3 programs an SM instead of 2), against the default, one host: matmul table, AWQ decode.
        quant_matmul_modes pw36 1,16,64 default: pairwise:--pairs-pairwise "cap:--pairs-maxnreg-64 168" \
          "both:--pairs-pairwise --pairs-maxnreg-64 168"
        awq_decode_modes pw36_awq.log default: pairwise:--pairs-pairwise "both:--pairs-pairwise --pairs-maxnreg-64 168" \
          "cap:--pairs-maxnreg-64 168" default: ;;
    final36) # ran at 011736d (session 36 call 4; --pairs-fused-reduce-max-rows was removed after it; its loop is
        # written with awq_decode_modes since). The paired kernel without PDL, split partials summed in the
        # kernel up to 16 rows and by one Triton launch above: kernel and quantized-engine GPU tests; AWQ decode
        # default / never summed in the kernel / 32-row tiles / default; then the AWQ engine's start, TTFT and
        # seeds' workload. Logs to $OUT as each ends.
        timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_triton_quant.py \
          tests/gpu/test_gpu_quantized.py -s > "$R/pytest_final36.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_final36.log"
        cp "$R/pytest_final36.log" "$OUT/"
        grep -a "AWQ bf16:\|tokens compared\|^FAILED\|^E   " "$R/pytest_final36.log" | head -20; tail -2 "$R/pytest_final36.log"
        awq_decode_modes final36_ab.log default: "never:--pairs-fused-reduce-max-rows 0" tiles32:--pairs-32-row-tiles \
          default:
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/final36_awq" --quantization awq \
          --sections start,ttft,seeds > "$R/final36_awq.log" 2>&1
        cp "$R/final36_awq.log" "$OUT/"
        tail -8 "$R/final36_awq.log" ;;
    ab36) # ran at bad17fa (session 36 call 3; --pairs-pdl and --pairs-fused-reduce-max-rows were removed after it;
        # its loops are written with the two helpers since).
        # The paired kernel's launch options, one host: matmul table with and without its PDL; AWQ engine decode
        # with the defaults (PDL, partials summed in the kernel up to 16 rows), without PDL, never summed in the
        # kernel, always summed in the kernel.
        quant_matmul_modes ab36 1,16,32,64 pdl: nopdl:--no-pairs-pdl
        awq_decode_modes ab36_awq.log default: nopdl:--no-pairs-pdl "never:--pairs-fused-reduce-max-rows 0" \
          "always:--pairs-fused-reduce-max-rows 128" default: ;;
    fuse36) # ran at c851746 (session 36 call 2; the in-kernel sum and PDL were removed after call 4). The paired
        # kernel's split-K summed by each tile's last program and launched with PDL (new) against
        # 3c0304c's kernel (old: .carry/triton_quant_old.py in a copy of the tree): a tiling sweep at 64 / 128
        # rows, the matmul table and the AWQ engine's decode, new and old in turn on this host.
        rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree && cp -r kvserve benchmarks /tmp/oldtree/ \
          && cp .carry/triton_quant_old.py /tmp/oldtree/kvserve/kernels/triton_quant.py || exit 1
        timeout 200 python3 benchmarks/quant_matmul_bench.py --out "$R/sweep36b" --pairs-sweep --sweep-rows 64,128 \
          --pairs-block-n 64,128 --pairs-warps 4 --pairs-stages 3,4 > "$R/sweep36b.log" 2>&1
        echo "sweep rc=$?" >> "$R/sweep36b.log"
        cp "$R/sweep36b.log" "$OUT/"
        tail -10 "$R/sweep36b.log"
        for mode in new old; do
          dir=.; [ $mode = old ] && dir=/tmp/oldtree
          (cd $dir && timeout 70 python3 benchmarks/quant_matmul_bench.py --out "$R/fuse36_$mode" --rows 1,8,16,32,64,128 \
            --repeats 5) > "$R/fuse36_matmul_$mode.log" 2>&1
          cp "$R/fuse36_matmul_$mode.log" "$OUT/"
          echo "== matmul $mode"; tail -24 "$R/fuse36_matmul_$mode.log"
        done
        for mode in new old new old; do
          dir=.; [ $mode = old ] && dir=/tmp/oldtree
          (cd $dir && timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/fuse36_awq_$mode" --quantization awq \
            --sections decode --decode-contexts 1024) >> "$R/fuse36_awq.log" 2>&1
          echo "mode $mode done" >> "$R/fuse36_awq.log"
          cp "$R/fuse36_awq.log" "$OUT/"
        done
        grep -a -E "decode b|mode .* done|Error" "$R/fuse36_awq.log" | tail -30 ;;
    ncu36) # Nsight Compute on the paired 4-bit matmul at 16 / 64 rows (and 32-row tiles, cuBLAS bf16 beside it),
        # then a tiling sweep at 64 rows with pipeline stages, then the quantized engine's HF comparison test.
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        timeout 240 "$NCU" --clock-control none --profile-from-start off --target-processes all \
          --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
          --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
          --section InstructionStats --section SourceCounters \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 benchmarks/quant_ncu_probe.py \
          --cases gate_up:64,gate_up:16,tiles32:gate_up:64,down:64,qkv:64,cublas:gate_up:64,cublas:down:64 \
          > "$R/ncu36.log" 2>&1
        echo "ncu rc=$?" >> "$R/ncu36.log"
        cp "$R/ncu36.log" "$OUT/"
        grep -a -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|ncu rc|rror" \
          "$R/ncu36.log" | head -80
        timeout 200 python3 benchmarks/quant_matmul_bench.py --out "$R/sweep36" --pairs-sweep --sweep-rows 64 \
          --pairs-block-n 128 --pairs-warps 4,8 --pairs-stages 2,3,4 > "$R/sweep36.log" 2>&1
        echo "sweep rc=$?" >> "$R/sweep36.log"
        cp "$R/sweep36.log" "$OUT/"
        tail -6 "$R/sweep36.log"
        timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_quantized.py -k hf -s \
          > "$R/pytest_hf36.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_hf36.log"
        cp "$R/pytest_hf36.log" "$OUT/"
        grep -a "AWQ bf16:\|^FAILED\|^E   " "$R/pytest_hf36.log" | head; tail -2 "$R/pytest_hf36.log" ;;
    fix35) # The review fixes (paired fma PTX, scales rounded only for the paired layout, bf16 pairs from sm_80):
        # kernel and engine GPU tests, the matmul table, the AWQ engine's start and decode.
        timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_triton_quant.py \
          tests/gpu/test_gpu_quantized.py -s > "$R/pytest_fix35.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_fix35.log"
        cp "$R/pytest_fix35.log" "$OUT/"
        grep -a "AWQ bf16:\|tokens compared\|^FAILED\|^E   " "$R/pytest_fix35.log" | head -20; tail -2 "$R/pytest_fix35.log"
        timeout 60 python3 benchmarks/quant_matmul_bench.py --out "$R/fix35" --rows 1,16,64 --repeats 5 \
          > "$R/fix35_matmul.log" 2>&1
        cp "$R/fix35_matmul.log" "$OUT/"
        tail -13 "$R/fix35_matmul.log"
        timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/fix35" --quantization awq \
          --sections start,decode --decode-contexts 1024 > "$R/fix35_awq.log" 2>&1
        cp "$R/fix35_awq.log" "$OUT/"
        tail -5 "$R/fix35_awq.log" ;;
    graphs35) # The bf16 graphs-vs-eager test of the quantized models, with its printed logprob distances.
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_quantized.py -k graphs_match -s \
          > "$R/graphs35.log" 2>&1
        echo "pytest rc=$?" >> "$R/graphs35.log"
        cp "$R/graphs35.log" "$OUT/"
        grep -a "tokens compared\|^E   " "$R/graphs35.log" | head; tail -2 "$R/graphs35.log" ;;
    final35) # The paired kernel with 64-row tiles of two 32-row dots past 32 rows: kernel and engine GPU tests, the
        # matmul table (and its 32-row-tile A/B), the AWQ engine (start, decode 1 / 8 / 64 x 1k, TTFT, seeds), the
        # bf16 engine's decode and seeds on the same host. Logs go to $OUT as each part ends.
        timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_triton_quant.py \
          tests/gpu/test_gpu_quantized.py > "$R/pytest_final35.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_final35.log"
        cp "$R/pytest_final35.log" "$OUT/"
        grep -a "AWQ bf16:\|^FAILED\|^E   " "$R/pytest_final35.log" | head -20; tail -2 "$R/pytest_final35.log"
        timeout 90 python3 benchmarks/quant_matmul_bench.py --out "$R/final35" --rows 1,8,16,32,48,64,128 \
          --repeats 5 > "$R/final35_matmul.log" 2>&1
        timeout 60 python3 benchmarks/quant_matmul_bench.py --out "$R/final35/tiles32" --rows 48,64,128 \
          --repeats 5 --pairs-32-row-tiles > "$R/final35_matmul_tiles32.log" 2>&1
        cp "$R/final35_matmul.log" "$R/final35_matmul_tiles32.log" "$OUT/"
        tail -29 "$R/final35_matmul.log"; tail -13 "$R/final35_matmul_tiles32.log"
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/final35" --quantization awq \
          --sections start,decode,ttft,seeds --decode-contexts 1024 > "$R/final35_awq.log" 2>&1
        cp "$R/final35_awq.log" "$OUT/"
        tail -10 "$R/final35_awq.log"
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/final35/bf16" --sections decode,seeds \
          --decode-contexts 1024 > "$R/final35_bf16.log" 2>&1
        cp "$R/final35_bf16.log" "$OUT/"
        tail -6 "$R/final35_bf16.log" ;;
    diag35) # Where a bf16 quantized model's graph and eager outputs part, at 512- and 128-token steps.
        timeout 300 python3 benchmarks/quant_graph_diag.py > "$R/diag35.log" 2>&1
        echo "diag rc=$?" >> "$R/diag35.log"
        cp "$R/diag35.log" "$OUT/"
        grep -a "^awq4\|^gptq4\|rc=" "$R/diag35.log" ;;
    pairs35) # The quantized matmuls' row-count-independent tilings: their kernel and engine GPU tests, where a bf16
        # quantized model's graph and eager tokens part (benchmarks/quant_graph_diag.py), the matmul table, the
        # AWQ engine (start, decode 1 / 8 / 64 x 1k, seeds). Logs go to $OUT as each part ends.
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_triton_quant.py \
          tests/gpu/test_gpu_quantized.py > "$R/pytest_pairs35.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_pairs35.log"
        cp "$R/pytest_pairs35.log" "$OUT/"
        grep -a "AWQ bf16:\|^FAILED\|^E   " "$R/pytest_pairs35.log" | head -20; tail -2 "$R/pytest_pairs35.log"
        timeout 120 python3 benchmarks/quant_graph_diag.py > "$R/pairs35_diag.log" 2>&1
        cp "$R/pairs35_diag.log" "$OUT/"
        grep -a "^awq4\|^gptq4" "$R/pairs35_diag.log"
        timeout 120 python3 benchmarks/quant_matmul_bench.py --out "$R/pairs35" --rows 1,8,16,32,64,128 \
          --repeats 5 > "$R/pairs35_matmul.log" 2>&1
        cp "$R/pairs35_matmul.log" "$OUT/"
        tail -26 "$R/pairs35_matmul.log"
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/pairs35" --quantization awq \
          --sections start,decode,seeds --decode-contexts 1024 > "$R/pairs35_awq.log" 2>&1
        cp "$R/pairs35_awq.log" "$OUT/"
        tail -5 "$R/pairs35_awq.log" ;;
    pairs34) # The paired-dequantizing 4-bit matmul in the engine: its kernel and engine GPU tests, the matmul table
        # against bf16, the AWQ engine (start, decode 1 / 8 / 64 x 1k, seeds), a tiling sweep, the bf16 engine's
        # decode on the same host.
        # Each log goes to $OUT as soon as its part ends (a run cut at the call's limit keeps what finished).
        timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_triton_quant.py \
          tests/gpu/test_gpu_quantized.py -k "pairs or real_shapes or act_order or prepared or gpu_quantized" -s \
          > "$R/pytest_pairs34.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_pairs34.log"
        cp "$R/pytest_pairs34.log" "$OUT/"
        grep -a "AWQ bf16:" "$R/pytest_pairs34.log"; tail -3 "$R/pytest_pairs34.log"
        timeout 120 python3 benchmarks/quant_matmul_bench.py --out "$R/pairs34" --rows 1,8,16,32,64,128 \
          --repeats 5 > "$R/pairs34_matmul.log" 2>&1
        cp "$R/pairs34_matmul.log" "$OUT/"
        tail -26 "$R/pairs34_matmul.log"
        timeout 180 python3 benchmarks/engine_benchmarks.py --out "$R/pairs34" --quantization awq \
          --sections start,decode,seeds --decode-contexts 1024 > "$R/pairs34_awq.log" 2>&1
        cp "$R/pairs34_awq.log" "$OUT/"
        tail -12 "$R/pairs34_awq.log"
        timeout 100 python3 benchmarks/quant_matmul_bench.py --out "$R/pairs34" --pairs-sweep \
          --sweep-rows 16,32,64,128 > "$R/pairs34_sweep.log" 2>&1
        cp "$R/pairs34_sweep.log" "$OUT/"
        tail -17 "$R/pairs34_sweep.log"
        timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/pairs34/bf16" --sections decode \
          --decode-contexts 1024 > "$R/pairs34_bf16.log" 2>&1
        cp "$R/pairs34_bf16.log" "$OUT/"
        tail -4 "$R/pairs34_bf16.log" ;;
    lop34) # The 4-bit matmul dequantizing two values per instruction (benchmarks/quant_lop3_probe.py) against the
        # engine's kernel and cuBLAS bf16 at the 7B shapes, 16 and 64 rows.
        timeout 560 python3 benchmarks/quant_lop3_probe.py --out "$R/lop34" > "$R/lop34.log" 2>&1
        echo "lop34 rc=$?" >> "$R/lop34.log"
        tail -10 "$R/lop34.log"
        cp "$R/lop34.log" "$OUT/" ;;
    swap34) # The 4-bit matmul with the weight as the MMA's first operand (benchmarks/quant_swap_probe.py) against
        # the engine's kernel and cuBLAS bf16 at the 7B shapes, 16 and 64 rows.
        timeout 540 python3 benchmarks/quant_swap_probe.py --out "$R/swap34" > "$R/swap34.log" 2>&1
        echo "swap34 rc=$?" >> "$R/swap34.log"
        tail -12 "$R/swap34.log"
        cp "$R/swap34.log" "$OUT/" ;;
    quant33) # AWQ / GPTQ: the quantized matmul's and the engine's GPU tests, the matmul against bf16 at the 7B
        # shapes, and the engine at the 7B shape with random 4-bit AWQ weights (start, decode 1 / 8 / 64 x 1k, TTFT,
        # the seeds' workload) beside the bf16 engine's decode on the same host.
        timeout 400 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_triton_quant.py \
          tests/gpu/test_gpu_quantized.py > "$R/pytest_quant33.log" 2>&1
        echo "pytest rc=$?" >> "$R/pytest_quant33.log"
        tail -5 "$R/pytest_quant33.log"
        timeout 300 python3 benchmarks/quant_matmul_bench.py --out "$R/quant33" > "$R/quant33_matmul.log" 2>&1
        tail -45 "$R/quant33_matmul.log"
        timeout 420 python3 benchmarks/engine_benchmarks.py --out "$R/quant33" --quantization awq \
          --sections start,decode,ttft,seeds --decode-contexts 1024 > "$R/quant33_awq.log" 2>&1
        tail -16 "$R/quant33_awq.log"
        timeout 300 python3 benchmarks/engine_benchmarks.py --out "$R/quant33/bf16" --sections start,decode \
          --decode-contexts 1024 > "$R/quant33_bf16.log" 2>&1
        tail -8 "$R/quant33_bf16.log"
        cp "$R"/pytest_quant33.log "$R"/quant33_*.log "$OUT/" ;;
    tp32a) # Tensor parallelism on two GPUs (nvidia-h200-x2): tests/gpu/test_gpu_tensor_parallel.py (two ranks against
        # one, float32 and bfloat16, CUDA graphs and eager). NCCL's NVLink multicast off (the device's rule).
        NCCL_NVLS_ENABLE=0 timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_tensor_parallel.py \
          > "$R/pytest_tp32a.log" 2>&1
        cp "$R/pytest_tp32a.log" "$OUT/" ;;
    tp32c) # One GPU: the engine's all-reduces through a one-rank NCCL group, captured in its CUDA graphs in the
        # tensor-parallel capture mode, against the plain engine (benchmarks/tp_collectives_probe.py).
        timeout 240 python3 benchmarks/tp_collectives_probe.py > "$R/tp32c.log" 2>&1
        echo "tp32c rc=$?" >> "$R/tp32c.log"
        cp "$R/tp32c.log" "$OUT/" ;;
    tp32b) # The 7B shape on two GPUs against one, one host: start, decode at batch 1 / 64 x 1k, the seeds' and the
        # 256-sequence workloads (TP_SIZES: the order, default "2 1").
        for tp in ${TP_SIZES:-2 1}; do
          NCCL_NVLS_ENABLE=0 timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/tp32b_$tp" \
            --tensor-parallel-size $tp --sections start,decode,seeds,random256 --decode-batches 1,64 \
            --decode-contexts 1024 > "$R/tp32b_$tp.log" 2>&1
          echo "=== tp $tp" >> "$R/tp32b.log"
          grep -E "^decode|^seeds|^256|^engine start|^  *[0-9]|Error|Traceback" "$R/tp32b_$tp.log" | head -40 >> "$R/tp32b.log"
        done
        cp "$R/tp32b.log" "$OUT/" ;;
    asc31b) # The engine's host time per decode step at the SmolLM2-135M shape (hostprof at 64 x 1k and 256 x 900), then
        # 0.5B-shape servers x1, x4, x1, x4 (--api-server-count), each loaded by two kvserve bench processes at once
        # (128 streams each: 512 requests of 256 in / 256 out; then 128 requests each of 512 in / 256 out at once),
        # so one client process's CPU is not the limit. Summary lines in $R/api30.log. Needs .carry/tok.
        timeout 150 python3 benchmarks/engine_benchmarks.py --model smollm2-135m --sections hostprof \
          --hostprof-cases 64x1024,256x900 --out "$R/asc31b_hostprof" > "$R/asc31b_hostprof.log" 2>&1
        grep -E "^host profile|^engine start" "$R/asc31b_hostprof.log" >> "$R/api30.log"
        n=0
        for count in 1 4 1 4; do
          n=$((n + 1))
          serve_shape qwen2.5-0.5b "$R/asc31b_server_$n.log" --api-server-count $count
          for load in closed256 burst512; do
            if [ $load = closed256 ]; then args="--concurrency 128 --num-prompts 512 --input-len 256 --max-tokens 256"
            else args="--request-rate inf --num-prompts 128 --input-len 512 --max-tokens 256"; fi
            t0=$(api_ticks)
            pids=""
            for c in 1 2; do
              PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
                --model qwen2-7b $args --warmup 4 --ignore-eos --tokenizer "$dir" --no-progress \
                --json "$R/asc31b_${n}_${load}_$c.json" > "$R/asc31b_bench_${n}_${load}_$c.log" 2>&1 &
              pids="$pids $!"
            done
            wait $pids
            t1=$(api_ticks)
            python3 - "$R/asc31b_${n}_${load}_1.json" "$R/asc31b_${n}_${load}_2.json" "$count" "$n" "$load" "$t0" "$t1" \
              "$(getconf CLK_TCK)" >> "$R/api30.log" 2>&1 <<'PY'
import json, sys
runs = [json.load(open(p))["runs"][-1] for p in sys.argv[1:3]]
count, n, load, t0, t1, hz = sys.argv[3], sys.argv[4], sys.argv[5], *map(int, sys.argv[6:9])
tokens = sum(r["summary"]["total_output_tokens"] for r in runs)
span = max(r["summary"]["duration_s"] for r in runs)
each = " + ".join(f"{r['summary']['output_throughput']:.0f}" for r in runs)
cpu = " / ".join(f"{r['summary']['client']['cpu_percent']:.0f}%" for r in runs)
ttft = " / ".join(f"{r['summary']['ttft']['median_ms']:.0f}" for r in runs)
itl = " / ".join(f"{r['summary']['itl']['median_ms']:.1f}" for r in runs)
done = sum(r["summary"]["completed"] for r in runs)
print(f"server {n} x{count} qwen2.5-0.5b {load} two clients: {tokens / span:.0f} tok/s ({tokens} tokens over the longer "
      f"run's {span:.2f} s; each {each}), completed {done}; TTFT p50 {ttft} ms; ITL p50 {itl} ms; client CPU {cpu}; "
      f"API {(t1 - t0) / hz:.2f} CPU-s, {1e6 * (t1 - t0) / hz / max(tokens, 1):.0f} us a token")
PY
            gzip -f "$R"/asc31b_${n}_${load}_*.json
          done
          kill -TERM $server; wait $server
          tar czf "$OUT/results.tgz" -C "$R" .
        done ;;
    asc31) # --api-server-count: servers of the plan ASC31_PLAN (SHAPE:COUNT ...), each with the loads that fit the
        # shape: closed256 (256 streams, 1,024 requests of 256 in / 256 out) and burst512 (256 requests of 512 in /
        # 256 out at once) for the small shapes, a 256-request burst and a seeds' run for the 7B. First, when
        # ASC31_ENGINE=1, the 0.5B shape's engine alone on burst512's load (as api30c). The API processes' CPU
        # (all of them) over each bench process. Lines in $R/api30.log ("server N COUNT ..."). Needs .carry/tok.
        if [ "${ASC31_ENGINE:-0}" = 1 ]; then
          timeout 150 python3 benchmarks/engine_benchmarks.py --model qwen2.5-0.5b --sections start,seeds --scale 5.12 \
            --out "$R/asc31_engine" > "$R/asc31_engine.log" 2>&1
          grep -E "^seeds|^engine start" "$R/asc31_engine.log" >> "$R/api30.log"
        fi
        n=0
        for entry in ${ASC31_PLAN:-qwen2.5-0.5b:1 qwen2.5-0.5b:2 qwen2.5-0.5b:4}; do
          shape=${entry%:*} count=${entry#*:}
          n=$((n + 1))
          serve_shape $shape "$R/asc31_server_$n.log" --api-server-count $count
          loads="closed256 burst512"; [ $shape = qwen2.5-7b ] && loads="burst256 seeds"
          for load in $loads; do
            case $load in
              closed256) args="--concurrency 256 --num-prompts 1024 --input-len 256 --max-tokens 256" ;;
              burst512) args="--request-rate inf --num-prompts 256 --input-len 512 --max-tokens 256" ;;
              *) args=$(bench_load_args $load) ;;
            esac
            api30_bench "$R/asc31_${n}_$load.json" "$R/asc31_bench_${n}_$load.log" "x$count" "$n" "$shape $load" $args
          done
          kill -TERM $server; wait $server
          tar czf "$OUT/results.tgz" -C "$R" .  # a call cut short still returns the servers that ran
        done ;;
    api30c) # The final code at the 0.5B shape: the engine alone (engine_benchmarks.py's seeds section at --scale 5.12:
        # 256 sequences of 512 in / 256 out at once), then one server (this tree) with the same load through HTTP
        # twice (256 requests at once, 512 in / 256 out) and one closed256 run as in api30 (API30C_LOADS: another
        # list of burst512 / closed256). Needs .carry/tok.
        timeout 150 python3 benchmarks/engine_benchmarks.py --model qwen2.5-0.5b --sections start,seeds --scale 5.12 \
          --out "$R/api30c_engine" > "$R/api30c_engine.log" 2>&1
        grep -E "^seeds|^engine start" "$R/api30c_engine.log" >> "$R/api30.log"
        serve_shape qwen2.5-0.5b "$R/api30c_server.log"
        n=0
        for load in ${API30C_LOADS:-burst512 burst512 closed256}; do
          n=$((n + 1))
          if [ $load = closed256 ]; then args="--concurrency 256 --num-prompts 1024 --input-len 256 --max-tokens 256"
          else args="--request-rate inf --num-prompts 256 --input-len 512 --max-tokens 256"; fi
          api30_bench "$R/api30c_${n}_$load.json" "$R/api30c_bench_${n}_$load.log" new "$n" "qwen2.5-0.5b $load" $args
          tar czf "$OUT/results.tgz" -C "$R" .
        done
        kill -TERM $server; wait $server ;;
    api30|api30b) # Queued stream updates merged into one chunk (this tree) against one chunk per update (the tree before,
        # carried as .carry/oldkv: git archive 241149c kvserve | tar -x -C .carry/oldkv). Servers old, new, old,
        # new of the Qwen2.5-0.5B shape (an engine that streams faster than the 7B's): 256 streams in flight, 1,024
        # requests of 256 in / 256 out; then servers old, new, old, new of the 7B shape, each a 256-request burst
        # and a seeds' run. The API process's CPU (/proc) over each bench process. Needs .carry/tok.
        # api30b: the same for the plan below (the reader's slice and its cheaper per-token work added).
        plan="qwen2.5-0.5b:old qwen2.5-0.5b:new qwen2.5-0.5b:old qwen2.5-0.5b:new"
        if [ $step = api30 ]; then plan="$plan qwen2.5-7b:old qwen2.5-7b:new qwen2.5-7b:old qwen2.5-7b:new"
        else plan="$plan qwen2.5-7b:new qwen2.5-7b:old"; fi
        n=0
        for entry in $plan; do
            shape=${entry%:*} mode=${entry#*:}
            n=$((n + 1))
            tree=$PWD; [ $mode = old ] && tree=$PWD/.carry/oldkv
            SERVE_TREE=$tree serve_shape $shape "$R/api30_server_$n.log"
            loads="closed256"; [ $shape = qwen2.5-7b ] && loads="burst256 seeds"
            for load in $loads; do
              if [ $load = closed256 ]; then args="--concurrency 256 --num-prompts 1024 --input-len 256 --max-tokens 256"
              else args=$(bench_load_args $load); fi
              api30_bench "$R/api30_${n}_${mode}_$load.json" "$R/api30_bench_${n}_$load.log" "$mode" "$n" "$shape $load" $args
            done
            kill -TERM $server; wait $server
            tar czf "$OUT/results.tgz" -C "$R" .  # a call cut short still returns the servers that ran
        done ;;
    client29b) # The final client code alone: bench_client_cpu.py at the two shapes of client29, then one 7B-shape server
        # and two bench processes, each a seeds' run and a 256-request burst as in client29. Needs .carry/tok.
        for shape in "--concurrency 50 --requests 200 --tokens 256 --period-ms 5" \
                     "--concurrency 256 --requests 512 --tokens 128 --period-ms 20"; do
          PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/bench_client_cpu.py $shape --label aiohttp \
            >> "$R/client29b.log" 2>&1
        done
        serve_7b "$R/client29b_server.log"
        for n in 1 2; do
          for load in seeds burst256; do
            json="$R/client29b_${n}_$load.json"
            args=$(bench_load_args $load)
            PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
              --model qwen2-7b $args --warmup 8 --ignore-eos --tokenizer "$dir" --no-progress --json "$json" \
              > "$R/client29b_bench_${n}_$load.log" 2>&1
            python3 - "$json" "$n" "$load" >> "$R/client29b.log" 2>&1 <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["runs"][-1]
s, recs = run["summary"], run["records"]
gaps = [g for r in recs for g in r["itl_s"]]
near0 = 100.0 * sum(g < 0.001 for g in gaps) / max(len(gaps), 1)
wait = 1e3 * sum(r.get("queued_s") or 0.0 for r in recs) / len(recs)
print(f"process {sys.argv[2]} {sys.argv[3]:8s}: output {s['output_throughput']:.0f} tok/s, completed {s['completed']}/"
      f"{s['num_requests']}; TTFT p50 {s['ttft']['median_ms']:.1f} ms; ITL p50 {s['itl']['median_ms']:.2f} P99 "
      f"{s['itl']['p99_ms']:.1f} ms, {near0:.1f} % of gaps < 1 ms; mean wait {wait:.1f} ms; client CPU "
      f"{s['client']['cpu_percent']:.0f}%, lag P99 {s['client']['loop_lag_p99_ms']:.1f} ms")
PY
            gzip -f "$json"
          done
        done
        kill -TERM $server; wait $server ;;
    api29) # Ran at 84918b8 (uvloop + httptools, removed after this measurement: docs/perf_notes.md entry 48).
        # The API process on uvloop + httptools (that tree's default) against asyncio's loop + h11 (KVSERVE_UVLOOP=0
        # and a wheel directory without httptools or uvloop): servers new, base, new, base, each one 256-request
        # burst (lengths uniform in about [100, 1024]) and one seeds' run (50 in flight, 512 / 256, 200 prompts),
        # 8 warm-up requests, the API process's CPU (/proc) over each run. The bench client is this tree's in
        # every case. Needs .carry/tok.
        cp -r /tmp/site /tmp/site_base && rm -rf /tmp/site_base/httptools* /tmp/site_base/uvloop*
        n=0
        for mode in new base new base; do
          n=$((n + 1))
          if [ $mode = new ]; then SERVE_SITE=/tmp/site serve_7b "$R/api29_server_$n.log"
          else KVSERVE_UVLOOP=0 SERVE_SITE=/tmp/site_base serve_7b "$R/api29_server_$n.log"; fi
          grep -o "event loop [a-z]*" "$R/api29_server_$n.log" | head -1 | sed "s/^/server $n $mode: /" >> "$R/api29.log"
          for load in burst256 seeds; do
            json="$R/api29_${n}_${mode}_$load.json"
            args=$(bench_load_args $load)
            t0=$(awk '{print $14 + $15}' /proc/$server/stat)
            PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
              --model qwen2-7b $args --warmup 8 --ignore-eos --tokenizer "$dir" --no-progress --json "$json" \
              > "$R/api29_bench_${n}_$load.log" 2>&1
            t1=$(awk '{print $14 + $15}' /proc/$server/stat)
            python3 - "$json" "$mode" "$n" "$load" "$t0" "$t1" "$(getconf CLK_TCK)" >> "$R/api29.log" 2>&1 <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["runs"][-1]
s, recs = run["summary"], run["records"]
gaps = [g for r in recs for g in r["itl_s"]]
near0 = 100.0 * sum(g < 0.001 for g in gaps) / max(len(gaps), 1)
api_s = (int(sys.argv[6]) - int(sys.argv[5])) / int(sys.argv[7])
tokens = sum(r.get("output_tokens") or 0 for r in recs)
print(f"process {sys.argv[3]} {sys.argv[2]:4s} {sys.argv[4]:8s}: output {s['output_throughput']:.0f} tok/s, completed "
      f"{s['completed']}/{s['num_requests']}; TTFT p50 {s['ttft']['median_ms']:.1f} ms; ITL p50 {s['itl']['median_ms']:.2f} "
      f"p90 {s['itl']['p90_ms']:.1f} P99 {s['itl']['p99_ms']:.1f} ms, {near0:.1f} % of gaps < 1 ms; TPOT p50 "
      f"{s['tpot']['median_ms']:.2f} ms; API process {api_s:.2f} CPU-s over the bench (warm-up too), "
      f"client CPU {s['client']['cpu_percent']:.0f}%")
PY
            gzip -f "$json"
          done
          kill -TERM $server; wait $server
        done ;;
    client29) # kvserve bench's streaming client: aiohttp (this tree) against httpx (913b519's client, carried as
        # .carry/oldkv/kvserve: git archive 913b519 kvserve | tar -x -C .carry/oldkv; needs .carry/oldkv and .carry/tok). First the client alone against a paced stand-in
        # server (bench_client_cpu.py), then through one 7B-shape server (default flags): bench processes new, old,
        # new, old, each a seeds' run (50 in flight, 512 in / 256 out, 200 prompts) and a 256-request burst with
        # lengths uniform in about [100, 1024] (--request-rate inf).
        for shape in "--concurrency 50 --requests 200 --tokens 256 --period-ms 5" \
                     "--concurrency 256 --requests 512 --tokens 128 --period-ms 20"; do
          PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/bench_client_cpu.py $shape --label aiohttp \
            >> "$R/client29.log" 2>&1
          (cd .carry/oldkv && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 ../../benchmarks/bench_client_cpu.py \
            $shape --label httpx-913b519) >> "$R/client29.log" 2>&1
        done
        serve_7b "$R/client29_server.log"
        n=0
        for mode in new old new old; do
          n=$((n + 1))
          for load in seeds burst256; do
            json="$R/client29_${n}_${mode}_$load.json"
            args=$(bench_load_args $load)
            where=$PWD; [ $mode = old ] && where=$PWD/.carry/oldkv
            (cd "$where" && PYTHONPATH=/tmp/site:$where timeout 90 python3 -m kvserve bench \
              --endpoint http://localhost:8000/v1/completions --model qwen2-7b $args --warmup 8 --ignore-eos \
              --tokenizer "$dir" --no-progress --json "$json") > "$R/client29_bench_${n}_$load.log" 2>&1
            python3 - "$json" "$mode" "$n" "$load" >> "$R/client29.log" 2>&1 <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["runs"][0]["summary"]
c = s["client"]
print(f"process {sys.argv[3]} {sys.argv[2]:3s} {sys.argv[4]:8s}: output {s['output_throughput']:.0f} tok/s, completed "
      f"{s['completed']}/{s['num_requests']}, {s['duration_s']:.2f} s; TTFT p50 {s['ttft']['median_ms']:.1f} ms; ITL p50 "
      f"{s['itl']['median_ms']:.2f} P99 {s['itl']['p99_ms']:.1f} ms; TPOT p50 {s['tpot']['median_ms']:.2f} ms; client CPU "
      f"{c['cpu_percent']:.0f}%, lag P99 {c['loop_lag_p99_ms']:.1f} ms")
PY
            gzip -f "$json"
          done
        done
        kill -TERM $server; wait $server ;;
    pytest28) timeout ${PYTEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not gguf" > "$R/pytest28.log" 2>&1
        cp "$R/pytest28.log" "$OUT/" ;;
    cublas28) # benchmarks/cublas_first_use.py: the host time of a matmul at row counts not seen before, the GPU busy.
        timeout 120 python3 benchmarks/cublas_first_use.py \
          --rows 47,48,50,100,200,2100,2500,3000,3001,3500,4000,5000,6000,7000,8000,8191 > "$R/cublas28.log" 2>&1
        echo "cublas28 rc=$?" >> "$R/cublas28.log"
        cp "$R/cublas28.log" "$OUT/" ;;
    firstburst28) # a fresh server's first load (default flags): one bench process, 50 concurrent requests, 512 in /
        # 256 out, 10 s (FIRSTBURST_DURATION) after 8 warm-up requests; itl_stalls' groups (session 28's call1: a 275-ms gap at 0.66 s,
        # with no client stall, against 150-200 ms later). Needs .carry/tok.
        serve_7b "$R/firstburst28_server.log"
        json="$R/firstburst28.json"
        PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
          --model qwen2-7b --concurrency 50 --duration ${FIRSTBURST_DURATION:-10} --warmup 8 --input-len 512 \
          --max-tokens 256 --ignore-eos --tokenizer "$dir" --no-progress --json "$json" > "$R/firstburst28_bench.log" 2>&1
        python3 benchmarks/itl_stalls.py "$json" > "$R/firstburst28.log" 2>&1
        grep -E "ITL|lag|GC pause" "$R/firstburst28_bench.log" >> "$R/firstburst28.log"
        gzip "$json"
        kill -TERM $server; wait $server
        grep -E "engine ready|warm" "$R/firstburst28_server.log" | cut -c1-200 >> "$R/firstburst28.log" ;;
    firstpass28w) # firstpass28's plain run with the LM head warmed at every row count last at start (the engine's
        # default), before the graph capture, and not at all; a fresh engine each.
        for where in last before-capture none; do
          firstpass_engine firstpass28w $where "" --sampled-rows-warmup $where
        done
        grep -E "firstpass pass|firstpass28w" "$R/firstpass28w_full.log" >> "$R/firstpass28w.log"
        cp "$R/firstpass28w.log" "$OUT/" ;;
    firstpass28s) # firstpass28 with every pass under torch.profiler (shapes recorded): the 12 single calls that held
        # the host longest in each pass, with their shapes (pass 1's aten::mm held it 333 ms, later passes 5-7).
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/firstpass28s" --sections firstpass \
          --firstpass-profile > "$R/firstpass28s_full.log" 2>&1
        echo "firstpass28s rc=$?" >> "$R/firstpass28s_full.log"
        grep -E "firstpass pass [0-9] \(|slow call|firstpass28s rc" "$R/firstpass28s_full.log" > "$R/firstpass28s.log"
        cp "$R/firstpass28s.log" "$OUT/" ;;
    sweep28) # kvserve bench --sweep-concurrency 50,50 against one server (default flags), after the fix that gives
        # each point its own prompts: the second point should no longer hit the prefix cache. Needs .carry/tok.
        serve_7b "$R/sweep28_server.log"
        json="$R/sweep28.json"
        PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
          --model qwen2-7b --sweep-concurrency 50,50 --duration 10 --warmup 8 --input-len 512 --max-tokens 256 \
          --ignore-eos --tokenizer "$dir" --no-progress --json "$json" > "$R/sweep28.log" 2>&1
        python3 benchmarks/itl_stalls.py "$json" > "$R/sweep28_stalls.log" 2>&1
        gzip "$json"
        kill -TERM $server; wait $server
        grep "prefix cache hit rate" "$R/sweep28_server.log" | tail -4 >> "$R/sweep28.log" ;;
    abclient27) # kvserve bench's client heap frozen or not, no probe: one server (default flags); bench processes with
        # KVSERVE_GC_FREEZE=1, 0, 0, 1 (ABCLIENT_MODES), each two runs of 50 concurrent requests, 512 in / 256 out,
        # 10 s (--sweep-concurrency 50,50). Summaries are copied to $OUT after each process. Needs .carry/tok.
        serve_7b "$R/abclient27_server.log"
        n=0
        for freeze in ${ABCLIENT_MODES:-1 0 0 1}; do
          n=$((n + 1))
          json="$R/abclient27_${n}_freeze$freeze.json"
          KVSERVE_GC_FREEZE=$freeze PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m kvserve bench \
            --endpoint http://localhost:8000/v1/completions --model qwen2-7b --sweep-concurrency 50,50 --duration 10 \
            --warmup 8 --input-len 512 --max-tokens 256 --ignore-eos --tokenizer "$dir" --no-progress --json "$json" \
            > "$R/abclient27_bench_$n.log" 2>&1
          python3 - "$json" "$freeze" "$n" >> "$R/abclient27.log" 2>&1 <<'PY'
import json, sys
for i, run in enumerate(json.load(open(sys.argv[1]))["runs"]):
    s = run["summary"]; itl, c = s["itl"], s["client"]
    print(f"abclient process {sys.argv[3]} freeze {sys.argv[2]} run {i + 1}: output {s['output_throughput']:.0f} tok/s, completed "
          f"{s['completed']}, ITL P99 {itl['p99_ms']:.1f} max {itl['max_ms']:.1f} ms; client lag P99 "
          f"{c['loop_lag_p99_ms']:.1f} max {c['loop_lag_max_ms']:.1f} ms, {c['gc_collections']} collections, "
          f"longest {c['gc_pause_max_ms']:.1f} ms")
PY
          python3 benchmarks/itl_stalls.py "$json" >> "$R/abclient27_stalls.log" 2>&1
          gzip "$json"
          cp "$R/abclient27.log" "$R/abclient27_stalls.log" "$OUT/" 2>/dev/null
        done
        kill -TERM $server; wait $server ;;
    gcprobe27) # kvserve bench's client under benchmarks/bench_gc_probe.py (each collection's generation, wall and
        # thread-CPU time; the cgroup's throttling counters): one server (default flags), client freeze on / off / on.
        serve_7b "$R/gcprobe27_server.log"
        cat /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null > "$R/gcprobe27.log"; nproc >> "$R/gcprobe27.log"
        run=0
        for freeze in ${GCPROBE_MODES:-1 0 1}; do
          run=$((run + 1))
          json="$R/gcprobe27_${run}_freeze$freeze.json"
          echo "=== run $run, client freeze $freeze" >> "$R/gcprobe27.log"
          KVSERVE_GC_FREEZE=$freeze PYTHONPATH=/tmp/site:$PWD timeout 90 python3 benchmarks/bench_gc_probe.py \
            --log "$R/gcprobe27_${run}_collections.json" -- bench --endpoint http://localhost:8000/v1/completions \
            --model qwen2-7b --concurrency 50 --duration 20 --warmup 8 --input-len 512 --max-tokens 256 \
            --ignore-eos --tokenizer "$dir" --no-progress --json "$json" > "$R/gcprobe27_bench_$run.log" 2>&1
          grep -E "gc probe|ITL \(|lag|GC" "$R/gcprobe27_bench_$run.log" >> "$R/gcprobe27.log"
          gzip "$json"
        done
        kill -TERM $server; wait $server ;;
    client27) # kvserve bench's client heap frozen during each run (KVSERVE_GC_FREEZE for the client only) or not:
        # one server at the default --max-num-batched-tokens 8192, client on / off / on / off; then servers at 2048
        # and 4096, client on, two runs each. 50 concurrent requests, 512 in / 256 out, 20 s. Needs .carry/tok.
        for plan in "8192:1 0 1 0" "2048:1 1" "4096:1 1"; do
          mnbt=${plan%%:*}
          serve_7b "$R/client27_server_$mnbt.log" --max-num-batched-tokens $mnbt
          run=0
          for freeze in ${plan#*:}; do
            run=$((run + 1))
            json="$R/client27_${mnbt}_${run}_freeze$freeze.json"
            KVSERVE_GC_FREEZE=$freeze PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m kvserve bench \
              --endpoint http://localhost:8000/v1/completions \
              --model qwen2-7b --concurrency 50 --duration 20 --warmup 8 --input-len 512 --max-tokens 256 \
              --ignore-eos --tokenizer "$dir" --no-progress --json "$json" > "$R/client27_bench.log" 2>&1
            echo "=== max-num-batched-tokens $mnbt, run $run on this server, client freeze $freeze" >> "$R/client27.log"
            python3 - "$json" >> "$R/client27.log" 2>&1 <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["runs"][-1]["summary"]
itl, tpot, ttft, c = s["itl"], s["tpot"], s["ttft"], s["client"]
print(f"client result: output {s['output_throughput']:.0f} tok/s, completed {s['completed']}, TPOT mean "
      f"{tpot['mean_ms']:.2f} ms, ITL P50 {itl['median_ms']:.2f} P99 {itl['p99_ms']:.2f} max {itl['max_ms']:.1f} ms, "
      f"TTFT mean {ttft['mean_ms']:.1f} P99 {ttft['p99_ms']:.1f} ms; client lag P99 {c['loop_lag_p99_ms']:.1f} max "
      f"{c['loop_lag_max_ms']:.1f} ms, {c.get('gc_collections')} collections, longest {c.get('gc_pause_max_ms', 0):.1f} ms")
PY
            python3 benchmarks/itl_stalls.py "$json" >> "$R/client27_stalls.log" 2>&1
            grep -E "^stalls that" "$R/client27_stalls.log" | tail -1 >> "$R/client27.log"
            gzip "$json"
          done
          grep -E "WARNING|Error" "$R/client27_server_$mnbt.log" | head -5 >> "$R/client27.log"
          kill -TERM $server; wait $server
        done ;;
    mnbt27) # kvserve serve at --max-num-batched-tokens 8192 / 2048 / 4096 / 8192 / 2048, each server fresh: two
        # bench runs of 50 concurrent requests, 512 in / 256 out (ignore EOS), 20 s each; throughput, TTFT, ITL P99
        # and maximum, and benchmarks/itl_stalls.py's stall groups. Needs .carry/tok.
        for mnbt in 8192 2048 4096 8192 2048; do
          serve_7b "$R/mnbt27_server_$mnbt.log" --max-num-batched-tokens $mnbt
          for run in 1 2; do
            json="$R/mnbt27_${mnbt}_$(date +%s)_$run.json"
            PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
              --model qwen2-7b --concurrency 50 --duration 20 --warmup 8 --input-len 512 --max-tokens 256 \
              --ignore-eos --tokenizer "$dir" --no-progress --json "$json" > "$R/mnbt27_bench.log" 2>&1
            echo "=== max-num-batched-tokens $mnbt, run $run on this server" >> "$R/mnbt27.log"
            python3 - "$json" >> "$R/mnbt27.log" 2>&1 <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["runs"][-1]["summary"]
itl, tpot, ttft = s["itl"], s["tpot"], s["ttft"]
print(f"mnbt result: output {s['output_throughput']:.0f} tok/s, completed {s['completed']}, TPOT mean "
      f"{tpot['mean_ms']:.2f} ms, ITL mean {itl['mean_ms']:.2f} P99 {itl['p99_ms']:.2f} max {itl['max_ms']:.1f} ms, "
      f"TTFT mean {ttft['mean_ms']:.1f} P99 {ttft['p99_ms']:.1f} ms")
PY
            python3 benchmarks/itl_stalls.py "$json" >> "$R/mnbt27_stalls.log" 2>&1
            grep -E "^stalls that" "$R/mnbt27_stalls.log" | tail -1 >> "$R/mnbt27.log"
            gzip "$json"
          done
          grep -E "WARNING|Error" "$R/mnbt27_server_$mnbt.log" | head -5 >> "$R/mnbt27.log"
          kill -TERM $server; wait $server
        done ;;
    gcserve26) # kvserve serve with its processes' start-up heaps frozen or not (KVSERVE_GC_FREEZE), on / off / on / off:
        # 50 concurrent requests, 512 in / 256 out (ignore EOS) for 20 s; the bench's ITL P99 and maximum. Needs .carry/tok.
        dir=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w("qwen2.5-7b"))')
        for mode in on off on off; do
          freeze=1; [ $mode = off ] && freeze=0
          KVSERVE_GC_FREEZE=$freeze PYTHONPATH=/tmp/site:$PWD python3 -m kvserve serve "$dir" --load-format dummy \
            --served-model-name qwen2-7b --port 8000 --disable-log-requests --disable-uvicorn-access-log \
            > "$R/gcserve26_server_$mode.log" 2>&1 &
          server=$!
          for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
          echo "=== server, freeze $mode" >> "$R/gcserve26.log"
          grep -E "start-up objects" "$R/gcserve26_server_$mode.log" >> "$R/gcserve26.log"
          PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
            --model qwen2-7b --concurrency 50 --duration 20 --warmup 8 --input-len 512 --max-tokens 256 \
            --ignore-eos --tokenizer "$dir" --no-progress --json "$R/gcserve26_${mode}.json" > "$R/gcserve26_bench_$mode.log" 2>&1
          python3 - "$R/gcserve26_${mode}.json" >> "$R/gcserve26.log" 2>&1 <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["runs"][-1]["summary"]
itl, tpot, ttft = s["itl"], s["tpot"], s["ttft"]
print(f"freeze result: output {s['output_throughput']:.0f} tok/s, completed {s['completed']}, TPOT mean "
      f"{tpot['mean_ms']:.2f} ms, ITL mean {itl['mean_ms']:.2f} P99 {itl['p99_ms']:.2f} max {itl['max_ms']:.1f} ms, "
      f"TTFT mean {ttft['mean_ms']:.1f} max {ttft['max_ms']:.1f} ms")
PY
          kill -TERM $server; wait $server
        done ;;
    gc26) # the engine's start-up heap frozen (gc.freeze) or not, off / on / off / on (call2 ran it at d44e01d, where a
        # --gc-freeze flag of the benchmark froze it; since then make_engine freezes unless KVSERVE_GC_FREEZE=0)
        for mode in off on off on; do
          freeze=1; [ $mode = off ] && freeze=0
          KVSERVE_GC_FREEZE=$freeze timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/gc26_$mode" \
            --sections start,shared,seeds,random256 >> "$R/gc26.log" 2>&1
          echo "mode $mode done" >> "$R/gc26.log"
        done ;;
    bisect26) for c in head old_c8a6828 old_4d2e64e old_5aadfc9 head old_c8a6828; do
          dir=.; [ $c = head ] || dir=.carry/$c
          secs=start,shared; case $c in head|old_c8a6828) [ -f "$R/bisect26_trace_$c" ] || secs=start,shared,trace ;; esac
          touch "$R/bisect26_trace_$c"
          echo "=== tree $c" >> "$R/bisect26.log"
          timeout 100 python3 $dir/benchmarks/engine_benchmarks.py --out "$R/bisect26_$c" --sections $secs \
            --trace-workloads shared_prefix >> "$R/bisect26.log" 2>&1
          echo "tree $c done" >> "$R/bisect26.log"
        done ;;
    shared22) for mode in on off on off; do
          flags=""; [ $mode = off ] && flags="--piecewise-max-tokens 0"
          timeout 80 python3 benchmarks/engine_benchmarks.py --out "$R/shared22_$mode" --sections start,shared $flags \
            >> "$R/shared22.log" 2>&1
          echo "mode $mode done" >> "$R/shared22.log"
        done ;;
    pytest22c) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not gguf" > "$R/pytest22c.log" 2>&1 ;;
    hostcopy22) timeout 90 python3 benchmarks/engine_benchmarks.py --out "$R/hostcopy22" --sections start,seeds,random256 \
          --time-host-copies > "$R/hostcopy22.log" 2>&1 ;;
    pytest22b) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_piecewise.py \
          tests/gpu/test_gpu_engine.py -k "piecewise or weak or collected" > "$R/pytest22b.log" 2>&1
        echo "=== the collection test with the garbage collector's pause disabled (must fail)" >> "$R/pytest22b.log"
        timeout 60 python3 -c "import gc, sys, pytest; gc.disable = lambda: None; sys.exit(pytest.main(['-q', '-p', \
          'no:cacheprovider', 'tests/gpu/test_gpu_piecewise.py', '-k', 'collected']))" >> "$R/pytest22b.log" 2>&1 ;;
    start22) for mode in lean torch lean torch; do
          timeout 60 python3 benchmarks/engine_benchmarks.py --out "$R/start22_$mode" --sections start \
            --graph-capture $mode >> "$R/start22.log" 2>&1
          echo "mode $mode done" >> "$R/start22.log"
        done ;;
    copy22) # ran at 0a66cc4 (session 22 call 2); model_runner.HOST_COPY_STREAM and --host-copy were removed after it
        for mode in side inline side inline; do
          timeout 75 python3 benchmarks/engine_benchmarks.py --out "$R/copy22_$mode" --sections start,seeds,random256 \
            --host-copy $mode >> "$R/copy22.log" 2>&1
          echo "mode $mode done" >> "$R/copy22.log"
        done
        timeout 70 python3 benchmarks/engine_benchmarks.py --out "$R/copy22_gaps" --sections tprofile --tprofile-windows 1 \
          --tprofile-steps 20 --tprofile-host >> "$R/copy22.log" 2>&1 ;;
    pytest21) timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py \
          -k "cuda_graph_matches or piecewise or prefill_graphs or padding_to" > "$R/pytest21.log" 2>&1 ;;
    pw21d) timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/pw21d" --sections start,mixed,decode,ttft \
          --mixed-cases 8x1024x64,16x1024x128,32x1024x256 --mixed-cycles 6 --decode-batches 1,64 \
          --decode-contexts 1024 > "$R/pw21d.log" 2>&1 ;;
    pw21c) timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/pw21c" --sections mixed \
          --mixed-cases 16x1024x128,32x1024x256 --mixed-cycles 4 > "$R/pw21c.log" 2>&1 ;;
    pw21b) for mode in on off on off; do
          flags=""; [ $mode = off ] && flags="--piecewise-max-tokens 0"
          timeout 60 python3 benchmarks/engine_benchmarks.py --out "$R/pw21b_start_$mode" --sections start $flags \
            >> "$R/pw21b.log" 2>&1
          echo "mode $mode done" >> "$R/pw21b.log"
        done
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/pw21b_mixed" --sections mixed \
          --mixed-cases 8x1024x64,16x1024x128,32x1024x256,48x1024x1024,128x1024x256 >> "$R/pw21b.log" 2>&1 ;;
    serve21) # the server under Poisson arrivals (512 in, 256 out), piecewise graphs on and off; needs .carry/tok
        dir=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w("qwen2.5-7b"))')
        for mode in on off; do
          if [ $mode = off ]; then export KVSERVE_PIECEWISE_GRAPH_MAX_TOKENS=0; else unset KVSERVE_PIECEWISE_GRAPH_MAX_TOKENS; fi
          PYTHONPATH=/tmp/site:$PWD python3 -m kvserve serve "$dir" --load-format dummy --served-model-name qwen2-7b \
            --port 8000 --disable-log-requests --disable-uvicorn-access-log > "$R/serve21_server_$mode.log" 2>&1 &
          server=$!
          for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
          PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m kvserve bench --endpoint http://localhost:8000/v1/completions \
            --model qwen2-7b --request-rate "${SERVE_RATE:-16}" --duration 30 --warmup 16 --input-len 512 \
            --max-tokens 256 --ignore-eos --tokenizer "$dir" --no-progress --json "$R/serve21_$mode.json" \
            > "$R/serve21_bench_$mode.log" 2>&1
          echo "=== $mode rc=$?" >> "$R/serve21.log"
          tail -40 "$R/serve21_bench_$mode.log" >> "$R/serve21.log"
          grep -E "piecewise|late|Error" "$R/serve21_server_$mode.log" | head -5 >> "$R/serve21.log"
          kill -TERM $server; wait $server
        done
        unset KVSERVE_PIECEWISE_GRAPH_MAX_TOKENS ;;
    pw21) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py \
          -k "piecewise or cuda_graph_matches or prefill_graphs or bf16_logprobs or async" > "$R/pw21.log" 2>&1
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/pw21_on" --sections start,mixed,seeds,random256 \
          >> "$R/pw21.log" 2>&1
        echo "mode on done" >> "$R/pw21.log"
        timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/pw21_off" --sections start,seeds,random256 \
          --piecewise-max-tokens 0 >> "$R/pw21.log" 2>&1
        echo "mode off done" >> "$R/pw21.log" ;;
    ph20) # new: this tree; old: a copy with .carry/ph20.patch reversed (made here, carried: git diff c2fa886~1 c2fa886 -- kvserve/worker/input_batch.py)
        rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree && cp -r kvserve benchmarks /tmp/oldtree/ \
          && (cd /tmp/oldtree && patch -R -p1 < "$OLDPWD/.carry/ph20.patch") > "$R/ph20.log" 2>&1 || exit 1
        for mode in new old new old; do
          dir=.; [ $mode = old ] && dir=/tmp/oldtree
          (cd $dir && timeout 110 python3 benchmarks/engine_benchmarks.py --out "$R/ph20_$mode" \
            --sections start,decode,seeds,random256 --decode-batches 1,64 --decode-contexts 1024) >> "$R/ph20.log" 2>&1
          echo "mode $mode done" >> "$R/ph20.log"
        done ;;
    host20) # ran at 401b797 (session 20 call 6); SAMPLED_HOST_BUFFERS and --sampled-host-buffers were removed after it
        timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py \
          -k "async or cuda_graph_matches or chunks or batch40" > "$R/host20.log" 2>&1
        for mode in ring fresh; do
          flags=""; [ $mode = fresh ] && flags="--sampled-host-buffers 0"
          timeout 70 python3 benchmarks/engine_benchmarks.py --out "$R/host20_$mode" --sections start,seeds,random256 \
            $flags >> "$R/host20.log" 2>&1
          echo "mode $mode done" >> "$R/host20.log"
        done
        timeout 70 python3 benchmarks/engine_benchmarks.py --out "$R/gaps20b" --sections tprofile --tprofile-windows 1 \
          --tprofile-steps 20 --tprofile-host >> "$R/host20.log" 2>&1 ;;
    gaps20) timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/gaps20" --sections tprofile --tprofile-windows 1 \
          --tprofile-steps 20 --tprofile-host > "$R/gaps20.log" 2>&1 ;;
    pytest20) timeout 420 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not gguf" \
          > "$R/pytest20.log" 2>&1 ;;
    diag20) timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/sync20" --sections start,seeds,random256 \
          --sync-debug > "$R/sync20.log" 2>&1
        timeout 200 python3 benchmarks/engine_benchmarks.py --out "$R/tprof20" --sections tprofile,trace,ttftdiag \
          --tprofile-windows 1 --tprofile-steps 20 --trace-workloads seeds,random256 > "$R/tprof20.log" 2>&1 ;;
    prune19) for mode in new old new old; do
          flags=""; [ $mode = old ] && flags="--no-last-layer-pruning"
          timeout 130 python3 benchmarks/engine_benchmarks.py --out "$R/prune19_$mode" --sections start,ttft,seeds,random256 \
            $flags >> "$R/prune19.log" 2>&1
          echo "mode $mode done" >> "$R/prune19.log"
        done ;;
    kprof19) for mode in new old; do
          flags=""; [ $mode = old ] && flags="--no-last-layer-pruning"
          timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/kprof19_$mode" --sections start,kprofile \
            --kprofile-cases p8192,p1024 --no-pdl $flags >> "$R/kprof19.log" 2>&1
          echo "mode $mode done" >> "$R/kprof19.log"
        done ;;
    dec19) for mode in new old; do
          flags=""; [ $mode = old ] && flags="--no-last-layer-pruning"
          timeout 100 python3 benchmarks/engine_benchmarks.py --out "$R/dec19_$mode" --sections start,decode \
            --decode-batches 1,8,64 --decode-contexts 1024 --decode-steps 30 $flags >> "$R/dec19.log" 2>&1
          echo "mode $mode done" >> "$R/dec19.log"
        done ;;
    ws19) # ran at 6ade294 (session 19 call 9); GateUpConfig.warp_specialize and --warp-specialize were removed after it
        timeout 300 python3 benchmarks/gate_up_sweep.py --out "$R/ws19" --rows 48,64,128 --loaders tma \
          --tilings "64,64,128,4,4;64,64,128,3,4;64,128,64,4,4;128,64,64,4,4" --warp-specialize off,on \
          > "$R/ws19.log" 2>&1 ;;
    fmlp18) # ran at d9fb0bb (session 18 call 1, as --splits 2,3,4 --stages "4/4;4/3"), then e5422f1, 3d152b5, b87f5e0
        # and 036fd4c (calls 2-5, each with its own --configs: see the logs); the probe and kernel are removed since
        timeout 240 python3 -m pytest -q -rA -s -p no:cacheprovider tests/kernels/test_triton_fused_mlp.py \
          > "$R/pytest_fmlp.log" 2>&1
        timeout 300 python3 benchmarks/fused_mlp_probe.py --out "$R/fmlp18" --rows 48,64 \
          --configs "4,4,4,1;4,4,4,1,64,2;3,4,4,1,64,2;2,4,4,1,64,2;4,4,6,1,64,2;5,4,4,1,64,2" > "$R/fmlp18.log" 2>&1 ;;
    early17) # ran at c7828f3 (--no-decode-early-tile is gone since its revert)
        timeout 200 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu -k "attention or graph" \
          > "$R/pytest_early.log" 2>&1
        for mode in new old new old; do
          flags=""; [ $mode = old ] && flags="--no-decode-early-tile"
          timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/early17_$mode" --sections start,decode,seeds,random256 \
            --decode-batches 1,8,64 --decode-contexts 1024,4096 --decode-steps 30 $flags >> "$R/early17.log" 2>&1
          echo "mode $mode done" >> "$R/early17.log"
        done ;;
    tprof17) timeout 240 python3 benchmarks/engine_benchmarks.py --out "$R/tprof17" --sections start,tprofile,hostprof \
          --tprofile-windows 25,250,500,800,950 --tprofile-steps 20 --hostprof-cases 64x1024,176x900,256x900 \
          > "$R/tprof17.log" 2>&1
        timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/kprof17" --sections start,kprofile \
          --kprofile-cases b176x900 --no-pdl > "$R/kprof17.log" 2>&1 ;;
    lpt16) # ran at 7510218 (--no-decode-longest-first is gone since its revert)
        timeout 200 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu -k "longest" > "$R/pytest_lpt.log" 2>&1
        for mode in new old new old; do
          flags=""; [ $mode = old ] && flags="--no-decode-longest-first"
          timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/lpt16_$mode" --sections start,seeds,random256 \
            $flags >> "$R/lpt16.log" 2>&1
          echo "mode $mode done" >> "$R/lpt16.log"
        done ;;
    abpad16) for mode in new old new old; do  # at f96283e old also had --no-decode-skip-empty-splits (since removed)
          flags=""; [ $mode = old ] && flags="--no-prefill-qkv-padding --prefill-copy-always"
          timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/abpad16_$mode" --sections start,decode,ttft \
            --decode-batches 1,4,8 --decode-contexts 1024,4096 --decode-steps 30 $flags >> "$R/abpad16.log" 2>&1
          echo "mode $mode done" >> "$R/abpad16.log"
        done
        timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/kprof16" --sections start,kprofile \
          --kprofile-cases b1,p8192 --no-pdl > "$R/kprof16.log" 2>&1 ;;
    ggufa) mkdir -p /tmp/gg && cp .carry/gg.aa /tmp/gg/ && ls -la /tmp/gg > "$R/ggufa.log" 2>&1 ;;
    ggufb) cat /tmp/gg/gg.aa .carry/gg.ab > /tmp/smollm2.gguf && sha256sum /tmp/smollm2.gguf > "$R/gguf.log" 2>&1 \
          && KVSERVE_TEST_GGUF=/tmp/smollm2.gguf timeout 200 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu \
             -k gguf >> "$R/gguf.log" 2>&1 ;;
    final12) TRITON_CACHE_DIR=$(mktemp -d) timeout 330 python3 benchmarks/engine_benchmarks.py --out "$R/final12" \
          --sections start,decode,seeds,random256,ttft,prefix,hf > "$R/final12.log" 2>&1 ;;
    final11) dir=$(mktemp -d)
        TRITON_CACHE_DIR=$dir timeout 220 python3 benchmarks/engine_benchmarks.py --out "$R/final11" \
          --sections start,decode,seeds,random256,ttft > "$R/final11.log" 2>&1
        echo "=== precompile off, empty Triton cache" >> "$R/final11.log"
        TRITON_CACHE_DIR=$(mktemp -d) KVSERVE_TRITON_PRECOMPILE=0 timeout 80 python3 benchmarks/engine_benchmarks.py \
          --out "$R/final11_off" --sections start >> "$R/final11.log" 2>&1
        echo "=== warm Triton cache" >> "$R/final11.log"
        TRITON_CACHE_DIR=$dir timeout 80 python3 benchmarks/engine_benchmarks.py --out "$R/final11_warm" \
          --sections start >> "$R/final11.log" 2>&1 ;;
    final) timeout 210 python3 benchmarks/engine_benchmarks.py --out "$R/final" \
              --sections start,decode,seeds,ttft,ttftrand,ttftdiag,kprofile --kprofile-cases b1,b64,p8192 \
              > "$R/final.log" 2>&1
           timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/final2" --sections start,random256 \
              >> "$R/final.log" 2>&1 ;;
    ggufcheck) cat .carry/gg.aa .carry/gg.ab > /tmp/smollm2.gguf && KVSERVE_TEST_GGUF=/tmp/smollm2.gguf \
              timeout 200 python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu -k gguf > "$R/gguf.log" 2>&1 ;;
    fuseab) for mode in on off; do  # (session 4's call 3 ran it with two more fusions, since removed)
          flags="--rotary-cache-fusion"; secs=start,decode,ttft,seeds,kprofile
          [ $mode = off ] && flags="--no-rotary-cache-fusion" && secs=start,decode,kprofile
          timeout 150 python3 benchmarks/engine_benchmarks.py --out "$R/fuse_$mode" --sections $secs \
            --decode-batches 1,8,16,64 --decode-contexts 1024 --decode-steps 30 --kprofile-cases b1,b64,p8192 \
            $flags >> "$R/fuseab.log" 2>&1
        done ;;
    cascade3) for mode in no-cascade cascade; do
          secs=start,prefix; [ $mode = cascade ] && secs=start,prefix,kprofile
          timeout 130 python3 benchmarks/engine_benchmarks.py --out "$R/prefix_$mode" --sections $secs \
            --kprofile-cases shared256 --$mode-attn >> "$R/cascade.log" 2>&1
        done ;;
    gemmdown) timeout 120 python3 benchmarks/gemm_sweep.py --budget-s 50 --shapes down,o_proj --rows 1,8 \
              --block-ns 32,64 --block-ks 64,128 --out "$R/gemm_sweep_down.json" > "$R/gemm.log" 2>&1 ;;
    pattn) timeout 90 python3 benchmarks/prefill_attention_backends.py --out "$R/prefill_attn.json" \
              > "$R/pattn.log" 2>&1 ;;
    cascade2) for mode in no-cascade cascade; do
          timeout 130 python3 benchmarks/engine_benchmarks.py --out "$R/prefix_$mode" --sections start,prefix \
            --$mode-attn >> "$R/cascade.log" 2>&1
        done
        timeout 100 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu -k cascade >> "$R/cascade.log" 2>&1 ;;
    hf) timeout 120 python3 benchmarks/engine_benchmarks.py --out "$R/hf" --sections hf > "$R/hf.log" 2>&1 ;;
    kernels) timeout 120 python3 benchmarks/gpu_kernels.py --models qwen2.5-7b --dtypes bf16 fp16 \
              --budget-s 60 --rep-ms 20 --out "$R/gpu_kernels.json" > "$R/gpu_kernels.log" 2>&1 ;;
    elementwise) timeout 120 python3 benchmarks/elementwise_backends.py --out "$R" > "$R/elementwise.log" 2>&1 ;;
  esac
  echo "rc=$?"
  tar czf "$OUT/results.tgz" -C "$R" .  # after every step: a call cut short still returns what ran
done
tar czf "$OUT/results.tgz" -C "$R" .
echo "=== total $(( $(date +%s) - T0 ))s"
for f in "$R"/pytest_tp32a.log "$R"/tp32b.log "$R"/tp32c.log "$R"/api30.log "$R"/client29b.log "$R"/api29.log "$R"/client29.log "$R"/pytest28.log "$R"/cublas28.log "$R"/firstburst28.log "$R"/firstpass28w.log "$R"/firstpass28s.log "$R"/firstpass28e.log "$R"/firstpass28.log "$R"/sweep28.log "$R"/abclient27.log "$R"/gcprobe27.log "$R"/client27.log "$R"/mnbt27.log "$R"/pytest26.log "$R"/rowq26.log "$R"/gcserve26.log "$R"/gc26.log "$R"/bisect26.log "$R"/hash25.log "$R"/capfail25b_before.log "$R"/pytest25b.log "$R"/capfail25_before.log "$R"/pytest25.log "$R"/pytest24.log "$R"/apipath.log "$R"/poisson22.log "$R"/mixed22.log "$R"/shared22.log "$R"/pytest22c.log "$R"/hostcopy22.log "$R"/pytest22.log "$R"/pytest22b.log "$R"/start22.log "$R"/copy22.log "$R"/pytest21.log "$R"/pw21d.log "$R"/pw21c.log "$R"/serve21.log "$R"/pw21b.log "$R"/pw21.log "$R"/host20.log "$R"/ph20.log "$R"/gaps20.log "$R"/pytest20.log "$R"/split20.log "$R"/tprofh20.log "$R"/sync20.log "$R"/tprof20.log "$R"/ws19.log "$R"/prune19.log "$R"/dec19.log "$R"/kprof19.log "$R"/pytest_fmlp.log "$R"/fmlp18.log "$R"/pytest_early.log "$R"/early17.log "$R"/tprof17.log "$R"/kprof17.log "$R"/pytest_lpt.log "$R"/lpt16.log "$R"/abpad16.log "$R"/kprof16.log "$R"/ggufa.log "$R"/layout1.log "$R"/kprof15.log "$R"/pytest_review14.log "$R"/review14.log "$R"/gatesmall2.log "$R"/pytest_tma.log "$R"/tmaab.log "$R"/gatesmall.log "$R"/gateup2.log "$R"/pytest_gateup2.log "$R"/gateab2.log "$R"/gateup.log "$R"/pytest_gateup.log "$R"/gateab.log "$R"/l2probe.log "$R"/diag13.log "$R"/hfdiag3.log "$R"/sdpafix.log "$R"/hfdiag2.log "$R"/hfdiag.log "$R"/final12.log "$R"/pytest_lt.log "$R"/tuneab2.log "$R"/tuneab.log "$R"/ltalgos.log "$R"/attnab3.log "$R"/attnab2.log "$R"/attnpf.log "$R"/attnsweep.log "$R"/rows32.log "$R"/ttftrest.log "$R"/prefillab.log "$R"/prefillprof.log "$R"/gemm4.log "$R"/ttftclk.log "$R"/gemm3.log "$R"/blasab.log "$R"/confirm.log "$R"/fuseab2.log "$R"/ttftrand2.log "$R"/pdlab2.log "$R"/pdlgemm.log "$R"/pdlab.log "$R"/ttftrand.log "$R"/modload.log "$R"/sharedab.log "$R"/final.log "$R"/gguf.log "$R"/fuseab.log "$R"/skinnyab.log "$R"/gemm.log "$R"/pattn.log "$R"/cascade.log "$R"/serve.log "$R"/diag3.log "$R"/ttftab.log "$R"/prefixab.log "$R"/diag2.log "$R"/async.log "$R"/sweep.log "$R"/diag.log "$R"/profile.log "$R"/pytest_gpu.log "$R"/engine.log "$R"/engine2.log "$R"/eager.log "$R"/ab.log "$R"/prefix2.log "$R"/hf.log "$R"/gpu_kernels.log "$R"/elementwise.log; do
  [ -f "$f" ] || continue
  echo "##### $(basename "$f")"
  case $(basename "$f") in
    api30.log) cat "$f" ;;
    pytest_lt.log) grep -E "passed|failed|FAILED|Error" "$f" | tail -12 ;;
    tuneab2.log) grep -E "^decode b|^TTFT|^engine start|mode .* done|Error|error" "$f" | cut -c1-110 ;;
    tuneab.log) grep -E "^decode|^seeds|^256|^TTFT|^engine start|mode .* done|matmul tuning|Error|error" "$f" ;;
    attnab3.log) grep -E "^seeds|^256|^engine start|mode .* done|Error|error" "$f" ;;
    attnab2.log) grep -E "^decode b|^256|^engine start|mode .* done|Error|error" "$f" ;;
    attnpf.log) grep -E "^decode b|^seeds|^engine start|mode .* done|Error|error" "$f" ;;
    attnsweep.log) grep -E "Error|Traceback" "$f" | head -5; sed -n '/^batch /,$p' "$f" | grep -v "^$" ;;
    rows32.log) grep -E "^decode b|^256|^engine start|mode .* done|Error|error" "$f" ;;
    ttftrest.log) grep -E "^TTFT|^engine start|Error|error" "$f" ;;
    pytest_gpu.log) grep -E "passed|failed|PASSED|FAILED|Error|error|kvserve bf16|skipped" "$f" | tail -25 ;;
    gpu_kernels.log) grep -E "FAIL|False|rows," "$f" | tail -8; tail -c 2500 "$f" ;;
    ab.log|prefix2.log) grep -E "^decode|^prefix|Error|failed" "$f" ;;
    cascade.log) grep -E "^prefix|^engine start|passed|failed|Error|^kernel profile|^ +[0-9]" "$f" | tail -40 ;;
    profile.log) tail -c 4500 "$f" ;;
    pdlgemm.log) grep -E "Error|Traceback" "$f" | head -5; grep -E "cublas|error" "$f" ;;
    confirm.log) grep -E "^decode|^shared|^engine start|Error|failed" "$f" ;;
    pdlab.log|pdlab2.log|fuseab2.log|blasab.log) grep -E "^decode|^seeds|^engine start|^mode|Error|failed" "$f" ;;
    ttftrand2.log) grep -E "^TTFT|^engine start|^mode|Error|failed|attention|flash|cudnn|^kernel profile" "$f" ;;
    ttftrand.log) grep -E "^TTFT|^engine start|^mode|Error|failed" "$f" ;;
    modload.log) grep -E "^shared|^engine start|^CUDA_MODULE|Error|failed" "$f" ;;
    sharedab.log) grep -E "^shared|^engine start|Error|failed" "$f" ;;
    hfdiag3.log) grep -E "^=== |^HF generate|Error|error" "$f" | cut -c1-400 ;;
    sdpafix.log) grep -E "passed|failed|PASSED|FAILED|Error|^alone|^kvserve-first|^=== " "$f" | tail -30; sed -n '/^measure /,$p' "$f" ;;
    hfdiag2.log) grep -E "^=== |^HF generate|Error|error" "$f" | cut -c1-400 ;;
    hfdiag.log) grep -E "^=== |^HF generate|^seeds|Error|error|Name|^ +[a-zA-Z_:<>0-9 ]+ +[0-9.]+%" "$f" | cut -c1-200 | head -90 ;;
    final12.log) sed -n '/^measure /,$p' "$f"; grep -E "Error|failed" "$f" | tail -5 ;;
    final.log) grep -E "^decode|^seeds|^TTFT|^engine start|^random|^256|Error|failed|^kernel profile" "$f" ;;
    gguf.log) tail -c 1500 "$f" ;;
    fuseab.log) grep -E "^decode|^seeds|^TTFT|^engine start|Error|failed|^kernel profile|^ +[0-9.]+ us" "$f" \
                | grep -v -E " (0\.[0-9]|[1-4]\.[0-9]) us" | head -90 ;;
    skinnyab.log) grep -E "^decode|^seeds|^TTFT|^engine start|Error|failed|^ +[0-9.]+ us/step" "$f" | head -70 ;;
    prefillprof.log) grep -E "^TTFT|^prefill|Error|failed" "$f"; sed -n '/by tottime/,/by cumulative/p' "$f" | head -45 ;;
    padab.log|padcheck.log) grep -E "^decode|^256|^engine start|^mode|Error|failed" "$f" ;;
    ltalgos.log) grep -E "Error|Traceback" "$f" | head -5; grep -E "^[a-z_]+ +M=" "$f" | cut -c1-150; sed -n '/^    M /,$p' "$f" ;;
    rows.log) grep -E "Error|Traceback" "$f" | head -5; sed -n '/^ +M /,$p' "$f" ;;
    decgraph.log) grep -E "^decode|^timeline|^  gap|^kernel profile|Error|failed" "$f" ;;
    gapdiag.log) grep -E "^host profile|^timeline|^  gap|^kernel profile|Error|failed" "$f";
                 grep -E -A 12 "^kernel profile b(64x4096|176)" "$f" | grep -E "^ +[0-9.]+ us" ;;
    gemm.log|gemm3.log|gemm4.log|gemmdown64.log) grep -E "Error|Traceback" "$f" | head -5; sed -n '/^shape /,$p' "$f" ;;
    serve.log) tail -c 2500 "$f" ;;
    diag3.log) tail -c 1500 "$f" ;;
    prefillab.log) grep -E "^TTFT|^decode|^engine start|^mode|Error|failed" "$f" ;;
    ttftclk.log) grep -E "^TTFT|^clocks|^event|Error|failed" "$f" ;;
    ttftab.log) grep -E "^TTFT|Error" "$f" ;;
    prefixab.log) tail -c 800 "$f" ;;
    diag2.log) grep -E -A 16 "^kernel profile" "$f"; tail -c 2500 "$f" ;;
    async.log) grep -E "^decode|^seeds|^trace|^engine start|Error|failed" "$f" ;;
    sweep.log) tail -c 3500 "$f" ;;
    gemmsplit.log) grep -A 40 "best us by split" "$f" ;;
    mergesweep.log) tail -c 3000 "$f" ;;
    mergeab.log|splitab.log) grep -E "^decode|^engine start|mode .* done|Error|error" "$f" | tail -60 ;;
    diag.log) grep -E -A 24 "^kernel profile" "$f"; tail -c 2000 "$f" ;;
    diag13.log) grep -E -A 22 "^kernel profile" "$f"; grep -E "^timeline|^trace|^seeds|Error|failed" "$f" ;;
    pytest_tma.log) grep -E "passed|failed|FAILED|Error|kvserve bf16|^E " "$f" | tail -25 ;;
    tmaab.log) grep -E "^decode|^seeds|^256|^engine start|^mode|Error|failed" "$f" ;;
    pytest_review14.log) grep -E "passed|failed|FAILED|Error|kvserve bf16|^E " "$f" | tail -25 ;;
    pytest22.log) grep -E "^[0-9]|gc.collect|force_cudagraph|passed|failed|FAILED|Error|^E " "$f" | tail -20 ;;
    apipath.log) grep -E "^poisson|===|tok/s|TTFT|TPOT|ITL|requests|Error|Traceback" "$f" | cut -c1-300 ;;
    poisson22.log) grep -E "^poisson|^engine start|Error|Traceback" "$f" | cut -c1-400 ;;
    mixed22.log) grep -E "^mixed|Error|Traceback" "$f" | cut -c1-220 ;;
    shared22.log) grep -E "^shared|^engine start|mode .* done|Error|Traceback" "$f" | cut -c1-200 ;;
    offloop24.log) grep -E "^===|TTFT|TPOT|ITL \(|Client CPU|lag|time_to_first|queue_time|Successful|Error|Traceback" "$f" ;;
    pytest28.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -25 ;;
    pytest26.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -25 ;;
    rowq26.log) grep -E "^TTFT|^engine start|mode .* done|Error|Traceback" "$f" | cut -c1-220 ;;
    firstpass28e.log) cut -c1-400 "$f" ;;
    firstpass28s.log) cut -c1-300 "$f" ;;
    firstpass28w.log) cut -c1-400 "$f" ;;
    firstburst28.log) cut -c1-200 "$f" | head -30 ;;
    cublas28.log) cut -c1-600 "$f" ;;
    firstpass28.log) grep -E "firstpass pass|firstpass28|Self CPU time total" "$f" | cut -c1-400 ;;
    sweep28.log) cut -c1-260 "$f" | tail -12 ;;
    abclient27.log) cut -c1-400 "$f" ;;
    gcprobe27.log) cut -c1-1500 "$f" ;;
    client27.log) cut -c1-400 "$f" ;;
    mnbt27.log) cut -c1-300 "$f" ;;
    client29b.log) grep -E "^client:|^ +[0-9] |^process|Error|Traceback" "$f" | cut -c1-260 ;;
    api29.log) grep -E "^server|^process|Error|Traceback" "$f" | cut -c1-300 ;;
    client29.log) grep -E "^client:|^ +[0-9] |^process|Error|Traceback" "$f" | cut -c1-260 ;;
    gcserve26.log) cat "$f" | cut -c1-300 ;;
    gc26.log) grep -E "^shared|^seeds|^256|^engine start|mode .* done|Error|Traceback" "$f" | cut -c1-260 ;;
    bisect26.log) grep -E "^=== tree|^shared|^trace|^engine start|Error|Traceback" "$f" | cut -c1-200 ;;
    hash25.log) grep -E "^TTFT|^engine start|mode .* done|Error|Traceback" "$f" | cut -c1-200 ;;
    capfail25b_before.log) grep -E "^=== |passed|failed|^E .*(Error|assert)|^exit" "$f" | cut -c1-220 ;;
    pytest25b.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -25 ;;
    capfail25_before.log) grep -E "^=== |passed|failed|^E .*(Error|assert)|^exit" "$f" | cut -c1-220 ;;
    pytest25.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -25 ;;
    pytest24.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -25 ;;
    rowattn24_pytest.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -15 ;;
    rowattn24.log) grep -E "^TTFT|^seeds|^256|^engine start|^Triton variants|mode .* done|Error|Traceback" "$f" | cut -c1-160 ;;
    pytest22c.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -15 ;;
    hostcopy22.log) grep -E "^seeds|^256|^host copy|^engine start|Error|Traceback" "$f" | cut -c1-300 ;;
    pytest22b.log) grep -E "===|passed|failed|FAILED|Error|^E " "$f" | tail -20 ;;
    start22.log) grep -E "^engine start|^CUDA graph pool|^KV cache|^Triton variants|mode .* done|Error|Traceback" "$f" | cut -c1-300 ;;
    copy22.log) grep -E "^seeds|^256|^engine start|^tprofile|mode .* done|Error|Traceback" "$f" | cut -c1-220; grep -E -A 14 '"gaps"' "$R"/copy22_gaps/engine_tprofile.json | cut -c1-240 ;;
    pytest21.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -15 ;;
    pw21d.log) grep -E "^mixed|^decode|^TTFT|^engine start|^CUDA graph pool|^Triton variants|Error|Traceback" "$f" | cut -c1-220; grep -o "keys: .*" "$f" | fold -w 200 ;;
    pw21c.log) grep -E "^mixed|Error|Traceback" "$f" | cut -c1-200; grep -o "keys: .*" "$f" | fold -w 200 ;;
    pw21b.log) grep -E "^mixed|^engine start|^CUDA graph pool|^KV cache|^Triton variants|mode .* done|Error|Traceback|keys" "$f" | cut -c1-400 ;;
    serve21.log) grep -E "===|tok/s|TTFT|TPOT|ITL|E2E|requests|piecewise|late|Error|Traceback" "$f" | cut -c1-200 ;;
    pw21.log) grep -E "passed|failed|FAILED|^E |^mixed|^seeds|^256|^engine start|^Triton variants|mode .* done|Error|Traceback|piecewise" "$f" | cut -c1-230 ;;
    host20.log) grep -E "passed|failed|^seeds|^256|mode .* done|^tprofile steps|Error|Traceback" "$f" | cut -c1-220; grep -E -A 8 '"gaps"' "$R"/gaps20b/engine_tprofile.json | cut -c1-200 ;;
    ph20.log) grep -E "^decode|^seeds|^256|^engine start|mode .* done|patch|Error|Traceback|FAILED|Hunk" "$f" ;;
    gaps20.log) grep -E "^tprofile steps|^tprofile 256|^tprofile alloc|Error|Traceback" "$f" | cut -c1-220; grep -E -A 12 '"gaps"' "$R"/gaps20/engine_tprofile.json | cut -c1-400 ;;
    split20.log) grep -E "^seeds|^256|^engine start|mode .* done|Error|Traceback" "$f" ;;
    tprofh20.log) grep -E -A 16 "^tprofile steps" "$f" | cut -c1-150; grep -E -A 14 '"gaps"' "$R"/tprofh20/engine_tprofile.json | cut -c1-200; grep -E "^tprofile|Error|Traceback" "$f" ;;
    pytest20.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -15 ;;
    sync20.log) grep -E "^host sync|^seeds|^256|Error|Traceback" "$f" ;;
    tprof20.log) grep -E -A 16 "^tprofile steps" "$f" | cut -c1-150; grep -E "^trace|^TTFT|^ttft|Error|Traceback" "$f" ;;
    kprof19.log) grep -E "^kernel profile|aten::mm|_cudnn_attention_forward|_silu_and_mul|_rms_norm|mode .* done|Error|Traceback" "$f" ;;
    ws19.log) grep -E "Error|mismatch" "$f" | head -8; sed -n '/^rows /,/^$/p' "$f" ;;
    dec19.log) grep -E "^decode|mode .* done|Error|Traceback" "$f" ;;
    prune19.log) grep -E "^TTFT|^seeds|^256|^engine start|^Triton variants|mode .* done|Error|Traceback" "$f" ;;
    pytest_fmlp.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -15 ;;
    fmlp18.log) grep -E "Error|Traceback|failed|skipped" "$f" | head -8; grep -E "^rows [0-9]+:" "$f"; sed -n '/^rows  case/,$p' "$f" ;;
    pytest_early.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -15 ;;
    early17.log) grep -E "^decode|^seeds|^256|^engine start|mode .* done|Error|Traceback" "$f" ;;
    tprof17.log) grep -E -A 16 "^tprofile steps" "$f" | cut -c1-150; grep -E "^host profile|^tprofile 256|Error|Traceback" "$f" ;;
    kprof17.log) grep -E "^timeline" -A 4 "$f" | cut -c1-150; grep -E -A 22 "^kernel profile" "$f" | cut -c1-150; grep -E "Error|failed" "$f" | tail -3 ;;
    pytest_tp32a.log) grep -E "passed|failed|FAILED|Error|SKIPPED|^E " "$f" | tail -25 ;;
    tp32b.log) cat "$f" ;;
    tp32c.log) grep -E " -> |all_gather|rc=|Error|Traceback" "$f" ;;
    pytest_lpt.log) grep -E "passed|failed|FAILED|Error|^E " "$f" | tail -15 ;;
    lpt16.log) grep -E "^seeds|^256|^engine start|mode .* done|Error|Traceback" "$f" ;;
    abpad16.log) grep -E "^decode|^TTFT|^engine start|mode .* done|Error|Traceback" "$f" ;;
    kprof16.log) grep -E -A 22 "^kernel profile" "$f" | cut -c1-160; grep -E "Error|failed" "$f" | tail -3 ;;
    ggufa.log) cat "$f" ;;
    layout1.log) grep -E "Error|Traceback" "$f" | head -5; sed -n '/^batch /,$p' "$f" | grep -v "^$" ;;
    kprof15.log) grep -E -A 22 "^kernel profile" "$f" | cut -c1-160; grep -E "Error|failed" "$f" | tail -3 ;;
    review14.log) grep -E "Error|Traceback" "$f" | head -5; grep -E "^rows|^  [a-z]" "$f" ;;
    gatesmall2.log) grep -E "Error|Traceback" "$f" | head -5; grep -E "^rows" -A 5 "$f" ;;
    gatesmall.log) grep -E "Error|Traceback" "$f" | head -5; grep -E "^rows" -A 6 "$f" ;;
    gateup2.log) grep -E "Error|Traceback" "$f" | head -5; grep -E "^rows|^  [a-z]" "$f" ;;
    pytest_gateup2.log) grep -E "passed|failed|PASSED|FAILED|Error|kvserve bf16|skipped|^E " "$f" | tail -25 ;;
    gateab2.log) grep -E "^TTFT|^mode|Error|failed" "$f" ;;
    gateup.log) grep -E "Error|Traceback" "$f" | head -5; grep -E "^rows|^  [a-z]" "$f" ;;
    pytest_gateup.log) grep -E "passed|failed|PASSED|FAILED|Error|kvserve bf16|skipped" "$f" | tail -25 ;;
    gateab.log) grep -E "^TTFT|^seeds|^256|^engine start|^mode|late|Error|failed" "$f" ;;
    l2probe.log) grep -E "Error|Traceback" "$f" | head -5; sed -n '/^case /,$p' "$f" ;;
    *) tail -c 2500 "$f" ;;
  esac
done
