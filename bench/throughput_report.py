#!/usr/bin/env python3
"""The throughput model of a training step (issue 15): where the step's time goes, against what the machine can do.

For one model (preset or config.json), batch and precision it
  1. measures the copy bandwidth (build/bench/copy_bandwidth: memcpy, read + written bytes);
  2. runs the step with the phase profiler (`hybridscan train --profile --json`, steady-state steps: the first is
     excluded), which also lists every matrix product the step ran (shape, dtypes, calls, wall time);
  3. measures the GEMM peak at those very shapes, bf16 (the dtypes the step used) and fp32, through the engine's own
     kernels::matmul on warm operands (build/bench/throughput_report_gemm); products whose row count varies from call
     to call (the routed experts) are timed at the FLOP-weighted mean row count of their family and scaled by FLOPs;
  4. counts the step's FLOPs by phase analytically from the config (below), and prints a table: time per phase, its
     share, achieved GFLOP/s (or GB/s), efficiency against the peak, and the step's overall efficiency.

What is counted (model FLOPs: forward + backward = 3x forward for every product; recompute is not counted):
  matmul      every linear layer 2 N in out (GDN in_proj qkv / z / b / a and out_proj; attention q(+gate) / k / v / o;
              router; routed experts top_k x (gate_up + down); shared expert and its gate; LM head);
  attention   causal scores and values: forward 2 x (2 T/2 hd) per token per query head (QK^T, PV), backward 2x;
  delta_rule  the chunked algorithm's products per value head, chunk C = 64: forward per token
              2 C (3 dk + 2 dv) + 6 dk dv (K K^T, Q K^T, W = T beta K, U = T beta V, A V_new; W S, Q S, K^T V_new),
              the triangular inverse not counted; backward 2x;
  optimizer   bytes, not FLOPs: AdamW reads w, g, m, v and writes w, m, v and the zeroed g (32 B per fp32 parameter),
              plus the gradient-norm pass (4 B per parameter), against the copy bandwidth;
  elementwise, moe_dispatch, loss_head, allocation, communication, other: time only.
The counted matmul FLOPs (2 M N K of every call the step made) are printed beside the analytic ones as a check.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ["matmul", "delta_rule", "attention", "moe_dispatch", "elementwise", "loss_head", "optimizer",
          "communication", "allocation", "other"]


def parse_config(line):
    """The model line `train` prints (model::describe)."""
    m = re.search(r"H (\d+), L (\d+) = (\d+) blocks x \((\d+) linear \+ 1 full\)(?: \+ (\d+) remainder linear)?, "
                  r"attn (\d+)q/(\d+)kv x (\d+), GDN (\d+)k/(\d+)v x (\d+)/(\d+), "
                  r"(?:MoE (\d+) experts top-(\d+) x (\d+) \+ shared (\d+)|dense MLP (\d+)), vocab (\d+)", line)
    if not m:
        raise SystemExit(f"throughput_report: cannot read the model line: {line!r}")
    g = [int(x) if x is not None else None for x in m.groups()]
    c = dict(H=g[0], L=g[1], blocks=g[2], local=g[3], rem=g[4] or 0, nH=g[5], nKV=g[6], hd=g[7], Hk=g[8], Hv=g[9],
             dk=g[10], dv=g[11], E=g[12], k=g[13], I=g[14], Is=g[15], dense=g[16], V=g[17])
    c["gdn_layers"] = c["blocks"] * c["local"] + c["rem"]
    c["attn_layers"] = c["blocks"]
    return c


def analytic_flops(c, B, T):
    """Model FLOPs of one step by phase (forward + backward)."""
    N = B * T
    H = c["H"]
    KD, VD = c["Hk"] * c["dk"], c["Hv"] * c["dv"]
    CD = 2 * KD + VD
    gdn_lin = 2 * H * (CD + VD + 2 * c["Hv"]) + 2 * VD * H
    attn_lin = 2 * H * (c["nH"] * 2 * c["hd"] + 2 * c["nKV"] * c["hd"]) + 2 * c["nH"] * c["hd"] * H
    if c["E"]:
        ffn = 2 * H * c["E"] + c["k"] * 6 * H * c["I"] + 6 * H * c["Is"] + 2 * H
    else:
        ffn = 6 * H * c["dense"]
    head = 2 * H * c["V"]
    per_token_fwd = c["gdn_layers"] * (gdn_lin + ffn) + c["attn_layers"] * (attn_lin + ffn) + head
    C = min(64, T)
    delta_fwd = c["gdn_layers"] * c["Hv"] * (2 * C * (3 * c["dk"] + 2 * c["dv"]) + 6 * c["dk"] * c["dv"])
    attn_fwd = c["attn_layers"] * c["nH"] * 2 * T * c["hd"]  # 2 products x 2 flops x T/2 keys on average
    return {"matmul": 3.0 * N * per_token_fwd, "delta_rule": 3.0 * N * delta_fwd, "attention": 3.0 * N * attn_fwd}


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"throughput_report: {' '.join(cmd[:3])} ... failed ({p.returncode})")
    return p


def gemm_peaks(gemm_bin, shapes, threads, min_s, reps):
    """Seconds at peak of each profiled product (calls included), bf16 as run and fp32, by timing representatives."""
    # A family: the shape with its varying row dimension wildcarded; timed at its FLOP-weighted mean row count.
    fam = defaultdict(list)
    for s in shapes:
        M, N, K, ta, tb, acc, var, i, o, calls, sec = s
        if var:
            key = ((None, N, K) if not ta else (M, N, None)) + (ta, tb, acc, var, i, o)
        else:
            key = (M, N, K, ta, tb, acc, var, i, o)
        fam[key].append(s)
    reps_lines, order = [], []
    for key, members in fam.items():
        M, N, K, ta, tb, acc, var, i, o = key
        if var:
            w = sum(2.0 * s[0] * s[1] * s[2] * s[9] for s in members)
            rows = sum((s[2] if ta else s[0]) * 2.0 * s[0] * s[1] * s[2] * s[9] for s in members) / w
            rows = max(1, int(round(rows)))
            if ta: K = rows
            else: M = rows
        for dt in (("as_run", i, o), ("fp32", 0, 0)):
            reps_lines.append(f"{M} {N} {K} {int(ta)} {int(tb)} {int(acc)} {int(var)} {dt[1]} {dt[2]}")
            order.append((key, dt[0], 2.0 * M * N * K))
    # The environment hybridscan gives itself (src/cli/main.cpp): libgomp's wait policy and the heap on huge pages.
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env.update(OMP_WAIT_POLICY="passive", GOMP_SPINCOUNT="30000")
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    p = run([gemm_bin, str(threads), str(min_s), str(reps)], input="\n".join(reps_lines) + "\n", env=env)
    res = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    rate = {}
    for (key, which, f), r in zip(order, res):
        rate[(key, which)] = f / r["seconds"]  # FLOP/s of the representative
    out = []
    for key, members in fam.items():
        for s in members:
            f = 2.0 * s[0] * s[1] * s[2] * s[9]
            out.append({"shape": s[:9], "calls": s[9], "seconds": s[10], "flops": f,
                        "peak_s": f / rate[(key, "as_run")], "peak_fp32_s": f / rate[(key, "fp32")]})
    return out, len(fam)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--preset", default=None, help="model preset (default small)")
    g.add_argument("--config", default=None, help="Hugging Face config.json")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--remat", choices=["none", "block", "sublayer"], default="none")
    ap.add_argument("--steps", type=int, default=4, help="steps run; the first is excluded (default 4)")
    ap.add_argument("--gemm-min-seconds", type=float, default=0.02, help="per timed batch of calls of one shape")
    ap.add_argument("--gemm-reps", type=int, default=5, help="timed batches per shape (median)")
    ap.add_argument("--copy-mib", type=int, default=256)
    ap.add_argument("--out", default="throughput_report", help="writes OUT.md and OUT.json")
    ap.add_argument("--hybridscan", default=os.path.join(ROOT, "build", "hybridscan"))
    ap.add_argument("--bench-dir", default=os.path.join(ROOT, "build", "bench"))
    a = ap.parse_args()
    if a.steps < 2:
        raise SystemExit("throughput_report: --steps must be >= 2 (the first step is excluded)")
    for b in (a.hybridscan, os.path.join(a.bench_dir, "copy_bandwidth"), os.path.join(a.bench_dir, "throughput_report_gemm")):
        if not os.access(b, os.X_OK):
            raise SystemExit(f"throughput_report: {b} is missing (build the hybridscan, copy_bandwidth and "
                             "throughput_report_gemm targets)")
    model = ["--config", a.config] if a.config else ["--preset", a.preset or "small"]

    copy = json.loads(run([os.path.join(a.bench_dir, "copy_bandwidth"), str(a.threads), str(a.copy_mib), "5"]).stdout)
    with tempfile.TemporaryDirectory() as tmp:
        p = run([a.hybridscan, "train", *model, "--synthetic", "--steps", str(a.steps), "--batch", str(a.batch),
                 "--seq", str(a.seq), "--threads", str(a.threads), "--compute-dtype", a.dtype, "--remat", a.remat,
                 "--quiet", "--json", "--profile", "--out", os.path.join(tmp, "run")])
    line = next(l for l in p.stderr.splitlines() if l.startswith("model: "))
    cfg = parse_config(line)
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    prof = summary["profile"]
    steps = a.steps - 1
    step_s = prof["step_s"] / steps
    shapes, families = gemm_peaks(os.path.join(a.bench_dir, "throughput_report_gemm"), prof["matmul_shapes"],
                                  a.threads, a.gemm_min_seconds, a.gemm_reps)
    mm_flops = sum(s["flops"] for s in shapes) / steps
    mm_peak_s = sum(s["peak_s"] for s in shapes) / steps
    mm_peak32_s = sum(s["peak_fp32_s"] for s in shapes) / steps
    peak = mm_flops / mm_peak_s          # FLOP/s: the GEMM peak at the step's own shapes, in the dtypes as run
    peak32 = mm_flops / mm_peak32_s
    fl = analytic_flops(cfg, a.batch, a.seq)
    params = summary.get("argument_bytes")
    n_params = None
    m = re.search(r"params (\d+)", p.stderr)
    if m: n_params = int(m.group(1))
    opt_bytes = 36.0 * n_params if n_params else None

    rows = []
    for ph in PHASES:
        t = prof["seconds"][ph] / steps
        r = {"phase": ph, "seconds": t, "share": t / step_s if step_s else 0, "calls": prof["calls"][ph] / steps}
        if ph == "matmul":
            r["gflops"] = mm_flops / t * 1e-9 if t else None
            r["analytic_gflop"] = fl["matmul"] * 1e-9
            r["counted_gflop"] = mm_flops * 1e-9
            r["efficiency"] = mm_peak_s / t if t else None  # peak time at its shapes / measured
        elif ph in ("attention", "delta_rule"):
            r["gflops"] = fl[ph] / t * 1e-9 if t else None
            r["analytic_gflop"] = fl[ph] * 1e-9
            r["efficiency"] = fl[ph] / t / peak if t else None
        elif ph == "optimizer" and opt_bytes:
            r["gbps"] = opt_bytes / t * 1e-9 if t else None
            r["efficiency"] = opt_bytes / t / copy["copy_bytes_per_s"] if t else None
        rows.append(r)
    model_flops = fl["matmul"] + fl["attention"] + fl["delta_rule"]
    overall = {
        "step_s": step_s, "tokens_per_s": a.batch * a.seq / step_s,
        "phase_sum_s": prof["phase_sum_s"] / steps,
        "model_gflop": model_flops * 1e-9, "achieved_gflops": model_flops / step_s * 1e-9,
        "gemm_peak_as_run_gflops": peak * 1e-9, "gemm_peak_fp32_gflops": peak32 * 1e-9,
        "efficiency_vs_peak": model_flops / step_s / peak,
        "gemm_time_at_peak_share": mm_peak_s / step_s,
        "copy_gbps": copy["copy_bytes_per_s"] * 1e-9,
        "minor_faults_per_step": prof["minor_faults"] / steps,
        "matmul_families_timed": families, "matmul_shapes": len(shapes),
    }
    out = {"config": cfg, "model_line": line, "batch": a.batch, "seq": a.seq, "threads": a.threads,
           "dtype": a.dtype, "remat": a.remat, "steps_timed": steps, "phases": rows, "overall": overall,
           "labels": prof.get("labels", {}), "matmul_shapes": sorted(shapes, key=lambda s: -s["seconds"])}
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=1)

    def f(x, fmt):
        return "-" if x is None else fmt.format(x)
    md = [f"# Throughput model: {line[7:].split(':')[0]}, batch {a.batch} x {a.seq}, {a.threads} threads, "
          f"{a.dtype} compute, remat {a.remat}", "",
          f"Step {step_s * 1e3:.1f} ms ({overall['tokens_per_s']:.0f} tokens/s; phases add up to "
          f"{overall['phase_sum_s'] * 1e3:.1f} ms), mean of {steps} steady-state steps. "
          f"GEMM peak at the step's own {len(shapes)} product shapes ({families} timed): "
          f"{a.dtype} as run {peak * 1e-9:.0f} GFLOP/s, all-fp32 {peak32 * 1e-9:.0f} GFLOP/s; copy bandwidth "
          f"{overall['copy_gbps']:.1f} GB/s.", "",
          "| phase | ms / step | share | calls | GFLOP (model) | achieved | efficiency |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ach = f(r.get("gflops"), "{:.0f} GFLOP/s") if "gflops" in r else f(r.get("gbps"), "{:.1f} GB/s") if "gbps" in r else "-"
        gfl = f(r.get("analytic_gflop"), "{:.1f}")
        if r["phase"] == "matmul":
            gfl += f" (counted {r['counted_gflop']:.1f})"
        eff = f(r.get("efficiency"), "{:.0%}")
        if r["phase"] == "matmul": eff += f" of the {a.dtype} peak at its shapes"
        elif r["phase"] in ("attention", "delta_rule"): eff += f" of the {a.dtype} GEMM peak"
        elif r["phase"] == "optimizer" and "efficiency" in r: eff += " of copy bandwidth"
        md.append(f"| {r['phase']} | {r['seconds'] * 1e3:.1f} | {r['share']:.1%} | {r['calls']:.0f} | {gfl} | {ach} | {eff} |")
    md += ["", f"**Overall:** {overall['model_gflop']:.1f} GFLOP of model work per step in {step_s * 1e3:.1f} ms = "
               f"{overall['achieved_gflops']:.0f} GFLOP/s, **{overall['efficiency_vs_peak']:.0%} of the {a.dtype} GEMM "
               f"peak at the step's shapes** ({peak * 1e-9:.0f} GFLOP/s). The step's products alone would take "
               f"{mm_peak_s * 1e3:.1f} ms at that peak ({overall['gemm_time_at_peak_share']:.0%} of the step). "
               f"Page faults: {overall['minor_faults_per_step']:.0f} minor per step.", "",
           "Where each phase's time goes, by kernel (exclusive time, the ten largest outside matmul):", "",
           "| kernel | phase | ms / step | share | calls / step |", "|---|---|---|---|---|"]
    labels = sorted(((n, v) for n, v in prof.get("labels", {}).items() if v[0] != "matmul"), key=lambda x: -x[1][2])
    for n, (ph, calls, sec) in labels[:10]:
        md.append(f"| {n} | {ph} | {sec / steps * 1e3:.1f} | {sec / steps / step_s:.1%} | {calls / steps:.0f} |")
    md += ["", "Slowest products (all calls of a shape together):", "",
           "| M x N x K (ta, tb, acc, varying) | dtypes | calls | ms / step | GFLOP/s in step | peak GFLOP/s | eff |",
           "|---|---|---|---|---|---|---|"]
    for s in out["matmul_shapes"][:12]:
        M, N, K, ta, tb, acc, var, i, o = s["shape"]
        md.append(f"| {M} x {N} x {K} ({int(ta)}{int(tb)}{int(acc)}{int(var)}) | {'bf16' if i else 'fp32'}->"
                  f"{'bf16' if o else 'fp32'} | {s['calls'] / steps:.0f} | {s['seconds'] / steps * 1e3:.2f} | "
                  f"{s['flops'] / s['seconds'] * 1e-9:.0f} | {s['flops'] / s['peak_s'] * 1e-9:.0f} | "
                  f"{s['peak_s'] / s['seconds']:.0%} |")
    with open(a.out + ".md", "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
