#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/matmul.h"

namespace hs::kernels {

// fp32 products of length K accumulate round-off ~ sqrt(K) * 2^-24 relative; 1e-4 relative to the
// row scale leaves a wide margin at K <= 512 while a wrong layout gives O(1) errors.
TEST(Matmul, F32AllTransposesAndAccumulate) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const int64_t M = 37, N = 53, K = 71;
  std::vector<float> A(M * K), B(K * N), C(M * N), R(M * N);
  for (auto& x : A) x = nd(rng);
  for (auto& x : B) x = nd(rng);
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (int acc = 0; acc < 2; ++acc) {
        for (int64_t i = 0; i < M * N; ++i) C[i] = R[i] = 0.5f * static_cast<float>(i % 7);
        matmul(A.data(), B.data(), C.data(), M, N, K, ta, tb, acc);
        matmul_reference(A.data(), B.data(), R.data(), M, N, K, ta, tb, acc);
        for (int64_t i = 0; i < M * N; ++i) ASSERT_NEAR(C[i], R[i], 1e-4 * std::sqrt(double(K))) << ta << tb << acc;
      }
}

// bf16 inputs are exact in the reference (same rounded values), products accumulate in fp32 in both,
// so only fp32 accumulation-order differences remain.
TEST(Matmul, Bf16InputsAccumulateInF32) {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  const int64_t M = 64, N = 96, K = 256;
  std::vector<bf16> A(M * K), B(N * K);
  std::vector<float> C(M * N), R(M * N);
  for (auto& x : A) x = bf16(nd(rng));
  for (auto& x : B) x = bf16(nd(rng));
  matmul(A.data(), B.data(), C.data(), M, N, K, false, true);
  matmul_reference(A.data(), B.data(), R.data(), M, N, K, false, true);
  for (int64_t i = 0; i < M * N; ++i) ASSERT_NEAR(C[i], R[i], 1e-3);
}

TEST(Matmul, PrimitivesAreCachedPerShape) {
  std::vector<float> A(8 * 8, 1.f), B(8 * 8, 1.f), C(8 * 8);
  matmul(A.data(), B.data(), C.data(), 8, 8, 8, false, false);
  int64_t n = matmul_primitives_created();
  for (int i = 0; i < 5; ++i) matmul(A.data(), B.data(), C.data(), 8, 8, 8, false, false);
  EXPECT_EQ(matmul_primitives_created(), n);
  EXPECT_FLOAT_EQ(C[0], 8.f);
}

}  // namespace hs::kernels

namespace hs::kernels {

// Products with one dimension <= 16 run on hybridscan's own skinny loops (the rest on oneDNN). Every
// transpose combination and both output types are checked against the double reference, at each small
// dimension's boundary (16 runs skinny, 17 does not), with and without accumulation. bf16 inputs are exact in
// the reference, so only fp32 accumulation order differs: 1e-4 * sqrt(K) relative to unit-scale products;
// a bf16 output adds one rounding (2^-8 relative).
TEST(Matmul, SkinnyShapesMatchReference) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  struct Shape {
    int64_t M, N, K;
  };
  for (const Shape& s : {Shape{300, 4, 256}, Shape{300, 16, 70}, Shape{300, 17, 70}, Shape{300, 256, 4},
                         Shape{257, 100, 16}, Shape{4, 256, 300}, Shape{8, 130, 4096}, Shape{16, 64, 33},
                         Shape{1, 1, 1000}, Shape{1000, 1, 1}}) {
    const int64_t M = s.M, N = s.N, K = s.K;
    std::vector<float> A(M * K), B(K * N);
    for (auto& x : A) x = nd(rng);
    for (auto& x : B) x = nd(rng);
    std::vector<bf16> Ab(A.begin(), A.end()), Bb(B.begin(), B.end());
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (int acc = 0; acc < 2; ++acc) {
          const double tol = 1e-4 * std::sqrt(double(K));
          std::vector<float> C(M * N), R(M * N);
          for (int64_t i = 0; i < M * N; ++i) C[i] = R[i] = 0.5f * static_cast<float>(i % 7);
          matmul(A.data(), B.data(), C.data(), M, N, K, ta, tb, acc);
          matmul_reference(A.data(), B.data(), R.data(), M, N, K, ta, tb, acc);
          for (int64_t i = 0; i < M * N; ++i)
            ASSERT_NEAR(C[i], R[i], tol) << "f32 " << M << "x" << N << "x" << K << " " << ta << tb << acc;
          std::vector<float> Cb(M * N), Rb(M * N);
          for (int64_t i = 0; i < M * N; ++i) Cb[i] = Rb[i] = 0.5f * static_cast<float>(i % 7);
          matmul(Ab.data(), Bb.data(), Cb.data(), M, N, K, ta, tb, acc);
          matmul_reference(Ab.data(), Bb.data(), Rb.data(), M, N, K, ta, tb, acc);
          for (int64_t i = 0; i < M * N; ++i)
            ASSERT_NEAR(Cb[i], Rb[i], tol) << "bf16->f32 " << M << "x" << N << "x" << K << " " << ta << tb << acc;
          std::vector<bf16> Co(M * N);
          std::vector<float> Ro(M * N);
          for (int64_t i = 0; i < M * N; ++i) Co[i] = bf16(Ro[i] = 0.5f * static_cast<float>(i % 7));
          matmul(Ab.data(), Bb.data(), Co.data(), M, N, K, ta, tb, acc);
          matmul_reference(Ab.data(), Bb.data(), Ro.data(), M, N, K, ta, tb, acc);
          for (int64_t i = 0; i < M * N; ++i)
            ASSERT_NEAR(to_f32(Co[i]), Ro[i], tol + std::abs(Ro[i]) * 0x1p-8)
                << "bf16 " << M << "x" << N << "x" << K << " " << ta << tb << acc;
        }
  }
}

// Leading dimensions larger than the shape (views into wider buffers) on the skinny paths.
TEST(Matmul, SkinnyShapesWithLeadingDimensions) {
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  const int64_t M = 200, N = 8, K = 64, pad = 5;
  std::vector<float> A(M * (K + pad)), B(N * (K + pad)), C(M * (N + pad), 1.f);
  for (auto& x : A) x = nd(rng);
  for (auto& x : B) x = nd(rng);
  matmul(A.data(), B.data(), C.data(), M, N, K, false, true, false, {K + pad, K + pad, N + pad});
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(A[i * (K + pad) + k]) * B[j * (K + pad) + k];
      ASSERT_NEAR(C[i * (N + pad) + j], s, 1e-4 * std::sqrt(double(K)));
    }
    for (int64_t j = N; j < N + pad; ++j) ASSERT_EQ(C[i * (N + pad) + j], 1.f) << "wrote outside the view";
  }
}

// The skinny loops give the same bits for any thread count (each sum runs in a fixed order). They split over threads
// only above 2^22 streamed elements, so the shapes are that large: one per loop (small N, small K, small M).
TEST(Matmul, SkinnyBitIdenticalAcrossThreads) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  struct Case {
    int64_t M, N, K;
    bool ta, tb;
  };
  for (const Case& c : {Case{4, 256, 20000, true, false}, Case{20000, 4, 256, false, true},
                        Case{20000, 256, 4, false, false}}) {
    std::vector<bf16> A(c.K * c.M), B(c.K * c.N);
    for (auto& x : A) x = bf16(nd(rng));
    for (auto& x : B) x = bf16(nd(rng));
    std::vector<float> C1(c.M * c.N), C2(c.M * c.N);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    matmul(A.data(), B.data(), C1.data(), c.M, c.N, c.K, c.ta, c.tb);
    omp_set_num_threads(2);
    matmul(A.data(), B.data(), C2.data(), c.M, c.N, c.K, c.ta, c.tb);
    omp_set_num_threads(saved);
    EXPECT_EQ(0, std::memcmp(C1.data(), C2.data(), C1.size() * sizeof(float))) << c.M << "x" << c.N << "x" << c.K;
  }
}

// oneDNN's products give the same bits for 1, 2 and 3 threads at every level (kernels/matmul.h): on AVX-512 its own
// blocking does, below it matmul.cpp's shape-only tiles do. The shapes are where a threaded gemm would cut K among
// threads (a few output blocks, K long), where the grid has one tile, several tiles with ragged edges, a weight
// gradient (A transposed) with and without rows at execution, a transposed B, fp32 and bf16 (widened below
// AVX-512-BF16), with and without accumulation. Fails under HS_MAX_ISA=avx2 with the tiles taken out of run_onednn.
TEST(Matmul, OneDnnProductsBitIdenticalAcrossThreads) {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  struct Case {
    int64_t M, N, K;
    bool ta, tb, acc, varying;
  };
  const Case cases[] = {{64, 96, 8192, false, false, false, false}, {40, 48, 20000, true, false, true, true},
                        {300, 700, 512, false, true, false, false},  {300, 700, 512, false, true, true, true},
                        {256, 200, 3000, true, false, false, false}, {130, 520, 257, true, true, false, false}};
  for (const Case& c : cases)
    for (int bf = 0; bf < 2; ++bf) {
      std::vector<float> A(static_cast<size_t>(c.M * c.K)), B(static_cast<size_t>(c.K * c.N));
      for (auto& x : A) x = nd(rng);
      for (auto& x : B) x = nd(rng);
      const std::vector<bf16> Ab(A.begin(), A.end()), Bb(B.begin(), B.end());
      MatmulLayout ld;
      ld.varying_rows = c.varying;
      auto run = [&](int threads) {
        std::vector<float> C(static_cast<size_t>(c.M * c.N), 0.5f);
        const int saved = omp_get_max_threads();
        omp_set_num_threads(threads);
        if (bf) matmul(Ab.data(), Bb.data(), C.data(), c.M, c.N, c.K, c.ta, c.tb, c.acc, ld);
        else matmul(A.data(), B.data(), C.data(), c.M, c.N, c.K, c.ta, c.tb, c.acc, ld);
        omp_set_num_threads(saved);
        return C;
      };
      const std::vector<float> one = run(1);
      for (int threads : {2, 3})
        EXPECT_EQ(0, std::memcmp(one.data(), run(threads).data(), one.size() * sizeof(float)))
            << c.M << "x" << c.N << "x" << c.K << (c.ta ? " ta" : "") << (c.tb ? " tb" : "") << (bf ? " bf16" : " f32")
            << ", " << threads << " threads";
    }
}

// Every instruction-set path of the skinny loops this CPU has, against the double reference (the tolerance of
// SkinnyShapesMatchReference: fp32 accumulation order, 1e-4 * sqrt(K) on unit-scale products, plus one bf16
// rounding of a bf16 output), at widths around the vector lengths (1, 7, 15, 16 + 1, 33 columns or rows) and
// ragged K. The small-M loop (weight gradients) and the small-K loop sum in the same order with the same fused
// operations on every path: bit for bit the scalar loop's result; so does the small-N loop on an AVX-512 build (its
// lanes replay the order of the compiler's 16-lane reduction of the scalar loop).
TEST(Matmul, SkinnyVectorPathsMatchReferenceAndScalar) {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  struct Shape {
    int64_t M, N, K;
  };
  for (int isa_i = 0; isa_i <= 2; ++isa_i) {
    const auto isa = static_cast<cpu::Level>(isa_i);
    if (!cpu::allows(isa)) continue;
    for (const Shape& s : {Shape{300, 4, 256}, Shape{37, 7, 1000}, Shape{65, 16, 33}, Shape{40, 3, 17},
                           Shape{4, 256, 300}, Shape{8, 130, 4096}, Shape{16, 64, 33}, Shape{7, 33, 100},
                           Shape{1, 17, 5}, Shape{13, 48, 70}, Shape{300, 256, 4}, Shape{257, 100, 16},
                           Shape{50, 47, 5}, Shape{20, 8, 3}, Shape{9, 7, 2}}) {
      const int64_t M = s.M, N = s.N, K = s.K;
      std::vector<float> A(M * K), B(K * N);
      for (auto& x : A) x = nd(rng);
      for (auto& x : B) x = nd(rng);
      std::vector<bf16> Ab(A.begin(), A.end()), Bb(B.begin(), B.end());
      const double tol = 1e-4 * std::sqrt(double(K));
      // (ta, tb): (0, 1) runs the small-N loop when N is small, (1, 0) the small-M loop when M is small, (0, 0) the
      // small-K loop when K is small.
      for (const auto& [ta, tb] : {std::pair{false, true}, std::pair{true, false}, std::pair{false, false}}) {
        for (int acc = 0; acc < 2; ++acc) {
          std::vector<float> C(M * N), R(M * N), S(M * N), Cb(M * N), Rb(M * N), Sb(M * N);
          for (int64_t i = 0; i < M * N; ++i) C[i] = R[i] = S[i] = Cb[i] = Rb[i] = Sb[i] = 0.25f * float(i % 5);
          std::vector<bf16> Co(M * N);
          std::vector<float> Ro(M * N);
          for (int64_t i = 0; i < M * N; ++i) Co[i] = bf16(Ro[i] = 0.5f * static_cast<float>(i % 7));
          {
            cpu::ScopedLevel forced(isa);
            matmul(A.data(), B.data(), C.data(), M, N, K, ta, tb, acc);
            matmul(Ab.data(), Bb.data(), Cb.data(), M, N, K, ta, tb, acc);
            matmul(Ab.data(), Bb.data(), Co.data(), M, N, K, ta, tb, acc);
          }
          {
            cpu::ScopedLevel forced(cpu::Level::Scalar);
            matmul(A.data(), B.data(), S.data(), M, N, K, ta, tb, acc);
            matmul(Ab.data(), Bb.data(), Sb.data(), M, N, K, ta, tb, acc);
          }
          matmul_reference(A.data(), B.data(), R.data(), M, N, K, ta, tb, acc);
          matmul_reference(Ab.data(), Bb.data(), Rb.data(), M, N, K, ta, tb, acc);
          matmul_reference(Ab.data(), Bb.data(), Ro.data(), M, N, K, ta, tb, acc);
          const std::string where = std::to_string(isa_i) + " " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                                    std::to_string(K) + " " + std::to_string(ta) + std::to_string(tb) + std::to_string(acc);
          for (int64_t i = 0; i < M * N; ++i) {
            ASSERT_NEAR(C[i], R[i], tol) << "f32 " << where;
            ASSERT_NEAR(Cb[i], Rb[i], tol) << "bf16->f32 " << where;
            ASSERT_NEAR(to_f32(Co[i]), Ro[i], tol + std::abs(Ro[i]) * 0x1p-8) << "bf16 " << where;
          }
          // The small-N loop's lanes keep one order on every path (the scalar loop spells it out), on every build.
          const bool small_n_bits = !ta && tb && N <= 16;
          if ((ta && M <= 16) || (!ta && !tb && K <= 16) || small_n_bits) {
            EXPECT_EQ(0, std::memcmp(C.data(), S.data(), C.size() * sizeof(float))) << "f32 vs scalar " << where;
            EXPECT_EQ(0, std::memcmp(Cb.data(), Sb.data(), Cb.size() * sizeof(float))) << "bf16 vs scalar " << where;
          }
        }
      }
    }
  }
}

}  // namespace hs::kernels

namespace hs::kernels {

// Weight-gradient products (trans_a, summed over K rows) issued with varying_rows take K at execution: one
// primitive per (M, N, layout) serves every row count, and each count still gives the reference result. bf16 inputs are exact in the
// reference, so only fp32 accumulation order differs (1e-4 * sqrt(K) on unit-scale products).
TEST(Matmul, TransposedAProductsTakeAnyRowCountFromOnePrimitive) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const int64_t M = 48, N = 80;
  int64_t created = -1;
  for (int64_t K : {17, 100, 255, 1000, 333}) {
    std::vector<bf16> A(static_cast<size_t>(K * M)), B(static_cast<size_t>(K * N));
    for (auto& x : A) x = bf16(nd(rng));
    for (auto& x : B) x = bf16(nd(rng));
    std::vector<float> C(static_cast<size_t>(M * N)), R(C.size());
    for (size_t i = 0; i < C.size(); ++i) C[i] = R[i] = 0.25f * static_cast<float>(i % 5);
    MatmulLayout any_rows;
    any_rows.varying_rows = true;
    matmul(A.data(), B.data(), C.data(), M, N, K, true, false, true, any_rows);
    matmul_reference(A.data(), B.data(), R.data(), M, N, K, true, false, true);
    for (size_t i = 0; i < C.size(); ++i) ASSERT_NEAR(C[i], R[i], 1e-4 * std::sqrt(double(K))) << "K " << K;
    if (created < 0) created = matmul_primitives_created();
    else EXPECT_EQ(matmul_primitives_created(), created) << "K " << K << " created a primitive";
  }
}

}  // namespace hs::kernels

namespace hs::kernels {

// Row-wise products issued with varying_rows take M at execution: one primitive per (N, K, layout) serves every row
// count, with B stored either way, and each count gives the reference (bf16 inputs exact in the reference, fp32
// accumulation order only: 1e-4 * sqrt(K)).
TEST(Matmul, RowWiseProductsTakeAnyRowCountFromOnePrimitive) {
  std::mt19937 rng(6);
  std::normal_distribution<float> nd;
  const int64_t N = 96, K = 64;
  for (int tb = 0; tb < 2; ++tb) {
    int64_t created = -1;
    for (int64_t M : {17, 130, 255, 33, 700}) {
      std::vector<bf16> A(static_cast<size_t>(M * K)), B(static_cast<size_t>(K * N));
      for (auto& x : A) x = bf16(nd(rng));
      for (auto& x : B) x = bf16(nd(rng));
      std::vector<float> C(static_cast<size_t>(M * N), 7.0f), R(C.size());
      MatmulLayout any_rows;
      any_rows.varying_rows = true;
      matmul(A.data(), B.data(), C.data(), M, N, K, false, tb, false, any_rows);
      matmul_reference(A.data(), B.data(), R.data(), M, N, K, false, tb, false);
      for (size_t i = 0; i < C.size(); ++i) ASSERT_NEAR(C[i], R[i], 1e-4 * std::sqrt(double(K))) << "M " << M;
      if (created < 0) created = matmul_primitives_created();
      else EXPECT_EQ(matmul_primitives_created(), created) << "M " << M << " created a primitive";
    }
  }
}

}  // namespace hs::kernels

namespace hs::kernels {

// ---- Packed weights ----
// The packed product must be the same kernel on the same numbers as the plain one: bit for bit, for both uses,
// both dtypes, bf16 and fp32 outputs, with and without accumulation, at shapes whose K and N are not multiples of
// oneDNN's blocks (the packed layout's padding must read as zeros), and against the double reference (bf16 inputs
// exact there: fp32 accumulation order only, 1e-4 * sqrt(K) relative to unit-scale data).
template <typename T, typename TC> void check_packed_bits(int64_t M, int64_t out, int64_t in) {
  const DType dt = dtype_of<T>();
  for (WeightUse use : {WeightUse::Forward, WeightUse::BackwardData}) {
    const bool fwd = use == WeightUse::Forward;
    const int64_t N = fwd ? out : in, K = fwd ? in : out;
    if (packed_weight_bytes(dt, out, in, use) == 0) GTEST_SKIP() << "oneDNN reads these weights plain on this CPU";
    std::mt19937 rng(static_cast<uint32_t>(M * 7 + out * 3 + in));
    std::normal_distribution<float> nd;
    std::vector<T> A(static_cast<size_t>(M * K)), W(static_cast<size_t>(out * in));
    for (auto& x : A) x = T(nd(rng));
    for (auto& x : W) x = T(nd(rng));
    for (int acc = 0; acc < 2; ++acc) {
      std::vector<TC> plain(static_cast<size_t>(M * N)), packed(plain.size());
      for (size_t i = 0; i < plain.size(); ++i) plain[i] = packed[i] = TC(0.25f * static_cast<float>(i % 5));
      matmul(A.data(), W.data(), plain.data(), M, N, K, false, fwd, acc);
      MemoryAccountant mem;
      PackedWeight pw(W.data(), dt, out, in, use, mem, MemCategory::WeightCasts, "test");
      ASSERT_TRUE(pw.active());
      EXPECT_EQ(mem.live(MemCategory::WeightCasts), packed_weight_bytes(dt, out, in, use));
      pw.pack();
      const int64_t before = matmul_packed_products();
      matmul(A.data(), W.data(), packed.data(), M, N, K, false, fwd, acc);
      EXPECT_EQ(matmul_packed_products(), before + 1) << "the packed copy was not read";
      ASSERT_EQ(std::memcmp(plain.data(), packed.data(), plain.size() * sizeof(TC)), 0)
          << (fwd ? "x W^T" : "dy W") << " acc " << acc << " M " << M << " out " << out << " in " << in;
      if constexpr (std::is_same_v<TC, float>) {
        std::vector<float> R(plain.size());
        for (size_t i = 0; i < R.size(); ++i) R[i] = 0.25f * static_cast<float>(i % 5);
        matmul_reference(A.data(), W.data(), R.data(), M, N, K, false, fwd, acc);
        for (size_t i = 0; i < R.size(); ++i) ASSERT_NEAR(packed[i], R[i], 1e-4 * std::sqrt(double(K)) * 4);
      }
    }
  }
}

TEST(PackedWeights, Bf16ProductsEqualThePlainOnesBitForBit) {
  check_packed_bits<bf16, float>(77, 520, 136);
  check_packed_bits<bf16, float>(300, 384, 256);
  check_packed_bits<bf16, bf16>(129, 200, 72);
}

TEST(PackedWeights, F32ProductsEqualThePlainOnesBitForBit) {
  check_packed_bits<float, float>(77, 520, 136);
  check_packed_bits<float, float>(300, 384, 256);
}

// Skinny weights (a dimension <= 16: the GDN gates' projections, a small router) run on hybridscan's own loops and
// get no packed copy.
TEST(PackedWeights, SkinnyWeightsAreNotPacked) {
  EXPECT_EQ(packed_weight_bytes(DType::BF16, 16, 256, WeightUse::Forward), 0u);
  EXPECT_EQ(packed_weight_bytes(DType::F32, 256, 8, WeightUse::BackwardData), 0u);
  EXPECT_THROW(packed_weight_bytes(DType::I32, 256, 256, WeightUse::Forward), std::invalid_argument);
}

// Once a PackedWeight is gone its copy is no longer read (its memory may be reused); products in layouts the copy
// does not serve (another use, a leading dimension, row counts taken at execution) read the plain weight.
TEST(PackedWeights, OnlyTheRegisteredUseReadsTheCopyAndOnlyWhileItLives) {
  const int64_t M = 64, out = 96, in = 128;
  if (packed_weight_bytes(DType::BF16, out, in, WeightUse::Forward) == 0) GTEST_SKIP() << "no packed layout here";
  std::vector<bf16> x(M * in, bf16(1.0f)), W(out * in, bf16(0.5f)), dy(M * out, bf16(1.0f));
  std::vector<float> y(M * out), dx(M * in);
  MemoryAccountant mem;
  {
    PackedWeight pw(W.data(), DType::BF16, out, in, WeightUse::Forward, mem, MemCategory::WeightCasts, "test");
    pw.pack();
    int64_t n = matmul_packed_products();
    matmul(x.data(), W.data(), y.data(), M, out, in, false, true);
    EXPECT_EQ(matmul_packed_products(), n + 1);
    matmul(dy.data(), W.data(), dx.data(), M, in, out, false, false);  // the other use
    MatmulLayout any_rows;
    any_rows.varying_rows = true;
    matmul(x.data(), W.data(), y.data(), M, out, in, false, true, false, any_rows);
    EXPECT_EQ(matmul_packed_products(), n + 1);
    EXPECT_FLOAT_EQ(y[0], 0.5f * in);
    EXPECT_FLOAT_EQ(dx[0], 0.5f * out);
  }
  EXPECT_EQ(mem.live(MemCategory::WeightCasts), 0u);
  const int64_t n = matmul_packed_products();
  matmul(x.data(), W.data(), y.data(), M, out, in, false, true);
  EXPECT_EQ(matmul_packed_products(), n);
}

// Planning allocates the same bytes (from the same memory descriptor) and packs nothing.
TEST(PackedWeights, PlanningAllocatesTheSameBytes) {
  MemoryAccountant plan(true);
  PackedWeight pw(nullptr, DType::BF16, 384, 256, WeightUse::Forward, plan, MemCategory::WeightCasts, "test");
  EXPECT_EQ(plan.live(MemCategory::WeightCasts), packed_weight_bytes(DType::BF16, 384, 256, WeightUse::Forward));
  const int64_t n = matmul_packed_products();
  pw.pack();
  EXPECT_EQ(matmul_packed_products(), n);
}

}  // namespace hs::kernels
