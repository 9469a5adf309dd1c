#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kernels/rope.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::randn;

// Two sequences of `seq` tokens, positions 0..seq-1 each (how the model calls it for a batch).
std::vector<int32_t> batch_positions(int32_t seq) {
  std::vector<int32_t> pos;
  for (int b = 0; b < 2; ++b)
    for (int32_t t = 0; t < seq; ++t) pos.push_back(t);
  return pos;
}

template <typename T>
void check_forward_against_reference(int64_t head_dim, int64_t rotary_dim, float theta) {
  const int32_t seq = 100;
  const int64_t heads = 3;
  const std::vector<int32_t> pos = batch_positions(seq);
  const int64_t tokens = static_cast<int64_t>(pos.size());
  const std::vector<float> x0 = randn(static_cast<size_t>(tokens * heads * head_dim), 7);
  std::vector<T> x(x0.size());
  std::vector<double> ref(x0.size());
  for (size_t i = 0; i < x0.size(); ++i) {
    x[i] = from_f32<T>(x0[i]);
    ref[i] = to_f32(x[i]);  // the reference starts from the same (rounded) values
  }
  const std::vector<T> before = x;
  rope_forward(x.data(), pos.data(), tokens, heads, head_dim, rotary_dim, theta);
  reference::rope_forward(ref.data(), pos.data(), tokens, heads, head_dim, rotary_dim, theta);
  // The fast kernel uses the fp32 angle position * inv_freq (as transformers does): with positions < 100
  // (angles < 100 rad) and inv_freq itself rounded, the angle is off by <= 100 * 2 * 2^-24 ~ 1.2e-5 rad,
  // moving an output by at most that times the pair's norm (|x| < 6 here), ~7e-5; cos/sin and the
  // rotation add a few fp32 ulps. bf16 storage adds the final rounding, half an ulp <= 2^-8 relative. A wrong
  // rotation (sign, half split, frequency) gives O(1) errors.
  const double rel = std::is_same_v<T, float> ? 0.0 : 1.0 / 256;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < head_dim; ++d) {
        const size_t i = static_cast<size_t>((t * heads + h) * head_dim + d);
        if (d >= rotary_dim) {
          ASSERT_EQ(to_f32(x[i]), to_f32(before[i])) << "pass-through dim " << d << " changed";
        } else {
          ASSERT_NEAR(to_f32(x[i]), ref[i], 1e-4 + rel * std::abs(ref[i]))
              << "token " << t << " head " << h << " dim " << d;
        }
      }
}

TEST(Rope, ForwardMatchesReferencePartialF32) { check_forward_against_reference<float>(64, 16, 1e7f); }
TEST(Rope, ForwardMatchesReferenceFullF32) { check_forward_against_reference<float>(32, 32, 1e4f); }
TEST(Rope, ForwardMatchesReferencePartialBf16) { check_forward_against_reference<bf16>(64, 16, 1e7f); }
TEST(Rope, ForwardMatchesReferenceFullBf16) { check_forward_against_reference<bf16>(32, 32, 1e4f); }

// <R x, y> = <x, R^T y> for the fast pair, and the fast backward agrees with the reference one.
TEST(Rope, BackwardIsTheTranspose) {
  const int64_t heads = 2, head_dim = 48, rotary_dim = 32;
  const std::vector<int32_t> pos = batch_positions(70);
  const int64_t tokens = static_cast<int64_t>(pos.size());
  const size_t n = static_cast<size_t>(tokens * heads * head_dim);
  std::vector<float> x = randn(n, 11), y = randn(n, 12);
  std::vector<float> Rx = x, RTy = y;
  std::vector<double> RTy_ref(y.begin(), y.end());
  rope_forward(Rx.data(), pos.data(), tokens, heads, head_dim, rotary_dim, 1e6f);
  rope_backward(RTy.data(), pos.data(), tokens, heads, head_dim, rotary_dim, 1e6f);
  reference::rope_backward(RTy_ref.data(), pos.data(), tokens, heads, head_dim, rotary_dim, 1e6);
  double lhs = 0, rhs = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    lhs += double(Rx[i]) * y[i];
    rhs += double(x[i]) * RTy[i];
    scale += std::abs(double(x[i]) * y[i]);
    // Same angle error budget as the forward test (positions < 70 here).
    ASSERT_NEAR(RTy[i], RTy_ref[i], 1e-4) << i;
  }
  // Both sides use identical fp32 cos/sin; each product is rounded once in fp32 (2^-24 relative), so
  // the sums agree to ~1e-7 of sum |x y|. A forward/backward sign mismatch breaks this at O(1).
  EXPECT_NEAR(lhs, rhs, 1e-6 * scale);
}

// position 3, theta 1e4, rotary_dim 4: inv_freq = (1, 1e4^-0.5 = 0.01), angles (3, 0.03).
//   x0' = x0 cos 3 - x2 sin 3        x2' = x2 cos 3 + x0 sin 3
//   x1' = x1 cos .03 - x3 sin .03    x3' = x3 cos .03 + x1 sin .03
// With x = 1..8 (cos 3 = -0.9899924966, sin 3 = 0.1411200081, cos .03 = 0.9995500337,
// sin .03 = 0.0299955002) and dims 4..7 untouched.
TEST(Rope, KnownValueAtHandComputedPosition) {
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};
  const int32_t pos = 3;
  rope_forward(x.data(), &pos, 1, 1, 8, 4, 1e4f);
  const double expected[8] = {-1.4133525208, 1.8791180667, -2.8288574817, 4.0581911354, 5, 6, 7, 8};
  // fp32 rounding of the angle (3 and 0.03 are not exact) and of cos/sin: a few 1e-7.
  for (int d = 0; d < 8; ++d) EXPECT_NEAR(x[static_cast<size_t>(d)], expected[d], 2e-6) << d;
}

// Golden values from transformers' fp32 rotary embedding (theta 1e7, rotary_dim 64, x = ones) at
// long positions, where computing the angle in double instead would move these outputs by up to 4e-3.
TEST(Rope, MatchesTransformersFp32AngleAtLongPositions) {
  const int64_t rd = 64;
  const int idx[8] = {1, 2, 3, 7, 33, 34, 35, 39};
  struct Case {
    int32_t pos;
    float want[8];
  };
  const Case cases[2] = {
      {200003, {0.137492359f, 0.809616446f, -1.40567422f, 0.744645834f, -1.4075141f, 1.15953493f, 0.155177355f,
                -1.20229053f}},
      {77777, {-1.3792212f, -1.38506246f, 0.011862874f, -1.10804355f, 0.312648058f, 0.285661042f, -1.41416383f,
               0.878771544f}}};
  for (const Case& c : cases) {
    std::vector<float> x(static_cast<size_t>(rd), 1.0f);
    rope_forward(x.data(), &c.pos, 1, 1, rd, rd, 1e7f);
    // Same fp32 angle; cos/sin agree with PyTorch's to 1 ulp, plus the rotation's own rounding.
    for (int j = 0; j < 8; ++j) EXPECT_NEAR(x[static_cast<size_t>(idx[j])], c.want[j], 5e-7) << c.pos << " " << idx[j];
  }
}

TEST(Rope, RejectsOddOrOversizedRotaryDim) {
  std::vector<float> x(16);
  const int32_t pos = 0;
  EXPECT_THROW(rope_forward(x.data(), &pos, 1, 1, 16, 7, 1e4f), std::invalid_argument);
  EXPECT_THROW(rope_backward(x.data(), &pos, 1, 1, 16, 18, 1e4f), std::invalid_argument);
}

}  // namespace
}  // namespace hs::kernels

namespace hs::kernels {

// The queries and keys in one call (each token's cos/sin once) give the bits of a call for each, forward (fp32,
// bf16) and backward, at a token count over the parallel threshold.
template <typename T> void pair_equals_two_calls() {
  const int64_t tokens = 300, qh = 4, kh = 1, hd = 64, rd = 16;
  std::vector<int32_t> pos(tokens);
  for (int64_t t = 0; t < tokens; ++t) pos[t] = static_cast<int32_t>(t % 150);
  const auto q0 = test::cast<T>(test::randn(tokens * qh * hd, 81));
  const auto k0 = test::cast<T>(test::randn(tokens * kh * hd, 82));
  auto q1 = q0, k1 = k0, q2 = q0, k2 = k0;
  rope_forward(q1.data(), pos.data(), tokens, qh, hd, rd, 1e7f);
  rope_forward(k1.data(), pos.data(), tokens, kh, hd, rd, 1e7f);
  rope_forward(q2.data(), qh, k2.data(), kh, pos.data(), tokens, hd, rd, 1e7f);
  EXPECT_EQ(0, std::memcmp(q1.data(), q2.data(), q1.size() * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(k1.data(), k2.data(), k1.size() * sizeof(T)));
  auto dq1 = test::randn(tokens * qh * hd, 83), dk1 = test::randn(tokens * kh * hd, 84), dq2 = dq1, dk2 = dk1;
  rope_backward(dq1.data(), pos.data(), tokens, qh, hd, rd, 1e7f);
  rope_backward(dk1.data(), pos.data(), tokens, kh, hd, rd, 1e7f);
  rope_backward(dq2.data(), qh, dk2.data(), kh, pos.data(), tokens, hd, rd, 1e7f);
  EXPECT_EQ(0, std::memcmp(dq1.data(), dq2.data(), dq1.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dk1.data(), dk2.data(), dk1.size() * sizeof(float)));
}
TEST(Rope, QueriesAndKeysInOneCallEqualTwoCalls) {
  pair_equals_two_calls<float>();
  pair_equals_two_calls<bf16>();
}

}  // namespace hs::kernels
