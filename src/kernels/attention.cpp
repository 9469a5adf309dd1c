// Flash-style gated attention on the CPU. Work is cut into tiles of kTile queries x kTile keys.
//
// Each call first converts what the tile products read many times (k and v; in backward also q * scale
// and dA) to fp32 in a per-head layout [B, heads, Tp, hdp]: T padded to whole tiles, hd to a multiple
// of 16, padding zero. A tile is then one contiguous block that the products read in place, with no
// per-tile copies and no edge cases. This workspace is linear in T. Transposed operands are built once
// per task (its own query or key tile) in per-thread scratch.
//
// Where a task owns a query tile, scores are kept transposed, S^T [key, query], so the per-query
// softmax statistics (max, sum, lse, D) are vertical vector operations instead of reductions across
// lanes.
//
// Forward: one task per (batch, query head, query tile) runs an online softmax over the key tiles up
// to the diagonal and keeps only the log-sum-exp of each query.
// Backward (flash-attention-2: P recomputed from the log-sum-exp, D = rowsum(dA * attn)) runs as two
// passes so that every gradient row has exactly one writer and the result is deterministic:
//   pass 1, one task per (batch, KV head, key tile): dK and dV of that tile over all query heads of
//           its group and all later query tiles (scores [query, key]);
//   pass 2, one task per (batch, query head, query tile): dQ of that tile over the earlier key tiles
//           (scores [key, query]).
// That recomputes S and dP once more than an atomic or locked dQ would, in exchange for determinism and
// no synchronisation.
#include "kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "kernels/vec_math.h"

namespace hs::kernels {
namespace {

constexpr int64_t kTile = 64;  // a 64 x 64 fp32 score tile is 16 KiB: it and its operands stay in L1/L2

// Explicit 16-lane vectors (GCC/Clang vector extension) for the tile products: GCC's tuning for this
// CPU auto-vectorises with 256-bit vectors, and 512-bit ones double the products' throughput (measured
// ~90 -> ~185 GFLOP/s per core on 64 x 64 tiles). Without AVX-512 the compiler splits them.
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
  // Column blocks outside: a [K, 32] panel of B stays in L1 while the row blocks stream past it.
  for (int64_t j = 0; j < N; j += 32) {
    for (int64_t i = 0; i < M; i += 8) {
      const float* Ai = kTransA ? A + i : A + i * lda;
      if (j + 32 <= N)
        micro_kernel<kTransA, 2>(K, Ai, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);
      else
        micro_kernel<kTransA, 1>(K, Ai, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);
    }
  }
}

// Geometry shared by the passes.
struct Geometry {
  int64_t B, T, H, KVH, hd, hdp, group, tiles, Tp;
  float scale;
  explicit Geometry(const AttentionShape& s)
      : B(s.batch), T(s.seq), H(s.q_heads), KVH(s.kv_heads), hd(s.head_dim), hdp(round_up16(s.head_dim)),
        group(s.kv_heads > 0 ? s.q_heads / s.kv_heads : 0), tiles((s.seq + kTile - 1) / kTile),
        Tp(tiles * kTile), scale(1.0f / std::sqrt(static_cast<float>(s.head_dim))) {
    if (B < 0 || T < 0 || H <= 0 || KVH <= 0 || hd <= 0 || H % KVH != 0)
      throw std::invalid_argument("gated attention: need positive heads/head_dim with q_heads % kv_heads == 0");
  }
  // Offset of row t of head h in the caller's [B, T, heads, hd] layout.
  int64_t row(int64_t b, int64_t t, int64_t h, int64_t heads) const { return ((b * T + t) * heads + h) * hd; }
  // Offset of row t of head h in the padded fp32 layout [B, heads, Tp, hdp].
  int64_t padded(int64_t b, int64_t h, int64_t heads, int64_t t) const { return ((b * heads + h) * Tp + t) * hdp; }
  size_t padded_size(int64_t heads) const { return static_cast<size_t>(B * heads * Tp * hdp); }
  int64_t tile_len(int64_t tile) const { return std::min(kTile, T - tile * kTile); }
};

// dst [B, heads, Tp, hdp] fp32 <- src [B, T, heads, hd] * scale, padding zero.
template <typename T>
void to_padded(float* dst, const T* src, const Geometry& g, int64_t heads, float scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < g.B * heads * g.Tp; ++r) {
    const int64_t t = r % g.Tp, h = r / g.Tp % heads, b = r / g.Tp / heads;
    float* d = dst + r * g.hdp;
    const int64_t n = t < g.T ? g.hd : 0;
    const T* s = src + (t < g.T ? g.row(b, t, h, heads) : 0);
    for (int64_t i = 0; i < n; ++i) d[i] = scale * to_f32(s[i]);
    std::fill(d + n, d + g.hdp, 0.0f);
  }
}

// dst [hdp, kTile] <- the transpose of a padded tile [kTile, hdp].
void transpose_tile(float* dst, const float* src, int64_t hdp) {
  for (int64_t d = 0; d < hdp; ++d)
    for (int64_t j = 0; j < kTile; ++j) dst[d * kTile + j] = src[j * hdp + d];
}

// Query i of query tile qt sees keys j < visible_keys(...) of key tile kt (kt <= qt).
inline int64_t visible_keys(int64_t qt, int64_t kt, int64_t i, int64_t nk) {
  return std::min(nk, (qt - kt) * kTile + i + 1);
}
// Key j of key tile kt is seen by queries i >= first_query(...) of query tile qt (kt <= qt).
inline int64_t first_query(int64_t qt, int64_t kt, int64_t j) { return std::max<int64_t>(0, j - (qt - kt) * kTile); }

// Scratch floats per thread: four [kTile, hdp] tiles, two score tiles and four per-query vectors.
int64_t scratch_per_thread(const Geometry& g) { return 4 * kTile * g.hdp + 2 * kTile * kTile + 4 * kTile; }

// Scores as [query, key]: S <- P = exp(S - lse), dP <- dS = P * (dP - D); masked entries and padded
// rows become zero.
void probs_and_dscores(float* S, float* dP, const float* lse, const float* D, int64_t qt, int64_t kt, int64_t nq,
                       int64_t nk) {
  for (int64_t i = 0; i < kTile; ++i) {
    float* s = S + i * kTile;
    float* dp = dP + i * kTile;
    const int64_t vis = i < nq ? visible_keys(qt, kt, i, nk) : 0;
    const float l = i < nq ? lse[i] : 0.0f, d = i < nq ? D[i] : 0.0f;
    for (int64_t j = 0; j < kTile; ++j) {
      const float p = j < vis ? exp_vec(s[j] - l) : 0.0f;
      s[j] = p;
      dp[j] = p * (dp[j] - d);
    }
  }
}

// The same with scores as [key, query]; lse and D are per-query vectors whose padding is +inf and 0,
// which makes P zero in padded columns.
void probs_and_dscores_transposed(float* St, float* dPt, const float* lse, const float* D, int64_t qt, int64_t kt,
                                  int64_t nk) {
  for (int64_t j = 0; j < kTile; ++j) {
    float* s = St + j * kTile;
    float* dp = dPt + j * kTile;
    const int64_t first = j < nk ? first_query(qt, kt, j) : kTile;
    for (int64_t i = 0; i < kTile; ++i) {
      const float p = i >= first ? exp_vec(s[i] - lse[i]) : 0.0f;
      s[i] = p;
      dp[i] = p * (dp[i] - D[i]);
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
  Buffer k_buf = mem.allocate_n<float>(g.padded_size(g.KVH), MemCategory::Workspace, "attention.k_f32");
  Buffer v_buf = mem.allocate_n<float>(g.padded_size(g.KVH), MemCategory::Workspace, "attention.v_f32");
  const int nthreads = omp_get_max_threads();
  Buffer scratch = mem.allocate_n<float>(static_cast<size_t>(nthreads * scratch_per_thread(g)),
                                         MemCategory::Workspace, "attention.tiles");
  if (mem.planning()) return;
  float* kf = k_buf.as<float>();
  float* vf = v_buf.as<float>();
  to_padded(kf, k, g, g.KVH, 1.0f);
  to_padded(vf, v, g, g.KVH, 1.0f);
  float* lse_out = saved ? saved->lse.as<float>() : nullptr;
  T* attn_out = saved ? saved->attn.as<T>() : nullptr;
  const int64_t tasks = g.B * g.H * g.tiles;
  constexpr float kInf = std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(nthreads)
  {
    float* Qt = scratch.as<float>() + omp_get_thread_num() * scratch_per_thread(g);  // (q * scale)^T
    float* q_rows = Qt + kTile * g.hdp;  // q * scale, before the transpose
    float* O = q_rows + kTile * g.hdp;   // unnormalised output rows
    float* St = O + 2 * kTile * g.hdp;   // scores, then probabilities, [key, query]
    float* m = St + 2 * kTile * kTile;   // running max per query
    float* l = m + kTile;                // running sum per query
    float* m_new = l + kTile;
    float* corr = m_new + kTile;
    // Longest tasks (last query tiles) first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t qt = g.tiles - 1 - task / (g.B * g.H), b = task % (g.B * g.H) / g.H, h = task % g.H;
      const int64_t kvh = h / g.group, q0 = qt * kTile, nq = g.tile_len(qt);
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t n = i < nq ? g.hd : 0;
        const T* src = q + (i < nq ? g.row(b, q0 + i, h, g.H) : 0);
        for (int64_t d = 0; d < n; ++d) q_rows[i * g.hdp + d] = g.scale * to_f32(src[d]);
        std::fill(q_rows + i * g.hdp + n, q_rows + (i + 1) * g.hdp, 0.0f);
      }
      transpose_tile(Qt, q_rows, g.hdp);
      std::fill(O, O + kTile * g.hdp, 0.0f);
      std::fill(m, m + kTile, -kInf);
      std::fill(l, l + kTile, 0.0f);
      for (int64_t kt = 0; kt <= qt; ++kt) {
        const int64_t nk = g.tile_len(kt);
        const float* K = kf + g.padded(b, kvh, g.KVH, kt * kTile);
        const float* V = vf + g.padded(b, kvh, g.KVH, kt * kTile);
        tile_gemm<false>(kTile, kTile, g.hdp, K, g.hdp, Qt, kTile, St, kTile, false);
        // Mask padded keys and future keys. Every query column keeps a finite entry (key 0 of the first
        // tile, the diagonal for real queries), so the max is finite and no exp sees inf - inf.
        for (int64_t j = 0; j < kTile; ++j)
          std::fill(St + j * kTile, St + j * kTile + (j < nk ? first_query(qt, kt, j) : kTile), -kInf);
        // Online softmax, per query column: rescale what was accumulated by exp(m_old - m_new).
        std::copy(m, m + kTile, m_new);
        for (int64_t j = 0; j < kTile; ++j)
          for (int64_t i = 0; i < kTile; ++i) m_new[i] = std::max(m_new[i], St[j * kTile + i]);
        for (int64_t i = 0; i < kTile; ++i) {
          corr[i] = exp_vec(m[i] - m_new[i]);  // 0 on the first tile (m = -inf)
          l[i] *= corr[i];
          m[i] = m_new[i];
        }
        for (int64_t j = 0; j < kTile; ++j)
          for (int64_t i = 0; i < kTile; ++i) {
            const float p = exp_vec(St[j * kTile + i] - m[i]);
            St[j * kTile + i] = p;
            l[i] += p;
          }
        for (int64_t i = 0; i < kTile; ++i)
          if (corr[i] != 1.0f)
            for (int64_t d = 0; d < g.hdp; ++d) O[i * g.hdp + d] *= corr[i];
        tile_gemm<true>(kTile, g.hdp, kTile, St, kTile, V, g.hdp, O, g.hdp, true);  // O += P V
      }
      for (int64_t i = 0; i < nq; ++i) {
        const float inv_l = 1.0f / l[i];
        const int64_t row = g.row(b, q0 + i, h, g.H);
        for (int64_t d = 0; d < g.hd; ++d) {
          const float a = O[i * g.hdp + d] * inv_l;
          out[row + d] = from_f32<T>(a * sigmoid_vec(to_f32(gate[row + d])));
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
  Buffer q_buf = mem.allocate_n<float>(g.padded_size(g.H), MemCategory::Workspace, "attention.q_f32");
  Buffer k_buf = mem.allocate_n<float>(g.padded_size(g.KVH), MemCategory::Workspace, "attention.k_f32");
  Buffer v_buf = mem.allocate_n<float>(g.padded_size(g.KVH), MemCategory::Workspace, "attention.v_f32");
  // dA = dL/d(attn) = dout * sigmoid(gate), padded like q, and D = rowsum(dA * attn) [B, H, T].
  Buffer dA_buf = mem.allocate_n<float>(g.padded_size(g.H), MemCategory::Workspace, "attention.d_attn");
  Buffer D_buf = mem.allocate_n<float>(static_cast<size_t>(g.B * g.H * g.T), MemCategory::Workspace,
                                       "attention.rowdot");
  const int nthreads = omp_get_max_threads();
  Buffer scratch = mem.allocate_n<float>(static_cast<size_t>(nthreads * scratch_per_thread(g)),
                                         MemCategory::Workspace, "attention.tiles");
  if (mem.planning()) return;
  float* qf = q_buf.as<float>();  // q * scale
  float* kf = k_buf.as<float>();
  float* vf = v_buf.as<float>();
  float* dA = dA_buf.as<float>();
  float* D = D_buf.as<float>();
  const float* lse = saved.lse.as<float>();
  const T* attn = saved.attn.as<T>();
  to_padded(qf, q, g, g.H, g.scale);
  to_padded(kf, k, g, g.KVH, 1.0f);
  to_padded(vf, v, g, g.KVH, 1.0f);

  // Pass 0: through the gate.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < g.B * g.H * g.Tp; ++r) {
    const int64_t t = r % g.Tp, h = r / g.Tp % g.H, b = r / g.Tp / g.H;
    float* da = dA + r * g.hdp;
    std::fill(da, da + g.hdp, 0.0f);
    if (t >= g.T) continue;
    const int64_t o = g.row(b, t, h, g.H);
    float rowdot = 0.0f;
    for (int64_t d = 0; d < g.hd; ++d) {
      const float sg = sigmoid_vec(to_f32(gate[o + d])), a = to_f32(attn[o + d]), go = dout[o + d];
      dgate[o + d] += go * a * sg * (1.0f - sg);
      da[d] = go * sg;
      rowdot += da[d] * a;
    }
    D[(b * g.H + h) * g.T + t] = rowdot;
  }

#pragma omp parallel num_threads(nthreads)
  {
    float* tile0 = scratch.as<float>() + omp_get_thread_num() * scratch_per_thread(g);
    float* tile1 = tile0 + kTile * g.hdp;
    float* tile2 = tile1 + kTile * g.hdp;
    float* tile3 = tile2 + kTile * g.hdp;
    float* S = tile3 + kTile * g.hdp;
    float* dP = S + kTile * kTile;
    float* lse_t = dP + kTile * kTile;  // pass 2: this tile's lse and D, padded with +inf and 0
    float* D_t = lse_t + kTile;

    // Pass 1: dK, dV per key tile, scores [query, key]. Longest tasks (first key tiles) first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < g.B * g.KVH * g.tiles; ++task) {
      const int64_t kt = task / (g.B * g.KVH), b = task % (g.B * g.KVH) / g.KVH, kvh = task % g.KVH;
      const int64_t k0 = kt * kTile, nk = g.tile_len(kt);
      float* Kt = tile0;
      float* Vt = tile1;
      float* dK = tile2;
      float* dV = tile3;
      transpose_tile(Kt, kf + g.padded(b, kvh, g.KVH, k0), g.hdp);
      transpose_tile(Vt, vf + g.padded(b, kvh, g.KVH, k0), g.hdp);
      std::fill(dK, dK + 2 * kTile * g.hdp, 0.0f);
      for (int64_t h = kvh * g.group; h < (kvh + 1) * g.group; ++h)
        for (int64_t qt = kt; qt < g.tiles; ++qt) {
          const int64_t q0 = qt * kTile, nq = g.tile_len(qt);
          const float* Qs = qf + g.padded(b, h, g.H, q0);
          const float* dAq = dA + g.padded(b, h, g.H, q0);
          tile_gemm<false>(kTile, kTile, g.hdp, Qs, g.hdp, Kt, kTile, S, kTile, false);
          tile_gemm<false>(kTile, kTile, g.hdp, dAq, g.hdp, Vt, kTile, dP, kTile, false);
          const int64_t stats = (b * g.H + h) * g.T + q0;
          probs_and_dscores(S, dP, lse + stats, D + stats, qt, kt, nq, nk);
          tile_gemm<true>(kTile, g.hdp, kTile, S, kTile, dAq, g.hdp, dV, g.hdp, true);  // dV += P^T dA
          tile_gemm<true>(kTile, g.hdp, kTile, dP, kTile, Qs, g.hdp, dK, g.hdp, true);  // dK += dS^T (q*scale)
        }
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t row = g.row(b, k0 + j, kvh, g.KVH);
        for (int64_t d = 0; d < g.hd; ++d) {
          dk[row + d] += dK[j * g.hdp + d];
          dv[row + d] += dV[j * g.hdp + d];
        }
      }
    }

    // Pass 2: dQ per query tile, scores [key, query]. Longest tasks (last query tiles) first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < g.B * g.H * g.tiles; ++task) {
      const int64_t qt = g.tiles - 1 - task / (g.B * g.H), b = task % (g.B * g.H) / g.H, h = task % g.H;
      const int64_t kvh = h / g.group, q0 = qt * kTile, nq = g.tile_len(qt);
      float* Qst = tile0;  // (q * scale)^T
      float* dAt = tile1;  // dA^T
      float* dQ = tile2;   // dq / scale
      transpose_tile(Qst, qf + g.padded(b, h, g.H, q0), g.hdp);
      transpose_tile(dAt, dA + g.padded(b, h, g.H, q0), g.hdp);
      const int64_t stats = (b * g.H + h) * g.T + q0;
      for (int64_t i = 0; i < kTile; ++i) {
        lse_t[i] = i < nq ? lse[stats + i] : std::numeric_limits<float>::infinity();
        D_t[i] = i < nq ? D[stats + i] : 0.0f;
      }
      std::fill(dQ, dQ + kTile * g.hdp, 0.0f);
      for (int64_t kt = 0; kt <= qt; ++kt) {
        const int64_t nk = g.tile_len(kt);
        const float* K = kf + g.padded(b, kvh, g.KVH, kt * kTile);
        const float* V = vf + g.padded(b, kvh, g.KVH, kt * kTile);
        tile_gemm<false>(kTile, kTile, g.hdp, K, g.hdp, Qst, kTile, S, kTile, false);
        tile_gemm<false>(kTile, kTile, g.hdp, V, g.hdp, dAt, kTile, dP, kTile, false);
        probs_and_dscores_transposed(S, dP, lse_t, D_t, qt, kt, nk);
        tile_gemm<true>(kTile, g.hdp, kTile, dP, kTile, K, g.hdp, dQ, g.hdp, true);  // dQ += dS K
      }
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t row = g.row(b, q0 + i, h, g.H);
        for (int64_t d = 0; d < g.hd; ++d) dq[row + d] += g.scale * dQ[i * g.hdp + d];
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
