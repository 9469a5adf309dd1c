#!/usr/bin/env bash
# Decode tokens/s at batch 1 of a GGUF file run from its quantized blocks (bench/qdecode_bench.cpp) against
# llama.cpp's llama-bench on the same file (-p 0 -n NEW: decoding from an empty context; ours: one prompt token, then
# NEW steps), alternating the two engines within each round; medians and the spread (min..max) of the rounds.
# --prefill P measures the prefill of a P-token prompt instead (ours: qdecode_bench prefill, in pieces on the
# quantized blocks; llama-bench -p P -n 0). --batch B (B > 1): B sequences decoded together (or B prompts prefilled),
# against llama.cpp's llama-batched-bench (-npl B; its speed_tg, or speed_pp), totals over all sequences.
# Decode rows also give the bandwidth bound: build/bench/copy_bandwidth's read bandwidth (measured once, first) over
# the model bytes a batch-1 step reads (qdecode_bench's bytes_read_per_token), and ours as a fraction of it.
#   bench/qdecode_bench.sh [--rounds N] [--new N] [--prefill P] [--batch B] [--threads T] [--types "q8_0 q4_k"] [FILE.gguf ...]
# Without files: hybridscan's random `small` model (seed 7) exported by qdecode_bench make-small at each type.
# LLAMA_CPP_DIR: a llama.cpp tree built as bench/generate_bench.sh builds it (its build/bin has llama-bench); or
# LLAMA_BIN: that build/bin itself. Never rebuilt here. LLAMA_BENCH_ARGS: more llama-bench flags (e.g. "--repack 0":
# a native build on a CPU with AMX crashed in ggml_backend_amx_mul_mat on `small` with its default repacking).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=5 NEW=64 PREFILL=0 BATCH=1 THREADS=2 TYPES="q8_0 q4_k" FILES=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) ROUNDS=$2; shift 2 ;;
    --new) NEW=$2; shift 2 ;;
    --prefill) PREFILL=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --types) TYPES=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
if [[ $BATCH -gt 1 && ! -x $LLAMA_BIN/llama-batched-bench ]]; then
  echo "qdecode_bench.sh: --batch needs $LLAMA_BIN/llama-batched-bench (cmake --build BUILD --target llama-batched-bench)" >&2
  exit 2
fi
READ_BW=$(build/bench/copy_bandwidth "$THREADS" 256 5 | python3 -c 'import json,sys; print(json.load(sys.stdin)["read_bytes_per_s"])')
echo "read bandwidth ($THREADS threads): $READ_BW bytes/s"
RES=$WORK/results.txt
: > "$RES"
# llama-batched-bench: B sequences of P prompt tokens, then NEW steps of all; the one jsonl line's field $1.
batched() {
  "$LLAMA_BIN/llama-batched-bench" -m "$1" -c $(( BATCH * ($2 + $3 + 1) )) -b 512 -ub 512 -npp "$2" -ntg "$3" \
    -npl "$BATCH" -t "$THREADS" ${LLAMA_BATCHED_ARGS:-} --output-format jsonl 2>/dev/null |
    python3 -c "import json,sys; print([json.loads(l) for l in sys.stdin if l.startswith('{')][-1]['$4'])"
}
for ((r = 0; r < ROUNDS; ++r)); do
  for f in "${FILES[@]}"; do
    bytes=0
    if [[ $PREFILL -gt 0 ]]; then
      hs=$(OMP_NUM_THREADS=$THREADS "$QB" prefill "$f" "$PREFILL" chunked "$BATCH" | python3 -c 'import json,sys; print(json.load(sys.stdin)["prefill_tokens_per_s"])')
      if [[ $BATCH -gt 1 ]]; then
        ll=$(batched "$f" "$PREFILL" 1 speed_pp)
      else
        ll=$("$LLAMA_BIN/llama-bench" -m "$f" -p "$PREFILL" -n 0 -t "$THREADS" -r 1 ${LLAMA_BENCH_ARGS:-} -o json 2>/dev/null |
             python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["avg_ts"])')
      fi
    else
      read -r hs bytes < <(OMP_NUM_THREADS=$THREADS "$QB" run "$f" "$NEW" 1 "$BATCH" |
        python3 -c 'import json,sys; d = json.load(sys.stdin); print(d["decode_tokens_per_s"], d["bytes_read_per_token"])')
      if [[ $BATCH -gt 1 ]]; then
        ll=$(batched "$f" 1 "$NEW" speed_tg)
      else
        ll=$("$LLAMA_BIN/llama-bench" -m "$f" -p 0 -n "$NEW" -t "$THREADS" -r 1 ${LLAMA_BENCH_ARGS:-} -o json 2>/dev/null |
             python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["avg_ts"])')
      fi
    fi
    echo "$(basename "$f") $hs $ll $bytes" | tee -a "$RES"
  done
done
python3 - "$RES" "$READ_BW" "$BATCH" "$PREFILL" <<'PY'
import sys, statistics as st
bw, batch, prefill = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows, nbytes = {}, {}
for line in open(sys.argv[1]):
    f, hs, ll, b = line.split()
    rows.setdefault(f, []).append((float(hs), float(ll)))
    nbytes[f] = float(b)
bound = prefill == 0 and batch == 1
print(f"{'prefill of ' + str(prefill) if prefill else 'decode'}, batch {batch}")
print("| file | hybridscan tok/s median (min..max) | llama.cpp tok/s median (min..max) | ratio of medians | per-round ratios median (min..max) |"
      + (" bytes read per token | bandwidth bound tok/s | ours / bound |" if bound else ""))
print("|---|---|---|---|---|" + ("---|---|---|" if bound else ""))
for f, v in rows.items():
    h = [a for a, _ in v]; l = [b for _, b in v]; q = [a / b for a, b in v]
    line = (f"| {f} | {st.median(h):.1f} ({min(h):.1f}..{max(h):.1f}) | {st.median(l):.1f} ({min(l):.1f}..{max(l):.1f}) | "
            f"{st.median(h) / st.median(l):.2f} | {st.median(q):.2f} ({min(q):.2f}..{max(q):.2f}) |")
    if bound:
        b = bw / nbytes[f]
        line += f" {nbytes[f] / 1e6:.0f} MB | {b:.1f} | {st.median(h) / b:.2f} |"
    print(line)
PY
