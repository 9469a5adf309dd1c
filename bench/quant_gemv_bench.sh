#!/usr/bin/env bash
# Quantized decode products, ours against ggml's in one run (bench/quant_gemv_bench.cpp), with the copy bandwidth of
# the same machine beside them. Needs a llama.cpp build with its shared libraries (the one bench/generate_bench.sh
# builds from llama-cpp-python 0.3.36's sdist; LLAMA_CPP_DIR names another): it compiles bench/quant_ggml_peer.cpp
# against it and hands the library to the benchmark.
#   bench/quant_gemv_bench.sh [THREADS=2] [REPETITIONS=5] [extra Google Benchmark flags]
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
REPS=${2:-5}
shift $(($# < 2 ? $# : 2))
LLAMA=${LLAMA_CPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridscan/llama_cpp_python-0.3.36/vendor/llama.cpp}
LIBDIR=$(dirname "$(find "$LLAMA/build" -name 'libggml-cpu.so' 2>/dev/null | head -n 1)")
if [[ ! -f $LIBDIR/libggml-cpu.so ]]; then
  echo "quant_gemv_bench.sh: no libggml-cpu.so under $LLAMA/build (set LLAMA_CPP_DIR, or run bench/generate_bench.sh once)" >&2
  exit 2
fi
cmake --build build --target quant_gemv_bench copy_bandwidth >&2
PEER=build/bench/libquant_ggml_peer.so
if [[ ! -f $PEER || bench/quant_ggml_peer.cpp -nt $PEER ]]; then
  g++ -O2 -std=c++17 -shared -fPIC bench/quant_ggml_peer.cpp -I"$LLAMA/ggml/include" -L"$LIBDIR" \
    -Wl,-rpath,"$LIBDIR" -lggml -lggml-base -lggml-cpu -o "$PEER"
fi
echo "copy bandwidth ($THREADS threads): $(build/bench/copy_bandwidth "$THREADS" 512 10)"
OMP_NUM_THREADS=$THREADS build/bench/quant_gemv_bench --ggml-peer="$PWD/$PEER" --threads="$THREADS" \
  --benchmark_repetitions="$REPS" --benchmark_enable_random_interleaving=true "$@" 2>&1 | grep -v '^repack: '
