#!/usr/bin/env python3
"""Multi-process training under mpirun, against one process (ctest runs each case as its own test).

  mpi_test.py BINARY MPIRUN CASE

Cases: accum (--grad-accum on 2 ranks: one process's losses, the plan's peak), agree (N = 2 and 4 ranks train the same losses as one process with the same global batch, both families,
models with a remainder layer count, fp32 and bf16 compute, with and without --prefetch), fsdp (FSDP groups of 2
inside 4 ranks), memory (each rank's measured step peak equals `plan --devices N [--fsdp G]`), checkpoint (saved by 2 ranks,
resumed on 1, 2 and 4; same-count resume bit-exact; eval reads it), pieces (routed experts one expert a piece: the
same bits as whole layers, peaks equal to the plan), update (--update-in-backward: the usual step's losses and saved
parameters and moments to the bit on 2 ranks and on 2 FSDP groups of 2, peaks equal to the plan), expert
(--expert-parallel: losses, memory, checkpoints, bad input), faults (a killed rank, mismatched options, a
world size that does not divide the batch), vocab (the LM head and the embedding in vocabulary pieces whose
ranges straddle the shard bound: losses within the bound of one process, peaks equal to the plan,
--update-in-backward to the bit), packed (packed documents from a token file: 2 ranks equal one process, peaks
equal to the plan).

The ranks run one OpenMP thread each (two ranks already fill this 2-core machine), as the plan is told
(OMP_NUM_THREADS=1): the delta rule's backward scratch is per thread.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures" / "parity"
ENV = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", HS_MPI_TIMEOUT_S="60")
# The fp32 bound of the issue; bf16 compute rounds each rank's partial sums, so its bound is that of bf16 itself.
TOL = {"fp32": 1e-6, "bf16": 2e-3}
# qwen3-next-L7 (fp32): the ranks' partial sums differ from one process's by rounding (1.3e-9 relative in the first
# loss); this model's training amplifies any such difference ~1000x in 20 steps (5.7e-6 at step 20 with 2 ranks). It
# is the model, not the split: one process whose weights after step 1 are moved by one ulp each (random sign) departs
# from its own curve as far (up to 7.0e-6 over steps 2-20; `l7_sensitivity` below shows it every run), and
# from identical weights (a checkpoint resumed on 1 and on 2 ranks) one step agrees to 3e-9. So 1e-6 over 20 steps
# would need 2 ranks to be bit-identical to one process, i.e. the same summation order for every gradient, which a
# split of the rows over ranks cannot give. How far the amplification goes depends on where the rounding lands (the
# router's near-ties: one flipped top-k choice moves every later loss): after session 7's kernel changes (which moved
# rounding in the router's logits and elsewhere; not bisected) the sanitizer build's 2 and 4 ranks reached 8.6e-5 / 9.5e-5 over 20 steps, the Release build's
# 5.7e-6 / 1.0e-6, every step before the first flip within 2e-6; an earlier build's one-ulp probe moved this model's
# own curve by 1.7e-3. So the model is held to 1e-4: a wrong exchange (an expert's rows or gradient lost, a shard
# summed twice) moves the first losses by orders of magnitude more, and the other models stay at 1e-6.
TOL_L7 = 1e-4
MODELS = {
    "tiny": ["--preset", "tiny"],                                    # qwen3-next, 4 layers: one block
    "tiny+mtp": ["--preset", "tiny+mtp"],                            # the same with a multi-token-prediction layer
    "qwen3.5-L5": ["--config", str(FIXTURES / "qwen3_5_L5")],         # one block + 1 remainder layer
    "qwen3-next-L7": ["--config", str(FIXTURES / "qwen3_next_L7")],   # one block + 3 remainder layers
}


def run(cmd, check=True, timeout=120):
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        sys.exit(f"FAILED ({p.returncode}): {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return p


MPIRUN = "mpirun"


def mpirun(n, args):
    return [MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", str(n), *args]


def train(binary, n, model, extra, check=True):
    args = [binary, "train", *MODELS[model], "--synthetic", "--seq", "16", "--threads", "1", "--quiet", "--json",
            *extra]
    p = run(mpirun(n, args) if n > 1 else args, check=check)
    if not check:
        return p
    return json.loads(p.stdout.strip().splitlines()[-1])


def worst_rel(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def case_agree(binary):
    failures = []
    runs = [("tiny", "fp32", ["--remat", "sublayer"]), ("qwen3.5-L5", "fp32", ["--remat", "block"]),
            ("qwen3-next-L7", "fp32", ["--remat", "sublayer", "--prefetch"]),
            ("tiny", "bf16", ["--remat", "sublayer", "--prefetch"]),
            ("tiny", "fp32", ["--remat", "none", "--weight-dtype", "bf16"])]
    for model, dtype, extra in runs:
        # The fp32 claim is over 20 steps; the bf16 runs only show the size of bf16's rounding, 10 steps do.
        steps = 10 if dtype == "bf16" or "--weight-dtype" in extra else 20
        common = ["--steps", str(steps), "--batch", "4", "--compute-dtype", dtype, *extra]
        one = train(binary, 1, model, common)["losses"]
        for n in (2, 4):
            many = train(binary, n, model, common)["losses"]
            w = worst_rel(many, one)
            same = sum(x == y for x, y in zip(many, one))
            print(f"{model} {dtype} {' '.join(extra) or '-'} N={n}: worst relative loss difference over {steps} steps "
                  f"{w:.2e}, {same}/{steps} steps bit-identical")
            # bf16 weights: an update that differs in its last fp32 bits can round a weight to the next bf16 value.
            tol = TOL_L7 if model == "qwen3-next-L7" and dtype == "fp32" else TOL[
                "bf16" if "--weight-dtype" in extra else dtype]
            if w > tol:
                failures.append(f"{model} {dtype} N={n}: {w:.2e} > {tol}")
    failures += l7_sensitivity(binary)
    # Deterministic reductions: the same rank count gives the same bits twice.
    common = ["--steps", "5", "--batch", "4", "--compute-dtype", "fp32", "--prefetch"]
    if train(binary, 2, "tiny", common)["losses"] != train(binary, 2, "tiny", common)["losses"]:
        failures.append("two 2-rank runs differ")
    return failures


def l7_sensitivity(binary):
    """qwen3-next-L7 in one process, its weights after step 1 moved by one ulp each: how far its own loss curve moves
    (the model's sensitivity to rounding, which bounds how well any other summation order can agree with it)."""
    import array
    import random
    with tempfile.TemporaryDirectory() as d:
        common = ["--steps", "20", "--batch", "4", "--compute-dtype", "fp32", "--remat", "sublayer"]
        train(binary, 1, "qwen3-next-L7", [*common, "--out", f"{d}/a", "--stop-after", "1"])
        ck = pathlib.Path(d) / "a" / "checkpoint-1"
        pert = pathlib.Path(d) / "pert"
        subprocess.run(["cp", "-r", str(ck), str(pert)], check=True)
        f = pert / "model.safetensors"
        b = bytearray(f.read_bytes())
        n = int.from_bytes(b[:8], "little")
        h = json.loads(b[8:8 + n])
        rng = random.Random(0)
        for k, v in h.items():
            if k == "__metadata__" or v["dtype"] != "F32":
                continue
            s, e = v["data_offsets"]
            a = array.array("I", bytes(b[8 + n + s:8 + n + e]))
            for i in range(len(a)):
                a[i] = (a[i] + rng.choice((-1, 1))) & 0xFFFFFFFF
            b[8 + n + s:8 + n + e] = a.tobytes()
        f.write_bytes(bytes(b))
        base = train(binary, 1, "qwen3-next-L7", ["--resume", str(ck), "--steps", "20"])["losses"]
        moved = train(binary, 1, "qwen3-next-L7", ["--resume", str(pert), "--steps", "20"])["losses"]
    w = worst_rel(moved, base)
    print(f"qwen3-next-L7, one process, weights moved by one ulp after step 1: worst relative loss difference over "
          f"steps 2-20 {w:.2e} (the model's own rounding sensitivity)")
    # The claim of TOL_L7: the model itself amplifies a rounding-level perturbation (~1e-9 relative in the first loss)
    # to the order of the 1e-6, so 2 ranks cannot be held to 1e-6. Where the rounding lands moves the figure
    # from build to build: 1.2e-6 to 7.0e-6 in Release builds, 9.3e-7 in the sanitizer build after session 13's
    # matmul tiles (its 2 and 4 ranks then differed from one process by 1.3e-6 and 5.5e-6). The check asks for
    # amplification of at least 100x (> 1e-7), which every build showed; a model that stopped amplifying would fail.
    return [] if w > 1e-7 else [f"qwen3-next-L7 moved only {w:.2e} under a one-ulp perturbation: revisit TOL_L7"]


def case_accum(binary):
    """--grad-accum: 2 ranks (one FSDP group of 2, and 2 data-parallel replicas of 1: the replicas' sum runs once an
    update, after the last micro-batch) train the losses of one process with the same micro-batches, and each rank's
    peak is the plan's, which is that of one micro-batch."""
    failures = []
    common = ["--steps", "5", "--batch", "4", "--grad-accum", "3", "--compute-dtype", "fp32"]
    one = train(binary, 1, "tiny", common)["losses"]
    for extra in ([], ["--fsdp", "1"]):
        w = worst_rel(train(binary, 2, "tiny", [*common, *extra])["losses"], one)
        print(f"--grad-accum 3, 2 ranks {' '.join(extra) or '(one FSDP group)'}: worst relative loss difference {w:.2e}")
        if w > TOL["fp32"]:
            failures.append(f"--grad-accum 2 ranks {extra}: {w:.2e}")
    r = train(binary, 2, "tiny", ["--steps", "2", "--batch", "4", "--grad-accum", "3", "--fsdp", "1"])
    plan = [json.loads(run([binary, "plan", "--model", "tiny", "--devices", "2", "--fsdp", "1", "--batch-per-device", "2",
                            "--seq", "16", "--json", *accum]).stdout)["total_bytes"]
            for accum in (["--grad-accum", "3"], [])]
    print(f"--grad-accum 3 on 2 ranks: measured {r['rank_peak_bytes']} B, planned {plan[0]} B (one micro-batch: {plan[1]} B)")
    if any(peak != plan[0] for peak in r["rank_peak_bytes"]) or plan[0] != plan[1]:
        failures.append(f"--grad-accum peaks {r['rank_peak_bytes']} vs plan {plan}")
    return failures


def write_documents_file(path, vocab=256, seed=0):
    """A token file (docs/token_format.md, version 1) of byte-like documents of random lengths 1-150, separated by
    id vocab - 1: what `tokenize` writes, without needing a tokenizer."""
    import random
    import struct
    rng = random.Random(seed)
    eot = vocab - 1
    ids, docs = [], 0
    while len(ids) < 40000:
        if docs:
            ids.append(eot)
        ids.extend(rng.randrange(eot) for _ in range(rng.randint(1, 150)))
        docs += 1
    table = struct.pack(f"<{vocab}H", *([1] * (vocab - 1) + [0]))
    fixed = b"HSTOKENS" + struct.pack("<IIQqqqqII", 1, 2, 0, vocab, len(ids), docs, len(ids) - docs + 1, eot, 0)
    h = 0xcbf29ce484222325
    for byte in fixed + table:
        h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    head = fixed + struct.pack("<Q", h) + table
    head += b"\0" * (-len(head) % 64)
    pathlib.Path(path).write_bytes(head + struct.pack(f"<{len(ids)}H", *ids))


def case_packed(binary):
    """Packed documents (--packing documents, the default on a token file of several documents) on 2 ranks equal one
    process, both families, with FSDP; each rank's peak equals the plan with --packing documents; and packing is in
    effect (stream gives other losses)."""
    failures = []
    with tempfile.TemporaryDirectory() as d:
        data = f"{d}/docs.tok"
        write_documents_file(data)
        for model, remat in (("tiny", "sublayer"), ("qwen3.5-L5", "none")):
            common = ["--data", data, "--seq", "128", "--steps", "8", "--batch", "4", "--compute-dtype", "fp32",
                      "--remat", remat]
            args = lambda extra: [binary, "train", *MODELS[model], "--threads", "1", "--quiet", "--json", *common,
                                  *extra]
            one = json.loads(run(args([])).stdout.strip().splitlines()[-1])
            stream = json.loads(run(args(["--packing", "stream"])).stdout.strip().splitlines()[-1])
            two = json.loads(run(mpirun(2, args(["--packing", "documents"]))).stdout.strip().splitlines()[-1])
            w = worst_rel(two["losses"], one["losses"])
            moved = worst_rel(stream["losses"], one["losses"])
            print(f"{model} packed documents, 2 ranks vs 1: worst relative loss difference {w:.2e}; "
                  f"stream vs documents {moved:.2e}")
            if w > TOL["fp32"]:
                failures.append(f"{model} packed on 2 ranks: {w:.2e} > {TOL['fp32']}")
            if moved < 1e-4:
                failures.append(f"{model}: --packing stream and documents train alike ({moved:.2e}): packing not in effect")
            cfg = MODELS[model][1]
            p = json.loads(run([binary, "plan", "--model", cfg, "--devices", "2", "--batch-per-device", "2", "--seq",
                                "128", "--remat", remat, "--compute-dtype", "fp32", "--packing", "documents",
                                "--json"]).stdout)
            for rank, peak in enumerate(two["rank_peak_bytes"]):
                print(f"{model} packed N=2 rank {rank}: measured {peak} B, planned {p['total_bytes']} B")
                if peak != p["total_bytes"]:
                    failures.append(f"{model} packed N=2 rank {rank}: {peak} vs plan {p['total_bytes']}")
    return failures


def case_fsdp(binary):
    common = ["--steps", "10", "--batch", "4", "--compute-dtype", "fp32", "--remat", "block"]
    one = train(binary, 1, "qwen3.5-L5", common)["losses"]
    r = train(binary, 4, "qwen3.5-L5", [*common, "--fsdp", "2"])
    w = worst_rel(r["losses"], one)
    print(f"4 ranks as 2 FSDP groups of 2: worst relative loss difference {w:.2e}")
    bad = train(binary, 4, "tiny", ["--steps", "1", "--batch", "4", "--fsdp", "3"], check=False)
    failures = [] if w <= TOL["fp32"] else [f"fsdp 2 x 2: {w:.2e}"]
    if bad.returncode == 0 or "an FSDP group of 3 ranks must divide the number of ranks (4)" not in bad.stderr:
        failures.append(f"--fsdp 3 on 4 ranks: no clear error ({bad.returncode}): {bad.stderr[-400:]}")
    return failures


def case_mtp(binary):
    """--mtp-weight 0.3 on tiny+mtp: 2 ranks (one FSDP group) and 4 ranks (2 FSDP groups of 2) train one process's
    losses within fp32's tolerance, and each rank's measured peak is the plan's."""
    failures = []
    common = ["--steps", "8", "--batch", "4", "--compute-dtype", "fp32", "--mtp-weight", "0.3"]
    one = train(binary, 1, "tiny+mtp", common)["losses"]
    for n, extra in [(2, []), (4, ["--fsdp", "2"])]:
        r = train(binary, n, "tiny+mtp", [*common, *extra])
        w = worst_rel(r["losses"], one)
        print(f"tiny+mtp --mtp-weight 0.3 N={n} {' '.join(extra) or '-'}: worst relative loss difference {w:.2e}")
        if w > TOL["fp32"]:
            failures.append(f"mtp N={n}: {w:.2e} > {TOL['fp32']}")
        p = json.loads(run([binary, "plan", "--model", "tiny+mtp", "--devices", str(n), "--batch-per-device",
                            str(4 // n) if n <= 4 else "1", "--seq", "16", "--compute-dtype", "fp32", "--mtp-weight",
                            "0.3", "--json", *extra]).stdout)
        for rank, peak in enumerate(r["rank_peak_bytes"]):
            rel = abs(peak - p["total_bytes"]) / p["total_bytes"]
            print(f"  rank {rank}: measured {peak} B, planned {p['total_bytes']} B ({rel:.2e})")
            if rel > 0.01:
                failures.append(f"mtp N={n} rank {rank}: {peak} vs plan {p['total_bytes']}")
    return failures


def case_memory(binary):
    failures = []
    for model, n, remat, dtype, extra in [("tiny", 2, "sublayer", "fp32", []), ("tiny", 4, "block", "bf16", ["--prefetch"]),
                                          ("qwen3-next-L7", 2, "none", "bf16", ["--prefetch"]),
                                          ("qwen3.5-L5", 4, "sublayer", "fp32", ["--prefetch"]),
                                          ("tiny", 4, "sublayer", "fp32", ["--fsdp", "2"])]:
        batch = 2 * n
        r = train(binary, n, model, ["--steps", "2", "--batch", str(batch), "--remat", remat, "--compute-dtype", dtype,
                                     *extra])
        cfg = MODELS[model][1]
        p = json.loads(run([binary, "plan", "--model", cfg, "--devices", str(n), "--batch-per-device", "2", "--seq", "16",
                            "--remat", remat, "--compute-dtype", dtype, "--json", *extra]).stdout)
        for rank, peak in enumerate(r["rank_peak_bytes"]):
            rel = abs(peak - p["total_bytes"]) / p["total_bytes"]
            print(f"{model} N={n} {remat} {dtype} {' '.join(extra) or '-'} rank {rank}: measured {peak} B, "
                  f"planned {p['total_bytes']} B ({rel:.2e})")
            if rel > 0.01:
                failures.append(f"{model} N={n} rank {rank}: {peak} vs plan {p['total_bytes']}")
    return failures


def case_pieces(binary):
    """Routed experts gathered and reduce-scattered one expert at a time (--gather-piece-bytes 1) against whole layers:
    the same losses to the bit on 2 ranks (a piece changes what is live, not the sums), within the fp32 bound of one
    process, and each rank's measured peak equal to the plan."""
    failures = []
    piece = ["--gather-piece-bytes", "1"]
    for model, extra in [("tiny", ["--remat", "sublayer"]), ("qwen3.5-L5", ["--remat", "block", "--prefetch"])]:
        common = ["--steps", "6", "--batch", "4", "--compute-dtype", "fp32", *extra]
        one = train(binary, 1, model, common)["losses"]
        whole = train(binary, 2, model, common)["losses"]
        pieces = train(binary, 2, model, [*common, *piece])
        w = worst_rel(pieces["losses"], one)
        print(f"{model} {' '.join(extra)} N=2, one expert a piece: bit-identical to whole layers: "
              f"{pieces['losses'] == whole}; against one process {w:.2e}")
        if pieces["losses"] != whole:
            failures.append(f"{model}: pieces change the losses on 2 ranks")
        if w > TOL["fp32"]:
            failures.append(f"{model} pieces N=2: {w:.2e} > {TOL['fp32']}")
        cfg = MODELS[model][1]
        p = json.loads(run([binary, "plan", "--model", cfg, "--devices", "2", "--batch-per-device", "2", "--seq", "16",
                            "--compute-dtype", "fp32", "--json", *extra, *piece]).stdout)
        for rank, peak in enumerate(pieces["rank_peak_bytes"]):
            if peak != p["total_bytes"]:
                failures.append(f"{model} pieces rank {rank}: measured {peak} B, planned {p['total_bytes']} B")
    return failures


def case_vocab(binary):
    """The LM head and the embedding in vocabulary pieces (--vocab-piece-bytes 5000: tiny's 256 x 64 tensors in pieces
    of 19 rows in fp32, 39 in bf16, so that one piece straddles the shard bound at row 128 of 2 ranks: ranges not
    aligned to shards). Losses within the bound of one process: the rank split's (TOL) plus the streamed
    log-sum-exp's, per token (2 V + 4.2 P + 4) u + 2 u loss (u = 2^-24, P pieces; lm_head_test.cpp derives it), which
    is also what each step's loss may move by through the parameters of the steps before (measured far below).
    Each rank's measured peak equals the plan to the byte, with and without --prefetch and --update-in-backward; with
    --update-in-backward the usual step's losses and saved parameters and moments to the bit (both in pieces)."""
    failures = []
    piece = ["--vocab-piece-bytes", "5000"]
    V, u = 256, 2.0 ** -24
    runs = [(["--remat", "sublayer", "--compute-dtype", "fp32"], 19),
            (["--remat", "block", "--compute-dtype", "fp32", "--prefetch"], 19),
            (["--remat", "none", "--compute-dtype", "bf16", "--prefetch", "--weight-dtype", "bf16"], 39)]
    with tempfile.TemporaryDirectory() as d:
        for i, (extra, rows) in enumerate(runs):
            common = ["--steps", "6", "--batch", "4", "--clip", "0", *extra]
            one = train(binary, 1, "tiny", [*common, "--vocab-piece-bytes", "0"])["losses"]
            many = train(binary, 2, "tiny", [*common, *piece, "--out", f"{d}/u{i}"])
            upd = train(binary, 2, "tiny", [*common, *piece, "--update-in-backward", "--out", f"{d}/b{i}"])
            P = (V + rows - 1) // rows
            tol = TOL["bf16" if "bf16" in extra else "fp32"] + (2 * V + 4.2 * P + 4) * u / min(one) + 2 * u
            w = worst_rel(many["losses"], one)
            files = list(pathlib.Path(f"{d}/b{i}/checkpoint-6").glob("*.safetensors"))
            same_files = bool(files) and all((pathlib.Path(f"{d}/u{i}/checkpoint-6") / f.name).read_bytes() ==
                                             f.read_bytes() for f in files)
            print(f"tiny N=2 {' '.join(extra)}, {P} vocabulary pieces: worst relative loss difference to one process "
                  f"{w:.2e} (bound {tol:.2e}); --update-in-backward bit-identical {upd['losses'] == many['losses']}, "
                  f"{len(files)} saved tensor files identical {same_files}")
            if w > tol:
                failures.append(f"tiny N=2 {' '.join(extra)}: {w:.2e} > {tol:.2e}")
            if upd["losses"] != many["losses"] or not same_files:
                failures.append(f"tiny N=2 {' '.join(extra)}: --update-in-backward in pieces changes losses or files")
            plan_extra = [a for a in extra if a not in ("--compute-dtype", "--weight-dtype", "fp32", "bf16")]
            dt = ["--compute-dtype", extra[extra.index("--compute-dtype") + 1]]
            if "--weight-dtype" in extra:
                dt += ["--weight-dtype", extra[extra.index("--weight-dtype") + 1]]
            for label, r, more in (("usual", many, []), ("update", upd, ["--update-in-backward"])):
                p = json.loads(run([binary, "plan", "--model", "tiny", "--devices", "2", "--batch-per-device", "2",
                                    "--seq", "16", "--json", *plan_extra, *dt, *piece, *more]).stdout)
                print(f"  {label}: peaks {r['rank_peak_bytes']} planned {p['total_bytes']}")
                for rank, peak in enumerate(r["rank_peak_bytes"]):
                    if peak != p["total_bytes"]:
                        failures.append(f"tiny N=2 {' '.join(extra)} {label} rank {rank}: measured {peak} B, planned "
                                        f"{p['total_bytes']} B")
    # qwen3.5-tiny (the real vocabulary, 248,320 x 64, under a tiny body): the head is the step's peak, whole and in
    # pieces of 4 MiB (8 pieces), usual step, --update-in-backward and --prefetch: measured equals planned.
    MODELS["qwen3.5-tiny"] = ["--preset", "qwen3.5-tiny"]
    for vocab in ("0", "4MiB"):
        for extra in ([], ["--update-in-backward", "--clip", "0"], ["--prefetch"]):
            r = train(binary, 2, "qwen3.5-tiny", ["--steps", "2", "--batch", "4", "--vocab-piece-bytes", vocab, *extra])
            plan_extra = [a for a in extra if a not in ("--clip", "0")]
            p = json.loads(run([binary, "plan", "--model", "qwen3.5-tiny", "--devices", "2", "--batch-per-device", "2",
                                "--seq", "16", "--vocab-piece-bytes", vocab, "--json", *plan_extra]).stdout)
            print(f"qwen3.5-tiny N=2 --vocab-piece-bytes {vocab} {' '.join(extra) or '-'}: "
                  f"peaks {r['rank_peak_bytes']} planned {p['total_bytes']}")
            for rank, peak in enumerate(r["rank_peak_bytes"]):
                if peak != p["total_bytes"]:
                    failures.append(f"qwen3.5-tiny {vocab} {' '.join(extra)} rank {rank}: measured {peak} B, planned "
                                    f"{p['total_bytes']} B")
    del MODELS["qwen3.5-tiny"]
    return failures


def case_update(binary):
    """AdamW applied per gradient shard in the backward (--update-in-backward, --clip 0) against the usual step on the
    same ranks: the same losses to the bit, the same saved parameters and moments byte for byte (each rank updates
    its own shards; a save gathers them), also with the replica sum of 2 FSDP groups of 2 inside 4 ranks, and each
    rank's measured peak equal to the plan."""
    failures = []
    runs = [("tiny", 2, ["--remat", "sublayer", "--compute-dtype", "fp32"]),
            ("qwen3.5-L5", 2, ["--remat", "block", "--prefetch", "--gather-piece-bytes", "1"]),
            ("tiny", 4, ["--remat", "none", "--fsdp", "2", "--weight-dtype", "bf16"])]
    with tempfile.TemporaryDirectory() as d:
        for i, (model, n, extra) in enumerate(runs):
            common = ["--steps", "4", "--batch", str(2 * n), "--clip", "0", *extra]
            usual = train(binary, n, model, [*common, "--out", f"{d}/u{i}"])
            upd = train(binary, n, model, [*common, "--update-in-backward", "--out", f"{d}/b{i}"])
            same_files = all((pathlib.Path(f"{d}/u{i}/checkpoint-4") / f.name).read_bytes() == f.read_bytes()
                             for f in pathlib.Path(f"{d}/b{i}/checkpoint-4").glob("*.safetensors"))
            n_files = len(list(pathlib.Path(f"{d}/b{i}/checkpoint-4").glob("*.safetensors")))
            print(f"{model} N={n} {' '.join(extra)}: losses bit-identical {upd['losses'] == usual['losses']}, "
                  f"{n_files} saved tensor files identical {same_files}")
            if upd["losses"] != usual["losses"]:
                failures.append(f"{model} N={n}: --update-in-backward changes the losses")
            if not same_files or n_files == 0:
                failures.append(f"{model} N={n}: --update-in-backward changes the saved parameters or moments")
            fsdp = extra[extra.index("--fsdp") + 1] if "--fsdp" in extra else str(n)
            plan_extra = [a for a in extra if a not in ("--fsdp", fsdp)] + ["--fsdp", fsdp]
            p = json.loads(run([binary, "plan", "--model", MODELS[model][1], "--devices", str(n), "--batch-per-device",
                                "2", "--seq", "16", "--json", "--update-in-backward", *plan_extra]).stdout)
            for rank, peak in enumerate(upd["rank_peak_bytes"]):
                if peak != p["total_bytes"]:
                    failures.append(f"{model} N={n} update rank {rank}: measured {peak} B, planned {p['total_bytes']} B")
            print(f"  peaks {upd['rank_peak_bytes']} planned {p['total_bytes']} (usual step {usual['rank_peak_bytes'][0]})")
        # With expert parallelism the owners' expert gradients come back into the shards inside the MoE backward,
        # before the layer's shards reach the optimizer: the same bits again (memory: see case_expert).
        common = ["--steps", "4", "--batch", "4", "--clip", "0", "--remat", "sublayer", "--expert-parallel", "2"]
        usual = train(binary, 2, "tiny", [*common, "--out", f"{d}/ue"])
        upd = train(binary, 2, "tiny", [*common, "--update-in-backward", "--out", f"{d}/be"])
        files = list(pathlib.Path(f"{d}/be/checkpoint-4").glob("*.safetensors"))
        same_files = bool(files) and all((pathlib.Path(f"{d}/ue/checkpoint-4") / f.name).read_bytes() == f.read_bytes()
                                         for f in files)
        print(f"tiny N=2 --expert-parallel 2: losses bit-identical {upd['losses'] == usual['losses']}, "
              f"{len(files)} saved tensor files identical {same_files}")
        if upd["losses"] != usual["losses"] or not same_files:
            failures.append("tiny N=2 --expert-parallel 2: --update-in-backward changes the losses or parameters")
    return failures


def case_expert(binary):
    """--expert-parallel E: routed experts split over E ranks, the tokens' rows exchanged by all-to-all. The losses of
    20 fp32 steps agree with one process on the same global batch within 1e-6 relative (E = 2 on 2 ranks, E = 4 on 4,
    E = 2 on 4 ranks: two owners of each expert in one FSDP group, and in two FSDP groups of 2 with replicas), both
    families, top-2 of 4 experts and top-3 of 8; each rank's measured step peak equals `plan --devices N --expert-parallel E`; a
    checkpoint saved with E = 2 resumes on 1 process and on 4 ranks without expert parallelism on the same curve; E
    dividing neither the experts nor the group: a clear error before the first step."""
    failures = []
    for model, n, ep, extra in [("tiny", 2, 2, ["--remat", "sublayer"]), ("tiny", 4, 4, ["--remat", "none"]),
                                ("qwen3.5-L5", 4, 2, ["--remat", "block", "--prefetch"]),
                                ("tiny", 4, 2, ["--fsdp", "2", "--gather-piece-bytes", "1"])]:
        common = ["--steps", "20", "--batch", "4", "--compute-dtype", "fp32"]
        # One process with the same remat policy (the options about sharding do not apply to it).
        remat = extra[extra.index("--remat"):extra.index("--remat") + 2] if "--remat" in extra else []
        one = train(binary, 1, model, [*common, *remat])
        many = train(binary, n, model, [*common, *extra, "--expert-parallel", str(ep)])
        w = worst_rel(many["losses"], one["losses"])
        same = sum(x == y for x, y in zip(many["losses"], one["losses"]))
        print(f"{model} N={n} --expert-parallel {ep} {' '.join(extra)}: worst relative loss difference over 20 steps "
              f"{w:.2e}, {same}/20 steps bit-identical")
        if w > TOL["fp32"]:
            failures.append(f"{model} N={n} E={ep}: {w:.2e} > {TOL['fp32']}")
    # More experts and a larger top-k: Qwen3.5 L = 5 with 8 experts, top-3, on 4 ranks with E = 4 (two experts a rank,
    # one a piece, so the next piece's all-to-all is in flight while one computes).
    with tempfile.TemporaryDirectory() as d:
        cfg = json.loads((FIXTURES / "qwen3_5_L5" / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        text["num_experts"], text["num_experts_per_tok"] = 8, 3
        (pathlib.Path(d) / "config.json").write_text(json.dumps(cfg))
        MODELS["qwen3.5-L5-8x3"] = ["--config", d]
        common = ["--steps", "20", "--batch", "4", "--compute-dtype", "fp32"]
        one = train(binary, 1, "qwen3.5-L5-8x3", common)["losses"]
        many = train(binary, 4, "qwen3.5-L5-8x3", [*common, "--expert-parallel", "4", "--gather-piece-bytes", "1"])
        w = worst_rel(many["losses"], one)
        print(f"qwen3.5-L5 with 8 experts top-3, N=4 --expert-parallel 4, one expert a piece: worst relative loss "
              f"difference over 20 steps {w:.2e}")
        if w > TOL["fp32"]:
            failures.append(f"8 experts top-3 E=4: {w:.2e} > {TOL['fp32']}")
        del MODELS["qwen3.5-L5-8x3"]
    # The weights' dtype conversions on arrival (fp32 storage to bf16 compute, bf16 storage to fp32 compute): within
    # bf16's bound of one process, as without expert parallelism.
    for dtypes in (["--compute-dtype", "bf16"], ["--compute-dtype", "fp32", "--weight-dtype", "bf16"]):
        common = ["--steps", "10", "--batch", "4", *dtypes]
        one = train(binary, 1, "tiny", common)["losses"]
        many = train(binary, 2, "tiny", [*common, "--expert-parallel", "2"])["losses"]
        w = worst_rel(many, one)
        print(f"tiny N=2 --expert-parallel 2 {' '.join(dtypes)}: worst relative loss difference over 10 steps {w:.2e}")
        if w > TOL["bf16"]:
            failures.append(f"tiny E=2 {' '.join(dtypes)}: {w:.2e} > {TOL['bf16']}")
    # Memory: the measured per-rank step peak against the plan (balanced routing planned; a rank whose experts
    # receive more rows than it sends holds that many rows more).
    for model, n, ep, remat, dtype, extra in [("tiny", 2, 2, "sublayer", "fp32", []),
                                              ("tiny", 4, 2, "none", "bf16", ["--prefetch"]),
                                              ("qwen3.5-L5", 4, 4, "sublayer", "fp32", ["--gather-piece-bytes", "1"])]:
        r = train(binary, n, model, ["--steps", "2", "--batch", str(2 * n), "--remat", remat, "--compute-dtype", dtype,
                                     "--expert-parallel", str(ep), *extra])
        p = json.loads(run([binary, "plan", "--model", MODELS[model][1], "--devices", str(n), "--batch-per-device", "2",
                            "--seq", "16", "--remat", remat, "--compute-dtype", dtype, "--expert-parallel", str(ep),
                            "--json", *extra]).stdout)
        for rank, peak in enumerate(r["rank_peak_bytes"]):
            rel = abs(peak - p["total_bytes"]) / p["total_bytes"]
            print(f"{model} N={n} E={ep} {remat} {dtype} {' '.join(extra) or '-'} rank {rank}: measured {peak} B, "
                  f"planned {p['total_bytes']} B ({rel:.2e})")
            # Never below the plan: the owner's buffers hold at least the planned (balanced) rows.
            if rel > 0.01 or peak < p["total_bytes"]:
                failures.append(f"{model} N={n} E={ep} rank {rank}: {peak} vs plan {p['total_bytes']}")
    with tempfile.TemporaryDirectory() as d:
        common = ["--steps", "12", "--batch", "4", "--compute-dtype", "fp32"]
        full = train(binary, 1, "tiny", [*common, "--out", f"{d}/full"])["losses"]
        train(binary, 2, "tiny", [*common, "--out", f"{d}/a", "--stop-after", "6", "--expert-parallel", "2"])
        ck = f"{d}/a/checkpoint-6"
        for n in (1, 4):
            r = train(binary, n, "tiny", ["--resume", ck, "--steps", "12", "--out", f"{d}/r{n}"])["losses"]
            w = worst_rel(r, full[6:])
            print(f"saved by 2 ranks with --expert-parallel 2 at step 6, resumed on {n} without: {w:.2e}")
            if w > TOL["fp32"]:
                failures.append(f"EP checkpoint resumed on {n}: {w:.2e}")
        h2 = safetensors_header(f"{ck}/model.safetensors")
        train(binary, 1, "tiny", [*common, "--out", f"{d}/b", "--stop-after", "6"])
        h1 = safetensors_header(f"{d}/b/checkpoint-6/model.safetensors")
        if {k: (v["dtype"], v["shape"]) for k, v in h2.items()} != {k: (v["dtype"], v["shape"]) for k, v in h1.items()}:
            failures.append("the expert-parallel checkpoint's tensors differ from the 1-process one's")
    for n, extra, msg in [(4, ["--expert-parallel", "3"], "expert parallelism over 3 ranks must divide the FSDP group (4 ranks)"),
                          (4, ["--expert-parallel", "4", "--fsdp", "2"], "expert parallelism over 4 ranks must divide the FSDP group (2 ranks)"),
                          (1, ["--expert-parallel", "2"], "expert parallelism over 2 ranks needs that many processes")]:
        p = train(binary, n, "tiny", ["--steps", "1", "--batch", "4", *extra], check=False)
        if p.returncode == 0 or msg not in p.stderr:
            failures.append(f"{' '.join(extra)} on {n}: no clear error ({p.returncode}): {p.stderr[-300:]}")
    # --expert-parallel on one rank only: the mismatch is reported, not a hang in a communicator split.
    base = [binary, "train", "--preset", "tiny", "--synthetic", "--seq", "16", "--threads", "1", "--quiet",
            "--steps", "2", "--batch", "4"]
    p = run([MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", "1", *base, "--expert-parallel", "2", ":",
             "-np", "1", *base], check=False)
    if p.returncode == 0 or "other options or another model than rank 0" not in p.stderr:
        failures.append(f"--expert-parallel on rank 0 only: no clear error: {p.stderr[-400:]}")
    # Experts not divisible: a config with 6 experts on 4 ranks, E = 4.
    with tempfile.TemporaryDirectory() as d:
        cfg = json.loads((FIXTURES / "qwen3_5_L5" / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        text["num_experts"] = 6
        (pathlib.Path(d) / "config.json").write_text(json.dumps(cfg))
        p = run(mpirun(4, [binary, "train", "--config", d, "--synthetic", "--seq", "16", "--threads", "1", "--quiet",
                           "--steps", "1", "--batch", "4", "--expert-parallel", "4"]), check=False)
        if p.returncode == 0 or "expert parallelism over 4 ranks must divide the number of experts (6)" not in p.stderr:
            failures.append(f"6 experts over 4: no clear error ({p.returncode}): {p.stderr[-300:]}")
    return failures


def case_checkpoint(binary):
    failures = []
    with tempfile.TemporaryDirectory() as d:
        common = ["--steps", "12", "--batch", "4", "--compute-dtype", "fp32"]
        full = train(binary, 2, "tiny", [*common, "--out", f"{d}/full"])["losses"]
        train(binary, 2, "tiny", [*common, "--out", f"{d}/a", "--stop-after", "6"])
        ck = f"{d}/a/checkpoint-6"
        for n in (1, 2, 4):
            r = train(binary, n, "tiny", ["--resume", ck, "--steps", "12", "--compute-dtype", "fp32", "--out", f"{d}/r{n}"])["losses"]
            w = worst_rel(r, full[6:])
            print(f"saved by 2 ranks at step 6, resumed on {n}: worst relative loss difference {w:.2e}"
                  f"{' (bit-exact)' if r == full[6:] else ''}")
            if (n == 2 and r != full[6:]) or w > TOL["fp32"]:
                failures.append(f"resume on {n} ranks: {w:.2e}")
        # One format whatever the rank count: the files of a 1-process save and a 2-rank save name the same tensors
        # with the same shapes, and eval reads the 2-rank one.
        train(binary, 1, "tiny", [*common, "--out", f"{d}/b", "--stop-after", "6"])
        h2, h1 = safetensors_header(f"{ck}/model.safetensors"), safetensors_header(f"{d}/b/checkpoint-6/model.safetensors")
        if {k: (v["dtype"], v["shape"]) for k, v in h2.items()} != {k: (v["dtype"], v["shape"]) for k, v in h1.items()}:
            failures.append("the 2-rank checkpoint's tensors differ from the 1-process one's")
        text = pathlib.Path(d) / "text.txt"
        text.write_text("In the beginning God created the heaven and the earth. " * 20)
        e = run([binary, "eval", "--checkpoint", ck, "--text", str(text), "--seq", "16"], check=False)
        print("eval of the 2-rank checkpoint:", (e.stdout or e.stderr).strip().splitlines()[-1:])
        if e.returncode != 0:
            failures.append(f"eval cannot read a 2-rank checkpoint: {e.stderr[-300:]}")
    return failures


def case_faults(binary):
    failures = []
    with tempfile.TemporaryDirectory() as d:
        # A rank killed mid-run: the job stops, mpirun names the rank, no half-written checkpoint stays.
        args = [binary, "train", "--preset", "tiny", "--synthetic", "--seq", "16", "--threads", "1", "--quiet",
                "--steps", "100000", "--batch", "4", "--save-every", "5", "--out", f"{d}/k"]
        p = subprocess.Popen(mpirun(2, args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        victim = None
        for _ in range(600):
            time.sleep(0.1)
            victim = rank_pid(p.pid, 1)
            if victim and (pathlib.Path(d) / "k" / "checkpoint-5").exists():
                break
        if victim is None or not (pathlib.Path(d) / "k" / "checkpoint-5").exists():
            p.kill()
            return ["rank 1's process or its first checkpoint did not appear within 60 s"]
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        try:
            out, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            return ["the job did not stop after rank 1 was killed"]
        out_dir = pathlib.Path(d) / "k"
        left = sorted(x.name for x in out_dir.iterdir())

        def complete(name):  # the metrics, or a checkpoint whose rename into place happened
            return name == "metrics.jsonl" or (name.startswith("checkpoint-") and name.split("-")[1].isdigit()
                                               and (out_dir / name / "model.safetensors").exists())
        partial = [x for x in left if not complete(x)]
        print(f"rank 1 killed: exit {p.returncode}; mpirun says: "
              f"{[l.strip() for l in err.splitlines() if 'rank 1' in l][:1]}; left: {left}")
        if p.returncode == 0 or "rank 1" not in err:
            failures.append(f"killed rank: exit {p.returncode}, no message naming rank 1: {err[-500:]}")
        if partial:
            failures.append(f"half-written files left: {partial}")
        last = max((x for x in left if x.startswith("checkpoint-")), key=lambda x: int(x.split("-")[1]))
        r = train(binary, 2, "tiny", ["--resume", f"{d}/k/{last}", "--steps", str(int(last.split("-")[1]) + 2)],
                  check=False)
        if r.returncode != 0:
            failures.append(f"resume from the last complete checkpoint {last} failed: {r.stderr[-300:]}")
    failures += stopped_rank(binary)
    # Mismatched options: MPMD launch with a different --lr on rank 1.
    base = [binary, "train", "--preset", "tiny", "--synthetic", "--seq", "16", "--threads", "1", "--quiet",
            "--steps", "2", "--batch", "4"]
    p = run([MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", "1", *base, ":", "-np", "1", *base, "--lr",
             "0.5"], check=False)
    print("mismatched options:", [l for l in p.stderr.splitlines() if "other options" in l][:1])
    if p.returncode == 0 or "were started with other options or another model than rank 0 (rank 1 is one)" not in p.stderr:
        failures.append(f"mismatched options: no clear error: {p.stderr[-500:]}")
    # --prefetch changes the order of the collectives: one rank with it and one without must not start.
    p = run([MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", "1", *base, ":", "-np", "1", *base, "--prefetch"],
            check=False)
    if p.returncode == 0 or "(rank 1 is one)" not in p.stderr:
        failures.append(f"--prefetch on one rank only: no clear error: {p.stderr[-500:]}")
    p = train(binary, 2, "tiny", ["--steps", "1", "--batch", "3"], check=False)
    print("batch 3 on 2 ranks:", [l for l in p.stderr.splitlines() if "multiple" in l][:1])
    if p.returncode == 0 or "a global batch of 3 sequences must be a multiple of the 2 ranks" not in p.stderr:
        failures.append(f"batch 3 on 2 ranks: no clear error: {p.stderr[-500:]}")
    return failures


def stopped_rank(binary):
    """A rank that stops answering without dying (SIGSTOP): the watchdog of the waiting rank ends the job."""
    args = [binary, "train", "--preset", "tiny", "--synthetic", "--seq", "16", "--threads", "1", "--quiet",
            "--steps", "100000", "--batch", "4"]
    p = subprocess.Popen(mpirun(2, args), env=dict(ENV, HS_MPI_TIMEOUT_S="3"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    victim = None
    for _ in range(100):
        time.sleep(0.1)
        victim = rank_pid(p.pid, 1)
        if victim:
            break
    if victim is None:
        p.kill()
        return ["could not find rank 1's process"]
    time.sleep(1.0)
    os.kill(victim, signal.SIGSTOP)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(victim, signal.SIGKILL)
        p.kill()
        return ["the job did not stop after rank 1 stopped answering"]
    said = [l for l in err.splitlines() if "did not complete within" in l]
    print(f"rank 1 stopped (SIGSTOP): exit {p.returncode}; {said[:1]}")
    if p.returncode == 0 or not said:
        return [f"stopped rank: exit {p.returncode}, no watchdog message: {err[-500:]}"]
    return []


def safetensors_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def rank_pid(root, rank):
    """The pid of the hybridscan process of MPI rank `rank` under the mpirun process `root`."""
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"hybridscan" in cmd and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env and ancestor(int(proc.name), root):
            return int(proc.name)
    return None


def ancestor(pid, root):
    while pid > 1:
        if pid == root:
            return True
        try:
            pid = int((pathlib.Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def main():
    global MPIRUN
    binary, MPIRUN, case = sys.argv[1], sys.argv[2], sys.argv[3]
    t0 = time.time()
    failures = globals()["case_" + case](binary)
    print(f"{case}: {time.time() - t0:.1f} s")
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
    main()
