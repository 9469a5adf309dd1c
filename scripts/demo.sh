#!/usr/bin/env bash
# The main job: installs and builds (scripts/setup.sh), trains the `small` Qwen3-Next-family model on the King James
# Bible (byte tokens) for a few minutes on this machine's cores, evaluates it on the held-out text, lets it write a
# few lines (generate), and prints the measured step-memory table of the three remat policies next to the planner's prediction.
#   STEPS=300 scripts/demo.sh        (default 300 steps; OUT=runs/demo)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build

STEPS=${STEPS:-300}
OUT=${OUT:-runs/demo}
echo "== training 'small' on data/kjv.txt for $STEPS steps (batch 8 x 256 bytes) -> $OUT"
build/hybridscan train --preset small --text data/kjv.txt --steps "$STEPS" --batch 8 --seq 256 --lr 2e-3 \
  --warmup 30 --eval-every 50 --out "$OUT" --report-memory
python3 - "$OUT/metrics.jsonl" <<'PY' || true
import json, math, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
data = open("data/kjv.txt", "rb").read()
n = len(data); cnt = collections.Counter(data)
unigram = -sum(c / n * math.log(c / n) for c in cnt.values())
ev = [r for r in rows if "eval_ce" in r]
print(f"byte unigram entropy of the corpus: {unigram:.3f} nats ({unigram / math.log(2):.3f} bits/byte)")
print(f"first step loss {rows[0]['ce']:.3f} -> last {rows[-1]['ce']:.3f} nats; held-out {ev[-1]['eval_ce']:.3f} nats "
      f"= {ev[-1]['eval_bits_per_byte']:.3f} bits/byte")
PY
echo "== loss curve: $OUT/loss.svg, metrics: $OUT/metrics.jsonl"

echo "== the trained model writing (generate: 200 bytes sampled at temperature 0.8, top-k 40, seed 1)"
build/hybridscan generate --checkpoint "$OUT/checkpoint-$STEPS" --prompt "And God said" --max-new-tokens 200 \
  --temperature 0.8 --top-k 40 --seed 1

echo "== step memory of 'small', batch 8 x seq 512, fp32 weights, bf16 compute: measured (2 steps) vs planned"
printf "%-9s %-7s %14s %14s %14s\n" policy weights measured_temp planned_temp measured_peak
for w in fp32 bf16; do
  for r in none block sublayer; do
    m=$(build/hybridscan train --preset small --synthetic --steps 2 --batch 8 --seq 512 --remat $r --weight-dtype $w \
        --quiet --json 2>/dev/null | tail -n 1)
    p=$(build/hybridscan plan --model small --batch-per-device 8 --seq 512 --remat $r --weight-dtype $w --json)
    python3 -c "import json,sys; m=json.loads(sys.argv[1]); p=json.loads(sys.argv[2]); \
print('%-9s %-7s %11.1f MiB %11.1f MiB %11.1f MiB' % (sys.argv[3], sys.argv[4], m['temp_bytes']/2**20, p['temp_bytes']/2**20, m['peak_bytes']/2**20))" \
      "$m" "$p" "$r" "$w"
  done
done
