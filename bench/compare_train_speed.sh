#!/usr/bin/env bash
# Side-by-side training speed: hybridscan's step vs the PyTorch peers (bench/torch_train_step.py: eager and/or
# torch.compile), same model
# (`small` preset), same batch, sequence length, threads and precision, run alternately A/B/A/B so that a noisy,
# shared machine slows both sides alike. Prints a table and the ratios of the medians, hybridscan / torch.
#
#   bench/compare_train_speed.sh [--batch B] [--seq T] [--threads N] [--dtype fp32|bf16] [--rounds R]
#                                [--remat none|block|sublayer] [--hs-steps S] [--torch-steps S] [--warmup S]
#                                [--torch-tunables T] [--peers eager,compile]
# Each flag also reads an environment variable (BATCH, SEQ, THREADS, DTYPE, ROUNDS, REMAT, HS_STEPS, TORCH_STEPS,
# WARMUP, TORCH_TUNABLES, PEERS); flags win.
# --peers (default eager): which torch peers run in each round, in order: eager, compile (torch.compile with
#   inductor; its compile happens in the warm-up steps and is never timed; its graph breaks are printed).
# --torch-tunables (default glibc.malloc.hugetlb=1): GLIBC_TUNABLES for the torch process. hybridscan backs glibc's
#   heap with transparent huge pages itself (it sets exactly this for its own process); giving torch the same keeps
#   the comparison about the engines, not the allocator setting (torch measured ~8% faster with it). '' runs torch
#   with the environment as it is.
# --remat none (default) is the like-for-like comparison: PyTorch eager keeps every activation for backward and
#   recomputes nothing, as hybridscan does with --remat none. sublayer/block add hybridscan's recomputation.
# HYBRIDSCAN (default build/hybridscan) and PYTHON (default .venv/bin/python, made by scripts/setup.sh --bench, else
#   python3) pick the programs.
#
# --dtype bf16 (default): hybridscan's default, fp32 weights with bf16 compute; torch runs fp32 weights under
#   bf16 autocast. --dtype fp32: fp32 compute on both sides.
# Both sides run --warmup untimed steps first (default 2: one-time setup such as oneDNN primitive creation, first-touch
# allocation, PyTorch's allocator warming up) and are timed over the steps after them: hybridscan runs warmup +
# --hs-steps steps and its figure comes from the per-step times in its metrics.jsonl; torch gets --warmup.
# Two ratios: of tokens/s over each run's timed steps (the headline figure), and of each run's best timed step,
# which other jobs on a shared machine disturb less.
set -euo pipefail
cd "$(dirname "$0")/.."

batch=${BATCH:-8}
seq=${SEQ:-512}
threads=${THREADS:-2}
dtype=${DTYPE:-bf16}
rounds=${ROUNDS:-3}
remat=${REMAT:-none}
hs_steps=${HS_STEPS:-4}
torch_steps=${TORCH_STEPS:-3}
warmup=${WARMUP:-2}
torch_tunables=${TORCH_TUNABLES-glibc.malloc.hugetlb=1}
hybridscan=${HYBRIDSCAN:-build/hybridscan}
peers=${PEERS:-eager}
default_python=python3
[ -x .venv/bin/python ] && default_python=.venv/bin/python
python=${PYTHON:-$default_python}

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "compare_train_speed.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --batch) batch=${2:?--batch needs a value}; shift 2 ;;
    --seq) seq=${2:?--seq needs a value}; shift 2 ;;
    --threads) threads=${2:?--threads needs a value}; shift 2 ;;
    --dtype) dtype=${2:?--dtype needs a value}; shift 2 ;;
    --rounds) rounds=${2:?--rounds needs a value}; shift 2 ;;
    --remat) remat=${2:?--remat needs a value}; shift 2 ;;
    --hs-steps) hs_steps=${2:?--hs-steps needs a value}; shift 2 ;;
    --torch-steps) torch_steps=${2:?--torch-steps needs a value}; shift 2 ;;
    --warmup) warmup=${2:?--warmup needs a value}; shift 2 ;;
    --torch-tunables) torch_tunables=${2?--torch-tunables needs a value}; shift 2 ;;
    --peers) peers=${2:?--peers needs a value}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument '$1'" ;;
  esac
done

for v in batch seq threads rounds hs_steps torch_steps; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer, got '${!v}'"
done
[[ $warmup =~ ^[0-9]+$ ]] || die "warmup must be a non-negative integer, got '$warmup'"
case "$dtype" in fp32|bf16) ;; *) die "--dtype must be fp32 or bf16, got '$dtype'" ;; esac
case "$remat" in none|block|sublayer) ;; *) die "--remat must be none, block or sublayer, got '$remat'" ;; esac
IFS=, read -r -a peer_list <<<"$peers"
for p in "${peer_list[@]}"; do
  case "$p" in eager|compile) ;; *) die "--peers takes a comma-separated list of eager and compile, got '$peers'" ;; esac
done
[ "$warmup" -ge 1 ] || [[ ",$peers," != *,compile,* ]] || die "the compile peer needs --warmup >= 1 (the compile is not timed)"

if [ ! -x "$hybridscan" ]; then
  echo "compare_train_speed.sh: $hybridscan not found; build it first: scripts/setup.sh" >&2
  exit 2
fi
if ! "$python" -c 'import torch, transformers' 2>/dev/null; then
  echo "compare_train_speed.sh: $python cannot import torch and transformers; run scripts/setup.sh --bench" >&2
  exit 2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Peak RSS through GNU time when it is there; the torch script also reports its own.
gnu_time=()
if [ -x /usr/bin/time ]; then gnu_time=(/usr/bin/time -o "$tmp/rss" -f %M); fi

# Prints "tokens_per_s best_step_tokens_per_s" for one run over its timed steps. torch: both from the last stdout
# line's JSON. hybridscan (a metrics.jsonl and the warm-up count given): from the per-step tokens/s of the steps
# after the warm-up, as total tokens over total time.
read_run='
import json, sys
run = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
tps, best = run["tokens_per_s"], run.get("best_step_tokens_per_s")
if len(sys.argv) > 2:
    steps = [json.loads(line)["tokens_per_s"] for line in open(sys.argv[2]) if line.strip()]
    timed = steps[int(sys.argv[3]):]
    if not timed:
        sys.exit("no timed steps in " + sys.argv[2])
    tps, best = len(timed) / sum(1.0 / s for s in timed), max(timed)
print(tps, best)
'

# Runs one side (its metrics.jsonl path or "" first) and sets tps, best and rss_mib ("-" when unknown); dies with
# the run's stderr on failure. Called in this shell, not a subshell, so that its exit stops the script.
run_side() {
  local name=$1 metrics=$2 parsed
  shift 2
  rm -f "$tmp/rss"
  if ! "${gnu_time[@]}" "$@" >"$tmp/out" 2>"$tmp/err"; then
    echo "compare_train_speed.sh: $name failed: $*" >&2
    tail -n 20 "$tmp/err" >&2
    exit 1
  fi
  parsed=$("$python" -c "$read_run" "$tmp/out" ${metrics:+"$metrics" "$warmup"} 2>"$tmp/parse_err") ||
    die "$name: cannot read tokens_per_s ($(tail -n 1 "$tmp/parse_err")); last stdout line: $(tail -n 1 "$tmp/out")"
  read -r tps best <<<"$parsed"
  rss_mib="-"
  if [ -s "$tmp/rss" ]; then rss_mib=$(( $(tail -n 1 "$tmp/rss") / 1024 )); fi
  printf '%-6s %-13s %12.1f %16.1f %13s\n' "$r" "$name" "$tps" "$best" "$rss_mib"
}

hs_cmd=("$hybridscan" train --preset small --synthetic --steps "$((warmup + hs_steps))" --batch "$batch" --seq "$seq"
        --threads "$threads" --compute-dtype "$dtype" --remat "$remat" --out "$tmp/hs" --quiet --json)
torch_env=()
if [ -n "$torch_tunables" ]; then torch_env=(env "GLIBC_TUNABLES=$torch_tunables"); fi
torch_cmd=("${torch_env[@]}" "$python" bench/torch_train_step.py --dtype "$dtype" --threads "$threads" --batch "$batch" --seq "$seq"
           --steps "$torch_steps" --warmup "$warmup")

echo "small preset, batch $batch x seq $seq, $threads threads, $dtype, hybridscan --remat $remat; $rounds rounds alternating;"
echo "each side timed over its steps after $warmup untimed warm-up steps"
echo "  hybridscan: ${hs_cmd[*]}"
for p in "${peer_list[@]}"; do
  flag=""; [ "$p" = compile ] && flag=" --compile"
  echo "  torch-$p: ${torch_cmd[*]}$flag"
done
printf '%-6s %-13s %12s %16s %13s\n' round impl tokens/s best_step_tok/s peak_rss_MiB
results=()   # "impl tokens_per_s best_step" per run
for ((r = 1; r <= rounds; r++)); do
  run_side hybridscan "$tmp/hs/metrics.jsonl" "${hs_cmd[@]}"
  results+=("hybridscan $tps $best")
  for p in "${peer_list[@]}"; do
    extra=(); [ "$p" = compile ] && extra=(--compile)
    run_side "torch-$p" "" "${torch_cmd[@]}" "${extra[@]}"
    results+=("torch-$p $tps $best")
    if [ "$p" = compile ]; then
      "$python" -c 'import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print("       torch-compile: %d graph break(s), %d graph(s), warm-up incl. compile %.1f s" % (r["graph_breaks"], r["unique_graphs"], r["warmup_seconds"])); [print("         break x%d: %s" % (v, k)) for k, v in r["graph_break_reasons"].items()]' "$tmp/out"
    fi
  done
done

"$python" - "${results[@]}" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(lambda: ([], []))
for r in sys.argv[1:]:
    impl, tps, best = r.split()
    runs[impl][0].append(float(tps))
    runs[impl][1].append(float(best))
hs, hs_best = (statistics.median(v) for v in runs.pop("hybridscan"))
for impl, (tps, best) in runs.items():
    pt, pt_best = statistics.median(tps), statistics.median(best)
    print(f"median tokens/s    hybridscan {hs:10.1f}   {impl:13s} {pt:10.1f}   hybridscan/{impl} {hs / pt:.2f}x")
    print(f"median best step   hybridscan {hs_best:10.1f}   {impl:13s} {pt_best:10.1f}   hybridscan/{impl} {hs_best / pt_best:.2f}x")
EOF
