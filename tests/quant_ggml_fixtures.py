#!/usr/bin/env python3
"""Writes tests/fixtures/quant/ggml_quantizers.bin, the fixture of QuantGgml.* (tests/quant_ggml_test.cpp): float
rows and the blocks libggml's reference quantizers (quantize_row_*_ref, what llama-quantize runs without an
importance matrix) make of them, for the types PyPI gguf cannot quantize (Q4_K, Q5_K, Q6_K, Q8_K) and Q4_0's all
negative-zero block, where the package and ggml part.

    quant_ggml_fixtures.py LIBGGML_BASE_SO [OUT]

LIBGGML_BASE_SO: libggml-base.so of a llama.cpp build (llama-cpp-python 0.3.36's vendored llama.cpp here).
OUT (little-endian): "HSQG", u32 case count, then per case: u32 ggml type id, u64 element count n, u32 label length,
the label, n fp32, u64 byte count, the blocks.
"""
import ctypes
import struct
import sys
from pathlib import Path

import numpy as np

TYPES = {"Q4_0": 2, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_K": 15}
BLOCK = {"Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292)}


def rows(rng):
    """Named inputs: Gaussian rows at several scales, heavy tails, and edge blocks."""
    out = []
    for scale in (1e-3, 1.0, 1e3):
        out.append((f"normal x {scale}", (rng.standard_normal(256 * 8) * scale).astype(np.float32)))
    out.append(("student-t 3", rng.standard_t(3, 256 * 8).astype(np.float32)))
    out.append(("uniform [0, 1)", rng.uniform(0, 1, 256 * 4).astype(np.float32)))  # min > 0: the fits' min clamp
    x = rng.standard_normal((8, 256)).astype(np.float32)
    x[0] = 0                                     # all zero
    x[1] = 3.0                                   # constant
    x[2, 17] = 1e4                               # one outlier
    x[3, :128] = 0                               # half empty: sub-blocks with zero scale keep the fit's levels
    x[4] = np.abs(x[4])                          # one sign
    x[5] = -np.abs(x[5])
    x[6] = x[6] * 1e-6
    x[7, ::2] = 0
    out.append(("edge blocks", x.reshape(-1)))
    return out


def main():
    lib = ctypes.CDLL(sys.argv[1])
    out_path = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).parent / "fixtures" / "quant" / "ggml_quantizers.bin"
    rng = np.random.default_rng(20261202)
    cases = []
    for name, tid in TYPES.items():
        fn = getattr(lib, f"quantize_row_{name.lower().replace('_k', '_K')}_ref")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
        inputs = rows(rng) if name != "Q4_0" else [("negative zeros only", np.full(64, -0.0, dtype=np.float32))]
        for label, x in inputs:
            x = np.ascontiguousarray(x, dtype=np.float32)
            elems, size = BLOCK[name]
            blocks = np.zeros(x.size // elems * size, dtype=np.uint8)
            fn(x.ctypes.data, blocks.ctypes.data, x.size)
            if name == "Q8_K":  # ggml leaves an all-zero block's bsums unwritten: zero them as we write them
                b = blocks.reshape(-1, size)
                d = b[:, :4].copy().view(np.float32).reshape(-1)
                b[d == 0, 260:] = 0
            cases.append((tid, f"{name}: {label}", x, blocks))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "wb") as f:
        f.write(b"HSQG" + struct.pack("<I", len(cases)))
        for tid, label, x, blocks in cases:
            lab = label.encode()
            f.write(struct.pack("<IQI", tid, x.size, len(lab)) + lab + x.tobytes())
            f.write(struct.pack("<Q", blocks.size) + blocks.tobytes())
    print(f"{out_path}: {len(cases)} cases, {out_path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
