#!/usr/bin/env python3
"""The peer for bench/delta_rule_bench.cpp: the same chunked gated delta rule (chunk 64, WY form, as in
transformers' torch_chunk_gated_delta_rule and flash-linear-attention's naive chunk) in PyTorch on the CPU,
forward in torch and backward by autograd, on the same shapes. Prints, per shape and storage type, the best
of --reps steps:
  shape=<B>/<T>/<Hk>/<Hv>/<d> dtype=<f32|bf16> tokens_per_s=<x>
"""
import argparse
import time

import torch
import torch.nn.functional as F

CHUNK = 64
SHAPES = [(1, 2048, 2, 4, 64), (1, 1024, 16, 32, 128)]  # batch, seq, k_heads, v_heads, head dim


def chunk_gated_delta_rule(q, k, v, beta, g):
    """q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; beta, g [B, T, Hv]. Returns o [B, T, Hv, dv] (input dtype)."""
    B, T, Hk, _ = k.shape
    Hv = v.shape[2]
    r = Hv // Hk
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).float() for x in (q, k, v, beta, g))  # [B, H, T, ...]
    pad = (CHUNK - T % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (T + pad) // CHUNK
    q, k, v = (x.reshape(B, Hv, n, CHUNK, x.shape[-1]) for x in (q, k, v))
    beta, g = (x.reshape(B, Hv, n, CHUNK) for x in (beta, g))

    G = g.cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1)
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    A = ((kb @ k.transpose(-1, -2)) * D).tril(-1) + torch.eye(CHUNK)
    U = torch.linalg.solve_triangular(A, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, kb * G.exp().unsqueeze(-1), upper=False, unitriangular=True)
    P = (q @ k.transpose(-1, -2)) * D
    qg = q * G.exp().unsqueeze(-1)
    kd = k * (G[..., -1:] - G).exp().unsqueeze(-1)
    decay = G[..., -1].exp()[..., None, None]

    S = torch.zeros(B, Hv, k.shape[-1], v.shape[-1])
    outs = []
    # unbind rather than indexing per chunk: its backward is one stack, where n selects would each add a
    # full-size zero-filled gradient (O(n^2) traffic).
    for U_c, W_c, qg_c, P_c, kd_c, decay_c in zip(*(x.unbind(2) for x in (U, W, qg, P, kd, decay))):
        vn = U_c - W_c @ S
        outs.append(qg_c @ S + P_c @ vn)
        S = S * decay_c + kd_c.transpose(-1, -2) @ vn
    o = torch.stack(outs, dim=2).reshape(B, Hv, n * CHUNK, -1)[:, :, :T]
    return o.transpose(1, 2).contiguous()


def inputs(B, T, Hk, Hv, d, dtype):
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, T, Hk, d, generator=gen), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(B, T, Hk, d, generator=gen), dim=-1)
    v = torch.randn(B, T, Hv, d, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=gen))
    g = F.logsigmoid(torch.randn(B, T, Hv, generator=gen))
    d_o = torch.randn(B, T, Hv, d, generator=gen)
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    beta.requires_grad_()
    g.requires_grad_()
    return q, k, v, beta, g, d_o


def tokens_per_s(shape, dtype, reps):
    """Best of `reps` timed steps after one warm-up (shared machines are noisy)."""
    B, T = shape[0], shape[1]
    q, k, v, beta, g, d_o = inputs(*shape, dtype)
    best = float("inf")
    for i in range(reps + 1):
        for x in (q, k, v, beta, g):
            x.grad = None
        start = time.perf_counter()
        o = chunk_gated_delta_rule(q, k, v, beta, g)
        o.float().backward(d_o)
        if i > 0:
            best = min(best, time.perf_counter() - start)
    return B * T / best


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="timed steps per shape (best one reported)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for shape in SHAPES:
        for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            tps = tokens_per_s(shape, dtype, args.reps)
            print(f"shape={'/'.join(map(str, shape))} dtype={name} tokens_per_s={tps:.1f}", flush=True)


if __name__ == "__main__":
    main()
