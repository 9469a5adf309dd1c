#!/usr/bin/env python3
"""Writes a token file (docs/token_format.md, version 1) of random documents for the byte-vocabulary presets (tiny,
small): ids 0..254 at random, documents of uniformly random lengths in [MIN, MAX], separated by id 255 (the
end-of-text id), TOKENS tokens in all. For packing A/Bs (bench/ab_train_step.sh with DATA=).

  bench/documents_token_file.py OUT [--tokens N] [--min MIN] [--max MAX] [--seed S]
"""
import argparse
import pathlib
import random
import struct

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--tokens", type=int, default=2_000_000)
ap.add_argument("--min", type=int, default=1)
ap.add_argument("--max", type=int, default=1000)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
vocab, eot = 256, 255
rng = random.Random(a.seed)
ids, docs = bytearray(), 0
while len(ids) // 2 < a.tokens:
    if docs:
        ids += struct.pack("<H", eot)
    n = rng.randint(a.min, a.max)
    ids += struct.pack(f"<{n}H", *(rng.randrange(eot) for _ in range(n)))
    docs += 1
tokens = len(ids) // 2
table = struct.pack(f"<{vocab}H", *([1] * (vocab - 1) + [0]))
fixed = b"HSTOKENS" + struct.pack("<IIQqqqqII", 1, 2, 0, vocab, tokens, docs, tokens - docs + 1, eot, 0)
h = 0xcbf29ce484222325
for byte in fixed + table:
    h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
head = fixed + struct.pack("<Q", h) + table
head += b"\0" * (-len(head) % 64)
pathlib.Path(a.out).write_bytes(head + bytes(ids))
print(f"{a.out}: {tokens} tokens, {docs} documents")
