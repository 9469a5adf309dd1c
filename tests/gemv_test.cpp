// The inference products of a few rows (kernels/gemv.h) on every instruction-set path this CPU runs, against the
// double-precision reference (matmul_reference).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "kernels/gemv.h"
#include "kernels/matmul.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

std::vector<cpu::Level> paths() {
  std::vector<cpu::Level> v;
  for (cpu::Level i : {cpu::Level::Scalar, cpu::Level::Avx2, cpu::Level::Avx512, cpu::Level::Avx512Bf16})
    if (cpu::allows(i)) v.push_back(i);
  return v;
}

// Every path sums the exact products x_k w_k (bf16 times bf16 is exact in fp32) in fp32, in its own order, so each
// output is within K u sum_k |x_k w_k| of the exact sum (u = 2^-24; the standard bound for recursive or blocked
// summation of K terms, first order), plus half a unit of the output's last place (2^-24, or 2^-9 for bf16) of the
// result. Inputs are exact in the reference (it reads the same rounded values), which sums in double.
template <typename T, typename TY>
void expect_within_bound(int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy, cpu::Level isa, uint32_t seed) {
  const std::vector<T> x = test::cast<T>(test::randn(static_cast<size_t>(M * ldx), seed));
  const std::vector<T> W = test::cast<T>(test::randn(static_cast<size_t>(N * K), seed + 1));
  std::vector<T> xp(static_cast<size_t>(M * K));  // packed rows for the reference
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xp[static_cast<size_t>(m * K + k)] = x[static_cast<size_t>(m * ldx + k)];
  std::vector<float> ref(static_cast<size_t>(M * N));
  matmul_reference(xp.data(), W.data(), ref.data(), M, N, K, false, true);
  std::vector<TY> y(static_cast<size_t>(M * ldy), from_f32<TY>(-7.0f));
  gemv(x.data(), W.data(), y.data(), M, N, K, ldx, ldy, isa);
  const double u = std::ldexp(1.0, -24), out_ulp = std::is_same_v<TY, bf16> ? std::ldexp(1.0, -9) : u;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double abs_sum = 0;
      for (int64_t k = 0; k < K; ++k)
        abs_sum += std::abs(double(to_f32(xp[static_cast<size_t>(m * K + k)])) * to_f32(W[static_cast<size_t>(n * K + k)]));
      const double want = ref[static_cast<size_t>(m * N + n)];
      const double bound = (K + 1) * u * abs_sum + out_ulp * std::abs(want) * 2;
      ASSERT_NEAR(to_f32(y[static_cast<size_t>(m * ldy + n)]), want, bound)
          << cpu::level_name(isa) << " M=" << M << " N=" << N << " K=" << K << " at " << m << "," << n;
    }
  // Padding between rows is left alone.
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = N; n < ldy; ++n) ASSERT_EQ(to_f32(y[static_cast<size_t>(m * ldy + n)]), -7.0f);
}

// Shapes at every path's tails: rows 1..5 and 16 (x row blocks of 4), outputs 1..5 and 37 (weight row blocks of 4),
// K around the 8-, 16- and 32-lane steps.
struct Shape {
  int64_t M, N, K;
};
const Shape kShapes[] = {{1, 1, 1},   {1, 5, 7},    {2, 4, 16},  {3, 3, 17},  {4, 37, 31},   {5, 9, 32},
                         {1, 64, 33}, {16, 37, 63}, {8, 13, 64}, {7, 2, 100}, {16, 70, 257}, {1, 300, 1024}};

template <typename T, typename TY> void all_shapes() {
  uint32_t seed = 1;
  for (cpu::Level isa : paths())
    for (const Shape& s : kShapes) {
      expect_within_bound<T, TY>(s.M, s.N, s.K, s.K, s.N, isa, seed++);
      expect_within_bound<T, TY>(s.M, s.N, s.K, s.K + 3, s.N + 2, isa, seed++);  // strided rows
    }
}

TEST(Gemv, Fp32WithinTheSummationBoundOnEveryPath) { all_shapes<float, float>(); }
TEST(Gemv, Bf16ToFp32WithinTheSummationBoundOnEveryPath) { all_shapes<bf16, float>(); }
TEST(Gemv, Bf16ToBf16WithinTheSummationBoundOnEveryPath) { all_shapes<bf16, bf16>(); }

// The bound is tight enough to see a wrong product: one of 256 weight elements off by 1/16 moves the output 16 times
// past it (a check that the test can fail).
TEST(Gemv, TheBoundSeesAOneElementError) {
  const int64_t K = 256;
  std::vector<float> x(K, 1.0f), W(K, 1.0f), y(1);
  W[100] = 1.0f + 1.0f / 16;
  gemv(x.data(), W.data(), y.data(), 1, 1, K);
  EXPECT_GT(std::abs(y[0] - K), (K + 1) * std::ldexp(1.0, -24) * K);
  EXPECT_FLOAT_EQ(y[0], K + 1.0f / 16);
}

// Each output is one dot product in a fixed order: the same bits whatever the thread count, and rows computed
// together equal each row alone (a decode step's sequences do not depend on each other). 600 KiB of weights: the
// threads split them.
TEST(Gemv, BitIdenticalAcrossThreadsAndRowCounts) {
  const int64_t M = 9, N = 301, K = 1024;
  const std::vector<bf16> x = test::cast<bf16>(test::randn(M * K, 5)), W = test::cast<bf16>(test::randn(N * K, 6));
  for (cpu::Level isa : paths()) {
    std::vector<float> one(M * N), two(M * N), alone(M * N);
    test::with_threads(1, [&] { gemv(x.data(), W.data(), one.data(), M, N, K, 0, 0, isa); });
    test::with_threads(2, [&] { gemv(x.data(), W.data(), two.data(), M, N, K, 0, 0, isa); });
    for (int64_t m = 0; m < M; ++m) gemv(x.data() + m * K, W.data(), alone.data() + m * N, 1, N, K, 0, 0, isa);
    EXPECT_EQ(one, two) << cpu::level_name(isa);
    EXPECT_EQ(one, alone) << cpu::level_name(isa);
  }
}

// The fp32-lane paths' sums, emulated in scalar code operation by operation (IEEE fused multiply-adds and adds, so
// any correct build gives these bits): 16 lanes, lane l summing x_k w_k for k = l mod 16 in ascending k (fused
// multiply-adds; a padded tail's zero products change nothing here), then lane l + 8 added to lane l, l + 4, l + 2
// and l + 1 (GCC's _mm512_reduce_add_ps). AVX-512F keeps the 16 lanes in one register, AVX2 in two 8-lane halves (bf16 weights: even
// and odd lanes) with the same order. Whatever order a block visits its rows and x rows in, these are the bits: a
// reordering inside the kernels that changed a sum fails here.
float lanes16_sum(const float* x, const float* w, int64_t K) {
  float a[16] = {};
  for (int64_t k = 0; k < K; ++k) a[k % 16] = std::fma(x[k], w[k], a[k % 16]);
  for (int h = 8; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) a[l] = a[l] + a[l + h];
  return a[0];
}

TEST(Gemv, Fp32LanePathsSumInTheDocumentedOrder) {
  std::vector<cpu::Level> isas;
  for (cpu::Level i : {cpu::Level::Avx2, cpu::Level::Avx512})
    if (cpu::allows(i)) isas.push_back(i);
  if (isas.empty()) GTEST_SKIP() << "no AVX2 or AVX-512 on this CPU";
  uint32_t seed = 40;
  for (cpu::Level isa : isas)
    for (int64_t M : {1, 2, 4, 5, 8, 9})
      for (int64_t K : {7, 15, 16, 17, 31, 33, 47, 256, 300})
        for (int64_t N : {1, 9, 20}) {
          const std::vector<float> xf = test::randn(static_cast<size_t>(M * K), seed++);
          const std::vector<float> Wf = test::randn(static_cast<size_t>(N * K), seed++);
          const std::vector<bf16> Wb = test::cast<bf16>(Wf), xb = test::cast<bf16>(xf);
          std::vector<float> y(static_cast<size_t>(M * N)), yb(static_cast<size_t>(M * N));
          gemv(xf.data(), Wf.data(), y.data(), M, N, K, 0, 0, isa);
          gemv(xb.data(), Wb.data(), yb.data(), M, N, K, 0, 0, isa);
          const std::vector<float> xbf(xb.begin(), xb.end()), Wbf(Wb.begin(), Wb.end());  // exact widenings
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) {
              const size_t o = static_cast<size_t>(m * N + n), xo = static_cast<size_t>(m * K), wo = static_cast<size_t>(n * K);
              const auto sum = lanes16_sum;
              ASSERT_EQ(y[o], sum(xf.data() + xo, Wf.data() + wo, K))
                  << cpu::level_name(isa) << " fp32 M=" << M << " N=" << N << " K=" << K << " at " << m << "," << n;
              ASSERT_EQ(yb[o], sum(xbf.data() + xo, Wbf.data() + wo, K))
                  << cpu::level_name(isa) << " bf16 M=" << M << " N=" << N << " K=" << K << " at " << m << "," << n;
            }
        }
}

// The AVX2 path gives the AVX-512F path's bits (the same 16 lanes and reduction, in two 8-lane halves), for fp32 and
// bf16 operands, strided x rows, every blocking (M = 1: 8 x 1; 2-4: 4 x 4; 9: 4 x 4 and a pass of one; AVX-512F 2 x 8
// above 4), K off the 16-lane step; and gemv_rows over any block split gives gemv's bits on the AVX2 path (the
// fused decode step's threads call it on their own rows). Without AVX-512F only the second half runs.
TEST(Gemv, Avx2GivesTheAvx512fBitsAndGemvRowsGivesGemvs) {
  if (!cpu::allows(cpu::Level::Avx2)) GTEST_SKIP() << "no AVX2 on this CPU";
  const bool avx512 = cpu::allows(cpu::Level::Avx512);
  uint32_t seed = 90;
  for (int64_t M : {1, 2, 3, 4, 5, 9})
    for (int64_t K : {1, 15, 16, 18, 63, 200, 1024}) {
      const int64_t N = 43, ldx = K + 5;
      const std::vector<float> xf = test::randn(static_cast<size_t>(M * ldx), seed++);
      const std::vector<float> Wf = test::randn(static_cast<size_t>(N * K), seed++);
      const std::vector<bf16> xb = test::cast<bf16>(xf), Wb = test::cast<bf16>(Wf);
      std::vector<float> a32(M * N), b32(M * N), a16(M * N), b16(M * N), r16(M * N, -1.0f);
      gemv(xf.data(), Wf.data(), a32.data(), M, N, K, ldx, 0, cpu::Level::Avx2);
      gemv(xb.data(), Wb.data(), a16.data(), M, N, K, ldx, 0, cpu::Level::Avx2);
      if (avx512) {
        gemv(xf.data(), Wf.data(), b32.data(), M, N, K, ldx, 0, cpu::Level::Avx512);
        gemv(xb.data(), Wb.data(), b16.data(), M, N, K, ldx, 0, cpu::Level::Avx512);
        EXPECT_EQ(a32, b32) << "fp32 M=" << M << " K=" << K;
        EXPECT_EQ(a16, b16) << "bf16 M=" << M << " K=" << K;
      }
      const int64_t align = gemv_row_align(M, cpu::Level::Avx2);
      for (int64_t n0 = 0; n0 < N; n0 += 2 * align)
        gemv_rows(xb.data(), Wb.data(), r16.data(), M, N, K, ldx, 0, n0, std::min(N, n0 + 2 * align),
                  cpu::Level::Avx2);
      EXPECT_EQ(r16, a16) << "gemv_rows bf16 M=" << M << " K=" << K;
    }
}

// Software prefetch (gemv_prefetch_blocks) changes no value: every distance, every path, every blocking (M = 1, 3,
// 8), fp32 and bf16 weights, a last block shorter than the others (N = 301). The default prefetches 2 blocks ahead
// for the AVX-512 paths' 2 x 8 and 3 x 8 blocks (M > 4) only.
TEST(Gemv, PrefetchChangesNoBit) {
  const int64_t N = 301, K = 1000;
  const std::vector<float> xf = test::randn(8 * K, 7), Wf = test::randn(N * K, 8);
  const std::vector<bf16> xb = test::cast<bf16>(xf), Wb = test::cast<bf16>(Wf);
  for (cpu::Level isa : paths())
    for (int64_t M : {1, 3, 8}) {
      std::vector<float> want32(M * N), want16(M * N);
      set_gemv_prefetch_blocks(0);
      gemv(xf.data(), Wf.data(), want32.data(), M, N, K, 0, 0, isa);
      gemv(xb.data(), Wb.data(), want16.data(), M, N, K, 0, 0, isa);
      for (int pf : {1, 2, 4, 100, -1}) {
        set_gemv_prefetch_blocks(pf);
        std::vector<float> y32(M * N), y16(M * N);
        gemv(xf.data(), Wf.data(), y32.data(), M, N, K, 0, 0, isa);
        gemv(xb.data(), Wb.data(), y16.data(), M, N, K, 0, 0, isa);
        EXPECT_EQ(y32, want32) << cpu::level_name(isa) << " M " << M << " prefetch " << pf;
        EXPECT_EQ(y16, want16) << cpu::level_name(isa) << " M " << M << " prefetch " << pf;
      }
    }
  set_gemv_prefetch_blocks(-1);
  const bool avx512 = gemv_level() == cpu::Level::Avx512 || gemv_level() == cpu::Level::Avx512Bf16;
  if (!std::getenv("HS_GEMV_PREFETCH")) {
    EXPECT_EQ(gemv_prefetch_blocks(1, gemv_level()), 0);
    EXPECT_EQ(gemv_prefetch_blocks(4, gemv_level()), 0);
    EXPECT_EQ(gemv_prefetch_blocks(8, gemv_level()), avx512 ? 2 : 0);
    for (int64_t M : {1, 4, 8}) EXPECT_EQ(gemv_prefetch_blocks(M, gemv_level(), 4), 2) << "fp32 weights, M " << M;
  }
}

TEST(Gemv, BadInputIsRefused) {
  std::vector<float> x(17 * 4), W(4 * 4), y(17 * 4);
  EXPECT_THROW(gemv(x.data(), W.data(), y.data(), 17, 4, 4), std::invalid_argument);
  EXPECT_THROW(gemv(x.data(), W.data(), y.data(), -1, 4, 4), std::invalid_argument);
  cpu::ScopedLevel avx2(cpu::Level::Avx2);  // a path above the level in force is refused, not run
  EXPECT_THROW(gemv(x.data(), W.data(), y.data(), 1, 4, 4, 0, 0, cpu::Level::Avx512), std::invalid_argument);
  EXPECT_THROW(gemv_row_align(1, cpu::Level::Avx512Bf16), std::invalid_argument);
}

// Inside a SmallRowProducts scope matmul's few-row products x W^T are gemv's (same bits, no oneDNN primitive);
// others, and every product outside the scope, stay on matmul's own paths.
TEST(Gemv, SmallRowScopeRoutesFewRowProductsOnly) {
  const int64_t K = 96, N = 80;
  const std::vector<bf16> x = test::cast<bf16>(test::randn(20 * K, 7)), W = test::cast<bf16>(test::randn(N * K, 8));
  std::vector<bf16> direct(3 * N), scoped(3 * N);
  gemv(x.data(), W.data(), direct.data(), 3, N, K);
  const int64_t before = matmul_primitives_created(), calls = matmul_onednn_calls();
  {
    const SmallRowProducts scope;
    matmul(x.data(), W.data(), scoped.data(), 3, N, K, false, true);
  }
  EXPECT_EQ(matmul_primitives_created(), before);
  EXPECT_EQ(matmul_onednn_calls(), calls);
  for (size_t i = 0; i < direct.size(); ++i) ASSERT_EQ(direct[i].bits, scoped[i].bits) << i;
  std::vector<float> many(20 * N);
  {
    const SmallRowProducts scope;
    matmul(x.data(), W.data(), many.data(), 20, N, K, false, true);  // 20 rows: oneDNN
  }
  const int64_t after_many = matmul_onednn_calls();  // one call, or one per tile (kernels/matmul.h)
  EXPECT_GT(after_many, calls);
  std::vector<float> outside(3 * N);
  matmul(x.data(), W.data(), outside.data(), 3, N, K, false, true);  // no scope: oneDNN
  EXPECT_GT(matmul_onednn_calls(), after_many);
}

}  // namespace
}  // namespace hs::kernels
