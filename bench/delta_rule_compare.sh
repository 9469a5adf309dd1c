#!/usr/bin/env bash
# Forward + backward tokens/s of our chunked gated delta rule against the PyTorch chunked implementation
# (bench/delta_rule_torch.py) on the same shapes, both on THREADS CPU threads, measured in the same run.
# Shared machines are noisy, so each side reports its best of several repetitions; ratio = ours / torch. bf16 rows
# also show ours with the bf16-input products (DeltaRuleProducts::Bf16; "-" without AVX-512-BF16) and its ratio.
# Usage: bench/delta_rule_compare.sh [build dir (default: build)]   env: THREADS (default 2), REPS (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
THREADS=${THREADS:-2}
REPS=${REPS:-5}
BIN="$BUILD/bench/delta_rule_bench"
[[ -x "$BIN" ]] || { echo "missing $BIN: configure with -DHS_BUILD_BENCH=ON and build delta_rule_bench" >&2; exit 1; }

ours=$(mktemp)
torch_out=$(mktemp)
trap 'rm -f "$ours" "$torch_out"' EXIT
OMP_NUM_THREADS=$THREADS "$BIN" --benchmark_filter=ForwardBackward --benchmark_repetitions="$REPS" \
  --benchmark_format=json >"$ours" 2>/dev/null
OMP_NUM_THREADS=$THREADS python3 bench/delta_rule_torch.py --threads "$THREADS" --reps "$REPS" >"$torch_out"

python3 - "$ours" "$torch_out" "$THREADS" <<'EOF'
import json, re, sys
ours_file, torch_file, threads = sys.argv[1:]
best = {}
for b in json.load(open(ours_file))["benchmarks"]:
    if b.get("run_type") != "iteration":
        continue
    if b.get("error_occurred"):
        continue
    m = re.match(r"BM_DeltaRuleForwardBackward(?:<(\w+)>|(Bf16Products))/(\d+/\d+/\d+/\d+/\d+)/0/", b["name"])
    if not m:
        continue
    dtype = "bf16p" if m.group(2) else ("f32" if m.group(1) == "float" else m.group(1))
    key = (m.group(3), dtype)
    best[key] = max(best.get(key, 0.0), b["tokens/s"])
print(f"gated delta rule forward+backward, tokens/s, {threads} threads (shape = B/T/Hk/Hv/d)")
print(f"{'shape':<18} {'dtype':<5} {'ours':>10} {'torch':>10} {'ratio':>8} {'ours bf16 products':>19} {'ratio':>8}")
for line in open(torch_file):
    f = dict(kv.split("=") for kv in line.split())
    key = (f["shape"], f["dtype"])
    theirs = float(f["tokens_per_s"])
    extra = ""
    if key[1] == "bf16":
        bp = best.get((key[0], "bf16p"))
        extra = f" {bp:>19.0f} {bp / theirs:>7.1f}x" if bp else f" {'-':>19} {'-':>8}"
    print(f"{key[0]:<18} {key[1]:<5} {best[key]:>10.0f} {theirs:>10.0f} {best[key] / theirs:>7.1f}x{extra}")
EOF
