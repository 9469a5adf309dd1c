// CausalConv: the depthwise causal conv + SiLU against its double-precision reference (fp32 and bf16
// storage, several widths, shapes that cross the channel and time blocks), its backward against
// finite differences, causality, and dw's independence of the thread count.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/conv.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::close;
using test::randn;
using test::widen;

struct Shape {
  int64_t batch, seq, channels, width;
  int64_t n() const { return batch * seq * channels; }
};

// fast (fp32 math) vs reference (double math) on the same stored inputs. Outputs and dx sum <= width
// products (~1e-7 relative round-off), so rtol 1e-5 / atol 1e-6 is ample; dw sums batch*seq products
// of O(1) terms, so its atol grows with sqrt(batch*seq). bf16 outputs may differ by one bf16 ulp
// (2^-7 relative) where the two near-identical values round to neighbours.
template <typename T> void matches_reference(Shape s) {
  const auto x = cast<T>(randn(s.n(), 1));
  const auto w = randn(s.channels * s.width, 2, 0.7f);
  const auto dy = randn(s.n(), 3);
  std::vector<T> y(s.n()), y_ref(s.n());
  causal_conv_silu_forward(x.data(), w.data(), y.data(), s.batch, s.seq, s.channels, s.width);
  reference::causal_conv_silu_forward(x.data(), w.data(), y_ref.data(), s.batch, s.seq, s.channels, s.width);
  const bool is_bf16 = std::is_same_v<T, bf16>;
  EXPECT_TRUE(close(y, y_ref, is_bf16 ? 1.0 / 128 : 1e-5, 1e-6)) << s.width;

  // Non-zero initial gradients check that the backward accumulates.
  std::vector<float> dx(s.n(), 0.25f), dx_ref(dx), dw(s.channels * s.width, -1.0f), dw_ref(dw);
  causal_conv_silu_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), s.batch, s.seq, s.channels, s.width);
  reference::causal_conv_silu_backward(x.data(), w.data(), dy.data(), dx_ref.data(), dw_ref.data(), s.batch, s.seq,
                                       s.channels, s.width);
  EXPECT_TRUE(close(dx, dx_ref, 1e-5, 1e-6)) << s.width;
  EXPECT_TRUE(close(dw, dw_ref, 1e-5, 1e-6 * std::sqrt(double(s.batch * s.seq)))) << s.width;

  // accumulate_dx = false: dx is overwritten (garbage before), dw still accumulates.
  std::vector<float> dx_over(s.n(), std::nanf("")), dw_over(s.channels * s.width, -1.0f);
  std::vector<float> dx_zero(s.n(), 0.0f), dw_zero(dw_over);
  causal_conv_silu_backward(x.data(), w.data(), dy.data(), dx_over.data(), dw_over.data(), s.batch, s.seq, s.channels,
                            s.width, false);
  causal_conv_silu_backward(x.data(), w.data(), dy.data(), dx_zero.data(), dw_zero.data(), s.batch, s.seq, s.channels,
                            s.width);
  EXPECT_EQ(0, std::memcmp(dx_over.data(), dx_zero.data(), dx_over.size() * sizeof(float))) << s.width;
  EXPECT_EQ(0, std::memcmp(dw_over.data(), dw_zero.data(), dw_over.size() * sizeof(float))) << s.width;
}

// With 2 threads 70 channels split into blocks of 64 + 6; seq 300 crosses the 256-step time block;
// seq 2 < width puts every output inside the zero padding's reach.
TEST(CausalConv, MatchesReferenceF32) {
  for (int64_t width : {1, 3, 4}) matches_reference<float>({2, 37, 70, width});
  matches_reference<float>({1, 300, 20, 4});
  matches_reference<float>({3, 2, 5, 4});
}
TEST(CausalConv, MatchesReferenceBf16) {
  for (int64_t width : {1, 3, 4}) matches_reference<bf16>({2, 37, 70, width});
  matches_reference<bf16>({1, 300, 20, 4});
  matches_reference<bf16>({3, 2, 5, 4});
}

// Central differences in double with h = 1e-6: truncation and round-off are both < 1e-8 here, so 1e-6
// relative is a safe bound that a wrong tap or a dropped SiLU derivative exceeds by orders of magnitude.
TEST(CausalConv, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t batch = 2, seq = 6, channels = 3, width = 4, n = batch * seq * channels;
  auto x = widen(randn(n, 4)), w = widen(randn(channels * width, 6, 0.7f));
  const auto dy = widen(randn(n, 5));
  std::vector<double> y(n), dx(n), dw(channels * width);
  auto loss = [&] {
    reference::causal_conv_silu_forward(x.data(), w.data(), y.data(), batch, seq, channels, width);
    double l = 0;
    for (int64_t i = 0; i < n; ++i) l += dy[i] * y[i];
    return l;
  };
  reference::causal_conv_silu_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), batch, seq, channels,
                                       width);
  test::expect_grad_matches_fd(x, dx, loss, "dx", 1e-6, 1e-6);
  test::expect_grad_matches_fd(w, dw, loss, "dw", 1e-6, 1e-6);
}

// Changing x at step t0 + 1 leaves every output at steps <= t0 bit-identical (and does change step t0 + 1),
// in every batch row, on the fast kernel.
TEST(CausalConv, OutputDoesNotSeeTheFuture) {
  const int64_t batch = 2, seq = 40, channels = 70, width = 4, t0 = 17;
  auto x = randn(batch * seq * channels, 7);
  const auto w = randn(channels * width, 8);
  std::vector<float> y(x.size()), y2(x.size());
  causal_conv_silu_forward(x.data(), w.data(), y.data(), batch, seq, channels, width);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < channels; ++c) x[(b * seq + t0 + 1) * channels + c] += 10.0f;
  causal_conv_silu_forward(x.data(), w.data(), y2.data(), batch, seq, channels, width);
  for (int64_t b = 0; b < batch; ++b) {
    const size_t past = (b * seq + t0 + 1) * channels;
    EXPECT_EQ(0, std::memcmp(y.data() + b * seq * channels, y2.data() + b * seq * channels,
                             (t0 + 1) * channels * sizeof(float)));
    EXPECT_NE(y[past], y2[past]);
  }
}

TEST(CausalConv, WeightGradientIndependentOfThreadCount) {
  const int64_t batch = 2, seq = 50, channels = 200, width = 4, n = batch * seq * channels;
  const auto x = cast<bf16>(randn(n, 9));
  const auto w = randn(channels * width, 10), dy = randn(n, 11);
  std::vector<float> dx1(n), dw1(channels * width), dx3(n), dw3(channels * width);
  test::with_threads(1, [&] {
    causal_conv_silu_backward(x.data(), w.data(), dy.data(), dx1.data(), dw1.data(), batch, seq, channels, width);
  });
  test::with_threads(3, [&] {
    causal_conv_silu_backward(x.data(), w.data(), dy.data(), dx3.data(), dw3.data(), batch, seq, channels, width);
  });
  EXPECT_EQ(0, std::memcmp(dx1.data(), dx3.data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dw1.data(), dw3.data(), dw1.size() * sizeof(float)));
}

TEST(CausalConv, RejectsUnsupportedWidth) {
  std::vector<float> x(4), w(kMaxConvWidth + 1), y(4);
  EXPECT_THROW(causal_conv_silu_forward(x.data(), w.data(), y.data(), 1, 4, 1, kMaxConvWidth + 1),
               std::invalid_argument);
  EXPECT_THROW(causal_conv_silu_forward(x.data(), w.data(), y.data(), 1, 4, 1, 0), std::invalid_argument);
}

}  // namespace
}  // namespace hs::kernels

namespace hs::kernels {

// Column blocks: the forward written into [q | k | v]-like blocks equals the plain output split by columns, and the
// backward reading dy from blocks equals the plain backward on the joined dy; a dx in bf16 is exactly the fp32 dx
// rounded once (the same bits the caller's cast would give), dw unchanged. Block widths cross the channel blocks
// (64-wide with 2 threads at 200 channels).
TEST(CausalConv, ColumnBlocksAndBf16DxEqualThePlainKernels) {
  const int64_t batch = 2, seq = 70, channels = 200, width = 4;
  const int64_t widths[3] = {48, 48, 104};
  const int64_t n = batch * seq * channels;
  const auto x = test::cast<bf16>(test::randn(n, 11));
  const auto w = test::randn(channels * width, 12, 0.7f);
  const auto dy = test::randn(n, 13);
  std::vector<bf16> y(n);
  causal_conv_silu_forward(x.data(), w.data(), y.data(), batch, seq, channels, width);

  std::vector<std::vector<bf16>> yb(3);
  std::vector<std::vector<float>> dyb(3);
  ColumnBlocks<bf16> ys;
  ColumnBlocks<const float> dys;
  for (int i = 0, start = 0; i < 3; start += static_cast<int>(widths[i]), ++i) {
    yb[i].resize(static_cast<size_t>(batch * seq * widths[i]));
    dyb[i].resize(yb[i].size());
    for (int64_t r = 0; r < batch * seq; ++r)
      for (int64_t c = 0; c < widths[i]; ++c) dyb[i][r * widths[i] + c] = dy[r * channels + start + c];
    ys.add(yb[i].data(), widths[i]);
    dys.add(dyb[i].data(), widths[i]);
  }
  causal_conv_silu_forward(x.data(), w.data(), ys, batch, seq, channels, width);
  for (int i = 0, start = 0; i < 3; start += static_cast<int>(widths[i]), ++i)
    for (int64_t r = 0; r < batch * seq; ++r)
      for (int64_t c = 0; c < widths[i]; ++c)
        ASSERT_EQ(to_f32(yb[i][r * widths[i] + c]), to_f32(y[r * channels + start + c])) << i << " " << r << " " << c;

  std::vector<float> dx(n), dw(channels * width, 0.5f), dw_b(dw);
  std::vector<bf16> dx_b(n);
  causal_conv_silu_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), batch, seq, channels, width, false);
  causal_conv_silu_backward<bf16, bf16>(x.data(), w.data(), dys, dx_b.data(), dw_b.data(), batch, seq, channels, width,
                                        false);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(to_f32(dx_b[i]), to_f32(from_f32<bf16>(dx[i]))) << i;
  EXPECT_EQ(0, std::memcmp(dw.data(), dw_b.data(), dw.size() * sizeof(float)));

  EXPECT_THROW((causal_conv_silu_backward<bf16, bf16>(x.data(), w.data(), dys, dx_b.data(), dw_b.data(), batch, seq,
                                                      channels, width, true)),
               std::invalid_argument);
  EXPECT_THROW(causal_conv_silu_forward(x.data(), w.data(), ys, batch, seq, channels + 1, width), std::invalid_argument);
}

}  // namespace hs::kernels
