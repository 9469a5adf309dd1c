#!/usr/bin/env bash
# A/B of two hybridscan builds (or two environments) on the `small` training step, alternated run by run so that a
# noisy, shared machine slows both alike. Each run trains WARMUP + STEPS synthetic steps and is timed over the steps
# after the warm-up (total tokens / total time, from its metrics.jsonl); prints every run, the mean and median per
# side, B / A of the means and the median of the per-round B / A.
#
#   bench/ab_train_step.sh [--rounds R] [--steps S] [--warmup W] [--remat none|block|sublayer] A B
# A and B are each a binary, or ENV=VALUE...:binary to run it with extra environment variables, either followed by
# train flags of that side, e.g.
#   bench/ab_train_step.sh /tmp/hybridscan-before build/hybridscan
#   bench/ab_train_step.sh GLIBC_TUNABLES=glibc.malloc.hugetlb=0:build/hybridscan build/hybridscan
#   DATA=/tmp/docs.tok bench/ab_train_step.sh "build/hybridscan --packing stream" "build/hybridscan --packing documents"
# Batch 8 x 512, 2 threads, bf16 compute (BATCH, SEQ, THREADS, DTYPE override); the `small` preset, or CONFIG=a
# config.json (e.g. bench/configs/real_width_4layer.json: the real layer widths, 4 layers, 8 experts top-2); synthetic
# tokens, or DATA=a token file (bench/documents_token_file.py writes one of many documents).
set -euo pipefail

rounds=4 steps=6 warmup=2 remat=none
batch=${BATCH:-8} seq=${SEQ:-512} threads=${THREADS:-2} dtype=${DTYPE:-bf16}
model=(--preset small)
[ -n "${CONFIG:-}" ] && model=(--config "$CONFIG")
data=(--synthetic)
[ -n "${DATA:-}" ] && data=(--data "$DATA")
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=${2:?}; shift 2 ;;
    --steps) steps=${2:?}; shift 2 ;;
    --warmup) warmup=${2:?}; shift 2 ;;
    --remat) remat=${2:?}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --*) usage >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -eq 2 ] || { usage >&2; exit 2; }
for v in rounds steps; do [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "ab_train_step.sh: --$v must be a positive integer" >&2; exit 2; }; done
[[ $warmup =~ ^[0-9]+$ ]] || { echo "ab_train_step.sh: --warmup must be a non-negative integer" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Splits "ENV=V ENV2=V2:binary" into an env prefix and the binary.
run() {
  local spec=$1 bin envs=() cmd=()
  read -r -a cmd <<<"${spec##*:}"
  bin=${cmd[0]}
  if [ "${spec##*:}" != "$spec" ]; then read -r -a envs <<<"${spec%:*}"; fi
  [ -x "$bin" ] || { echo "ab_train_step.sh: $bin is not an executable" >&2; exit 2; }
  rm -rf "$tmp/out"
  if ! env "${envs[@]}" "$bin" train "${model[@]}" "${data[@]}" "${cmd[@]:1}" --steps $((warmup + steps)) --batch "$batch" \
      --seq "$seq" --threads "$threads" --compute-dtype "$dtype" --remat "$remat" --quiet --json --out "$tmp/out" \
      >/dev/null 2>"$tmp/err"; then
    echo "ab_train_step.sh: $spec failed:" >&2
    tail -n 20 "$tmp/err" >&2
    exit 1
  fi
  python3 - "$tmp/out/metrics.jsonl" "$warmup" <<'EOF'
import json, sys
v = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1]) if l.strip()][int(sys.argv[2]):]
print(f"{len(v) / sum(1.0 / x for x in v):.1f}")
EOF
}

a=() b=()
printf '%-6s %-4s %12s\n' round side tokens/s
for ((r = 1; r <= rounds; r++)); do
  t=$(run "$1"); a+=("$t"); printf '%-6s %-4s %12s\n' "$r" A "$t"
  t=$(run "$2"); b+=("$t"); printf '%-6s %-4s %12s\n' "$r" B "$t"
done
python3 - "$rounds" "${a[@]}" "${b[@]}" <<'EOF'
import statistics, sys
n = int(sys.argv[1])
a = [float(x) for x in sys.argv[2:2 + n]]
b = [float(x) for x in sys.argv[2 + n:]]
print(f"mean tokens/s  A {statistics.mean(a):.1f}  B {statistics.mean(b):.1f}  B/A {statistics.mean(b) / statistics.mean(a):.3f}"
      f"  (B faster in {sum(y > x for x, y in zip(a, b))} of {n} rounds)")
print(f"median tokens/s  A {statistics.median(a):.1f}  B {statistics.median(b):.1f}"
      f"  median of the per-round B/A {statistics.median(y / x for x, y in zip(a, b)):.3f}")
EOF
