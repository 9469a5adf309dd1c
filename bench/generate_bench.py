#!/usr/bin/env python3
"""Helpers of bench/generate_bench.sh (generation speed: hybridscan vs llama.cpp vs transformers). Subcommands:

  models --out DIR --model small|real [--seed S]
      Writes a random-initialised Hugging Face checkpoint (config.json, model.safetensors in bf16, tokenizer.json):
      small: hybridscan's `small` preset as transformers' Qwen3NextForCausalLM (vocab 256) with a byte-level
             tokenizer.json of 256 tokens (id b = byte b, no merges), so llama.cpp's converter accepts it;
      real:  Qwen3_5MoeForCausalLM with the layer widths of qwen3.5-35b-a3b (hidden 2048, 16 q / 2 kv heads of 256,
             GDN 16 key / 32 value heads of 128, conv 4, experts of 512 and a shared expert of 512, the real Qwen3.5
             vocabulary of 248,320 and data/tokenizers/qwen3_5/tokenizer.json) but 4 layers and 16 experts top-8.
  convert --hf DIR --out FILE.gguf --llama-dir DIR
      llama.cpp's convert_hf_to_gguf.py --outtype bf16 with its vendored gguf-py. The 256-token byte vocabulary is
      not one of the converter's known pre-tokenizers (it recognises them by a hash of their output), so for it
      alone the pre-tokenizer is named "qwen2"; the bench feeds token ids, never text, through llama.cpp.
  prompts --vocab V --len N --count B --seed S
      B prompts of N token ids drawn uniformly from [0, V) (ids only: the same ids go to every engine), one line each.
  transformers --hf DIR --prompts FILE --batch B --new N --threads T [--rounds R]
      transformers' generate (greedy, bf16 weights, no stop) on the first B prompts, one call of N new tokens, each
      next-token choice time-stamped by a logits processor: prefill tokens/s (B x P over the time to the first
      choice: the prompts' forward) and decode tokens/s ((N-1) x B over the time from the first to the last choice).
  bound --hf DIR --batch B --context C --bandwidth BYTES_PER_S
      Bytes read per decode step (weights actually touched + state + KV at the context) and the tokens/s ceiling.
  check --hf DIR --name M --prompt IDS --engine NAME=[ids] ...
      Scores each engine's greedy tokens against transformers in fp32 (see cmd_check).
  report --results FILE.jsonl --out-json FILE --out-md FILE
      The table and the JSON of every figure, with the ratios hybridscan / llama.cpp and hybridscan / transformers.
"""
import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from byte_level import byte_tokenizer_json, llama_converter_for_byte_vocab  # noqa: E402


# ---------------------------------------------------------------------------------------------------------- models
def small_config(transformers):
    sys.path.insert(0, str(ROOT / "bench"))
    import torch_train_step  # the `small` preset, field for field

    c = torch_train_step.small_config(transformers)
    c.output_router_logits = False
    c.use_cache = True
    c.max_position_embeddings = 4096
    c.architectures = ["Qwen3NextForCausalLM"]
    return c


def real_config(transformers, layers=4, experts=16, top_k=8):
    interval = 4
    return transformers.Qwen3_5MoeTextConfig(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        full_attention_interval=interval,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        eos_token_id=248046,
        architectures=["Qwen3_5MoeForCausalLM"],
    )


def cmd_models(a):
    import torch
    import transformers

    torch.manual_seed(a.seed)
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: no fp32 copy of a 1.4B-parameter model
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.model == "small":
        model = transformers.Qwen3NextForCausalLM(small_config(transformers))
        (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False))
    else:
        model = transformers.Qwen3_5MoeForCausalLM(real_config(transformers))
        (out / "tokenizer.json").write_bytes((ROOT / "data/tokenizers/qwen3_5/tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="50GB")
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {type(model).__name__}, {n / 1e6:.1f}M parameters, bf16, seed {a.seed}")


# --------------------------------------------------------------------------------------------------------- convert
def cmd_convert(a):
    conv = llama_converter_for_byte_vocab(Path(a.llama_dir).resolve())  # `small`'s byte vocabulary
    # --no-mtp: these checkpoints have no multi-token-prediction head (the converter asserts one for Qwen3-Next).
    sys.argv = ["convert_hf_to_gguf.py", str(a.hf), "--outtype", "bf16", "--no-mtp", "--outfile", str(a.out)]
    conv.main()


# --------------------------------------------------------------------------------------------------------- prompts
def cmd_prompts(a):
    rng = random.Random(a.seed)
    for _ in range(a.count):
        print(",".join(str(rng.randrange(a.vocab)) for _ in range(a.len)))


def read_prompts(path, batch):
    rows = [[int(x) for x in line.split(",")] for line in Path(path).read_text().splitlines() if line.strip()]
    if len(rows) < batch:
        raise SystemExit(f"{path} holds {len(rows)} prompts, {batch} asked")
    return rows[:batch]


# ---------------------------------------------------------------------------------------------------- transformers
def cmd_transformers(a):
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.bfloat16)
    model.eval()
    prompts = read_prompts(a.prompts, a.batch)
    ids = torch.tensor(prompts, dtype=torch.long)  # all prompts have the same length: no padding
    gen = dict(do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)

    class Clock(transformers.LogitsProcessor):
        """Stamps each next-token choice: the first comes right after the prompt's forward."""
        times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def run(x, new):
        Clock.times = []
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                 min_new_tokens=new, logits_processor=transformers.LogitsProcessorList([Clock()]), **gen)
        return Clock.times[0] - t0, Clock.times[-1] - Clock.times[0], out

    run(ids[:, :8], 2)  # warm-up on a short prompt (allocations, oneDNN primitives)
    prefill, decode, tokens = [], [], None
    for _ in range(a.rounds):
        tp, td, out = run(ids, a.new)
        prefill.append(tp)
        decode.append(max(td, 1e-9))
        tokens = out[:, ids.shape[1]:].tolist()
    B, P = ids.shape
    print(json.dumps({
        "engine": "transformers", "batch": B, "prompt_tokens": P, "new_tokens": a.new, "threads": a.threads,
        "prefill_tokens_per_s": B * P / statistics.median(prefill),
        "decode_tokens_per_s": B * (a.new - 1) / statistics.median(decode),
        "prefill_seconds": prefill, "decode_seconds": decode, "tokens": tokens,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }))


# ----------------------------------------------------------------------------------------------------------- bound
def text_config(hf):
    cfg = json.loads((Path(hf) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def decode_bytes(c, batch, context, wbytes=2, state_bytes=4):
    """Bytes one decode step of `batch` sequences reads: every weight it touches once (the routed experts: the
    expected number of distinct experts the batch's tokens choose, uniform routing) and each sequence's state."""
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    types = c.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)]
    nk, nv, dk, dv = c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    qh, kvh, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    conv_dim = 2 * nk * dk + nv * dv
    E, k, I, S = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    experts_touched = E * (1 - (1 - k / E) ** batch)
    w = {"lm_head": V * H, "embedding_rows": batch * H, "final_norm": H}
    s = {"gdn_state": 0, "conv_window": 0, "kv_cache": 0}
    for t in types:
        w["norms"] = w.get("norms", 0) + 2 * H
        if t == "linear_attention":
            w["gdn"] = w.get("gdn", 0) + conv_dim * H + nv * dv * H + 2 * nv * H + conv_dim * c["linear_conv_kernel_dim"] + nv * dv * H + dv
            s["gdn_state"] += batch * nv * dk * dv * state_bytes * 2  # read and written
            s["conv_window"] += batch * conv_dim * (c["linear_conv_kernel_dim"] - 1) * wbytes
        else:
            w["attention"] = w.get("attention", 0) + qh * 2 * hd * H + 2 * kvh * hd * H + H * qh * hd + 2 * hd
            s["kv_cache"] += batch * 2 * kvh * hd * context * wbytes
        w["router"] = w.get("router", 0) + E * H
        w["shared_expert"] = w.get("shared_expert", 0) + 3 * S * H + H
        w["routed_experts"] = w.get("routed_experts", 0) + experts_touched * 3 * I * H
    wb = {n: v * wbytes for n, v in w.items()}
    return {"weights": wb, "state": s, "experts_touched_per_layer": experts_touched,
            "total": sum(wb.values()) + sum(s.values())}


def cmd_bound(a):
    d = decode_bytes(text_config(a.hf), a.batch, a.context)
    d["bandwidth_bytes_per_s"] = a.bandwidth
    d["ceiling_tokens_per_s"] = a.batch * a.bandwidth / d["total"]
    print(json.dumps(d))


# ---------------------------------------------------------------------------------------------------------- report
def cmd_report(a):
    rows = [json.loads(l) for l in Path(a.results).read_text().splitlines() if l.strip()]
    meta = next((r for r in rows if r.get("kind") == "meta"), {})
    runs = [r for r in rows if r.get("kind") == "run"]
    bounds = {(r["model"], r["batch"]): r for r in rows if r.get("kind") == "bound"}
    checks = [r for r in rows if r.get("kind") == "greedy_check"]
    figures = {}
    for r in runs:
        f = figures.setdefault((r["model"], r["batch"]), {}).setdefault(r["engine"], {"prefill": [], "decode": []})
        f["prefill"].append(r["prefill_tokens_per_s"])
        f["decode"].append(r["decode_tokens_per_s"])
    out = {"meta": meta, "results": [], "greedy_checks": checks}
    md = [f"Generation speed, {meta.get('threads', '?')} threads, prompt {meta.get('prompt_tokens', '?')} tokens, "
          f"{meta.get('new_tokens', '?')} new tokens, bf16 weights, median of {meta.get('rounds', '?')} rounds; "
          f"copy bandwidth {meta.get('bandwidth_bytes_per_s', 0) / 1e9:.2f} GB/s. Timings on a shared machine: only "
          "the same-run ratios mean much.", "",
          "| model | batch | engine | prefill tok/s | decode tok/s | decode / bandwidth ceiling | hs/llama prefill | hs/llama decode |",
          "|---|---|---|---|---|---|---|---|"]
    for (model, batch), engines in sorted(figures.items()):
        med = {e: {k: statistics.median(v) for k, v in f.items()} for e, f in engines.items()}
        bound = bounds.get((model, batch), {})
        ceiling = bound.get("ceiling_tokens_per_s")
        hs, ll = med.get("hybridscan"), med.get("llama.cpp")
        entry = {"model": model, "batch": batch, "engines": {}, "bound": bound}
        for e in ("hybridscan", "llama.cpp", "transformers"):
            if e not in med:
                continue
            m = med[e]
            frac = m["decode"] / ceiling if ceiling else None
            entry["engines"][e] = {"prefill_tokens_per_s": m["prefill"], "decode_tokens_per_s": m["decode"],
                                   "prefill_rounds": engines[e]["prefill"], "decode_rounds": engines[e]["decode"],
                                   "decode_fraction_of_ceiling": frac}
            rp = rd = ""
            if e == "hybridscan" and ll:
                rp, rd = f"{hs['prefill'] / ll['prefill']:.2f}x", f"{hs['decode'] / ll['decode']:.2f}x"
            md.append(f"| {model} | {batch} | {e} | {m['prefill']:.1f} | {m['decode']:.2f} | "
                      f"{'' if frac is None else f'{frac:.2f}'} | {rp} | {rd} |")
        for peer in ("llama.cpp", "transformers"):
            if hs and peer in med:
                entry[f"hybridscan_over_{peer}"] = {"prefill": hs["prefill"] / med[peer]["prefill"],
                                                     "decode": hs["decode"] / med[peer]["decode"]}
        out["results"].append(entry)
    md.append("")
    for (model, batch), b in sorted(bounds.items()):
        md.append(f"- {model}, batch {batch}: {b['total'] / 2**20:.1f} MiB read per decode step "
                  f"(weights {sum(b['weights'].values()) / 2**20:.1f} MiB, of which routed experts "
                  f"{b['weights'].get('routed_experts', 0) / 2**20:.1f} MiB ({b['experts_touched_per_layer']:.1f} "
                  f"experts/layer) and LM head {b['weights']['lm_head'] / 2**20:.1f} MiB; state and KV "
                  f"{sum(b['state'].values()) / 2**20:.2f} MiB) -> ceiling {b['ceiling_tokens_per_s']:.1f} tokens/s")
    for c in checks:
        parts = [f"{e} {v['agree_with_reference']} (largest margin {v['max_margin']:.3f}"
                 + (f", reference top-2 gap where it left: {v['reference_top2_gap_at_first_difference']:.3f}"
                    if v["reference_top2_gap_at_first_difference"] is not None else "") + ")"
                 for e, v in c["engines"].items()]
        md.append(f"- greedy check, {c['model']} ({len(c['prompt'])}-token prompt, {c['new_tokens']} new tokens; "
                  f"logit std {next(iter(c['engines'].values()))['logit_std']:.2f}): leading tokens equal to the fp32 "
                  f"reference's greedy tokens: " + "; ".join(parts))
    Path(a.out_json).write_text(json.dumps(out, indent=1))
    Path(a.out_md).write_text("\n".join(md) + "\n")
    print("\n".join(md))


def cmd_check(a):
    """Do the engines run the same model? The fp32 reference (transformers on the bf16 weights widened to fp32, so
    exact up to fp32 rounding) generates greedily from the prompt, and scores each engine's own greedy tokens by
    teacher forcing: the margin of step i is the reference's best logit minus the logit of the engine's token (0 when
    the engine chose the reference's argmax). bf16 engines may pick another token where the reference's top two are
    closer than bf16's error, and then continue from a different text; a margin well above that error would be a
    real disagreement (the wrong RoPE, norm or head order)."""
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32)
    model.eval()
    prompt = [int(x) for x in a.prompt.split(",")]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new,
                             min_new_tokens=a.new, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = ref[0, len(prompt):].tolist()
    row = {"kind": "greedy_check", "model": a.name, "prompt": prompt, "new_tokens": a.new, "reference": ref,
           "engines": {}}

    def score(tokens):
        seq = torch.tensor([prompt + tokens])
        with torch.inference_mode():
            logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float()
        top2 = logits.topk(2, dim=-1).values
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        return (top2[:, 0] - chosen).tolist(), (top2[:, 0] - top2[:, 1]).tolist(), logits.std().item()

    for spec in a.engine:
        name, toks = spec.split("=", 1)
        toks = json.loads(toks)[: a.new]
        margins, gaps, spread = score(toks)
        agree = 0
        while agree < min(len(toks), len(ref)) and toks[agree] == ref[agree]:
            agree += 1
        row["engines"][name] = {"tokens": toks, "agree_with_reference": agree, "max_margin": max(margins),
                                "margins": margins, "reference_top2_gap_at_first_difference":
                                gaps[agree] if agree < len(toks) else None, "logit_std": spread}
    print(json.dumps(row))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("models")
    p.add_argument("--out", required=True)
    p.add_argument("--model", choices=["small", "real"], required=True)
    p.add_argument("--seed", type=int, default=1)
    p = sub.add_parser("convert")
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--llama-dir", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--len", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--seed", type=int, default=7)
    p = sub.add_parser("transformers")
    p.add_argument("--hf", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p = sub.add_parser("bound")
    p.add_argument("--hf", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--bandwidth", type=float, required=True)
    p = sub.add_parser("report")
    p.add_argument("--results", required=True)
    p.add_argument("--out-json", required=True)
    p.add_argument("--out-md", required=True)
    p = sub.add_parser("check")
    p.add_argument("--hf", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine", action="append", default=[], help="NAME=[ids...]")
    a = ap.parse_args()
    {"models": cmd_models, "convert": cmd_convert, "prompts": cmd_prompts, "transformers": cmd_transformers,
     "bound": cmd_bound, "report": cmd_report, "check": cmd_check}[a.cmd](a)


if __name__ == "__main__":
    main()
