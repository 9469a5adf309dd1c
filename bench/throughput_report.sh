#!/usr/bin/env bash
# The throughput model of a training step: GEMM peak (bf16, fp32) at the step's own shapes, copy bandwidth, the
# step's time by phase, FLOPs by phase, efficiency. See bench/throughput_report.py --help and bench/README.md.
#   bench/throughput_report.sh [--preset P | --config C] [--batch B] [--seq T] [--threads N] [--dtype bf16|fp32]
#                              [--remat none|block|sublayer] [--steps S] [--out PREFIX]
# Writes PREFIX.md and PREFIX.json (default throughput_report.*). Needs build/hybridscan, build/bench/copy_bandwidth
# and build/bench/throughput_report_gemm.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
exec "$python" bench/throughput_report.py "$@"
