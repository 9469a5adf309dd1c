#!/usr/bin/env python3
"""The Python side of Tokenizer.NormalizerMatchesHuggingFaceOnEveryCombiningMark (tests/tokenizer_test.cpp):
Hugging Face `tokenizers`' own normalizers and ids for the strings the test wrote.

    normalizer_reference.py IN_FILE OUT_FILE TOKENIZER_JSON...

IN_FILE: the strings, UTF-8, one per line. OUT_FILE: JSON {"NFC": [...], "NFD": [...], "NFKC": [...], "NFKD": [...],
"ids": {TOKENIZER_JSON: [[id, ...] or null, ...]}}: each string as tokenizers.normalizers.NFC() (...) normalizes it,
and the ids of tokenizers.encode(string, add_special_tokens=False) for each tokenizer. The ids are null for a string
with a character unassigned in this Python's Unicode (14.0, that of PCRE2 10.42): there the split regex and not the
normalizer decides (docs/tokenizer.md), and the test does not compare them.
"""
import json
import sys
import unicodedata

import tokenizers
from tokenizers import normalizers

assert tokenizers.__version__ == "0.23.3", tokenizers.__version__


def main():
    src, out, *tokenizer_files = sys.argv[1:]
    with open(src, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    result = {}
    for name in ("NFC", "NFD", "NFKC", "NFKD"):
        n = getattr(normalizers, name)()
        result[name] = [n.normalize_str(s) for s in lines]
    result["ids"] = {}
    compared = [all(unicodedata.category(c) != "Cn" for c in s) for s in lines]
    for path in tokenizer_files:
        tok = tokenizers.Tokenizer.from_file(path)
        enc = tok.encode_batch(lines, add_special_tokens=False)
        result["ids"][path] = [e.ids if keep else None for e, keep in zip(enc, compared)]
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
