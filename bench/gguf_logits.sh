#!/usr/bin/env bash
# hybridscan against llama.cpp on the same GGUF files: the logits of every position of a 64-token prompt (ids, no
# tokenizer in the way), top-1 agreement and the largest difference (bench/gguf_logits.py compare).
#
#   bench/gguf_logits.sh LLAMA_DIR [OUT_DIR]
#
# LLAMA_DIR is a llama.cpp source tree with a build (build/bin/libllama.so, llama-quantize): llama-cpp-python
# 0.3.36's vendored tree. Files, per family (Qwen3-Next: the `small` preset; Qwen3.5 MoE: the same widths as
# bench/gguf_qwen35_small.json), both trained 40 steps on data/kjv.txt so that the logits are not flat, and with
# GGUF_REAL=1 also a Qwen3.5 MoE of qwen3.5-35b-a3b's widths (bench/gguf_qwen35_real.json: 4 layers, 16 experts,
# a byte vocabulary; random weights: too slow to train here):
#   llama.cpp's converter f32 and bf16, llama-quantize's Q8_0, Q4_K_M and Q6_K of its f32 file, and our
#   convert --quantize q8_0, q4_k, q5_k, q6_k and mixed of the same checkpoint.
# hybridscan dequantizes at load and computes in fp32; llama.cpp computes on the quantized blocks (its activations
# quantized to Q8 for the quantized products), so the differences of quantized files include that rounding.
set -euo pipefail
LLAMA=$(cd "$1" && pwd)
OUT=${2:-build/gguf_logits}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
PY=.venv/bin/python
BIN=$LLAMA/build/bin
g++ -O2 -std=c++17 bench/gguf_llama_logits.cpp -I"$LLAMA/include" -I"$LLAMA/ggml/include" -L"$BIN" -Wl,-rpath,"$BIN" \
  -lllama -lggml -lggml-base -o "$OUT/gguf_llama_logits"
ninja -C build gguf_logits hybridscan >&2
PROMPT=$($PY -c "import random; r=random.Random(1); print(','.join(str(r.randrange(256)) for _ in range(64)))")
: > "$OUT/results.jsonl"  # this run's rows
# GGUF_FAMILIES="..." (space-separated) runs only those.
families=(small bench/gguf_qwen35_small.json)
[[ ${GGUF_REAL:-0} == 1 ]] && families+=(bench/gguf_qwen35_real.json)
[[ -n ${GGUF_FAMILIES:-} ]] && read -ra families <<< "$GGUF_FAMILIES"
for fam in "${families[@]}"; do
  name=$(basename "$fam" .json)
  ck=$OUT/$name.native
  if [[ $name == gguf_qwen35_real && ! -d $OUT/$name.hf ]]; then
    $PY bench/gguf_logits.py random --config "$fam" --out "$OUT/$name.hf" >&2
  elif [[ ! -d $OUT/$name.hf ]]; then
    rm -rf "$ck"
    build/hybridscan train --model "$fam" --text data/kjv.txt --steps 40 --warmup 5 --batch 4 --seq 128 --eval-every 0 \
      --out "$ck" >&2
    build/hybridscan convert --from "$ck/checkpoint-40" --to "$OUT/$name.hf" --format hf --quiet >&2
  fi
  files=()
  for t in f32 bf16; do
    [[ -f $OUT/$name.llama-$t.gguf ]] || $PY scripts/make_gguf_fixtures.py --llama-dir "$LLAMA" --hf "$OUT/$name.hf" \
      --outtype "$t" --outfile "$OUT/$name.llama-$t.gguf" >&2
    files+=("$OUT/$name.llama-$t.gguf")
  done
  for t in Q8_0 Q4_K_M Q6_K; do
    [[ -f $OUT/$name.llama-$t.gguf ]] || "$BIN/llama-quantize" "$OUT/$name.llama-f32.gguf" "$OUT/$name.llama-$t.gguf" "$t" >&2
    files+=("$OUT/$name.llama-$t.gguf")
  done
  for t in q8_0 q4_k q5_k q6_k mixed; do
    build/hybridscan convert --from "$OUT/$name.hf" --to "$OUT/$name.ours-$t.gguf" --quantize "$t" --overwrite >&2
    files+=("$OUT/$name.ours-$t.gguf")
  done
  for f in "${files[@]}"; do
    build/bench/gguf_logits "$f" "$PROMPT" > "$OUT/ours.json" 2>/dev/null
    "$OUT/gguf_llama_logits" "$f" 2 "$PROMPT" > "$OUT/llama.json" 2>/dev/null
    $PY bench/gguf_logits.py compare --file "$f" --ours "$OUT/ours.json" --llama "$OUT/llama.json" | tee -a "$OUT/results.jsonl"
  done
done
