#!/usr/bin/env python3
"""bench/gguf_logits.sh's comparison: hybridscan's and llama.cpp's logits of the same prompt on the same GGUF file.

  random --config CONFIG.json --out DIR
      A random-initialised Hugging Face checkpoint of that config (fp32; every weight, the zero-initialised norms and
      gates included, perturbed by N(0, 0.05^2) so that no transform is tested on zeros): the real-width model, which
      is too slow to train here.
  compare --file F --ours OURS.json --llama LLAMA.json
      One JSON line: positions, top-1 agreement (the share of positions where both engines' argmax is the same id),
      the largest absolute logit difference, the relative RMS difference, and the file's tensor types (gguf-py).
"""
import argparse
import collections
import json

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("random")
    r.add_argument("--config", required=True)
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("--file", required=True)
    c.add_argument("--ours", required=True)
    c.add_argument("--llama", required=True)
    a = ap.parse_args()
    if a.cmd == "random":
        import torch
        import transformers

        torch.manual_seed(0)
        cfg = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in json.load(open(a.config)).items()
                                                   if k not in ("model_type",)})
        model = transformers.Qwen3_5MoeForCausalLM(cfg).float()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(a.out)
        return
    ours = np.array(json.load(open(a.ours))["logits"], dtype=np.float64)
    llama = np.array(json.load(open(a.llama))["logits"], dtype=np.float64)
    assert ours.shape == llama.shape, (ours.shape, llama.shape)
    import gguf

    types = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(a.file).tensors)
    print(json.dumps({
        "file": a.file.rsplit("/", 1)[-1],
        "positions": int(ours.shape[0]),
        "top1_agreement": float(np.mean(ours.argmax(-1) == llama.argmax(-1))),
        "max_abs_diff": float(np.abs(ours - llama).max()),
        "rel_rms_diff": float(np.sqrt(((ours - llama) ** 2).sum() / (llama ** 2).sum())),
        "logit_rms": float(np.sqrt((llama ** 2).mean())),
        "tensor_types": dict(types),
    }))


if __name__ == "__main__":
    main()
