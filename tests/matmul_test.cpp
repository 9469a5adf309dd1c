#include <gtest/gtest.h>

#include <random>
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
