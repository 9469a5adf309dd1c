#!/usr/bin/env python3
"""Loads a Hugging Face checkpoint directory (e.g. one exported by `hybridscan convert --format hf`) with
`transformers` on the CPU in fp32 and prints the same JSON as `hybridscan eval`: the mean cross-entropy of the
tokens, cut into windows of seq+1 tokens that overlap by one token, and bits per byte of the original text.

The tokens are, as for `hybridscan eval`: those of a token file (--data, docs/token_format.md), or the text encoded
by --tokenizer, else by the checkpoint's own tokenizer.json (with Hugging Face `tokenizers`), else the text's bytes.

    python3 scripts/check_hf_export.py --checkpoint runs/rt-hf --text data/kjv-heldout.txt --seq 256
    python3 scripts/check_hf_export.py --checkpoint runs/ft-hf --data runs/heldout.tok --seq 256
Needs torch and transformers (scripts/setup.sh --bench); CI does not run it.
"""
import argparse
import json
import math
import os
import struct

import torch
import transformers

from byte_level import bytes_to_unicode


def read_token_file(path):
    """The ids and the per-id byte lengths of a hybridscan token file."""
    with open(path, "rb") as f:
        head = f.read(72)
        if head[:8] != b"HSTOKENS":
            raise SystemExit(f"{path}: not a hybridscan token file")
        _, width, _, vocab, count = struct.unpack_from("<IIQqq", head, 8)
        lengths = struct.unpack(f"<{vocab}H", f.read(2 * vocab))
        f.seek((72 + 2 * vocab + 63) // 64 * 64)
        ids = list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", f.read(count * width)))
    return ids, lengths


def encode_text(path, tokenizer_path):
    """The text's ids and a function giving each id's byte length (1 per byte without a tokenizer)."""
    data = open(path, "rb").read()
    if not tokenizer_path:
        return list(data), lambda i: 1
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(tokenizer_path)
    ids = tok.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    eot = tok.token_to_id("<|endoftext|>")
    added = {t.content for t in tok.get_added_tokens_decoder().values()}

    def length(i):
        if i == eot:
            return 0  # as in token files: the separator stands for no text
        s = tok.id_to_token(i)
        return len(s.encode()) if s in added else sum(1 for c in s if c in byte_of)

    return ids, length


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text")
    src.add_argument("--data")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint's own, if it has one)")
    ap.add_argument("--seq", type=int, default=512)
    a = ap.parse_args()
    cfg = transformers.AutoConfig.from_pretrained(a.checkpoint)
    if getattr(cfg, "model_type", "").startswith("qwen3_5"):
        model = transformers.AutoModelForImageTextToText.from_pretrained(a.checkpoint, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32)
    model.eval()
    own = os.path.join(a.checkpoint, "tokenizer.json")
    tokenizer_path = a.tokenizer or (own if os.path.exists(own) else None)
    if a.data:
        data, lengths = read_token_file(a.data)
        length = lengths.__getitem__
    else:
        data, length = encode_text(a.text, tokenizer_path)
    total, count, text_bytes = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(data) - 1, a.seq):
            window = data[start:start + a.seq + 1]
            ids = torch.tensor([window[:-1]])
            logits = model(input_ids=ids).logits[0].float()
            target = torch.tensor(window[1:])
            n = len(target)
            total += torch.nn.functional.cross_entropy(logits[:n], target, reduction="sum").item()
            count += n
            text_bytes += sum(length(t) for t in window[1:])
    ce = total / count
    out = {"cross_entropy": ce, "tokens": count, "text_bytes": text_bytes,
           "bits_per_byte": total / math.log(2) / text_bytes, "checkpoint": a.checkpoint,
           "implementation": "transformers " + transformers.__version__}
    if tokenizer_path and not a.data:
        out["tokenizer"] = tokenizer_path
    print(json.dumps(out))


if __name__ == "__main__":
    main()
