#!/usr/bin/env python3
"""Helpers of bench/quant_quality.sh (PyPI gguf's GGUFReader; no llama.cpp needed).

    bench/quant_quality.py types FILE.gguf          one JSON line: the file's tensor types (how many tensors and
                                                    weights each), its bits per weight (tensor bytes x 8 / weights,
                                                    all tensors), and for each 2-D+ tensor its type
    bench/quant_quality.py same A.gguf B.gguf       one JSON line: the tensors both files hold, how many are byte-equal
                                                    (same type, same bytes), and the differing ones' names and types
    bench/quant_quality.py kld LOG                  one JSON line from llama-perplexity --kl-divergence's log: mean KLD
                                                    and its uncertainty, PPL(Q) and its uncertainty, same top p
    bench/quant_quality.py table RESULTS.jsonl      the markdown table of quant_quality.sh's rows
"""
import json
import math
import re
import sys
from collections import Counter

import numpy as np


def read(path):
    from gguf import GGUFReader
    return GGUFReader(path)


def types(path):
    r = read(path)
    count, weights = Counter(), Counter()
    total_bytes = total_weights = 0
    per_tensor = {}
    for t in r.tensors:
        n = int(np.prod(t.shape))
        name = t.tensor_type.name
        count[name] += 1
        weights[name] += n
        total_bytes += int(t.n_bytes)
        total_weights += n
        if len(t.shape) >= 2:
            per_tensor[t.name] = name
    return {"file": path, "bpw": 8 * total_bytes / total_weights, "weights": total_weights,
            "tensor_bytes": total_bytes,
            "types": {k: {"tensors": count[k], "weights": weights[k]} for k in sorted(count)},
            "matrices": per_tensor}


def same(a, b):
    ta = {t.name: t for t in read(a).tensors}
    tb = {t.name: t for t in read(b).tensors}
    common = sorted(set(ta) & set(tb))
    differ = []
    for n in common:
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or bytes(np.asarray(x.data).tobytes()) != bytes(np.asarray(y.data).tobytes()):
            differ.append({"name": n, "a": x.tensor_type.name, "b": y.tensor_type.name})
    return {"a": a, "b": b, "common": len(common), "only_a": sorted(set(ta) - set(tb)),
            "only_b": sorted(set(tb) - set(ta)), "byte_equal": len(common) - len(differ), "differ": differ}


def kld(log):
    text = open(log, encoding="utf-8", errors="replace").read()
    pm = r"\s*([-0-9.naninf]+)\s*±\s*([-0-9.naninf]+)"
    out = {}
    for key, pat in (("kld", r"Mean\s+KLD:" + pm), ("ppl", r"Mean PPL\(Q\)\s*:" + pm),
                     ("ppl_base", r"Mean PPL\(base\)\s*:" + pm), ("same_top", r"Same top p:" + pm)):
        m = re.search(pat, text)
        if not m:
            raise SystemExit(f"{log}: no '{key}' line (llama-perplexity failed?)")
        out[key], out[key + "_err"] = float(m.group(1)), float(m.group(2))
    return out


def table(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("| file | tensor types (tensors) | bits/weight | mean KL ± err | PPL (llama.cpp) | same top % | PPL (hybridscan eval) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ty = ", ".join(f"{k} {v['tensors']}" for k, v in r["types"].items())
        kl = "base" if r.get("kld") is None else f"{r['kld']:.6f} ± {r['kld_err']:.6f}"
        top = "" if r.get("same_top") is None else f"{r['same_top']:.3f} ± {r['same_top_err']:.3f}"
        ppl = f"{r['ppl']:.4f} ± {r['ppl_err']:.4f}" if r.get("ppl") is not None else ""
        ours = f"{math.exp(r['eval_ce']):.4f}" if r.get("eval_ce") is not None else ""
        print(f"| {r['name']} | {ty} | {r['bpw']:.3f} | {kl} | {ppl} | {top} | {ours} |")


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("types", "same", "kld", "table"):
        sys.exit(__doc__)
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "types":
        print(json.dumps(types(args[0])))
    elif cmd == "same":
        print(json.dumps(same(args[0], args[1])))
    elif cmd == "kld":
        print(json.dumps(kld(args[0])))
    else:
        table(args[0])


if __name__ == "__main__":
    main()
