#!/usr/bin/env python3
"""Writes a tiny random Qwen3.5-MoE checkpoint in Hugging Face format that carries the real Qwen3.5 tokenizer, for
the fine-tuning demo in the README (train --init, eval, export, and transformers agreeing on the loss):

    python3 scripts/make_hf_tokenizer_model.py --out runs/hf-q35 [--tokenizer data/tokenizers/qwen3_5/tokenizer.json]

OUT gets config.json and model.safetensors from save_pretrained (the body of hybridscan's `tiny` preset, as the parity
fixtures use it, with the vocabulary padded to 248,320 as the released Qwen3.5 configs are) and tokenizer.json.
Needs torch and transformers (scripts/setup.sh --bench); CI does not run it.
"""
import argparse
import shutil
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_parity_fixtures as fx  # noqa: E402  (the tiny model's shapes)


def main():
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=str(root / "data/tokenizers/qwen3_5/tokenizer.json"))
    ap.add_argument("--vocab-size", type=int, default=248320)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    text = dict(fx.TINY_TEXT, vocab_size=a.vocab_size, num_hidden_layers=4, rope_parameters=dict(fx.ROPE, **fx.MROPE))
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=fx.TINY_VISION)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    shutil.copyfile(a.tokenizer, out / "tokenizer.json")
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: Qwen3.5-MoE, {n / 1e6:.1f}M parameters, vocab {a.vocab_size}, tokenizer {a.tokenizer}")


if __name__ == "__main__":
    main()
