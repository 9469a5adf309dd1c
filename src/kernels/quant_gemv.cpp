#include "kernels/quant_gemv.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/simd.h"

namespace hs::kernels {
namespace {

using Act32 = QuantAct32;

inline int nearest_even(float f) { return static_cast<int>(std::nearbyint(f)); }

// Below this many weight bytes one thread does the whole product (a fork/join costs more than it saves).
constexpr int64_t kParallelBytes = int64_t{1} << 19;

std::atomic<int> g_vnni{1};

bool act_is_q8k(GgmlType t) { return t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K; }

// The 8 scales and 8 mins of a Q4_K / Q5_K block (unpack_scale_min_k4 for all j at once, without branches): bytes
// 0..7 of out the scales, 8..15 the mins.
inline void unpack_k4_scales(const uint8_t* q, uint8_t out[16]) {
  uint32_t u[3], v[4];
  std::memcpy(u, q, 12);
  v[0] = u[0] & 0x3f3f3f3f;                                          // scales 0..3
  v[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);    // scales 4..7
  v[2] = u[1] & 0x3f3f3f3f;                                          // mins 0..3
  v[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);  // mins 4..7
  std::memcpy(out, v, 16);
}

// sum_s a[s] * b[s] over 8 unsigned bytes and 8 int16 (exact).
inline int32_t dot8_u8_i16(const uint8_t* a, const int16_t* b) {
  const __m128i p = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  const __m128i q = _mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(2, 3, 0, 1))));
}
// sum_s a[s] * b[s] over 16 signed bytes and 16 int16 (exact).
inline int32_t dot16_i8_i16(const int8_t* a, const int16_t* b) {
  const __m128i av = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i p = _mm_add_epi32(
      _mm_madd_epi16(_mm_cvtepi8_epi16(av), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b))),
      _mm_madd_epi16(_mm_cvtepi8_epi16(_mm_srli_si128(av, 8)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8))));
  const __m128i q = _mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(2, 3, 0, 1))));
}
// Byte-shuffle controls that fill the low 16 bytes of a 32-byte register with int16 word `lo` of its 128-bit lane
// and the high 16 with word `hi` (V::pick).
struct PickTable {
  alignas(32) uint8_t c[8][8][32] = {};
  constexpr PickTable() {
    for (int lo = 0; lo < 8; ++lo)
      for (int hi = 0; hi < 8; ++hi)
        for (int k = 0; k < 16; ++k) {
          c[lo][hi][k] = static_cast<uint8_t>(2 * lo + k % 2);
          c[lo][hi][16 + k] = static_cast<uint8_t>(2 * hi + k % 2);
        }
  }
};
constexpr PickTable kPick;

// The sums of each sub-block of 32 of a Q8_K block: bsums in pairs.
inline void q8k_pair_sums(const BlockQ8_K& a, int16_t out[8]) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsums));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsums + 8));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_hadd_epi16(lo, hi));
}

// ---- the plain path: the definition in the header, one lane at a time.
namespace quant_scalar {
struct V {
  static constexpr int kRows = 1;
  struct I {
    uint8_t b[32];
  };
  struct F {
    float l[8];
  };
  static I zero_i() { return I{}; }
  static F zero_f() { return F{}; }
  static F set1_f(float v) {
    F f;
    for (float& x : f.l) x = v;
    return f;
  }
  static F per_row(const float* v) { return set1_f(v[0]); }
  static F mul(const F& a, const F& b) {
    F f;
    for (int i = 0; i < 8; ++i) f.l[i] = a.l[i] * b.l[i];
    return f;
  }
  static F fma(const F& a, const F& b, const F& c) {
    F f;
    for (int i = 0; i < 8; ++i) f.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
    return f;
  }
  // The 32 bytes at p (_mm256_loadu_si256).
  static I loadu(const void* p) {
    I v;
    std::memcpy(v.b, p, 32);
    return v;
  }
  static int32_t lane(const I& v, int i) {
    int32_t x;
    std::memcpy(&x, v.b + 4 * i, 4);
    return x;
  }
  static I from_lanes(const int32_t* l) { return loadu(l); }
  static F cvt(const I& v) {
    F f;
    for (int i = 0; i < 8; ++i) f.l[i] = static_cast<float>(lane(v, i));
    return f;
  }
  static I add_i(const I& a, const I& b) {
    int32_t l[8];
    for (int i = 0; i < 8; ++i) l[i] = lane(a, i) + lane(b, i);
    return from_lanes(l);
  }
  static I or_i(const I& a, const I& b) {
    I v;
    for (int j = 0; j < 32; ++j) v.b[j] = a.b[j] | b.b[j];
    return v;
  }
  static I load_rows(const uint8_t* const* p) { return loadu(p[0]); }
  static I load_nibble_rows(const uint8_t* const* p) {
    I v;
    for (int j = 0; j < 16; ++j) {
      v.b[j] = p[0][j] & 0xF;
      v.b[j + 16] = p[0][j] >> 4;
    }
    return v;
  }
  static I bcast(const int8_t* x) { return loadu(x); }
  static I low_nibbles(const I& a) {
    I v;
    for (int j = 0; j < 32; ++j) v.b[j] = a.b[j] & 0xF;
    return v;
  }
  static I high_nibbles(const I& a) {
    I v;
    for (int j = 0; j < 32; ++j) v.b[j] = a.b[j] >> 4;
    return v;
  }
  static I bit_to_16(const I& a, int bit) {
    I v;
    for (int j = 0; j < 32; ++j) v.b[j] = static_cast<uint8_t>(((a.b[j] >> bit) & 1) << 4);
    return v;
  }
  static I two_bits_to_16(const I& a, int shift) {
    I v;
    for (int j = 0; j < 32; ++j) v.b[j] = static_cast<uint8_t>(((a.b[j] >> shift) & 3) << 4);
    return v;
  }
  // Eight int16 scales of a row; pick: the int16 scales of the 16 byte pairs, the first 8 pairs (bytes 0..15) word
  // lo, the next 8 word hi.
  struct S {
    int16_t w[8];
  };
  static S load_scales_u8(const uint8_t* const* p) {
    S s;
    for (int i = 0; i < 8; ++i) s.w[i] = p[0][i];
    return s;
  }
  static S load_scales_i8(const uint8_t* const* p) {
    S s;
    for (int i = 0; i < 8; ++i) s.w[i] = static_cast<int8_t>(p[0][i]);
    return s;
  }
  static I pick(const S& s, int lo, int hi) {
    I v;
    for (int k = 0; k < 16; ++k) std::memcpy(v.b + 2 * k, &s.w[k < 8 ? lo : hi], 2);
    return v;
  }
  static int16_t scale_of_pair(const I& s, int k) {
    int16_t x;
    std::memcpy(&x, s.b + 2 * k, 2);
    return x;
  }
  // Lane i: sum_{j<4} u[4i + j] * x[4i + j], u unsigned.
  static I dot_unsigned(const I& u, const I& x) {
    int32_t l[8];
    for (int i = 0; i < 8; ++i) {
      l[i] = 0;
      for (int j = 0; j < 4; ++j) l[i] += u.b[4 * i + j] * static_cast<int8_t>(x.b[4 * i + j]);
    }
    return from_lanes(l);
  }
  static I dot_signed(const I& w, const I& x) {
    int32_t l[8];
    for (int i = 0; i < 8; ++i) {
      l[i] = 0;
      for (int j = 0; j < 4; ++j) l[i] += static_cast<int8_t>(w.b[4 * i + j]) * static_cast<int8_t>(x.b[4 * i + j]);
    }
    return from_lanes(l);
  }
  // Lane i: the scale of its byte pairs (2i, 2i + 1) times the sum of its four products.
  static I dot_scaled(const I& u, const I& x, const I& s) {
    int32_t l[8];
    for (int i = 0; i < 8; ++i) {
      l[i] = 0;
      for (int k = 2 * i; k < 2 * i + 2; ++k)
        l[i] += scale_of_pair(s, k) *
                (u.b[2 * k] * static_cast<int8_t>(x.b[2 * k]) + u.b[2 * k + 1] * static_cast<int8_t>(x.b[2 * k + 1]));
    }
    return from_lanes(l);
  }
  static void hsum_rows(const F& a, float* out) {
    const float p0 = a.l[0] + a.l[4], p1 = a.l[1] + a.l[5], p2 = a.l[2] + a.l[6], p3 = a.l[3] + a.l[7];
    out[0] = (p0 + p2) + (p1 + p3);
  }
};
#include "kernels/quant_gemv_paths.inc"
}  // namespace quant_scalar

#if defined(__x86_64__)
// ---- AVX2: one weight row per register.
#define HS_Q_AVX2 __attribute__((target("avx2,fma"), always_inline))
struct V256 {
  static constexpr int kRows = 1;
  using I = __m256i;
  using F = __m256;
  HS_Q_AVX2 static I zero_i() { return _mm256_setzero_si256(); }
  HS_Q_AVX2 static F zero_f() { return _mm256_setzero_ps(); }
  HS_Q_AVX2 static F set1_f(float v) { return _mm256_set1_ps(v); }
  HS_Q_AVX2 static F per_row(const float* v) { return _mm256_set1_ps(v[0]); }
  HS_Q_AVX2 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  HS_Q_AVX2 static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  HS_Q_AVX2 static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  HS_Q_AVX2 static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  HS_Q_AVX2 static I or_i(I a, I b) { return _mm256_or_si256(a, b); }
  HS_Q_AVX2 static I load_rows(const uint8_t* const* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[0])); }
  HS_Q_AVX2 static I load_nibble_rows(const uint8_t* const* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[0]));
    const __m128i m = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
  }
  HS_Q_AVX2 static I bcast(const int8_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }
  HS_Q_AVX2 static I low_nibbles(I a) { return _mm256_and_si256(a, _mm256_set1_epi8(0xF)); }
  HS_Q_AVX2 static I high_nibbles(I a) { return _mm256_and_si256(_mm256_srli_epi16(a, 4), _mm256_set1_epi8(0xF)); }
  HS_Q_AVX2 static I bit_to_16(I a, int bit) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(a, _mm_cvtsi32_si128(bit)), _mm256_set1_epi8(1)), 4);
  }
  HS_Q_AVX2 static I two_bits_to_16(I a, int shift) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(a, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(3)), 4);
  }
  using S = __m256i;  // the row's 8 int16 scales in both 128-bit lanes
  HS_Q_AVX2 static S load_scales_u8(const uint8_t* const* p) {
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[0]))));
  }
  HS_Q_AVX2 static S load_scales_i8(const uint8_t* const* p) {
    return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[0]))));
  }
  HS_Q_AVX2 static I pick(S s, int lo, int hi) {
    return _mm256_shuffle_epi8(s, _mm256_load_si256(reinterpret_cast<const __m256i*>(kPick.c[lo][hi])));
  }
  HS_Q_AVX2 static I dot_unsigned(I u, I x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)); }
  HS_Q_AVX2 static I dot_signed(I w, I x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x)), _mm256_set1_epi16(1));
  }
  HS_Q_AVX2 static I dot_scaled(I u, I x, I s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), s); }
  HS_Q_AVX2 static void hsum_rows(F a, float* out) { out[0] = simd::hsum8(a); }
};
// The same with the dots as one vpdpbusd (AVX-512-VNNI on 256-bit registers). Two weight rows per 512-bit register,
// the other way to use AVX-512 here, measured 2-3x slower on this Zen 5 class CPU (Q8_0 in L2, one thread: 3.2
// against 11-12 GB/s; the zmm loads, inserts and per-row scale broadcasts cost more than the wider dots saved).
#define HS_Q_VNNI256 __attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni"), always_inline))
struct V256Vnni : V256 {
  HS_Q_VNNI256 static I dot_unsigned(I u, I x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x); }
  HS_Q_VNNI256 static I dot_signed(I w, I x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
  }
};
#undef HS_Q_VNNI256
// ... and as AVX-VNNI's VEX form, which CPUs of the AVX2 level may have (Intel Alder Lake, AMD Zen 5).
#define HS_Q_AVXVNNI __attribute__((target("avx2,fma,avxvnni"), always_inline))
struct V256AvxVnni : V256 {
  HS_Q_AVXVNNI static I dot_unsigned(I u, I x) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x); }
  HS_Q_AVXVNNI static I dot_signed(I w, I x) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
  }
};
#undef HS_Q_AVXVNNI
#undef HS_Q_AVX2
namespace quant_avx2 {
using V = V256;
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "kernels/quant_gemv_paths.inc"
#pragma GCC pop_options
}  // namespace quant_avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace quant_vnni256 {
using V = V256Vnni;
#include "kernels/quant_gemv_paths.inc"
}  // namespace quant_vnni256
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
namespace quant_avxvnni {
using V = V256AvxVnni;
#include "kernels/quant_gemv_paths.inc"
}  // namespace quant_avxvnni
#pragma GCC pop_options
#endif

void check_isa(cpu::Level isa) {
  if (!cpu::allows(isa))
    throw std::invalid_argument(std::string("quant_gemv: the ") + cpu::level_name(isa) + " path is above this CPU's level");
}

bool vnni_allowed() { return g_vnni.load(std::memory_order_relaxed) != 0; }

void rows_on(cpu::Level isa, const QuantizedRows& xq, const uint8_t* W, float* y, int64_t ldy, int64_t n0, int64_t n1) {
#if defined(__x86_64__)
  const cpu::Features& f = cpu::detected();
  if (static_cast<int>(isa) >= static_cast<int>(cpu::Level::Avx512) && f.avx512_vnni && vnni_allowed())
    return quant_vnni256::rows(xq, W, y, ldy, n0, n1);
  if (static_cast<int>(isa) >= static_cast<int>(cpu::Level::Avx2)) {
    if (f.avx_vnni && vnni_allowed()) return quant_avxvnni::rows(xq, W, y, ldy, n0, n1);
    return quant_avx2::rows(xq, W, y, ldy, n0, n1);
  }
#endif
  quant_scalar::rows(xq, W, y, ldy, n0, n1);
}

template <typename T> void quantize_act32_row(const T* x, int64_t K, Act32* out) {
  for (int64_t b = 0; b < K / kQK; ++b, x += kQK) {
    float amax = 0;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(to_f32(x[j])));
    const float d = amax / 127;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < kQK; ++j) {
      const int q = nearest_even(to_f32(x[j]) * id);
      out[b].qs[j] = static_cast<int8_t>(q);
      sum += q;
    }
    out[b].d = d;
    out[b].sum = sum;
  }
}

}  // namespace

bool quant_gemv_supports(GgmlType t) {
  return t == GgmlType::Q8_0 || t == GgmlType::Q4_0 || act_is_q8k(t);
}

cpu::Level quant_gemv_level() { return cpu::allows(cpu::Level::Avx512) ? cpu::Level::Avx512 : cpu::Level::Avx2; }

void set_quant_gemv_vnni(bool allowed) { g_vnni.store(allowed ? 1 : 0); }
bool quant_gemv_uses_vnni() {
  const cpu::Features& f = cpu::detected();
  return vnni_allowed() && ((cpu::allows(cpu::Level::Avx512) && f.avx512_vnni) || f.avx_vnni);
}

template <typename T> void quantize_rows(GgmlType t, const T* x, int64_t M, int64_t K, int64_t ldx, QuantizedRows& out) {
  if (!quant_gemv_supports(t))
    throw std::invalid_argument(std::string("no quantized products for ") + ggml_type_info(t).name + " weights");
  if (ldx == 0) ldx = K;
  const bool k_quant = act_is_q8k(t);
  const int64_t block = k_quant ? kQKK : kQK;
  if (K % block != 0)
    throw std::invalid_argument(std::string(ggml_type_info(t).name) + " rows hold " + std::to_string(block) +
                                "-element blocks; K = " + std::to_string(K) + " is not a multiple");
  out.weight_type = t;
  out.M = M;
  out.K = K;
  out.row_bytes = k_quant ? K / kQKK * static_cast<int64_t>(sizeof(BlockQ8_K)) : K / kQK * static_cast<int64_t>(sizeof(Act32));
  uint8_t* base = out.external;
  if (base) {
    if (out.external_bytes < static_cast<size_t>(M * out.row_bytes))
      throw std::invalid_argument("quantize_rows: the caller's storage holds " + std::to_string(out.external_bytes) +
                                  " bytes, " + std::to_string(M * out.row_bytes) + " needed");
  } else {
    if (out.data.size() < static_cast<size_t>(M * out.row_bytes)) out.data.resize(static_cast<size_t>(M * out.row_bytes));
    base = out.data.data();
  }
  // Rows are independent: many rows (a prefill's) are split over threads; a few (a decode step's, quantized by one
  // thread inside the fused step's parallel region) stay on the calling thread.
#pragma omp parallel for schedule(static) if (M > kGemvMaxRows)
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* dst = base + m * out.row_bytes;
    if (!k_quant) {
      quantize_act32_row(x + m * ldx, K, reinterpret_cast<Act32*>(dst));
    } else if constexpr (std::is_same_v<T, float>) {
      quantize_row(GgmlType::Q8_K, x + m * ldx, dst, K);
    } else {
      thread_local std::vector<float> row;
      row.resize(static_cast<size_t>(K));
      for (int64_t k = 0; k < K; ++k) row[static_cast<size_t>(k)] = to_f32(x[m * ldx + k]);
      quantize_row(GgmlType::Q8_K, row.data(), dst, K);
    }
  }
}

int64_t quantized_rows_bytes(GgmlType t, int64_t M, int64_t K) {
  const bool k_quant = act_is_q8k(t);
  return M * (k_quant ? K / kQKK * static_cast<int64_t>(sizeof(BlockQ8_K)) : K / kQK * static_cast<int64_t>(sizeof(Act32)));
}

void dequantize_quantized_row(const QuantizedRows& xq, int64_t m, float* out) {
  if (act_is_q8k(xq.weight_type)) return dequantize_row(GgmlType::Q8_K, xq.row(m), out, xq.K);
  const auto* a = reinterpret_cast<const Act32*>(xq.row(m));
  for (int64_t b = 0; b < xq.K / kQK; ++b)
    for (int j = 0; j < kQK; ++j) out[b * kQK + j] = a[b].d * static_cast<float>(a[b].qs[j]);
}

void quant_gemv_rows(const QuantizedRows& xq, const void* W, float* y, int64_t ldy, int64_t n0, int64_t n1,
                     cpu::Level isa) {
  check_isa(isa);
  if (ldy == 0) throw std::invalid_argument("quant_gemv_rows: ldy must be given (the full row's N)");
  if (n1 > n0) rows_on(isa, xq, static_cast<const uint8_t*>(W), y, ldy, n0, n1);
}

void quant_gemv_ranges(const QuantizedRows& xq, const void* W, float* y, int64_t ldy,
                       const std::vector<std::pair<int64_t, int64_t>>& ranges, cpu::Level isa) {
  check_isa(isa);
  const int64_t wrow = ggml_row_bytes(xq.weight_type, xq.K);
  // Cut the ranges into pieces of about 64 KiB of weights, which threads take as they come.
  constexpr int64_t kPieceBytes = int64_t{1} << 16;
  const int64_t piece_rows = std::max<int64_t>(2, kPieceBytes / wrow / 2 * 2);
  std::vector<std::pair<int64_t, int64_t>> pieces;
  int64_t bytes = 0;
  for (const auto& [a, b] : ranges) {
    for (int64_t n = a; n < b; n += piece_rows) pieces.emplace_back(n, std::min(b, n + piece_rows));
    bytes += (b - a) * wrow;
  }
  const auto* w = static_cast<const uint8_t*>(W);
  const int64_t count = static_cast<int64_t>(pieces.size());
#pragma omp parallel for schedule(dynamic, 1) if (bytes >= kParallelBytes && omp_get_max_threads() > 1)
  for (int64_t i = 0; i < count; ++i) rows_on(isa, xq, w, y, ldy, pieces[static_cast<size_t>(i)].first, pieces[static_cast<size_t>(i)].second);
}

template <typename T>
void quant_gemv(GgmlType t, const T* x, const void* W, float* y, int64_t M, int64_t N, int64_t K, int64_t ldx,
                int64_t ldy, cpu::Level isa) {
  check_isa(isa);
  if (M < 0 || M > kGemvMaxRows)
    throw std::invalid_argument("quant_gemv takes 0.." + std::to_string(kGemvMaxRows) + " rows, not " + std::to_string(M));
  if (M == 0 || N == 0) return;
  if (ldy == 0) ldy = N;
  thread_local QuantizedRows rows_of_this_thread;
  QuantizedRows& xq = rows_of_this_thread;  // the caller's: inside the parallel region the name would be each thread's
  quantize_rows(t, x, M, K, ldx, xq);
  const int64_t wrow = ggml_row_bytes(t, K);
  const auto* w = static_cast<const uint8_t*>(W);
  const int threads = omp_get_max_threads();
  if (N * wrow < kParallelBytes || threads == 1) return rows_on(isa, xq, w, y, ldy, 0, N);
  // Equal shares of rows.
#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t share = (N + nt - 1) / nt;
    const int64_t n0 = std::min(N, id * share), n1 = std::min(N, n0 + share);
    if (n1 > n0) rows_on(isa, xq, w, y, ldy, n0, n1);
  }
}

template <typename T>
void quant_gemv(GgmlType t, const T* x, const void* W, float* y, int64_t M, int64_t N, int64_t K, int64_t ldx,
                int64_t ldy) {
  quant_gemv(t, x, W, y, M, N, K, ldx, ldy, quant_gemv_level());
}

template void quantize_rows<float>(GgmlType, const float*, int64_t, int64_t, int64_t, QuantizedRows&);
template void quantize_rows<bf16>(GgmlType, const bf16*, int64_t, int64_t, int64_t, QuantizedRows&);
template void quant_gemv<float>(GgmlType, const float*, const void*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void quant_gemv<bf16>(GgmlType, const bf16*, const void*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void quant_gemv<float>(GgmlType, const float*, const void*, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                cpu::Level);
template void quant_gemv<bf16>(GgmlType, const bf16*, const void*, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                               cpu::Level);

}  // namespace hs::kernels
