#include <gtest/gtest.h>

#include <cstring>

#include <cmath>
#include <cstdio>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/delta_rule.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::widen;
using Vec = std::vector<double>;

// Inputs as the layer produces them: q, k L2-normalised (q also scaled by dk^-0.5), beta = sigmoid(noise),
// g = logsigmoid(noise) * gate_scale, plus an upstream gradient d_o.
struct Problem {
  DeltaRuleShape s;
  Vec q, k, v, beta, g, d_o;
};

Problem make_problem(const DeltaRuleShape& s, double gate_scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd;
  Problem p{s, {}, {}, {}, {}, {}, {}};
  const int64_t nqk = s.batch * s.seq * s.k_heads, nv = s.batch * s.seq * s.v_heads;
  auto unit_rows = [&](Vec& x, double scale) {
    x.resize(nqk * s.dk);
    for (int64_t r = 0; r < nqk; ++r) {
      double ss = 0;
      for (int64_t j = 0; j < s.dk; ++j) {
        x[r * s.dk + j] = nd(rng);
        ss += x[r * s.dk + j] * x[r * s.dk + j];
      }
      for (int64_t j = 0; j < s.dk; ++j) x[r * s.dk + j] *= scale / std::sqrt(ss + 1e-6);
    }
  };
  unit_rows(p.q, 1.0 / std::sqrt(double(s.dk)));
  unit_rows(p.k, 1.0);
  p.v.resize(nv * s.dv);
  p.d_o.resize(nv * s.dv);
  for (auto& x : p.v) x = nd(rng);
  for (auto& x : p.d_o) x = nd(rng);
  p.beta.resize(nv);
  p.g.resize(nv);
  for (auto& x : p.beta) x = 1.0 / (1.0 + std::exp(-nd(rng)));
  for (auto& x : p.g) {
    const double z = nd(rng);
    x = gate_scale * (std::min(z, 0.0) - std::log1p(std::exp(-std::abs(z))));  // logsigmoid(z)
  }
  return p;
}

struct Result {
  Vec o, dq, dk, dv, dbeta, dg;
};

Result reference_result(const Problem& p) {
  const auto& s = p.s;
  Result r{Vec(p.v.size()), Vec(p.q.size()), Vec(p.k.size()), Vec(p.v.size()), Vec(p.beta.size()),
           Vec(p.g.size())};
  reference::delta_rule_recurrent_forward(s, p.q.data(), p.k.data(), p.v.data(), p.beta.data(), p.g.data(),
                                          r.o.data());
  reference::delta_rule_recurrent_backward(s, p.q.data(), p.k.data(), p.v.data(), p.beta.data(), p.g.data(),
                                           p.d_o.data(), r.dq.data(), r.dk.data(), r.dv.data(), r.dbeta.data(),
                                           r.dg.data());
  return r;
}

std::vector<float> to_float(const Vec& x) { return cast<float>(x); }

// The fast kernels with storage type T; gradients start from a non-zero fill to check they accumulate.
template <typename T>
Result kernel_result(const Problem& p, MemoryAccountant& mem, double grad_fill = 0.0, bool keep_states = false,
                     DeltaRuleProducts products = DeltaRuleProducts::Fp32) {
  const auto& s = p.s;
  const auto q = cast<T>(p.q), k = cast<T>(p.k), v = cast<T>(p.v);
  const auto beta = to_float(p.beta), g = to_float(p.g), d_o = to_float(p.d_o);
  std::vector<T> o(p.v.size());
  std::vector<float> dq(p.q.size(), float(grad_fill)), dk(p.k.size(), float(grad_fill)),
      dv(p.v.size(), float(grad_fill)), dbeta(p.beta.size(), float(grad_fill)), dg(p.g.size(), float(grad_fill));
  DeltaRuleSaved saved;
  delta_rule_forward(s, q.data(), k.data(), v.data(), beta.data(), g.data(), o.data(), &saved, mem, keep_states,
                     products);
  EXPECT_EQ(saved.W.empty(), !keep_states);
  delta_rule_backward(s, q.data(), k.data(), v.data(), beta.data(), g.data(), saved, d_o.data(), dq.data(), dk.data(),
                      dv.data(), dbeta.data(), dg.data(), mem, true, products);
  Result r{widen(o), widen(dq), widen(dk), widen(dv), widen(dbeta), widen(dg)};
  if (grad_fill != 0.0)
    for (Vec* x : {&r.dq, &r.dk, &r.dv, &r.dbeta, &r.dg})
      for (double& e : *x) e -= grad_fill;
  return r;
}

// ||a - ref|| / ||ref||; the floor keeps an all-zero reference (dg at T = 1, where the state read is zero)
// from turning round-off into infinities.
double rel_rms(const Vec& a, const Vec& ref) { return test::rel_rms(a, ref, 1e-20); }

void expect_close(const Result& got, const Result& want, double tol_o, double tol_grad, const std::string& what) {
  EXPECT_LT(rel_rms(got.o, want.o), tol_o) << what << " o";
  EXPECT_LT(rel_rms(got.dq, want.dq), tol_grad) << what << " dq";
  EXPECT_LT(rel_rms(got.dk, want.dk), tol_grad) << what << " dk";
  EXPECT_LT(rel_rms(got.dv, want.dv), tol_grad) << what << " dv";
  EXPECT_LT(rel_rms(got.dbeta, want.dbeta), tol_grad) << what << " dbeta";
  EXPECT_LT(rel_rms(got.dg, want.dg), tol_grad) << what << " dg";
}

struct SweepCase {
  int64_t seq, dk, dv, r;
  double gate_scale;
};

std::string case_name(const SweepCase& c) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "T%ld_dk%ld_dv%ld_r%ld_gate%s", long(c.seq), long(c.dk), long(c.dv), long(c.r),
                c.gate_scale < 1 ? "0p1" : c.gate_scale > 1 ? "10" : "1");
  return buf;
}

class DeltaRuleChunkedVsRecurrent : public ::testing::TestWithParam<SweepCase> {};

void PrintTo(const SweepCase& c, std::ostream* os) { *os << case_name(c); }

// The fp32 chunked kernel against the double recurrent oracle. fp32 round-off (2^-24 = 6e-8) accumulates
// over dot products of length <= 128 and 64-step triangular solves, and a chunk's start-state error is
// carried on through the recurrence: observed relative-RMS errors are <= 7e-7 for the output and the
// gradients, except dg (row minus column sums that largely cancel) at <= 8e-6 with the strongest gates.
// Tolerances 1e-5 (output) and 1e-4 (gradients) keep a >= 10x margin; a wrong term gives 1e-2 and up, and
// even scaling the chunk-boundary gate term by 0.999 already fails dg (3.6e-4).
TEST_P(DeltaRuleChunkedVsRecurrent, OutputAndEveryGradient) {
  const SweepCase c = GetParam();
  const DeltaRuleShape s{1, c.seq, 2, 2 * c.r, c.dk, c.dv};
  const Problem p = make_problem(s, c.gate_scale, 100 + static_cast<uint32_t>(c.seq + c.dk + c.r));
  MemoryAccountant mem;
  expect_close(kernel_result<float>(p, mem, 0.25), reference_result(p), 1e-5, 1e-4, case_name(c));
  EXPECT_EQ(mem.live_total(), 0u);
}

// Every value of every axis (T, head dim, r, gate scale) appears, and the large combination (T = 300 with
// dim 128) appears with both ratios.
INSTANTIATE_TEST_SUITE_P(DeltaRuleSweep, DeltaRuleChunkedVsRecurrent,
                         ::testing::Values(SweepCase{1, 16, 16, 1, 1.0}, SweepCase{15, 32, 32, 2, 0.1},
                                           SweepCase{63, 100, 100, 1, 10.0}, SweepCase{64, 128, 128, 2, 1.0},
                                           SweepCase{65, 16, 16, 2, 10.0}, SweepCase{65, 100, 100, 2, 0.1},
                                           SweepCase{300, 32, 32, 1, 1.0}, SweepCase{300, 16, 16, 2, 0.1},
                                           SweepCase{300, 128, 128, 2, 10.0}, SweepCase{300, 128, 128, 1, 0.1},
                                           SweepCase{130, 32, 100, 2, 1.0}, SweepCase{64, 16, 16, 1, 10.0}),
                         [](const ::testing::TestParamInfo<SweepCase>& param_info) {
                           return case_name(param_info.param);
                         });

// Inference (saved == nullptr) computes the same output and keeps nothing.
TEST(DeltaRuleForward, InferenceMatchesTrainingAndKeepsNothing) {
  const DeltaRuleShape s{2, 100, 1, 2, 32, 48};
  const Problem p = make_problem(s, 1.0, 7);
  const auto q = to_float(p.q), k = to_float(p.k), v = to_float(p.v), beta = to_float(p.beta), g = to_float(p.g);
  std::vector<float> o1(p.v.size()), o2(p.v.size());
  MemoryAccountant mem;
  DeltaRuleSaved saved;
  delta_rule_forward(s, q.data(), k.data(), v.data(), beta.data(), g.data(), o1.data(), &saved, mem);
  const size_t kept = mem.live_total();
  EXPECT_EQ(kept, saved.tinv.bytes() + saved.gcum.bytes());
  delta_rule_forward<float>(s, q.data(), k.data(), v.data(), beta.data(), g.data(), o2.data(), nullptr, mem);
  EXPECT_EQ(mem.live_total(), kept);
  EXPECT_EQ(o1, o2);
}

// The oracle's own backward against central differences of L = sum(o * d_o), all in double. With h = 1e-6
// the truncation error is ~h^2 and the round-off ~1e-16 |L| / h ~ 1e-9, so 1e-7 absolute (gradients are
// O(1)) separates a correct backward from any wrong term.
TEST(DeltaRuleReference, BackwardMatchesFiniteDifferences) {
  const DeltaRuleShape s{2, 9, 1, 2, 4, 3};
  Problem p = make_problem(s, 1.0, 11);
  const Result r = reference_result(p);
  auto loss = [&]() {
    Vec o(p.v.size());
    reference::delta_rule_recurrent_forward(s, p.q.data(), p.k.data(), p.v.data(), p.beta.data(), p.g.data(),
                                            o.data());
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += o[i] * p.d_o[i];
    return l;
  };
  test::expect_grad_matches_fd(p.q, r.dq, loss, "dq", 0.0, 1e-7);
  test::expect_grad_matches_fd(p.k, r.dk, loss, "dk", 0.0, 1e-7);
  test::expect_grad_matches_fd(p.v, r.dv, loss, "dv", 0.0, 1e-7);
  test::expect_grad_matches_fd(p.beta, r.dbeta, loss, "dbeta", 0.0, 1e-7);
  test::expect_grad_matches_fd(p.g, r.dg, loss, "dg", 0.0, 1e-7);
}

// bf16 storage against the fp32 path fed the same (bf16-rounded) values: loads widen exactly and all
// math is fp32 in both, so gradients agree to fp32 summation noise (1e-6) and the output differs only by
// its final rounding to bf16, at most 2^-8 relative per element. Against the double oracle on the
// unrounded inputs, bf16 input rounding (2^-9 relative per element) propagated through the recurrence
// gives ~3e-3 relative RMS; 2e-2 bounds it.
TEST(DeltaRuleBf16, MatchesF32PathOnRoundedInputs) {
  const DeltaRuleShape s{1, 150, 2, 4, 64, 64};
  const Problem exact = make_problem(s, 1.0, 21);
  Problem rounded = exact;
  for (Vec* x : {&rounded.q, &rounded.k, &rounded.v})
    for (double& e : *x) e = to_f32(bf16(static_cast<float>(e)));
  MemoryAccountant mem;
  const Result b = kernel_result<bf16>(exact, mem);
  const Result f = kernel_result<float>(rounded, mem);
  for (size_t i = 0; i < b.o.size(); ++i)
    ASSERT_LE(std::abs(b.o[i] - f.o[i]), std::ldexp(std::abs(f.o[i]), -8) + 1e-30) << i;
  expect_close(b, f, 4e-3, 1e-6, "bf16 vs f32");
  expect_close(b, reference_result(exact), 2e-2, 2e-2, "bf16 vs oracle");
}

// Batch entries are independent: a batch of different sequences equals each run alone, bit for bit (the
// same operations run in the same order per (batch, head)).
TEST(DeltaRuleBatch, EqualsEachSequenceAlone) {
  const DeltaRuleShape s{3, 70, 2, 4, 32, 16};
  const Problem p = make_problem(s, 1.0, 31);
  MemoryAccountant mem;
  const Result all = kernel_result<float>(p, mem);
  for (int64_t b = 0; b < s.batch; ++b) {
    const DeltaRuleShape s1{1, s.seq, s.k_heads, s.v_heads, s.dk, s.dv};
    auto slice = [&](const Vec& x) {
      const size_t n = x.size() / s.batch;
      return Vec(x.begin() + b * n, x.begin() + (b + 1) * n);
    };
    const Problem p1{s1, slice(p.q), slice(p.k), slice(p.v), slice(p.beta), slice(p.g), slice(p.d_o)};
    const Result one = kernel_result<float>(p1, mem);
    EXPECT_EQ(one.o, slice(all.o)) << b;
    EXPECT_EQ(one.dq, slice(all.dq)) << b;
    EXPECT_EQ(one.dk, slice(all.dk)) << b;
    EXPECT_EQ(one.dv, slice(all.dv)) << b;
    EXPECT_EQ(one.dbeta, slice(all.dbeta)) << b;
    EXPECT_EQ(one.dg, slice(all.dg)) << b;
  }
}

// With r > 1 and fewer (batch, key head) pairs than threads each value head's dq, dk go through a partial
// summed afterwards, otherwise one thread adds all r heads directly: the sums run in the same order, so
// the gradients are identical bit for bit.
TEST(DeltaRuleBackward, SameResultForAnyThreadCount) {
  const DeltaRuleShape s{1, 130, 1, 4, 32, 16};
  const Problem p = make_problem(s, 1.0, 51);
  MemoryAccountant mem;
  const Result one = test::with_threads(1, [&] { return kernel_result<float>(p, mem, 0.25); });
  const Result three = test::with_threads(3, [&] { return kernel_result<float>(p, mem, 0.25); });
  EXPECT_EQ(one.o, three.o);
  EXPECT_EQ(one.dq, three.dq);
  EXPECT_EQ(one.dk, three.dk);
  EXPECT_EQ(one.dv, three.dv);
  EXPECT_EQ(one.dbeta, three.dbeta);
  EXPECT_EQ(one.dg, three.dg);
}

// Keeping every chunk's W, V_new and start state in the forward (remat none) gives the backward exactly the values
// it would recompute: the same bits for the output and every gradient, at several chunk counts (T = 64 is one
// chunk, 130 ends in a partial one), fp32 and bf16 storage, and with r > 1.
TEST(DeltaRuleBackward, KeptChunkStatesGiveTheSameBitsAsRecomputing) {
  for (const DeltaRuleShape& s : {DeltaRuleShape{1, 64, 1, 1, 32, 32}, DeltaRuleShape{2, 130, 1, 2, 32, 16},
                                  DeltaRuleShape{1, 200, 2, 4, 48, 64}}) {
    const Problem p = make_problem(s, 1.0, 61);
    MemoryAccountant mem;
    const Result a = kernel_result<float>(p, mem, 0.25), b = kernel_result<float>(p, mem, 0.25, true);
    const Result c = kernel_result<bf16>(p, mem), d = kernel_result<bf16>(p, mem, 0.0, true);
    for (auto [x, y] : {std::pair{&a, &b}, std::pair{&c, &d}}) {
      EXPECT_EQ(x->o, y->o);
      EXPECT_EQ(x->dq, y->dq);
      EXPECT_EQ(x->dk, y->dk);
      EXPECT_EQ(x->dv, y->dv);
      EXPECT_EQ(x->dbeta, y->dbeta);
      EXPECT_EQ(x->dg, y->dg);
    }
  }
}

// accumulate = false writes every gradient (buffers full of NaN before) with exactly the bits of adding to zeros,
// in both ways of summing a key head's value heads (r = 2 with one and with three threads: per key head, and
// per value head with partials).
TEST(DeltaRuleBackward, WritingEqualsAddingToZeros) {
  const DeltaRuleShape s{1, 150, 1, 2, 32, 16};
  const Problem p = make_problem(s, 1.0, 71);
  const auto q = cast<float>(p.q), k = cast<float>(p.k), v = cast<float>(p.v);
  const auto beta = to_float(p.beta), g = to_float(p.g), d_o = to_float(p.d_o);
  for (int threads : {1, 3}) {
    test::with_threads(threads, [&] {
      MemoryAccountant mem;
      std::vector<float> o(p.v.size());
      DeltaRuleSaved saved;
      delta_rule_forward(s, q.data(), k.data(), v.data(), beta.data(), g.data(), o.data(), &saved, mem);
      auto run = [&](bool accumulate, float fill) {
        std::vector<std::vector<float>> r = {std::vector<float>(p.q.size(), fill), std::vector<float>(p.k.size(), fill),
                                             std::vector<float>(p.v.size(), fill),
                                             std::vector<float>(p.beta.size(), fill),
                                             std::vector<float>(p.g.size(), fill)};
        delta_rule_backward(s, q.data(), k.data(), v.data(), beta.data(), g.data(), saved, d_o.data(), r[0].data(),
                            r[1].data(), r[2].data(), r[3].data(), r[4].data(), mem, accumulate);
        return r;
      };
      const auto added = run(true, 0.0f), written = run(false, std::nanf(""));
      for (size_t i = 0; i < added.size(); ++i)
        EXPECT_EQ(0, std::memcmp(added[i].data(), written[i].data(), added[i].size() * sizeof(float)))
            << "gradient " << i << ", " << threads << " threads";
      return 0;
    });
  }
}

// ---- bf16-input products (DeltaRuleProducts::Bf16) ----

#define HS_NEED_BF16_PRODUCTS() \
  if (!delta_rule_bf16_products_available()) GTEST_SKIP() << "this CPU lacks AVX-512-BF16"

// Rounds to bf16 and back (nearest even), as the packing does.
double round_bf16(double x) { return to_f32(bf16(static_cast<float>(x))); }

// The kernels' own products against a double product of the operands as they see them (fp32: as given; bf16: rounded
// to bf16 first): both sum exact products in fp32, so |C - C_exact| <= K 2^-24 sum_k |a_k b_k| (the usual bound for
// a length-K fp32 sum). A wrong pack (a swapped pair, a row off by one) breaks it by orders of magnitude. Shapes cover
// K % 32 == 16 (the half-width tail of the row pack), narrow 8-row blocks and 3-vector-wide ones.
TEST(DeltaRuleProduct, WithinTheSummationBoundOfItsInputs) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (DeltaRuleProducts kind : {DeltaRuleProducts::Fp32, DeltaRuleProducts::Bf16}) {
    if (kind == DeltaRuleProducts::Bf16 && !delta_rule_bf16_products_available()) continue;
    for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{64, 64, 64}, {16, 48, 16}, {128, 64, 48},
                           {8, 16, 32}, {64, 128, 128}, {4, 32, 80}}) {
      std::vector<float> A(M * K), B(K * N), Cm(M * N);
      for (auto& x : A) x = nd(rng);
      for (auto& x : B) x = nd(rng);
      detail::delta_rule_product(M, N, K, A.data(), B.data(), Cm.data(), kind);
      auto seen = [&](float x) { return kind == DeltaRuleProducts::Bf16 ? round_bf16(x) : double(x); };
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double exact = 0, mag = 0;
          for (int64_t k = 0; k < K; ++k) {
            const double t = seen(A[i * K + k]) * seen(B[k * N + j]);
            exact += t;
            mag += std::abs(t);
          }
          ASSERT_LE(std::abs(Cm[i * N + j] - exact), K * std::ldexp(mag, -24))
              << (kind == DeltaRuleProducts::Bf16 ? "bf16 " : "fp32 ") << M << "x" << N << "x" << K << " at " << i
              << "," << j;
        }
    }
  }
  EXPECT_THROW(detail::delta_rule_product(6, 16, 16, nullptr, nullptr, nullptr, DeltaRuleProducts::Fp32),
               std::invalid_argument);
}

// The whole kernel with bf16-input products, forward and backward, against the double oracle fed the same bf16 inputs
// and against the fp32-product kernel. Every product rounds its two operands to bf16 (at most 2^-9 relative each,
// ~1.1e-3 RMS), and a result passes through a few products in a chain (e.g. dq <- dP <- dO Vn^T, or o <- P Vn <- Tinv
// (beta V)): observed relative RMS errors 2.5e-3 - 3.5e-3 for the output and every gradient, at head dims 48-128 and
// gate scales 0.1-10, against 1.7e-3 for the fp32 kernel's output (its own final rounding to bf16) and <= 1e-5 for its
// gradients. The output's storage in bf16 already costs 1.7e-3, so the products add about as much again. Tolerance
// 1e-2 (3x margin); the products must also differ from the fp32 ones by more than 1e-4 (so the bf16 path really ran).
// A misplaced operand in any product gives errors of order 1.
TEST(DeltaRuleBf16Products, CloseToTheOracleAndToTheFp32Products) {
  HS_NEED_BF16_PRODUCTS();
  for (const DeltaRuleShape& s : {DeltaRuleShape{1, 150, 2, 4, 64, 64}, DeltaRuleShape{1, 300, 1, 2, 128, 128},
                                  DeltaRuleShape{2, 130, 1, 2, 48, 100}}) {
    for (double gate_scale : {0.1, 1.0, 10.0}) {
      const Problem exact = make_problem(s, gate_scale, 21);
      Problem rounded = exact;
      for (Vec* x : {&rounded.q, &rounded.k, &rounded.v})
        for (double& e : *x) e = round_bf16(e);
      MemoryAccountant mem;
      const Result b = kernel_result<bf16>(exact, mem, 0.25, false, DeltaRuleProducts::Bf16);
      const Result f = kernel_result<bf16>(exact, mem, 0.25);
      const std::string what = "dk " + std::to_string(s.dk) + " gate " + std::to_string(gate_scale);
      expect_close(b, reference_result(rounded), 1e-2, 1e-2, what + " vs oracle");
      expect_close(b, f, 1e-2, 1e-2, what + " vs fp32 products");
      EXPECT_GT(rel_rms(b.dq, f.dq), 1e-4) << what;
      EXPECT_GT(rel_rms(b.dg, f.dg), 1e-4) << what;
      EXPECT_EQ(mem.live_total(), 0u);
    }
  }
}

// The bf16 products keep the kernel's guarantees: the same bits for any thread count (r = 4 over one key head: per
// value head partials with 3 threads, direct adds with 1) and with or without the kept chunk states; fp32 storage
// ignores the request (the same bits as Fp32), as does a CPU without AVX-512-BF16.
TEST(DeltaRuleBf16Products, SameBitsForAnyThreadCountAndKeptStates) {
  const DeltaRuleShape s{1, 130, 1, 4, 32, 16};
  const Problem p = make_problem(s, 1.0, 51);
  MemoryAccountant mem;
  constexpr auto kBf16 = DeltaRuleProducts::Bf16;
  const Result one = test::with_threads(1, [&] { return kernel_result<bf16>(p, mem, 0.25, false, kBf16); });
  const Result three = test::with_threads(3, [&] { return kernel_result<bf16>(p, mem, 0.25, false, kBf16); });
  const Result kept = test::with_threads(3, [&] { return kernel_result<bf16>(p, mem, 0.25, true, kBf16); });
  for (const Result* r : {&three, &kept}) {
    EXPECT_EQ(one.o, r->o);
    EXPECT_EQ(one.dq, r->dq);
    EXPECT_EQ(one.dk, r->dk);
    EXPECT_EQ(one.dv, r->dv);
    EXPECT_EQ(one.dbeta, r->dbeta);
    EXPECT_EQ(one.dg, r->dg);
  }
  const Result f32 = kernel_result<float>(p, mem, 0.25), f32_asked = kernel_result<float>(p, mem, 0.25, false, kBf16);
  EXPECT_EQ(f32.o, f32_asked.o);
  EXPECT_EQ(f32.dq, f32_asked.dq);
  EXPECT_EQ(f32.dg, f32_asked.dg);
  if (!delta_rule_bf16_products_available()) {
    const Result b = kernel_result<bf16>(p, mem, 0.25);
    EXPECT_EQ(b.o, one.o);
    EXPECT_EQ(b.dq, one.dq);
    EXPECT_EQ(b.dg, one.dg);
  }
}


// Forward + backward peak (saved + workspace), planned or measured.
template <typename T = float>
size_t peak_bytes(const DeltaRuleShape& s, bool planning, DeltaRuleProducts products = DeltaRuleProducts::Fp32,
                  bool keep = false) {
  MemoryAccountant mem(planning);
  if (planning) {
    DeltaRuleSaved saved;
    delta_rule_forward<T>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &saved, mem, keep, products);
    delta_rule_backward<T>(s, nullptr, nullptr, nullptr, nullptr, nullptr, saved, nullptr, nullptr, nullptr, nullptr,
                           nullptr, nullptr, mem, true, products);
  } else {
    kernel_result<T>(make_problem(s, 1.0, 41), mem, 0.0, keep, products);
  }
  return mem.peak_total();
}

// Memory grows linearly in T and like T (dk + dv), never T dk dv: per token the forward keeps Tinv and G
// (65 floats per head) and the backward's per-thread scratch holds one head's W, Vn (dk + dv per token)
// and chunk-start states (dk dv / 64 per token, which at these dims is below dk + dv). Going from d = 32
// to 64 the per-token bytes grow ~1.8x; a T dk dv term would make that 4x.
TEST(DeltaRuleMemory, LinearInTAndNotQuadraticInHeadDim) {
  auto shape = [](int64_t T, int64_t d) { return DeltaRuleShape{1, T, 2, 4, d, d}; };
  const int64_t T = 256;
  for (int64_t d : {32, 64}) {
    const size_t p1 = peak_bytes(shape(T, d), false), p4 = peak_bytes(shape(4 * T, d), false);
    EXPECT_EQ(p1, peak_bytes(shape(T, d), true)) << d;
    EXPECT_EQ(p4, peak_bytes(shape(4 * T, d), true)) << d;
    EXPECT_LT(double(p4) / double(p1), 4.5) << d;
    EXPECT_GT(p4, p1) << d;
  }
  auto per_token = [&](int64_t d) {
    return double(peak_bytes(shape(4 * T, d), true) - peak_bytes(shape(T, d), true)) / double(3 * T);
  };
  const double growth = per_token(64) / per_token(32);
  EXPECT_GT(growth, 1.3);
  EXPECT_LT(growth, 2.5);
}

// With bf16 products each thread's scratch also holds two operand packs (max(64, dk, dv)^2 bf16 each): planned the
// same way as measured, kept states or not; without AVX-512-BF16 nothing changes.
TEST(DeltaRuleMemory, Bf16ProductsPlannedAsMeasured) {
  for (const DeltaRuleShape& s : {DeltaRuleShape{2, 200, 2, 4, 64, 64}, DeltaRuleShape{1, 130, 1, 2, 48, 100}})
    for (bool keep : {false, true}) {
      const size_t planned = peak_bytes<bf16>(s, true, DeltaRuleProducts::Bf16, keep);
      EXPECT_EQ(planned, peak_bytes<bf16>(s, false, DeltaRuleProducts::Bf16, keep)) << s.dk << " " << keep;
      const size_t fp32 = peak_bytes<bf16>(s, true, DeltaRuleProducts::Fp32, keep);
      if (delta_rule_bf16_products_available()) {
        EXPECT_GT(planned, fp32);
      } else {
        EXPECT_EQ(planned, fp32);
      }
    }
}

// HS_DELTA_RULE_BF16_PRODUCTS=off takes the path of a CPU without AVX-512-BF16: Bf16 asked for, fp32 products run, the
// same bits as Fp32 (and the plan drops the packs).
TEST(DeltaRuleBf16Products, FallbackWithoutTheInstructionsIsTheFp32Kernel) {
  const DeltaRuleShape s{2, 100, 1, 2, 32, 48};
  const Problem p = make_problem(s, 1.0, 81);
  MemoryAccountant mem;
  const Result f = kernel_result<bf16>(p, mem, 0.25);
  const size_t planned_fp32 = peak_bytes<bf16>(s, true, DeltaRuleProducts::Fp32, true);
  ::setenv("HS_DELTA_RULE_BF16_PRODUCTS", "off", 1);
  const bool available = delta_rule_bf16_products_available();
  const Result b = kernel_result<bf16>(p, mem, 0.25, false, DeltaRuleProducts::Bf16);
  const size_t planned = peak_bytes<bf16>(s, true, DeltaRuleProducts::Bf16, true);
  ::unsetenv("HS_DELTA_RULE_BF16_PRODUCTS");
  EXPECT_FALSE(available);
  EXPECT_EQ(planned, planned_fp32);
  EXPECT_EQ(f.o, b.o);
  EXPECT_EQ(f.dq, b.dq);
  EXPECT_EQ(f.dk, b.dk);
  EXPECT_EQ(f.dv, b.dv);
  EXPECT_EQ(f.dbeta, b.dbeta);
  EXPECT_EQ(f.dg, b.dg);
}

}  // namespace
}  // namespace hs::kernels
