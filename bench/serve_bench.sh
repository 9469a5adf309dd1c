#!/usr/bin/env bash
# Serving: hybridscan serve against llama.cpp's llama-server on the same model (bench/generate_bench.sh's `small`:
# hybridscan's small preset, random weights, bf16; llama.cpp reads the GGUF its convert_hf_to_gguf.py makes of it),
# same machine, same run, alternating: total generated tokens/s with 1, 4 and 16 concurrent streaming clients
# (--parallel / -np 16 for both), and the time to the first token of a second request that shares a long system
# prompt with a first one (the prefix cache's case). Not a test: nothing here gates CI.
#
#   bench/serve_bench.sh [--threads T] [--concurrency "1 4 16"] [--requests R] [--prompt-len P] [--new N]
#                        [--system-len L] [--out DIR]
#
# Environment: LLAMA_CPP_DIR, a llama.cpp tree whose build/bin holds llama-server (default: generate_bench.sh's
# cache, $HS_CACHE/llama_cpp_python-0.3.36/vendor/llama.cpp; this script builds nothing); HS_CACHE as
# generate_bench.sh (the models are made there by bench/generate_bench.py if missing); PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
THREADS=2 CONC="1 4 16" REQ=4 PLEN=128 NEW=128 SYSLEN=2000 OUT=runs/serve_bench
while [[ $# -gt 0 ]]; do
  case $1 in
    --threads) THREADS=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --requests) REQ=$2; shift 2 ;;
    --prompt-len) PLEN=$2; shift 2 ;;
    --new) NEW=$2; shift 2 ;;
    --system-len) SYSLEN=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "serve_bench.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-$ROOT/.venv/bin/python}
HS=$ROOT/build/hybridscan
CACHE=${HS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridscan}
WORK=$CACHE/generate_bench
LLAMA=${LLAMA_CPP_DIR:-$CACHE/llama_cpp_python-0.3.36/vendor/llama.cpp}
SERVER=$LLAMA/build/bin/llama-server
[[ -x $HS ]] || { echo "serve_bench.sh: no build/hybridscan: run scripts/setup.sh first" >&2; exit 2; }
[[ -x $SERVER ]] || { echo "serve_bench.sh: no $SERVER: set LLAMA_CPP_DIR to a llama.cpp tree built with llama-server (bench/generate_bench.sh builds one)" >&2; exit 2; }
mkdir -p "$WORK" "$OUT"
HF=$WORK/small-hf GGUF=$WORK/small-bf16.gguf
if [[ ! -f $HF/config.json ]]; then
  echo "== writing the random small model (transformers, seed 1) -> $HF" >&2
  nice "$PY" bench/generate_bench.py models --model small --out "$HF.tmp" >&2 && rm -rf "$HF" && mv "$HF.tmp" "$HF"
fi
if [[ ! -f $GGUF ]]; then
  echo "== converting it to GGUF (llama.cpp's convert_hf_to_gguf.py, bf16)" >&2
  nice "$PY" bench/generate_bench.py convert --hf "$HF" --out "$GGUF.tmp" --llama-dir "$LLAMA" >&2 && mv "$GGUF.tmp" "$GGUF"
fi
CTX=$(( SYSLEN + 256 > PLEN + NEW ? SYSLEN + 256 : PLEN + NEW ))
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_up() {
  for _ in $(seq 600); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "serve_bench.sh: $1 did not come up" >&2; exit 1
}
start_hs() {
  local port; port=$(free_port)
  "$HS" serve --checkpoint "$HF" --port "$port" --parallel 16 --ctx "$CTX" --cache-bytes 256MiB --threads "$THREADS" \
    >/dev/null 2>"$OUT/hybridscan.log" & PIDS+=($!)
  URL=http://127.0.0.1:$port; wait_up "$URL"
}
start_llama() {
  local port; port=$(free_port)
  "$SERVER" -m "$GGUF" --host 127.0.0.1 --port "$port" -np 16 -c $(( CTX * 16 )) -t "$THREADS" -tb "$THREADS" \
    --cont-batching --no-webui >"$OUT/llama-server.log" 2>&1 & PIDS+=($!)
  URL=http://127.0.0.1:$port; wait_up "$URL"
}
stop_last() { local p=${PIDS[-1]}; kill "$p"; wait "$p" 2>/dev/null || true; unset 'PIDS[-1]'; }

RESULTS=$OUT/results.jsonl
: > "$RESULTS"
echo "{\"kind\": \"meta\", \"threads\": $THREADS, \"prompt_tokens\": $PLEN, \"new_tokens\": $NEW, \"system_tokens\": $SYSLEN, \"load_average\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >> "$RESULTS"
for c in $CONC; do
  for engine in hybridscan llama-server; do
    if [[ $engine == hybridscan ]]; then start_hs; else start_llama; fi
    r=$("$PY" bench/serve_bench.py throughput --url "$URL" --concurrency "$c" --requests "$REQ" --prompt-len "$PLEN" \
        --new "$NEW" --vocab 256)
    stop_last
    echo "{\"kind\": \"throughput\", \"engine\": \"$engine\", \"result\": $r}" | tee -a "$RESULTS"
  done
done
for engine in hybridscan llama-server; do
  if [[ $engine == hybridscan ]]; then start_hs; else start_llama; fi
  r=$("$PY" bench/serve_bench.py ttft --url "$URL" --system-len "$SYSLEN" --vocab 256)
  stop_last
  echo "{\"kind\": \"ttft\", \"engine\": \"$engine\", \"result\": $r}" | tee -a "$RESULTS"
done
"$PY" - "$RESULTS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tp = {(r["engine"], r["result"]["concurrency"]): r["result"]["tokens_per_s"] for r in rows if r["kind"] == "throughput"}
for c in sorted({k[1] for k in tp}):
    h, l = tp.get(("hybridscan", c)), tp.get(("llama-server", c))
    print(f"concurrency {c:3d}: hybridscan {h:8.1f} tokens/s, llama-server {l:8.1f} tokens/s, ratio {h / l:.2f}")
tt = {r["engine"]: r["result"] for r in rows if r["kind"] == "ttft"}
if len(tt) == 2:
    h, l = tt["hybridscan"], tt["llama-server"]
    print(f"second request sharing the system prompt: time to first token hybridscan {h['second_ttft_s']:.3f} s "
          f"(cached {h['second_cached_tokens']}), llama-server {l['second_ttft_s']:.3f} s (cached "
          f"{l['second_cached_tokens']}); ratio {l['second_ttft_s'] / h['second_ttft_s']:.1f}x; first requests "
          f"{h['first_ttft_s']:.3f} s / {l['first_ttft_s']:.3f} s")
PY
