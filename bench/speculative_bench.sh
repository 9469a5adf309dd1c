#!/usr/bin/env bash
# Speculative decoding with the MTP layer (generate --speculative mtp --draft N) against plain decoding, same run:
# each `generate --compare-plain` call decodes its prompts speculatively and then plainly in the same process and
# reports both decode rates, the acceptance per draft position and whether the tokens are the same. Not a test.
#
#   bench/speculative_bench.sh CHECKPOINT [--new N] [--prompts K] [--drafts "1 2 3"] [--batches "1 8"]
#                              [--identity P] [--threads T] [--out DIR]
#
#   CHECKPOINT  a checkpoint with an MTP layer (e.g. train --preset small+mtp --mtp-weight 0.3, docs/model.md)
#   --new       new tokens per prompt (default 128; --ignore-eos)
#   --prompts   prompts at batch 1, each its own call (default 8); batch B > 1 decodes B prompts together
#   --identity  P prompts decoded together, greedy, at every draft depth: speculative tokens == plain tokens
#               (default 100; 0 skips)
#   --out       results (default runs/speculative_bench): results.jsonl (every call's JSON line), summary.md
#
# Prompts: the first 48 bytes of the lines of data/kjv-heldout.txt longer than 48 bytes (text the model did not
# train on). Greedy throughout (temperature 0). The speedup is decode tokens/s (after the first token) speculative
# over plain, medians over the calls.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/hybridscan}
[ $# -ge 1 ] || { sed -n 2,20p "$0"; exit 2; }
CK=$1; shift
NEW=128 K=8 DRAFTS="1 2 3" BATCHES="1 8" IDENT=100 THREADS=0 OUT=runs/speculative_bench
while [ $# -gt 0 ]; do
  case $1 in
    --new) NEW=$2; shift 2 ;;
    --prompts) K=$2; shift 2 ;;
    --drafts) DRAFTS=$2; shift 2 ;;
    --batches) BATCHES=$2; shift 2 ;;
    --identity) IDENT=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
: > "$OUT/results.jsonl"
PROMPTS="$OUT/prompts.txt"
awk 'length($0) > 48 { s = substr($0, 1, 48); gsub(/^ +/, "", s); print s }' data/kjv-heldout.txt > "$PROMPTS"
TH=()
[ "$THREADS" -gt 0 ] && TH=(--threads "$THREADS")

call() {  # label, then generate's arguments
  local label=$1; shift
  "$BIN" generate --checkpoint "$CK" --ignore-eos --json --compare-plain "${TH[@]}" "$@" > "$OUT/last.out" 2> "$OUT/last.err" ||
    { cat "$OUT/last.err" >&2; exit 1; }
  printf '{"label": "%s", "result": %s}\n' "$label" "$(tail -n 1 "$OUT/last.out")" >> "$OUT/results.jsonl"
  grep '^speculative:' "$OUT/last.err" | sed "s/^/[$label] /" >&2
}

for N in $DRAFTS; do
  for B in $BATCHES; do
    if [ "$B" -eq 1 ]; then
      for i in $(seq 1 "$K"); do
        call "b1 draft$N" --speculative mtp --draft "$N" --max-new-tokens "$NEW" --prompt "$(sed -n "${i}p" "$PROMPTS")"
      done
    else
      head -n "$B" "$PROMPTS" > "$OUT/batch.txt"
      call "b$B draft$N" --speculative mtp --draft "$N" --max-new-tokens "$NEW" --prompts "$OUT/batch.txt"
    fi
  done
  if [ "$IDENT" -gt 0 ]; then
    head -n "$IDENT" "$PROMPTS" > "$OUT/identity.txt"
    call "identity$IDENT draft$N" --speculative mtp --draft "$N" --max-new-tokens "$NEW" --prompts "$OUT/identity.txt"
  fi
done

python3 - "$OUT" <<'EOF'
import json, statistics, sys, collections
out = sys.argv[1]
rows = collections.OrderedDict()
for line in open(f"{out}/results.jsonl"):
    r = json.loads(line)
    rows.setdefault(r["label"], []).append(r["result"])
lines = ["| run | calls | acceptance per draft position | tokens / step | plain tok/s | speculative tok/s | speedup | same tokens |",
         "|---|---|---|---|---|---|---|---|"]
for label, rs in rows.items():
    s = [r["speculative"] for r in rs]
    acc = [statistics.mean(x["accepted_rate"][k] for x in s) for k in range(len(s[0]["accepted_rate"]))]
    lines.append("| %s | %d | %s | %.2f | %.1f | %.1f | %.2fx | %s |" % (
        label, len(rs), ", ".join("%.0f%%" % (100 * a) for a in acc),
        statistics.mean(x["tokens_per_step"] for x in s),
        statistics.median(x["plain_decode_tokens_per_s"] for x in s),
        statistics.median(r["decode_tokens_per_s"] for r in rs),
        statistics.median(x["speedup"] for x in s),
        "yes" if all(x["same_tokens_as_plain"] for x in s) else "NO"))
open(f"{out}/summary.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
