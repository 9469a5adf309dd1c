#include "kernels/lm_head.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::randn;
using test::rel_rms;
using test::widen;

// Targets with ignored entries (-100 as in transformers, and -1) scattered through.
std::vector<int32_t> make_targets(int64_t N, int64_t V, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(N);
  for (int64_t i = 0; i < N; ++i) t[i] = static_cast<int32_t>(rng() % V);
  t[1] = -100;
  t[N - 2] = -1;
  return t;
}

template <typename T>
void check_chunks(double loss_tol, double grad_tol) {
  const int64_t N = 10, H = 24, V = 300;
  // Row scales up to 8 spread the logits over roughly +-100, so the softmax underflows for many
  // entries and the max-subtraction and exp's cut-offs are exercised.
  auto xf = randn(N * H, 1);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < H; ++h) xf[t * H + h] *= (t % 3 == 0) ? 8.0f : 1.0f;
  const auto x = cast<T>(xf), W = cast<T>(randn(V * H, 2, 0.5f));
  const auto targets = make_targets(N, V, 3);
  const float grad_scale = 0.37f;

  const auto xd = widen(x), Wd = widen(W);
  std::vector<double> dxr(N * H), dWr(V * H);
  const XentResult ref = reference::lm_head_xent<double>(xd.data(), Wd.data(), targets.data(), N, H, V, grad_scale,
                                                         dxr.data(), dWr.data());
  ASSERT_EQ(ref.count, N - 2);
  // chunk 0 is the default (>= N here), 3 and 4 do not divide N, N + 5 exceeds it.
  for (int64_t chunk : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{4}, N, N + 5}) {
    MemoryAccountant mem;
    std::vector<float> dx(N * H), dW(V * H);
    const XentResult r =
        lm_head_xent<T>(x.data(), W.data(), targets.data(), N, H, V, grad_scale, dx.data(), dW.data(), mem, chunk);
    EXPECT_EQ(r.count, ref.count) << chunk;
    EXPECT_NEAR(r.loss_sum, ref.loss_sum, loss_tol * std::abs(ref.loss_sum)) << chunk;
    EXPECT_LT(rel_rms(dx, dxr), grad_tol) << "dx, chunk " << chunk;
    EXPECT_LT(rel_rms(dW, dWr), grad_tol) << "dW, chunk " << chunk;
    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(dx[1 * H + h], 0.0f) << "ignored token got a gradient";

    MemoryAccountant mem2;
    const XentResult fwd =
        lm_head_xent<T>(x.data(), W.data(), targets.data(), N, H, V, 0.0f, nullptr, nullptr, mem2, chunk);
    EXPECT_EQ(fwd.count, r.count);
    EXPECT_DOUBLE_EQ(fwd.loss_sum, r.loss_sum) << "forward-only must compute the same loss";
  }
}

// fp32: logits from oneDNN fp32 (accumulation order only, ~1e-7 relative), log-sum-exp in fp32 with
// a ~1-ulp exp: 1e-5 relative on the loss sum and on the gradients (relative RMS) is a wide margin.
TEST(LmHead, MatchesNaiveCrossEntropyF32) { check_chunks<float>(1e-5, 1e-5); }

// bf16: the inputs are the same bf16 values in both, the logits accumulate in fp32, so the loss keeps
// fp32 accuracy (1e-5); the logits' gradient is rounded to bf16 (2^-9) before its two products:
// ~3e-3 relative RMS, tolerance 2e-2.
TEST(LmHead, MatchesNaiveCrossEntropyBf16) { check_chunks<bf16>(1e-5, 2e-2); }

// Central differences in double on the naive reference (eps 1e-6, truncation ~1e-12, cancellation
// ~1e-10): tolerance 1e-6 relative.
TEST(LmHead, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t N = 4, H = 5, V = 7;
  auto x = widen(randn(N * H, 4)), W = widen(randn(V * H, 5));
  const std::vector<int32_t> targets = {3, -100, 0, 6};
  const double gs = 0.7;
  std::vector<double> dx(N * H), dW(V * H);
  reference::lm_head_xent<double>(x.data(), W.data(), targets.data(), N, H, V, gs, dx.data(), dW.data());
  auto loss = [&] {
    return gs *
           reference::lm_head_xent<double>(x.data(), W.data(), targets.data(), N, H, V, gs, nullptr, nullptr).loss_sum;
  };
  test::expect_grad_matches_fd(x, dx, loss, "x", 1e-6, 1e-6);
  test::expect_grad_matches_fd(W, dW, loss, "W", 1e-6, 1e-6);
}

// The workspace is the chunk's logits (plus their bf16 gradient and one float per row), whatever
// the number of tokens, and the planner predicts it exactly.
template <typename T>
void check_workspace() {
  const int64_t H = 16, V = 1000, chunk = 3;
  for (int64_t N : {int64_t{7}, int64_t{40}}) {
    const auto x = cast<T>(randn(N * H, 6)), W = cast<T>(randn(V * H, 7, 0.3f));
    const auto targets = make_targets(N, V, 8);
    std::vector<float> dx(N * H), dW(V * H);
    MemoryAccountant real, plan(true);
    lm_head_xent<T>(x.data(), W.data(), targets.data(), N, H, V, 1.0f, dx.data(), dW.data(), real, chunk);
    lm_head_xent<T>(x.data(), W.data(), targets.data(), N, H, V, 1.0f, dx.data(), dW.data(), plan, chunk);
    const size_t expected = size_t(chunk * V) * (4 + (std::is_same_v<T, float> ? 0 : sizeof(T))) + size_t(chunk) * 4;
    EXPECT_EQ(real.peak(MemCategory::Workspace), expected) << N;
    EXPECT_EQ(plan.peak_total(), real.peak_total()) << N;
    EXPECT_EQ(plan.allocations(), real.allocations()) << N;
    EXPECT_EQ(real.live_total(), 0u);
  }
}
TEST(LmHead, WorkspaceBoundedByChunk) {
  check_workspace<float>();
  check_workspace<bf16>();
}

TEST(LmHead, DefaultChunkKeepsLogitsNear64MiB) {
  EXPECT_EQ(default_xent_chunk(248320), 67);
  EXPECT_EQ(default_xent_chunk(151936), 110);
  EXPECT_EQ(default_xent_chunk(int64_t{1} << 30), 1);  // at least one token
  for (int64_t V : {1000, 151936, 248320}) EXPECT_LE(default_xent_chunk(V) * V * 4, int64_t{64} << 20);
}

TEST(LmHead, AllTargetsIgnoredGivesNothing) {
  const int64_t N = 3, H = 4, V = 5;
  const auto x = randn(N * H, 9), W = randn(V * H, 10);
  const std::vector<int32_t> targets(N, -100);
  std::vector<float> dx(N * H, 1.0f), dW(V * H, 1.0f);
  MemoryAccountant mem;
  const XentResult r =
      lm_head_xent<float>(x.data(), W.data(), targets.data(), N, H, V, 1.0f, dx.data(), dW.data(), mem);
  EXPECT_EQ(r.count, 0);
  EXPECT_EQ(r.loss_sum, 0.0);
  for (float v : dx) EXPECT_EQ(v, 1.0f);
  for (float v : dW) EXPECT_EQ(v, 1.0f);
}

TEST(LmHead, TargetOutsideVocabularyThrows) {
  const int64_t N = 2, H = 4, V = 5;
  const auto x = randn(N * H, 11), W = randn(V * H, 12);
  const std::vector<int32_t> targets = {1, 5};
  MemoryAccountant mem;
  EXPECT_THROW(lm_head_xent<float>(x.data(), W.data(), targets.data(), N, H, V, 1.0f, nullptr, nullptr, mem),
               std::out_of_range);
}

}  // namespace
}  // namespace hs::kernels
