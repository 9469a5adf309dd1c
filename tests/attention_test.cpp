#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/attention.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

size_t q_size(const AttentionShape& s) { return static_cast<size_t>(s.batch * s.seq * s.q_heads * s.head_dim); }
size_t kv_size(const AttentionShape& s) { return static_cast<size_t>(s.batch * s.seq * s.kv_heads * s.head_dim); }

// Standard normal values in the storage type, plus the same (rounded) values in double for the reference.
template <typename T>
struct Input {
  std::vector<T> x;
  std::vector<double> ref;
  Input(size_t n, std::mt19937& rng, float stddev = 1.0f)
      : x(test::cast<T>(test::randn(n, rng, stddev))), ref(test::widen(x)) {}
};

// sqrt(sum (a - offset - b)^2 / sum b^2), the offset subtracted in double.
double rel_rms(const std::vector<float>& a, const std::vector<double>& b, double offset = 0) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = a[i] - offset - b[i];
    num += e * e;
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);  // T = 1: dq = dk = 0 exactly
}

template <typename T>
void check_against_reference(const AttentionShape& s, uint32_t seed, float q_stddev = 1.0f) {
  SCOPED_TRACE("T=" + std::to_string(s.seq) + " hd=" + std::to_string(s.head_dim) +
               " heads=" + std::to_string(s.q_heads) + "/" + std::to_string(s.kv_heads));
  constexpr bool kF32 = std::is_same_v<T, float>;
  std::mt19937 rng(seed);
  Input<T> q(q_size(s), rng, q_stddev), k(kv_size(s), rng), v(kv_size(s), rng), gate(q_size(s), rng);
  Input<float> dout(q_size(s), rng);

  MemoryAccountant mem;
  AttentionSaved saved;
  std::vector<T> out(q_size(s));
  gated_attention_forward(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), out.data(), &saved, mem);
  std::vector<double> out_ref(q_size(s)), attn_ref(q_size(s)),
      lse_ref(static_cast<size_t>(s.batch * s.q_heads * s.seq));
  reference::gated_attention_forward(s, q.ref.data(), k.ref.data(), v.ref.data(), gate.ref.data(), out_ref.data(),
                                     attn_ref.data(), lse_ref.data());

  // fp32: scores are fp32 dot products of <= 256 terms of magnitude ~1, the softmax uses a sub-ulp exp
  // (kernels/vec_math.h) and the outputs are averages of O(1) values: errors are ~1e-6 (measured <= 1.4e-6).
  // 2e-5 leaves a margin while a masking or indexing bug gives O(0.1) errors. The scores' round-off grows
  // with their magnitude, so every tolerance scales with q_stddev (measured at 8: 1e-5 here, 1.6e-6 and
  // 5e-3 for the fp32 and bf16 gradients below).
  // bf16: the result is rounded once to bf16 (half an ulp: at most 2^-8 relative) on top of that.
  const double spread = q_stddev;
  const double atol = 2e-5 * spread, rel = kF32 ? 0.0 : 1.0 / 256;
  const float* lse = saved.lse.as<float>();
  const T* attn = saved.attn.as<T>();
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(to_f32(out[i]), out_ref[i], atol + rel * std::abs(out_ref[i])) << "out " << i;
    ASSERT_NEAR(to_f32(attn[i]), attn_ref[i], atol + rel * std::abs(attn_ref[i])) << "attn " << i;
  }
  // lse is fp32 in both storage types: a log of a sum of exps of the fp32 scores.
  for (size_t i = 0; i < lse_ref.size(); ++i) ASSERT_NEAR(lse[i], lse_ref[i], atol * (1 + std::abs(lse_ref[i])));

  // Gradients start from a nonzero value to check that the kernel accumulates; rounding init + grad to
  // fp32 costs half an ulp of it (~1e-8 here), far below the tolerances.
  const float init = 0.25f;
  std::vector<float> dq(q_size(s), init), dk(kv_size(s), init), dv(kv_size(s), init), dgate(q_size(s), init);
  gated_attention_backward(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), saved, dout.x.data(), dq.data(),
                           dk.data(), dv.data(), dgate.data(), mem);
  std::vector<double> dq_ref(q_size(s)), dk_ref(kv_size(s)), dv_ref(kv_size(s)), dgate_ref(q_size(s));
  reference::gated_attention_backward(s, q.ref.data(), k.ref.data(), v.ref.data(), gate.ref.data(),
                                      dout.ref.data(), dq_ref.data(), dk_ref.data(), dv_ref.data(),
                                      dgate_ref.data());
  // Relative RMS over each gradient. fp32: the same fp32 round-off as the forward (measured <= 6e-7);
  // 1e-5 is a wide margin, while a wrong mask, scale or GQA mapping gives O(1). bf16: backward reads
  // the saved attention rounded to bf16 (relative RMS of bf16 rounding ~2^-9 * 1.4 / sqrt(3) ~ 1.6e-3)
  // in dgate and in D = rowsum(dA * attn), which enters dS = P (dP - D) (measured: dgate 1.6e-3,
  // dq / dk <= 2.4e-3, dv unaffected); 1e-2 bounds these with margin.
  const double tol = (kF32 ? 1e-5 : 1e-2) * spread;
  EXPECT_LT(rel_rms(dq, dq_ref, init), tol) << "dq";
  EXPECT_LT(rel_rms(dk, dk_ref, init), tol) << "dk";
  EXPECT_LT(rel_rms(dv, dv_ref, init), tol) << "dv";
  EXPECT_LT(rel_rms(dgate, dgate_ref, init), tol) << "dgate";
}

// T in {1, 7, 64, 65, 130} crosses 0, 1 and 2 tile boundaries (tiles of 64) with ragged last tiles.
template <typename T>
void sweep() {
  uint32_t seed = 1;
  for (int64_t seq : {1, 7, 64, 65, 130})
    for (int64_t hd : {16, 64})
      for (int64_t kv_heads : {4, 2, 1}) check_against_reference<T>({2, seq, 4, kv_heads, hd}, seed++);
}

TEST(GatedAttention, MatchesReferenceF32) { sweep<float>(); }
TEST(GatedAttention, MatchesReferenceBf16) { sweep<bf16>(); }

// hd 256 (Qwen3-Next) and hd 24, which is padded to 32 inside the kernel.
TEST(GatedAttention, MatchesReferenceWideAndPaddedHeadDims) {
  check_against_reference<float>({1, 65, 4, 2, 256}, 100);
  check_against_reference<bf16>({1, 65, 4, 2, 256}, 101);
  check_against_reference<float>({2, 130, 4, 1, 24}, 102);
  check_against_reference<bf16>({2, 130, 4, 1, 24}, 103);
}

// hd 12 and 20: rows whose length is not a multiple of 8, so the AVX2 output and gate loops end in their scalar
// tails (padded to 16 and 32 inside the kernel).
TEST(GatedAttention, MatchesReferenceWithRaggedHeadDims) {
  check_against_reference<float>({2, 70, 4, 2, 12}, 104);
  check_against_reference<bf16>({2, 70, 4, 2, 12}, 105);
  check_against_reference<float>({1, 130, 2, 1, 20}, 106);
  check_against_reference<bf16>({1, 130, 2, 1, 20}, 107);
}

// Scores with a standard deviation of 8: nearly one-hot rows whose maximum moves between key tiles, so the
// online softmax's rescaling and the exp's range matter.
TEST(GatedAttention, MatchesReferenceWithPeakedScores) {
  check_against_reference<float>({2, 130, 4, 2, 64}, 200, 8.0f);
  check_against_reference<bf16>({2, 130, 4, 2, 64}, 201, 8.0f);
}

// The reference backward against central differences of L = sum(out * w), all in double.
TEST(GatedAttention, ReferenceBackwardMatchesFiniteDifferences) {
  const AttentionShape s{2, 5, 4, 2, 3};
  std::mt19937 rng(5);
  Input<double> q(q_size(s), rng), k(kv_size(s), rng), v(kv_size(s), rng), gate(q_size(s), rng),
      w(q_size(s), rng);
  auto loss = [&] {
    std::vector<double> out(q_size(s));
    reference::gated_attention_forward(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), out.data());
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += out[i] * w.x[i];
    return l;
  };
  std::vector<double> dq(q_size(s)), dk(kv_size(s)), dv(kv_size(s)), dgate(q_size(s));
  reference::gated_attention_backward(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), w.x.data(), dq.data(),
                                      dk.data(), dv.data(), dgate.data());
  // eps 1e-5: truncation error ~eps^2 * |L'''| ~ 1e-10, round-off ~1e-16 * |L| / eps ~ 1e-11.
  const double eps = 1e-5;
  const std::pair<std::vector<double>*, std::vector<double>*> inputs[] = {
      {&q.x, &dq}, {&k.x, &dk}, {&v.x, &dv}, {&gate.x, &dgate}};
  for (auto [x, grad] : inputs)
    for (size_t i = 0; i < x->size(); ++i) {
      const double x0 = (*x)[i];
      (*x)[i] = x0 + eps;
      const double lp = loss();
      (*x)[i] = x0 - eps;
      const double lm = loss();
      (*x)[i] = x0;
      ASSERT_NEAR((*grad)[i], (lp - lm) / (2 * eps), 1e-8) << i;
    }
}

TEST(GatedAttention, InferenceKeepsNothingAndGivesTheSameOutput) {
  const AttentionShape s{2, 70, 4, 2, 32};
  std::mt19937 rng(9);
  Input<bf16> q(q_size(s), rng), k(kv_size(s), rng), v(kv_size(s), rng), gate(q_size(s), rng);
  std::vector<bf16> train_out(q_size(s)), infer_out(q_size(s));
  MemoryAccountant train_mem, infer_mem;
  AttentionSaved saved;
  gated_attention_forward(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), train_out.data(), &saved, train_mem);
  gated_attention_forward<bf16>(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), infer_out.data(), nullptr,
                                infer_mem);
  EXPECT_EQ(infer_mem.peak(MemCategory::Activations), 0u);
  for (size_t i = 0; i < train_out.size(); ++i) ASSERT_EQ(train_out[i].bits, infer_out[i].bits) << i;
}

// Forward + backward on shapes alone: the planning accountant sees exactly the real allocations.
TEST(GatedAttention, PlanningMakesTheRealAllocations) {
  const AttentionShape s{1, 130, 4, 2, 64};
  std::mt19937 rng(3);
  Input<float> q(q_size(s), rng), k(kv_size(s), rng), v(kv_size(s), rng), gate(q_size(s), rng),
      dout(q_size(s), rng);
  std::vector<float> out(q_size(s)), dq(q_size(s)), dk(kv_size(s)), dv(kv_size(s)), dgate(q_size(s));
  MemoryAccountant real(false), plan(true);
  {
    AttentionSaved saved;
    gated_attention_forward(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), out.data(), &saved, real);
    gated_attention_backward(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), saved, dout.x.data(), dq.data(),
                             dk.data(), dv.data(), dgate.data(), real);
  }
  {
    AttentionSaved saved;
    gated_attention_forward<float>(s, nullptr, nullptr, nullptr, nullptr, nullptr, &saved, plan);
    gated_attention_backward<float>(s, nullptr, nullptr, nullptr, nullptr, saved, nullptr, nullptr, nullptr, nullptr,
                                    nullptr, plan);
  }
  EXPECT_EQ(plan.allocations(), real.allocations());
  EXPECT_EQ(plan.peak_total(), real.peak_total());
  EXPECT_EQ(plan.peak(MemCategory::Activations), real.peak(MemCategory::Activations));
  EXPECT_EQ(plan.peak(MemCategory::Workspace), real.peak(MemCategory::Workspace));
  EXPECT_EQ(real.live_total(), 0u);
}

// No [T, T] buffer: the forward + backward peak grows linearly in T (x4 from 256 to 1024 tokens, less
// with the constant per-thread tiles); a per-head score matrix would make it ~x16.
TEST(GatedAttention, PeakMemoryIsLinearInSequenceLength) {
  auto peak = [](int64_t seq) {
    MemoryAccountant plan(true);
    const AttentionShape s{1, seq, 4, 1, 64};
    AttentionSaved saved;
    gated_attention_forward<bf16>(s, nullptr, nullptr, nullptr, nullptr, nullptr, &saved, plan);
    gated_attention_backward<bf16>(s, nullptr, nullptr, nullptr, nullptr, saved, nullptr, nullptr, nullptr,
                                   nullptr, nullptr, plan);
    return static_cast<double>(plan.peak_total());
  };
  const double ratio = peak(1024) / peak(256);
  EXPECT_LT(ratio, 5.0);
  EXPECT_GT(ratio, 1.0);
}

// Forward and backward give the same bits for 1 and 3 threads: the backward's dq partials (4 key-tile
// chunks for batch * kv_heads = 2) are added in chunk order whichever thread made them; with
// batch * kv_heads = 8 (one chunk) each task adds its own dq from a per-thread accumulator.
template <typename T>
void check_thread_count_independence(const AttentionShape& s) {
  std::mt19937 rng(11);
  Input<T> q(q_size(s), rng), k(kv_size(s), rng), v(kv_size(s), rng), gate(q_size(s), rng);
  Input<float> dout(q_size(s), rng);
  auto run = [&](int threads) {
    return test::with_threads(threads, [&] {
      MemoryAccountant mem;
      AttentionSaved saved;
      std::vector<T> out(q_size(s));
      gated_attention_forward(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), out.data(), &saved, mem);
      std::vector<float> grads(2 * q_size(s) + 2 * kv_size(s), 0.5f);
      float* dq = grads.data();
      float* dgate = dq + q_size(s);
      float* dk = dgate + q_size(s);
      float* dv = dk + kv_size(s);
      gated_attention_backward(s, q.x.data(), k.x.data(), v.x.data(), gate.x.data(), saved, dout.x.data(), dq, dk,
                               dv, dgate, mem);
      for (const T& o : out) grads.push_back(to_f32(o));
      return grads;
    });
  };
  const std::vector<float> one = run(1), three = run(3);
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(one[i]), std::bit_cast<uint32_t>(three[i])) << i;
}

TEST(GatedAttention, SameBitsForAnyThreadCount) {
  for (const AttentionShape& s : {AttentionShape{2, 300, 4, 1, 64}, AttentionShape{4, 130, 4, 2, 64}}) {
    check_thread_count_independence<float>(s);
    check_thread_count_independence<bf16>(s);
  }
}

TEST(GatedAttention, RejectsHeadCountsThatDoNotGroup) {
  MemoryAccountant plan(true);
  EXPECT_THROW(gated_attention_forward<float>({1, 4, 6, 4, 16}, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                              plan),
               std::invalid_argument);
}

}  // namespace
}  // namespace hs::kernels
