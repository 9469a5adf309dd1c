#!/usr/bin/env bash
# Coverage-guided fuzzing of the safetensors parser, or with HS_FUZZ_TARGET=gguf of the GGUF header parser, with
# libFuzzer (clang, ASan + UBSan). Not part of the CMake build or CI; the gtest suite runs fixed-seed random fuzzes
# (tests/safetensors_fuzz_test.cpp, GgufFuzz.* in tests/gguf_file_test.cpp).
#
#   [HS_FUZZ_TARGET=gguf] scripts/fuzz.sh [seconds (default 60)] [extra libFuzzer flags...]
#
# Works in build-fuzz/ (override with HS_FUZZ_DIR); the corpus there starts from the committed fixtures
# and grows across runs. Crashing inputs are written to the current directory as crash-*.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${HS_FUZZ_DIR:-$root/build-fuzz}
seconds=${1:-60}
shift $(( $# > 0 ? 1 : 0 ))

if [[ ${HS_FUZZ_TARGET:-safetensors} == gguf ]]; then
  mkdir -p "$out/gguf-corpus"
  cp -n "$root"/tests/fixtures/gguf/*.gguf "$out/gguf-corpus/"
  clang++ -std=c++20 -O1 -g -Wall -Wextra -Wno-unknown-pragmas \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$root/src" "$root/fuzz/gguf_fuzzer.cpp" "$root/src/gguf/gguf_file.cpp" "$root/src/core/atomic_file.cpp" \
    -o "$out/gguf_fuzzer"
  exec "$out/gguf_fuzzer" -max_total_time="$seconds" -max_len=1200000 "$@" "$out/gguf-corpus"
fi

mkdir -p "$out/corpus"
cp -n "$root"/tests/fixtures/safetensors/*.safetensors "$out/corpus/"
for f in "$root"/tests/fixtures/safetensors/sharded/*.safetensors; do cp -n "$f" "$out/corpus/sharded-$(basename "$f")"; done

clang++ -std=c++20 -O1 -g -Wall -Wextra -Wno-unknown-pragmas \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$root/src" "$root/fuzz/safetensors_fuzzer.cpp" \
  "$root/src/checkpoint/safetensors.cpp" "$root/src/checkpoint/atomic_file.cpp" \
  -o "$out/safetensors_fuzzer"

"$out/safetensors_fuzzer" -max_total_time="$seconds" -max_len=65536 "$@" "$out/corpus"
