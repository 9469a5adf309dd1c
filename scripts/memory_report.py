#!/usr/bin/env python3
"""Regenerates the planner's tables and plot for the MaxText configurations of issue 11 (docs/memory_report.md).

Usage: scripts/memory_report.py [--binary build/hybridscan] [--svg docs/memory_temp_vs_chips.svg]
Runs `hybridscan plan --json` (batch 1 per device, sequence 1024, FSDP over all chips, sub-layer remat, bf16 compute,
v5p chips) for every row of the issue's table with fp32 and bf16 weights, prints a markdown table beside MaxText's
published and ahead-of-time figures and hybridscan's own figures before the change, then `plan --fit` for the two
configurations the issue asks to fit, and writes an SVG of temp per device against chip count for the three released
models (drawn here: no plotting library needed).
"""
import argparse
import json
import math
import subprocess
import time

# (model, chips) -> {weights: (MaxText published, MaxText 0.2.5 AOT here, hybridscan before)} in GB of temp per
# device, as issue 11 quotes them; None where no figure was given.
TABLE = {
    ("qwen3.5-397b-a17b", 256): {"fp32": (46.01, 30.12, 46.60), "bf16": (218.19, 215.42, 46.60)},
    ("qwen3.5-397b-a17b", 64): {"fp32": (116.25, 116.24, 65.18), "bf16": (None, None, 65.18)},
    ("qwen3.5-35b-a3b", 256): {"fp32": (6.74, 4.65, 5.99), "bf16": (None, 20.64, 5.99)},
    ("qwen3.5-35b-a3b", 64): {"fp32": (11.03, 7.08, 7.62), "bf16": (None, None, 7.62)},
    ("qwen3.5-35b-a3b", 4): {"fp32": (150.02, 150.02, 40.11), "bf16": (None, None, 40.11)},
    ("qwen3-next-80b-a3b", 256): {"fp32": (10.68, 7.88, 11.57), "bf16": (53.46, 46.89, 11.57)},
}
MODELS = ["qwen3.5-397b-a17b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"]
CHIPS = [4, 8, 16, 32, 64, 128, 256, 512]
V5P = 95 * 2**30


def run(binary, *args):
    return json.loads(subprocess.run([binary, "plan", "--batch-per-device", "1", "--seq", "1024", "--chip", "v5p",
                                      "--json", *args], check=True, capture_output=True, text=True).stdout)


def plan(binary, model, chips, weights="fp32", moments="fp32", update=False, vocab_piece=None):
    return run(binary, "--model", model, "--devices", str(chips), "--weight-dtype", weights, "--moment-dtype", moments,
               *(["--update-in-backward"] if update else []),
               *(["--vocab-piece-bytes", str(vocab_piece)] if vocab_piece is not None else []))


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def svg(series, path, dashed=None):
    """Temp per device (GB, log scale) against chips (log scale), one line per model (dashed: with
    --update-in-backward)."""
    dashed = dashed or {}
    w, h, left, right, top, bottom = 640, 400, 70, 200, 30, 50
    ys = [v for s in [*series.values(), *dashed.values()] for _, v in s]
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    x0, x1 = math.log2(CHIPS[0]), math.log2(CHIPS[-1])
    px = lambda c: left + (math.log2(c) - x0) / (x1 - x0) * (w - left - right)
    py = lambda v: h - bottom - (math.log10(v) - y0) / (y1 - y0) * (h - top - bottom)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="18">temp per device, sub-layer remat, fp32 weights, batch 1 x 1024 (hybridscan plan)</text>']
    for c in CHIPS:
        out.append(f'<line x1="{px(c):.1f}" y1="{top}" x2="{px(c):.1f}" y2="{h - bottom}" stroke="#ddd"/>')
        out.append(f'<text x="{px(c):.1f}" y="{h - bottom + 16}" text-anchor="middle">{c}</text>')
    for e in range(y0, y1 + 1):
        v = 10.0**e
        out.append(f'<line x1="{left}" y1="{py(v):.1f}" x2="{w - right}" y2="{py(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:g} GB</text>')
    out.append(f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">chips (FSDP over all)</text>')
    colours = ["#1f77b4", "#d62728", "#2ca02c"]
    for i, (model, pts) in enumerate(series.items()):
        d = " ".join(f"{'M' if j == 0 else 'L'}{px(c):.1f},{py(v):.1f}" for j, (c, v) in enumerate(pts))
        out.append(f'<path d="{d}" fill="none" stroke="{colours[i]}" stroke-width="2"/>')
        for c, v in pts:
            out.append(f'<circle cx="{px(c):.1f}" cy="{py(v):.1f}" r="3" fill="{colours[i]}"/>')
        out.append(f'<text x="{w - right + 10}" y="{top + 20 + 18 * i}" fill="{colours[i]}">{model}</text>')
        if model in dashed:
            d = " ".join(f"{'M' if j == 0 else 'L'}{px(c):.1f},{py(v):.1f}" for j, (c, v) in enumerate(dashed[model]))
            out.append(f'<path d="{d}" fill="none" stroke="{colours[i]}" stroke-width="2" stroke-dasharray="6 4"/>')
    if dashed:
        out.append(f'<text x="{w - right + 10}" y="{top + 20 + 18 * len(series) + 10}">dashed: --update-in-backward</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default="build/hybridscan")
    ap.add_argument("--svg", default="docs/memory_temp_vs_chips.svg")
    args = ap.parse_args()
    gb = lambda b: b / 1e9
    t0 = time.time()
    print("| model | chips | weights | MaxText published | MaxText AOT here | hybridscan before | whole LM head "
          "| hybridscan now | argument | total | fits 95 GiB | total, bf16 moments | fits | temp, update in backward, "
          "whole LM head | temp, update in backward | total | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    slowest = 0.0
    for (model, chips), by_weights in TABLE.items():
        for weights, (published, aot, before) in by_weights.items():
            p = plan(args.binary, model, chips, weights)
            q = plan(args.binary, model, chips, weights, "bf16")
            u = plan(args.binary, model, chips, weights, update=True)
            pw = plan(args.binary, model, chips, weights, vocab_piece=0)
            uw = plan(args.binary, model, chips, weights, update=True, vocab_piece=0)
            slowest = max(slowest, p["plan_seconds"], q["plan_seconds"], u["plan_seconds"])
            print(f"| {model} | {chips} | {weights} | {fmt(published)} | {fmt(aot)} | {fmt(before)} | "
                  f"{gb(pw['temp_bytes']):.2f} | "
                  f"**{gb(p['temp_bytes']):.2f}** | {gb(p['argument_bytes']):.2f} | {gb(p['total_bytes']):.2f} | "
                  f"{'yes' if p['fits'] else 'no'} | {gb(q['total_bytes']):.2f} | {'yes' if q['fits'] else 'no'} | "
                  f"{gb(uw['temp_bytes']):.2f} | "
                  f"{gb(u['temp_bytes']):.2f} | {gb(u['total_bytes']):.2f} | {'yes' if u['fits'] else 'no'} |")
    print(f"\n(GB of temp per device unless marked; slowest single plan {slowest:.2f} s)\n")
    for model, chips, weights in (("qwen3.5-397b-a17b", 64, "fp32"), ("qwen3.5-35b-a3b", 4, "bf16")):
        f = run(args.binary, "--model", model, "--devices", str(chips), "--weight-dtype", weights, "--fit")
        print(f"`plan --model {model} --devices {chips} --weight-dtype {weights} --chip v5p --fit`:\n")
        print("| remat | moments | update | argument | temp | total | |")
        print("|---|---|---|---|---|---|---|")
        for i, c in enumerate(f["candidates"]):
            upd = "in backward" if c["update_in_backward"] else "step"
            print(f"| {c['remat']} | {c['moment_dtype']} | {upd} | {gb(c['argument_bytes']):.2f} | {gb(c['temp_bytes']):.2f} | "
                  f"{gb(c['total_bytes']):.2f} | {'**the choice**' if i == f['choice'] else c['why_not']} |")
        print()
    series = {m: [(c, gb(plan(args.binary, m, c)["temp_bytes"])) for c in CHIPS] for m in MODELS}
    dashed = {m: [(c, gb(plan(args.binary, m, c, update=True)["temp_bytes"])) for c in CHIPS] for m in MODELS}
    svg(series, args.svg, dashed)
    print("| chips | " + " | ".join(MODELS) + " | " + " | ".join(f"{m}, update in backward" for m in MODELS) + " |")
    print("|---|" + "---|" * (2 * len(MODELS)))
    for i, c in enumerate(CHIPS):
        print(f"| {c} | " + " | ".join(f"{series[m][i][1]:.2f}" for m in MODELS) + " | " +
              " | ".join(f"{dashed[m][i][1]:.2f}" for m in MODELS) + " |")
    print(f"\n(all plans in {time.time() - t0:.1f} s; plot written to {args.svg})")


if __name__ == "__main__":
    main()
