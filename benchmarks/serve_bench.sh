#!/bin/bash
# The seeds' load test end to end: `kvserve serve` on a random-weight model of a real shape, then
# `kvserve bench` with the seeds' command (and the same with --ignore-eos, for fixed-length outputs).
#   bash benchmarks/serve_bench.sh [MODEL_SHAPE] [DURATION_S] [CONCURRENCY] [MAX_TOKENS] [EXTRA_SERVE_ARGS...]
# MODEL_SHAPE is a name in benchmarks/common.py (qwen2.5-7b on the GPU, tiny for a CPU try-out). The
# tokenizer is the default model's (SmolLM2), put beside config.json by common.write_served_model_dir: the
# weights are random, so the text is meaningless, but prompts and token counts are real.
# Results: $OUT (or /tmp/out): serve.log, bench.log, bench.json, bench_ignore_eos.json.
set -u
SHAPE=${1:-qwen2.5-7b}
DURATION=${2:-30}
CONC=${3:-50}
MAXTOK=${4:-256}
shift $(( $# < 4 ? $# : 4 ))
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PORT=${PORT:-8000}
DIR=$($PY -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w(sys.argv[1]))' "$SHAPE") \
  || exit 1
echo "model dir: $DIR"
$PY -m kvserve serve "$DIR" --load-format dummy --served-model-name qwen2-7b --port "$PORT" \
    --disable-log-requests --disable-uvicorn-access-log "$@" > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SERVER 2> /dev/null || { echo "server died"; tail -30 "$OUT/serve.log"; exit 1; }
  sleep 1
done
grep -E "KV cache|ready" "$OUT/serve.log" | tail -3
for variant in plain ignore_eos; do
  extra=()
  json="$OUT/bench.json"
  if [ $variant = ignore_eos ]; then extra=(--ignore-eos); json="$OUT/bench_ignore_eos.json"; fi
  timeout $(( DURATION + 150 )) $PY -m kvserve bench --endpoint "http://localhost:$PORT/v1/chat/completions" \
      --model qwen2-7b --concurrency "$CONC" --duration "$DURATION" --max-tokens "$MAXTOK" \
      --tokenizer "$DIR" --no-progress --json "$json" --temperature server "${extra[@]}" > "$OUT/bench_$variant.log" 2>&1
  echo "=== bench ($variant) rc=$?"
  tail -45 "$OUT/bench_$variant.log"
done
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^kvserve:(generation_tokens_total|num_preemptions_total|prefix_cache_hits_total)" | head
kill -TERM $SERVER
wait $SERVER
echo "server exit status: $?"
