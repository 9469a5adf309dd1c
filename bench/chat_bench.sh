#!/usr/bin/env bash
# Chat-template rendering speed of hybridscan (src/chat) against transformers' own rendering (jinja2, compiled to
# Python), in the same run on the same conversations: tests/chat_reference.py's generated cases of every real Qwen
# template in data/templates, each rendered REPS times after a warm-up, the best pass reported, with the ratio.
# Usage: bench/chat_bench.sh [build dir (default: build)]     env: REPS (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
REPS=${REPS:-5}
BIN="$BUILD/bench/chat_render"
PY=.venv/bin/python
[[ -x "$BIN" ]] || { echo "missing $BIN: configure with -DHS_BUILD_BENCH=ON and build chat_render" >&2; exit 2; }
for f in "$PY" data/templates data/tokenizers/qwen2/tokenizer.json; do
  [[ -e "$f" ]] || { echo "missing $f: run scripts/setup.sh" >&2; exit 2; }
done
cases=$(mktemp)
ours=$(mktemp)
peer=$(mktemp)
trap 'rm -f "$cases" "$ours" "$peer"' EXIT
"$PY" tests/chat_reference.py data/templates data/tokenizers "$cases"
"$BIN" "$cases" data/templates "$REPS" >"$ours"
"$PY" bench/chat_render_peer.py "$cases" data/templates "$REPS" >"$peer"
"$PY" - "$ours" "$peer" <<'PY'
import json, sys
ours = {r["template"]: r for r in map(json.loads, open(sys.argv[1]))}
peer = {r["template"]: r for r in map(json.loads, open(sys.argv[2]))}
print("%-32s %6s %16s %16s %7s" % ("template", "convs", "hybridscan /s", "transformers /s", "ratio"))
for name in sorted(ours):
    o, p = ours[name], peer[name]
    print("%-32s %6d %16.0f %16.0f %6.1fx" % (name, o["conversations"], o["per_s"], p["per_s"], o["per_s"] / p["per_s"]))
PY
