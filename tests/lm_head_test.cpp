#include "kernels/lm_head.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
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

// The LM head in vocabulary pieces from a whole W / dW in memory, recording the order of the kernel's calls.
template <typename T>
struct WholePieces final : XentPieces<T> {
  const T* W;
  float* dW;
  int64_t rows, H;
  std::vector<std::pair<char, int64_t>> calls;
  WholePieces(const T* w, float* dw, int64_t r, int64_t h) : W(w), dW(dw), rows(r), H(h) {}
  const T* weights(int64_t k) override {
    calls.emplace_back('w', k);
    return W + k * rows * H;
  }
  float* grad(int64_t k) override {
    calls.emplace_back('g', k);
    return dW ? dW + k * rows * H : nullptr;
  }
  void grad_done(int64_t k) override { calls.emplace_back('d', k); }
};

// Targets on the bounds of 7-row pieces (first and last row of a piece, the uneven last piece of V = 300), and
// ignored ones.
std::vector<int32_t> boundary_targets(int64_t N, int64_t V) {
  std::vector<int32_t> t = make_targets(N, V, 13);
  const int32_t at[] = {0, 6, 7, 13, 14, 293, 294, 299};
  for (int64_t i = 0; i < N && i < 8; ++i)
    if (t[i] >= 0) t[i] = at[i];
  return t;
}

struct PieceCase {
  int64_t N = 16, H = 24, V = 300;
};

// Against the naive double reference, with the tolerances of the whole kernel (the same bounds hold: the pieces
// change only how the fp32 sums are grouped), pieces of 1 row, of 7 (the last one 6 rows, targets on the bounds),
// 64, V and more than V, token chunks that do and do not divide N; the kernel asks for the pieces in order forward
// and in reverse backward, each piece's gradient between grad(k) and grad_done(k).
template <typename T>
void check_pieces(double loss_tol, double grad_tol) {
  const PieceCase pc;
  const int64_t N = pc.N, H = pc.H, V = pc.V;
  auto xf = randn(N * H, 1);
  // Large logits (row scale 8) on tokens whose targets are not on piece bounds (a target that takes almost all the
  // probability leaves 1 - p to cancellation, in the whole kernel as much).
  for (int64_t t = 8; t < N; ++t)
    for (int64_t h = 0; h < H; ++h) xf[t * H + h] *= (t % 3 == 0) ? 8.0f : 1.0f;
  const auto x = cast<T>(xf), W = cast<T>(randn(V * H, 2, 0.5f));
  const auto targets = boundary_targets(N, V);
  const float grad_scale = 0.37f;
  const auto xd = widen(x), Wd = widen(W);
  std::vector<double> dxr(N * H), dWr(V * H);
  const XentResult ref = reference::lm_head_xent<double>(xd.data(), Wd.data(), targets.data(), N, H, V, grad_scale,
                                                         dxr.data(), dWr.data());
  for (int64_t rows : {int64_t{1}, int64_t{7}, int64_t{64}, V, V + 5})
    for (int64_t chunk : {int64_t{0}, int64_t{3}}) {
      const std::string what = "rows " + std::to_string(rows) + " chunk " + std::to_string(chunk);
      MemoryAccountant mem;
      std::vector<float> dx(N * H), dW(V * H);
      WholePieces<T> src(W.data(), dW.data(), rows, H);
      const XentResult r = lm_head_xent_pieced<T>(x.data(), targets.data(), N, H, V, rows, src, grad_scale, dx.data(),
                                                  mem, chunk);
      EXPECT_EQ(r.count, ref.count) << what;
      EXPECT_NEAR(r.loss_sum, ref.loss_sum, loss_tol * std::abs(ref.loss_sum)) << what;
      EXPECT_LT(rel_rms(dx, dxr), grad_tol) << "dx, " << what;
      EXPECT_LT(rel_rms(dW, dWr), grad_tol) << "dW, " << what;
      for (int64_t h = 0; h < H; ++h) EXPECT_EQ(dx[1 * H + h], 0.0f) << "ignored token got a gradient";
      const int64_t P = (V + std::min(rows, V) - 1) / std::min(rows, V);
      std::vector<std::pair<char, int64_t>> want;
      for (int64_t k = 0; k < P; ++k) want.emplace_back('w', k);
      for (int64_t k = P; k-- > 0;)
        for (char e : {'w', 'g', 'd'}) want.emplace_back(e, k);
      EXPECT_EQ(src.calls, want) << what;
      MemoryAccountant mem2;
      WholePieces<T> fsrc(W.data(), nullptr, rows, H);
      const XentResult fwd =
          lm_head_xent_pieced<T>(x.data(), targets.data(), N, H, V, rows, fsrc, 0.f, nullptr, mem2, chunk);
      EXPECT_EQ(fwd.loss_sum, r.loss_sum) << "forward only: " << what;
      EXPECT_EQ(fsrc.calls.size(), static_cast<size_t>(P)) << what;
    }
}
TEST(LmHeadPieces, MatchNaiveCrossEntropyF32) { check_pieces<float>(1e-5, 1e-5); }
TEST(LmHeadPieces, MatchNaiveCrossEntropyBf16) { check_pieces<bf16>(1e-5, 2e-2); }

// One piece (rows >= V) is lm_head_xent's arithmetic: loss, dx and dW to the bit, fp32 and bf16.
template <typename T>
void check_one_piece() {
  const PieceCase pc;
  const int64_t N = pc.N, H = pc.H, V = pc.V;
  const auto x = cast<T>(randn(N * H, 3)), W = cast<T>(randn(V * H, 4, 0.5f));
  const auto targets = make_targets(N, V, 5);
  std::vector<float> dx0(N * H), dW0(V * H);
  MemoryAccountant mem;
  const XentResult whole =
      lm_head_xent<T>(x.data(), W.data(), targets.data(), N, H, V, 0.5f, dx0.data(), dW0.data(), mem);
  for (int64_t rows : {V, V + 5}) {
    std::vector<float> dx(N * H), dW(V * H);
    WholePieces<T> src(W.data(), dW.data(), rows, H);
    const XentResult r = lm_head_xent_pieced<T>(x.data(), targets.data(), N, H, V, rows, src, 0.5f, dx.data(), mem);
    EXPECT_EQ(r.loss_sum, whole.loss_sum) << sizeof(T);
    EXPECT_EQ(dx, dx0) << sizeof(T);
    EXPECT_EQ(dW, dW0) << sizeof(T);
  }
}
TEST(LmHeadPieces, OnePieceIsTheWholeKernelToTheBit) {
  check_one_piece<float>();
  check_one_piece<bf16>();
}

// Pieces against the whole fp32 kernel, and why the tolerance cannot hide a lost piece. Per counted token t, with
// u = 2^-24 and exp_vec within 0.9 ulp (1.8 u relative):
//   - the whole kernel's sum S of V exponentials has relative error <= (V - 1) u + 1.8 u (recursive summation; the
//     SIMD lanes' partial sums only shorten the chains);
//   - the pieces' S: each piece's sum of r_k terms <= (r_k - 1) u + 1.8 u, each of the P joins multiplies by an
//     exponential (1.8 u, its argument's rounding adds at most u d e^-d <= 0.37 u of the term) and rounds a product
//     and a sum (2 u): <= (V - P) u + 1.8 u + P (4.2 u);
//   - log turns a relative error of S into an absolute one of the loss; the logits themselves may differ between the
//     two matmul shapes by at most H u A_t each (A_t = max_v sum_h |x_th W_vh|), which moves the loss by at most
//     2 H u A_t per path; the loss of a row is rounded to fp32 in both (u |loss_t| each).
// So |loss_pieces - loss_whole| <= sum_t [(2 V + 4.2 P + 4) u + 4 H u A_t + 2 u |loss_t|]. A piece skipped, or a
// target's logit taken from the wrong piece, moves the loss (computed in double from the same logits) by far more.
TEST(LmHeadPieces, WithinTheRoundingBoundOfTheWholeKernelAndALostPieceIsNot) {
  const PieceCase pc;
  const int64_t N = pc.N, H = pc.H, V = pc.V;
  const auto x = randn(N * H, 6), W = randn(V * H, 7, 0.5f);
  const auto targets = boundary_targets(N, V);
  MemoryAccountant mem;
  const XentResult whole = lm_head_xent<float>(x.data(), W.data(), targets.data(), N, H, V, 0.f, nullptr, nullptr, mem);
  const double u = std::ldexp(1.0, -24);
  // Per token in double: the logits, A_t, and the loss with every row, without rows [a, b), with the target's logit
  // read one row off.
  auto lse = [&](int64_t t, int64_t a, int64_t b) {
    double mx = -1e300, s = 0;
    std::vector<double> l(V);
    for (int64_t v = 0; v < V; ++v) {
      double d = 0;
      for (int64_t h = 0; h < H; ++h) d += double(x[t * H + h]) * double(W[v * H + h]);
      l[v] = d;
      if (v < a || v >= b) mx = std::max(mx, d);
    }
    for (int64_t v = 0; v < V; ++v)
      if (v < a || v >= b) s += std::exp(l[v] - mx);
    return std::pair<double, std::vector<double>>{mx + std::log(s), l};
  };
  for (int64_t rows : {int64_t{1}, int64_t{7}}) {
    const int64_t P = (V + rows - 1) / rows;
    double bound = 0, ref = 0;
    std::vector<double> skipped(static_cast<size_t>(P), 0.0);
    double wrong_target = 0;
    for (int64_t t = 0; t < N; ++t) {
      if (targets[t] < 0) continue;
      const auto [full, l] = lse(t, 0, 0);
      double A = 0;
      for (int64_t v = 0; v < V; ++v) {
        double a = 0;
        for (int64_t h = 0; h < H; ++h) a += std::abs(double(x[t * H + h]) * double(W[v * H + h]));
        A = std::max(A, a);
      }
      const double loss_t = full - l[targets[t]];
      ref += loss_t;
      bound += (2.0 * V + 4.2 * P + 4) * u + 4.0 * H * u * A + 2 * u * std::abs(loss_t);
      for (int64_t k = 0; k < P; ++k) {
        const int64_t a = k * rows, b = std::min(V, a + rows);
        // Without piece k; a target in it is lost too (its logit taken as 0).
        const bool in = targets[t] >= a && targets[t] < b;
        skipped[static_cast<size_t>(k)] += std::abs(lse(t, a, b).first - (in ? 0.0 : l[targets[t]]) - loss_t);
      }
      const int32_t off = targets[t] % rows == 0 && targets[t] > 0 ? targets[t] - 1 : targets[t] + (targets[t] + 1 < V);
      wrong_target += std::abs(l[off] - l[targets[t]]);
    }
    std::vector<float> dx(N * H);
    WholePieces<float> src(W.data(), nullptr, rows, H);
    const XentResult r = lm_head_xent_pieced<float>(x.data(), targets.data(), N, H, V, rows, src, 0.f, nullptr, mem);
    EXPECT_LE(std::abs(r.loss_sum - whole.loss_sum), bound) << "rows " << rows;
    EXPECT_LE(std::abs(r.loss_sum - ref), bound) << "rows " << rows << " against double";
    // Pieces of 7 rows: skipping any one moves the loss beyond the bound. Single rows: a row of negligible
    // probability can hide within the worst-case bound, a row that is some token's target cannot.
    double least = 1e300;
    for (int64_t k = 0; k < P; ++k) {
      bool target_row = false;
      for (int64_t t = 0; t < N; ++t) target_row |= targets[t] >= k * rows && targets[t] < (k + 1) * rows;
      if (rows > 1 || target_row) least = std::min(least, skipped[static_cast<size_t>(k)]);
    }
    EXPECT_GT(least, 10 * bound) << "rows " << rows << ": a skipped piece would hide within the bound";
    EXPECT_GT(wrong_target, 10 * bound) << "rows " << rows;
    std::printf("rows %lld: |pieces - whole| %.3g, bound %.3g; least effect of a skipped piece %.3g, of a target "
                "read one row off %.3g\n",
                static_cast<long long>(rows), std::abs(r.loss_sum - whole.loss_sum), bound, least, wrong_target);
  }
}

// The workspace: a chunk of the piece's logits (and their bf16 gradient) and 3 floats a token, whatever V; the
// plan makes the same calls and allocations.
template <typename T>
void check_piece_workspace() {
  const int64_t H = 16, V = 1000, chunk = 3, rows = 64;
  for (int64_t N : {int64_t{7}, int64_t{40}}) {
    const auto x = cast<T>(randn(N * H, 6)), W = cast<T>(randn(V * H, 7, 0.3f));
    const auto targets = make_targets(N, V, 8);
    std::vector<float> dx(N * H), dW(V * H);
    MemoryAccountant real, plan(true);
    WholePieces<T> a(W.data(), dW.data(), rows, H), b(W.data(), dW.data(), rows, H);
    lm_head_xent_pieced<T>(x.data(), targets.data(), N, H, V, rows, a, 1.0f, dx.data(), real, chunk);
    lm_head_xent_pieced<T>(nullptr, nullptr, N, H, V, rows, b, 1.0f, dx.data(), plan, chunk);
    const size_t expected =
        size_t(chunk * rows) * (4 + (std::is_same_v<T, float> ? 0 : sizeof(T))) + 3 * size_t(N) * 4;
    EXPECT_EQ(real.peak(MemCategory::Workspace), expected) << N;
    EXPECT_EQ(plan.peak_total(), real.peak_total()) << N;
    EXPECT_EQ(plan.allocations(), real.allocations()) << N;
    EXPECT_EQ(a.calls, b.calls);
    EXPECT_EQ(real.live_total(), 0u);
  }
}
TEST(LmHeadPieces, WorkspaceBoundedByChunkAndPiece) {
  check_piece_workspace<float>();
  check_piece_workspace<bf16>();
}

TEST(LmHeadPieces, BadInputThrows) {
  const int64_t N = 2, H = 4, V = 5;
  const auto x = randn(N * H, 11), W = randn(V * H, 12);
  MemoryAccountant mem;
  WholePieces<float> src(W.data(), nullptr, 2, H);
  const std::vector<int32_t> bad = {1, 5};
  EXPECT_THROW(lm_head_xent_pieced<float>(x.data(), bad.data(), N, H, V, 2, src, 1.f, nullptr, mem), std::out_of_range);
  const std::vector<int32_t> ok = {1, 4};
  EXPECT_THROW(lm_head_xent_pieced<float>(x.data(), ok.data(), N, H, V, 0, src, 1.f, nullptr, mem),
               std::invalid_argument);
}

}  // namespace
}  // namespace hs::kernels
