#include "kernels/mlp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/vec_math.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::randn;
using test::rel_rms;
using test::widen;

template <typename T>
void check_against_reference(int64_t N, int64_t H, int64_t I, double tol, uint32_t seed) {
  const auto x = cast<T>(randn(N * H, seed));
  const auto wg = cast<T>(randn(I * H, seed + 1, 1.0f / std::sqrt(float(H))));
  const auto wu = cast<T>(randn(I * H, seed + 2, 1.0f / std::sqrt(float(H))));
  const auto wd = cast<T>(randn(H * I, seed + 3, 1.0f / std::sqrt(float(I))));
  const auto dy = randn(N * H, seed + 4);

  MemoryAccountant mem;
  SwigluSaved saved;
  std::vector<T> y(N * H);
  swiglu_forward<T>(N, H, I, x.data(), wg.data(), wu.data(), wd.data(), y.data(), &saved, mem);

  // The reference sees exactly the T values the kernel saw, widened to double.
  const auto xd = widen(x), wgd = widen(wg), wud = widen(wu), wdd = widen(wd), dyd = widen(dy);
  std::vector<double> yr(N * H);
  reference::swiglu_forward<double>(N, H, I, xd.data(), wgd.data(), wud.data(), wdd.data(), yr.data());
  EXPECT_LT(rel_rms(y, yr), tol) << "y";

  // Gradients start from random values: backward must add to them, not overwrite.
  const auto dx0 = randn(N * H, seed + 5), dwg0 = randn(I * H, seed + 6), dwu0 = randn(I * H, seed + 7),
             dwd0 = randn(H * I, seed + 8);
  auto dx = dx0, dwg = dwg0, dwu = dwu0, dwd = dwd0;
  std::vector<float> row_dot(N);
  swiglu_backward<T>(N, H, I, x.data(), wg.data(), wu.data(), wd.data(), saved, dy.data(), dx.data(), dwg.data(),
                     dwu.data(), dwd.data(), mem, row_dot.data());
  std::vector<double> dxr(N * H), dwgr(I * H), dwur(I * H), dwdr(H * I);
  reference::swiglu_backward<double>(N, H, I, xd.data(), wgd.data(), wud.data(), wdd.data(), dyd.data(), dxr.data(),
                                     dwgr.data(), dwur.data(), dwdr.data());
  auto sub = [](std::vector<float> a, const std::vector<float>& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
    return a;
  };
  EXPECT_LT(rel_rms(sub(dx, dx0), dxr), tol) << "dx";
  EXPECT_LT(rel_rms(sub(dwg, dwg0), dwgr), tol) << "dw_gate";
  EXPECT_LT(rel_rms(sub(dwu, dwu0), dwur), tol) << "dw_up";
  EXPECT_LT(rel_rms(sub(dwd, dwd0), dwdr), tol) << "dw_down";
  std::vector<double> dot_r(N, 0.0);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < H; ++h) dot_r[t] += dyd[t * H + h] * yr[t * H + h];
  EXPECT_LT(rel_rms(row_dot, dot_r), tol) << "row_dot";
}

// fp32: oneDNN's fp32 products differ from the double reference by accumulation order only
// (~1e-7 relative per product over K <= 48 terms); 1e-5 relative RMS keeps a wide margin while any
// indexing or layout error is O(1).
TEST(SwigluMlp, MatchesReferenceF32) { check_against_reference<float>(33, 48, 40, 1e-5, 10); }

// bf16: the pre-activations, silu * up, y, dy and the pre-activation gradients are each rounded to bf16
// (unit round-off 2^-9 ~ 2e-3), a handful of independent roundings per value: ~0.5% relative RMS;
// 2e-2 leaves margin, still far below the O(1) of a wrong result.
TEST(SwigluMlp, MatchesReferenceBf16) { check_against_reference<bf16>(33, 48, 40, 2e-2, 20); }

// Central differences in double on the reference (eps 1e-6: truncation ~eps^2 ~ 1e-12, cancellation
// ~1e-16 / eps ~ 1e-10 for an O(1) loss), against a 1e-6 relative tolerance.
TEST(SwigluMlp, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t N = 3, H = 5, I = 4;
  auto x = widen(randn(N * H, 1)), wg = widen(randn(I * H, 2, 0.5f)), wu = widen(randn(I * H, 3, 0.5f)),
       wd = widen(randn(H * I, 4, 0.5f)), dy = widen(randn(N * H, 5));
  std::vector<double> dx(N * H), dwg(I * H), dwu(I * H), dwd(H * I), y(N * H);
  reference::swiglu_backward<double>(N, H, I, x.data(), wg.data(), wu.data(), wd.data(), dy.data(), dx.data(),
                                     dwg.data(), dwu.data(), dwd.data());
  auto loss = [&] {
    reference::swiglu_forward<double>(N, H, I, x.data(), wg.data(), wu.data(), wd.data(), y.data());
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
    return l;
  };
  test::expect_grad_matches_fd(x, dx, loss, "x", 1e-6, 1e-6);
  test::expect_grad_matches_fd(wg, dwg, loss, "w_gate", 1e-6, 1e-6);
  test::expect_grad_matches_fd(wu, dwu, loss, "w_up", 1e-6, 1e-6);
  test::expect_grad_matches_fd(wd, dwd, loss, "w_down", 1e-6, 1e-6);
}

// The planner runs the same code over shapes: every allocation, and so every peak, must agree.
template <typename T>
void check_planning() {
  const int64_t N = 17, H = 24, I = 20;
  const auto x = cast<T>(randn(N * H, 7)), w = cast<T>(randn(I * H, 8, 0.2f));
  const auto dy = randn(N * H, 9);
  std::vector<float> dx(N * H), dw(I * H * 3);
  std::vector<T> y(N * H);
  auto run = [&](MemoryAccountant& mem) {
    SwigluSaved saved;
    swiglu_forward<T>(N, H, I, x.data(), w.data(), w.data(), w.data(), y.data(), &saved, mem);
    swiglu_backward<T>(N, H, I, x.data(), w.data(), w.data(), w.data(), saved, dy.data(), dx.data(), dw.data(),
                       dw.data() + I * H, dw.data() + 2 * I * H, mem);
  };
  MemoryAccountant real, plan(true);
  run(real);
  run(plan);
  EXPECT_EQ(plan.peak_total(), real.peak_total());
  EXPECT_EQ(plan.allocations(), real.allocations());
  for (size_t c = 0; c < kNumMemCategories; ++c)
    EXPECT_EQ(plan.peak(MemCategory(c)), real.peak(MemCategory(c))) << category_name(MemCategory(c));
  EXPECT_EQ(real.peak(MemCategory::Activations), size_t(N * 2 * I) * sizeof(T));
  EXPECT_EQ(real.live_total(), 0u);
}
// Backward's fused row pass gives exactly what the two separate passes give.
template <typename T>
void check_fused_rows(int64_t rows, int64_t inter, uint32_t seed) {
  const auto gu = cast<T>(randn(rows * 2 * inter, seed, 3.0f));
  const auto dact = randn(rows * inter, seed + 1);
  const auto scale = randn(rows, seed + 2);
  for (const float* sc : {static_cast<const float*>(nullptr), scale.data()}) {
    std::vector<T> act(rows * inter), act2(rows * inter), dgu(rows * 2 * inter), dgu2(rows * 2 * inter);
    std::vector<float> dot(rows), dot2(rows);
    pieces::swiglu_act_rows<T>(rows, inter, gu.data(), sc, act.data());
    pieces::swiglu_grad_rows<T>(rows, inter, gu.data(), dact.data(), sc, dgu.data(), dot.data());
    pieces::swiglu_act_grad_rows<T>(rows, inter, gu.data(), dact.data(), sc, act2.data(), dgu2.data(), dot2.data());
    EXPECT_EQ(std::memcmp(act.data(), act2.data(), act.size() * sizeof(T)), 0);
    EXPECT_EQ(std::memcmp(dgu.data(), dgu2.data(), dgu.size() * sizeof(T)), 0);
    EXPECT_EQ(dot, dot2);
  }
}

TEST(SwigluMlp, FusedActGradRowsMatchSeparatePasses) {
  check_fused_rows<float>(70, 37, 11);  // odd width: vector remainders
  check_fused_rows<bf16>(70, 37, 12);
  check_fused_rows<bf16>(300, 256, 13);  // above the parallel threshold
}

// The bf16 rounding of the row kernels (vcvtneps2bf16 where the CPU has it, which flushes subnormals that
// the kernel then rounds separately) equals from_f32 on every bf16 value of u, subnormals, infinities and
// NaNs included: act = g * sigmoid(g) * u with g = 100 (sigmoid exactly 1), 1 and -3.
TEST(SwigluMlp, ActRowsRoundLikeFromF32) {
  const int64_t rows = 256, inter = 256;
  for (const float g : {100.0f, 1.0f, -3.0f}) {
    std::vector<bf16> gu(rows * 2 * inter), act(rows * inter);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < inter; ++i) {
        gu[r * 2 * inter + i] = from_f32<bf16>(g);
        gu[r * 2 * inter + inter + i].bits = static_cast<uint16_t>(r * inter + i);
      }
    pieces::swiglu_act_rows<bf16>(rows, inter, gu.data(), nullptr, act.data());
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < inter; ++i) {
        const float u = to_f32(gu[r * 2 * inter + inter + i]);
        const float gi = to_f32(from_f32<bf16>(g));
        bad += act[r * inter + i].bits != from_f32<bf16>(1.0f * gi * sigmoid_vec(gi) * u).bits;
      }
    EXPECT_EQ(bad, 0) << "g = " << g;
  }
}

TEST(SwigluMlp, PlannedPeakEqualsMeasured) {
  check_planning<float>();
  check_planning<bf16>();
}

TEST(SwigluMlp, InferenceKeepsNoActivations) {
  const int64_t N = 4, H = 8, I = 6;
  const auto x = randn(N * H, 1), w = randn(I * H, 2, 0.3f);
  std::vector<float> y(N * H), y_train(N * H);
  MemoryAccountant mem;
  swiglu_forward<float>(N, H, I, x.data(), w.data(), w.data(), w.data(), y.data(), nullptr, mem);
  EXPECT_EQ(mem.peak(MemCategory::Activations), 0u);
  EXPECT_EQ(mem.live_total(), 0u);
  SwigluSaved saved;
  swiglu_forward<float>(N, H, I, x.data(), w.data(), w.data(), w.data(), y_train.data(), &saved, mem);
  EXPECT_EQ(y, y_train);
}

}  // namespace
}  // namespace hs::kernels

namespace hs::kernels {

// accumulate_dx = false writes dx (NaN before) with the same bits as adding it to zeros; the weight gradients still
// accumulate the same way.
TEST(SwigluMlp, WritingDxEqualsAddingToZeros) {
  const int64_t N = 37, H = 48, I = 40;
  const auto x = test::cast<bf16>(test::randn(N * H, 91));
  const auto wg = test::cast<bf16>(test::randn(I * H, 92, 0.15f));
  const auto wu = test::cast<bf16>(test::randn(I * H, 93, 0.15f));
  const auto wd = test::cast<bf16>(test::randn(H * I, 94, 0.15f));
  const auto dy = test::randn(N * H, 95);
  MemoryAccountant mem;
  SwigluSaved saved;
  std::vector<bf16> y(N * H);
  swiglu_forward<bf16>(N, H, I, x.data(), wg.data(), wu.data(), wd.data(), y.data(), &saved, mem);
  auto run = [&](bool accumulate, float fill) {
    std::vector<std::vector<float>> g = {std::vector<float>(N * H, fill), std::vector<float>(I * H, 0.5f),
                                         std::vector<float>(I * H, 0.5f), std::vector<float>(H * I, 0.5f)};
    swiglu_backward<bf16>(N, H, I, x.data(), wg.data(), wu.data(), wd.data(), saved, dy.data(), g[0].data(),
                          g[1].data(), g[2].data(), g[3].data(), mem, nullptr, accumulate);
    return g;
  };
  const auto added = run(true, 0.0f), written = run(false, std::nanf(""));
  for (size_t i = 0; i < added.size(); ++i)
    EXPECT_EQ(0, std::memcmp(added[i].data(), written[i].data(), added[i].size() * sizeof(float))) << i;
}

}  // namespace hs::kernels
