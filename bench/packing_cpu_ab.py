#!/usr/bin/env python3
"""The `small` step with --packing stream and --packing documents on one token file, alternated round by round and
timed by the CPU seconds each run uses (one thread, passive waiting), which contention from other work on a shared
machine disturbs far less than wall-clock tokens/s.

  bench/packing_cpu_ab.py BINARY TOKEN_FILE ROUNDS
"""
import resource, subprocess, sys, statistics
binary, data = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3])
res = {"stream": [], "documents": []}
for r in range(rounds):
    for side in ("stream", "documents"):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([binary, "train", "--preset", "small", "--data", data, "--packing", side, "--steps", "3",
                        "--batch", "8", "--seq", "512", "--threads", "1", "--compute-dtype", "bf16", "--remat", "none",
                        "--quiet", "--json"], check=True, capture_output=True, env={"OMP_WAIT_POLICY": "passive", "PATH": "/usr/bin:/bin"})
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        res[side].append(cpu)
        print(r, side, f"{cpu:.2f} s CPU", flush=True)
a, b = res["stream"], res["documents"]
print(f"CPU seconds for 3 steps (+ start): stream mean {statistics.mean(a):.2f} median {statistics.median(a):.2f}; "
      f"documents mean {statistics.mean(b):.2f} median {statistics.median(b):.2f}; documents/stream {statistics.mean(b)/statistics.mean(a):.3f}, "
      f"median of per-round ratios {statistics.median(y/x for x, y in zip(a, b)):.3f}")
