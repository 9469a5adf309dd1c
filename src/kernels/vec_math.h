// exp, sigmoid and SiLU in fp32 that element loops can vectorise.
//
// std::exp is a scalar libm call (the engine is not built with -ffast-math), so a loop that calls it stays
// scalar: the exp in the SwiGLU, cross-entropy, softmax, conv and gate loops cost as much as the matmuls around
// them. These are branch-free inline arithmetic, so `#pragma omp simd` loops over them vectorise.
//
// Largest errors, measured over every float of the range against double-precision libm with the project's
// Release flags of the time (GCC 12, -O3 -march=native, so with FMA contraction; the default x86-64-v3 build
// contracts the same way, and tests/vec_math_test.cpp checks the figures on whatever build runs it):
//   exp_vec      0.895 ulp on [kExpVecLo, kExpVecHi]
//   sigmoid_vec  2.481 ulp on [-kExpVecHi, kExpVecHi]   (exp's error, then the add and the divide)
//   silu_vec     2.394 ulp on [-kExpVecHi, kExpVecHi]
// tests/vec_math_test.cpp checks a sample of those floats against these figures; HS_VEC_MATH_STRIDE=1 makes it
// check every one (about two minutes).
#pragma once
#include <bit>
#include <cstdint>
#include <limits>

namespace hs::kernels {

// The range where exp_vec is accurate: e^x is a normal float (>= 2^-126) and 2^n below is finite.
inline constexpr float kExpVecLo = -87.33f, kExpVecHi = 88.37f;

// e^x for x in [kExpVecLo, kExpVecHi]; 0 below (e^x < 1.2e-38, subnormal; also for -inf), +inf above
// (e^x > 2.4e38); NaN stays NaN. x = n ln2 + r with n = round(x / ln2) by the 1.5 * 2^23 shift (whose low bits
// then hold n; std::nearbyint would block GCC's vectoriser) and |r| <= ln2 / 2, ln2 split so that n * high is
// exact (Cody-Waite); e^r = 1 + r + r^2 P(r) with Cephes' expf minimax coefficients, in Horner form (the
// most accurate of the forms measured); 2^n built in the exponent bits.
inline float exp_vec(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  const float xc = x < kExpVecLo ? kExpVecLo : (x > kExpVecHi ? kExpVecHi : x);
  const float t = xc * 1.44269504088896341f + kShift;
  const float n = t - kShift;
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kShift) + 127;
  const float v = p * std::bit_cast<float>(e << 23);
  return x < kExpVecLo ? 0.0f : (x > kExpVecHi ? std::numeric_limits<float>::infinity() : v);
}

// 1 / (1 + e^-x); exactly 0 below -88.37, where the true value is subnormal.
inline float sigmoid_vec(float x) { return 1.0f / (1.0f + exp_vec(-x)); }

// x * sigmoid(x), as x / (1 + e^-x): one rounding fewer than multiplying by sigmoid_vec(x).
inline float silu_vec(float x) { return x / (1.0f + exp_vec(-x)); }

}  // namespace hs::kernels
