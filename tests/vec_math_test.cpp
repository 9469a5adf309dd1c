// exp_vec, sigmoid_vec and silu_vec against double-precision libm: the error bounds kernels/vec_math.h states,
// on a sample of every float in the accurate range (HS_VEC_MATH_STRIDE=1: on all of them), and the values
// outside it.
#include "kernels/vec_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

namespace hs::kernels {
namespace {

// Every stride-th float; 211 (prime, so the sample does not follow the mantissa's bit patterns) keeps the three
// tests near 0.3 s in Release while touching ~10 million floats each.
uint32_t sample_stride() {
  const char* s = std::getenv("HS_VEC_MATH_STRIDE");
  return s ? static_cast<uint32_t>(std::max(1L, std::strtol(s, nullptr, 10))) : 211u;
}

// The spacing of floats at |v| (2^-149 among subnormals).
double ulp_at(double v) {
  int e;
  std::frexp(v, &e);
  return std::ldexp(1.0, std::max(e - 24, -149));
}

struct Worst {
  double ulp = 0;
  float x = 0;
};

// The largest |f(x) - want(x)| in ulps of want(x) over the sampled floats of [lo, hi] (lo < 0 < hi), walking
// each sign's bit patterns upwards from zero.
template <typename F, typename Want>
Worst max_ulp(F f, Want want, float lo, float hi) {
  const uint32_t stride = sample_stride();
  Worst w;
  for (const float end : {lo, hi}) {
    const uint32_t sign = std::bit_cast<uint32_t>(end) & 0x80000000u;
    const uint32_t last = std::bit_cast<uint32_t>(end) & 0x7fffffffu;
    for (uint32_t m = 0;; m = last - m > stride ? m + stride : last) {
      const float x = std::bit_cast<float>(sign | m);
      const double ref = want(static_cast<double>(x));
      const double err = std::abs(static_cast<double>(f(x)) - ref) / ulp_at(ref);
      if (!(err <= w.ulp)) w = {err, x};
      if (m == last) break;
    }
  }
  return w;
}

// The bounds are the exhaustive maxima stated in vec_math.h; a sample cannot exceed them. A polynomial or
// reduction constant off by one digit costs tens of ulps.
TEST(VecMath, ExpWithinStatedUlp) {
  const Worst w = max_ulp(
      exp_vec, [](double x) { return std::exp(x); }, kExpVecLo, kExpVecHi);
  EXPECT_LE(w.ulp, 0.895) << "at x = " << w.x;
}

TEST(VecMath, SigmoidWithinStatedUlp) {
  const Worst w = max_ulp(
      sigmoid_vec, [](double x) { return 1.0 / (1.0 + std::exp(-x)); }, -kExpVecHi, kExpVecHi);
  EXPECT_LE(w.ulp, 2.481) << "at x = " << w.x;
}

TEST(VecMath, SiluWithinStatedUlp) {
  const Worst w = max_ulp(
      silu_vec, [](double x) { return x / (1.0 + std::exp(-x)); }, -kExpVecHi, kExpVecHi);
  EXPECT_LE(w.ulp, 2.394) << "at x = " << w.x;
}

// Outside the accurate range exp saturates to 0 and +inf (so sigmoid to exactly 0 and 1), NaN propagates, and
// the values softmax and the decays rely on are exact.
TEST(VecMath, EdgeValues) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(exp_vec(0.0f), 1.0f);
  EXPECT_EQ(exp_vec(-0.0f), 1.0f);
  EXPECT_EQ(exp_vec(-kInf), 0.0f);
  EXPECT_EQ(exp_vec(std::nextafter(kExpVecLo, -kInf)), 0.0f);
  EXPECT_EQ(exp_vec(-1000.0f), 0.0f);
  EXPECT_EQ(exp_vec(std::nextafter(kExpVecHi, kInf)), kInf);
  EXPECT_EQ(exp_vec(kInf), kInf);
  EXPECT_TRUE(std::isnan(exp_vec(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_GE(exp_vec(kExpVecLo), std::numeric_limits<float>::min());  // still normal at the bottom
  EXPECT_LT(exp_vec(kExpVecHi), kInf);
  EXPECT_EQ(sigmoid_vec(-100.0f), 0.0f);
  EXPECT_EQ(sigmoid_vec(100.0f), 1.0f);
  EXPECT_EQ(sigmoid_vec(0.0f), 0.5f);
  EXPECT_EQ(silu_vec(0.0f), 0.0f);
  EXPECT_EQ(silu_vec(100.0f), 100.0f);
  EXPECT_TRUE(std::isnan(sigmoid_vec(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace hs::kernels
