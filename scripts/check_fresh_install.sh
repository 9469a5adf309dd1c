#!/usr/bin/env bash
# Proves the README's install on a bare machine: makes a minimal Debian 12 root (mmdebstrap, variant minbase: apt,
# bash, coreutils and nothing else) from this machine's apt sources, copies a clean clone of the repository's
# committed HEAD into it and runs the README's two commands there under chroot, failing on any error:
#
#   scripts/demo.sh      (STEPS=20: the install and the whole demo path, not a long training run)
#   scripts/test.sh      (HS_TEST_LABELS='unit|emulated', HS_SKIP_SANITIZERS=1, HS_SKIP_AVX2_CAP=1: the tests
#                         that exercise what the install brought (oneDNN, OpenMP, PCRE2 and ICU, the Python peers of
#                         the tokenizer tests, mpirun through the MPI collectives' unit tests, qemu-user, the data
#                         files) on every module; the integration tests, the multi-process training cases, the
#                         AVX2-capped and the sanitizer passes run the same code on the same libraries and prove
#                         nothing more about the install; the caller's own scripts/test.sh runs them)
#
#   scripts/check_fresh_install.sh [--full] [--bench] [--keep]
#     --full    run both commands exactly as the README says (300 demo steps, every test, every pass)
#     --bench   also run `scripts/setup.sh --bench --no-build` and import the benchmark peers (several GB from PyPI)
#     --keep    leave the root in place for a look afterwards (its path is printed)
#
# Needs root (chroot, mounts). What it takes from this machine, as any new machine on this network would have it:
# the apt sources, the apt Acquire settings, the local CA certificates and /etc/resolv.conf; nothing else.
# Cached outside the repository, in HS_FRESH_CACHE (default /var/cache/hybridscan-fresh): the bare root as a
# tarball (remade when the sources change or after 7 days), and the downloaded .deb and pip files, so that a
# second run does not fetch them again. The root itself is made anew from the tarball on every run. The compiler
# cache of this machine (ccache's cache_dir) is lent to the root, so that its build compiles only what no build here
# has compiled (the root's own gcc and headers are part of every key); HS_FRESH_CCACHE=0 compiles everything.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
full=0 bench=0 keep=0
for a in "$@"; do
  case "$a" in
    --full) full=1 ;;
    --bench) bench=1 ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "check_fresh_install.sh: unknown option '$a' (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "check_fresh_install.sh: needs root (chroot and mounts); run it with sudo" >&2; exit 2; }
command -v git >/dev/null || { echo "check_fresh_install.sh: needs git" >&2; exit 2; }
if ! command -v mmdebstrap >/dev/null; then
  echo "fresh: installing mmdebstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
fi

t0=$(date +%s)
stamp() { echo "fresh: [$(( $(date +%s) - t0 )) s] $*"; }

cache=${HS_FRESH_CACHE:-/var/cache/hybridscan-fresh}
mkdir -p "$cache/apt-archives/partial" "$cache/pip"

# This machine's apt sources (deb822 and one-line files) and the Acquire settings of its apt.conf.d.
sources=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -s "$f" ] && grep -q -E '^(deb |Types:)' "$f" && sources+=("$f")
done
[ ${#sources[@]} -gt 0 ] || { echo "check_fresh_install.sh: no apt sources in /etc/apt" >&2; exit 1; }
aptconf=()
for f in /etc/apt/apt.conf.d/*; do grep -q '^Acquire::' "$f" 2>/dev/null && aptconf+=("$f"); done
aptopts=()
for f in "${aptconf[@]}"; do aptopts+=(--aptopt="$f"); done

base=$cache/bookworm-minbase.tar
key=$(cat "${sources[@]}" "${aptconf[@]}" | sha256sum | cut -c1-16)
if [ ! -s "$base" ] || [ "$(cat "$base.key" 2>/dev/null)" != "$key" ] || [ -n "$(find "$base" -mtime +7)" ]; then
  stamp "making a bare Debian 12 root (mmdebstrap --variant=minbase) from ${sources[*]}"
  mmdebstrap --quiet --mode=root --variant=minbase "${aptopts[@]}" bookworm "$cache/new-$(basename "$base")" "${sources[@]}"
  mv "$cache/new-$(basename "$base")" "$base"
  echo "$key" > "$base.key"
else
  stamp "bare Debian 12 root from the cache ($base)"
fi

root=$(mktemp -d /var/tmp/hs-fresh.XXXXXX)
mounts=()
cleanup() {
  local i
  for (( i=${#mounts[@]}-1; i>=0; i-- )); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
  if [ "$keep" = 1 ]; then echo "fresh: root kept at $root"; else rm -rf --one-file-system "$root"; fi
}
trap cleanup EXIT
mnt() { mount "$@"; mounts+=("${@: -1}"); }

tar -C "$root" -xf "$base"
# No package lists either, as on a new machine: the project's setup must run `apt-get update` itself.
rm -rf "$root"/var/lib/apt/lists/*_*
cp /etc/resolv.conf "$root/etc/resolv.conf"
if compgen -G "/usr/local/share/ca-certificates/*" >/dev/null; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp -r /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
fi
mkdir -p "$root/root/.cache/pip"
mnt -t proc proc "$root/proc"
mnt --rbind /sys "$root/sys"
mnt --rbind /dev "$root/dev"
mnt --bind "$cache/apt-archives" "$root/var/cache/apt/archives"
mnt --bind "$cache/pip" "$root/root/.cache/pip"
if [ "${HS_FRESH_CCACHE:-1}" = 1 ]; then
  ccache_dir=$(command -v ccache >/dev/null && ccache -k cache_dir 2>/dev/null || echo "$HOME/.cache/ccache")
  mkdir -p "$ccache_dir" "$root/root/.cache/ccache"
  mnt --bind "$ccache_dir" "$root/root/.cache/ccache"
fi

git clone --quiet --no-hardlinks "$repo" "$root/root/hybridscan"
stamp "clean clone of $(git -C "$repo" rev-parse --short HEAD) in $root/root/hybridscan"

steps=20 skip_sanitizers=1 labels='unit|emulated'
[ "$full" = 1 ] && { steps=300; skip_sanitizers=0; labels=''; }
# pip's settings for this network (PIP_CERT, timeouts) pass through as the machine has them; nothing else does.
pip_env=()
for v in PIP_CERT PIP_DEFAULT_TIMEOUT PIP_INDEX_URL PIP_TRUSTED_HOST; do [ -n "${!v:-}" ] && pip_env+=("$v=${!v}"); done
in_root() {
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb CI=true "${pip_env[@]}" \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin STEPS="$steps" \
    HS_SKIP_SANITIZERS="$skip_sanitizers" HS_SKIP_AVX2_CAP="$skip_sanitizers" HS_TEST_LABELS="$labels" \
    bash -c "cd /root/hybridscan && $1"
}
stamp "== scripts/demo.sh (STEPS=$steps)"
in_root "scripts/demo.sh"
stamp "== scripts/test.sh (HS_TEST_LABELS='$labels' HS_SKIP_SANITIZERS=$skip_sanitizers HS_SKIP_AVX2_CAP=$skip_sanitizers)"
in_root "scripts/test.sh"
if [ "$bench" = 1 ]; then
  stamp "== scripts/setup.sh --bench --no-build"
  in_root "scripts/setup.sh --bench --no-build && .venv/bin/python -c 'import torch, transformers; print(\"bench peers:\", torch.__version__, transformers.__version__)'"
fi
stamp "passed: the README's commands work on a bare Debian 12 root"
