// Flash-style gated attention on the CPU. Work is cut into tiles of kTile queries x kTile keys.
//
// Products run in an operand element type E: fp32 for T = float, and bf16 (AVX512_BF16 dot products
// with fp32 accumulation, as flash-attention does in bf16) for T = bf16 where the CPU has them; the
// portable build runs the bf16 storage type through the fp32 products. Every product is
// C[M, N] (+)= A[M, K] B[K, N] with A row-major and B in the "B layout": row-major for fp32, and for
// bf16 pairs of K rows interleaved ([K/2, N, 2], what _mm512_dpbf16_ps multiplies), so the kernels need
// no transposed operand. Each call first packs q, k, v (and in backward dA = dL/d(attn)) once into the
// layouts its products read, padded to whole tiles (T to a multiple of kTile, hd to 16, padding zero);
// this workspace is linear in T. Scores are [query, key] throughout; the softmax scale is applied to the
// fp32 scores.
//
// Forward: one task per (batch, query head, query tile) runs an online softmax over the key tiles up
// to the diagonal and keeps only the log-sum-exp of each query.
// Backward (flash-attention-2: P recomputed from the log-sum-exp, D = rowsum(dA * attn)) is one pass
// over key tiles: a task owns (batch, KV head, a fixed chunk of key tiles), computes S, dP, P and dS once
// per (query head of the group, query tile, key tile), accumulates dK^T, dV^T of its key tile and dQ of
// every query tile into its own dQ partial; a last pass adds the partials in chunk order. The chunk count
// depends on the shape only (enough tasks for parallelism when batch * kv_heads is small), so the
// result is the same for any thread count. With one chunk (batch * kv_heads >= 8) a task sees all key
// tiles of its group and adds its dQ to dq itself, from a per-thread accumulator.
//
// With AVX512_BF16 the row loops around the products (softmax statistics, P = exp(...), dS, the gate
// step, the output rows) are explicit AVX-512 and write P and dS straight into the bf16 operand layouts;
// packing converts and transposes tiles with vector stores and 32-bit gathers. The portable loops below
// them remain for fp32 products and for builds without AVX512_BF16.
#include "kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "core/profile.h"
#include "kernels/simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HS_ATTENTION_BF16_DOT 1
#else
#define HS_ATTENTION_BF16_DOT 0
#endif
#if HS_ATTENTION_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HS_ATTENTION_AMX 1
#else
#define HS_ATTENTION_AMX 0
#endif

#include "kernels/vec_math.h"

namespace hs::kernels {
namespace {

constexpr int64_t kTile = 64;
constexpr int64_t kMaxRowSum = 256;  // the dQ reduction sums rows in blocks of this many floats  // a 64 x 64 fp32 score tile is 16 KiB: it and its operands stay in L1/L2

// The element type of the products for storage type T.
template <typename T>
struct ComputeType {
  using type = float;
};
#if HS_ATTENTION_BF16_DOT
template <>
struct ComputeType<bf16> {
  using type = bf16;
};
#endif

// K rows interleaved per 32-bit lane in the B layout.
template <typename E>
constexpr int64_t kPair = std::is_same_v<E, float> ? 1 : 2;

// Index of element (r, c) of a B operand with row length ld.
template <typename E>
inline int64_t b_index(int64_t r, int64_t c, int64_t ld) {
  if constexpr (kPair<E> == 1)
    return r * ld + c;
  else
    return (r / 2) * ld * 2 + c * 2 + (r & 1);
}

// Explicit 16-lane vectors (GCC/Clang vector extension) for the fp32 tile products: GCC's tuning for this
// CPU auto-vectorises with 256-bit vectors, and 512-bit ones double the products' throughput (measured
// ~90 -> ~185 GFLOP/s per core on 64 x 64 tiles). Without AVX-512 the compiler splits them.
typedef float f32x16 __attribute__((vector_size(64)));

// Vectors go through references, never by value (that would be ABI-dependent: -Wpsabi without AVX-512).
inline void load16(f32x16& v, const float* p) { std::memcpy(&v, p, sizeof v); }
inline void store16(float* p, const f32x16& v) { std::memcpy(p, &v, sizeof v); }

int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }

// C[8, 16*NV] (+)= A[8, K] B[K, 16*NV], fp32: 8 x NV accumulators live in registers across K.
template <int NV>
inline void micro_kernel(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                         int64_t ldc, bool accumulate) {
  constexpr int kRows = 8;
  f32x16 acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < NV; ++j) {
      acc[r][j] = f32x16{};
      if (accumulate) load16(acc[r][j], C + r * ldc + 16 * j);
    }
  for (int64_t k = 0; k < K; ++k) {
    f32x16 b[NV];
    for (int j = 0; j < NV; ++j) load16(b[j], B + k * ldb + 16 * j);
    for (int r = 0; r < kRows; ++r) {
      const float a = A[r * lda + k];
      for (int j = 0; j < NV; ++j) acc[r][j] += a * b[j];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < NV; ++j) store16(C + r * ldc + 16 * j, acc[r][j]);
}

#if HS_ATTENTION_BF16_DOT
// The same with bf16 operands: each step multiplies a pair of K (A's two adjacent elements broadcast,
// B's interleaved pair rows) into fp32 accumulators.
template <int NV>
inline void micro_kernel(int64_t K, const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float* C,
                         int64_t ldc, bool accumulate) {
  constexpr int kRows = 8;
  __m512 acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * j) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh b[NV];
    for (int j = 0; j < NV; ++j) b[j] = (__m512bh)_mm512_loadu_si512(B + k * ldb + 32 * j);
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + k, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(C + r * ldc + 16 * j, acc[r][j]);
}
#endif

// AMX (bf16 tile products): the operand layouts above are exactly what TDPBF16PS reads (A rows of 32
// bf16, B pairs of rows interleaved). Linux hands out the AMX register state only on request; where that
// fails the AVX512_BF16 kernels run instead (a property of the machine, so results stay deterministic).
#if HS_ATTENTION_AMX
bool amx_available() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Tiles 0-3: C blocks [16, 16] fp32; 4-5: A [16 rows, 32 bf16]; 6-7: B [16 pair rows, 16 x 2 bf16].
struct AmxScope {
  bool on;
  AmxScope() : on(amx_available()) {
    if (!on) return;
    alignas(64) unsigned char cfg[64] = {};
    cfg[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
      const uint16_t colsb = 64;
      std::memcpy(cfg + 16 + 2 * t, &colsb, sizeof colsb);
      cfg[48 + t] = 16;
    }
    _tile_loadconfig(cfg);
  }
  ~AmxScope() {
    if (on) _tile_release();
  }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
};

// C[M, N] (+)= A[M, K] B[K, N] with M, N multiples of 32 and K of 32, in 32 x 32 blocks of 2 x 2 tiles.
void amx_gemm(int64_t M, int64_t N, int64_t K, const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float* C,
              int64_t ldc, bool accumulate) {
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;  // row strides in bytes
  for (int64_t i = 0; i < M; i += 32)
    for (int64_t j = 0; j < N; j += 32) {
      float* c = C + i * ldc + j;
      if (accumulate) {
        _tile_loadd(0, c, sc);
        _tile_loadd(1, c + 16, sc);
        _tile_loadd(2, c + 16 * ldc, sc);
        _tile_loadd(3, c + 16 * ldc + 16, sc);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k = 0; k < K; k += 32) {
        const bf16* a = A + i * lda + k;
        const bf16* b = B + k * ldb + 2 * j;  // pair row k / 2
        _tile_loadd(4, a, sa);
        _tile_loadd(5, a + 16 * lda, sa);
        _tile_loadd(6, b, sb);
        _tile_loadd(7, b + 32, sb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, sc);
      _tile_stored(1, c + 16, sc);
      _tile_stored(2, c + 16 * ldc, sc);
      _tile_stored(3, c + 16 * ldc + 16, sc);
    }
}
#else
struct AmxScope {};
#endif

// C[M, N] (+)= A[M, K] B[K, N]: A row-major (row stride lda), B in the B layout with row length ldb
// (pointing at its column 0 of row 0). M is a multiple of 8, N of 16 and K of 2 (tiles are padded);
// for bf16 all three are multiples of 32 (hd is padded to 32 there).
template <typename E>
void tile_gemm(int64_t M, int64_t N, int64_t K, const E* A, int64_t lda, const E* B, int64_t ldb, float* C,
               int64_t ldc, bool accumulate) {
#if HS_ATTENTION_AMX
  if constexpr (std::is_same_v<E, bf16>) {
    if (amx_available()) return amx_gemm(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
  }
#endif
  // Column blocks outside: a [K, 32] panel of B stays in L1 while the row blocks stream past it.
  for (int64_t j = 0; j < N; j += 32) {
    for (int64_t i = 0; i < M; i += 8) {
      if (j + 32 <= N)
        micro_kernel<2>(K, A + i * lda, lda, B + j * kPair<E>, ldb, C + i * ldc + j, ldc, accumulate);
      else
        micro_kernel<1>(K, A + i * lda, lda, B + j * kPair<E>, ldb, C + i * ldc + j, ldc, accumulate);
    }
  }
}

// fp32 tile [kTile, kTile] -> the operand layouts. For fp32 both are the tile itself (returned as is);
// for bf16 they are rounded (round to nearest even) into dst.
template <typename E>
const E* as_rows(const float* src, E* dst) {
  if constexpr (std::is_same_v<E, float>) {
    return src;
  } else {
#if HS_ATTENTION_BF16_DOT
    for (int64_t i = 0; i < kTile * kTile; i += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
      _mm512_storeu_si512(dst + i, (__m512i)v);
    }
#endif
    return dst;
  }
}
template <typename E>
const E* as_b_operand(const float* src, E* dst) {
  if constexpr (std::is_same_v<E, float>) {
    return src;
  } else {
#if HS_ATTENTION_BF16_DOT
    // Rows 2p and 2p+1 interleaved: lane 2n <- row 2p's n, lane 2n+1 <- row 2p+1's n.
    alignas(64) static constexpr uint16_t kIdx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i idx = _mm512_load_si512(kIdx);
    for (int64_t p = 0; p < kTile / 2; ++p)
      for (int64_t v = 0; v < kTile; v += 16) {
        const __m512bh c = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + (2 * p + 1) * kTile + v),
                                               _mm512_loadu_ps(src + 2 * p * kTile + v));
        _mm512_storeu_si512(dst + p * 2 * kTile + 2 * v, _mm512_permutexvar_epi16(idx, (__m512i)c));
      }
#endif
    return dst;
  }
}

template <typename E>
inline E to_e(float x) {
  return from_f32<E>(x);
}

#if HS_ATTENTION_BF16_DOT
// AVX-512 forms of the row loops for bf16 storage (the auto-vectorised loops use 256-bit vectors and
// separate conversion passes). exp512 is exp_vec (vec_math.h) lane for lane, with the FMAs GCC contracts
// exp_vec's arithmetic into, so it gives exp_vec's values.
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpVecLo), hi = _mm512_set1_ps(kExpVecHi);
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  const __m512 xc = _mm512_min_ps(hi, _mm512_max_ps(lo, x));  // NaN stays NaN (max/min return the 2nd)
  const __m512 t = _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), shift);
  const __m512 n = _mm512_sub_ps(t, shift);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-6f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(shift)), _mm512_set1_epi32(127)),
      23);
  __m512 v = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ),
                            _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// 16 bf16 -> fp32 (exact).
inline __m512 bf16x16_to_ps(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 load_bf16x16(const bf16* p, __mmask16 k) {
  return bf16x16_to_ps(_mm256_maskz_loadu_epi16(k, p));
}
// Lanes j < n set (n clamped to [0, 16]).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : (n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1));
}
// (row a, row b) of 16 columns -> 32 bf16 in the B layout (pairs interleaved: a0 b0 a1 b1 ...).
inline __m512i interleave_pair(__m512 a, __m512 b) {
  alignas(64) static constexpr uint16_t kIdx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kIdx), (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

static_assert(kTile == 64, "the AVX-512 row loops hold a row in four vectors");

// Forward online-softmax update for one score tile S [query, key] (unscaled fp32): m, l updated, O's
// rows rescaled, and the probabilities written as bf16 rows twice, P = hi + lo (see the forward).
inline void forward_rows_bf16(const float* S, bf16* Phi, bf16* Plo, float* m, float* l, float* O, int64_t hdp,
                              float scale, bool diagonal) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < kTile; ++i) {
    const float* s = S + i * kTile;
    const int64_t vis = diagonal ? i + 1 : kTile;
    __m512 x[4], p[4];
    __m512 mxv = _mm512_set1_ps(m[i]);
    for (int v = 0; v < 4; ++v) {
      x[v] = _mm512_mask_mul_ps(ninf, first_lanes(vis - 16 * v), _mm512_loadu_ps(s + 16 * v), vscale);
      mxv = _mm512_max_ps(mxv, x[v]);
    }
    const float mx = _mm512_reduce_max_ps(mxv);
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 sumv = _mm512_setzero_ps();
    for (int v = 0; v < 4; ++v) {
      // Exactly 0 for masked keys (-inf); vectors past the diagonal skip the exp.
      p[v] = 16 * v < vis ? exp512(_mm512_sub_ps(x[v], vmx)) : _mm512_setzero_ps();
      sumv = _mm512_add_ps(sumv, p[v]);
    }
    const float sum = _mm512_reduce_add_ps(sumv);
    const float corr = exp_vec(m[i] - mx);  // 0 on the first tile (m = -inf)
    l[i] = l[i] * corr + sum;
    m[i] = mx;
    if (corr != 1.0f) {
      const __m512 vc = _mm512_set1_ps(corr);
      for (int64_t d = 0; d < hdp; d += 16)
        _mm512_storeu_ps(O + i * hdp + d, _mm512_mul_ps(vc, _mm512_loadu_ps(O + i * hdp + d)));
    }
    for (int v = 0; v < 4; v += 2) {
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(p[v + 1], p[v]);
      _mm512_storeu_si512(Phi + i * kTile + 16 * v, h);
      const __m512 lo0 = _mm512_sub_ps(p[v], bf16x16_to_ps(_mm512_castsi512_si256(h)));
      const __m512 lo1 = _mm512_sub_ps(p[v + 1], bf16x16_to_ps(_mm512_extracti64x4_epi64(h, 1)));
      _mm512_storeu_si512(Plo + i * kTile + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(lo1, lo0));
    }
  }
}

// Backward: P = exp(S * scale - lse) (0 for masked keys) and dS = P (dP - D), written straight into the
// layouts the products read: P and dS in the B layout, dS as rows. Two query rows at a time (a B pair).
inline void backward_rows_bf16(const float* S, const float* dP, const float* lse, const float* D, float scale,
                               bool diagonal, bf16* Pb, bf16* dSb, bf16* dSr) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < kTile; i += 2) {
    __m512 p[2][4], ds[2][4];
    for (int r = 0; r < 2; ++r) {
      const int64_t row = i + r, vis = diagonal ? row + 1 : kTile;
      const __m512 li = _mm512_set1_ps(lse[row]), di = _mm512_set1_ps(D[row]);
      for (int v = 0; v < 4; ++v) {
        if (16 * v >= vis) {  // wholly past the diagonal
          p[r][v] = ds[r][v] = _mm512_setzero_ps();
          continue;
        }
        const __m512 e = exp512(_mm512_fmsub_ps(_mm512_loadu_ps(S + row * kTile + 16 * v), vscale, li));
        p[r][v] = _mm512_maskz_mov_ps(first_lanes(vis - 16 * v), e);
        ds[r][v] = _mm512_mul_ps(p[r][v], _mm512_sub_ps(_mm512_loadu_ps(dP + row * kTile + 16 * v), di));
      }
      for (int v = 0; v < 4; v += 2)
        _mm512_storeu_si512(dSr + row * kTile + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(ds[r][v + 1], ds[r][v]));
    }
    for (int v = 0; v < 4; ++v) {
      _mm512_storeu_si512(Pb + i * kTile + 32 * v, interleave_pair(p[0][v], p[1][v]));
      _mm512_storeu_si512(dSb + i * kTile + 32 * v, interleave_pair(ds[0][v], ds[1][v]));
    }
  }
}

// Forward output of one query row (bf16 storage): a = O / l, out = a * sigmoid(gate), attn = a.
inline void output_row_bf16(const float* O, float inv_l, const bf16* gate, bf16* out, bf16* attn, int64_t hd) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps(), vl = _mm512_set1_ps(inv_l);
  for (int64_t d = 0; d < hd; d += 16) {
    const __mmask16 k = first_lanes(hd - d);
    const __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, O + d), vl);
    const __m512 sg = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, load_bf16x16(gate + d, k)))));
    _mm256_mask_storeu_epi16(out + d, k, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a, sg)));
    if (attn) _mm256_mask_storeu_epi16(attn + d, k, (__m256i)_mm512_cvtneps_pbh(a));
  }
}

// dst[j, d] += scale * src[d, j] for j < n, d < hd: src [hd (padded), kTile], dst rows ld apart.
inline void add_transposed(const float* src, float scale, int64_t n, int64_t hd, float* dst, int64_t ld) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(kTile)));
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < hd; d += 16) {
      const __mmask16 k = first_lanes(hd - d);
      const __m512 x = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, idx, src + d * kTile + j, 4);
      _mm512_mask_storeu_ps(dst + j * ld + d, k, _mm512_fmadd_ps(vs, x, _mm512_maskz_loadu_ps(k, dst + j * ld + d)));
    }
}

// The gate step of one query row (bf16 storage): dgate +=, dA (rounded to bf16, as fp32) into da;
// returns D = rowsum(dA * attn).
inline float gate_row_bf16(const bf16* gate, const bf16* attn, const float* dout, float* dgate, float* da,
                           int64_t hd) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  __m512 dot = zero;
  for (int64_t d = 0; d < hd; d += 16) {
    const __mmask16 k = first_lanes(hd - d);
    const __m512 gt = load_bf16x16(gate + d, k), a = load_bf16x16(attn + d, k);
    const __m512 go = _mm512_maskz_loadu_ps(k, dout + d);
    const __m512 sg = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, gt))));
    const __m512 dg = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(go, a), sg), _mm512_sub_ps(one, sg),
                                      _mm512_maskz_loadu_ps(k, dgate + d));
    _mm512_mask_storeu_ps(dgate + d, k, dg);
    const __m512 dav = bf16x16_to_ps((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(go, sg)));  // 0 past hd
    _mm512_mask_storeu_ps(da + d, k, dav);
    dot = _mm512_fmadd_ps(dav, a, dot);
  }
  return _mm512_reduce_add_ps(dot);
}
#endif

// Geometry shared by the passes.
struct Geometry {
  int64_t B, T, H, KVH, hd, hdp, group, tiles, Tp;
  float scale;
  // hd is padded to a multiple of 16 (fp32 products) or 32 (bf16: AMX's K step).
  Geometry(const AttentionShape& s, bool bf16_products)
      : B(s.batch), T(s.seq), H(s.q_heads), KVH(s.kv_heads), hd(s.head_dim),
        hdp(bf16_products ? (s.head_dim + 31) / 32 * 32 : round_up16(s.head_dim)),
        group(s.kv_heads > 0 ? s.q_heads / s.kv_heads : 0), tiles((s.seq + kTile - 1) / kTile),
        Tp(tiles * kTile), scale(1.0f / std::sqrt(static_cast<float>(s.head_dim))) {
    if (B < 0 || T < 0 || H <= 0 || KVH <= 0 || hd <= 0 || H % KVH != 0)
      throw std::invalid_argument("gated attention: need positive heads/head_dim with q_heads % kv_heads == 0");
  }
  // Offset of row t of head h in the caller's [B, T, heads, hd] layout.
  int64_t row(int64_t b, int64_t t, int64_t h, int64_t heads) const { return ((b * T + t) * heads + h) * hd; }
  // Elements of one (batch, head) in a padded layout ([Tp, hdp] or [hdp, Tp]).
  int64_t per_head() const { return Tp * hdp; }
  size_t padded_size(int64_t heads) const { return static_cast<size_t>(B * heads * per_head()); }
  int64_t tile_len(int64_t tile) const { return std::min(kTile, T - tile * kTile); }
};

// Packed copies of one (batch, head) matrix X [Tp, hdp] (padding zero); any of the pointers may be null.
template <typename E>
struct Packs {
  E* rows = nullptr;    // X row-major: the A operand with K = hd
  E* rows_b = nullptr;  // X in the B layout [Tp, hdp]: the B operand with K = time
  E* cols = nullptr;    // X^T row-major [hdp, Tp]: the A operand with K = time
  E* cols_b = nullptr;  // X^T in the B layout [hdp, Tp]: the B operand with K = hd
};

// Writes time tile `tile` of tmp [kTile, hdp] (fp32) into the packs of one (batch, head).
template <typename E>
void emit_tile(const float* tmp, int64_t tile, const Geometry& g, const Packs<E>& p) {
  const int64_t t0 = tile * kTile;
#if HS_ATTENTION_BF16_DOT
  // bf16 products: the AVX-512 form. tmp's values are bf16 values already (loaded from bf16 storage or
  // rounded to bf16), so the conversion is exact either way.
  constexpr int64_t kMaxHdp = 256;
  if constexpr (std::is_same_v<E, bf16>) {
    if (g.hdp <= kMaxHdp) {
      alignas(64) uint16_t tb[kTile * kMaxHdp];  // the tile as bf16 rows
      for (int64_t i = 0; i < kTile; ++i)
        for (int64_t d = 0; d < g.hdp; d += 32)
          _mm512_store_si512(tb + i * g.hdp + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(tmp + i * g.hdp + d + 16),
                                                                          _mm512_loadu_ps(tmp + i * g.hdp + d)));
      if (p.rows) std::memcpy(p.rows + t0 * g.hdp, tb, sizeof(uint16_t) * kTile * g.hdp);
      if (p.rows_b)
        for (int64_t i = 0; i < kTile; i += 2)
          for (int64_t d = 0; d < g.hdp; d += 16)
            _mm512_storeu_si512(p.rows_b + (t0 + i) * g.hdp + 2 * d,
                                interleave_pair(_mm512_loadu_ps(tmp + i * g.hdp + d),
                                                _mm512_loadu_ps(tmp + (i + 1) * g.hdp + d)));
      // Transposes by 32-bit gathers down tb's columns: word c of row i of tb holds elements (2c, 2c + 1).
      const int64_t w = g.hdp / 2;
      const auto* tb32 = reinterpret_cast<const int32_t*>(tb);
      const __m512i gidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(static_cast<int>(w)));
      if (p.cols) {
        alignas(64) static constexpr uint16_t kEven[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20,
                                                           22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                                                           44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
        const __m512i even = _mm512_load_si512(kEven), odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
        auto* cols = reinterpret_cast<uint16_t*>(p.cols);
        for (int64_t c = 0; c < w; ++c)
          for (int64_t i = 0; i < kTile; i += 32) {
            const __m512i x0 = _mm512_i32gather_epi32(gidx, tb32 + i * w + c, 4);
            const __m512i x1 = _mm512_i32gather_epi32(gidx, tb32 + (i + 16) * w + c, 4);
            _mm512_storeu_si512(cols + 2 * c * g.Tp + t0 + i, _mm512_permutex2var_epi16(x0, even, x1));
            _mm512_storeu_si512(cols + (2 * c + 1) * g.Tp + t0 + i, _mm512_permutex2var_epi16(x0, odd, x1));
          }
      }
      if (p.cols_b) {
        // The B layout of X^T holds the same words: a 32-bit transpose [kTile, hdp / 2] -> [hdp / 2, Tp].
        auto* dst = reinterpret_cast<int32_t*>(p.cols_b);
        for (int64_t c = 0; c < w; ++c)
          for (int64_t i = 0; i < kTile; i += 16)
            _mm512_storeu_si512(dst + c * g.Tp + t0 + i, _mm512_i32gather_epi32(gidx, tb32 + i * w + c, 4));
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < kTile; ++i)
    for (int64_t d = 0; d < g.hdp; ++d) {
      const E x = to_e<E>(tmp[i * g.hdp + d]);
      if (p.rows) p.rows[(t0 + i) * g.hdp + d] = x;
      if (p.rows_b) p.rows_b[b_index<E>(t0 + i, d, g.hdp)] = x;
    }
  if (p.cols || p.cols_b)
    for (int64_t d = 0; d < g.hdp; ++d)
      for (int64_t i = 0; i < kTile; ++i) {
        const E x = to_e<E>(tmp[i * g.hdp + d]);
        if (p.cols) p.cols[d * g.Tp + t0 + i] = x;
        if (p.cols_b) p.cols_b[b_index<E>(d, t0 + i, g.Tp)] = x;
      }
}

// tmp [kTile, hdp] <- rows [t0, t0 + kTile) of head h of src [B, T, heads, hd], padding zero.
template <typename T>
void load_tile(float* tmp, const T* src, const Geometry& g, int64_t b, int64_t h, int64_t heads, int64_t tile) {
  const int64_t t0 = tile * kTile, n = g.tile_len(tile);
  for (int64_t i = 0; i < kTile; ++i) {
    float* d = tmp + i * g.hdp;
    const int64_t len = i < n ? g.hd : 0;
    const T* s = src + (i < n ? g.row(b, t0 + i, h, heads) : 0);
    for (int64_t c = 0; c < len; ++c) d[c] = to_f32(s[c]);
    std::fill(d + len, d + g.hdp, 0.0f);
  }
}

// Packs every (batch, head) of src [B, T, heads, hd]; packs(b, h) gives the destinations.
template <typename E, typename T, typename F>
void pack_all(const T* src, const Geometry& g, int64_t heads, float* tmp_all, F packs) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < g.B * heads * g.tiles; ++r) {
    // Heads fastest: the tiles of all heads at one time tile are one contiguous stretch of src.
    const int64_t h = r % heads, tile = r / heads % g.tiles, b = r / heads / g.tiles;
    float* tmp = tmp_all + omp_get_thread_num() * kTile * g.hdp;
    load_tile(tmp, src, g, b, h, heads, tile);
    emit_tile<E>(tmp, tile, g, packs(b, h));
  }
}

}  // namespace

template <typename T>
void gated_attention_forward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* gate,
                             T* out, AttentionSaved* saved, MemoryAccountant& mem) {
  profile::Scope profile_scope(profile::Phase::Attention, "gated_attention_forward");
  using E = typename ComputeType<T>::type;
  const Geometry g(shape, !std::is_same_v<E, float>);
  if (saved) {
    saved->lse = mem.allocate_n<float>(static_cast<size_t>(g.B * g.H * g.T), MemCategory::Activations,
                                       "attention.lse");
    saved->attn = mem.allocate_n<T>(static_cast<size_t>(g.B * g.T * g.H * g.hd), MemCategory::Activations,
                                    "attention.attn");
  }
  // K^T as the B operand of S = q K^T, V as the B operand of O = P V.
  Buffer k_buf = mem.allocate_n<E>(g.padded_size(g.KVH), MemCategory::Workspace, "attention.k_packed");
  Buffer v_buf = mem.allocate_n<E>(g.padded_size(g.KVH), MemCategory::Workspace, "attention.v_packed");
  const int nthreads = omp_get_max_threads();
  // Per thread: q rows (E), S (fp32), P (E), O (fp32), m, l.
  const int64_t per_thread = 2 * kTile * g.hdp + 2 * kTile * kTile + kTile * g.hdp + 2 * kTile + 32;
  Buffer scratch = mem.allocate_n<float>(static_cast<size_t>(nthreads * per_thread), MemCategory::Workspace,
                                         "attention.tiles");
  if (mem.planning()) return;
  E* kp = k_buf.as<E>();
  E* vp = v_buf.as<E>();
  float* tmp_all = scratch.as<float>();  // pack_all's tiles, before the tiles below are used
  pack_all<E>(k, g, g.KVH, tmp_all, [&](int64_t b, int64_t h) {
    Packs<E> p;
    p.cols_b = kp + (b * g.KVH + h) * g.per_head();
    return p;
  });
  pack_all<E>(v, g, g.KVH, tmp_all, [&](int64_t b, int64_t h) {
    Packs<E> p;
    p.rows_b = vp + (b * g.KVH + h) * g.per_head();
    return p;
  });
  float* lse_out = saved ? saved->lse.as<float>() : nullptr;
  T* attn_out = saved ? saved->attn.as<T>() : nullptr;
  const int64_t tasks = g.B * g.H * g.tiles;
  constexpr float kInf = std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(nthreads)
  {
    [[maybe_unused]] const AmxScope amx;
    float* base = scratch.as<float>() + omp_get_thread_num() * per_thread;
    E* Qr = reinterpret_cast<E*>(base);           // q rows (unscaled)
    float* S = base + kTile * g.hdp;              // scores [query, key], then probabilities
    E* P = reinterpret_cast<E*>(S + kTile * kTile);  // probabilities as the A operand (bf16)
    float* O = S + 2 * kTile * kTile;             // unnormalised output rows
    float* m = O + kTile * g.hdp;                 // running max per query
    float* l = m + kTile;                         // running sum per query
    // Longest tasks (last query tiles) first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t qt = g.tiles - 1 - task / (g.B * g.H), b = task % (g.B * g.H) / g.H, h = task % g.H;
      const int64_t kvh = h / g.group, q0 = qt * kTile, nq = g.tile_len(qt);
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t n = i < nq ? g.hd : 0;
        const T* src = q + (i < nq ? g.row(b, q0 + i, h, g.H) : 0);
        if constexpr (std::is_same_v<E, T>)
          std::memcpy(Qr + i * g.hdp, src, sizeof(E) * static_cast<size_t>(n));
        else
          for (int64_t d = 0; d < n; ++d) Qr[i * g.hdp + d] = to_e<E>(to_f32(src[d]));
        std::fill(Qr + i * g.hdp + n, Qr + (i + 1) * g.hdp, to_e<E>(0.0f));
      }
      std::fill(O, O + kTile * g.hdp, 0.0f);
      std::fill(m, m + kTile, -kInf);
      std::fill(l, l + kTile, 0.0f);
      const E* Kb = kp + (b * g.KVH + kvh) * g.per_head();
      const E* Vb = vp + (b * g.KVH + kvh) * g.per_head();
      for (int64_t kt = 0; kt <= qt; ++kt) {
        tile_gemm<E>(kTile, kTile, g.hdp, Qr, g.hdp, Kb + kt * kTile * kPair<E>, g.Tp, S, kTile, false);
        // Online softmax per query row. Row i sees keys j < vis: all of an earlier tile, up to the
        // diagonal on the last (padded keys there are only seen by padded queries, whose rows are
        // finite and never written out). vis >= 1, so the max is finite and no exp sees inf - inf.
        const bool diagonal = kt == qt;
        const E* Vt = Vb + kt * kTile * g.hdp;
#if HS_ATTENTION_BF16_DOT
        if constexpr (std::is_same_v<E, bf16>) {
          forward_rows_bf16(S, P, P + kTile * kTile, m, l, O, g.hdp, g.scale, diagonal);
          tile_gemm<E>(kTile, g.hdp, kTile, P, kTile, Vt, g.hdp, O, g.hdp, true);                  // O += P_hi V
          tile_gemm<E>(kTile, g.hdp, kTile, P + kTile * kTile, kTile, Vt, g.hdp, O, g.hdp, true);  // O += P_lo V
          continue;
        }
#endif
        for (int64_t i = 0; i < kTile; ++i) {
          float* s = S + i * kTile;
          const int64_t vis = diagonal ? i + 1 : kTile;
          float mx = m[i];
#pragma omp simd reduction(max : mx)
          for (int64_t j = 0; j < kTile; ++j) {
            const float x = j < vis ? s[j] * g.scale : -kInf;
            s[j] = x;
            mx = std::max(mx, x);
          }
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < kTile; ++j) {
            const float p = exp_vec(s[j] - mx);  // exactly 0 for masked keys (-inf)
            s[j] = p;
            sum += p;
          }
          const float corr = exp_vec(m[i] - mx);  // 0 on the first tile (m = -inf)
          l[i] = l[i] * corr + sum;
          m[i] = mx;
          if (corr != 1.0f)
            for (int64_t d = 0; d < g.hdp; ++d) O[i * g.hdp + d] *= corr;
        }
        tile_gemm<E>(kTile, g.hdp, kTile, as_rows<E>(S, P), kTile, Vt, g.hdp, O, g.hdp, true);  // O += P V
        if constexpr (!std::is_same_v<E, float>) {
          // bf16: P = hi + lo, both bf16 (P's relative error 2^-9 -> 2^-17), so the output keeps fp32-like
          // accuracy (an O(1e-3) error in P would show in outputs that average to near zero).
          for (int64_t e = 0; e < kTile * kTile; ++e) S[e] -= to_f32(P[e]);
          tile_gemm<E>(kTile, g.hdp, kTile, as_rows<E>(S, P), kTile, Vt, g.hdp, O, g.hdp, true);
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        const float inv_l = 1.0f / l[i];
        const int64_t row = g.row(b, q0 + i, h, g.H);
#if HS_ATTENTION_BF16_DOT
        if constexpr (std::is_same_v<T, bf16>) {
          output_row_bf16(O + i * g.hdp, inv_l, gate + row, out + row, attn_out ? attn_out + row : nullptr, g.hd);
          if (lse_out) lse_out[(b * g.H + h) * g.T + q0 + i] = m[i] + std::log(l[i]);
          continue;
        }
#endif
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

namespace {
// Key tiles [start[c], start[c + 1]) form chunk c, cut so that the chunks' causal work (key tile kt
// meets tiles - kt query tiles) is about equal. Some chunks are empty when tiles < chunks.
std::vector<int64_t> chunk_starts(int64_t tiles, int64_t chunks) {
  std::vector<int64_t> start(static_cast<size_t>(chunks + 1), tiles);
  const int64_t total = tiles * (tiles + 1) / 2;
  int64_t kt = 0, done = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    while (kt < tiles && done * chunks < c * total) done += tiles - kt++;
    start[static_cast<size_t>(c)] = kt;
  }
  return start;
}
}  // namespace

template <typename T>
void gated_attention_backward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* gate,
                              const AttentionSaved& saved, const float* dout, float* dq, float* dk, float* dv,
                              float* dgate, MemoryAccountant& mem) {
  profile::Scope profile_scope(profile::Phase::Attention, "gated_attention_backward");
  using E = typename ComputeType<T>::type;
  const Geometry g(shape, !std::is_same_v<E, float>);
  // Enough (batch, KV head, chunk) tasks to keep a few threads busy; a function of the shape only.
  constexpr int64_t kMinTasks = 8;
  const int64_t chunks = std::max<int64_t>(1, (kMinTasks + g.B * g.KVH - 1) / std::max<int64_t>(1, g.B * g.KVH));
  // K^T and V^T as B operands of S = q K^T and dP = dA V^T, K as the B operand of dQ = dS K; q and dA
  // as rows (A operands of S and dP) and transposed (A operands of dK^T = q^T dS and dV^T = dA^T P).
  Buffer kc_buf = mem.allocate_n<E>(g.padded_size(g.KVH), MemCategory::Workspace, "attention.k_packed");
  Buffer vc_buf = mem.allocate_n<E>(g.padded_size(g.KVH), MemCategory::Workspace, "attention.v_packed");
  Buffer kr_buf = mem.allocate_n<E>(g.padded_size(g.KVH), MemCategory::Workspace, "attention.k_rows");
  Buffer qr_buf = mem.allocate_n<E>(g.padded_size(g.H), MemCategory::Workspace, "attention.q_rows");
  Buffer qc_buf = mem.allocate_n<E>(g.padded_size(g.H), MemCategory::Workspace, "attention.q_cols");
  Buffer dar_buf = mem.allocate_n<E>(g.padded_size(g.H), MemCategory::Workspace, "attention.d_attn_rows");
  Buffer dac_buf = mem.allocate_n<E>(g.padded_size(g.H), MemCategory::Workspace, "attention.d_attn_cols");
  // Per query, padded to Tp: lse (+inf in padding, so P = 0 there) and D = rowsum(dA * attn).
  Buffer stats_buf = mem.allocate_n<float>(static_cast<size_t>(2 * g.B * g.H * g.Tp), MemCategory::Workspace,
                                           "attention.stats");
  const int nthreads = omp_get_max_threads();
  // One chunk: a task sees every key tile of its (batch, KV head), so it adds its dQ (of its query heads)
  // to dq itself, from a per-thread accumulator that stays in cache (same sums, less fresh memory).
  const bool direct = chunks == 1;
  const size_t dq_size = direct ? static_cast<size_t>(nthreads * g.group * g.per_head())
                                : static_cast<size_t>(chunks) * g.padded_size(g.H);
  Buffer dq_buf = mem.allocate_n<float>(dq_size, MemCategory::Workspace, "attention.dq_partials");
  // Per thread: S, dP (fp32); P, dS in the B layout and dS as rows (E); dK^T, dV^T (fp32).
  const int64_t per_thread = 2 * kTile * kTile + 3 * kTile * kTile + 2 * kTile * g.hdp + 32;
  Buffer scratch = mem.allocate_n<float>(static_cast<size_t>(nthreads * per_thread), MemCategory::Workspace,
                                         "attention.tiles");
  if (mem.planning()) return;
  E* kc = kc_buf.as<E>();
  E* vc = vc_buf.as<E>();
  E* kr = kr_buf.as<E>();
  E* qr = qr_buf.as<E>();
  E* qc = qc_buf.as<E>();
  E* dar = dar_buf.as<E>();
  E* dac = dac_buf.as<E>();
  float* lse_p = stats_buf.as<float>();
  float* D_p = lse_p + g.B * g.H * g.Tp;
  float* dq_part = dq_buf.as<float>();
  const float* lse = saved.lse.as<float>();
  const T* attn = saved.attn.as<T>();
  float* tmp_all = scratch.as<float>();
  pack_all<E>(k, g, g.KVH, tmp_all, [&](int64_t b, int64_t h) {
    Packs<E> p;
    p.cols_b = kc + (b * g.KVH + h) * g.per_head();
    p.rows_b = kr + (b * g.KVH + h) * g.per_head();
    return p;
  });
  pack_all<E>(v, g, g.KVH, tmp_all, [&](int64_t b, int64_t h) {
    Packs<E> p;
    p.cols_b = vc + (b * g.KVH + h) * g.per_head();
    return p;
  });
  pack_all<E>(q, g, g.H, tmp_all, [&](int64_t b, int64_t h) {
    Packs<E> p;
    p.rows = qr + (b * g.H + h) * g.per_head();
    p.cols = qc + (b * g.H + h) * g.per_head();
    return p;
  });

  // Through the gate: dgate, dA = dout * sigmoid(gate) (packed) and D; lse padded.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < g.B * g.H * g.tiles; ++r) {
    const int64_t h = r % g.H, tile = r / g.H % g.tiles, b = r / g.H / g.tiles;  // as in pack_all
    float* tmp = tmp_all + omp_get_thread_num() * kTile * g.hdp;
    const int64_t t0 = tile * kTile, n = g.tile_len(tile);
    float* lse_row = lse_p + (b * g.H + h) * g.Tp + t0;
    float* D_row = D_p + (b * g.H + h) * g.Tp + t0;
    for (int64_t i = 0; i < kTile; ++i) {
      float* da = tmp + i * g.hdp;
      std::fill(da, da + g.hdp, 0.0f);
      lse_row[i] = std::numeric_limits<float>::infinity();
      D_row[i] = 0.0f;
      if (i >= n) continue;
      const int64_t o = g.row(b, t0 + i, h, g.H);
      lse_row[i] = lse[(b * g.H + h) * g.T + t0 + i];
#if HS_ATTENTION_BF16_DOT
      if constexpr (std::is_same_v<E, bf16>) {
        D_row[i] = gate_row_bf16(gate + o, attn + o, dout + o, dgate + o, da, g.hd);
        continue;
      }
#endif
      float rowdot = 0.0f;
      for (int64_t d = 0; d < g.hd; ++d) {
        const float sg = sigmoid_vec(to_f32(gate[o + d])), a = to_f32(attn[o + d]), go = dout[o + d];
        dgate[o + d] += go * a * sg * (1.0f - sg);
        // dA as the products see it (rounded to bf16 when E is), so that D = rowsum(P * dP) holds for
        // the dP computed from it: dS = P (dP - D) cancels, and an inconsistent D would be amplified.
        da[d] = to_f32(to_e<E>(go * sg));
        rowdot += da[d] * a;
      }
      D_row[i] = rowdot;
    }
    Packs<E> p;
    p.rows = dar + (b * g.H + h) * g.per_head();
    p.cols = dac + (b * g.H + h) * g.per_head();
    emit_tile<E>(tmp, tile, g, p);
  }

  const std::vector<int64_t> start = chunk_starts(g.tiles, chunks);
  const int64_t tasks = g.B * g.KVH * chunks;
#pragma omp parallel num_threads(nthreads)
  {
    [[maybe_unused]] const AmxScope amx;
    float* S = scratch.as<float>() + omp_get_thread_num() * per_thread;
    float* dP = S + kTile * kTile;
    E* Pb = reinterpret_cast<E*>(dP + kTile * kTile);  // each of these three: kTile * kTile elements
    E* dSb = Pb + kTile * kTile;
    E* dSr = dSb + kTile * kTile;
    float* dKt = dP + kTile * kTile + 3 * kTile * kTile;  // dK^T [hdp, kTile] (/ scale)
    float* dVt = dKt + kTile * g.hdp;                      // dV^T [hdp, kTile]

#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t c = task % chunks, b = task / chunks / g.KVH, kvh = task / chunks % g.KVH;
      const int64_t kt_begin = start[static_cast<size_t>(c)], kt_end = start[static_cast<size_t>(c + 1)];
      if (kt_begin == kt_end) continue;
      // dQ of head h is at dQc + dq_head(h) * per_head.
      float* dQc = direct ? dq_part + omp_get_thread_num() * g.group * g.per_head()
                          : dq_part + static_cast<int64_t>(c) * g.B * g.H * g.per_head();
      const auto dq_head = [&](int64_t h) { return direct ? h - kvh * g.group : b * g.H + h; };
      for (int64_t h = kvh * g.group; h < (kvh + 1) * g.group; ++h)
        std::fill(dQc + dq_head(h) * g.per_head() + kt_begin * kTile * g.hdp,
                  dQc + (dq_head(h) + 1) * g.per_head(), 0.0f);
      const E* Kc = kc + (b * g.KVH + kvh) * g.per_head();
      const E* Vc = vc + (b * g.KVH + kvh) * g.per_head();
      const E* Kr = kr + (b * g.KVH + kvh) * g.per_head();
      for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
        const int64_t k0 = kt * kTile, nk = g.tile_len(kt);
        std::fill(dKt, dKt + 2 * kTile * g.hdp, 0.0f);
        for (int64_t h = kvh * g.group; h < (kvh + 1) * g.group; ++h) {
          const int64_t bh = b * g.H + h;
          const E* Qr = qr + bh * g.per_head();
          const E* Qc = qc + bh * g.per_head();
          const E* dAr = dar + bh * g.per_head();
          const E* dAc = dac + bh * g.per_head();
          float* dQ = dQc + dq_head(h) * g.per_head();
          for (int64_t qt = kt; qt < g.tiles; ++qt) {
            const int64_t q0 = qt * kTile;
            tile_gemm<E>(kTile, kTile, g.hdp, Qr + q0 * g.hdp, g.hdp, Kc + k0 * kPair<E>, g.Tp, S, kTile, false);
            tile_gemm<E>(kTile, kTile, g.hdp, dAr + q0 * g.hdp, g.hdp, Vc + k0 * kPair<E>, g.Tp, dP, kTile, false);
            // P = exp(S * scale - lse) (0 for masked keys and, by lse = +inf, padded queries) and
            // dS = P (dP - D). Padded keys are only seen on the diagonal by padded queries.
            const bool diagonal = qt == kt;
            const float* lse_t = lse_p + bh * g.Tp + q0;
            const float* D_t = D_p + bh * g.Tp + q0;
#if HS_ATTENTION_BF16_DOT
            if constexpr (std::is_same_v<E, bf16>) {
              backward_rows_bf16(S, dP, lse_t, D_t, g.scale, diagonal, Pb, dSb, dSr);
              tile_gemm<E>(g.hdp, kTile, kTile, dAc + q0, g.Tp, Pb, kTile, dVt, kTile, true);
              tile_gemm<E>(g.hdp, kTile, kTile, Qc + q0, g.Tp, dSb, kTile, dKt, kTile, true);
              tile_gemm<E>(kTile, g.hdp, kTile, dSr, kTile, Kr + k0 * g.hdp, g.hdp, dQ + q0 * g.hdp, g.hdp, true);
              continue;
            }
#endif
            for (int64_t i = 0; i < kTile; ++i) {
              float* s = S + i * kTile;
              float* dp = dP + i * kTile;
              const int64_t vis = diagonal ? i + 1 : kTile;
              const float li = lse_t[i], di = D_t[i];
#pragma omp simd
              for (int64_t j = 0; j < kTile; ++j) {
                const float p = j < vis ? exp_vec(s[j] * g.scale - li) : 0.0f;
                s[j] = p;
                dp[j] = p * (dp[j] - di);
              }
            }
            const E* P_b = as_b_operand<E>(S, Pb);
            const E* dS_b = as_b_operand<E>(dP, dSb);
            const E* dS_r = as_rows<E>(dP, dSr);
            tile_gemm<E>(g.hdp, kTile, kTile, dAc + q0, g.Tp, P_b, kTile, dVt, kTile, true);  // dV^T += dA^T P
            tile_gemm<E>(g.hdp, kTile, kTile, Qc + q0, g.Tp, dS_b, kTile, dKt, kTile, true);  // dK^T += q^T dS
            tile_gemm<E>(kTile, g.hdp, kTile, dS_r, kTile, Kr + k0 * g.hdp, g.hdp, dQ + q0 * g.hdp, g.hdp,
                         true);  // dQ += dS K
          }
        }
#if HS_ATTENTION_BF16_DOT
        add_transposed(dKt, g.scale, nk, g.hd, dk + g.row(b, k0, kvh, g.KVH), g.KVH * g.hd);
        add_transposed(dVt, 1.0f, nk, g.hd, dv + g.row(b, k0, kvh, g.KVH), g.KVH * g.hd);
#else
        for (int64_t j = 0; j < nk; ++j) {
          const int64_t row = g.row(b, k0 + j, kvh, g.KVH);
          for (int64_t d = 0; d < g.hd; ++d) {
            dk[row + d] += g.scale * dKt[d * kTile + j];
            dv[row + d] += dVt[d * kTile + j];
          }
        }
#endif
      }
      if (direct)  // dq += scale * (0 + the one partial), as the pass below would
        for (int64_t h = kvh * g.group; h < (kvh + 1) * g.group; ++h)
          for (int64_t t = 0; t < g.T; ++t) {
            const float* part = dQc + dq_head(h) * g.per_head() + t * g.hdp;
            float* dst = dq + g.row(b, t, h, g.H);
#pragma omp simd
            for (int64_t d = 0; d < g.hd; ++d) dst[d] += g.scale * (0.0f + part[d]);
          }
    }

    // dq += scale * (the chunks' partials, in chunk order).
    if (!direct)
#pragma omp for schedule(static)
    for (int64_t r = 0; r < g.B * g.H * g.T; ++r) {
      const int64_t t = r % g.T, bh = r / g.T, b = bh / g.H, h = bh % g.H;
      float* dst = dq + g.row(b, t, h, g.H);
      // Per element the same sum (0 + chunk 0 + chunk 1 + ...), vectorised over d.
      float sum[kMaxRowSum];
      for (int64_t d0 = 0; d0 < g.hd; d0 += kMaxRowSum) {
        const int64_t n = std::min(kMaxRowSum, g.hd - d0);
        std::fill(sum, sum + n, 0.0f);
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t kb = start[static_cast<size_t>(c)];
          if (kb == start[static_cast<size_t>(c + 1)] || t / kTile < kb) continue;
          const float* part = dq_part + (c * g.B * g.H + bh) * g.per_head() + t * g.hdp + d0;
#pragma omp simd
          for (int64_t d = 0; d < n; ++d) sum[d] += part[d];
        }
#pragma omp simd
        for (int64_t d = 0; d < n; ++d) dst[d0 + d] += g.scale * sum[d];
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
