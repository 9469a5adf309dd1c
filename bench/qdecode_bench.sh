#!/usr/bin/env bash
# Decode tokens/s at batch 1 of a GGUF file run from its quantized blocks (bench/qdecode_bench.cpp) against
# llama.cpp's llama-bench on the same file (-p 0 -n NEW: decoding from an empty context; ours: one prompt token, then
# NEW steps), alternating the two engines within each round; medians and the spread (min..max) of the rounds.
# --prefill P measures the prefill of a P-token prompt instead (ours: qdecode_bench prefill, in pieces on the
# quantized blocks; llama-bench -p P -n 0).
#   bench/qdecode_bench.sh [--rounds N] [--new N] [--prefill P] [--threads T] [--types "q8_0 q4_k"] [FILE.gguf ...]
# Without files: hybridscan's random `small` model (seed 7) exported by qdecode_bench make-small at each type.
# LLAMA_CPP_DIR: a llama.cpp tree built as bench/generate_bench.sh builds it (its build/bin has llama-bench); or
# LLAMA_BIN: that build/bin itself. Never rebuilt here. LLAMA_BENCH_ARGS: more llama-bench flags (e.g. "--repack 0":
# a native build on a CPU with AMX crashed in ggml_backend_amx_mul_mat on `small` with its default repacking).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=5 NEW=64 PREFILL=0 THREADS=2 TYPES="q8_0 q4_k" FILES=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) ROUNDS=$2; shift 2 ;;
    --new) NEW=$2; shift 2 ;;
    --prefill) PREFILL=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --types) TYPES=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) FILES+=("$1"); shift ;;
  esac
done
LLAMA_BIN=${LLAMA_BIN:-${LLAMA_CPP_DIR:+$LLAMA_CPP_DIR/build/bin}}
if [[ -z $LLAMA_BIN || ! -x $LLAMA_BIN/llama-bench ]]; then
  echo "qdecode_bench.sh: no llama-bench: set LLAMA_CPP_DIR to a llama.cpp tree built as bench/generate_bench.sh builds" \
       "it (it downloads llama-cpp-python 0.3.36's sdist and builds llama-bench once), or LLAMA_BIN to its build/bin" >&2
  exit 2
fi
QB=build/bench/qdecode_bench
WORK=${TMPDIR:-/tmp}/qdecode_bench.$$
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT
if [[ ${#FILES[@]} -eq 0 ]]; then
  for t in $TYPES; do "$QB" make-small "$t" "$WORK/small.$t.gguf"; FILES+=("$WORK/small.$t.gguf"); done
fi
RES=$WORK/results.txt
: > "$RES"
for ((r = 0; r < ROUNDS; ++r)); do
  for f in "${FILES[@]}"; do
    if [[ $PREFILL -gt 0 ]]; then
      hs=$(OMP_NUM_THREADS=$THREADS "$QB" prefill "$f" "$PREFILL" | python3 -c 'import json,sys; print(json.load(sys.stdin)["prefill_tokens_per_s"])')
      ll=$("$LLAMA_BIN/llama-bench" -m "$f" -p "$PREFILL" -n 0 -t "$THREADS" -r 1 ${LLAMA_BENCH_ARGS:-} -o json 2>/dev/null |
           python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["avg_ts"])')
    else
      hs=$(OMP_NUM_THREADS=$THREADS "$QB" run "$f" "$NEW" | python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tokens_per_s"])')
      ll=$("$LLAMA_BIN/llama-bench" -m "$f" -p 0 -n "$NEW" -t "$THREADS" -r 1 ${LLAMA_BENCH_ARGS:-} -o json 2>/dev/null |
           python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["avg_ts"])')
    fi
    echo "$(basename "$f") $hs $ll" | tee -a "$RES"
  done
done
python3 - "$RES" <<'PY'
import sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    f, hs, ll = line.split()
    rows.setdefault(f, []).append((float(hs), float(ll)))
print("| file | hybridscan tok/s median (min..max) | llama-bench tok/s median (min..max) | ratio of medians | per-round ratios median (min..max) |")
print("|---|---|---|---|---|")
for f, v in rows.items():
    h = [a for a, _ in v]; l = [b for _, b in v]; q = [a / b for a, b in v]
    print(f"| {f} | {st.median(h):.1f} ({min(h):.1f}..{max(h):.1f}) | {st.median(l):.1f} ({min(l):.1f}..{max(l):.1f}) | "
          f"{st.median(h) / st.median(l):.2f} | {st.median(q):.2f} ({min(q):.2f}..{max(q):.2f}) |")
PY
