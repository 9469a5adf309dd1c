#!/usr/bin/env bash
# The whole test suite: installs and builds (scripts/setup.sh), runs every test in Release, again in Release capped
# at AVX2 (HS_MAX_ISA=avx2: the paths of a CPU without AVX-512, proven on this one; src/kernels/cpu.h), then again
# under AddressSanitizer + UndefinedBehaviorSanitizer. Each pass prints its time; the
# labels and how to run one test are in docs/testing.md.
#   HS_SKIP_AVX2_CAP=1     skips the AVX2-capped pass
#   HS_SKIP_SANITIZERS=1   skips the sanitizer pass
#   HS_TEST_LABELS=REGEX   runs only the tests whose labels match (ctest -L) in every pass, e.g. unit
set -euo pipefail
cd "$(dirname "$0")/.."

t0=$(date +%s)
phases=()
took() { local s=$(( $(date +%s) - t0 )); echo "== $1: $s s"; phases+=("$1 $s s"); t0=$(date +%s); }
labels=()
[ -n "${HS_TEST_LABELS:-}" ] && labels=(-L "$HS_TEST_LABELS")
run_ctest() { ctest --test-dir "$1" --output-on-failure -j"$(nproc)" "${labels[@]}" "${@:2}"; }

scripts/setup.sh build
took "install and build (Release)"
echo "== tests (Release${HS_TEST_LABELS:+, labels $HS_TEST_LABELS})"
run_ctest build
took "tests (Release)"
if [ "${HS_SKIP_AVX2_CAP:-0}" != 1 ]; then
  # Every test again, as on a CPU with no more than AVX2 + FMA. The emulated-CPU test sets its own CPU.
  echo "== tests (Release, HS_MAX_ISA=avx2)"
  HS_MAX_ISA=avx2 run_ctest build -LE emulated
  took "tests (Release, HS_MAX_ISA=avx2)"
fi

if [ "${HS_SKIP_SANITIZERS:-0}" != 1 ]; then
  # Every test but the emulated CPU's (qemu under the sanitizers proves nothing more); the `slow` ones add ~40 s here.
  echo "== tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
  # -g1: line tables only, all a sanitizer's report needs (its build ~30% faster than with full -g).
  scripts/setup.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
    -DHS_SANITIZE=ON -DHS_BUILD_BENCH=OFF
  took "build (sanitizers)"
  # oneDNN keeps JIT kernels in process-lifetime caches; leak checking would report them.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_ctest build-asan -LE emulated
  took "tests (sanitizers)"
fi
echo "== scripts/test.sh phases: $(IFS=';'; echo "${phases[*]}")"
