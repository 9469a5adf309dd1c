// Flash-style gated attention on the CPU. Work is cut into tiles of kTile queries x kTile keys; each
// tile is copied to fp32 scratch (transposed where a product needs it), padded with zeros to whole
// tiles and to a head size that is a multiple of 16, so the tile products need no edge cases.
//
// Forward: one task per (batch, query head, query tile) runs an online softmax over the key tiles up
// to the diagonal and keeps only the log-sum-exp of each row.
// Backward (flash-attention-2 recompute of P from the log-sum-exp, D = rowsum(dA * attn)) runs as two
// passes so that every gradient row has exactly one writer and the result is deterministic:
//   pass 1, one task per (batch, KV head, key tile): dK and dV of that tile over all query heads of
//           its group and all later query tiles;
//   pass 2, one task per (batch, query head, query tile): dQ of that tile over the earlier key tiles.
// That recomputes S and dP once more than an atomic / locked dQ would, in exchange for determinism and
// no synchronisation.
#include "kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace hs::kernels {
namespace {

constexpr int64_t kTile = 64;  // a 64 x 64 fp32 score tile is 16 KiB: it and its operands stay in L1/L2

// Explicit 16-lane vectors for the tile products: with -march=native GCC auto-vectorises with 256-bit
// vectors only, and these 512-bit ones (two FMA ports busy) double the products' throughput
// (measured ~90 -> ~185 GFLOP/s per core). Without AVX-512 the compiler splits them.
typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }

// C[8, 16*NV] (+)= op(A)[8, K] B[K, 16*NV]: 8 x NV accumulators live in registers across K.
template <bool kTransA, int NV>
inline void micro_kernel(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                         int64_t ldc, bool accumulate) {
  constexpr int kRows = 8;
  f32x16 acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = accumulate ? load16(C + r * ldc + 16 * j) : f32x16{};
  for (int64_t k = 0; k < K; ++k) {
    f32x16 b[NV];
    for (int j = 0; j < NV; ++j) b[j] = load16(B + k * ldb + 16 * j);
    for (int r = 0; r < kRows; ++r) {
      const float a = kTransA ? A[k * lda + r] : A[r * lda + k];
      for (int j = 0; j < NV; ++j) acc[r][j] += a * b[j];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < NV; ++j) store16(C + r * ldc + 16 * j, acc[r][j]);
}

// C[M, N] (+)= op(A)[M, K] B[K, N], all row-major; op(A) is A ([M, K], row stride lda) or, with
// kTransA, A^T where A is stored [K, M]. M is a multiple of 8 and N of 16 (tiles are padded).
template <bool kTransA>
void tile_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
               int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < M; i += 8) {
    const float* Ai = kTransA ? A + i : A + i * lda;
    float* Ci = C + i * ldc;
    int64_t j = 0;
    for (; j + 32 <= N; j += 32) micro_kernel<kTransA, 2>(K, Ai, lda, B + j, ldb, Ci + j, ldc, accumulate);
    if (j < N) micro_kernel<kTransA, 1>(K, Ai, lda, B + j, ldb, Ci + j, ldc, accumulate);
  }
}

// exp(x) in fp32 without a libm call so that the softmax loops vectorise: Cephes' expf (range
// reduction by ln 2 in two parts, degree-6 polynomial), within 1.4 ulp of exp on [-87, 0]; 0 below
// -87 (including -inf), which is where exp underflows anyway. Inputs here are <= 0 (minus a max).
inline float exp_approx(float x) {
  const float xc = std::clamp(x, -87.0f, 88.0f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * two_n;
}

inline float sum_row(const float* p) {  // sum of kTile floats
  f32x16 s = load16(p);
  for (int64_t j = 16; j < kTile; j += 16) s += load16(p + j);
  float total = 0;
  for (int l = 0; l < 16; ++l) total += s[l];
  return total;
}

// dst [kTile, hdp] <- n rows of hd values (row stride `stride`) times scale; the rest zero.
template <typename T>
void load_rows(float* dst, const T* src, int64_t stride, int64_t n, int64_t hd, int64_t hdp, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < hd; ++d) dst[i * hdp + d] = scale * to_f32(src[i * stride + d]);
    for (int64_t d = hd; d < hdp; ++d) dst[i * hdp + d] = 0.0f;
  }
  std::fill(dst + n * hdp, dst + kTile * hdp, 0.0f);
}

// dst [hdp, kTile] <- the transpose of n rows of hd values; the rest zero.
template <typename T>
void load_transposed(float* dst, const T* src, int64_t stride, int64_t n, int64_t hd, int64_t hdp) {
  std::fill(dst, dst + hdp * kTile, 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < hd; ++d) dst[d * kTile + j] = to_f32(src[j * stride + d]);
}

// Geometry shared by the passes.
struct Geometry {
  int64_t B, T, H, KVH, hd, hdp, group, tiles;
  float scale;
  explicit Geometry(const AttentionShape& s)
      : B(s.batch), T(s.seq), H(s.q_heads), KVH(s.kv_heads), hd(s.head_dim), hdp(round_up16(s.head_dim)),
        group(s.kv_heads > 0 ? s.q_heads / s.kv_heads : 0), tiles((s.seq + kTile - 1) / kTile),
        scale(1.0f / std::sqrt(static_cast<float>(s.head_dim))) {
    if (B < 0 || T < 0 || H <= 0 || KVH <= 0 || hd <= 0 || H % KVH != 0)
      throw std::invalid_argument("gated attention: need positive heads/head_dim with q_heads % kv_heads == 0");
  }
  int64_t q_row(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * H + h) * hd; }
  int64_t kv_row(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * KVH + h) * hd; }
  int64_t tile_len(int64_t tile) const { return std::min(kTile, T - tile * kTile); }
};

// Keys j < visible(i) of key tile kt are unmasked for query i of query tile qt (kt <= qt).
inline int64_t visible(int64_t qt, int64_t kt, int64_t i, int64_t nk) {
  return std::min(nk, (qt - kt) * kTile + i + 1);
}

// Scratch floats per thread (forward and backward use the same budget: six [kTile, hdp] tiles, two
// score tiles and two row vectors).
int64_t scratch_per_thread(const Geometry& g) { return 6 * kTile * g.hdp + 2 * kTile * kTile + 2 * kTile; }

// Turns the score tile S (in place) into P = exp(S - lse) and dP (in place) into dS = P * (dP - D),
// with masked entries and padded rows zero.
void probs_and_dscores(float* S, float* dP, const float* lse, const float* D, int64_t qt, int64_t kt, int64_t nq,
                       int64_t nk) {
  for (int64_t i = 0; i < kTile; ++i) {
    float* s = S + i * kTile;
    float* dp = dP + i * kTile;
    const int64_t vis = i < nq ? visible(qt, kt, i, nk) : 0;
    const float l = i < nq ? lse[i] : 0.0f, d = i < nq ? D[i] : 0.0f;
    for (int64_t j = 0; j < kTile; ++j) {
      const float p = j < vis ? exp_approx(s[j] - l) : 0.0f;
      s[j] = p;
      dp[j] = p * (dp[j] - d);
    }
  }
}

}  // namespace

template <typename T>
void gated_attention_forward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* gate,
                             T* out, AttentionSaved* saved, MemoryAccountant& mem) {
  const Geometry g(shape);
  if (saved) {
    saved->lse = mem.allocate_n<float>(static_cast<size_t>(g.B * g.H * g.T), MemCategory::Activations,
                                       "attention.lse");
    saved->attn = mem.allocate_n<T>(static_cast<size_t>(g.B * g.T * g.H * g.hd), MemCategory::Activations,
                                    "attention.attn");
  }
  const int nthreads = omp_get_max_threads();
  Buffer scratch = mem.allocate_n<float>(static_cast<size_t>(nthreads * scratch_per_thread(g)),
                                         MemCategory::Workspace, "attention.tiles");
  if (mem.planning()) return;
  float* lse_out = saved ? saved->lse.as<float>() : nullptr;
  T* attn_out = saved ? saved->attn.as<T>() : nullptr;
  const int64_t tasks = g.B * g.H * g.tiles;

#pragma omp parallel num_threads(nthreads)
  {
    float* Qs = scratch.as<float>() + omp_get_thread_num() * scratch_per_thread(g);
    float* Kt = Qs + kTile * g.hdp;
    float* V = Kt + kTile * g.hdp;
    float* O = V + kTile * g.hdp;
    float* S = O + kTile * g.hdp;
    float* m = S + kTile * kTile;
    float* l = m + kTile;
    // Longest tasks (last query tiles) first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t qt = g.tiles - 1 - task / (g.B * g.H), b = task % (g.B * g.H) / g.H, h = task % g.H;
      const int64_t kvh = h / g.group, q0 = qt * kTile, nq = g.tile_len(qt);
      load_rows(Qs, q + g.q_row(b, q0, h), g.H * g.hd, nq, g.hd, g.hdp, g.scale);
      std::fill(O, O + kTile * g.hdp, 0.0f);
      std::fill(m, m + kTile, -std::numeric_limits<float>::infinity());
      std::fill(l, l + kTile, 0.0f);
      for (int64_t kt = 0; kt <= qt; ++kt) {
        const int64_t k0 = kt * kTile, nk = g.tile_len(kt);
        load_transposed(Kt, k + g.kv_row(b, k0, kvh), g.KVH * g.hd, nk, g.hd, g.hdp);
        load_rows(V, v + g.kv_row(b, k0, kvh), g.KVH * g.hd, nk, g.hd, g.hdp, 1.0f);
        tile_gemm<false>(kTile, kTile, g.hdp, Qs, g.hdp, Kt, kTile, S, kTile, false);
        // Online softmax: rescale what was accumulated by exp(m_old - m_new), add this tile's P.
        for (int64_t i = 0; i < kTile; ++i) {
          float* s = S + i * kTile;
          const int64_t vis = i < nq ? visible(qt, kt, i, nk) : 0;
          if (vis == 0) {
            std::fill(s, s + kTile, 0.0f);
            continue;
          }
          float mx = m[i];
          for (int64_t j = 0; j < vis; ++j) mx = std::max(mx, s[j]);
          for (int64_t j = 0; j < kTile; ++j) s[j] = j < vis ? exp_approx(s[j] - mx) : 0.0f;
          const float corr = exp_approx(m[i] - mx);  // 0 on the first tile (m = -inf)
          l[i] = l[i] * corr + sum_row(s);
          m[i] = mx;
          if (corr != 1.0f)
            for (int64_t d = 0; d < g.hdp; ++d) O[i * g.hdp + d] *= corr;
        }
        tile_gemm<false>(kTile, g.hdp, kTile, S, kTile, V, g.hdp, O, g.hdp, true);
      }
      for (int64_t i = 0; i < nq; ++i) {
        const float inv_l = 1.0f / l[i];
        const int64_t row = g.q_row(b, q0 + i, h);
        for (int64_t d = 0; d < g.hd; ++d) {
          const float a = O[i * g.hdp + d] * inv_l;
          out[row + d] = from_f32<T>(a * sigmoidf(to_f32(gate[row + d])));
          if (attn_out) attn_out[row + d] = from_f32<T>(a);
        }
        if (lse_out) lse_out[(b * g.H + h) * g.T + q0 + i] = m[i] + std::log(l[i]);
      }
    }
  }
}

template <typename T>
void gated_attention_backward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* gate,
                              const AttentionSaved& saved, const float* dout, float* dq, float* dk, float* dv,
                              float* dgate, MemoryAccountant& mem) {
  const Geometry g(shape);
  // dA = dL/d(attn) = dout * sigmoid(gate) [B, T, H, hd] and D = rowsum(dA * attn) [B, H, T].
  Buffer dA_buf = mem.allocate_n<float>(static_cast<size_t>(g.B * g.T * g.H * g.hd), MemCategory::Workspace,
                                        "attention.d_attn");
  Buffer D_buf = mem.allocate_n<float>(static_cast<size_t>(g.B * g.H * g.T), MemCategory::Workspace,
                                       "attention.rowdot");
  const int nthreads = omp_get_max_threads();
  Buffer scratch = mem.allocate_n<float>(static_cast<size_t>(nthreads * scratch_per_thread(g)),
                                         MemCategory::Workspace, "attention.tiles");
  if (mem.planning()) return;
  float* dA = dA_buf.as<float>();
  float* D = D_buf.as<float>();
  const float* lse = saved.lse.as<float>();
  const T* attn = saved.attn.as<T>();

  // Pass 0: through the gate.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < g.B * g.T * g.H; ++r) {
    const int64_t o = r * g.hd;
    float rowdot = 0.0f;
    for (int64_t d = 0; d < g.hd; ++d) {
      const float sg = sigmoidf(to_f32(gate[o + d])), a = to_f32(attn[o + d]), go = dout[o + d];
      dgate[o + d] += go * a * sg * (1.0f - sg);
      dA[o + d] = go * sg;
      rowdot += dA[o + d] * a;
    }
    const int64_t h = r % g.H, bt = r / g.H;
    D[(bt / g.T * g.H + h) * g.T + bt % g.T] = rowdot;
  }

#pragma omp parallel num_threads(nthreads)
  {
    float* Qs = scratch.as<float>() + omp_get_thread_num() * scratch_per_thread(g);
    float* dAt = Qs + kTile * g.hdp;  // dA tile, rows
    float* Kt = dAt + kTile * g.hdp;  // keys transposed [hdp, kTile]
    float* Vt = Kt + kTile * g.hdp;   // values transposed
    float* X = Vt + kTile * g.hdp;    // pass 1: dK; pass 2: keys as rows
    float* Y = X + kTile * g.hdp;     // pass 1: dV; pass 2: dQ
    float* S = Y + kTile * g.hdp;
    float* dP = S + kTile * kTile;

    // Pass 1: dK, dV per key tile. Longest tasks (first key tiles) first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < g.B * g.KVH * g.tiles; ++task) {
      const int64_t kt = task / (g.B * g.KVH), b = task % (g.B * g.KVH) / g.KVH, kvh = task % g.KVH;
      const int64_t k0 = kt * kTile, nk = g.tile_len(kt);
      load_transposed(Kt, k + g.kv_row(b, k0, kvh), g.KVH * g.hd, nk, g.hd, g.hdp);
      load_transposed(Vt, v + g.kv_row(b, k0, kvh), g.KVH * g.hd, nk, g.hd, g.hdp);
      std::fill(X, X + 2 * kTile * g.hdp, 0.0f);
      for (int64_t h = kvh * g.group; h < (kvh + 1) * g.group; ++h)
        for (int64_t qt = kt; qt < g.tiles; ++qt) {
          const int64_t q0 = qt * kTile, nq = g.tile_len(qt);
          load_rows(Qs, q + g.q_row(b, q0, h), g.H * g.hd, nq, g.hd, g.hdp, g.scale);
          load_rows(dAt, dA + g.q_row(b, q0, h), g.H * g.hd, nq, g.hd, g.hdp, 1.0f);
          tile_gemm<false>(kTile, kTile, g.hdp, Qs, g.hdp, Kt, kTile, S, kTile, false);
          tile_gemm<false>(kTile, kTile, g.hdp, dAt, g.hdp, Vt, kTile, dP, kTile, false);
          const int64_t stats = (b * g.H + h) * g.T + q0;
          probs_and_dscores(S, dP, lse + stats, D + stats, qt, kt, nq, nk);
          tile_gemm<true>(kTile, g.hdp, kTile, S, kTile, dAt, g.hdp, Y, g.hdp, true);  // dV += P^T dA
          tile_gemm<true>(kTile, g.hdp, kTile, dP, kTile, Qs, g.hdp, X, g.hdp, true);  // dK += dS^T (q*scale)
        }
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t row = g.kv_row(b, k0 + j, kvh);
        for (int64_t d = 0; d < g.hd; ++d) {
          dk[row + d] += X[j * g.hdp + d];
          dv[row + d] += Y[j * g.hdp + d];
        }
      }
    }

    // Pass 2: dQ per query tile. Longest tasks (last query tiles) first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < g.B * g.H * g.tiles; ++task) {
      const int64_t qt = g.tiles - 1 - task / (g.B * g.H), b = task % (g.B * g.H) / g.H, h = task % g.H;
      const int64_t kvh = h / g.group, q0 = qt * kTile, nq = g.tile_len(qt);
      load_rows(Qs, q + g.q_row(b, q0, h), g.H * g.hd, nq, g.hd, g.hdp, g.scale);
      load_rows(dAt, dA + g.q_row(b, q0, h), g.H * g.hd, nq, g.hd, g.hdp, 1.0f);
      std::fill(Y, Y + kTile * g.hdp, 0.0f);
      const int64_t stats = (b * g.H + h) * g.T + q0;
      for (int64_t kt = 0; kt <= qt; ++kt) {
        const int64_t k0 = kt * kTile, nk = g.tile_len(kt);
        load_transposed(Kt, k + g.kv_row(b, k0, kvh), g.KVH * g.hd, nk, g.hd, g.hdp);
        load_transposed(Vt, v + g.kv_row(b, k0, kvh), g.KVH * g.hd, nk, g.hd, g.hdp);
        load_rows(X, k + g.kv_row(b, k0, kvh), g.KVH * g.hd, nk, g.hd, g.hdp, 1.0f);
        tile_gemm<false>(kTile, kTile, g.hdp, Qs, g.hdp, Kt, kTile, S, kTile, false);
        tile_gemm<false>(kTile, kTile, g.hdp, dAt, g.hdp, Vt, kTile, dP, kTile, false);
        probs_and_dscores(S, dP, lse + stats, D + stats, qt, kt, nq, nk);
        tile_gemm<false>(kTile, g.hdp, kTile, dP, kTile, X, g.hdp, Y, g.hdp, true);  // dQ/scale += dS K
      }
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t row = g.q_row(b, q0 + i, h);
        for (int64_t d = 0; d < g.hd; ++d) dq[row + d] += g.scale * Y[i * g.hdp + d];
      }
    }
  }
}

#define HS_INSTANTIATE(T)                                                                                         \
  template void gated_attention_forward<T>(const AttentionShape&, const T*, const T*, const T*, const T*, T*,     \
                                           AttentionSaved*, MemoryAccountant&);                                   \
  template void gated_attention_backward<T>(const AttentionShape&, const T*, const T*, const T*, const T*,        \
                                            const AttentionSaved&, const float*, float*, float*, float*, float*, \
                                            MemoryAccountant&);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

}  // namespace hs::kernels
