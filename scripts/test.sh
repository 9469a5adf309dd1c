#!/usr/bin/env bash
# The whole test suite: installs and builds (scripts/setup.sh), runs every test in Release, then once more under
# AddressSanitizer + UndefinedBehaviorSanitizer. Set HS_SKIP_SANITIZERS=1 to skip the second pass locally.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh build
echo "== tests (Release)"
ctest --test-dir build --output-on-failure -j"$(nproc)"

if [ "${HS_SKIP_SANITIZERS:-0}" != 1 ]; then
  echo "== tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
  scripts/setup.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHS_SANITIZE=ON -DHS_BUILD_BENCH=OFF
  # oneDNN keeps JIT kernels in process-lifetime caches; leak checking would report them.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j"$(nproc)" -E 'Slow'
fi
