#!/usr/bin/env python3
"""Writes the reference files under tests/fixtures/safetensors/ with the Python `safetensors` library.

Run once by hand (needs safetensors, numpy, torch and huggingface_hub; torch only because numpy has no
bfloat16 or float8); the outputs are committed and tests/safetensors_test.cpp and tests/sharded_test.cpp
read them without Python. Every value follows a formula the C++ tests recompute (element i of the
flattened tensor), so a test checks the values, and writing the same tensors with the C++ writer must
reproduce these files byte for byte.

    python3 scripts/make_safetensors_fixtures.py
"""
import pathlib
import shutil

import numpy as np
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.numpy import save as save_numpy_bytes
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "safetensors"


def ramp(shape, dtype, fn):
    n = int(np.prod(shape)) if shape else 1
    return torch.tensor([fn(i) for i in range(n)], dtype=dtype).reshape(shape)


def raw_bytes(shape, dtype, fn):
    """Tensor of a dtype torch cannot fill from Python numbers, built from its raw bytes."""
    n = int(np.prod(shape))
    return torch.tensor([fn(i) for i in range(n)], dtype=torch.uint8).view(dtype).reshape(shape)


# Values the F16 -> F32 conversion must get exactly right: signed zero, the largest finite value, the
# smallest normal and subnormal, infinities and NaN.
F16_SPECIAL = [0.0, -0.0, 1.0, -2.5, 65504.0, 2.0**-14, 2.0**-24, float("inf"), float("-inf"), float("nan")]


def all_dtypes():
    return {
        "f64.scalar": ramp([], torch.float64, lambda i: -1.5),
        "f32.matrix": ramp([2, 3], torch.float32, lambda i: (i - 5) * 0.25),
        "f16.vector": ramp([5], torch.float16, lambda i: (i - 2) * 0.5),
        "f16.special": torch.tensor(F16_SPECIAL, dtype=torch.float16),
        "bf16.cube": ramp([2, 2, 3], torch.bfloat16, lambda i: (i - 7) * 0.5),
        "i64.vector": ramp([4], torch.int64, lambda i: (i - 2) * 3_000_000_000),
        "i32.empty": ramp([0, 3], torch.int32, lambda i: 0),
        "i16.vector": ramp([3], torch.int16, lambda i: (i - 1) * 1000),
        "i8.vector": ramp([7], torch.int8, lambda i: i - 5),
        "u8.vector": ramp([6], torch.uint8, lambda i: i * 3),
        "u16.vector": ramp([2], torch.uint16, lambda i: i * 1000 + 1),
        "u32.vector": ramp([2], torch.uint32, lambda i: i * 100_000 + 1),
        "u64.vector": ramp([2], torch.uint64, lambda i: i * 2**40 + 1),
        "bool.vector": ramp([5], torch.bool, lambda i: i % 3 == 0),
        "f8e4m3.vector": raw_bytes([4], torch.float8_e4m3fn, lambda i: i * 7),
        "f8e5m2.vector": raw_bytes([4], torch.float8_e5m2, lambda i: i * 5),
        # serde_json escapes the quote and the tab and keeps UTF-8 as is; the C++ writer must too.
        'odd "name"\twith é': ramp([1], torch.float32, lambda i: 42.0),
    }


def main():
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    save_torch(all_dtypes(), str(OUT / "all_dtypes.safetensors"), metadata={"format": "pt"})

    # No metadata at all; header lengths that need no padding and some that do.
    save_numpy(
        {"a": np.arange(3, dtype=np.float32), "b": np.arange(2, dtype=np.int16)},
        str(OUT / "no_metadata.safetensors"),
    )
    save_numpy({}, str(OUT / "empty.safetensors"))
    # A header whose JSON is already a multiple of 8 bytes long, so it gets no padding at all.
    for k in range(1, 9):
        tensors = {"x" * k: np.array([1.0], dtype=np.float64)}
        header = save_numpy_bytes(tensors)[8:].split(b"}}")[0]
        if (len(header) + 2) % 8 == 0:
            save_numpy(tensors, str(OUT / "unpadded.safetensors"))
            break

    # A sharded checkpoint as huggingface_hub writes it: eight F32 [4, 4] tensors (64 bytes each) in
    # shards of at most 200 bytes, so three per shard and three shards.
    state = {f"layers.{i}.weight": ramp([4, 4], torch.float32, lambda j, i=i: i * 100 + j) for i in range(8)}
    (OUT / "sharded").mkdir()
    save_torch_state_dict(state, str(OUT / "sharded"), max_shard_size=200)


if __name__ == "__main__":
    main()
