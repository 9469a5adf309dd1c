#!/usr/bin/env python3
"""Scaling over processes on one machine: N ranks x 1 thread against 1 process x N threads, the same global batch.

  python3 bench/mpi_scaling.py [--binary build/hybridscan] [--ranks 2] [--rounds 3] [--preset small]
                               [--batch 8] [--seq 256] [--steps 5] [--compute-dtype bf16]

Runs alternate round by round (a shared, noisy machine slows all alike): one process with N threads, N ranks
without and with --prefetch. Each run reports its steady-state tokens/s (hybridscan skips the first step) and each
rank's seconds blocked on communication; printed: every run, the median tokens/s per side, the ratios to one
process, and rank 0's exposed communication as a share of its step time.
"""
import argparse
import json
import os
import statistics
import subprocess


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="build/hybridscan")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compute-dtype", default="bf16")
    a = ap.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    base = [a.binary, "train", "--preset", a.preset, "--synthetic", "--steps", str(a.steps), "--batch", str(a.batch),
            "--seq", str(a.seq), "--compute-dtype", a.compute_dtype, "--quiet", "--json"]
    mpi = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(a.ranks)]
    sides = {
        f"1 process x {a.ranks} threads": [*base, "--threads", str(a.ranks)],
        f"{a.ranks} ranks x 1 thread": [*mpi, *base, "--threads", "1"],
        f"{a.ranks} ranks x 1 thread, --prefetch": [*mpi, *base, "--threads", "1", "--prefetch"],
    }
    results = {k: [] for k in sides}
    for rnd in range(a.rounds):
        for name, cmd in sides.items():
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            j = json.loads(p.stdout.strip().splitlines()[-1])
            exposed = j["rank_comm_exposed_s"][0] if j.get("ranks", 1) > 1 else 0.0
            results[name].append((j["tokens_per_s"], exposed, j["step_s"]))
            print(f"round {rnd + 1} {name:36s} {j['tokens_per_s']:8.0f} tokens/s, rank 0 exposed communication "
                  f"{exposed:.3f} s of {j['step_s']:.3f} s")
    ref = statistics.median(r[0] for r in results[next(iter(sides))])
    print(f"\n{a.preset}, global batch {a.batch} x {a.seq}, {a.compute_dtype} compute, {a.steps - 1} timed steps, "
          f"median of {a.rounds} rounds:")
    for name, rs in results.items():
        tps = statistics.median(r[0] for r in rs)
        share = statistics.median(r[1] / r[2] if r[2] else 0 for r in rs)
        print(f"  {name:36s} {tps:8.0f} tokens/s  ratio {tps / ref:5.2f}  exposed communication {100 * share:4.1f}%")


if __name__ == "__main__":
    main()
