// The chunked gated delta rule (WY form, chunk C = 64), forward and backward, in fp32 (optionally with bf16-input
// products).
//
// Per chunk, with G the chunk-local cumulative gate and S0 the state at chunk start (spec/model.md):
//   D_ij = exp(G_i - G_j) (i >= j),  M = strictly_lower((beta K) K^T o D),  Tinv = (I + M)^-1,
//   W = Tinv (beta exp(G) K),  U = Tinv (beta V),  Vn = U - W S0,
//   O = (exp(G) Q) S0 + (Q K^T o D) Vn,  S1 = exp(G_last) S0 + (exp(G_last - G) K)^T Vn.
// The forward saves Tinv and G. The backward needs each chunk's start state S0 and the gradient of its end
// state dS1 together, and the two come from recurrences running in opposite directions, so one of them has
// to be kept for every chunk of a head: a forward pass over the chunks recomputes W, Vn and S0 and keeps
// them for the one head a thread is working on (never for all heads at once), then a reverse pass carries
// dS and produces every gradient.
//
// The matrices are 64x64, 64xd and dxd: each head runs on one OpenMP thread over its own scratch with
// small register-blocked products (gemm below; oneDNN's per-call overhead would dominate at these sizes
// and it must not be called inside the parallel region anyway); feature dims are zero-padded to a multiple
// of 16 so every vector loop is whole.
//
// Where the work goes (the products are ~55% of the time and run near the FMA peak): products whose result is
// only read on and below the diagonal (Q K^T, K K^T, dO Vn^T and the dM chain) compute just the 16-column
// groups that reach it; terms known to be zero are skipped (the first chunk's zero start state, the last
// chunk's zero dS1, and the last chunk's end state, which nobody reads); the backward's dKbg comes from
// d(beta V) directly (-d(beta V) S0^T) instead of through dW. By default everything stays fp32 (bf16 storage is only
// widened on load), so the bf16 path computes exactly what the fp32 path does on the same values. With
// DeltaRuleProducts::Bf16 (bf16 storage, AVX-512-BF16) every product packs its operands rounded to bf16 and runs on
// vdpbf16ps into fp32 sums (twice the FMA rate); all else is unchanged.
#include "kernels/delta_rule.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "core/profile.h"
#include "kernels/cpu.h"
#include "kernels/simd.h"
#include "kernels/vec_math.h"

namespace hs::kernels {
namespace {

constexpr int64_t C = kDeltaRuleChunk;
constexpr int64_t kLanes = 16;  // one AVX-512 register of floats

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp of a gate difference, which is <= 0 for valid gates (g <= 0); a positive one (an invalid g) is taken as
// 0, so no decay factor exceeds 1.
inline float exp_nonpositive(float x) { return exp_vec(std::min(x, 0.0f)); }

// ---- Small dense products ---------------------------------------------------------------------------------

// Structure of op(A) that lets a product skip known zeros: Lower (row i reads columns k <= i) or Upper
// (k >= i). The skipped entries must be stored as zeros: blocks of rows read a superset.
enum class Tri { None, Lower, Upper };

constexpr int kMR = 4;  // rows of C per register block (8 where the block is at most 32 columns wide); every M
                        // here is a multiple of 16

// Sixteen floats as one value: GCC and Clang keep it in a 512-bit register where there is one (auto-
// vectorisation prefers 256-bit ones on AVX-512 machines) and split it elsewhere. Loads and stores go
// through memcpy (unaligned), and no function takes or returns one (that would be ABI-dependent).
using f32x16 = float __attribute__((vector_size(64)));

// Cm[MR, 16 NV] (= or +=) alpha A B over k in [kb, ke): the accumulators stay in registers while B streams row by
// row. Every element is one fp32 accumulator fed by fused multiply-adds in ascending k, then scaled, then added to
// the old value: the same operations on every path, so the AVX-512 and AVX2 kernels give the same bits.
// Never inlined, and the accumulators are named registers: with `acc[..] = {}` GCC zeroes a stack copy with
// memset on every call.
template <int MR, int NV>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), noinline)) void gemm_block_avx512(
    int64_t kb, int64_t ke, const float* A, int64_t ars, int64_t aks, const float* B, int64_t ldb, float* Cm,
    int64_t ldc, float alpha, bool accumulate) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = kb; k < ke; ++k) {
    __m512 b[NV];
    // Pinned in registers: otherwise GCC folds each load into every row's FMA (MR loads of one vector instead of
    // one), and the loop runs at the load ports' rate, ~55% of the FMA peak on Zen 4.
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      b[v] = _mm512_loadu_ps(B + k * ldb + 16 * v);
      __asm__("" : "+v"(b[v]));
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * ars + k * aks]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cp = Cm + r * ldc + 16 * v;
      __m512 c = _mm512_mul_ps(al, acc[r][v]);
      if (accumulate) c = _mm512_add_ps(c, _mm512_loadu_ps(cp));
      _mm512_storeu_ps(cp, c);
    }
}

// AVX2 has 16 vector registers of 8 floats: the block runs as 4-row x 16-column pieces (8 accumulators, 2 B vectors,
// a broadcast), each over the whole k range, the B piece (K x 16 floats) staying in L1 across the row pieces.
template <int MR, int NV>
__attribute__((target("avx2,fma"), noinline)) void gemm_block_avx2(int64_t kb, int64_t ke, const float* A,
                                                                   int64_t ars, int64_t aks, const float* B,
                                                                   int64_t ldb, float* Cm, int64_t ldc, float alpha,
                                                                   bool accumulate) {
  const __m256 al = _mm256_set1_ps(alpha);
  for (int v = 0; v < NV; ++v)
    for (int r0 = 0; r0 < MR; r0 += 4) {
      __m256 acc[4][2];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t k = kb; k < ke; ++k) {
        __m256 b0 = _mm256_loadu_ps(B + k * ldb + 16 * v), b1 = _mm256_loadu_ps(B + k * ldb + 16 * v + 8);
        __asm__("" : "+x"(b0), "+x"(b1));
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const __m256 a = _mm256_set1_ps(A[(r0 + r) * ars + k * aks]);
          acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h) {
          float* cp = Cm + (r0 + r) * ldc + 16 * v + 8 * h;
          __m256 c = _mm256_mul_ps(al, acc[r][h]);
          if (accumulate) c = _mm256_add_ps(c, _mm256_loadu_ps(cp));
          _mm256_storeu_ps(cp, c);
        }
    }
}

// The widest of the two this CPU runs (HS_MAX_ISA included), chosen once.
bool wide_vectors() {
  static const bool wide = cpu::allows(cpu::Level::Avx512);
  return wide;
}

template <int MR, int NV>
inline void gemm_block(int64_t kb, int64_t ke, const float* A, int64_t ars, int64_t aks, const float* B, int64_t ldb,
                       float* Cm, int64_t ldc, float alpha, bool accumulate) {
  if (wide_vectors()) gemm_block_avx512<MR, NV>(kb, ke, A, ars, aks, B, ldb, Cm, ldc, alpha, accumulate);
  else gemm_block_avx2<MR, NV>(kb, ke, A, ars, aks, B, ldb, Cm, ldc, alpha, accumulate);
}

// The register blocks of Cm[M, N] = op(A)[M, K] B[K, N] (N % 16 == 0, M % 4 == 0 in kMR-row blocks, 8-row ones
// where at most two vectors are wanted), visited in order: run(mr, nv, i0, j0, kb, ke) for each block of mr rows
// from i0 and nv 16-column vectors from j0, reading k in [kb, ke) (kb, ke even: rows blocks start at multiples of 4).
// Column panels outermost: a K x 64 panel of B (32 KiB at K = 128) stays in L1 while A's rows stream by.
// out == Tri::Lower: only the lower triangle of Cm (j <= i) is wanted; each block of rows stops at the 16-column
// group holding its diagonal, so entries above the diagonal are partly computed and partly left untouched
// (stale): a consumer must mask them, never multiply them by zero.
template <typename Run>
void for_each_block(int64_t M, int64_t N, int64_t K, Tri tri, Tri out, Run&& run) {
  for (int64_t j0 = 0; j0 < N; j0 += 64) {
    for (int64_t i0 = 0; i0 < M;) {
      // Narrow blocks (one or two vectors wide) take 8 rows, to keep enough independent accumulators.
      auto width = [&](int64_t mr) {
        const int64_t n_end = out == Tri::Lower ? std::min(N, round_up(i0 + mr, 16)) : N;
        return j0 >= n_end ? int64_t{0} : std::min<int64_t>(64, n_end - j0) / 16;
      };
      const int64_t nv8 = i0 % 8 == 0 && i0 + 8 <= M ? width(8) : 4;
      const int64_t mr = nv8 <= 2 ? 8 : kMR;
      const int64_t nv = mr == 8 ? nv8 : width(kMR);
      if (nv > 0) {
        const int64_t kb = tri == Tri::Upper ? std::min(i0, K) : 0;
        const int64_t ke = tri == Tri::Lower ? std::min(i0 + mr, K) : K;
        run(mr, nv, i0, j0, kb, ke);
      }
      i0 += mr;
    }
  }
}

// Calls kernel.template operator()<MR, NV>() for the block shape (mr, nv) for_each_block chose.
template <typename Kernel>
void dispatch_block(int64_t mr, int64_t nv, Kernel&& kernel) {
  if (mr == 8) {
    if (nv == 2)
      kernel.template operator()<8, 2>();
    else
      kernel.template operator()<8, 1>();
    return;
  }
  switch (nv) {
    case 4: kernel.template operator()<kMR, 4>(); break;
    case 3: kernel.template operator()<kMR, 3>(); break;
    case 2: kernel.template operator()<kMR, 2>(); break;
    default: kernel.template operator()<kMR, 1>(); break;
  }
}

// Cm[M, N] (= or +=) alpha op(A)[M, K] B[K, N] in fp32; A is [M, K] (lda) or, with ta, [K, M]. N % 16 == 0.
void gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, bool ta, const float* B, int64_t ldb,
              float* Cm, int64_t ldc, float alpha, bool accumulate, Tri tri, Tri out) {
  const int64_t ars = ta ? 1 : lda, aks = ta ? lda : 1;
  for_each_block(M, N, K, tri, out, [&](int64_t mr, int64_t nv, int64_t i0, int64_t j0, int64_t kb, int64_t ke) {
    const float* a = A + i0 * ars;
    const float* b = B + j0;
    float* c = Cm + i0 * ldc + j0;
    dispatch_block(mr, nv, [&]<int MR, int NV>() {
      gemm_block<MR, NV>(kb, ke, a, ars, aks, b, ldb, c, ldc, alpha, accumulate);
    });
  });
}

// ---- bf16-input products (AVX-512-BF16), fp32 accumulation ------------------------------------------------
// vdpbf16ps multiplies pairs of bf16 along k exactly and adds both products into an fp32 lane, so a product
// reads A as pairs (A[i, k], A[i, k + 1]) broadcast as one 32-bit value and B as rows of pairs: B2[k / 2, n] =
// (B[k, n], B[k + 1, n]) ("VNNI" layout). Operands are rounded to bf16 (nearest even) when they are packed; every
// K here (64, dk and dv rounded up to 16) is even. Only compiled into functions with the target attribute and
// called after a run-time check of the CPU, whatever -march says.
#if defined(__x86_64__) && defined(__GNUC__)
#define HS_DELTA_BF16 1
#define HS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int MR, int NV>
HS_BF16_TARGET __attribute__((noinline)) void gemm_block_bf16(int64_t kb, int64_t ke, const int32_t* A, int64_t ars,
                                                              int64_t aks, const int32_t* B, int64_t ldb, float* Cm,
                                                              int64_t ldc, float alpha, bool accumulate) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = kb; k < ke; ++k) {  // k counts pairs
    __m512bh b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + k * ldb + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(A[r * ars + k * aks]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cp = Cm + r * ldc + 16 * v;
      __m512 c = _mm512_mul_ps(al, acc[r][v]);
      if (accumulate) c = _mm512_add_ps(c, _mm512_loadu_ps(cp));
      _mm512_storeu_ps(cp, c);
    }
}

// dst[i, 0 .. K/2) = the pairs of row i of src [M, K] (lds) in bf16: a row-major A operand. K % 16 == 0.
HS_BF16_TARGET void pack_rows_bf16(int64_t M, int64_t K, const float* src, int64_t lds, int32_t* dst) {
  for (int64_t i = 0; i < M; ++i) {
    const float* s = src + i * lds;
    int32_t* d = dst + i * (K / 2);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
      _mm512_storeu_si512(d + k / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + k + 16), _mm512_loadu_ps(s + k)));
    if (k < K) _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + k)));
  }
}

// dst[k / 2, n] = (src[k, n], src[k + 1, n]) in bf16 for src [K, N] (lds): a B operand, or a transposed A one
// (then pair (i, k) sits at dst[k / 2, i]). K even, N % 16 == 0.
HS_BF16_TARGET void pack_pairs_bf16(int64_t K, int64_t N, const float* src, int64_t lds, int32_t* dst) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t k = 0; k < K; k += 2) {
    const float* s0 = src + k * lds;
    const float* s1 = s0 + lds;
    int32_t* d = dst + (k / 2) * N;
    for (int64_t n = 0; n < N; n += 16) {
      // words 0-15: row k, 16-31: row k + 1; then interleaved into pairs.
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s1 + n), _mm512_loadu_ps(s0 + n));
      _mm512_storeu_si512(d + n, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}
#endif

// Whether this CPU runs the bf16-input products (kernels/cpu.h: HS_MAX_ISA included) and HS_DELTA_RULE_BF16_PRODUCTS is not "off" (read
// at every kernel call, so that a test can take the fallback on a CPU that has them).
bool cpu_has_bf16_products() {
#if defined(HS_DELTA_BF16)
  static const bool has = cpu::allows(cpu::Level::Avx512Bf16);
  const char* cap = std::getenv("HS_DELTA_RULE_BF16_PRODUCTS");
  return has && !(cap && std::strcmp(cap, "off") == 0);
#else
  return false;
#endif
}

// The largest operand one product packs: a pack holds at most max(64, dkp, dvp)^2 bf16 (half as many floats).
int64_t pack_floats(int64_t dkp, int64_t dvp) {
  const int64_t d = std::max({C, dkp, dvp});
  return d * d / 2;
}

// The products of one thread's chunk work: fp32, or bf16 inputs packed into its own two pack buffers.
struct Products {
  bool bf16 = false;
  int32_t *pa = nullptr, *pb = nullptr;

  void operator()(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, bool ta, const float* B, int64_t ldb,
                  float* Cm, int64_t ldc, float alpha = 1.0f, bool accumulate = false, Tri tri = Tri::None,
                  Tri out = Tri::None) const {
#if defined(HS_DELTA_BF16)
    if (bf16) {
      // Only the k range a triangular A reads is packed and read; the rest of the pack stays unread.
      if (ta)
        pack_pairs_bf16(K, M, A, lda, pa);
      else
        pack_rows_bf16(M, K, A, lda, pa);
      pack_pairs_bf16(K, N, B, ldb, pb);
      const int64_t ars = ta ? 1 : K / 2, aks = ta ? M : 1;
      for_each_block(M, N, K, tri, out, [&](int64_t mr, int64_t nv, int64_t i0, int64_t j0, int64_t kb, int64_t ke) {
        const int32_t* a = pa + i0 * ars;
        const int32_t* b = pb + j0;
        float* c = Cm + i0 * ldc + j0;
        dispatch_block(mr, nv, [&]<int MR, int NV>() {
          gemm_block_bf16<MR, NV>(kb / 2, ke / 2, a, ars, aks, b, N, c, ldc, alpha, accumulate);
        });
      });
      return;
    }
#endif
    gemm_f32(M, N, K, A, lda, ta, B, ldb, Cm, ldc, alpha, accumulate, tri, out);
  }
};

// dst[cols, rows] = src[rows, cols]^T, rows and cols multiples of 16, through a 16x16 tile on the stack
// (twice as fast as the plain strided loop).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void transpose16_avx512(const float* src, int64_t lds,
                                                                                     float* dst, int64_t ldd,
                                                                                     int64_t i0, int64_t j0) {
      // In registers: pairs, then quads, then 128-bit lanes twice (48 shuffles for 256 floats).
      const float* s0 = src + i0 * lds + j0;
      __m512 r[16], t[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(s0 + i * lds);
      for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 16; i += 8)
        for (int c = 0; c < 4; ++c) {
          t[i + c] = _mm512_shuffle_f32x4(r[i + c], r[i + 4 + c], 0x88);
          t[i + 4 + c] = _mm512_shuffle_f32x4(r[i + c], r[i + 4 + c], 0xDD);
        }
      for (int c = 0; c < 8; ++c) {
        r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
      }
      float* d0 = dst + j0 * ldd + i0;
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(d0 + j * ldd, r[j]);
}

void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t i0, int64_t j0) {
      float tile[kLanes][kLanes];
      for (int64_t i = 0; i < kLanes; ++i)
        for (int64_t j = 0; j < kLanes; ++j) tile[j][i] = src[(i0 + i) * lds + j0 + j];
      for (int64_t j = 0; j < kLanes; ++j)
        for (int64_t i = 0; i < kLanes; ++i) dst[(j0 + j) * ldd + i0 + i] = tile[j][i];
}

void transpose(const float* src, int64_t rows, int64_t cols, int64_t lds, float* dst, int64_t ldd) {
  const bool wide = wide_vectors();
  for (int64_t i0 = 0; i0 < rows; i0 += kLanes)
    for (int64_t j0 = 0; j0 < cols; j0 += kLanes) {
      if (wide) transpose16_avx512(src, lds, dst, ldd, i0, j0);
      else transpose16(src, lds, dst, ldd, i0, j0);
    }
}

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// dst[i, :] = scale[i] * src[i, :] for C rows of width d (leading dimension d).
void scale_rows(const float* scale, const float* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < C; ++i) {
    const float s = scale[i];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) dst[i * d + j] = s * src[i * d + j];
  }
}

// ---- Masked lower-triangle passes ----------------------------------------------------------------------
// Elementwise work on C x C tiles runs only over the 16-column groups up to the diagonal, with the lanes past it
// masked to zero (GCC splits `j <= i ? ... : 0` loops into scalar pieces instead of vectorising them).

using i32x16 = int32_t __attribute__((vector_size(64)));

// dst[0, 16) = s a b in the lanes j0 + l <= last, 0 elsewhere (dst may be a or b). Vectors stay local: no
// function passes or returns one (the ABI for that depends on the target).
inline void mul_masked(float* dst, const float* a, const float* b, float s, int64_t j0, int64_t last) {
  const i32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const i32x16 m = (iota + static_cast<int32_t>(j0)) <= static_cast<int32_t>(last);
  f32x16 x, y;
  std::memcpy(&x, a, sizeof x);
  std::memcpy(&y, b, sizeof y);
  x = reinterpret_cast<f32x16>(reinterpret_cast<i32x16>(s * x * y) & m);
  std::memcpy(dst, &x, sizeof x);
}

// sum_l a[l] b[l] over the lanes j0 + l <= last.
inline float dot_masked(const float* a, const float* b, int64_t j0, int64_t last) {
  const i32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const i32x16 m = (iota + static_cast<int32_t>(j0)) <= static_cast<int32_t>(last);
  f32x16 x, y;
  std::memcpy(&x, a, sizeof x);
  std::memcpy(&y, b, sizeof y);
  x = reinterpret_cast<f32x16>(reinterpret_cast<i32x16>(x * y) & m);
  float sum = 0.0f;
  for (int l = 0; l < 16; ++l) sum += x[l];
  return sum;
}

inline void zero16(float* dst) { std::fill_n(dst, 16, 0.0f); }

// ---- Chunk tiles ------------------------------------------------------------------------------------------

// Rows [t0, t0 + n) of one head of a [B, T, H, d] tensor (row stride `stride`) into a zero-padded C x dp tile.
// Widens a row of n bf16 (exactly: the bits move to the top half) or copies floats.
inline void widen_row(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen_row(const bf16* src, int64_t n, float* dst) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = to_f32(src[j]);
}

template <typename S>
void load_tile(const S* src, int64_t stride, int64_t n, int64_t d, float* dst, int64_t dp) {
  for (int64_t i = 0; i < C; ++i) {
    float* row = dst + i * dp;
    int64_t j = 0;
    if (i < n) {
      widen_row(src + i * stride, d, row);
      j = d;
    }
    for (; j < dp; ++j) row[j] = 0.0f;
  }
}

// Per-thread carving of one workspace block; with a null base it only counts (planning, sizing).
class Carver {
 public:
  explicit Carver(float* base) : base_(base) {}
  float* take(int64_t n) {
    float* p = base_ ? base_ + used_ : nullptr;
    used_ += round_up(n, kLanes);  // keeps every piece 64-byte aligned
    return p;
  }
  int64_t used() const { return used_; }

 private:
  float* base_;
  int64_t used_ = 0;
};

// What one chunk needs in both directions: inputs as fp32 tiles and the gate-derived factors.
struct ChunkTiles {
  int64_t dkp, dvp;
  float *q, *k, *v, *kt, *beta, *G, *eG, *eKd, *D, *kkt, *tinv, *kbg, *bv, *qg, *kd, *qkt;
  const float* T = nullptr;  // the chunk's Tinv in use: tinv, or the forward's saved copy
  Products mm;               // this thread's products (bf16: with its pack buffers)
  ChunkTiles(Carver& cv, int64_t dkp_, int64_t dvp_, bool bf16) : dkp(dkp_), dvp(dvp_) {
    if (bf16) {
      mm.bf16 = true;
      mm.pa = reinterpret_cast<int32_t*>(cv.take(pack_floats(dkp, dvp)));
      mm.pb = reinterpret_cast<int32_t*>(cv.take(pack_floats(dkp, dvp)));
    }
    q = cv.take(C * dkp);
    k = cv.take(C * dkp);
    v = cv.take(C * dvp);
    kt = cv.take(dkp * C);
    beta = cv.take(C);
    G = cv.take(C);
    eG = cv.take(C);
    eKd = cv.take(C);
    D = cv.take(C * C);
    kkt = cv.take(C * C);
    tinv = cv.take(C * C);
    kbg = cv.take(C * dkp);
    bv = cv.take(C * dvp);
    qg = cv.take(C * dkp);
    kd = cv.take(C * dkp);
    qkt = cv.take(C * C);
  }

  float gl() const { return G[C - 1]; }

  // exp(G) and exp(G_last - G), the factors on the chunk-start state and on the keys written to the end state.
  void state_decays() {
    const float last = gl();
#pragma omp simd
    for (int64_t i = 0; i < C; ++i) {
      eG[i] = exp_nonpositive(G[i]);
      eKd[i] = exp_nonpositive(last - G[i]);
    }
  }

  // D: lower triangle including the diagonal, zeros above (the exps only up to the diagonal's 16 columns).
  void decay_matrix() {
    for (int64_t i = 0; i < C; ++i) {
      float* row = D + i * C;
      const float gi = G[i];
      const int64_t e = round_up(i + 1, kLanes);
#pragma omp simd
      for (int64_t j = 0; j < e; ++j) row[j] = j <= i ? exp_nonpositive(gi - G[j]) : 0.0f;
      std::fill(row + e, row + C, 0.0f);
    }
  }

  // The WY operands: beta exp(G) K and beta V.
  void wy_operands() {
    for (int64_t i = 0; i < C; ++i) {
      const float s = beta[i] * eG[i], b = beta[i];
#pragma omp simd
      for (int64_t j = 0; j < dkp; ++j) kbg[i * dkp + j] = s * k[i * dkp + j];
#pragma omp simd
      for (int64_t j = 0; j < dvp; ++j) bv[i * dvp + j] = b * v[i * dvp + j];
    }
  }
};

// X = X o D on and below the diagonal, zeros above (X may hold anything there).
void mask_decay(float* X, const float* D) {
  for (int64_t i = 0; i < C; ++i)
    for (int64_t j0 = 0; j0 < C; j0 += kLanes) {
      const int64_t o = i * C + j0;
      if (j0 > i)
        zero16(X + o);
      else
        mul_masked(X + o, X + o, D + o, 1.0f, j0, i);
    }
}

// Tinv = (I + M)^-1 for strictly lower M by forward substitution: row i = e_i - sum_{j<i} M_ij row j.
// Right-looking: once row j is final it is subtracted from every later row, so the updates of one step are
// independent (no chain through one row's accumulators); row j is zero beyond column j, so only its first
// round_up(j + 1, 16) columns move. Each row still sums its terms in order j = 0, 1, ...
void unit_lower_inverse(const float* M, float* Tinv) {
  std::fill_n(Tinv, C * C, 0.0f);
  for (int64_t i = 0; i < C; ++i) Tinv[i * C + i] = 1.0f;
  for (int64_t j = 0; j < C - 1; ++j) {
    const float* tj = Tinv + j * C;
    const int64_t e = round_up(j + 1, kLanes);
    for (int64_t i = j + 1; i < C; ++i) {
      const float m = M[i * C + j];
      float* ti = Tinv + i * C;
#pragma omp simd
      for (int64_t l = 0; l < e; ++l) ti[l] -= m * tj[l];
    }
  }
}

// Asks for the cache lines of rows [t0, t0 + 64) of one head of a [B, T, H, d] tensor (clipped to the sequence)
// ahead of their use: the rows of a head are strided, which the hardware prefetchers follow poorly.
template <typename S>
void prefetch_chunk(const S* base, int64_t stride, int64_t rows, int64_t d, bool for_write) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(S));
  for (int64_t i = 0; i < rows; ++i) {
    const char* row = reinterpret_cast<const char*>(base + i * stride);
    for (int64_t b = 0; b < bytes; b += 64) {
      if (for_write)
        __builtin_prefetch(row + b, 1);
      else
        __builtin_prefetch(row + b, 0);
    }
  }
}

// Indexing of one (batch, value head) in the [B, T, H, d] inputs.
struct HeadView {
  const DeltaRuleShape& s;
  int64_t b, h;
  int64_t kh() const { return h / s.ratio(); }
  int64_t qk_offset(int64_t t) const { return ((b * s.seq + t) * s.k_heads + kh()) * s.dk; }
  int64_t qk_stride() const { return s.k_heads * s.dk; }
  int64_t vo_offset(int64_t t) const { return ((b * s.seq + t) * s.v_heads + h) * s.dv; }
  int64_t vo_stride() const { return s.v_heads * s.dv; }
  int64_t gate_offset(int64_t t) const { return (b * s.seq + t) * s.v_heads + h; }
  int64_t rows(int64_t c) const {
    return c < 0 || c >= s.chunks() ? 0 : std::min(kDeltaRuleChunk, s.seq - c * kDeltaRuleChunk);
  }
  // Prefetches chunk c (if it exists) of q (unless null), k and v.
  template <typename T>
  void prefetch_inputs(int64_t c, const T* q, const T* k, const T* v) const {
    const int64_t n = rows(c), t0 = c * kDeltaRuleChunk;
    if (n == 0) return;
    if (q) prefetch_chunk(q + qk_offset(t0), qk_stride(), n, s.dk, false);
    prefetch_chunk(k + qk_offset(t0), qk_stride(), n, s.dk, false);
    prefetch_chunk(v + vo_offset(t0), vo_stride(), n, s.dv, false);
  }
};

// The bf16-input products run when asked for, the storage is bf16 and the CPU has AVX-512-BF16; else fp32.
template <typename T>
bool bf16_products(DeltaRuleProducts p) {
  return p == DeltaRuleProducts::Bf16 && std::is_same_v<T, bf16> && cpu_has_bf16_products();
}

void check_shape(const DeltaRuleShape& s) {
  if (s.batch < 0 || s.seq < 0 || s.k_heads <= 0 || s.v_heads <= 0 || s.dk <= 0 || s.dv <= 0 ||
      s.v_heads % s.k_heads != 0)
    throw std::invalid_argument("delta_rule: bad shape (v_heads must be a multiple of k_heads, dims > 0)");
}

// Threads used: one (batch, value head) at a time each, so never more than there are heads.
int64_t worker_count(const DeltaRuleShape& s) {
  return std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), s.batch * s.v_heads));
}

// ---- Forward ----------------------------------------------------------------------------------------------

struct ForwardScratch {
  ChunkTiles t;
  float *S, *W, *vn, *out;
  ForwardScratch(Carver& cv, int64_t dkp, int64_t dvp, bool bf16) : t(cv, dkp, dvp, bf16) {
    S = cv.take(dkp * dvp);
    W = cv.take(C * dkp);
    vn = cv.take(C * dvp);
    out = cv.take(C * dvp);
  }
};

// Loads chunk c of one head: q (unless null), k, v and beta; padded steps are zeros.
template <typename T>
void load_chunk(const HeadView& hv, int64_t c, const T* q, const T* k, const T* v, const float* beta, ChunkTiles& t) {
  const int64_t t0 = c * C, n = std::min(C, hv.s.seq - t0);
  if (q) load_tile(q + hv.qk_offset(t0), hv.qk_stride(), n, hv.s.dk, t.q, t.dkp);
  load_tile(k + hv.qk_offset(t0), hv.qk_stride(), n, hv.s.dk, t.k, t.dkp);
  load_tile(v + hv.vo_offset(t0), hv.vo_stride(), n, hv.s.dv, t.v, t.dvp);
  for (int64_t i = 0; i < C; ++i) t.beta[i] = i < n ? beta[hv.gate_offset(t0 + i)] : 0.0f;
}

// The chunk's Vn = U - W S0 from Tinv and the start state S0, then (unless S1 is null: the last chunk, whose
// end state nobody reads) the end state S1, which may be S0 itself.
// S0 == nullptr stands for a zero start state (the first chunk).
void chunk_values_and_state(ChunkTiles& t, float* W, float* vn, const float* S0, float* S1) {
  t.wy_operands();
  t.mm(C, t.dkp, C, t.T, C, false, t.kbg, t.dkp, W, t.dkp, 1.0f, false, Tri::Lower);
  t.mm(C, t.dvp, C, t.T, C, false, t.bv, t.dvp, vn, t.dvp, 1.0f, false, Tri::Lower);
  if (S0) t.mm(C, t.dvp, t.dkp, W, t.dkp, false, S0, t.dvp, vn, t.dvp, -1.0f, true);
  if (!S1) return;
  scale_rows(t.eKd, t.k, t.kd, t.dkp);
  const float decay = exp_nonpositive(t.gl());
  const int64_t n = t.dkp * t.dvp;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) S1[i] = S0 ? decay * S0[i] : 0.0f;
  t.mm(t.dkp, t.dvp, C, t.kd, t.dkp, true, vn, t.dvp, S1, t.dvp, 1.0f, true);
}

// states (optional): where to keep every chunk's W, V_new and start state (DeltaRuleSaved's layout for this head).
struct ChunkStates {
  float *W = nullptr, *vn = nullptr, *S = nullptr;
};

// carry (optional, [dk, dv] unpadded): the head's start state on entry, its end state on return (decoding).
template <typename T>
void forward_head(const HeadView& hv, const T* q, const T* k, const T* v, const float* beta, const float* g, T* o,
                  float* tinv_out, float* gcum_out, const ChunkStates& keep, ForwardScratch& w,
                  float* carry = nullptr) {
  ChunkTiles& t = w.t;
  const int64_t dkp = t.dkp, dvp = t.dvp, nchunks = hv.s.chunks(), nS = dkp * dvp;
  const int64_t dk = hv.s.dk, dv = hv.s.dv;
  if (carry) {  // the scratch state, zero-padded, advances in place from the carried one
    std::fill_n(w.S, nS, 0.0f);
    for (int64_t i = 0; i < dk; ++i) std::copy_n(carry + i * dv, dv, w.S + i * dvp);
  }
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t t0 = c * C, n = std::min(C, hv.s.seq - t0);
    load_chunk(hv, c, q, k, v, beta, t);
    hv.prefetch_inputs(c + 1, q, k, v);
    float acc = 0.0f;
    for (int64_t i = 0; i < C; ++i) t.G[i] = acc += i < n ? g[hv.gate_offset(t0 + i)] : 0.0f;
    t.state_decays();
    t.decay_matrix();

    transpose(t.k, C, dkp, dkp, t.kt, C);
    t.mm(C, C, dkp, t.k, dkp, false, t.kt, C, t.kkt, C, 1.0f, false, Tri::None, Tri::Lower);
    float* M = t.qkt;  // scratch until Q K^T is formed below
    for (int64_t i = 1; i < C; ++i)  // unit_lower_inverse reads M only below the diagonal
      for (int64_t j0 = 0; j0 < i; j0 += kLanes) {
        const int64_t at = i * C + j0;
        mul_masked(M + at, t.kkt + at, t.D + at, t.beta[i], j0, i - 1);
      }
    float* tinv = tinv_out ? tinv_out + c * C * C : t.tinv;
    unit_lower_inverse(M, tinv);
    t.T = tinv;
    if (gcum_out) std::copy_n(t.G, C, gcum_out + t0);

    // O = (exp(G) Q) S0 + P Vn with the state at chunk start, before it advances.
    // The first chunk starts from a zero state (the state is only written at its end). Kept states go to their
    // own slots; otherwise the scratch state advances in place.
    const float* S0 = c == 0 && !carry ? nullptr : keep.S ? keep.S + c * nS : w.S;
    float* S1 = c + 1 == nchunks && !carry ? nullptr : keep.S ? keep.S + (c + 1) * nS : w.S;
    float* Wc = keep.W ? keep.W + c * C * dkp : w.W;
    float* vn = keep.vn ? keep.vn + c * C * dvp : w.vn;
    if (S0) {
      scale_rows(t.eG, t.q, t.qg, dkp);
      t.mm(C, dvp, dkp, t.qg, dkp, false, S0, dvp, w.out, dvp);
    }
    chunk_values_and_state(t, Wc, vn, S0, S1);
    t.mm(C, C, dkp, t.q, dkp, false, t.kt, C, t.qkt, C, 1.0f, false, Tri::None, Tri::Lower);
    mask_decay(t.qkt, t.D);
    t.mm(C, dvp, C, t.qkt, C, false, vn, dvp, w.out, dvp, 1.0f, S0 != nullptr, Tri::Lower);

    T* dst = o + hv.vo_offset(t0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < hv.s.dv; ++j) dst[i * hv.vo_stride() + j] = from_f32<T>(w.out[i * dvp + j]);
  }
  if (carry)
    for (int64_t i = 0; i < dk; ++i) std::copy_n(w.S + i * dvp, dv, carry + i * dv);
}

// ---- Backward ---------------------------------------------------------------------------------------------

struct BackwardScratch {
  ChunkTiles t;
  // Whole head: W and Vn of every chunk, and every chunk's start state.
  float *W_all, *vn_all, *S_all;
  float *dS, *dSt, *S0t, *vnt, *bvt, *kbgt, *tinvt, *dO, *dvn, *dqg, *dq, *dk, *dv, *dP, *dkd, *X, *dM,
      *dbv, *dkbg, *dbeta, *dG;
  // recompute: room for the head's W, Vn and start states (not needed when the forward kept them).
  BackwardScratch(Carver& cv, int64_t dkp, int64_t dvp, int64_t nchunks, bool recompute, bool bf16)
      : t(cv, dkp, dvp, bf16) {
    W_all = recompute ? cv.take(nchunks * C * dkp) : nullptr;
    vn_all = recompute ? cv.take(nchunks * C * dvp) : nullptr;
    S_all = recompute ? cv.take(nchunks * dkp * dvp) : nullptr;
    dS = cv.take(dkp * dvp);
    dSt = cv.take(dvp * dkp);
    S0t = cv.take(dvp * dkp);
    vnt = cv.take(dvp * C);
    bvt = cv.take(dvp * C);
    kbgt = cv.take(dkp * C);
    tinvt = cv.take(C * C);
    dO = cv.take(C * dvp);
    dvn = cv.take(C * dvp);
    dqg = cv.take(C * dkp);
    dq = cv.take(C * dkp);
    dk = cv.take(C * dkp);
    dv = cv.take(C * dvp);
    dP = cv.take(C * C);
    dkd = cv.take(C * dkp);
    X = cv.take(C * C);
    dM = cv.take(C * C);
    dbv = cv.take(C * dvp);
    dkbg = cv.take(C * dkp);
    dbeta = cv.take(C);
    dG = cv.take(C);
  }
};

// dG_i += rowsum_i(F) - colsum_i(F) for F = dX o X with X_ij = Y_ij exp(G_i - G_j): the gate enters X only
// through the difference G_i - G_j.
void decay_gate_grad(const float* F, float* dG) {
  for (int64_t i = 0; i < C; ++i) {
    float row = 0.0f;
#pragma omp simd reduction(+ : row)
    for (int64_t j = 0; j < C; ++j) row += F[i * C + j];
    dG[i] += row;
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) dG[j] -= F[i * C + j];
  }
}

// Gradients of one chunk given d_o and dS = the gradient of the chunk's end state; leaves dS as the
// gradient of its start state. Tiles t hold the chunk's inputs and gate factors; W, vn, S0 come from the
// forward pass over the head.
// S0 == nullptr: the first chunk, whose start state is zero; ds_zero: the last chunk (dS1 = 0). Terms known
// to be zero are skipped.
void chunk_backward(BackwardScratch& w, const float* W, const float* vn, const float* S0, bool ds_zero) {
  ChunkTiles& t = w.t;
  const int64_t dkp = t.dkp, dvp = t.dvp;
  float* P = t.qkt;
  float* dG = w.dG;
  std::fill_n(dG, C, 0.0f);
  std::fill_n(w.dbeta, C, 0.0f);

  transpose(t.k, C, dkp, dkp, t.kt, C);
  t.mm(C, C, dkp, t.q, dkp, false, t.kt, C, P, C, 1.0f, false, Tri::None, Tri::Lower);
  mask_decay(P, t.D);
  t.mm(C, C, dkp, t.k, dkp, false, t.kt, C, t.kkt, C, 1.0f, false, Tri::None, Tri::Lower);
  scale_rows(t.eG, t.q, t.qg, dkp);
  scale_rows(t.eKd, t.k, t.kd, dkp);
  t.wy_operands();

  // dVn = P^T dO + Kd dS1.
  t.mm(C, dvp, C, P, C, true, w.dO, dvp, w.dvn, dvp, 1.0f, false, Tri::Upper);
  if (!ds_zero) t.mm(C, dvp, dkp, t.kd, dkp, false, w.dS, dvp, w.dvn, dvp, 1.0f, true);

  // Through O = Qg S0: dQg = dO S0^T.
  if (S0) {
    transpose(S0, dkp, dvp, dvp, w.S0t, dkp);
    t.mm(C, dkp, dvp, w.dO, dvp, false, w.S0t, dkp, w.dqg, dkp);
    for (int64_t i = 0; i < C; ++i) {
      dG[i] += dot(t.qg + i * dkp, w.dqg + i * dkp, dkp);
      const float e = t.eG[i];
#pragma omp simd
      for (int64_t j = 0; j < dkp; ++j) w.dq[i * dkp + j] = e * w.dqg[i * dkp + j];
    }
  } else {
    std::fill_n(w.dq, C * dkp, 0.0f);
  }

  // Through O += P Vn: dP = dO Vn^T (lower), then P = (Q K^T) o D.
  transpose(vn, C, dvp, dvp, w.vnt, C);
  t.mm(C, C, dvp, w.dO, dvp, false, w.vnt, C, w.dP, C, 1.0f, false, Tri::None, Tri::Lower);
  for (int64_t i = 0; i < C; ++i)
    for (int64_t j0 = 0; j0 < C; j0 += kLanes) {
      const int64_t o = i * C + j0;
      if (j0 > i) {
        zero16(w.X + o);
        zero16(w.dP + o);
        continue;
      }
      mul_masked(w.X + o, w.dP + o, P + o, 1.0f, j0, i);  // before dP is overwritten
      mul_masked(w.dP + o, w.dP + o, t.D + o, 1.0f, j0, i);
    }
  decay_gate_grad(w.X, dG);
  t.mm(C, dkp, C, w.dP, C, false, t.k, dkp, w.dq, dkp, 1.0f, true, Tri::Lower);
  t.mm(C, dkp, C, w.dP, C, true, t.q, dkp, w.dk, dkp, 1.0f, false, Tri::Upper);

  // Through S1 = exp(G_last) S0 + Kd^T Vn with Kd = exp(G_last - G) K.
  const float gl = t.gl(), decay = exp_nonpositive(gl);
  if (!ds_zero) {
    transpose(w.dS, dkp, dvp, dvp, w.dSt, dkp);
    t.mm(C, dkp, dvp, vn, dvp, false, w.dSt, dkp, w.dkd, dkp);
    float dgl = S0 ? decay * dot(w.dS, S0, dkp * dvp) : 0.0f;
    for (int64_t i = 0; i < C; ++i) {
      const float x = dot(t.kd + i * dkp, w.dkd + i * dkp, dkp);
      dG[i] -= x;
      dgl += x;
      const float e = t.eKd[i];
#pragma omp simd
      for (int64_t j = 0; j < dkp; ++j) w.dk[i * dkp + j] += e * w.dkd[i * dkp + j];
    }
    dG[C - 1] += dgl;
  }

  // Through Vn = U - W S0 the state gradient moves to the chunk start.
  const int64_t nS = dkp * dvp;
#pragma omp simd
  for (int64_t i = 0; i < nS; ++i) w.dS[i] = ds_zero ? 0.0f : decay * w.dS[i];
  t.mm(dkp, dvp, C, t.qg, dkp, true, w.dO, dvp, w.dS, dvp, 1.0f, true);
  t.mm(dkp, dvp, C, W, dkp, true, w.dvn, dvp, w.dS, dvp, -1.0f, true);

  // Through U = Tinv (beta V) and W = Tinv Kbg: d(beta V) = Tinv^T dU, and with dW = -dU S0^T,
  // dKbg = Tinv^T dW = -d(beta V) S0^T.
  t.mm(C, dvp, C, t.T, C, true, w.dvn, dvp, w.dbv, dvp, 1.0f, false, Tri::Upper);
  if (S0)
    t.mm(C, dkp, dvp, w.dbv, dvp, false, w.S0t, dkp, w.dkbg, dkp, -1.0f);
  else
    std::fill_n(w.dkbg, C * dkp, 0.0f);
  for (int64_t i = 0; i < C; ++i) {
    const float b = t.beta[i], e = t.eG[i];
    const float* dbv = w.dbv + i * dvp;
    const float* dkbg = w.dkbg + i * dkp;
    w.dbeta[i] += dot(t.v + i * dvp, dbv, dvp) + e * dot(t.k + i * dkp, dkbg, dkp);
    dG[i] += dot(t.kbg + i * dkp, dkbg, dkp);
#pragma omp simd
    for (int64_t j = 0; j < dvp; ++j) w.dv[i * dvp + j] = b * dbv[j];
#pragma omp simd
    for (int64_t j = 0; j < dkp; ++j) w.dk[i * dkp + j] += b * e * dkbg[j];
  }

  // Through Tinv = (I + M)^-1 with dTinv = dU (beta V)^T + dW Kbg^T: dM = -Tinv^T dTinv Tinv^T, where
  // Tinv^T dTinv = d(beta V) (beta V)^T + dKbg Kbg^T; only its strictly lower part counts.
  // M = beta (K K^T) o D. The strictly lower dM_ij = -sum_b X_ib Tinv_jb reads X only at b <= j < i: both
  // products need just their lower triangles (what a row block computes above it is finite and meets zeros
  // of Tinv).
  transpose(t.bv, C, dvp, dvp, w.bvt, C);
  transpose(t.kbg, C, dkp, dkp, w.kbgt, C);
  t.mm(C, C, dvp, w.dbv, dvp, false, w.bvt, C, w.X, C, 1.0f, false, Tri::None, Tri::Lower);
  t.mm(C, C, dkp, w.dkbg, dkp, false, w.kbgt, C, w.X, C, 1.0f, true, Tri::None, Tri::Lower);
  transpose(t.T, C, C, C, w.tinvt, C);
  t.mm(C, C, C, w.X, C, false, w.tinvt, C, w.dM, C, -1.0f, false, Tri::Lower, Tri::Lower);
  float* E = w.dM;  // becomes beta_i dM_ij D_ij in place
  float* F = w.X;
  for (int64_t i = 0; i < C; ++i) {
    const float b = t.beta[i];
    float db = 0.0f;
    for (int64_t j0 = 0; j0 < C; j0 += kLanes) {
      const int64_t o = i * C + j0;
      if (j0 >= i) {  // nothing strictly below the diagonal here
        zero16(E + o);
        zero16(F + o);
        continue;
      }
      // t.kkt is stale above the diagonal: every read of it is masked.
      mul_masked(E + o, E + o, t.D + o, 1.0f, j0, i - 1);  // dM o D
      db += dot_masked(E + o, t.kkt + o, j0, i - 1);
      mul_masked(F + o, E + o, t.kkt + o, b, j0, i - 1);
      for (int64_t l = 0; l < kLanes; ++l) E[o + l] *= b;
    }
    w.dbeta[i] += db;
  }
  decay_gate_grad(F, dG);
  t.mm(C, dkp, C, E, C, false, t.k, dkp, w.dk, dkp, 1.0f, true, Tri::Lower);
  t.mm(C, dkp, C, E, C, true, t.k, dkp, w.dk, dkp, 1.0f, true, Tri::Upper);

  // G is the chunk-local cumulative sum of g.
  for (int64_t i = C - 2; i >= 0; --i) dG[i] += dG[i + 1];
}

// Where one head's dq, dk rows go: the outputs (added to) or a per-value-head partial (assigned).
struct GradTarget {
  float *dq, *dk;
  int64_t stride;
  bool assign;
};

template <typename T>
void backward_head(const HeadView& hv, const T* q, const T* k, const T* v, const float* beta, const float* tinv,
                   const float* gcum, const float* d_o, const GradTarget& dqk, float* dv, float* dbeta, float* dg,
                   bool assign_v, const ChunkStates& kept, BackwardScratch& w) {
  ChunkTiles& t = w.t;
  const DeltaRuleShape& s = hv.s;
  const int64_t dkp = t.dkp, dvp = t.dvp, nchunks = s.chunks();
  auto load = [&](int64_t c, const T* q_or_null) {
    load_chunk(hv, c, q_or_null, k, v, beta, t);
    std::copy_n(gcum + c * C, C, t.G);
    t.T = tinv + c * C * C;
    t.state_decays();
  };

  // Every chunk's start state, W and Vn: kept by the forward, or recomputed by a forward pass over the chunks.
  const int64_t nS = dkp * dvp;
  const float* W_all = kept.W ? kept.W : w.W_all;
  const float* vn_all = kept.vn ? kept.vn : w.vn_all;
  const float* S_all = kept.S ? kept.S : w.S_all;
  if (!kept.W)
    for (int64_t c = 0; c < nchunks; ++c) {
      load(c, nullptr);
      hv.prefetch_inputs(c + 1, static_cast<const T*>(nullptr), k, v);
      chunk_values_and_state(t, w.W_all + c * C * dkp, w.vn_all + c * C * dvp, c > 0 ? w.S_all + c * nS : nullptr,
                             c + 1 < nchunks ? w.S_all + (c + 1) * nS : nullptr);
    }

  // Reverse over the chunks carrying dS (zero after the last token: the final state is not an output).
  std::fill_n(w.dS, dkp * dvp, 0.0f);
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t t0 = c * C, n = std::min(C, s.seq - t0);
    load_tile(d_o + hv.vo_offset(t0), hv.vo_stride(), n, s.dv, w.dO, dvp);
    load(c, q);
    // This chunk's gradient rows (added to below) and the next chunk's inputs.
    prefetch_chunk(dqk.dq + t0 * dqk.stride, dqk.stride, n, s.dk, true);
    prefetch_chunk(dqk.dk + t0 * dqk.stride, dqk.stride, n, s.dk, true);
    prefetch_chunk(dv + hv.vo_offset(t0), hv.vo_stride(), n, s.dv, true);
    if (c > 0) {
      prefetch_chunk(d_o + hv.vo_offset(t0 - C), hv.vo_stride(), C, s.dv, false);
      hv.prefetch_inputs(c - 1, q, k, v);
    }
    t.decay_matrix();
    chunk_backward(w, W_all + c * C * dkp, vn_all + c * C * dvp, c > 0 ? S_all + c * nS : nullptr, c == nchunks - 1);
    for (int64_t i = 0; i < n; ++i) {
      float* dqr = dqk.dq + (t0 + i) * dqk.stride;
      float* dkr = dqk.dk + (t0 + i) * dqk.stride;
      float* dvr = dv + hv.vo_offset(t0 + i);
      for (int64_t j = 0; j < s.dk; ++j) {
        dqr[j] = (dqk.assign ? 0.0f : dqr[j]) + w.dq[i * dkp + j];
        dkr[j] = (dqk.assign ? 0.0f : dkr[j]) + w.dk[i * dkp + j];
      }
      // dv, dbeta, dg belong to this value head alone: written (assign_v) or added to.
      float* db = dbeta + hv.gate_offset(t0 + i);
      float* dgr = dg + hv.gate_offset(t0 + i);
      if (assign_v) {
        for (int64_t j = 0; j < s.dv; ++j) dvr[j] = w.dv[i * dvp + j];
        *db = w.dbeta[i];
        *dgr = w.dG[i];
      } else {
        for (int64_t j = 0; j < s.dv; ++j) dvr[j] += w.dv[i * dvp + j];
        *db += w.dbeta[i];
        *dgr += w.dG[i];
      }
    }
  }
}

// The forwards' per-thread scratch from the accountant (planned as well), then head(view, index, scratch) for every
// (sequence, value head) on the workers.
template <typename PerHead>
void for_each_head(const DeltaRuleShape& s, int64_t dkp, int64_t dvp, bool bf16, MemoryAccountant& mem,
                   PerHead&& head) {
  const int64_t heads = s.batch * s.v_heads;
  const int64_t workers = worker_count(s);
  Carver sizing(nullptr);
  ForwardScratch{sizing, dkp, dvp, bf16};
  const int64_t per_thread = sizing.used();
  Buffer ws = mem.allocate_n<float>(workers * per_thread, MemCategory::Workspace, "delta_rule.forward_scratch");
  if (mem.planning() || heads == 0 || s.seq == 0) return;

#pragma omp parallel num_threads(static_cast<int>(workers))
  {
    Carver cv(ws.as<float>() + omp_get_thread_num() * per_thread);
    ForwardScratch w(cv, dkp, dvp, bf16);
#pragma omp for schedule(static)
    for (int64_t hh = 0; hh < heads; ++hh) head(HeadView{s, hh / s.v_heads, hh % s.v_heads}, hh, w);
  }
}

}  // namespace

template <typename T>
void delta_rule_forward(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                        const float* g, T* o, DeltaRuleSaved* saved, MemoryAccountant& mem, bool keep_chunk_states,
                        DeltaRuleProducts products) {
  profile::Scope profile_scope(profile::Phase::DeltaRule, "delta_rule_forward");
  check_shape(s);
  const int64_t heads = s.batch * s.v_heads, nchunks = s.chunks();
  const int64_t dkp = round_up(s.dk, kLanes), dvp = round_up(s.dv, kLanes);
  const bool keep = saved && keep_chunk_states;
  if (saved) {
    saved->tinv = mem.allocate_n<float>(heads * nchunks * C * C, MemCategory::Activations, "delta_rule.tinv");
    saved->gcum = mem.allocate_n<float>(heads * nchunks * C, MemCategory::Activations, "delta_rule.gcum");
  }
  if (keep) {
    saved->W = mem.allocate_n<float>(heads * nchunks * C * dkp, MemCategory::Activations, "delta_rule.W");
    saved->vn = mem.allocate_n<float>(heads * nchunks * C * dvp, MemCategory::Activations, "delta_rule.vn");
    saved->S = mem.allocate_n<float>(heads * nchunks * dkp * dvp, MemCategory::Activations, "delta_rule.states");
  }
  for_each_head(s, dkp, dvp, bf16_products<T>(products), mem, [&](const HeadView& hv, int64_t hh, ForwardScratch& w) {
    float* tinv = saved ? saved->tinv.as<float>() + hh * nchunks * C * C : nullptr;
    float* gcum = saved ? saved->gcum.as<float>() + hh * nchunks * C : nullptr;
    ChunkStates states;
    if (keep)
      states = {saved->W.as<float>() + hh * nchunks * C * dkp, saved->vn.as<float>() + hh * nchunks * C * dvp,
                saved->S.as<float>() + hh * nchunks * dkp * dvp};
    forward_head(hv, q, k, v, beta, g, o, tinv, gcum, states, w);
  });
}

template <typename T>
void delta_rule_forward_cached(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                               const float* g, T* o, float* state, const int32_t* slots, MemoryAccountant& mem,
                               DeltaRuleProducts products) {
  profile::Scope profile_scope(profile::Phase::DeltaRule, "delta_rule_forward_cached");
  check_shape(s);
  const int64_t dkp = round_up(s.dk, kLanes), dvp = round_up(s.dv, kLanes);
  for_each_head(s, dkp, dvp, bf16_products<T>(products), mem, [&](const HeadView& hv, int64_t, ForwardScratch& w) {
    float* carry = state + (int64_t{slots[hv.b]} * s.v_heads + hv.h) * s.dk * s.dv;
    forward_head(hv, q, k, v, beta, g, o, nullptr, nullptr, ChunkStates{}, w, carry);
  });
}

template <typename T>
void delta_rule_backward(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                         const float* /*g: read back from saved.gcum*/, const DeltaRuleSaved& saved, const float* d_o,
                         float* dq, float* dk, float* dv, float* dbeta, float* dg, MemoryAccountant& mem,
                         bool accumulate, DeltaRuleProducts products) {
  profile::Scope profile_scope(profile::Phase::DeltaRule, "delta_rule_backward");
  check_shape(s);
  const int64_t heads = s.batch * s.v_heads, nchunks = s.chunks(), r = s.ratio();
  const int64_t dkp = round_up(s.dk, kLanes), dvp = round_up(s.dv, kLanes);
  if (!mem.planning() && heads > 0 &&
      (saved.tinv.bytes() != sizeof(float) * heads * nchunks * C * C ||
       saved.gcum.bytes() != sizeof(float) * heads * nchunks * C))
    throw std::invalid_argument("delta_rule_backward: saved buffers do not match the shape");
  const bool kept = !saved.W.empty();
  if (!mem.planning() && heads > 0 && kept &&
      (saved.W.bytes() != sizeof(float) * heads * nchunks * C * dkp ||
       saved.vn.bytes() != sizeof(float) * heads * nchunks * C * dvp ||
       saved.S.bytes() != sizeof(float) * heads * nchunks * dkp * dvp))
    throw std::invalid_argument("delta_rule_backward: kept chunk states do not match the shape");

  // The r value heads of a key head all add into its dq, dk. With at least as many key heads as threads
  // one thread runs all r of them in order and adds directly; otherwise each value head is a unit of work
  // that assigns its own partial (every row written once, so no zeroing), summed afterwards in head order.
  // Either way the contributions are added in the same order: the result does not depend on the threads.
  const bool per_key_head = r == 1 || s.batch * s.k_heads >= omp_get_max_threads();
  const int64_t units = per_key_head ? s.batch * s.k_heads : heads;
  const int64_t heads_per_unit = per_key_head ? r : 1;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), units));
  Carver sizing(nullptr);
  const bool bf16 = bf16_products<T>(products);
  BackwardScratch{sizing, dkp, dvp, nchunks, !kept, bf16};
  const int64_t per_thread = sizing.used();
  Buffer ws = mem.allocate_n<float>(workers * per_thread, MemCategory::Workspace, "delta_rule.backward_scratch");
  Buffer partial;
  if (!per_key_head)
    partial = mem.allocate_n<float>(2 * s.batch * s.seq * s.v_heads * s.dk, MemCategory::Workspace,
                                    "delta_rule.dqk_partial");
  if (mem.planning() || heads == 0) return;

  const int64_t part_n = s.batch * s.seq * s.v_heads * s.dk;
  float* part_q = partial.as<float>();
  float* part_k = part_q ? part_q + part_n : nullptr;

#pragma omp parallel num_threads(static_cast<int>(workers))
  {
    Carver cv(ws.as<float>() + omp_get_thread_num() * per_thread);
    BackwardScratch w(cv, dkp, dvp, nchunks, !kept, bf16);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u)
      for (int64_t j = 0; j < heads_per_unit; ++j) {
        const int64_t hh = u * heads_per_unit + j;  // both unit kinds enumerate (batch, value head) in order
        const HeadView hv{s, hh / s.v_heads, hh % s.v_heads};
        // Without accumulate the key head's first value head writes dq, dk and the others add to them.
        GradTarget dqk{dq + hv.qk_offset(0), dk + hv.qk_offset(0), hv.qk_stride(), !accumulate && j == 0};
        if (!per_key_head) {
          const int64_t off = (hv.b * s.seq * s.v_heads + hv.h) * s.dk;
          dqk = GradTarget{part_q + off, part_k + off, s.v_heads * s.dk, true};
        }
        ChunkStates states;
        if (kept)
          states = {saved.W.as<float>() + hh * nchunks * C * dkp, saved.vn.as<float>() + hh * nchunks * C * dvp,
                    saved.S.as<float>() + hh * nchunks * dkp * dvp};
        backward_head(hv, q, k, v, beta, saved.tinv.as<float>() + hh * nchunks * C * C,
                      saved.gcum.as<float>() + hh * nchunks * C, d_o, dqk, dv, dbeta, dg, !accumulate, states, w);
      }
  }

  if (!per_key_head) {
    const int64_t rows = s.batch * s.seq * s.k_heads;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const float* pq = part_q + row * r * s.dk;
      const float* pk = part_k + row * r * s.dk;
      for (int64_t j = 0; j < r; ++j)
        for (int64_t l = 0; l < s.dk; ++l) {
          const bool first = !accumulate && j == 0;
          dq[row * s.dk + l] = (first ? 0.0f : dq[row * s.dk + l]) + pq[j * s.dk + l];
          dk[row * s.dk + l] = (first ? 0.0f : dk[row * s.dk + l]) + pk[j * s.dk + l];
        }
    }
  }
}

bool delta_rule_bf16_products_available() { return cpu_has_bf16_products(); }

void detail::delta_rule_product(int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* Cm,
                                DeltaRuleProducts products) {
  if (M % 4 != 0 || N % 16 != 0 || K % 16 != 0)
    throw std::invalid_argument("delta_rule_product: M must be a multiple of 4, N and K of 16");
  Products mm;
  if (products == DeltaRuleProducts::Bf16) {
    if (!cpu_has_bf16_products()) throw std::invalid_argument("delta_rule_product: this CPU lacks AVX-512-BF16");
    thread_local std::vector<int32_t> ta, tb;  // reused: the bench calls this in a loop
    ta.resize(M * K / 2);
    tb.resize(K * N / 2);
    mm = Products{true, ta.data(), tb.data()};
  }
  mm(M, N, K, A, K, false, B, N, Cm, N);
}

#define HS_INSTANTIATE(T)                                                                                       \
  template void delta_rule_forward<T>(const DeltaRuleShape&, const T*, const T*, const T*, const float*,         \
                                      const float*, T*, DeltaRuleSaved*, MemoryAccountant&, bool,                \
                                      DeltaRuleProducts);                                                        \
  template void delta_rule_forward_cached<T>(const DeltaRuleShape&, const T*, const T*, const T*, const float*,  \
                                             const float*, T*, float*, const int32_t*, MemoryAccountant&,        \
                                             DeltaRuleProducts);                                                 \
  template void delta_rule_backward<T>(const DeltaRuleShape&, const T*, const T*, const T*, const float*,        \
                                       const float*, const DeltaRuleSaved&, const float*, float*, float*, float*, \
                                       float*, float*, MemoryAccountant&, bool, DeltaRuleProducts);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

}  // namespace hs::kernels
