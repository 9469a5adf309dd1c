// GdnGates: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) against the double-precision
// reference (fp32 and bf16 storage), the backward against finite differences, and the per-head sums'
// independence of the thread count.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/gdn_gates.h"

namespace hs::kernels {
namespace {

std::vector<float> randn(size_t n, uint32_t seed, float mean = 0.0f, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(mean, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

template <typename T> std::vector<T> cast(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_f32<T>(v[i]);
  return out;
}

::testing::AssertionResult close(const std::vector<float>& got, const std::vector<float>& want, double rtol,
                                 double atol) {
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(double(got[i]) - want[i]) <= atol + rtol * std::abs(double(want[i]))))
      return ::testing::AssertionFailure() << "element " << i << ": " << got[i] << " vs " << want[i];
  return ::testing::AssertionSuccess();
}

// fp32 math vs double math on the same stored inputs: exp, log1p and sigmoid are each within a few fp32
// ulps, so rtol 1e-5 holds elementwise with margin; the per-head sums over `rows` terms get an atol
// that grows with sqrt(rows). Inputs go past the softplus threshold of 20 to cover both branches.
template <typename T> void matches_reference() {
  const int64_t rows = 45, heads = 6;
  const auto b = cast<T>(randn(rows * heads, 1, 0.0f, 3.0f));
  auto a_f = randn(rows * heads, 2, 0.0f, 3.0f);
  a_f[7] = 25.0f;  // a + dt_bias above the threshold: softplus is the identity there
  const auto a = cast<T>(a_f);
  const auto A_log = randn(heads, 3, 0.0f, 1.0f), dt_bias = randn(heads, 4, 0.0f, 1.0f);
  const auto dbeta = randn(rows * heads, 5), dg = randn(rows * heads, 6);
  std::vector<float> beta(rows * heads), g(rows * heads), beta_ref(rows * heads), g_ref(rows * heads);
  gdn_gates_forward(b.data(), a.data(), A_log.data(), dt_bias.data(), beta.data(), g.data(), rows, heads);
  reference::gdn_gates_forward(b.data(), a.data(), A_log.data(), dt_bias.data(), beta_ref.data(), g_ref.data(), rows,
                               heads);
  EXPECT_TRUE(close(beta, beta_ref, 1e-5, 1e-7));
  EXPECT_TRUE(close(g, g_ref, 1e-5, 1e-7));
  for (float x : g) EXPECT_LE(x, 0.0f);

  // Non-zero initial gradients check that the backward accumulates.
  std::vector<float> db(rows * heads, 0.5f), da(rows * heads, -0.5f), dA(heads, 1.0f), ddt(heads, 2.0f);
  std::vector<float> db_ref(db), da_ref(da), dA_ref(dA), ddt_ref(ddt);
  gdn_gates_backward(b.data(), a.data(), A_log.data(), dt_bias.data(), dbeta.data(), dg.data(), db.data(), da.data(),
                     dA.data(), ddt.data(), rows, heads);
  reference::gdn_gates_backward(b.data(), a.data(), A_log.data(), dt_bias.data(), dbeta.data(), dg.data(),
                                db_ref.data(), da_ref.data(), dA_ref.data(), ddt_ref.data(), rows, heads);
  EXPECT_TRUE(close(db, db_ref, 1e-5, 1e-7));
  EXPECT_TRUE(close(da, da_ref, 1e-5, 1e-7));
  const double sum_atol = 1e-6 * std::sqrt(double(rows));
  EXPECT_TRUE(close(dA, dA_ref, 1e-5, sum_atol));
  EXPECT_TRUE(close(ddt, ddt_ref, 1e-5, sum_atol));
}

TEST(GdnGates, MatchesReferenceF32) { matches_reference<float>(); }
TEST(GdnGates, MatchesReferenceBf16) { matches_reference<bf16>(); }

// Central differences in double, h = 1e-6: truncation and round-off are < 1e-8 for these O(1) losses,
// so 1e-6 relative leaves margin. Inputs stay well below the softplus threshold, where the function
// has a kink of size ~1e-9 that a finite difference across it would see.
TEST(GdnGates, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, heads = 3, n = rows * heads;
  auto to_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  auto b = to_double(randn(n, 7, 0.0f, 2.0f)), a = to_double(randn(n, 8, 0.0f, 2.0f));
  auto A_log = to_double(randn(heads, 9)), dt_bias = to_double(randn(heads, 10));
  const auto dbeta = to_double(randn(n, 11)), dg = to_double(randn(n, 12));
  std::vector<double> beta(n), g(n), db(n), da(n), dA(heads), ddt(heads);
  auto loss = [&] {
    reference::gdn_gates_forward(b.data(), a.data(), A_log.data(), dt_bias.data(), beta.data(), g.data(), rows, heads);
    double l = 0;
    for (int64_t i = 0; i < n; ++i) l += dbeta[i] * beta[i] + dg[i] * g[i];
    return l;
  };
  reference::gdn_gates_backward(b.data(), a.data(), A_log.data(), dt_bias.data(), dbeta.data(), dg.data(), db.data(),
                                da.data(), dA.data(), ddt.data(), rows, heads);
  const double h = 1e-6;
  auto check = [&](std::vector<double>& p, const std::vector<double>& grad, const char* what) {
    for (size_t i = 0; i < p.size(); ++i) {
      const double save = p[i];
      p[i] = save + h;
      const double lp = loss();
      p[i] = save - h;
      const double lm = loss();
      p[i] = save;
      const double fd = (lp - lm) / (2 * h);
      EXPECT_NEAR(grad[i], fd, 1e-6 * (1.0 + std::abs(fd))) << what << "[" << i << "]";
    }
  };
  check(b, db, "db");
  check(a, da, "da");
  check(A_log, dA, "dA_log");
  check(dt_bias, ddt, "ddt_bias");
}

TEST(GdnGates, HeadGradientsIndependentOfThreadCount) {
  const int64_t rows = 301, heads = 5, n = rows * heads;
  const auto b = cast<bf16>(randn(n, 13)), a = cast<bf16>(randn(n, 14));
  const auto A_log = randn(heads, 15), dt_bias = randn(heads, 16), dbeta = randn(n, 17), dg = randn(n, 18);
  std::vector<float> db1(n), da1(n), dA1(heads), ddt1(heads), db3(n), da3(n), dA3(heads), ddt3(heads);
  const int prev = omp_get_max_threads();
  omp_set_num_threads(1);
  gdn_gates_backward(b.data(), a.data(), A_log.data(), dt_bias.data(), dbeta.data(), dg.data(), db1.data(), da1.data(),
                     dA1.data(), ddt1.data(), rows, heads);
  omp_set_num_threads(3);
  gdn_gates_backward(b.data(), a.data(), A_log.data(), dt_bias.data(), dbeta.data(), dg.data(), db3.data(), da3.data(),
                     dA3.data(), ddt3.data(), rows, heads);
  omp_set_num_threads(prev);
  EXPECT_EQ(0, std::memcmp(dA1.data(), dA3.data(), heads * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(ddt1.data(), ddt3.data(), heads * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(da1.data(), da3.data(), n * sizeof(float)));
}

}  // namespace
}  // namespace hs::kernels
