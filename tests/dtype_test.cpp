// core::convert, fp32 <-> bf16 arrays: every element equals bf16::from_float / to_float of its input, at sizes on
// both sides of the run length (65,536) that decides between the calling thread and runs shared among the threads,
// including a last run shorter than the others.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dtype.h"

namespace hs {
namespace {

// Floats that exercise the rounding: random bit patterns (every exponent), exact ties (low half 0x8000, odd and
// even kept bit), NaN, infinities, signed zeros.
std::vector<float> rounding_cases(size_t n) {
  std::vector<float> v(n);
  uint32_t s = 12345u;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    uint32_t u = s;
    if (i % 7 == 1) u = (u & 0xffff0000u) | 0x8000u;  // a tie
    std::memcpy(&v[i], &u, 4);
  }
  const float special[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), 0.0f, -0.0f};
  for (size_t i = 0; i < n && i < 5; ++i) v[n - 1 - i] = special[i];
  return v;
}

TEST(Dtype, ConvertRoundsAndWidensEveryElementAsTheScalarRules) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{65536}, size_t{65537}, size_t{3} * 65536 + 123}) {
    const std::vector<float> src = rounding_cases(n);
    std::vector<bf16> b(n + 1);
    b[n].bits = 0xabcd;  // one past the end stays as it was
    convert(src.data(), b.data(), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(b[i].bits, bf16::from_float(src[i])) << "n " << n << " i " << i;
    EXPECT_EQ(b[n].bits, 0xabcd) << n;

    std::vector<float> back(n + 1, 7.0f);
    convert(b.data(), back.data(), n);
    for (size_t i = 0; i < n; ++i) {
      const float want = bf16::to_float(b[i].bits);
      ASSERT_EQ(std::memcmp(&back[i], &want, 4), 0) << "n " << n << " i " << i;
    }
    EXPECT_EQ(back[n], 7.0f) << n;
  }
}

}  // namespace
}  // namespace hs
