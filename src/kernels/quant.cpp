// The block formats: type table, fp16, dequantization and ggml's reference quantizers.
//
// No fused multiply-add in this file: the references round every product and sum on its own (numpy; libggml-base,
// which ggml builds for plain x86-64), and a contracted `w * l * x + sum` in the quantizers' fits would pick other
// scales. The build is ISO C++ (contraction off by default); the pragma keeps it so under any flags.
#pragma GCC optimize("fp-contract=off")

#include "kernels/quant.h"
#include "kernels/simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace hs::kernels {
namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::F32, "F32", 1, 4},
    {GgmlType::F16, "F16", 1, 2},
    {GgmlType::Q4_0, "Q4_0", kQK, sizeof(BlockQ4_0)},
    {GgmlType::Q8_0, "Q8_0", kQK, sizeof(BlockQ8_0)},
    {GgmlType::Q4_K, "Q4_K", kQKK, sizeof(BlockQ4_K)},
    {GgmlType::Q5_K, "Q5_K", kQKK, sizeof(BlockQ5_K)},
    {GgmlType::Q6_K, "Q6_K", kQKK, sizeof(BlockQ6_K)},
    {GgmlType::Q8_K, "Q8_K", kQKK, sizeof(BlockQ8_K)},
    {GgmlType::BF16, "BF16", 1, 2},
};

// Every id of ggml's enum ggml_type (ggml.h), by its gguf name; holes are ids ggml retired.
const char* const kAllNames[] = {
    "F32",   "F16",     "Q4_0",   "Q4_1",    "Q4_2", "Q4_3",  "Q5_0",   "Q5_1",  "Q8_0",  "Q8_1",    "Q2_K",
    "Q3_K",  "Q4_K",    "Q5_K",   "Q6_K",    "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S",
    "IQ2_S", "IQ4_XS",  "I8",     "I16",     "I32",  "I64",   "F64",    "IQ1_M", "BF16",  "Q4_0_4_4", "Q4_0_4_8",
    "Q4_0_8_8", "TQ1_0", "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4", "NVFP4", "Q1_0"};

// ggml's nearest_int: round to nearest (ties to even) through the float's mantissa; |f| <= 2^22 - 1.
inline int nearest_int(float f) {
  const float v = f + 12582912.f;
  int32_t i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}

constexpr float kGroupMaxEps = 1e-15f;

// ggml's make_qkx2_quants: an asymmetric nmax-level fit of x[0, n) (scale returned, -min in *neg_min) by weighted
// least squares over nstep + 1 trial scales; L gets the levels.
float fit_scale_min(int n, int nmax, const float* x, const float* w, uint8_t* L, float* neg_min, uint8_t* Laux,
                    float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0];
  float sum_w = w[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::memset(L, 0, static_cast<size_t>(n));
    *neg_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    const float diff = scale * L[i] + min - x[i];
    best_error += w[i] * (diff * diff);
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = std::max(0, std::min(nmax, l));
      Laux[i] = static_cast<uint8_t>(l);
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        const float diff = this_scale * Laux[i] + this_min - x[i];
        cur_error += w[i] * (diff * diff);
      }
      if (cur_error < best_error) {
        std::memcpy(L, Laux, static_cast<size_t>(n));
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *neg_min = -min;
  return scale;
}

// ggml's make_qx_quants with rmse_type 1 and no importance weights: a symmetric fit, levels L in [0, 2 nmax).
float fit_scale_symmetric(int n, int nmax, const float* x, int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    std::memset(L, 0, static_cast<size_t>(n));
    return 0.f;
  }
  float iscale = -nmax / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = static_cast<int8_t>(l + nmax);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = std::max(-nmax, std::min(nmax - 1, l));
      const float w = x[i] * x[i];
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * x[i]);
        L[i] = static_cast<int8_t>(nmax + std::max(-nmax, std::min(nmax - 1, l)));
      }
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// ---- dequantization (the order of gguf.quants: scale products first, then q times them, then the min) ----
// Eight elements at a time in AVX2 (the build's baseline: every CPU this engine runs on has it), for the output T:
// float, or bf16 (each float rounded to nearest even, as bf16::from_float does: simd::store8). Each lane does the
// scalar arithmetic (int to float, the same products and difference, each rounded once), so the values are
// gguf.quants' bit for bit (tests/quant_format_test.cpp). kernels/quant_matmul.cpp dequantizes whole weight tiles
// through these for the prefill products: the scalar loops they replace took 0.2-0.6 ns per element, Q6_K 6.0 (one
// thread, a 256 x 2048 tile); these 0.22-0.27 to fp32, 0.37-0.55 to bf16 (docs/quantization.md).

// Eight bytes widened to int32 lanes.
HS_SIMD_AVX2 inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
HS_SIMD_AVX2 inline __m256i sbytes8(const int8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// scale * float(q) in every lane (the order of the scalar references: the scale first).
HS_SIMD_AVX2 inline __m256 scaled(__m256i q, __m256 scale) { return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(q)); }

template <typename T> void dequantize_q8_0(const BlockQ8_0* b, T* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const __m256 d = _mm256_set1_ps(fp16_to_fp32(b[i].d));
    for (int j = 0; j < kQK; j += 8) simd::store8(y + j, _mm256_mul_ps(_mm256_cvtepi32_ps(sbytes8(b[i].qs + j)), d));
  }
}

template <typename T> void dequantize_q4_0(const BlockQ4_0* b, T* y, int64_t nb) {
  const __m256i low = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const __m256 d = _mm256_set1_ps(fp16_to_fp32(b[i].d));
    for (int j = 0; j < kQK / 2; j += 8) {
      const __m256i q = bytes8(b[i].qs + j);
      simd::store8(y + j, scaled(_mm256_sub_epi32(_mm256_and_si256(q, low), eight), d));
      simd::store8(y + j + kQK / 2, scaled(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight), d));
    }
  }
}

template <typename B, typename T> void dequantize_k4_or_k5(const B* b, T* y, int64_t nb) {
  constexpr bool kHigh = std::is_same_v<B, BlockQ5_K>;
  const __m256i low = _mm256_set1_epi32(0xF), one = _mm256_set1_epi32(1);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
    for (int s = 0; s < 8; s += 2, y += 64) {  // sub-blocks s (low nibbles) and s + 1 (high nibbles) of 32 bytes
      uint8_t sc0, m0, sc1, m1;
      unpack_scale_min_k4(s, b[i].scales, sc0, m0);
      unpack_scale_min_k4(s + 1, b[i].scales, sc1, m1);
      const __m256 ds0 = _mm256_set1_ps(d * sc0), ms0 = _mm256_set1_ps(dmin * m0);
      const __m256 ds1 = _mm256_set1_ps(d * sc1), ms1 = _mm256_set1_ps(dmin * m1);
      const uint8_t* q = b[i].qs + 16 * s;
      for (int l = 0; l < 32; l += 8) {
        const __m256i v = bytes8(q + l);
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi32(v, 4);
        if constexpr (kHigh) {
          const __m256i h = bytes8(b[i].qh + l);
          lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, s), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, s + 1), one), 4));
        }
        simd::store8(y + l, _mm256_sub_ps(scaled(lo, ds0), ms0));
        simd::store8(y + l + 32, _mm256_sub_ps(scaled(hi, ds1), ms1));
      }
    }
  }
}

// Element 128 h + 32 quarter + l of a block: the low four bits from ql[64 h + 32 (quarter % 2) + l] (low nibble for
// quarters 0 and 1, high for 2 and 3), the high two from bits 2 quarter of qh[32 h + l], scale scales[8 h + 2 quarter
// + l / 16] (ggml's dequantize_row_q6_K).
template <typename T> void dequantize_q6_k(const BlockQ6_K* b, T* y, int64_t nb) {
  const __m256i low = _mm256_set1_epi32(0xF), three = _mm256_set1_epi32(3), off = _mm256_set1_epi32(32);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    for (int h = 0; h < 2; ++h, y += 128) {
      const uint8_t* ql = b[i].ql + 64 * h;
      const uint8_t* qh = b[i].qh + 32 * h;
      const int8_t* sc = b[i].scales + 8 * h;
      for (int l = 0; l < 32; l += 8) {
        const int g = l / 16;  // one scale per 16 elements of a quarter
        const __m256 s0 = _mm256_set1_ps(d * static_cast<float>(sc[g])), s1 = _mm256_set1_ps(d * static_cast<float>(sc[g + 2]));
        const __m256 s2 = _mm256_set1_ps(d * static_cast<float>(sc[g + 4])), s3 = _mm256_set1_ps(d * static_cast<float>(sc[g + 6]));
        const __m256i a = bytes8(ql + l), c = bytes8(ql + l + 32), e = bytes8(qh + l);
        auto high = [&](int shift) { return _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(e, shift), three), 4); };
        const __m256i q0 = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(a, low), high(0)), off);
        const __m256i q1 = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(c, low), high(2)), off);
        const __m256i q2 = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(a, 4), high(4)), off);
        const __m256i q3 = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(c, 4), high(6)), off);
        simd::store8(y + l, scaled(q0, s0));
        simd::store8(y + l + 32, scaled(q1, s1));
        simd::store8(y + l + 64, scaled(q2, s2));
        simd::store8(y + l + 96, scaled(q3, s3));
      }
    }
  }
}

void dequantize_q8_k(const BlockQ8_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQKK)
    for (int j = 0; j < kQKK; ++j) y[j] = b[i].d * static_cast<float>(b[i].qs[j]);
}

// ---- ggml's reference quantizers ----

void quantize_q8_0(const float* x, BlockQ8_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    float amax = 0;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK; ++j) y[i].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
  }
}

void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    float amax = 0, max = 0;
    for (int j = 0; j < kQK; ++j)
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    const float d = max / -8;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK / 2; ++j) {
      const int q0 = std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f)));
      const int q1 = std::min(15, static_cast<int>(static_cast<int8_t>(x[j + kQK / 2] * id + 8.5f)));
      y[i].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

// Q4_K / Q5_K (ggml's quantize_row_q4_K_ref / q5_K_ref): each sub-block of 32 fitted with a scale and a min, the 8
// scales and 8 mins quantized to 6 bits against the largest, then every element requantized with the stored ones.
template <typename B> void quantize_k4_or_k5(const float* x, B* y, int64_t nb) {
  constexpr bool kQ5 = std::is_same_v<B, BlockQ5_K>;
  constexpr int kMaxLevel = kQ5 ? 31 : 15;
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    uint8_t L[kQKK], Laux[32];
    float weights[32], mins[8], scales[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
      const float* xs = x + 32 * j;
      float sum_x2 = 0;
      for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
      const float av_x = std::sqrt(sum_x2 / 32);
      for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
      scales[j] = kQ5 ? fit_scale_min(32, 31, xs, weights, L + 32 * j, &mins[j], Laux, -0.5f, 0.1f, 15)
                      : fit_scale_min(32, 15, xs, weights, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20);
      max_scale = std::max(max_scale, scales[j]);
      max_min = std::max(max_min, mins[j]);
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    std::memset(y[i].scales, 0, sizeof(y[i].scales));
    for (int j = 0; j < 8; ++j) {
      const uint8_t ls = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
      const uint8_t lm = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
      if (j < 4) {
        y[i].scales[j] = ls;
        y[i].scales[j + 4] = lm;
      } else {
        y[i].scales[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
        y[i].scales[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
        y[i].scales[j] |= static_cast<uint8_t>((lm >> 4) << 6);
      }
    }
    y[i].d = fp32_to_fp16(max_scale / 63.f);
    y[i].dmin = fp32_to_fp16(max_min / 63.f);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      unpack_scale_min_k4(j, y[i].scales, sc, m);
      const float d = fp16_to_fp32(y[i].d) * sc;
      if (d == 0) continue;  // the fit's levels stay (ggml does the same)
      const float dm = fp16_to_fp32(y[i].dmin) * m;
      for (int l = 0; l < 32; ++l)
        L[32 * j + l] = static_cast<uint8_t>(std::max(0, std::min(kMaxLevel, nearest_int((x[32 * j + l] + dm) / d))));
    }
    if constexpr (kQ5) std::memset(y[i].qh, 0, sizeof(y[i].qh));
    for (int g = 0; g < 4; ++g)
      for (int l = 0; l < 32; ++l) {
        int lo = L[64 * g + l], hi = L[64 * g + 32 + l];
        if constexpr (kQ5) {
          if (lo > 15) {
            lo -= 16;
            y[i].qh[l] |= static_cast<uint8_t>(1 << (2 * g));
          }
          if (hi > 15) {
            hi -= 16;
            y[i].qh[l] |= static_cast<uint8_t>(2 << (2 * g));
          }
        }
        y[i].qs[32 * g + l] = static_cast<uint8_t>(lo | (hi << 4));
      }
  }
}

void quantize_q6_k(const float* x, BlockQ6_K* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    int8_t L[kQKK];
    float scales[16];
    float max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < 16; ++ib) {
      scales[ib] = fit_scale_symmetric(16, 32, x + 16 * ib, L + 16 * ib);
      if (std::fabs(scales[ib]) > max_abs_scale) {
        max_abs_scale = std::fabs(scales[ib]);
        max_scale = scales[ib];
      }
    }
    if (max_abs_scale < kGroupMaxEps) {
      std::memset(&y[i], 0, sizeof(BlockQ6_K));
      continue;
    }
    const float iscale = -128.f / max_scale;
    y[i].d = fp32_to_fp16(1 / iscale);
    for (int ib = 0; ib < 16; ++ib) y[i].scales[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
    for (int j = 0; j < 16; ++j) {
      const float d = fp16_to_fp32(y[i].d) * y[i].scales[j];
      if (d == 0) continue;
      for (int l = 0; l < 16; ++l)
        L[16 * j + l] = static_cast<int8_t>(std::max(-32, std::min(31, nearest_int(x[16 * j + l] / d))) + 32);
    }
    for (int h = 0; h < 2; ++h) {
      const int8_t* Lh = L + 128 * h;
      uint8_t* ql = y[i].ql + 64 * h;
      uint8_t* qh = y[i].qh + 32 * h;
      for (int l = 0; l < 32; ++l) {
        ql[l] = static_cast<uint8_t>((Lh[l] & 0xF) | ((Lh[l + 64] & 0xF) << 4));
        ql[l + 32] = static_cast<uint8_t>((Lh[l + 32] & 0xF) | ((Lh[l + 96] & 0xF) << 4));
        qh[l] = static_cast<uint8_t>((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) | ((Lh[l + 64] >> 4) << 4) |
                                     ((Lh[l + 96] >> 4) << 6));
      }
    }
  }
}

void quantize_q8_k(const float* x, BlockQ8_K* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    float max = 0, amax = 0;
    for (int j = 0; j < kQKK; ++j)
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    if (amax == 0) {
      std::memset(&y[i], 0, sizeof(BlockQ8_K));
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < kQKK; ++j) y[i].qs[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * x[j])));
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += y[i].qs[16 * g + l];
      y[i].bsums[g] = static_cast<int16_t>(sum);
    }
    y[i].d = 1 / iscale;
  }
}

uint16_t bf16_bits_as_ggml(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((u >> 16) | 64);  // NaN: made quiet
  return static_cast<uint16_t>((u + (0x7fff + ((u >> 16) & 1))) >> 16);
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(uint32_t id) {
  for (const auto& t : kTypes)
    if (static_cast<uint32_t>(t.type) == id) return &t;
  return nullptr;
}

const GgmlTypeInfo& ggml_type_info(GgmlType t) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(t));
  if (!info) throw std::invalid_argument("ggml type id " + std::to_string(static_cast<uint32_t>(t)) + " is not one of ours");
  return *info;
}

std::string ggml_type_name(uint32_t id) {
  if (id < std::size(kAllNames)) return kAllNames[id];
  return "type " + std::to_string(id);
}

int64_t ggml_row_bytes(GgmlType t, int64_t n) {
  const GgmlTypeInfo& info = ggml_type_info(t);
  if (n < 0 || n % info.block_elems != 0)
    throw std::invalid_argument(std::string(info.name) + " stores rows in blocks of " +
                                std::to_string(info.block_elems) + " elements; a row of " + std::to_string(n) +
                                " is not a whole number of them");
  return n / info.block_elems * info.block_bytes;
}

namespace {

template <typename T> void dequantize_row_as(GgmlType t, const void* blocks, T* out, int64_t n) {
  const int64_t nb = ggml_row_bytes(t, n) / ggml_type_info(t).block_bytes;
  switch (t) {
    case GgmlType::F32: {
      const auto* f = static_cast<const float*>(blocks);
      if constexpr (std::is_same_v<T, float>) std::memcpy(out, f, static_cast<size_t>(n) * 4);
      else for (int64_t i = 0; i < n; ++i) out[i] = from_f32<T>(f[i]);
      return;
    }
    case GgmlType::F16: {
      const auto* h = static_cast<const uint16_t*>(blocks);
      for (int64_t i = 0; i < n; ++i) out[i] = from_f32<T>(fp16_to_fp32(h[i]));
      return;
    }
    case GgmlType::BF16: {
      const auto* h = static_cast<const uint16_t*>(blocks);
      if constexpr (std::is_same_v<T, bf16>) {
        std::memcpy(static_cast<void*>(out), h, static_cast<size_t>(n) * 2);
      } else {
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t u = static_cast<uint32_t>(h[i]) << 16;
          std::memcpy(out + i, &u, 4);
        }
      }
      return;
    }
    case GgmlType::Q8_0: return dequantize_q8_0(static_cast<const BlockQ8_0*>(blocks), out, nb);
    case GgmlType::Q4_0: return dequantize_q4_0(static_cast<const BlockQ4_0*>(blocks), out, nb);
    case GgmlType::Q4_K: return dequantize_k4_or_k5(static_cast<const BlockQ4_K*>(blocks), out, nb);
    case GgmlType::Q5_K: return dequantize_k4_or_k5(static_cast<const BlockQ5_K*>(blocks), out, nb);
    case GgmlType::Q6_K: return dequantize_q6_k(static_cast<const BlockQ6_K*>(blocks), out, nb);
    case GgmlType::Q8_K: {
      if constexpr (std::is_same_v<T, float>) return dequantize_q8_k(static_cast<const BlockQ8_K*>(blocks), out, nb);
      throw std::invalid_argument("Q8_K (the activations' format) is not dequantized to bf16");
    }
  }
}

}  // namespace

void dequantize_row(GgmlType t, const void* blocks, float* out, int64_t n) { dequantize_row_as(t, blocks, out, n); }
void dequantize_row(GgmlType t, const void* blocks, bf16* out, int64_t n) { dequantize_row_as(t, blocks, out, n); }

void quantize_row(GgmlType t, const float* x, void* blocks, int64_t n) {
  const int64_t nb = ggml_row_bytes(t, n) / ggml_type_info(t).block_bytes;
  switch (t) {
    case GgmlType::F32: std::memcpy(blocks, x, static_cast<size_t>(n) * 4); return;
    case GgmlType::F16: {
      auto* h = static_cast<uint16_t*>(blocks);
      for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(x[i]);
      return;
    }
    case GgmlType::BF16: {
      auto* h = static_cast<uint16_t*>(blocks);
      for (int64_t i = 0; i < n; ++i) h[i] = bf16_bits_as_ggml(x[i]);
      return;
    }
    case GgmlType::Q8_0: return quantize_q8_0(x, static_cast<BlockQ8_0*>(blocks), nb);
    case GgmlType::Q4_0: return quantize_q4_0(x, static_cast<BlockQ4_0*>(blocks), nb);
    case GgmlType::Q4_K: return quantize_k4_or_k5(x, static_cast<BlockQ4_K*>(blocks), nb);
    case GgmlType::Q5_K: return quantize_k4_or_k5(x, static_cast<BlockQ5_K*>(blocks), nb);
    case GgmlType::Q6_K: return quantize_q6_k(x, static_cast<BlockQ6_K*>(blocks), nb);
    case GgmlType::Q8_K: return quantize_q8_k(x, static_cast<BlockQ8_K*>(blocks), nb);
  }
}

}  // namespace hs::kernels
