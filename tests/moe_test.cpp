#include "kernels/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/matmul.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::randn;
using test::rel_rms;
using test::widen;

// Values representable in T, kept as float (what both the kernel and the reference will see).
template <typename T>
std::vector<float> round_to(std::vector<float> v) {
  for (float& x : v) x = to_f32(from_f32<T>(x));
  return v;
}

// The smallest gap, over tokens, between the k-th and (k+1)-th largest router logit.
double routing_margin(const MoeShape& s, const float* x, const float* router, int64_t t) {
  if (s.top_k == s.experts) return INFINITY;
  std::vector<double> l(static_cast<size_t>(s.experts), 0.0);
  for (int64_t e = 0; e < s.experts; ++e)
    for (int64_t h = 0; h < s.hidden; ++h)
      l[static_cast<size_t>(e)] += double(x[t * s.hidden + h]) * router[e * s.hidden + h];
  std::sort(l.begin(), l.end(), std::greater<>());
  return l[static_cast<size_t>(s.top_k - 1)] - l[static_cast<size_t>(s.top_k)];
}

// Top-k is piecewise constant in the logits: a comparison against another implementation (or a
// finite difference) is only meaningful if every token's selected set is unambiguous. Each token's
// input is redrawn until its k-th and (k+1)-th logits differ by kMargin, which is orders of magnitude
// above both the fp32-vs-double logit error (~1e-6) and the FD perturbation's effect (~1e-6).
constexpr double kMargin = 0.1;

// All values rounded to T and kept as float: weights, input, upstream gradients.
struct Problem {
  MoeShape s;
  std::vector<float> x, router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate, dy, aux;
};

template <typename T>
Problem make_problem(const MoeShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, I = s.expert_inter, Is = s.shared_inter;
  const float sh = 1.0f / std::sqrt(float(H));
  Problem p;
  p.s = s;
  p.router = round_to<T>(randn(E * H, rng, 2.0f * sh));  // logits ~ N(0, 4): clearly unequal probabilities
  p.x.resize(N * H);
  for (int64_t t = 0; t < N; ++t) {
    for (int tries = 0;; ++tries) {
      if (tries > 1000) throw std::runtime_error("no well-separated routing found");
      const auto row = round_to<T>(randn(H, rng));
      std::copy(row.begin(), row.end(), p.x.begin() + t * H);
      if (routing_margin(s, p.x.data(), p.router.data(), t) >= kMargin) break;
    }
  }
  p.gate_up = round_to<T>(randn(E * 2 * I * H, rng, sh));
  p.down = round_to<T>(randn(E * H * I, rng, 1.0f / std::sqrt(float(I))));
  p.shared_gate = round_to<T>(randn(Is * H, rng, sh));
  p.shared_up = round_to<T>(randn(Is * H, rng, sh));
  p.shared_down = round_to<T>(randn(H * Is, rng, 1.0f / std::sqrt(float(Is))));
  p.shared_expert_gate = randn(H, rng, sh);  // fp32 in both
  p.dy = randn(N * H, rng);
  p.aux = randn(E, rng, 0.1f);
  return p;
}

struct Grads {
  std::vector<float> dx, router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate;
  explicit Grads(const MoeShape& s)
      : dx(s.tokens * s.hidden),
        router(s.experts * s.hidden),
        gate_up(s.experts * 2 * s.expert_inter * s.hidden),
        down(s.experts * s.hidden * s.expert_inter),
        shared_gate(s.shared_inter * s.hidden),
        shared_up(s.shared_inter * s.hidden),
        shared_down(s.hidden * s.shared_inter),
        shared_expert_gate(s.hidden) {}
  MoeGrads view() {
    return {router.data(),      gate_up.data(),           down.data(), shared_gate.data(), shared_up.data(),
            shared_down.data(), shared_expert_gate.data()};
  }
};

template <typename T>
struct FastRun {
  std::vector<T> x, router, gate_up, down, shared_gate, shared_up, shared_down;
  explicit FastRun(const Problem& p)
      : x(cast<T>(p.x)),
        router(cast<T>(p.router)),
        gate_up(cast<T>(p.gate_up)),
        down(cast<T>(p.down)),
        shared_gate(cast<T>(p.shared_gate)),
        shared_up(cast<T>(p.shared_up)),
        shared_down(cast<T>(p.shared_down)) {}
  MoeWeights<T> weights(const Problem& p) const {
    return {router.data(),
            gate_up.data(),
            down.data(),
            shared_gate.data(),
            shared_up.data(),
            shared_down.data(),
            p.shared_expert_gate.data()};
  }
};

struct ReferenceRun {
  std::vector<double> x, router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate, dy, aux;
  std::vector<double> y, dx, g_router, g_gate_up, g_down, g_shared_gate, g_shared_up, g_shared_down, g_seg;
  RouterStats stats;
  explicit ReferenceRun(const Problem& p)
      : x(widen(p.x)),
        router(widen(p.router)),
        gate_up(widen(p.gate_up)),
        down(widen(p.down)),
        shared_gate(widen(p.shared_gate)),
        shared_up(widen(p.shared_up)),
        shared_down(widen(p.shared_down)),
        shared_expert_gate(widen(p.shared_expert_gate)),
        dy(widen(p.dy)),
        aux(widen(p.aux)),
        y(p.x.size()),
        dx(p.x.size()),
        g_router(p.router.size()),
        g_gate_up(p.gate_up.size()),
        g_down(p.down.size()),
        g_shared_gate(p.shared_gate.size()),
        g_shared_up(p.shared_up.size()),
        g_shared_down(p.shared_down.size()),
        g_seg(p.shared_expert_gate.size()) {}
  reference::MoeParams<double> params() const {
    return {router.data(),      gate_up.data(),           down.data(), shared_gate.data(), shared_up.data(),
            shared_down.data(), shared_expert_gate.data()};
  }
  reference::MoeParamGrads<double> grads() {
    return {g_router.data(),    g_gate_up.data(),     g_down.data(), g_shared_gate.data(),
            g_shared_up.data(), g_shared_down.data(), g_seg.data()};
  }
  void run(const MoeShape& s, bool with_aux) {
    stats = reference::moe_forward<double>(s, x.data(), params(), y.data());
    reference::moe_backward<double>(s, x.data(), params(), dy.data(), with_aux ? aux.data() : nullptr, dx.data(),
                                    grads());
  }
};

template <typename T>
void check_against_reference(const MoeShape& s, uint32_t seed, double tol) {
  SCOPED_TRACE("tokens " + std::to_string(s.tokens) + " experts " + std::to_string(s.experts) + " top_k " +
               std::to_string(s.top_k) + " norm " + std::to_string(s.norm_topk_prob));
  const Problem p = make_problem<T>(s, seed);
  ReferenceRun ref(p);
  ref.run(s, true);

  FastRun<T> fast(p);
  MemoryAccountant mem;
  MoeSaved saved;
  std::vector<T> y(p.x.size());
  const RouterStats stats = moe_forward<T>(s, fast.x.data(), fast.weights(p), y.data(), &saved, mem);
  std::vector<float> yf(y.size());
  for (size_t i = 0; i < y.size(); ++i) yf[i] = to_f32(y[i]);
  EXPECT_LT(rel_rms(yf, ref.y), tol) << "y";
  EXPECT_EQ(stats.rows, s.tokens);
  EXPECT_EQ(stats.expert_counts, ref.stats.expert_counts);  // same selections, exactly
  for (int64_t e = 0; e < s.experts; ++e)                   // fp32 softmax of fp32 logits vs double: ~1e-6 relative
    EXPECT_NEAR(stats.prob_sums[e], ref.stats.prob_sums[e], 1e-5 * s.tokens) << e;

  Grads g(s);
  moe_backward<T>(s, fast.x.data(), fast.weights(p), saved, p.dy.data(), p.aux.data(), g.dx.data(), g.view(), mem);
  EXPECT_LT(rel_rms(g.dx, ref.dx), tol) << "dx";
  EXPECT_LT(rel_rms(g.router, ref.g_router), tol) << "router";
  EXPECT_LT(rel_rms(g.gate_up, ref.g_gate_up), tol) << "gate_up";
  EXPECT_LT(rel_rms(g.down, ref.g_down), tol) << "down";
  EXPECT_LT(rel_rms(g.shared_gate, ref.g_shared_gate), tol) << "shared_gate";
  EXPECT_LT(rel_rms(g.shared_up, ref.g_shared_up), tol) << "shared_up";
  EXPECT_LT(rel_rms(g.shared_down, ref.g_shared_down), tol) << "shared_down";
  EXPECT_LT(rel_rms(g.shared_expert_gate, ref.g_seg), tol) << "shared_expert_gate";
}

const std::vector<MoeShape>& shapes() {
  static const std::vector<MoeShape> v = {
      {37, 32, 6, 2, 24, 20, true},
      {19, 24, 5, 3, 16, 12, false},  // no renormalisation (Qwen3-Next with norm_topk_prob = false)
      {7, 16, 12, 2, 8, 8, true},     // more experts than slots: several empty groups
      {9, 16, 3, 3, 8, 8, true},      // k = E: every expert on every token
  };
  return v;
}

// fp32: oneDNN fp32 products vs double, accumulation order only (~1e-7 relative per value, measured
// ~3e-7 relative RMS); 1e-5 keeps a wide margin while a wrong index, weight or layout is O(1).
TEST(Moe, MatchesDenseReferenceF32) {
  uint32_t seed = 100;
  for (const MoeShape& s : shapes()) check_against_reference<float>(s, seed++, 1e-5);
}

// bf16: pre-activations, silu * up, y, the gathered dy, the pre-activation gradients and the router
// logits' gradient are each rounded to bf16 (2^-9 ~ 2e-3), a few roundings per value: measured
// ~3-6e-3 relative RMS; 2e-2 leaves margin and is still far from an O(1) error.
TEST(Moe, MatchesDenseReferenceBf16) {
  uint32_t seed = 200;
  for (const MoeShape& s : shapes()) check_against_reference<bf16>(s, seed++, 2e-2);
}

// Groups above 1024 rows go through a bulk piece (1024 * 2^j rows) plus the rest at a runtime row count: with
// k = E, 1100 rows each (1024 + 76), in fp32 and bf16; ~733 rows per expert take the runtime path alone.
TEST(Moe, LargeGroupsSplitIntoRowPieces) {
  check_against_reference<float>({1100, 16, 3, 2, 16, 8, true}, 300, 1e-5);
  check_against_reference<float>({1100, 16, 2, 2, 16, 8, true}, 301, 1e-5);
  check_against_reference<bf16>({1100, 16, 3, 2, 16, 8, true}, 302, 2e-2);
  check_against_reference<bf16>({1100, 16, 2, 2, 16, 8, true}, 303, 2e-2);
}

// oneDNN creates a primitive per shape (~0.6 ms each, cached for the process): per-expert row counts
// must not create primitives. Six different routings of 300 tokens over 4 experts (groups of ~150 rows) use, per
// row-wise expert product (4 of them), one primitive taking the rows at execution (and at most the fixed 1024-row
// piece, which these groups never reach); per weight-gradient product (2) one primitive taking the
// rows at execution; plus the shared expert's fixed shapes (2 forward, 2 backward products; its weight
// gradients share the experts' runtime primitives here, inter being equal; the router's products, with 4
// outputs, run on hybridscan's skinny loops): at most 4 x 2 + 2 + 4 = 14 new primitives, where one per row
// count would add ~6 routings x 4 experts x 6 products ~ 140.
TEST(Moe, RowCountsComeFromAFixedSet) {
  const MoeShape s{300, 16, 4, 2, 8, 8, true};
  const int64_t before = matmul_primitives_created();
  for (uint32_t seed = 0; seed < 6; ++seed) {
    const Problem p = make_problem<float>(s, 400 + seed);
    FastRun<float> fast(p);
    MemoryAccountant mem;
    MoeSaved saved;
    std::vector<float> y(p.x.size());
    moe_forward<float>(s, fast.x.data(), fast.weights(p), y.data(), &saved, mem);
    Grads g(s);
    moe_backward<float>(s, fast.x.data(), fast.weights(p), saved, p.dy.data(), nullptr, g.dx.data(), g.view(), mem);
  }
  EXPECT_LE(matmul_primitives_created() - before, 4 * 2 + 2 + 4);
}

// The reference's backward against central differences in double, for every input and parameter,
// of L = <dy, y> + <aux_dprob, prob_sums> (the aux path included). eps = 1e-6 moves a logit by ~1e-6,
// far below the 0.1 selection margin, so the top-k set is constant across each difference.
// Truncation ~eps^2 ~ 1e-12 and cancellation ~1e-16 / eps ~ 1e-10 against a 1e-6 relative tolerance.
void check_reference_fd(const MoeShape& s, uint32_t seed) {
  Problem p = make_problem<float>(s, seed);
  ReferenceRun ref(p);
  ref.run(s, true);
  auto loss = [&] {
    std::vector<double> y(ref.x.size());
    const RouterStats st = reference::moe_forward<double>(s, ref.x.data(), ref.params(), y.data());
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += ref.dy[i] * y[i];
    for (size_t e = 0; e < st.prob_sums.size(); ++e) l += ref.aux[e] * st.prob_sums[e];
    return l;
  };
  test::expect_grad_matches_fd(ref.x, ref.dx, loss, "x", 1e-6, 1e-6);
  test::expect_grad_matches_fd(ref.router, ref.g_router, loss, "router", 1e-6, 1e-6);
  test::expect_grad_matches_fd(ref.gate_up, ref.g_gate_up, loss, "gate_up", 1e-6, 1e-6);
  test::expect_grad_matches_fd(ref.down, ref.g_down, loss, "down", 1e-6, 1e-6);
  test::expect_grad_matches_fd(ref.shared_gate, ref.g_shared_gate, loss, "shared_gate", 1e-6, 1e-6);
  test::expect_grad_matches_fd(ref.shared_up, ref.g_shared_up, loss, "shared_up", 1e-6, 1e-6);
  test::expect_grad_matches_fd(ref.shared_down, ref.g_shared_down, loss, "shared_down", 1e-6, 1e-6);
  test::expect_grad_matches_fd(ref.shared_expert_gate, ref.g_seg, loss, "shared_expert_gate", 1e-6, 1e-6);
}
TEST(Moe, ReferenceBackwardMatchesFiniteDifferences) {
  check_reference_fd({5, 6, 4, 2, 3, 4, true}, 500);
  check_reference_fd({5, 6, 4, 2, 3, 4, false}, 501);
}

// Router logits planted through one-hot inputs (x[t] = e_t, router[e][t] = logit[t][e]), with exact
// ties. The rule: descending probability, ties to the lower expert index.
template <typename T>
void check_ties() {
  const std::vector<std::vector<float>> logits = {{1, 3, 3, 2, 3}, {0, 0, 0, 0, 0}, {0, 1, 0, 1, 0}};
  const int64_t N = 3, E = 5, H = N;
  const std::vector<std::vector<int32_t>> expected = {{1, 2, 4}, {0, 1, 2}, {1, 3, 0}};
  std::vector<float> x(N * H, 0.0f), router(E * H, 0.0f);
  for (int64_t t = 0; t < N; ++t) {
    x[t * H + t] = 1.0f;
    for (int64_t e = 0; e < E; ++e) router[e * H + t] = logits[t][e];
  }
  for (int64_t k : {2, 3}) {
    const MoeShape s{N, H, E, k, 4, 4, true};
    std::mt19937 rng(7);
    Problem p;
    p.s = s;
    p.x = x;
    p.router = router;
    p.gate_up = round_to<T>(randn(E * 8 * H, rng, 0.5f));
    p.down = round_to<T>(randn(E * H * 4, rng, 0.5f));
    p.shared_gate = p.shared_up = p.shared_down = round_to<T>(randn(4 * H, rng, 0.5f));
    p.shared_expert_gate = randn(H, rng, 0.5f);
    FastRun<T> fast(p);
    MemoryAccountant mem;
    MoeSaved saved;
    std::vector<T> y(N * H);
    const RouterStats stats = moe_forward<T>(s, fast.x.data(), fast.weights(p), y.data(), &saved, mem);
    const int32_t* idx = saved.topk_index.as<int32_t>();
    std::vector<double> counts(E, 0.0);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(idx[t * k + j], expected[t][j]) << "token " << t << " slot " << j << " k " << k;
        counts[expected[t][j]] += 1;
      }
    EXPECT_EQ(stats.expert_counts, counts);
    ReferenceRun ref(p);
    std::vector<double> yr(N * H);
    EXPECT_EQ(reference::moe_forward<double>(s, ref.x.data(), ref.params(), yr.data()).expert_counts, counts);
  }
}
TEST(Moe, TopKTiesGoToLowerIndex) {
  check_ties<float>();
  check_ties<bf16>();
}

// The planner runs the same code with null data: every allocation and every peak must agree, and the
// saved tensors are exactly the documented ones.
template <typename T>
void check_planning() {
  const MoeShape s{29, 16, 5, 2, 12, 8, true};
  const Problem p = make_problem<T>(s, 600);
  FastRun<T> fast(p);
  auto run = [&](MemoryAccountant& mem) {
    MoeSaved saved;
    std::vector<T> y(p.x.size());
    moe_forward<T>(s, fast.x.data(), fast.weights(p), y.data(), &saved, mem);
    Grads g(s);
    moe_backward<T>(s, fast.x.data(), fast.weights(p), saved, p.dy.data(), p.aux.data(), g.dx.data(), g.view(), mem);
  };
  MemoryAccountant real, plan(true);
  run(real);
  run(plan);
  EXPECT_EQ(plan.peak_total(), real.peak_total());
  EXPECT_EQ(plan.allocations(), real.allocations());
  for (size_t c = 0; c < kNumMemCategories; ++c)
    EXPECT_EQ(plan.peak(MemCategory(c)), real.peak(MemCategory(c))) << category_name(MemCategory(c));
  const size_t N = size_t(s.tokens), E = size_t(s.experts), nk = N * size_t(s.top_k);
  const size_t saved_bytes = N * E * 4 + nk * 4 * 3 + (E + 1) * 8 + nk * size_t(2 * s.expert_inter) * sizeof(T) +
                             N * 4 + N * size_t(2 * s.shared_inter) * sizeof(T);
  EXPECT_EQ(real.peak(MemCategory::Activations), saved_bytes);
  EXPECT_EQ(real.live_total(), 0u);
}
TEST(Moe, PlannedPeakEqualsMeasured) {
  check_planning<float>();
  check_planning<bf16>();
}

TEST(Moe, InferenceKeepsNoActivations) {
  const MoeShape s{11, 16, 4, 2, 8, 8, true};
  const Problem p = make_problem<float>(s, 700);
  FastRun<float> fast(p);
  std::vector<float> y(p.x.size()), y_train(p.x.size());
  MemoryAccountant mem;
  const RouterStats a = moe_forward<float>(s, fast.x.data(), fast.weights(p), y.data(), nullptr, mem);
  EXPECT_EQ(mem.peak(MemCategory::Activations), 0u);
  MoeSaved saved;
  const RouterStats b = moe_forward<float>(s, fast.x.data(), fast.weights(p), y_train.data(), &saved, mem);
  EXPECT_EQ(y, y_train);
  EXPECT_EQ(a.expert_counts, b.expert_counts);
  EXPECT_EQ(a.prob_sums, b.prob_sums);
}

// Forward and backward give the same bits for any thread count. 640 tokens over 4 experts put ~320 (k = 2)
// or ~480 (k = 3) rows x 64 columns in each group, above the size at which the per-expert loops go
// parallel; k = 3 also has tokens whose middle expert is neither their first nor their last. dx starts
// non-zero (backward accumulates into it).
template <typename T>
void check_thread_count_invariance(const MoeShape& s, uint32_t seed) {
  const Problem p = make_problem<T>(s, seed);
  FastRun<T> fast(p);
  struct Out {
    std::vector<T> y;
    Grads g;
  };
  auto run = [&] {
    MemoryAccountant mem;
    MoeSaved saved;
    Out o{std::vector<T>(p.x.size()), Grads(s)};
    std::fill(o.g.dx.begin(), o.g.dx.end(), 0.5f);
    moe_forward<T>(s, fast.x.data(), fast.weights(p), o.y.data(), &saved, mem);
    moe_backward<T>(s, fast.x.data(), fast.weights(p), saved, p.dy.data(), p.aux.data(), o.g.dx.data(), o.g.view(),
                    mem);
    return o;
  };
  const Out one = test::with_threads(1, run);
  for (int n : {2, 3}) {
    const Out o = test::with_threads(n, run);
    SCOPED_TRACE(std::to_string(n) + " threads");
    EXPECT_EQ(std::memcmp(o.y.data(), one.y.data(), one.y.size() * sizeof(T)), 0) << "y";
    EXPECT_EQ(o.g.dx, one.g.dx);
    EXPECT_EQ(o.g.router, one.g.router);
    EXPECT_EQ(o.g.gate_up, one.g.gate_up);
    EXPECT_EQ(o.g.down, one.g.down);
    EXPECT_EQ(o.g.shared_gate, one.g.shared_gate);
    EXPECT_EQ(o.g.shared_up, one.g.shared_up);
    EXPECT_EQ(o.g.shared_down, one.g.shared_down);
    EXPECT_EQ(o.g.shared_expert_gate, one.g.shared_expert_gate);
  }
}

TEST(Moe, BitIdenticalForAnyThreadCount) {
  check_thread_count_invariance<float>({640, 64, 4, 2, 64, 64, true}, 1000);
  check_thread_count_invariance<bf16>({640, 64, 4, 2, 64, 64, true}, 1001);
  check_thread_count_invariance<bf16>({640, 64, 4, 3, 64, 64, false}, 1002);
}

// A layer can see no tokens (e.g. an empty micro-batch shard): nothing to do, nothing touched.
TEST(Moe, EmptyBatch) {
  const MoeShape s{0, 16, 4, 2, 8, 8, true};
  Problem p = make_problem<float>(s, 900);
  FastRun<float> fast(p);
  MemoryAccountant mem;
  MoeSaved saved;
  const RouterStats st = moe_forward<float>(s, fast.x.data(), fast.weights(p), nullptr, &saved, mem);
  EXPECT_EQ(st.rows, 0);
  EXPECT_EQ(st.expert_counts, std::vector<double>(4, 0.0));
  Grads g(s);
  moe_backward<float>(s, fast.x.data(), fast.weights(p), saved, nullptr, p.aux.data(), nullptr, g.view(), mem);
  for (float v : g.router) EXPECT_EQ(v, 0.0f);
  for (float v : g.shared_expert_gate) EXPECT_EQ(v, 0.0f);
}

// Two layers, E = 3, N = 6 rows: counts (5, 3, 4), prob sums (2.7, 1.4, 1.9) in total;
// aux = 3 * (5 * 2.7 + 3 * 1.4 + 4 * 1.9) / 36 = 3 * 25.3 / 36, d aux / d prob_sums = 3 * counts / 36.
TEST(LoadBalance, MatchesHandComputation) {
  std::vector<RouterStats> layers = {{{3, 1, 2}, {1.5, 0.5, 1.0}, 3}, {{2, 2, 2}, {1.2, 0.9, 0.9}, 3}};
  std::vector<float> d;
  EXPECT_NEAR(load_balance_loss(layers, 3, &d), 3 * 25.3 / 36, 1e-12);
  ASSERT_EQ(d.size(), 3u);
  EXPECT_FLOAT_EQ(d[0], 15.0f / 36);
  EXPECT_FLOAT_EQ(d[1], 9.0f / 36);
  EXPECT_FLOAT_EQ(d[2], 12.0f / 36);
  EXPECT_EQ(load_balance_loss({}, 3, &d), 0.0);
  EXPECT_THROW(load_balance_loss(layers, 4, nullptr), std::invalid_argument);
}

// The same planted logits given to transformers 5.24's load_balancing_loss_func (Qwen3-Next and
// Qwen3.5-MoE, identical): `f((l1, l2), num_experts=4, top_k=2)` returned 1.982121467590332 in fp32
// (1.982121473835761 in float64); tolerance 1e-6 covers its fp32 arithmetic.
TEST(LoadBalance, MatchesTransformersOnPlantedLogits) {
  const std::vector<std::vector<float>> l1 = {
      {2.0f, -1.0f, 0.5f, 0.0f}, {0.1f, 1.5f, -0.5f, 0.7f}, {-1.0f, 0.2f, 2.2f, 0.9f}, {0.3f, 0.0f, -0.2f, 1.8f}};
  const std::vector<std::vector<float>> l2 = {
      {1.0f, 0.0f, -1.0f, 0.4f}, {-0.3f, 2.0f, 0.6f, -1.2f}, {0.8f, 0.5f, 0.1f, -0.6f}, {0.0f, -0.7f, 1.3f, 0.2f}};
  const int64_t N = 4, E = 4, H = N;
  std::vector<RouterStats> layers;
  for (const auto& logits : {l1, l2}) {
    std::vector<float> x(N * H, 0.0f), router(E * H);
    for (int64_t t = 0; t < N; ++t) {
      x[t * H + t] = 1.0f;
      for (int64_t e = 0; e < E; ++e) router[e * H + t] = logits[t][e];
    }
    const MoeShape s{N, H, E, 2, 4, 4, true};
    std::mt19937 rng(8);
    Problem p;
    p.s = s;
    p.x = x;
    p.router = router;
    p.gate_up = randn(E * 8 * H, rng, 0.5f);
    p.down = randn(E * H * 4, rng, 0.5f);
    p.shared_gate = p.shared_up = p.shared_down = randn(4 * H, rng, 0.5f);
    p.shared_expert_gate = randn(H, rng, 0.5f);
    FastRun<float> fast(p);
    MemoryAccountant mem;
    std::vector<float> y(N * H);
    layers.push_back(moe_forward<float>(s, fast.x.data(), fast.weights(p), y.data(), nullptr, mem));
  }
  EXPECT_NEAR(load_balance_loss(layers, E, nullptr), 1.982121473835761, 1e-6);
}

// End to end through the aux path only: aux(router) = load_balance_loss(stats(moe_forward)) with the
// counts frozen (well-separated logits, see kMargin). The reference backward with dy = 0 and
// aux_dprob = d aux / d prob_sums must match central differences in the router weights (tolerance as
// in the FD test above), and the fast kernel's router gradient must match the reference (fp32, 1e-5).
TEST(LoadBalance, RouterGradientThroughAuxMatchesFiniteDifferences) {
  const MoeShape s{9, 8, 5, 2, 4, 4, true};
  Problem p = make_problem<float>(s, 800);
  std::fill(p.dy.begin(), p.dy.end(), 0.0f);
  ReferenceRun ref(p);
  std::vector<double> y(ref.x.size());
  std::vector<float> dprob;
  load_balance_loss({reference::moe_forward<double>(s, ref.x.data(), ref.params(), y.data())}, s.experts, &dprob);
  ref.aux.assign(dprob.begin(), dprob.end());
  ref.run(s, true);
  auto aux = [&] {
    return load_balance_loss({reference::moe_forward<double>(s, ref.x.data(), ref.params(), y.data())}, s.experts,
                             nullptr);
  };
  const double eps = 1e-6;
  for (size_t i = 0; i < ref.router.size(); ++i) {
    const double keep = ref.router[i];
    ref.router[i] = keep + eps;
    const double ap = aux();
    ref.router[i] = keep - eps;
    const double am = aux();
    ref.router[i] = keep;
    const double fd = (ap - am) / (2 * eps);
    ASSERT_NEAR(ref.g_router[i], fd, 1e-6 * (1 + std::abs(fd))) << i;
  }

  FastRun<float> fast(p);
  MemoryAccountant mem;
  MoeSaved saved;
  std::vector<float> yf(p.x.size());
  moe_forward<float>(s, fast.x.data(), fast.weights(p), yf.data(), &saved, mem);
  Grads g(s);
  moe_backward<float>(s, fast.x.data(), fast.weights(p), saved, p.dy.data(), dprob.data(), g.dx.data(), g.view(), mem);
  EXPECT_LT(rel_rms(g.router, ref.g_router), 1e-5);
  EXPECT_LT(rel_rms(g.dx, ref.dx), 1e-5);
  for (float v : g.gate_up) EXPECT_EQ(v, 0.0f);  // dy = 0: nothing reaches the experts
}

}  // namespace
}  // namespace hs::kernels

namespace hs::kernels {

// accumulate_dx = false: the shared expert, the first writer of dx, writes it (NaN before), and the result has the
// bits of adding everything to zeros; every weight gradient is the same.
TEST(Moe, WritingDxEqualsAddingToZeros) {
  const MoeShape s{300, 16, 4, 2, 8, 8, true};
  const Problem p = make_problem<bf16>(s, 500);
  FastRun<bf16> fast(p);
  MemoryAccountant mem;
  MoeSaved saved;
  std::vector<bf16> y(p.x.size());
  moe_forward<bf16>(s, fast.x.data(), fast.weights(p), y.data(), &saved, mem);
  Grads added(s), written(s);
  std::fill(written.dx.begin(), written.dx.end(), std::nanf(""));
  moe_backward<bf16>(s, fast.x.data(), fast.weights(p), saved, p.dy.data(), nullptr, added.dx.data(), added.view(),
                     mem);
  moe_backward<bf16>(s, fast.x.data(), fast.weights(p), saved, p.dy.data(), nullptr, written.dx.data(),
                     written.view(), mem, false);
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(added.dx, written.dx));
  EXPECT_TRUE(same(added.gate_up, written.gate_up));
  EXPECT_TRUE(same(added.down, written.down));
  EXPECT_TRUE(same(added.router, written.router));
  EXPECT_TRUE(same(added.shared_up, written.shared_up));
  EXPECT_TRUE(same(added.shared_expert_gate, written.shared_expert_gate));
}

}  // namespace hs::kernels
