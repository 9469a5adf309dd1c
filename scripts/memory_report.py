#!/usr/bin/env python3
"""Regenerates the planner's table for the published MaxText configurations (docs/memory_report.md quotes it).

Usage: scripts/memory_report.py [--binary build/hybridscan]
Runs `hybridscan plan --json` for qwen3.5-397b-a17b on v5p-512 (256 chips) and v5p-128 (64), and qwen3.5-35b-a3b on
v5p-512, v5p-128 and v5p-8 (4): batch 1 per device, sequence 1024, block vs sublayer, fp32 and bf16 weights, and prints
a markdown table next to the published XLA temp sizes.
"""
import argparse
import json
import subprocess
import time

PUBLISHED = {  # (model, devices): (before = block remat, after = sublayer remat), GB, fp32 weights
    ("qwen3.5-397b-a17b", 256): (75.62, 46.01),
    ("qwen3.5-397b-a17b", 64): (128.05, 116.25),
    ("qwen3.5-35b-a3b", 256): (11.99, 6.74),
    ("qwen3.5-35b-a3b", 64): (16.16, 11.03),
    ("qwen3.5-35b-a3b", 4): (148.11, 150.02),
}
TOPO = {256: "v5p-512", 64: "v5p-128", 4: "v5p-8"}


def plan(binary, model, devices, remat, weights):
    out = subprocess.run([binary, "plan", "--model", model, "--devices", str(devices), "--batch-per-device", "1",
                          "--seq", "1024", "--remat", remat, "--weight-dtype", weights, "--chip", "v5p", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default="build/hybridscan")
    args = ap.parse_args()
    gb = lambda b: b / 1e9
    print("| model | topology | weights | argument | temp block | temp sublayer | change | total sublayer | fits 95 GiB | MaxText temp before -> after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    t0 = time.time()
    for (model, devices), (before, after) in PUBLISHED.items():
        for weights in ("fp32", "bf16"):
            b = plan(args.binary, model, devices, "block", weights)
            s = plan(args.binary, model, devices, "sublayer", weights)
            change = (s["temp_bytes"] - b["temp_bytes"]) / b["temp_bytes"] * 100
            pub = f"{before:.2f} -> {after:.2f} GB" if weights == "fp32" else ("69.37 -> 218.19 GB" if (model, devices) == ("qwen3.5-397b-a17b", 256) else "-")
            print(f"| {model} | {TOPO[devices]} ({devices}) | {weights} | {gb(s['argument_bytes']):.2f} GB | "
                  f"{gb(b['temp_bytes']):.2f} GB | {gb(s['temp_bytes']):.2f} GB | {change:+.0f}% | {gb(s['total_bytes']):.2f} GB | "
                  f"{'yes' if s['fits'] else 'no'} | {pub} |")
    print(f"\n(planned in {time.time() - t0:.1f} s for all {len(PUBLISHED) * 4} plans)")


if __name__ == "__main__":
    main()
