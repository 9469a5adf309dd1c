#!/usr/bin/env python3
"""The Python side of tests/quant_format_test.cpp: blocks of every GGUF type the engine reads, with what PyPI
`gguf`'s gguf.quants.dequantize makes of them, and float rows with what gguf.quants.quantize makes of them (for the
types it can quantize), computed now from the installed package.

    quant_reference.py OUT_FILE

OUT_FILE (little-endian): "HSQR", u32 case count, then per case: u32 kind (0 dequantize, 1 quantize), u32 ggml type
id, u64 element count n, u32 label length and the label; kind 0: u64 byte count, the blocks, n fp32 (the expected
output); kind 1: n fp32 (the input), u64 byte count, the expected blocks.
"""
import struct
import sys

import numpy as np

np.seterr(all="ignore")  # the edge cases overflow and make NaNs on purpose
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

# Byte offsets of each type's fp16 scale fields within a block (ggml-common.h).
SCALE_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
# fp16 bit patterns at the edges: +-0, the smallest and largest subnormals, the smallest normal, 1, the largest
# finite, infinities and a NaN.
F16_EDGES = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00]
BF16_EDGES = [0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81]


def dequant_case(out, label, qtype, raw):
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.size // size * block
    expected = dequantize(raw.reshape(-1), qtype).astype(np.float32).reshape(-1)
    assert expected.size == n
    out.append((0, qtype, n, label, raw.tobytes(), expected.tobytes()))


def quant_case(out, label, qtype, x):
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(1, -1)
    blocks = quantize(x, qtype)
    out.append((1, qtype, x.size, label, x.tobytes(), np.ascontiguousarray(blocks).view(np.uint8).tobytes()))


def set_field(raw, offset, bits):
    raw[:, offset:offset + 2] = np.frombuffer(np.array(bits, dtype=np.uint16).tobytes(), dtype=np.uint8).reshape(-1, 2)


def main():
    rng = np.random.default_rng(20261202)
    cases = []
    for qtype, fields in SCALE_FIELDS.items():
        block, size = GGML_QUANT_SIZES[qtype]
        # Every byte random: scales of any fp16 value, infinities and NaNs included.
        dequant_case(cases, "random bytes", qtype, rng.integers(0, 256, (256, size), dtype=np.uint8))
        # Random quants with scales of a trained model's size.
        raw = rng.integers(0, 256, (256, size), dtype=np.uint8)
        for f in fields:
            set_field(raw, f, (rng.standard_normal(256) * 0.01).astype(np.float16).view(np.uint16))
        dequant_case(cases, "random quants, small scales", qtype, raw)
        # Each edge value in each scale field (the others random or an edge value too), quants all 0, all 0xFF, random.
        for f in fields:
            for fill in ("zeros", "ones", "random"):
                raw = rng.integers(0, 256, (len(F16_EDGES) ** len(fields), size), dtype=np.uint8)
                quants = np.ones(size, dtype=bool)
                for g in fields:
                    quants[g:g + 2] = False
                if fill != "random":
                    raw[:, quants] = 0 if fill == "zeros" else 0xFF
                if len(fields) == 1:
                    set_field(raw, f, F16_EDGES)
                else:  # every pair (d, dmin)
                    e = np.array(F16_EDGES, dtype=np.uint16)
                    set_field(raw, fields[0], np.repeat(e, len(e)))
                    set_field(raw, fields[1], np.tile(e, len(e)))
                dequant_case(cases, f"edge scales at byte {f}, quants {fill}", qtype, raw)
            if len(fields) > 1:
                break
    if True:  # Q6_K's signed 8-bit scales at -128 and 127
        raw = rng.integers(0, 256, (4, 210), dtype=np.uint8)
        raw[0, 192:208] = 0x80
        raw[1, 192:208] = 0x7F
        set_field(raw, 208, [0x7BFF, 0x7BFF, 0x0001, 0x8001])
        dequant_case(cases, "Q6_K extreme sub-block scales", T.Q6_K, raw)
    dequant_case(cases, "random", T.F16, rng.integers(0, 256, 2 * 1024, dtype=np.uint8))
    dequant_case(cases, "edges", T.F16, np.array(F16_EDGES, dtype=np.uint16).view(np.uint8))
    dequant_case(cases, "random", T.BF16, rng.integers(0, 256, 2 * 1024, dtype=np.uint8))
    dequant_case(cases, "edges", T.BF16, np.array(BF16_EDGES, dtype=np.uint16).view(np.uint8))
    dequant_case(cases, "random", T.F32, rng.standard_normal(256).astype(np.float32).view(np.uint8))

    # Quantizers the package implements: ggml's reference ones (Q8_0 and Q4_0 say so; F16 and BF16 round to even).
    for qtype in (T.Q8_0, T.Q4_0, T.F16, T.BF16):
        for scale in (1.0, 1e-3, 1e3):
            quant_case(cases, f"normal x {scale}", qtype, rng.standard_normal(32 * 256) * scale)
        quant_case(cases, "uniform", qtype, rng.uniform(-1, 1, 32 * 256))
        x = rng.standard_normal((64, 32)).astype(np.float32)
        x[0] = 0                              # an all-zero block
        x[1] = -1e-30                         # tiny values only: d rounds to fp16 zero
        x[2, 5] = 100                         # one outlier, positive
        x[3, 7] = -100                        # one outlier, negative (Q4_0 keeps the sign of the largest)
        x[4] = np.arange(32) - 15.5           # halves: ties in the rounding
        x[5] = np.linspace(-127, 127, 32)     # exact levels
        x[6, :16] = 2.0 ** -140               # subnormal floats beside normal ones
        x[7] = 3.0                            # constant block
        x[8, 3], x[8, 9] = 4.0, -4.0          # equal magnitudes of both signs: the first wins
        x[9] = 65504.0 * np.sign(x[9])        # fp16's largest
        x[10] = x[10] * 1e7                   # scales beyond fp16 (d rounds to inf)
        quant_case(cases, "edge blocks", qtype, x)
        quant_case(cases, "negative zeros only", qtype, np.full(32, -0.0))

    with open(sys.argv[1], "wb") as f:
        f.write(b"HSQR" + struct.pack("<I", len(cases)))
        for kind, qtype, n, label, a, b in cases:
            lab = f"{qtype.name}: {label}".encode()
            f.write(struct.pack("<IIQI", kind, int(qtype), n, len(lab)) + lab)
            if kind == 0:
                f.write(struct.pack("<Q", len(a)) + a + b)
            else:
                f.write(a + struct.pack("<Q", len(b)) + b)


if __name__ == "__main__":
    main()
