#!/usr/bin/env python3
"""Loads a Hugging Face checkpoint directory (e.g. one exported by `hybridscan convert --format hf`) with
`transformers` on the CPU in fp32 and prints the same JSON as `hybridscan eval`: the mean cross-entropy of the text's
bytes, cut into windows of seq+1 tokens that overlap by one token.

    python3 scripts/check_hf_export.py --checkpoint runs/rt-hf --text data/kjv-tail.txt --seq 256
Needs torch and transformers (pip install torch transformers); CI does not run it.
"""
import argparse
import json
import math

import torch
import transformers


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--seq", type=int, default=512)
    a = ap.parse_args()
    cfg = transformers.AutoConfig.from_pretrained(a.checkpoint)
    if getattr(cfg, "model_type", "").startswith("qwen3_5"):
        model = transformers.AutoModelForImageTextToText.from_pretrained(a.checkpoint, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32)
    model.eval()
    data = list(open(a.text, "rb").read())
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data) - 1, a.seq):
            window = data[start:start + a.seq + 1]
            ids = torch.tensor([window[:-1]])
            logits = model(input_ids=ids).logits[0].float()
            target = torch.tensor(window[1:])
            n = len(target)
            total += torch.nn.functional.cross_entropy(logits[:n], target, reduction="sum").item()
            count += n
    ce = total / count
    print(json.dumps({"cross_entropy": ce, "tokens": count, "bits_per_byte": ce / math.log(2), "checkpoint": a.checkpoint,
                      "implementation": "transformers " + transformers.__version__}))


if __name__ == "__main__":
    main()
