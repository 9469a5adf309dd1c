#!/usr/bin/env bash
# The whole test suite: installs and builds (scripts/setup.sh), runs every test in Release, again in Release capped
# at AVX2 (HS_MAX_ISA=avx2: the paths of a CPU without AVX-512, proven on this one; src/kernels/cpu.h), then once more
# under AddressSanitizer + UndefinedBehaviorSanitizer. HS_SKIP_SANITIZERS=1 skips the last pass locally,
# HS_SKIP_AVX2_CAP=1 the second. Each pass prints its time.
set -euo pipefail
cd "$(dirname "$0")/.."

t0=$(date +%s)
took() { echo "== $1: $(( $(date +%s) - t0 )) s"; t0=$(date +%s); }
scripts/setup.sh build
took "install and build (Release)"
echo "== tests (Release)"
ctest --test-dir build --output-on-failure -j"$(nproc)"
took "tests (Release)"
if [ "${HS_SKIP_AVX2_CAP:-0}" != 1 ]; then
  # Every test again, as on a CPU with no more than AVX2 + FMA (the whole suite takes ~4 minutes on 2 cores here;
  # the emulated-CPU test runs without the cap by design, so it is left out).
  echo "== tests (Release, HS_MAX_ISA=avx2)"
  HS_MAX_ISA=avx2 ctest --test-dir build --output-on-failure -j"$(nproc)" -E '^Cpu\.Emulated'
  took "tests (Release, HS_MAX_ISA=avx2)"
fi

if [ "${HS_SKIP_SANITIZERS:-0}" != 1 ]; then
  echo "== tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
  scripts/setup.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHS_SANITIZE=ON -DHS_BUILD_BENCH=OFF
  # oneDNN keeps JIT kernels in process-lifetime caches; leak checking would report them.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j"$(nproc)" -E 'Slow|^Cpu\.Emulated'
  took "build and tests (sanitizers)"
fi
