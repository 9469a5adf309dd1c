// RmsNorm, GatedRmsNorm and L2Norm: fast kernels vs the double-precision references (fp32 and bf16
// storage), the references' backwards vs central finite differences, and dw's independence of the
// thread count.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/norms.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::close;
using test::randn;
using test::widen;
using test::with_threads;

// Central differences of loss() with respect to each element of p, against the analytic grad. In double
// with h = 1e-6 the truncation error (h^2/6 * f''') and round-off (1e-16 * |L| / h) are both below 1e-8
// for these O(1) losses, so 1e-6 relative (and absolute) leaves margin while a wrong term is off by >= 1e-3.
template <typename Loss>
void check_fd(std::vector<double>& p, const std::vector<double>& grad, Loss loss, const char* what) {
  test::expect_grad_matches_fd(p, grad, loss, what, 1e-6, 1e-6);
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Tolerances for fast (fp32 math) vs reference (double math) on identical stored inputs:
// * fp32 outputs and all fp32 gradients: sums of <= 300 fp32 products round to ~1e-6 relative, so
//   rtol 2e-5 plus atol 2e-5 (for outputs that cancel to near zero) is a safe bound; a wrong formula
//   is off by O(1e-2) or more.
// * bf16 outputs: both sides round a value that agrees to ~1e-6 to bf16, so they differ by at most one
//   bf16 ulp, 2^-7 relative.
constexpr double kF32Rtol = 2e-5, kF32Atol = 2e-5, kBf16Rtol = 1.0 / 128, kBf16Atol = 1e-6;

template <typename T> constexpr double out_rtol() { return std::is_same_v<T, bf16> ? kBf16Rtol : kF32Rtol; }
template <typename T> constexpr double out_atol() { return std::is_same_v<T, bf16> ? kBf16Atol : kF32Atol; }

// ---------------- RmsNorm ----------------

template <typename T> void rmsnorm_matches_reference(int64_t rows, int64_t dim) {
  const float eps = 1e-6f;
  const auto x = cast<T>(randn(rows * dim, 1, 2.0f, 0.3f));
  const auto w = randn(dim, 2, 0.5f);
  const auto dy = randn(rows * dim, 3);
  std::vector<T> y(rows * dim), y_ref(rows * dim), y_norstd(rows * dim);
  std::vector<float> rstd(rows), rstd_ref(rows);
  rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, dim, eps);
  reference::rmsnorm_forward(x.data(), w.data(), y_ref.data(), rstd_ref.data(), rows, dim, eps);
  EXPECT_TRUE(close(y, y_ref, out_rtol<T>(), out_atol<T>()));
  EXPECT_TRUE(close(rstd, rstd_ref, kF32Rtol, 0.0));
  rmsnorm_forward(x.data(), w.data(), y_norstd.data(), nullptr, rows, dim, eps);
  EXPECT_EQ(0, std::memcmp(y.data(), y_norstd.data(), y.size() * sizeof(T)));

  // Non-zero initial gradients check that the backward accumulates.
  std::vector<float> dx(rows * dim, 0.5f), dx_ref(dx), dw(dim, -0.25f), dw_ref(dw);
  rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), rows, dim);
  reference::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx_ref.data(), dw_ref.data(), rows, dim);
  EXPECT_TRUE(close(dx, dx_ref, kF32Rtol, kF32Atol));
  // dw sums `rows` terms: atol scales with sqrt(rows).
  EXPECT_TRUE(close(dw, dw_ref, kF32Rtol, kF32Atol * std::sqrt(double(rows))));
}

TEST(RmsNorm, MatchesReferenceF32) {
  rmsnorm_matches_reference<float>(7, 67);
  rmsnorm_matches_reference<float>(65, 300);
  rmsnorm_matches_reference<float>(1000, 64);  // many dw row blocks
}
TEST(RmsNorm, MatchesReferenceBf16) {
  rmsnorm_matches_reference<bf16>(7, 67);
  rmsnorm_matches_reference<bf16>(65, 300);
  rmsnorm_matches_reference<bf16>(1000, 64);
}

TEST(RmsNorm, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t rows = 3, dim = 5;
  const double eps = 1e-6;
  auto x = widen(randn(rows * dim, 4, 1.0f, 0.2f));
  auto w = widen(randn(dim, 5, 0.5f));
  const auto dy = widen(randn(rows * dim, 6));
  std::vector<double> y(rows * dim), rstd(rows), dx(rows * dim), dw(dim);
  auto loss = [&] {
    reference::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, dim, eps);
    return dot(dy, y);
  };
  loss();
  reference::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), rows, dim);
  check_fd(x, dx, loss, "dx");
  check_fd(w, dw, loss, "dw");
}

// Enough rows for many row blocks (dw is summed per block, then over blocks).
TEST(RmsNorm, WeightGradientIndependentOfThreadCount) {
  const int64_t rows = 3001, dim = 100;
  const auto x = cast<bf16>(randn(rows * dim, 7));
  const auto w = randn(dim, 8);
  const auto dy = randn(rows * dim, 9);
  std::vector<float> rstd(rows);
  std::vector<bf16> y(rows * dim);
  rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, dim, 1e-6f);
  std::vector<float> dx1(rows * dim), dw1(dim), dx3(rows * dim), dw3(dim);
  with_threads(
      1, [&] { rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx1.data(), dw1.data(), rows, dim); });
  with_threads(
      3, [&] { rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx3.data(), dw3.data(), rows, dim); });
  EXPECT_EQ(0, std::memcmp(dx1.data(), dx3.data(), dx1.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dw1.data(), dw3.data(), dw1.size() * sizeof(float)));
}

// ---------------- GatedRmsNorm ----------------

template <typename T> void gated_matches_reference(int64_t rows, int64_t dim) {
  const float eps = 1e-6f;
  const auto x = cast<T>(randn(rows * dim, 11, 1.5f, -0.1f));
  const auto z = cast<T>(randn(rows * dim, 12, 3.0f));
  const auto w = randn(dim, 13, 0.3f, 1.0f);
  const auto dy = randn(rows * dim, 14);
  std::vector<T> y(rows * dim), y_ref(rows * dim);
  std::vector<float> rstd(rows), rstd_ref(rows);
  gated_rmsnorm_forward(x.data(), z.data(), w.data(), y.data(), rstd.data(), rows, dim, eps);
  reference::gated_rmsnorm_forward(x.data(), z.data(), w.data(), y_ref.data(), rstd_ref.data(), rows, dim, eps);
  EXPECT_TRUE(close(y, y_ref, out_rtol<T>(), out_atol<T>()));
  EXPECT_TRUE(close(rstd, rstd_ref, kF32Rtol, 0.0));

  std::vector<float> dx(rows * dim, 0.5f), dx_ref(dx), dz(rows * dim, -1.0f), dz_ref(dz), dw(dim, 2.0f), dw_ref(dw);
  gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx.data(), dz.data(), dw.data(), rows,
                         dim);
  reference::gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx_ref.data(), dz_ref.data(),
                                    dw_ref.data(), rows, dim);
  EXPECT_TRUE(close(dx, dx_ref, kF32Rtol, kF32Atol));
  EXPECT_TRUE(close(dz, dz_ref, kF32Rtol, kF32Atol));
  EXPECT_TRUE(close(dw, dw_ref, kF32Rtol, kF32Atol * std::sqrt(double(rows))));
}

TEST(GatedRmsNorm, MatchesReferenceF32) {
  gated_matches_reference<float>(9, 33);
  gated_matches_reference<float>(64, 128);
  gated_matches_reference<float>(1000, 64);  // many dw row blocks
  gated_matches_reference<float>(5, 300);  // the backward's SiLU buffer in two pieces (256 + 44)
}
TEST(GatedRmsNorm, MatchesReferenceBf16) {
  gated_matches_reference<bf16>(9, 33);
  gated_matches_reference<bf16>(64, 128);
  gated_matches_reference<bf16>(1000, 64);
  gated_matches_reference<bf16>(5, 300);  // the backward's SiLU buffer in two pieces (256 + 44)
}

TEST(GatedRmsNorm, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t rows = 3, dim = 6;
  const double eps = 1e-6;
  auto x = widen(randn(rows * dim, 15));
  auto z = widen(randn(rows * dim, 16, 2.0f));
  auto w = widen(randn(dim, 17, 0.3f, 1.0f));
  const auto dy = widen(randn(rows * dim, 18));
  std::vector<double> y(rows * dim), rstd(rows), dx(rows * dim), dz(rows * dim), dw(dim);
  auto loss = [&] {
    reference::gated_rmsnorm_forward(x.data(), z.data(), w.data(), y.data(), rstd.data(), rows, dim, eps);
    return dot(dy, y);
  };
  loss();
  reference::gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx.data(), dz.data(),
                                    dw.data(), rows, dim);
  check_fd(x, dx, loss, "dx");
  check_fd(z, dz, loss, "dz");
  check_fd(w, dw, loss, "dw");
}

TEST(GatedRmsNorm, WeightGradientIndependentOfThreadCount) {
  const int64_t rows = 2077, dim = 128;
  const auto x = randn(rows * dim, 19), z = randn(rows * dim, 20), w = randn(dim, 21), dy = randn(rows * dim, 22);
  std::vector<float> y(rows * dim), rstd(rows);
  gated_rmsnorm_forward(x.data(), z.data(), w.data(), y.data(), rstd.data(), rows, dim, 1e-6f);
  std::vector<float> dx1(rows * dim), dz1(rows * dim), dw1(dim), dx3(rows * dim), dz3(rows * dim), dw3(dim);
  with_threads(1, [&] {
    gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx1.data(), dz1.data(), dw1.data(),
                           rows, dim);
  });
  with_threads(3, [&] {
    gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx3.data(), dz3.data(), dw3.data(),
                           rows, dim);
  });
  EXPECT_EQ(0, std::memcmp(dw1.data(), dw3.data(), dw1.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dz1.data(), dz3.data(), dz1.size() * sizeof(float)));
}

// ---------------- L2Norm ----------------

template <typename T> void l2norm_matches_reference(int64_t rows, int64_t dim, float scale) {
  const float eps = 1e-6f;
  const auto x = cast<T>(randn(rows * dim, 23, 0.7f, 0.1f));
  const auto dy = randn(rows * dim, 24);
  std::vector<T> y(rows * dim), y_ref(rows * dim);
  std::vector<float> rstd(rows), rstd_ref(rows);
  l2norm_forward(x.data(), y.data(), rstd.data(), rows, dim, eps, scale);
  reference::l2norm_forward(x.data(), y_ref.data(), rstd_ref.data(), rows, dim, eps, scale);
  EXPECT_TRUE(close(y, y_ref, out_rtol<T>(), out_atol<T>()));
  EXPECT_TRUE(close(rstd, rstd_ref, kF32Rtol, 0.0));
  std::vector<float> dx(rows * dim, 0.5f), dx_ref(dx);
  l2norm_backward(x.data(), rstd.data(), dy.data(), dx.data(), rows, dim, scale);
  reference::l2norm_backward(x.data(), rstd.data(), dy.data(), dx_ref.data(), rows, dim, scale);
  EXPECT_TRUE(close(dx, dx_ref, kF32Rtol, kF32Atol));
}

TEST(L2Norm, MatchesReferenceF32) {
  l2norm_matches_reference<float>(10, 37, 1.0f);
  l2norm_matches_reference<float>(48, 128, 1.0f / std::sqrt(128.0f));
}
TEST(L2Norm, MatchesReferenceBf16) {
  l2norm_matches_reference<bf16>(10, 37, 1.0f);
  l2norm_matches_reference<bf16>(48, 128, 1.0f / std::sqrt(128.0f));
}

TEST(L2Norm, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, dim = 5;
  const double eps = 1e-6, scale = 0.37;
  auto x = widen(randn(rows * dim, 25));
  const auto dy = widen(randn(rows * dim, 26));
  std::vector<double> y(rows * dim), rstd(rows), dx(rows * dim);
  auto loss = [&] {
    reference::l2norm_forward(x.data(), y.data(), rstd.data(), rows, dim, eps, scale);
    return dot(dy, y);
  };
  loss();
  reference::l2norm_backward(x.data(), rstd.data(), dy.data(), dx.data(), rows, dim, scale);
  check_fd(x, dx, loss, "dx");
}

// The norm uses a sum (not a mean) and the caller's eps: a unit-length row stays unit length and
// an all-zero row gives rstd = eps^-1/2 and y = 0.
TEST(L2Norm, SumSemantics) {
  const std::vector<float> x = {0.6f, 0.8f, 0.0f, 0.0f, 0.0f, 0.0f};
  std::vector<float> y(6), rstd(2);
  l2norm_forward(x.data(), y.data(), rstd.data(), 2, 3, 1e-6f, 1.0f);
  EXPECT_NEAR(y[0], 0.6f, 1e-6);
  EXPECT_NEAR(y[1], 0.8f, 1e-6);
  EXPECT_FLOAT_EQ(rstd[1], 1000.0f);
  EXPECT_EQ(y[3], 0.0f);
}

}  // namespace
}  // namespace hs::kernels

namespace hs::kernels {

// The dx modes: writing (accumulate = false) gives exactly what accumulating into zeros gives, and starting from a
// residual exactly what accumulating into a copy of it gives (one float addition per element either way); dw
// accumulates in every mode. A mode that accumulated anyway or ignored the residual differs by O(1).
TEST(Norms, BackwardDxModesEqualAccumulatingIntoZerosOrACopy) {
  const int64_t rows = 70, dim = 48;
  const auto x = test::randn(rows * dim, 31, 1.0f, 0.2f);
  const auto z = test::randn(rows * dim, 32);
  const auto w = test::randn(dim, 33, 0.5f);
  const auto dy = test::randn(rows * dim, 34);
  const auto residual = test::randn(rows * dim, 35);
  std::vector<float> rstd(rows), y(rows * dim);
  rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, dim, 1e-6f);
  const auto n = static_cast<size_t>(rows * dim);
  auto same = [&](const std::vector<float>& a, const std::vector<float>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  {  // rmsnorm: write, residual + g
    std::vector<float> acc(n, 0.0f), wr(n, 7.0f), acc_res(residual), res(n, 7.0f), dw1(dim, 0.5f), dw2(dim, 0.5f);
    rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), acc.data(), dw1.data(), rows, dim);
    rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), wr.data(), dw2.data(), rows, dim, false);
    EXPECT_TRUE(same(acc, wr));
    EXPECT_TRUE(same(dw1, dw2));
    rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), acc_res.data(), dw1.data(), rows, dim);
    rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), res.data(), dw2.data(), rows, dim, false,
                     residual.data());
    EXPECT_TRUE(same(acc_res, res));
    EXPECT_TRUE(same(dw1, dw2));  // accumulated twice in both
    EXPECT_THROW(rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), res.data(), dw2.data(), rows, dim, true,
                                  residual.data()),
                 std::invalid_argument);
  }
  {  // gated rmsnorm: dx and dz written
    gated_rmsnorm_forward(x.data(), z.data(), w.data(), y.data(), rstd.data(), rows, dim, 1e-6f);
    std::vector<float> dx1(n, 0.0f), dz1(n, 0.0f), dx2(n, 3.0f), dz2(n, -3.0f), dw1(dim, 0.0f), dw2(dim, 0.0f);
    gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx1.data(), dz1.data(), dw1.data(),
                           rows, dim);
    gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx2.data(), dz2.data(), dw2.data(),
                           rows, dim, false);
    EXPECT_TRUE(same(dx1, dx2));
    EXPECT_TRUE(same(dz1, dz2));
    EXPECT_TRUE(same(dw1, dw2));
  }
  {  // l2 norm
    l2norm_forward(x.data(), y.data(), rstd.data(), rows, dim, 1e-6f, 0.5f);
    std::vector<float> dx1(n, 0.0f), dx2(n, 9.0f);
    l2norm_backward(x.data(), rstd.data(), dy.data(), dx1.data(), rows, dim, 0.5f);
    l2norm_backward(x.data(), rstd.data(), dy.data(), dx2.data(), rows, dim, 0.5f, false);
    EXPECT_TRUE(same(dx1, dx2));
  }
}

}  // namespace hs::kernels

namespace hs::kernels {

// A dz in bf16 (it only feeds a bf16 product) is the fp32 dz rounded once; dx and dw are unchanged.
TEST(Norms, GatedBackwardBf16DzIsTheFp32DzRounded) {
  const int64_t rows = 40, dim = 64;
  const auto x = test::cast<bf16>(test::randn(rows * dim, 41));
  const auto z = test::cast<bf16>(test::randn(rows * dim, 42));
  const auto w = test::randn(dim, 43, 0.5f);
  const auto dy = test::randn(rows * dim, 44);
  std::vector<float> rstd(rows);
  std::vector<bf16> y(rows * dim);
  gated_rmsnorm_forward(x.data(), z.data(), w.data(), y.data(), rstd.data(), rows, dim, 1e-6f);
  const auto n = static_cast<size_t>(rows * dim);
  std::vector<float> dx1(n), dz1(n), dx2(n), dw1(dim, 0.0f), dw2(dim, 0.0f);
  std::vector<bf16> dz2(n);
  gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx1.data(), dz1.data(), dw1.data(), rows,
                         dim, false);
  gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx2.data(), dz2.data(), dw2.data(), rows,
                         dim, false);
  EXPECT_EQ(0, std::memcmp(dx1.data(), dx2.data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dw1.data(), dw2.data(), dim * sizeof(float)));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(to_f32(dz2[i]), to_f32(from_f32<bf16>(dz1[i]))) << i;
  EXPECT_THROW(gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx2.data(), dz2.data(),
                                      dw2.data(), rows, dim, true),
               std::invalid_argument);
}

}  // namespace hs::kernels

namespace hs::kernels {

// rmsnorm_backward's optional copy of dx in bf16 is dx rounded once, and dx itself is unchanged by asking for it.
TEST(Norms, RmsnormBackwardDxCopyInBf16IsDxRounded) {
  const int64_t rows = 33, dim = 80;
  const auto x = test::cast<bf16>(test::randn(rows * dim, 51));
  const auto w = test::randn(dim, 52, 0.5f);
  const auto dy = test::randn(rows * dim, 53);
  const auto res = test::randn(rows * dim, 54);
  std::vector<float> rstd(rows);
  std::vector<bf16> y(rows * dim);
  rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, dim, 1e-6f);
  const auto n = static_cast<size_t>(rows * dim);
  std::vector<float> dx1(n), dx2(n), dw1(dim, 0.0f), dw2(dim, 0.0f);
  std::vector<bf16> dxt(n);
  rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx1.data(), dw1.data(), rows, dim, false, res.data());
  rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx2.data(), dw2.data(), rows, dim, false, res.data(),
                   dxt.data());
  EXPECT_EQ(0, std::memcmp(dx1.data(), dx2.data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dw1.data(), dw2.data(), dim * sizeof(float)));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(to_f32(dxt[i]), to_f32(from_f32<bf16>(dx1[i]))) << i;
}

}  // namespace hs::kernels

namespace hs::kernels {

// rmsnorm_backward_strided (dx only in T, at a row stride: the attention's query rows inside the q_proj gradient)
// writes exactly the bits of the plain backward's fp32 dx (no residual, written) rounded to T, leaves the columns
// between rows untouched, accumulates the same dw; fp32 (T = float: the fp32 dx itself) and bf16, 1 and 3 threads.
template <typename T> void strided_backward_equals_plain(int threads) {
  const int64_t rows = 97, dim = 64, stride = 2 * dim;
  const auto x = test::cast<T>(test::randn(rows * dim, 61));
  const auto w = test::randn(dim, 62, 0.5f);
  const auto dy = test::randn(rows * dim, 63);
  std::vector<float> rstd(rows);
  std::vector<T> y(rows * dim);
  rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, dim, 1e-6f);
  const auto n = static_cast<size_t>(rows * dim);
  std::vector<float> dx(n), dw1(dim, 0.25f), dw2(dim, 0.25f);
  std::vector<T> out(static_cast<size_t>(rows * stride), from_f32<T>(7.0f));
  test::with_threads(threads, [&] {
    rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw1.data(), rows, dim, false);
    rmsnorm_backward_strided(x.data(), w.data(), rstd.data(), dy.data(), out.data(), stride, dw2.data(), rows, dim);
  });
  EXPECT_EQ(0, std::memcmp(dw1.data(), dw2.data(), dim * sizeof(float)));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < dim; ++c) {
      ASSERT_EQ(to_f32(out[r * stride + c]), to_f32(from_f32<T>(dx[r * dim + c]))) << r << " " << c;
      ASSERT_EQ(to_f32(out[r * stride + dim + c]), 7.0f) << r << " " << c;
    }
  EXPECT_THROW(rmsnorm_backward_strided(x.data(), w.data(), rstd.data(), dy.data(), out.data(), dim - 1, dw2.data(),
                                        rows, dim),
               std::invalid_argument);
}
TEST(Norms, RmsnormBackwardStridedIsThePlainDxRounded) {
  strided_backward_equals_plain<float>(1);
  strided_backward_equals_plain<float>(3);
  strided_backward_equals_plain<bf16>(1);
  strided_backward_equals_plain<bf16>(3);
}

}  // namespace hs::kernels

namespace hs::kernels {

// add_rmsnorm_forward: the sum is a + b rounded to T and y, rstd are rmsnorm_forward's of that stored sum, bit for
// bit (fp32 and bf16, rows over the parallel threshold, 1 and 3 threads).
template <typename T> void add_norm_equals_add_then_norm(int threads) {
  const int64_t rows = 130, dim = 256;
  const auto a = test::cast<T>(test::randn(rows * dim, 71));
  const auto b = test::cast<T>(test::randn(rows * dim, 72));
  const auto w = test::randn(dim, 73, 0.5f);
  const auto n = static_cast<size_t>(rows * dim);
  std::vector<T> sum1(n), sum2(n), y1(n), y2(n);
  std::vector<float> r1(rows), r2(rows);
  test::with_threads(threads, [&] {
    for (size_t i = 0; i < n; ++i) sum1[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
    rmsnorm_forward(sum1.data(), w.data(), y1.data(), r1.data(), rows, dim, 1e-6f);
    add_rmsnorm_forward(a.data(), b.data(), sum2.data(), w.data(), y2.data(), r2.data(), rows, dim, 1e-6f);
  });
  EXPECT_EQ(0, std::memcmp(sum1.data(), sum2.data(), n * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), n * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(r1.data(), r2.data(), rows * sizeof(float)));
}
TEST(Norms, AddRmsnormForwardIsTheAddThenTheNorm) {
  add_norm_equals_add_then_norm<float>(1);
  add_norm_equals_add_then_norm<float>(3);
  add_norm_equals_add_then_norm<bf16>(1);
  add_norm_equals_add_then_norm<bf16>(3);
}

}  // namespace hs::kernels

namespace hs::kernels {

// The paired L2 norms (queries and keys in one pass, each its own scale) give the bits of a call for each, forward and
// backward (written and accumulated), fp32 and bf16, 1 and 3 threads.
template <typename T> void l2_pair_equals_two_calls(int threads) {
  const int64_t rows = 300, dim = 64;
  const auto q = test::cast<T>(test::randn(rows * dim, 91)), k = test::cast<T>(test::randn(rows * dim, 92));
  const auto dq = test::randn(rows * dim, 93), dk = test::randn(rows * dim, 94);
  const auto n = static_cast<size_t>(rows * dim);
  std::vector<T> qn1(n), kn1(n), qn2(n), kn2(n);
  std::vector<float> rq1(rows), rk1(rows), rq2(rows), rk2(rows);
  std::vector<float> gq1(n, 0.5f), gk1(n, 0.5f), gq2(n, 0.5f), gk2(n, 0.5f);
  for (bool acc : {false, true})
    test::with_threads(threads, [&] {
      l2norm_forward(q.data(), qn1.data(), rq1.data(), rows, dim, 1e-6f, 0.125f);
      l2norm_forward(k.data(), kn1.data(), rk1.data(), rows, dim, 1e-6f, 1.0f);
      l2norm_forward(L2NormPair<const T, T>{{q.data(), k.data()}, {qn2.data(), kn2.data()}, {rq2.data(), rk2.data()},
                                            {0.125f, 1.0f}},
                     rows, dim, 1e-6f);
      l2norm_backward(q.data(), rq1.data(), dq.data(), gq1.data(), rows, dim, 0.125f, acc);
      l2norm_backward(k.data(), rk1.data(), dk.data(), gk1.data(), rows, dim, 1.0f, acc);
      l2norm_backward(L2NormBackwardPair<T>{{q.data(), k.data()}, {rq2.data(), rk2.data()}, {dq.data(), dk.data()},
                                            {gq2.data(), gk2.data()}, {0.125f, 1.0f}},
                      rows, dim, acc);
    });
  EXPECT_EQ(0, std::memcmp(qn1.data(), qn2.data(), n * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(kn1.data(), kn2.data(), n * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(rq1.data(), rq2.data(), rows * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(rk1.data(), rk2.data(), rows * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(gq1.data(), gq2.data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(gk1.data(), gk2.data(), n * sizeof(float)));
}
TEST(Norms, L2NormPairEqualsACallForEach) {
  l2_pair_equals_two_calls<float>(1);
  l2_pair_equals_two_calls<bf16>(3);
}

}  // namespace hs::kernels
