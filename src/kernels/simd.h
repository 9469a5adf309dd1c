// The SIMD vocabulary the kernels share: the x86 intrinsics header, GCC's 16-lane vector types, and bf16 <-> fp32 in
// 8 (AVX2) and 16 (AVX-512) lanes. Each intrinsic helper carries its own target attribute and is always inlined, so
// a file includes this before its `*_paths.inc` copies (kernels/cpu.h) and a helper lands only in code of its level
// or wider (the compiler refuses to inline it into anything narrower). GCC 12 warns on the self-initialised
// _mm512_undefined_ps() inside some intrinsics (shuffles, max/min, reductions); the diagnostics are located in the
// header itself, so the pragma has to cover its inclusion.
#pragma once
#include <cstdint>
#include <cstring>

#include "core/dtype.h"

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

namespace hs::kernels::simd {

// Sixteen floats (or int32) as one value: GCC keeps it in a 512-bit register where the code is compiled for AVX-512
// (auto-vectorisation prefers 256-bit ones on AVX-512 machines) and splits it into two 256-bit ones elsewhere. Loads
// and stores go through memcpy (unaligned), and vectors pass by reference, never by value (that would be
// ABI-dependent: -Wpsabi without AVX-512).
using f32x16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));
inline void load_vec(f32x16& v, const float* p) { std::memcpy(&v, p, sizeof v); }
inline void store_vec(float* p, const f32x16& v) { std::memcpy(p, &v, sizeof v); }

#if defined(__x86_64__)
#define HS_SIMD_AVX2 __attribute__((target("avx2,fma"), always_inline))
#define HS_SIMD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), always_inline))

// ---- 8 lanes (AVX2). bf16 widens exactly (its bits are the high half of the fp32); fp32 -> bf16 rounds as
// bf16::from_float does: to nearest even, a NaN kept quiet ((bits >> 16) | 0x40).
HS_SIMD_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
HS_SIMD_AVX2 inline __m256 load8(const bf16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
HS_SIMD_AVX2 inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
HS_SIMD_AVX2 inline void store8(bf16* p, __m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i b = _mm256_blendv_epi8(r, q, nan);  // every lane <= 0xffff: packus keeps it
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// The sum of the 8 lanes: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
HS_SIMD_AVX2 inline float hsum8(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 q = _mm_add_ps(lo, hi);
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// ---- 16 lanes (AVX-512), the same conversions; masked forms read only the lanes set (zeros elsewhere).
HS_SIMD_AVX512 inline __m512 bf16x16_to_ps(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
HS_SIMD_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
HS_SIMD_AVX512 inline __m512 load16(const bf16* p) {
  return bf16x16_to_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
HS_SIMD_AVX512 inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
HS_SIMD_AVX512 inline __m512 load16(const bf16* p, __mmask16 k) { return bf16x16_to_ps(_mm256_maskz_loadu_epi16(k, p)); }
HS_SIMD_AVX512 inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
HS_SIMD_AVX512 inline void store16(bf16* p, __m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  b = _mm512_mask_or_epi32(b, nan, hi, _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
}
// Lanes j < n set (n clamped to [0, 16]).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : (n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1));
}
#endif

}  // namespace hs::kernels::simd
