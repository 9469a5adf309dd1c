#!/usr/bin/env bash
# The engine on CPUs this machine is not: qemu-user's TCG emulates an x86-64 CPU from its model's feature bits, and
# an instruction the model lacks raises SIGILL, as it would on that CPU. So:
#   -cpu Haswell  (AVX2 + FMA + F16C, no AVX-512): `train` runs, and its losses equal those of this machine under
#                 HS_MAX_ISA=avx2 to the bit (the cap takes exactly the paths such a CPU takes; the bits do not
#                 depend on the thread count here: one thread each);
#   -cpu Nehalem  (no AVX): the start-up check refuses it with a sentence naming what is missing, exit 1, no SIGILL.
#   tests/emulated_cpu_test.sh BUILD/hybridscan
set -euo pipefail
bin=${1:?usage: emulated_cpu_test.sh path/to/hybridscan}
command -v qemu-x86_64 >/dev/null || { echo "emulated_cpu_test: qemu-x86_64 missing (scripts/setup.sh installs qemu-user)" >&2; exit 1; }
# qemu-user does not follow an exec of /proc/self/exe into the emulator: set what main() would re-execute for.
export OMP_WAIT_POLICY=passive GLIBC_TUNABLES=glibc.malloc.hugetlb=0 OMP_NUM_THREADS=1
unset HS_MAX_ISA
quiet() { grep -v "TCG doesn't support requested feature" || true; }
fail() { echo "emulated_cpu_test: FAILED: $*" >&2; exit 1; }

out=$(qemu-x86_64 -cpu Nehalem "$bin" --version 2>&1 | quiet) && rc=0 || rc=$?
[ "$rc" = 1 ] || fail "Nehalem: exit $rc, expected 1: $out"
grep -q "this CPU lacks AVX" <<<"$out" || fail "Nehalem: no message naming AVX: $out"
grep -q "AVX2, FMA, F16C" <<<"$out" || fail "Nehalem: the message does not name AVX2, FMA, F16C: $out"
echo "Nehalem: refused with: $out"

out=$(qemu-x86_64 -cpu Haswell "$bin" --version 2>&1 | quiet)
grep -q "level: avx2$" <<<"$out" || fail "Haswell: --version does not say level avx2: $out"
grep -q "gemv (decode): avx2" <<<"$out" || fail "Haswell: gemv path: $out"

args=(train --preset tiny --synthetic --steps 2 --batch 2 --seq 64 --threads 1 --quiet --json)
emulated=$(qemu-x86_64 -cpu Haswell "$bin" "${args[@]}" 2>&1 | quiet | grep '^{' | tail -1)
capped=$(HS_MAX_ISA=avx2 "$bin" "${args[@]}" 2>/dev/null | grep '^{' | tail -1)
loss() { python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["losses"], j["final_ce"])' "$1"; }
[ -n "$emulated" ] || fail "Haswell: train printed no JSON"
le=$(loss "$emulated"); lc=$(loss "$capped")
[ "$le" = "$lc" ] || fail "Haswell trained to $le, HS_MAX_ISA=avx2 here to $lc"
echo "Haswell: trained; final loss and cross-entropy $le, equal to HS_MAX_ISA=avx2 on this CPU"
echo "1 passed, 0 failed"
