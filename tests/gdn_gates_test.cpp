// GdnGates: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) against the double-precision
// reference (fp32 and bf16 storage), the backward against finite differences, and the per-head sums'
// independence of the thread count.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/gdn_gates.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::close;
using test::randn;
using test::widen;

// fp32 math vs double math on the same stored inputs: exp, log1p and sigmoid are each within a few fp32
// ulps, so rtol 1e-5 holds elementwise with margin; the per-head sums over `rows` terms get an atol
// that grows with sqrt(rows). Inputs go past the softplus threshold of 20 to cover both branches.
template <typename T> void matches_reference() {
  const int64_t rows = 45, heads = 6;
  const auto b = cast<T>(randn(rows * heads, 1, 3.0f));
  auto a_f = randn(rows * heads, 2, 3.0f);
  a_f[7] = 25.0f;  // a + dt_bias above the threshold: softplus is the identity there
  const auto a = cast<T>(a_f);
  const auto A_log = randn(heads, 3), dt_bias = randn(heads, 4);
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
  auto b = widen(randn(n, 7, 2.0f)), a = widen(randn(n, 8, 2.0f));
  auto A_log = widen(randn(heads, 9)), dt_bias = widen(randn(heads, 10));
  const auto dbeta = widen(randn(n, 11)), dg = widen(randn(n, 12));
  std::vector<double> beta(n), g(n), db(n), da(n), dA(heads), ddt(heads);
  auto loss = [&] {
    reference::gdn_gates_forward(b.data(), a.data(), A_log.data(), dt_bias.data(), beta.data(), g.data(), rows, heads);
    double l = 0;
    for (int64_t i = 0; i < n; ++i) l += dbeta[i] * beta[i] + dg[i] * g[i];
    return l;
  };
  reference::gdn_gates_backward(b.data(), a.data(), A_log.data(), dt_bias.data(), dbeta.data(), dg.data(), db.data(),
                                da.data(), dA.data(), ddt.data(), rows, heads);
  test::expect_grad_matches_fd(b, db, loss, "db", 1e-6, 1e-6);
  test::expect_grad_matches_fd(a, da, loss, "da", 1e-6, 1e-6);
  test::expect_grad_matches_fd(A_log, dA, loss, "dA_log", 1e-6, 1e-6);
  test::expect_grad_matches_fd(dt_bias, ddt, loss, "ddt_bias", 1e-6, 1e-6);
}

TEST(GdnGates, HeadGradientsIndependentOfThreadCount) {
  const int64_t rows = 301, heads = 5, n = rows * heads;
  const auto b = cast<bf16>(randn(n, 13)), a = cast<bf16>(randn(n, 14));
  const auto A_log = randn(heads, 15), dt_bias = randn(heads, 16), dbeta = randn(n, 17), dg = randn(n, 18);
  std::vector<float> db1(n), da1(n), dA1(heads), ddt1(heads), db3(n), da3(n), dA3(heads), ddt3(heads);
  test::with_threads(1, [&] {
    gdn_gates_backward(b.data(), a.data(), A_log.data(), dt_bias.data(), dbeta.data(), dg.data(), db1.data(),
                       da1.data(), dA1.data(), ddt1.data(), rows, heads);
  });
  test::with_threads(3, [&] {
    gdn_gates_backward(b.data(), a.data(), A_log.data(), dt_bias.data(), dbeta.data(), dg.data(), db3.data(),
                       da3.data(), dA3.data(), ddt3.data(), rows, heads);
  });
  EXPECT_EQ(0, std::memcmp(dA1.data(), dA3.data(), heads * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(ddt1.data(), ddt3.data(), heads * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(da1.data(), da3.data(), n * sizeof(float)));
}

}  // namespace
}  // namespace hs::kernels
