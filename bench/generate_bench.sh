#!/usr/bin/env bash
# Generation speed: hybridscan against llama.cpp (the peer) and transformers' generate (second peer), on the same
# bf16 weights, at batch 1 and batch 8: prefill tokens/s of a 512-token prompt and decode tokens/s of 128 new tokens,
# plus the decode ceiling set by this machine's memory bandwidth. Not a test: nothing here gates CI.
#
#   bench/generate_bench.sh [--model small|real|both] [--rounds N] [--threads T] [--prompt-len P] [--new N]
#                           [--batches "1 8"] [--no-transformers] [--out DIR]
#
#   --model    small: hybridscan's `small` preset (Qwen3-Next, 16.4M parameters, byte vocabulary);
#              real: the layer widths of qwen3.5-35b-a3b (hidden 2048, attention 16q/2kv x 256, GDN 16k/32v x 128,
#              experts and shared expert of 512, real Qwen3.5 vocabulary of 248,320) with 4 layers and 16 experts
#              top-8 (1.36B parameters, 2.7 GB in bf16); both (default).
#   --rounds   rounds of every measurement (default 1); the engines alternate within a round, medians are reported.
#   --out      results (default runs/generate_bench): results.jsonl (every run), generate_bench.json, generate_bench.md.
#
# Environment: HS_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/hybridscan) holds the peer and the models between runs;
# LLAMA_CPP_DIR reuses an extracted llama.cpp tree (its build/ too) instead of downloading llama-cpp-python 0.3.36's
# sdist (`pip download --no-deps --no-binary :all:`) and building it there once; PYTHON (default .venv/bin/python,
# with torch and transformers: scripts/setup.sh --bench). OMP_WAIT_POLICY passes through to hybridscan and torch: on
# cores busy with other work set it to passive (spinning OpenMP threads then cost several times their speed).
# LLAMA_LOAD_MODE (default auto: llama.cpp maps the GGUF) is llama-bench's and llama-batched-bench's -lm; `none` reads
# the weights into llama.cpp's own memory, as hybridscan's default --weights-memory auto copies them (real b1 tg16,
# none / mmap alternated on a machine at load average 12: 1.25, 1.29 against 0.88, 1.47 tokens/s: not settled).
#
# What runs: the models are random-initialised by transformers (seed 1) and saved as Hugging Face checkpoints
# (bench/generate_bench.py models); llama.cpp's convert_hf_to_gguf.py converts them (--outtype bf16). hybridscan reads
# the Hugging Face directory itself (generate --prompt-ids ... --ignore-eos --json). llama.cpp: llama-bench -p P -n 0
# (prefill) and -p 0 -n N -d P (decode after a P-token context) at batch 1, llama-batched-bench -npp P -ntg N -npl 8 at
# batch 8. transformers: generate, greedy, bf16, torch threads = T. Prompts: the same random ids for every engine.
# A greedy check runs each model through hybridscan and llama.cpp (bench/llama_greedy.cpp) and scores both engines'
# tokens against transformers in fp32 (how many leading tokens equal its greedy ones, and by how much each engine's
# choice trails the fp32 argmax: near-ties of a random model can flip in bf16, a wrong model would trail by a lot).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

MODEL=both ROUNDS=1 THREADS=2 PLEN=512 NEW=128 BATCHES="1 8" TRANSFORMERS=1 OUT=runs/generate_bench
LLAMA_LOAD_MODE=${LLAMA_LOAD_MODE:-auto}
while [[ $# -gt 0 ]]; do
  case $1 in
    --model) MODEL=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --prompt-len) PLEN=$2; shift 2 ;;
    --new) NEW=$2; shift 2 ;;
    --batches) BATCHES=$2; shift 2 ;;
    --no-transformers) TRANSFORMERS=0; shift ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "generate_bench.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case $MODEL in small) MODELS=small ;; real) MODELS=real ;; both) MODELS="small real" ;;
  *) echo "generate_bench.sh: --model small|real|both" >&2; exit 2 ;; esac
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "generate_bench.sh: --rounds must be a positive integer" >&2; exit 2; }

PY=${PYTHON:-$ROOT/.venv/bin/python}
HS=$ROOT/build/hybridscan
CACHE=${HS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridscan}
WORK=$CACHE/generate_bench
mkdir -p "$WORK" "$OUT"
if [[ ! -x $HS ]]; then echo "generate_bench.sh: no build/hybridscan: run scripts/setup.sh first" >&2; exit 2; fi
"$PY" -c "import torch, transformers" 2>/dev/null ||
  { echo "generate_bench.sh: $PY lacks torch/transformers: scripts/setup.sh --bench" >&2; exit 2; }
[[ -x build/bench/copy_bandwidth ]] || cmake --build build --target copy_bandwidth >&2

# ---- the peer: llama.cpp from llama-cpp-python's sdist, built once
LLAMA_VERSION=0.3.36
if [[ -n ${LLAMA_CPP_DIR:-} ]]; then
  LLAMA=$LLAMA_CPP_DIR
else
  LLAMA=$CACHE/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp
  if [[ ! -f $LLAMA/CMakeLists.txt ]]; then
    echo "== downloading llama-cpp-python $LLAMA_VERSION (source) into $CACHE" >&2
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$CACHE/dl" >&2
    tar -xzf "$CACHE/dl/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$CACHE"
  fi
fi
if [[ ! -x $LLAMA/build/bin/llama-bench || ! -x $LLAMA/build/bin/llama-batched-bench ]]; then
  echo "== building llama.cpp in $LLAMA/build (once)" >&2
  cmake -S "$LLAMA" -B "$LLAMA/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF >&2
  cmake --build "$LLAMA/build" --target llama-bench llama-batched-bench >&2
fi
GREEDY=$WORK/llama_greedy
if [[ ! -x $GREEDY || bench/llama_greedy.cpp -nt $GREEDY ]]; then
  LIBDIR=$(dirname "$(find "$LLAMA/build" -name 'libllama.so' -o -name 'libllama.a' | head -n 1)")
  g++ -O2 -std=c++17 bench/llama_greedy.cpp -I"$LLAMA/include" -I"$LLAMA/ggml/include" -L"$LIBDIR" \
    -Wl,-rpath,"$LIBDIR" -lllama -lggml -lggml-base -o "$GREEDY" >&2
fi

RESULTS=$OUT/results.jsonl
: > "$RESULTS"
BW=$(build/bench/copy_bandwidth "$THREADS" 512 10)
echo "== copy bandwidth ($THREADS threads): $BW" >&2
BANDWIDTH=$("$PY" -c "import json,sys; print(json.loads(sys.argv[1])['copy_bytes_per_s'])" "$BW")
"$PY" - "$RESULTS" "$BW" <<PY
import json, sys
bw = json.loads(sys.argv[2])
meta = {"kind": "meta", "threads": $THREADS, "prompt_tokens": $PLEN, "new_tokens": $NEW, "rounds": $ROUNDS,
        "bandwidth_bytes_per_s": bw["copy_bytes_per_s"], "read_bandwidth_bytes_per_s": bw["read_bytes_per_s"],
        "llama_cpp": "llama-cpp-python $LLAMA_VERSION ($LLAMA)", "models": "$MODELS",
        "omp_wait_policy": "${OMP_WAIT_POLICY:-}", "llama_load_mode": "$LLAMA_LOAD_MODE", "load_average": open("/proc/loadavg").read().split()[:3]}
open(sys.argv[1], "a").write(json.dumps(meta) + "\n")
PY

record() { echo "$1" >> "$RESULTS"; }

for m in $MODELS; do
  HF=$WORK/$m-hf GGUF=$WORK/$m-bf16.gguf
  if [[ ! -f $HF/config.json ]]; then
    echo "== writing the random $m model (transformers, seed 1) -> $HF" >&2
    nice "$PY" bench/generate_bench.py models --model "$m" --out "$HF.tmp" >&2 && rm -rf "$HF" && mv "$HF.tmp" "$HF"
  fi
  if [[ ! -f $GGUF ]]; then
    echo "== converting $m to GGUF (llama.cpp's convert_hf_to_gguf.py, bf16)" >&2
    nice "$PY" bench/generate_bench.py convert --hf "$HF" --out "$GGUF.tmp" --llama-dir "$LLAMA" >&2 && mv "$GGUF.tmp" "$GGUF"
  fi
  VOCAB=$("$PY" -c "import json,sys; c=json.load(open(sys.argv[1])); c=c.get('text_config',c); print(min(c['vocab_size'], 248000))" "$HF/config.json")
  PROMPTS=$WORK/$m-prompts-$PLEN.txt
  "$PY" bench/generate_bench.py prompts --vocab "$VOCAB" --len "$PLEN" --count 8 > "$PROMPTS"
  for b in $BATCHES; do
    CONTEXT=$((PLEN + NEW / 2))  # the KV the average decode step reads
    record "$("$PY" bench/generate_bench.py bound --hf "$HF" --batch "$b" --context "$CONTEXT" --bandwidth "$BANDWIDTH" |
      "$PY" -c "import json,sys; d=json.load(sys.stdin); d.update(kind='bound', model='$m', batch=$b, context=$CONTEXT); print(json.dumps(d))")"
  done

  for r in $(seq "$ROUNDS"); do
    for b in $BATCHES; do
      echo "== $m, batch $b, round $r/$ROUNDS" >&2
      # Both engines map their weight files: read them into the page cache first, so that neither engine's prefill
      # pays for the disk (llama-bench also runs an untimed warm-up pass).
      cat "$HF"/*.safetensors "$GGUF" > /dev/null
      # hybridscan: the Hugging Face directory as it is (bf16; --weights-memory auto: copied into huge pages when they fit)
      args=()
      while IFS= read -r line; do args+=(--prompt-ids "$line"); done < <(head -n "$b" "$PROMPTS")
      j=$("$HS" generate --checkpoint "$HF" "${args[@]}" --max-new-tokens "$NEW" --ignore-eos --threads "$THREADS" \
          --json 2>"$OUT/hybridscan.stderr" | tail -n 1)
      record "$("$PY" -c "import json,sys; j=json.loads(sys.argv[1]); print(json.dumps(dict(kind='run', engine='hybridscan', model='$m', batch=$b, round=$r, prefill_tokens_per_s=j['prefill_tokens_per_s'], decode_tokens_per_s=j['decode_tokens_per_s'], peak_rss_bytes=j['peak_rss_bytes'], weights_mapped_bytes=j.get('weights_mapped_bytes'), weights_copied_bytes=j.get('weights_copied_bytes'), weights_memory=j.get('weights_memory'), thread_wait=j.get('thread_wait'), tokens=j['tokens'][0][:32])))" "$j")"
      # llama.cpp
      if [[ $b == 1 ]]; then
        pp=$("$LLAMA/build/bin/llama-bench" -m "$GGUF" -p "$PLEN" -n 0 -t "$THREADS" -lm "$LLAMA_LOAD_MODE" -r 1 -o json 2>/dev/null)
        tg=$("$LLAMA/build/bin/llama-bench" -m "$GGUF" -p 0 -n "$NEW" -d "$PLEN" -t "$THREADS" -lm "$LLAMA_LOAD_MODE" -r 1 -o json 2>/dev/null)
        record "$("$PY" -c "import json,sys; p=json.loads(sys.argv[1])[0]; t=json.loads(sys.argv[2])[0]; print(json.dumps(dict(kind='run', engine='llama.cpp', model='$m', batch=1, round=$r, prefill_tokens_per_s=p['avg_ts'], decode_tokens_per_s=t['avg_ts'], build=p.get('build_commit'))))" "$pp" "$tg")"
      else
        bb=$("$LLAMA/build/bin/llama-batched-bench" -m "$GGUF" -c $((b * (PLEN + NEW))) -b 2048 -ub 512 -npp "$PLEN" \
             -ntg "$NEW" -npl "$b" -t "$THREADS" -tb "$THREADS" -lm "$LLAMA_LOAD_MODE" --output-format jsonl 2>/dev/null | grep '^{' | tail -n 1)
        record "$("$PY" -c "import json,sys; j=json.loads(sys.argv[1]); print(json.dumps(dict(kind='run', engine='llama.cpp', model='$m', batch=$b, round=$r, prefill_tokens_per_s=j['speed_pp'], decode_tokens_per_s=j['speed_tg'])))" "$bb")"
      fi
      # transformers
      if [[ $TRANSFORMERS == 1 ]]; then
        t=$("$PY" bench/generate_bench.py transformers --hf "$HF" --prompts "$PROMPTS" --batch "$b" --new "$NEW" \
            --threads "$THREADS" 2>/dev/null | tail -n 1)
        record "$("$PY" -c "import json,sys; j=json.loads(sys.argv[1]); print(json.dumps(dict(kind='run', engine='transformers', model='$m', batch=$b, round=$r, prefill_tokens_per_s=j['prefill_tokens_per_s'], decode_tokens_per_s=j['decode_tokens_per_s'], tokens=j['tokens'][0][:32])))" "$t")"
      fi
    done
  done

  # Greedy check: 32 new tokens from the first 16 ids of the first prompt, from hybridscan and llama.cpp, scored
  # against transformers in fp32 (bench/generate_bench.py check).
  ids=$(head -n 1 "$PROMPTS" | cut -d, -f1-16)
  ht=$("$HS" generate --checkpoint "$HF" --prompt-ids "$ids" --max-new-tokens 32 --ignore-eos --threads "$THREADS" \
       --json 2>/dev/null | tail -n 1 | "$PY" -c "import json,sys; print(json.dumps(json.load(sys.stdin)['tokens'][0]))")
  lt=$("$GREEDY" "$GGUF" 32 "$THREADS" "$ids" 2>/dev/null | tail -n 1 |
       "$PY" -c "import json,sys; print(json.dumps(json.load(sys.stdin)['tokens']))")
  record "$("$PY" bench/generate_bench.py check --hf "$HF" --name "$m" --prompt "$ids" --new 32 --threads "$THREADS" \
            --engine "hybridscan=$ht" --engine "llama.cpp=$lt" 2>/dev/null | tail -n 1)"
done

"$PY" bench/generate_bench.py report --results "$RESULTS" --out-json "$OUT/generate_bench.json" --out-md "$OUT/generate_bench.md"
echo "== $OUT/generate_bench.md, $OUT/generate_bench.json, every run in $RESULTS" >&2
