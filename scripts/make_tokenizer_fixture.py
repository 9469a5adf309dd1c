#!/usr/bin/env python3
"""Writes the small tokenizer the token-data tests use: the first N ranks of the real Qwen3.5 vocabulary (a prefix of
a BPE rank list is itself a complete BPE: every token merges two of lower rank) with the same normalizer, split regex,
byte-level mapping and decoder, and <|endoftext|> as id N.

    scripts/make_tokenizer_fixture.py [SOURCE] [OUT] [N]
      SOURCE  data/tokenizers/qwen3_5/tokenizer.json (made by scripts/make_qwen_tokenizers.py)
      OUT     tests/fixtures/tokenizer/qwen3_5_320/tokenizer.json
      N       320
"""
import json
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
src = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "data/tokenizers/qwen3_5/tokenizer.json"
out = Path(sys.argv[2]) if len(sys.argv) > 2 else root / "tests/fixtures/tokenizer/qwen3_5_320/tokenizer.json"
n = int(sys.argv[3]) if len(sys.argv) > 3 else 320

j = json.loads(src.read_text(encoding="utf-8"))
vocab = {t: i for t, i in j["model"]["vocab"].items() if i < n}
merges = []
for m in j["model"]["merges"]:
    a, b = m if isinstance(m, list) else m.split(" ")
    if a in vocab and b in vocab and vocab.get(a + b, n) < n:
        merges.append([a, b])
eot = next(t for t in j["added_tokens"] if t["content"] == "<|endoftext|>")
j["model"]["vocab"] = vocab
j["model"]["merges"] = merges
j["added_tokens"] = [dict(eot, id=n)]
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(j, ensure_ascii=False, indent=None) + "\n", encoding="utf-8")

try:
    import tokenizers
except ImportError:
    sys.exit(0)
t = tokenizers.Tokenizer.from_file(str(out))
text = "In the beginning God created the heaven and the earth.<|endoftext|>Ünïcödé 123"
ids = t.encode(text, add_special_tokens=False).ids
assert t.decode(ids, skip_special_tokens=False) == text and n in ids and max(ids) <= n
print(f"wrote {out}: {len(vocab)} ranks, {len(merges)} merges, <|endoftext|> = {n}; {len(text)} chars -> {len(ids)} ids")
