#!/usr/bin/env bash
# Quantization quality: our `convert --quantize` against llama.cpp's llama-quantize, both from the same trained
# checkpoint, scored by one evaluator, llama-perplexity: the KL divergence of every quantized file's next-token
# distributions from the unquantized model's over a held-out text, its perplexity and how often the top token is the
# same. Our own `eval --gguf-blocks` perplexity of every file is a second column. Not a test: nothing here gates CI.
#
#   bench/quant_quality.sh CHECKPOINT [--llama-dir DIR] [--llama-bin DIR] [--out DIR] [--text FILE] [--ctx N]
#                          [--chunks N] [--threads T] [--no-eval]
#
#   CHECKPOINT   a trained checkpoint directory (native or Hugging Face), e.g. runs/qq-small/checkpoint-600 from
#                `hybridscan train --preset small --text data/kjv.txt --steps 600 --batch 8 --seq 128`
#   --llama-dir  a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/) (default $LLAMA_CPP_DIR)
#   --llama-bin  the directory of its llama-quantize and llama-perplexity (default DIR/build/bin)
#   --out        the files and results (default build/quant_quality): results.jsonl, table.md, *.log
#   --text       the held-out text (default data/kjv-heldout.txt: the last 80,000 bytes of data/kjv.txt, inside the
#                2% that training holds out)
#   --ctx        llama-perplexity's -c and eval's --seq (default 512)
#   --chunks     score only the text's first N windows of --ctx tokens (llama-perplexity --chunks N; eval gets the
#                first N x ctx bytes, the same tokens for a byte vocabulary) (default: all)
#   --threads    llama.cpp's -t and hybridscan's threads (default: all cores)
#   --no-eval    skip the hybridscan eval column
#
# Files, all from the checkpoint's exact fp32 weights:
#   base.f32   llama.cpp's converter --outtype f32 (the reference: llama-perplexity --kl-divergence-base)
#   llama-bf16 the converter's --outtype bf16
#   llama-Q8_0, llama-Q4_K, llama-Q5_K, llama-Q6_K   llama-quantize --pure of base.f32 (every tensor it quantizes at
#              that type, token_embd and output included; the same-type comparison)
#   llama-Q4_K_M   llama-quantize's mixture, of base.f32
#   ours-q8_0, ours-q4_k, ours-q5_k, ours-q6_k, ours-mixed   hybridscan convert --quantize of the checkpoint
# Existing files in --out are reused (delete them to remake them), and so are finished logs newer than their file.
# Per file: its tensor types and bits per weight (all tensors' bytes x 8 / weights), and for ours against llama's of
# the same type how many tensors are byte-equal (bench/quant_quality.py same).
# llama-perplexity runs with --no-repack (a native build's AMX repacking crashed on `small` here; bench/qdecode_bench.sh).
set -euo pipefail
usage() { sed -n '2,33p' "$0"; exit "${1:-0}"; }
[[ $# -ge 1 ]] || usage 1
[[ $1 == -h || $1 == --help ]] && usage
CK=$(cd "$1" && pwd)
shift
LLAMA=${LLAMA_CPP_DIR:-}
BIN=
OUT=build/quant_quality
TEXT=data/kjv-heldout.txt
CTX=512
CHUNKS=0
THREADS=$(nproc)
EVAL=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --llama-dir) LLAMA=$2; shift 2 ;;
    --llama-bin) BIN=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --text) TEXT=$2; shift 2 ;;
    --ctx) CTX=$2; shift 2 ;;
    --chunks) CHUNKS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --no-eval) EVAL=0; shift ;;
    -h|--help) usage ;;
    *) echo "unknown argument $1" >&2; usage 1 ;;
  esac
done
[[ -n $LLAMA ]] || { echo "--llama-dir (or LLAMA_CPP_DIR) is required" >&2; exit 1; }
LLAMA=$(cd "$LLAMA" && pwd)
BIN=$(cd "${BIN:-$LLAMA/build/bin}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TEXT=$(cd "$(dirname "$TEXT")" && pwd)/$(basename "$TEXT")
cd "$ROOT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=.venv/bin/python
HELP=bench/quant_quality.py
ninja -C build hybridscan >&2

# The files.
[[ -f $OUT/model.hf/config.json ]] ||
  build/hybridscan convert --from "$CK" --to "$OUT/model.hf" --format hf --overwrite --quiet >&2
for t in f32 bf16; do
  f=$OUT/llama-$t.gguf
  [[ $t == f32 ]] && f=$OUT/base.f32.gguf
  [[ -f $f ]] || $PY scripts/make_gguf_fixtures.py --llama-dir "$LLAMA" --hf "$OUT/model.hf" --outtype "$t" \
    --outfile "$f" > "$OUT/convert-$t.log" 2>&1
done
for t in Q8_0 Q4_K Q5_K Q6_K Q4_K_M; do
  pure=(--pure)
  [[ $t == Q4_K_M ]] && pure=()
  [[ -f $OUT/llama-$t.gguf ]] || "$BIN/llama-quantize" "${pure[@]}" "$OUT/base.f32.gguf" "$OUT/llama-$t.gguf" "$t" \
    "$THREADS" > "$OUT/quantize-$t.log" 2>&1
done
for t in q8_0 q4_k q5_k q6_k mixed; do
  [[ -f $OUT/ours-$t.gguf ]] ||
    build/hybridscan convert --from "$CK" --to "$OUT/ours-$t.gguf" --quantize "$t" --overwrite --quiet >&2
done

# Same type, same bytes?
: > "$OUT/same.jsonl"
for t in q8_0 q4_k q5_k q6_k; do
  $PY $HELP same "$OUT/ours-$t.gguf" "$OUT/llama-${t^^}.gguf" >> "$OUT/same.jsonl"
done

# The reference logits, then every file against them (one evaluator).
PPLX=(-c "$CTX" -b "$CTX" -t "$THREADS" --no-repack -f "$TEXT")
EVAL_TEXT=$TEXT
if [[ $CHUNKS != 0 ]]; then
  PPLX+=(--chunks "$CHUNKS")
  EVAL_TEXT=$OUT/eval-text.txt
  head -c $((CHUNKS * CTX)) "$TEXT" > "$EVAL_TEXT"
fi
# Logs of other evaluation settings are not reused.
if [[ "$(cat "$OUT/settings" 2>/dev/null)" != "${PPLX[*]}" ]]; then
  rm -f "$OUT"/ppl-*.log "$OUT"/eval-*.json "$OUT/base.kld"
  echo "${PPLX[*]}" > "$OUT/settings"
fi
[[ -s $OUT/base.kld && $OUT/base.kld -nt $OUT/base.f32.gguf ]] && grep -qs "Final estimate" "$OUT/ppl-base.f32.log" ||
  "$BIN/llama-perplexity" -m "$OUT/base.f32.gguf" "${PPLX[@]}" --kl-divergence-base "$OUT/base.kld" \
    > "$OUT/ppl-base.f32.log" 2>&1
names=(base.f32 llama-bf16 llama-Q8_0 ours-q8_0 llama-Q6_K ours-q6_k llama-Q5_K ours-q5_k llama-Q4_K ours-q4_k
  llama-Q4_K_M ours-mixed)
: > "$OUT/results.jsonl"
for n in "${names[@]}"; do
  f=$OUT/$n.gguf
  if [[ $n == base.f32 ]]; then
    kl=$(grep -o 'Final estimate: PPL = [0-9.]* +/- [0-9.]*' "$OUT/ppl-base.f32.log" |
      awk '{print "{\"ppl\": " $5 ", \"ppl_err\": " $7 ", \"kld\": null}"}')
  else
    # A finished log newer than the file is kept (a rerun resumes). One run here stopped after its 39th of 40 chunks
    # without its summary; such a log is run again.
    for try in 1 2; do
      if [[ ! $OUT/ppl-$n.log -nt $f ]] || ! $PY $HELP kld "$OUT/ppl-$n.log" > /dev/null 2>&1; then
        "$BIN/llama-perplexity" -m "$f" "${PPLX[@]}" --kl-divergence --kl-divergence-base "$OUT/base.kld" \
          > "$OUT/ppl-$n.log" 2>&1
      fi
    done
    kl=$($PY $HELP kld "$OUT/ppl-$n.log")
  fi
  ce=null
  if [[ $EVAL == 1 ]]; then
    [[ -s $OUT/eval-$n.json && $OUT/eval-$n.json -nt $f ]] ||
      OMP_NUM_THREADS=$THREADS build/hybridscan eval --checkpoint "$f" --gguf-blocks --text "$EVAL_TEXT" --seq "$CTX" \
        > "$OUT/eval-$n.json" 2> "$OUT/eval-$n.log"
    ce=$(tail -n1 "$OUT/eval-$n.json" | jq .cross_entropy)
  fi
  $PY $HELP types "$f" | jq -c --arg n "$n" --argjson kl "$kl" --argjson ce "$ce" \
    '{name: $n} + . + $kl + {eval_ce: $ce} | del(.matrices)' >> "$OUT/results.jsonl"
done
$PY $HELP table "$OUT/results.jsonl" | tee "$OUT/table.md"
echo
echo "byte-equal tensors, ours against llama-quantize --pure at the same type:"
jq -r '"  \(.a | split("/") | last) vs \(.b | split("/") | last): \(.byte_equal) of \(.common) byte-equal" +
  (if (.differ | length) > 0 then "; differ: " + ([.differ[] | "\(.name) (\(.a)/\(.b))"] | join(", ")) else "" end)' \
  "$OUT/same.jsonl"
