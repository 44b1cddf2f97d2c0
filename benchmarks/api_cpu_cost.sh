#!/bin/bash
# CPU time the API process spends per streamed token: `kvserve serve` on a random-weight model, the seeds'
# command shape (chat, 50 concurrent streams, 256 tokens, EOS ignored) for DURATION seconds, and the CPU
# seconds of the API process and of the engine-core process over the load, from /proc.
#   [CONCURRENCY=50] [MAX_TOKENS=256] bash benchmarks/api_cpu_cost.sh [MODEL_SHAPE] [DURATION_S] [EXTRA_SERVE_ARGS...]
# CONCURRENCY above 64 needs --max-num-seqs in EXTRA_SERVE_ARGS for the engine to run them all at once.
# MODEL_SHAPE: a name in benchmarks/common.py ("tiny" by default, which runs on a CPU; its vocabulary
# matches the SmolLM2 tokenizer, so every step streams text). Output under $OUT (default /tmp/out).
set -u
SHAPE=${1:-tiny}
DURATION=${2:-30}
shift $(( $# < 2 ? $# : 2 ))
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PORT=${PORT:-8011}
DIR=$($PY -c 'import sys; sys.path.insert(0, "benchmarks"); from common import write_served_model_dir as w; print(w(sys.argv[1]))' "$SHAPE") \
  || exit 1
MAXLEN=$([ "$SHAPE" = tiny ] && echo "--max-model-len 4096" || echo "")
$PY -m kvserve serve "$DIR" --load-format dummy --served-model-name m --port "$PORT" --max-num-seqs 64 $MAXLEN \
    --disable-log-requests --disable-uvicorn-access-log "$@" > "$OUT/api_cost_serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
CORE=$(pgrep -P "$SERVER" -f spawn_main | head -1)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
a0=$(cpu_ticks "$SERVER"); c0=$(cpu_ticks "$CORE")
$PY -m kvserve bench --endpoint "http://127.0.0.1:$PORT/v1/chat/completions" --model m --concurrency "${CONCURRENCY:-50}" \
    --duration "$DURATION" --max-tokens "${MAX_TOKENS:-256}" --ignore-eos --tokenizer "$DIR" --no-progress \
    --json "$OUT/api_cost_bench.json" --temperature server > "$OUT/api_cost_bench.log" 2>&1
a1=$(cpu_ticks "$SERVER"); c1=$(cpu_ticks "$CORE")
kill -INT "$SERVER"; wait "$SERVER"
$PY - "$OUT/api_cost_bench.json" "$a0" "$a1" "$c0" "$c1" "$(getconf CLK_TCK)" <<'P'
import json, sys
path, a0, a1, c0, c1, hz = sys.argv[1], *map(int, sys.argv[2:])
run = json.load(open(path))["runs"][0]
tokens = sum(r.get("output_tokens") or 0 for r in run["records"])
s = run["summary"]
print(f"{'measure':<44}{'value':>10}")
print(f"{'output tok/s':<44}{s['output_throughput']:>10.0f}")
gaps = [g for r in run["records"] for g in r["itl_s"]]
print(f"{'chunk gaps under 1 ms (%)':<44}{100.0 * sum(g < 0.001 for g in gaps) / max(len(gaps), 1):>10.1f}")
print(f"{'chunks per token':<44}{(len(gaps) + len(run['records'])) / max(tokens, 1):>10.2f}")
print(f"{'output tokens over the load':<44}{tokens:>10}")
print(f"{'API process CPU (s)':<44}{(a1 - a0) / hz:>10.2f}")
print(f"{'API process CPU per token (us)':<44}{(a1 - a0) / hz / tokens * 1e6:>10.1f}")
print(f"{'engine-core process CPU per token (us)':<44}{(c1 - c0) / hz / tokens * 1e6:>10.1f}")
P
