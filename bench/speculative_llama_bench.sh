#!/usr/bin/env bash
# Speculative decoding with the MTP layer, hybridscan against llama.cpp's draft-mtp on the same GGUF file (issue 25).
# Not a test.
#
#   bench/speculative_llama_bench.sh --llama-build DIR [--model M] [--steps S] [--new N] [--prompts K] [--drafts "1 2"]
#                                    [--threads T] [--dtype bf16|f32] [--no-converter-check] [--out DIR]
#   CHECKPOINT=DIR bench/speculative_llama_bench.sh --llama-build DIR ...   (skip the training)
#
#   --llama-build  a CMake build tree of llama.cpp with libllama and libllama-common built (shared libraries), whose
#                  CMakeCache.txt names its source tree (e.g. llama-cpp-python 0.3.36's vendored llama.cpp); also
#                  LLAMA_BUILD=DIR. bench/llama_mtp_spec.cpp is compiled against it into OUT/llama_mtp_spec
#   --model        what to train when CHECKPOINT is not given (default small+mtp, a Qwen3-Next MoE: llama.cpp's
#                  qwen3next; bench/configs/qwen35-small-dense-mtp.json is a Qwen3.5 dense one: llama.cpp's qwen35)
#   --steps        training steps when CHECKPOINT is not given (default 200): train --preset M --text
#                  data/kjv.txt --mtp-weight 0.3 --batch 8 --seq 128 --threads T (byte tokens: both models' vocabulary
#                  is the 256 bytes, so there is no tokenizer to share; both engines get token ids = bytes)
#   --new          new tokens per prompt (default 128; end-of-text does not stop either engine)
#   --prompts      prompts (default 8): the first 48 bytes of the lines of data/kjv-heldout.txt longer than 48 bytes
#   --drafts       draft lengths (default "1 2")
#   --threads      threads of each engine (default 2)
#   --dtype        the GGUF written by hybridscan's convert --quantize (default bf16); both engines decode from it
#   --no-converter-check   skip converting the Hugging Face export with llama.cpp's own converter (MTP kept) and
#                  comparing its tensors with ours (needs the venv's transformers and the llama.cpp source tree)
#   --out          results (default runs/speculative_llama_bench): results.jsonl (every call), summary.md
#
# Batch 1, greedy. Each prompt is one round: llama.cpp plain, then per draft length llama.cpp draft-mtp and
# hybridscan `generate --speculative mtp --draft N --compare-plain` (which decodes the prompt speculatively and then
# plainly in the same process), so the engines alternate within the round. If llama.cpp cannot load the file or
# draft-mtp fails, the error is recorded in summary.md and hybridscan's side still runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/hybridscan}
usage() { sed -n 2,29p "$0"; }
LLAMA_BUILD=${LLAMA_BUILD:-} MODEL=small+mtp STEPS=200 NEW=128 K=8 DRAFTS="1 2" THREADS=2 DTYPE=bf16 CONVCHECK=1
OUT=runs/speculative_llama_bench
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --llama-build) LLAMA_BUILD=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --new) NEW=$2; shift 2 ;;
    --prompts) K=$2; shift 2 ;;
    --drafts) DRAFTS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --dtype) DTYPE=$2; shift 2 ;;
    --no-converter-check) CONVCHECK=0; shift ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "speculative_llama_bench: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "speculative_llama_bench: $*" >&2; exit 2; }
[ -x "$BIN" ] || die "no $BIN: build hybridscan first (scripts/setup.sh build)"
[ -n "$LLAMA_BUILD" ] || die "--llama-build DIR (or LLAMA_BUILD=) is required: a llama.cpp build tree with libllama and libllama-common"
[ -f "$LLAMA_BUILD/CMakeCache.txt" ] || die "$LLAMA_BUILD has no CMakeCache.txt: not a CMake build tree"
LLAMA_SRC=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$LLAMA_BUILD/CMakeCache.txt")
[ -f "$LLAMA_SRC/common/speculative.h" ] || die "$LLAMA_SRC (the build tree's source) has no common/speculative.h"
LIBDIR=$(dirname "$(find "$LLAMA_BUILD" -name 'libllama-common.so' -print -quit)")
[ -f "$LIBDIR/libllama.so" ] || die "no libllama.so / libllama-common.so under $LLAMA_BUILD: build the targets llama and llama-common"
for fv in steps:STEPS new:NEW prompts:K threads:THREADS; do
  v=${fv#*:}; [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "--${fv%%:*} must be a positive integer, got '${!v}'"
done
for n in $DRAFTS; do [[ $n =~ ^[1-3]$ ]] || die "--drafts: each draft length is 1, 2 or 3 (hybridscan's limit), got '$n'"; done
case $DTYPE in bf16|f32) ;; *) die "--dtype is bf16 or f32, got '$DTYPE'" ;; esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/bench.log"
: > "$LOG"
note() { echo "$*" | tee -a "$LOG" >&2; }

# 1. The model.
if [ -n "${CHECKPOINT:-}" ]; then
  CK=$CHECKPOINT
  [ -d "$CK" ] || die "CHECKPOINT=$CK is not a directory"
else
  CK="$OUT/train/checkpoint-$STEPS"
  if [ ! -d "$CK" ]; then
    rm -rf "$OUT/train"
    note "training $MODEL, $STEPS steps (batch 8 x 128 bytes, --mtp-weight 0.3)"
    "$BIN" train --preset "$MODEL" --text data/kjv.txt --mtp-weight 0.3 --steps "$STEPS" --batch 8 --seq 128 \
      --threads "$THREADS" --eval-every 100 --out "$OUT/train" --quiet --json > "$OUT/train.json" 2> "$OUT/train.err" ||
      { cat "$OUT/train.err" >&2; die "training failed"; }
  fi
fi
"$BIN" inspect "$CK" 2>/dev/null | grep "^multi-token prediction" > /dev/null ||
  note "warning: inspect does not mention an MTP layer in $CK (generate --speculative mtp will say whether it has one)"

# 2. GGUF export (ours), and the Hugging Face export through llama.cpp's converter for comparison.
GGUF="$OUT/model.$DTYPE.gguf"
rm -f "$GGUF"
"$BIN" convert --from "$CK" --to "$GGUF" --quantize "$DTYPE" --quiet > "$OUT/convert.log" 2>&1 ||
  { cat "$OUT/convert.log" >&2; die "convert --quantize $DTYPE failed"; }
note "wrote $GGUF ($(du -h "$GGUF" | cut -f1))"
CONV_RESULT="not run (--no-converter-check)"
if [ "$CONVCHECK" = 1 ]; then
  rm -rf "$OUT/hf" "$OUT/llama-converter.$DTYPE.gguf"
  if "$BIN" convert --from "$CK" --to "$OUT/hf" --format hf --quiet > "$OUT/convert-hf.log" 2>&1 &&
     PY=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 ) &&
     "$PY" - "$LLAMA_SRC" "$OUT/hf" "$OUT/llama-converter.$DTYPE.gguf" "$DTYPE" "$GGUF" > "$OUT/converter-check.txt" 2>&1 <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
llama, hf, target, dtype, ours = sys.argv[1:]
from make_gguf_fixtures import patch_converter  # llama.cpp's converter, taught the byte vocabulary
import json, shutil, tempfile
from byte_level import byte_tokenizer_json
conv = patch_converter(Path(llama).resolve())
with tempfile.TemporaryDirectory() as tmp:
    src = Path(tmp) / "model"
    shutil.copytree(hf, src)
    if not (src / "tokenizer.json").exists():
        (src / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False))
        (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--outtype", dtype, "--outfile", target]  # MTP kept (no --no-mtp)
    conv.main()
sys.path.insert(0, str(Path(llama) / "gguf-py"))
import gguf
a, b = gguf.GGUFReader(ours), gguf.GGUFReader(target)
ta = {t.name: t for t in a.tensors}
tb = {t.name: t for t in b.tensors}
print(f"ours: {len(ta)} tensors, llama.cpp's converter: {len(tb)} tensors")
only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
diff = [n for n in sorted(set(ta) & set(tb))
        if ta[n].tensor_type != tb[n].tensor_type or list(ta[n].shape) != list(tb[n].shape)
        or bytes(ta[n].data.tobytes()) != bytes(tb[n].data.tobytes())]
nextn = sorted(n for n in ta if ".nextn." in n)
print("only ours:", only_a)
print("only the converter's:", only_b)
print("different (type, shape or bytes):", diff)
print("nextn tensors in ours:", nextn)
for key in ("nextn_predict_layers", "block_count"):
    fa = [f for f in a.fields if f.endswith(key)]
    fb = [f for f in b.fields if f.endswith(key)]
    va = [int(a.fields[f].parts[-1][0]) for f in fa]
    vb = [int(b.fields[f].parts[-1][0]) for f in fb]
    print(f"{key}: ours {va}, converter {vb}")
print("RESULT:", "same tensors, byte for byte" if not (only_a or only_b or diff) else
      f"{len(only_a)} only ours, {len(only_b)} only theirs, {len(diff)} different")
EOF
  then
    CONV_RESULT=$(sed -n 's/^RESULT: //p' "$OUT/converter-check.txt")
  else
    CONV_RESULT="failed (see converter-check.txt / convert-hf.log): $(tail -n 1 "$OUT/converter-check.txt" 2>/dev/null)"
  fi
  note "llama.cpp's converter on our HF export vs our GGUF: $CONV_RESULT"
fi

# 3. The llama.cpp driver.
DRIVER="$OUT/llama_mtp_spec"
if [[ ! -x $DRIVER || bench/llama_mtp_spec.cpp -nt $DRIVER ]]; then
  note "compiling bench/llama_mtp_spec.cpp against $LLAMA_BUILD"
  g++ -O2 -std=c++20 bench/llama_mtp_spec.cpp -I"$LLAMA_SRC/include" -I"$LLAMA_SRC/ggml/include" \
    -I"$LLAMA_SRC/common" -I"$LLAMA_SRC/vendor" -L"$LIBDIR" -lllama-common -lllama -lggml -lggml-base \
    -Wl,-rpath,"$LIBDIR" -o "$DRIVER" 2> "$OUT/driver-build.log" || { cat "$OUT/driver-build.log" >&2; die "cannot compile the llama.cpp driver"; }
fi

# 4. Prompts (token ids = bytes).
awk -v k="$K" 'length($0) > 48 { s = substr($0, 1, 48); gsub(/^ +/, "", s); print s; if (++n == k) exit }' \
  data/kjv-heldout.txt > "$OUT/prompts.txt"
python3 -c 'import sys; [print(",".join(str(b) for b in l.rstrip("\n").encode())) for l in open(sys.argv[1])]' \
  "$OUT/prompts.txt" > "$OUT/prompt_ids.txt"
[ "$(wc -l < "$OUT/prompt_ids.txt")" -eq "$K" ] || die "data/kjv-heldout.txt gave fewer than $K prompts"

# 5. The rounds.
: > "$OUT/results.jsonl"
: > "$OUT/llama_errors.txt"
LLAMA_ARGS=(-m "$GGUF" -t "$THREADS" -tb "$THREADS" -c 512 -b 512 -ub 512 --temp 0)
LLAMA_DEAD=()   # configurations that failed once are not retried
llama_call() {  # label, prompt file, then llama.cpp flags
  local label=$1 pf=$2; shift 2
  [[ " ${LLAMA_DEAD[*]} " == *" $label "* ]] && return 0
  if "$DRIVER" "$pf" "$NEW" "${LLAMA_ARGS[@]}" "$@" > "$OUT/last.out" 2> "$OUT/last.err"; then
    printf '{"engine": "llama.cpp", "label": "%s", "result": %s}\n' "$label" "$(tail -n 1 "$OUT/last.out")" >> "$OUT/results.jsonl"
  else
    local rc=$?
    { echo "== $label (exit $rc): llama_mtp_spec $pf $NEW ${LLAMA_ARGS[*]} $*"; grep -v '^\s*$' "$OUT/last.err" | tail -n 25; } >> "$OUT/llama_errors.txt"
    note "llama.cpp $label failed (exit $rc): $(grep -i -E 'error|assert|failed|abort|unknown|not supported' "$OUT/last.err" | tail -n 1)"
    LLAMA_DEAD+=("$label")
  fi
}
hs_call() {  # label, then generate's arguments
  local label=$1; shift
  "$BIN" generate --checkpoint "$GGUF" --ignore-eos --json --compare-plain --threads "$THREADS" "$@" \
    > "$OUT/last.out" 2> "$OUT/last.err" || { cat "$OUT/last.err" >&2; die "hybridscan generate failed ($label)"; }
  printf '{"engine": "hybridscan", "label": "%s", "result": %s}\n' "$label" "$(tail -n 1 "$OUT/last.out")" >> "$OUT/results.jsonl"
}
for i in $(seq 1 "$K"); do
  sed -n "${i}p" "$OUT/prompt_ids.txt" > "$OUT/prompt.txt"
  note "round $i/$K: $(sed -n "${i}p" "$OUT/prompts.txt")"
  llama_call "plain" "$OUT/prompt.txt"
  for N in $DRAFTS; do
    llama_call "draft$N" "$OUT/prompt.txt" --spec-type draft-mtp --spec-draft-n-max "$N" --spec-draft-n-min 0
    hs_call "draft$N" --speculative mtp --draft "$N" --max-new-tokens "$NEW" --prompt-ids "$(cat "$OUT/prompt.txt")"
  done
done

# 6. Summary.
{
  echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "model: $CK -> $GGUF; $K prompts x $NEW new tokens, batch 1, greedy, $THREADS threads each"
  echo "llama.cpp: $LLAMA_SRC, build $LLAMA_BUILD"
  echo "llama.cpp's converter on the HF export vs our GGUF: $CONV_RESULT"
} > "$OUT/summary.md"
python3 - "$OUT" "$NEW" >> "$OUT/summary.md" <<'EOF'
import collections, json, statistics, sys
out, new = sys.argv[1], int(sys.argv[2])
rows = [json.loads(l) for l in open(f"{out}/results.jsonl")]
by = collections.defaultdict(list)
for r in rows:
    by[(r["engine"], r["label"])].append(r["result"])
med = lambda xs: statistics.median(xs) if xs else float("nan")
lines = ["", "| engine | run | prompts | kept per draft position | tokens / step | replayed passes | plain tok/s | speculative tok/s | speedup | same tokens as its own plain |",
         "|---|---|---|---|---|---|---|---|---|---|"]
llama_plain = by.get(("llama.cpp", "plain"), [])
for (eng, label), rs in sorted(by.items()):
    if label == "plain":
        continue
    if eng == "hybridscan":
        s = [r["speculative"] for r in rs]
        acc = [statistics.mean(x["accepted_rate"][k] for x in s) for k in range(len(s[0]["accepted_rate"]))]
        plain = [x["plain_decode_tokens_per_s"] for x in s]
        spec = [r["decode_tokens_per_s"] for r in rs]
        ratio = [x["speedup"] for x in s]
        same = sum(bool(x["same_tokens_as_plain"]) for x in s)
        tps = statistics.mean(x["tokens_per_step"] for x in s)
        replays = "-"
    else:
        pd = [sum(x) for x in zip(*[r["pos_drafted"] for r in rs])] if rs[0]["pos_drafted"] else []
        pa = [sum(x) for x in zip(*[r["pos_accepted"] for r in rs])] if rs[0]["pos_accepted"] else []
        acc = [a / d if d else float("nan") for a, d in zip(pa, pd)]
        spec = [r["decode_tokens_per_s"] for r in rs]
        plain = [p["decode_tokens_per_s"] for p in llama_plain[:len(rs)]]
        ratio = [a / b for a, b in zip(spec, plain)]
        same = sum(r["tokens"] == p["tokens"] for r, p in zip(rs, llama_plain))
        tps = statistics.mean(r["generated"] / r["steps"] for r in rs)
        replays = "%d of %d" % (sum(r["replays"] for r in rs), sum(r["steps"] for r in rs))
    lines.append("| %s | draft %s | %d | %s | %.2f | %s | %.1f | %.1f | %.2fx | %s |" % (
        eng, label[5:], len(rs), ", ".join("%.0f%%" % (100 * a) for a in acc), tps, replays, med(plain), med(spec), med(ratio),
        "yes (%d/%d)" % (same, len(rs)) if same == len(rs) else "NO (%d/%d)" % (same, len(rs))))
print("\n".join(lines))
print("\nspeedup: median over the prompts of speculative / plain decode tokens/s of the same prompt and engine. "
      "tokens / step: new tokens per target pass (verification or replay); replayed passes: llama.cpp's second target "
      "pass after a partial acceptance (recurrent state restored from its checkpoint, the kept tokens fed again), of all "
      "its target passes.")
if llama_plain:
    # The engines against each other: leading tokens on which hybridscan's plain greedy output and llama.cpp's agree.
    hs = [r for r in by.get(("hybridscan", sorted(l for e, l in by if e == "hybridscan")[0]), [])]
    agree = []
    for h, l in zip(hs, llama_plain):
        ht, lt = (h.get("tokens") or [[]])[0], l["tokens"]
        n = 0
        while n < min(len(ht), len(lt)) and ht[n] == lt[n]:
            n += 1
        agree.append(n)
    if agree:
        print(f"hybridscan's and llama.cpp's greedy tokens agree for the first {agree} of {new} tokens per prompt "
              "(bf16 near-ties part them; each engine is compared with its own plain output above).")
else:
    print("\nllama.cpp produced no results: see llama_errors.txt.")
EOF
if [ -s "$OUT/llama_errors.txt" ]; then
  { echo; echo "llama.cpp errors (llama_errors.txt):"; echo '```'; cat "$OUT/llama_errors.txt"; echo '```'; } >> "$OUT/summary.md"
fi
cat "$OUT/summary.md"
