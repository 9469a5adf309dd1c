#!/usr/bin/env bash
# Installs what hybridscan builds with (Debian packages, idempotent: only missing ones are fetched) and builds it.
#   scripts/setup.sh [BUILD_DIR [extra cmake args...]]     default BUILD_DIR=build, Release
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(build-essential cmake ninja-build pkg-config libdnnl-dev nlohmann-json3-dev libcli11-dev libgtest-dev
      libgmock-dev libbenchmark-dev bible-kjv bible-kjv-text)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The default training corpus: the King James Bible (public domain), as plain text from Debian's bible-kjv.
mkdir -p data
if [ ! -s data/kjv.txt ]; then
  bible "Genesis 1:1-Revelation 22:21" > data/kjv.txt.tmp && mv data/kjv.txt.tmp data/kjv.txt
fi
# Its last 80,000 bytes lie inside the 2% that `hybridscan train` holds out: a quick evaluation text.
[ -s data/kjv-heldout.txt ] || tail -c 80000 data/kjv.txt > data/kjv-heldout.txt

build=${1:-build}
shift || true
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" -j"$(nproc)"
