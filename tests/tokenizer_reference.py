#!/usr/bin/env python3
"""The Python side of tests/tokenizer_test.cpp: a deterministic corpus of varied lines and the ids Hugging Face
`tokenizers` gives for each, computed now from the installed package.

    tokenizer_reference.py TOKENIZER_JSON OUT_FILE

OUT_FILE (little-endian): "HSTR", u32 line count, then per line u32 byte count, the raw bytes (possibly invalid
UTF-8), u32 flags, u32 id count, the ids as u32. Flag 0: a corpus line, and then all of them joined by "\\n" (the
parallel encoder's input); flag 1: a line with characters assigned after Unicode 14.0, where PCRE2 10.42 and HF's
Oniguruma are known to differ (not compared, only counted).
The ids of a line are those of tokenizers.encode(bytes.decode("utf-8", errors="replace"), add_special_tokens=False).
"""
import random
import struct
import sys
import unicodedata

import tokenizers

# Characters whose class differs between regex dialects or Unicode versions: every kind of space, line and
# paragraph separator, format characters that are not spaces, and file/group/record/unit separators.
TRICKY_SPACES = ["\u0085", "\u00a0", "\u1680", "\u180e", "\u2000", "\u2001", "\u2002", "\u2003", "\u2004",
                 "\u2005", "\u2006", "\u2007", "\u2008", "\u2009", "\u200a", "\u200b", "\u2028", "\u2029",
                 "\u202f", "\u205f", "\u3000", "\ufeff", "\u000b", "\u000c", "\u001c", "\u001d", "\u001e",
                 "\u001f", "\u2060", "\u200c", "\u200d", "\t", "\r", "\n", "\r\n", " "]

WORDS = {
    "en": "the quick brown fox jumps over lazy dog It's they'll we've I'm you'd she's DON'T WE'RE Hello world".split(),
    "de": "Größe Straße übermäßig Fußgänger Äpfel Öl schön Mädchen".split(),
    "fr": "élève garçon où déjà naïve cœur Noël français l'été aujourd'hui".split(),
    "zh": "我们 今天 天气 很好 中华人民共和国 北京 学习 机器 人工智能 语言模型".split(),
    "ja": "日本語 ひらがな カタカナ 東京 こんにちは ありがとう ｶﾀｶﾅ".split(),
    "ko": "한국어 안녕하세요 감사합니다 서울 대한민국".split(),
    "ar": "مرحبا بالعالم السلام عليكم العربية كتاب مدرسة ٱلْعَرَبِيَّة".split(),
    "he": "שלום עולם עברית ספר בית־ספר שָׁלוֹם".split(),
    "hi": "नमस्ते दुनिया हिन्दी भारत विद्यालय क्षत्रिय".split(),
    "th": "สวัสดี ภาษาไทย ประเทศไทย ขอบคุณครับ".split(),
    "ru": "Привет мир русский язык Москва ёлка ЁЖИК".split(),
    "el": "Γειά σου κόσμε Ελληνικά ΑΘΗΝΑ ά έ ή ΐ".split(),
    "ta": "வணக்கம் தமிழ் இந்தியா".split(),
    "am": "ሰላም ኢትዮጵያ አማርኛ".split(),
    "ka": "გამარჯობა საქართველო".split(),
    "hy": "Բարեւ Հայաստան".split(),
    "vi": "Tiếng Việt xin chào cảm ơn Hà Nội".split(),
    "my": "မင်္ဂလာပါ မြန်မာ".split(),
    "bn": "বাংলা নমস্কার".split(),
}
EMOJI = ["😀", "👍", "👍🏽", "👍🏿", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇯🇵", "🇺🇸", "🧑🏿‍💻", "👩🏻‍🔬", "1️⃣", "#️⃣", "🤷‍♀️",
         "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "🫠", "🪿", "☺", "✌🏼", "👁️‍🗨️", "🐕‍🦺"]
NUMBERS = ["0", "7", "42", "123", "2024", "3.14159", "1,000,000", "-17", "1e-9", "0x1F", "١٢٣", "४२", "๓๔", "一二三",
           "½", "²", "Ⅻ", "①", "𝟙𝟚", "٣.١٤", "99999999999"]
CODE = ["def f(x):", "    return x ** 2", "\tif (a && b) {", "c[i] = d->e;", "}", "#include <vector>",
        "for (int i = 0; i < n; ++i)", "x = {'a': 1, \"b\": [2, 3]}", "SELECT * FROM t WHERE id=1;",
        "fn main() -> Result<(), E> {", "λx.x", "std::vector<int> v{1,2};", "$ ls -la | grep '^d'",
        "<div class=\"x\">&amp;</div>", "a+=b<<2>>1", "print(f\"{x!r:>10}\")"]
COMBINING = ["e\u0301", "a\u0308", "o\u0302\u0323", "n\u0303", "\u1100\u1161\u11a8", "A\u030a", "i\u0307\u0301",
             "\u05e9\u05c1\u05b8", "\u0915\u094d\u0937", "x\u0338", "\u0061\u0328\u0301", "q\u0307\u0323",
             "\u0301\u0301", "\u0e01\u0e31\u0e49", ">\u0338", "=\u0338"]
SPECIALS2 = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|fim_prefix|>",
             "<|vision_pad|>", "<|im_start", "im_end|>", "<|extra_0|>"]
SPECIALS35 = SPECIALS2 + ["<tts_pad>", "<|audio_start|>", "<tts_text_bos_single>"]
CONTRACTIONS = ["'s", "'S", "'t", "'re", "'RE", "'ve", "'m", "'M", "'ll", "'LL", "'Ll", "'d", "'D", "'\u017f",
                "'\u212a", "'x", "''s", "'s'", " 's", "'\u0130"]
# Letters new in Unicode 14.0 (Arabic Extended-B, Latin Extended-F) and the ones beyond it: Unicode 15.0 (Kawi,
# Nag Mundari, CJK Extension H, Cyrillic Extended-D) and 16.0 (Egyptian Hieroglyphs Extended-A).
NEW_LETTERS = ["\u0870\u0871", "\U00010780"]
BEYOND_14 = ["\U00011f04\U00011f05", "\U0001e4d0\U0001e4d1", "\U00031350\U00031351", "\U0001e030", "\U00013460"]


def stable_everywhere(c):
    """Assigned in the Unicode 14.0 that PCRE2 10.42 and this Python know, or unassigned in every version up to
    16.0 (what HF's Oniguruma knows): noncharacters and planes 4-13. Characters assigned in 15.0 or 16.0 are letters
    to HF but unassigned to PCRE2, so they go to the version-sensitive lines instead."""
    o = ord(c)
    return (unicodedata.category(c) != "Cn" or 0xFDD0 <= o <= 0xFDEF or (o & 0xFFFE) == 0xFFFE
            or 0x40000 <= o <= 0xDFFFF)


def random_code_point(rng):
    ranges = [(0x20, 0x7e, 30), (0xa0, 0x24f, 8), (0x300, 0x36f, 6), (0x370, 0x52f, 5), (0x590, 0x6ff, 5),
              (0x900, 0x9ff, 4), (0xe00, 0xe7f, 3), (0x1100, 0x11ff, 3), (0x2000, 0x206f, 4), (0x3000, 0x30ff, 4),
              (0x4e00, 0x9fff, 8), (0xac00, 0xd7a3, 4), (0xe000, 0xf8ff, 1), (0xfb00, 0xfffd, 3),
              (0x10000, 0x1ffff, 4), (0x1f300, 0x1faff, 5), (0x20000, 0x3134f, 2), (0xe0000, 0xe01ef, 1),
              (0x0, 0x1f, 2), (0x80, 0x9f, 1), (0x40000, 0xdffff, 1), (0xfdd0, 0xfdef, 1)]
    lo, hi, _ = rng.choices(ranges, weights=[w for *_, w in ranges])[0]
    while True:
        c = rng.randint(lo, hi)
        if not 0xd800 <= c <= 0xdfff and stable_everywhere(chr(c)):
            return chr(c)


def fragment(rng, specials):
    kind = rng.random()
    if kind < 0.35:
        lang = rng.choice(list(WORDS))
        return " ".join(rng.choice(WORDS[lang]) for _ in range(rng.randint(1, 6)))
    if kind < 0.45:
        return rng.choice(NUMBERS)
    if kind < 0.55:
        return rng.choice(EMOJI) * rng.randint(1, 3)
    if kind < 0.63:
        return rng.choice(CODE)
    if kind < 0.71:
        return "".join(rng.choice(TRICKY_SPACES) for _ in range(rng.randint(1, 5)))
    if kind < 0.77:
        return rng.choice(COMBINING)
    if kind < 0.83:
        return rng.choice(specials)
    if kind < 0.89:
        return rng.choice(CONTRACTIONS)
    if kind < 0.90:
        return rng.choice(NEW_LETTERS)
    return "".join(random_code_point(rng) for _ in range(rng.randint(1, 8)))


def separator(rng):
    r = rng.random()
    if r < 0.6:
        return " "
    if r < 0.7:
        return ""
    if r < 0.8:
        return " " * rng.randint(2, 12)
    return rng.choice(TRICKY_SPACES)


def corrupt(rng, b: bytes) -> bytes:
    bad = [b"\x80", b"\xbf", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf",
           b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80", b"\xf5", b"\xff", b"\xfe", b"\xe2\x82", b"\xf0\x9f\x98",
           b"\xf0\x9f", b"\xc3", b"\xe4\xb8", b"\xe2\x28\xa1", b"\xf8\x88\x80\x80\x80"]
    out = bytearray(b)
    for _ in range(rng.randint(1, 4)):
        at = rng.randint(0, len(out))
        if rng.random() < 0.7:
            out[at:at] = rng.choice(bad)
        elif out:
            out[min(at, len(out) - 1)] = rng.randint(0x80, 0xff)
    return bytes(out)


def corpus(specials):
    rng = random.Random(20261201)
    lines = []
    fixed = [
        "", " ", "\n", "\r\n", "\t", "a", "  a", "a  ", "\n\n\nx", "x\r\n\r\ny", " \n \n x", "a\u00a0b", "a \u00a0b",
        "\u00a0\u00a0a", "a\u180eb", "a \u180e b", "\u180e\u180ex", "x\u200bx", "\ufeffBOM", "a\u2028b\u2029c",
        "a\u0085b", "a \u0085 b", "\u3000\u3000中", "a\u202fb\u205fc", "\u1680x", "\u001cx\u001dy\u001ez\u001f",
        "it's", "IT'S", "it\u2019s", "he'\u017f", "'\u212a", "<|endoftext|>", "<|endoftext|><|endoftext|>",
        "x<|im_start|>y", "<|im_start|>user\nhi<|im_end|>\n", "<|im_end|>\u0338", "<|im_end|\u0338",
        "e\u0301", "\u0301", "\u0301a", "\u1100\u1161", "\u1100\n\u1161", "a\n\u0301", "한\u11a8", "ﬁ ﬀ ℌ ㎏ ｱ",
        "    def f():\n        pass\n", "1234567890123456789", "  \t  \n\t\n", "x" * 1000, "🙂" * 300,
        " " * 20000 + "x", "\n" * 5000 + "y", "\t " * 3000, "ab" * 2000, "中" * 3000, "-" * 3000 + "a", "1" * 2500,
        "a" + "\u0301" * 500, "\r" * 100 + "\n", "x\r\r\n\ny", "'s's's's's", "don't can't won't", "\u0085" * 50,
        "\u3000" * 100 + "a", "\u200b" * 100, "\u0870" * 20, "\ufdd0's \U00050000's \U0010fffe's",
    ]
    for t in fixed:
        lines.append(t.encode("utf-8"))
    for s in specials:
        for t in (s, f"a{s}b", f" {s} ", f"\n{s}\n", f"{s}{s}", f"{s[:-1]}", f"x{s}\u0301", f"{s}\u00a0"):
            lines.append(t.encode("utf-8"))
    for sp in TRICKY_SPACES:
        for t in (f"a{sp}b", f"a {sp}b", f"a{sp} b", f"{sp}{sp}a", f"a{sp}", f"{sp}", f"1{sp}2", f".{sp}.",
                  f"a{sp}\nb", f"\n{sp}a", f"{sp}'s", f"中{sp}文", f"a{sp * 3}b"):
            lines.append(t.encode("utf-8"))
    for _ in range(6500):
        n = rng.randint(1, 12)
        t = "".join(fragment(rng, specials) + separator(rng) for _ in range(n))
        if rng.random() < 0.1:
            t = unicodedata.normalize("NFD", t)
        if rng.random() < 0.05:
            t = t.replace("\n", "\r\n")
        lines.append(t.encode("utf-8"))
    for _ in range(2000):
        lines.append("".join(random_code_point(rng) for _ in range(rng.randint(1, 40))).encode("utf-8"))
    valid = list(lines)
    for _ in range(1200):
        lines.append(corrupt(rng, rng.choice(valid)))
    for _ in range(20):
        lines.append("".join(fragment(rng, specials) + separator(rng) for _ in range(400)).encode("utf-8"))
    sensitive = [f"{c}{t}".encode("utf-8") for c in BEYOND_14 for t in ("'s", "-M", "_N", " x", c, "1")]
    return lines, sensitive


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    path, out = sys.argv[1], sys.argv[2]
    specials = SPECIALS35 if "qwen3_5" in path else SPECIALS2
    if unicodedata.unidata_version != "14.0.0":
        sys.exit(f"tokenizer_reference.py: this Python has Unicode {unicodedata.unidata_version}; the corpus keeps to "
                 "the characters PCRE2 10.42 knows (Unicode 14.0.0) by asking Python 3.11's unicodedata")
    lines, sensitive = corpus(specials)
    lines.append(b"\n".join(lines))
    flags = [0] * len(lines) + [1] * len(sensitive)
    lines += sensitive
    hf = tokenizers.Tokenizer.from_file(path)
    texts = [b.decode("utf-8", errors="replace") for b in lines]
    encodings = hf.encode_batch(texts, add_special_tokens=False)
    with open(out, "wb") as f:
        f.write(b"HSTR" + struct.pack("<I", len(lines)))
        for b, flag, e in zip(lines, flags, encodings):
            f.write(struct.pack("<I", len(b)) + b + struct.pack("<II", flag, len(e.ids)))
            f.write(struct.pack(f"<{len(e.ids)}I", *e.ids))


if __name__ == "__main__":
    main()
