// AdamW: a two-step example worked by hand, PyTorch's torch.optim.AdamW numbers, the fast update vs the
// double-precision reference for fp32 and bf16 weights; sum_squares; clipping through grad_scale.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/adamw.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::randn;

// One weight, lr 0.1, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, w0 = 1, gradients 0.5 then -1.
//   step 1: m = 0.1*0.5 = 0.05, v = 0.05*0.25 = 0.0125, mhat = 0.05/0.1 = 0.5, vhat = 0.0125/0.05 = 0.25
//           w = 1 - 0.1*(0.5/(0.5 + 1e-8) + 0.1*1) = 0.99 - 0.1*0.5/0.50000001
//   step 2: m = 0.9*0.05 - 0.1 = -0.055, v = 0.95*0.0125 + 0.05*1 = 0.061875,
//           mhat = -0.055/0.19, vhat = 0.061875/0.0975, w = w1*0.99 + 0.1*(0.055/0.19)/(sqrt(vhat) + 1e-8)
// The kernel runs in fp32: a handful of roundings of O(1) values, so 1e-6 relative.
TEST(AdamW, HandComputedTwoSteps) {
  const AdamWParams p{0.1f, 0.9f, 0.95f, 1e-8f, 0.1f};
  float w = 1.0f, m = 0.0f, v = 0.0f;
  const float g1 = 0.5f, g2 = -1.0f;
  adamw_update(&w, &g1, &m, &v, 1, p, 1);
  const double w1 = 0.99 - 0.1 * 0.5 / 0.50000001;
  EXPECT_NEAR(m, 0.05, 1e-6 * 0.05);
  EXPECT_NEAR(v, 0.0125, 1e-6 * 0.0125);
  EXPECT_NEAR(w, w1, 1e-6);
  adamw_update(&w, &g2, &m, &v, 1, p, 2);
  const double w2 = w1 * 0.99 + 0.1 * (0.055 / 0.19) / (std::sqrt(0.061875 / 0.0975) + 1e-8);
  EXPECT_NEAR(m, -0.055, 1e-6 * 0.055);
  EXPECT_NEAR(v, 0.061875, 1e-6 * 0.061875);
  EXPECT_NEAR(w, w2, 1e-6);
}

// Constants printed once by torch 2.15 (CPU, fp32):
//   w = torch.nn.Parameter(torch.tensor([0.5, -1.25, 2.0, 0.0, 3.0e-3]))
//   opt = torch.optim.AdamW([w], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
//   for g in ([0.1, -0.3, 2.5, 1e-4, -7.0], [-0.2, -0.1, 1.5, 0.0, 3.0]): w.grad = torch.tensor(g); opt.step()
// printing w, exp_avg and exp_avg_sq with '%.9g' after each step. Element 3 (g = 1e-4 from w = 0) is
// dominated by eps, element 4 by the decay. The kernel follows torch's order of operations; what remains
// is that torch forms 1 - beta and 1 - lr*wd in double from Python floats while the kernel's
// hyper-parameters are fp32 (1 - 0.95f differs from 0.05f by 2.4e-7 relative). Measured agreement is
// 1.1e-7 relative (one ulp) or better; 5e-7 relative allows a few ulps.
TEST(AdamW, MatchesTorchAdamW) {
  const AdamWParams p{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
  std::vector<float> w = {0.5f, -1.25f, 2.0f, 0.0f, 3.0e-3f}, m(5, 0.0f), v(5, 0.0f);
  const std::vector<std::vector<float>> grads = {{0.1f, -0.3f, 2.5f, 1e-4f, -7.0f}, {-0.2f, -0.1f, 1.5f, 0.0f, 3.0f}};
  const std::vector<std::vector<double>> w_torch = {
      {0.489500016, -1.23874998, 1.98800004, -0.00999899954, 0.0129969995},
      {0.49264425, -1.22871161, 1.97637999, -0.0167745054, 0.0162381381}};
  const std::vector<std::vector<double>> m_torch = {
      {0.0100000007, -0.0300000012, 0.25, 9.99999975e-06, -0.699999988},
      {-0.0110000009, -0.0370000005, 0.375, 8.99999941e-06, -0.329999983}};
  const std::vector<std::vector<double>> v_torch = {
      {0.000500000024, 0.00450000027, 0.3125, 4.99999986e-10, 2.45000005},
      {0.00247500022, 0.00477500027, 0.409375012, 4.74999984e-10, 2.77750015}};
  for (int step = 1; step <= 2; ++step) {
    adamw_update(w.data(), grads[step - 1].data(), m.data(), v.data(), 5, p, step);
    for (int i = 0; i < 5; ++i) {
      EXPECT_NEAR(w[i], w_torch[step - 1][i], 5e-7 * std::abs(w_torch[step - 1][i])) << "step " << step << " w" << i;
      EXPECT_NEAR(m[i], m_torch[step - 1][i], 5e-7 * std::abs(m_torch[step - 1][i])) << "step " << step << " m" << i;
      EXPECT_NEAR(v[i], v_torch[step - 1][i], 5e-7 * std::abs(v_torch[step - 1][i])) << "step " << step << " v" << i;
    }
  }
}

// Three steps on 1000 weights against the reference (double math, same fp32 hyper-parameters).
// Moments are fp32 in both: v sums positive terms, 1e-6 relative; m can cancel far below its terms
// (g ~ N(0, 0.1^2): terms < 0.05, each rounded by < 3e-9), so 1e-8 absolute. fp32 weights: w ~ 1 with
// updates ~lr, 1e-6 absolute. bf16 weights: both sides round nearly equal values to bf16, so they may
// differ by one bf16 ulp (2^-7 relative); each step restarts both from the fast kernel's weights so
// such a difference does not compound.
template <typename TW> void matches_reference() {
  const int64_t n = 1000;
  const AdamWParams p{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
  std::vector<TW> w(n), w_ref(n);
  const auto w0 = randn(n, 1);
  for (int64_t i = 0; i < n; ++i) w[i] = w_ref[i] = from_f32<TW>(w0[i]);
  std::vector<float> m(n, 0.0f), v(n, 0.0f), m_ref(n, 0.0f), v_ref(n, 0.0f);
  for (int64_t step = 1; step <= 3; ++step) {
    const auto g = randn(n, 10 + static_cast<uint32_t>(step), 0.1f);
    adamw_update(w.data(), g.data(), m.data(), v.data(), n, p, step);
    reference::adamw_update(w_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, p, step);
    for (int64_t i = 0; i < n; ++i) {
      const double a = to_f32(w[i]), b = to_f32(w_ref[i]);
      const double tol = std::is_same_v<TW, bf16> ? std::abs(b) / 128 + 1e-6 : 1e-6;
      ASSERT_NEAR(a, b, tol) << "step " << step << " i " << i;
      ASSERT_NEAR(m[i], m_ref[i], 1e-8) << "step " << step << " i " << i;
      ASSERT_NEAR(v[i], v_ref[i], 1e-6 * std::abs(v_ref[i]) + 1e-15) << "step " << step << " i " << i;
    }
    w_ref = w;
  }
}

TEST(AdamW, MatchesReferenceF32) { matches_reference<float>(); }
TEST(AdamW, MatchesReferenceBf16) { matches_reference<bf16>(); }

TEST(AdamW, RejectsStepZero) {
  float w = 1.0f, g = 1.0f, m = 0.0f, v = 0.0f;
  EXPECT_THROW(adamw_update(&w, &g, &m, &v, 1, AdamWParams{}, 0), std::invalid_argument);
}

// Summed in double either way; the block sums only reorder ~1e5 additions of doubles: 1e-12 relative.
// The same bits for 1 and 3 threads (n spans several blocks).
TEST(AdamW, SumSquaresMatchesReferenceAndIsThreadCountIndependent) {
  const int64_t n = 100003;
  const auto x = randn(n, 20);
  const double want = reference::sum_squares(x.data(), n);
  const double s1 = test::with_threads(1, [&] { return sum_squares(x.data(), n); });
  const double s3 = test::with_threads(3, [&] { return sum_squares(x.data(), n); });
  EXPECT_NEAR(s1, want, 1e-12 * want);
  EXPECT_EQ(std::memcmp(&s1, &s3, sizeof(double)), 0);
  EXPECT_EQ(sum_squares(x.data(), 0), 0.0);
}

// Clipping folded into the update: grad_scale s gives the same bits as scaling the gradient first.
TEST(AdamW, GradScaleEqualsScalingTheGradientFirst) {
  const int64_t n = 4099;
  const auto g = randn(n, 21);
  auto w1 = randn(n, 22), w2 = w1;
  std::vector<float> m1(n, 0.f), v1(n, 0.f), m2(n, 0.f), v2(n, 0.f), gs(g);
  const float s = 0.3712f;
  for (auto& x : gs) x *= s;
  AdamWParams p;
  p.weight_decay = 0.1f;
  adamw_update(w2.data(), gs.data(), m2.data(), v2.data(), n, p, 1);
  p.grad_scale = s;
  adamw_update(w1.data(), g.data(), m1.data(), v1.data(), n, p, 1);
  EXPECT_EQ(std::memcmp(w1.data(), w2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(m1.data(), m2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(v1.data(), v2.data(), n * sizeof(float)), 0);
}

}  // namespace
}  // namespace hs::kernels

namespace hs::kernels {

}  // namespace hs::kernels

namespace hs::kernels {

// The one-pass optimizer kernels give the same bits as one call per tensor: the update as adamw_update's, with every
// gradient left at zero; the sum of squares through the same blocks added in the same order (1 and 3 threads). Sizes
// span one piece, several and a ragged end; fp32 and bf16 weights, per-tensor weight decay.
// bf16 moments: the step is the fp32 step from the moments widened to fp32 (the same weights, bit for bit, since the
// weight update uses the new moments before rounding), and the stored moments are that step's fp32 moments rounded to
// nearest even. Truncation instead of rounding, or a weight update from the rounded moments, differs somewhere in
// 40k elements.
TEST(AdamW, Bf16MomentsAreTheFp32StepRoundedToNearestEven) {
  const int64_t n = 40000;
  std::vector<float> w32 = randn(n, 1), g32 = randn(n, 2), m32 = randn(n, 3, 0.01f), v32(static_cast<size_t>(n));
  std::vector<float> wb = w32, gb = g32;
  std::vector<bf16> mb(static_cast<size_t>(n)), vb(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    v32[k] = 1e-4f * (1.0f + 0.5f * std::sin(float(i)));
    mb[k] = from_f32<bf16>(m32[k]);
    vb[k] = from_f32<bf16>(v32[k]);
    m32[k] = to_f32(mb[k]);  // the fp32 run starts from the same (representable) moments
    v32[k] = to_f32(vb[k]);
  }
  AdamWParams p;
  AdamWTensor a, b;
  a.w = w32.data(), a.grad = g32.data(), a.m = m32.data(), a.v = v32.data(), a.n = n, a.weight_decay = 0.1f;
  b.w = wb.data(), b.grad = gb.data(), b.m_bf16 = mb.data(), b.v_bf16 = vb.data(), b.n = n, b.weight_decay = 0.1f;
  adamw_update_clear_all({a}, p, 4);
  adamw_update_clear_all({b}, p, 4);
  EXPECT_EQ(0, std::memcmp(w32.data(), wb.data(), static_cast<size_t>(n) * sizeof(float)));
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    ASSERT_EQ(mb[k].bits, bf16::from_float(m32[k])) << i;
    ASSERT_EQ(vb[k].bits, bf16::from_float(v32[k])) << i;
  }
  AdamWTensor mixed = b;
  mixed.m = m32.data();
  EXPECT_THROW(adamw_update_clear_all({mixed}, p, 5), std::invalid_argument);
}

TEST(AdamW, OnePassOverManyTensorsEqualsOneCallPerTensor) {
  const std::vector<int64_t> sizes = {1, 5000, 40000, 100003, 16384};
  std::vector<std::vector<float>> w1, w2, g1, g2, m1, m2, v1, v2;
  std::vector<std::vector<bf16>> wb1, wb2;
  std::vector<AdamWTensor> all;
  AdamWParams p;
  p.grad_scale = 0.7f;
  for (size_t t = 0; t < sizes.size(); ++t) {
    const int64_t n = sizes[t];
    w1.push_back(randn(n, 70 + static_cast<uint32_t>(t)));
    g1.push_back(randn(n, 80 + static_cast<uint32_t>(t)));
    m1.push_back(randn(n, 90 + static_cast<uint32_t>(t), 0.01f));
    v1.emplace_back(static_cast<size_t>(n), 1e-4f);
    wb1.emplace_back(w1.back().begin(), w1.back().end());
  }
  w2 = w1, g2 = g1, m2 = m1, v2 = v1, wb2 = wb1;
  const int64_t step = 3;
  for (size_t t = 0; t < sizes.size(); ++t) {
    p.weight_decay = t % 2 ? 0.1f : 0.0f;
    if (t == 2) adamw_update(wb1[t].data(), g1[t].data(), m1[t].data(), v1[t].data(), sizes[t], p, step);
    else adamw_update(w1[t].data(), g1[t].data(), m1[t].data(), v1[t].data(), sizes[t], p, step);
    AdamWTensor a;
    if (t == 2) a.w_bf16 = wb2[t].data();
    else a.w = w2[t].data();
    a.grad = g2[t].data();
    a.m = m2[t].data();
    a.v = v2[t].data();
    a.n = sizes[t];
    a.weight_decay = p.weight_decay;
    all.push_back(a);
  }
  p.weight_decay = 0.5f;  // ignored by the one-pass kernel
  adamw_update_clear_all(all, p, step);
  for (size_t t = 0; t < sizes.size(); ++t) {
    const size_t bytes = static_cast<size_t>(sizes[t]) * sizeof(float);
    EXPECT_EQ(0, std::memcmp(w1[t].data(), w2[t].data(), bytes)) << t;
    EXPECT_EQ(0, std::memcmp(wb1[t].data(), wb2[t].data(), bytes / 2)) << t;
    EXPECT_EQ(0, std::memcmp(m1[t].data(), m2[t].data(), bytes)) << t;
    EXPECT_EQ(0, std::memcmp(v1[t].data(), v2[t].data(), bytes)) << t;
    for (int64_t i = 0; i < sizes[t]; ++i) ASSERT_EQ(g2[t][static_cast<size_t>(i)], 0.0f) << t << " " << i;
  }
  AdamWTensor both;
  both.w = w2[0].data();
  both.w_bf16 = wb2[0].data();
  EXPECT_THROW(adamw_update_clear_all({both}, p, step), std::invalid_argument);

  std::vector<std::pair<const float*, int64_t>> arrays;
  double loop = 0.0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    arrays.emplace_back(m1[t].data(), sizes[t]);
    loop += sum_squares(m1[t].data(), sizes[t]);
  }
  const double one = test::with_threads(1, [&] { return sum_squares_all(arrays); });
  const double three = test::with_threads(3, [&] { return sum_squares_all(arrays); });
  EXPECT_EQ(std::memcmp(&one, &loop, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&three, &loop, sizeof(double)), 0);
}

}  // namespace hs::kernels

namespace hs::kernels {
namespace {

// The vectorised kernel against the scalar loop it replaced (reference::adamw_update_clear_all_loop, kept verbatim),
// bit for bit: every instruction-set path this CPU has, fp32 and bf16 weights, fp32 and bf16 moments, a clip scale,
// weight decay on some tensors and not others, sizes that are not multiples of 8 or 16 (the scalar tails) and a set
// of extreme values (zeros, denormal and huge gradients, moments at the edge of bf16 rounding, a NaN gradient), at
// 1 and 3 threads. Where the build has no FMA the old loop rounds each product separately, so it is not a reference.
#if defined(__FMA__)
TEST(AdamW, VectorPathsMatchThePreviousLoopBitForBit) {
  const std::vector<int64_t> sizes = {1, 7, 15, 17, 64, 1000, 40001, 16384};
  const float specials[] = {0.0f, -0.0f, 1e-40f, -3e-39f, 1e30f, -2.5e-20f, 65504.0f, std::nanf("")};
  for (int isa_i = 0; isa_i <= 2; ++isa_i) {
    const auto isa = static_cast<cpu::Level>(isa_i);
    if (!cpu::allows(isa)) continue;
    for (int mode = 0; mode < 4; ++mode) {  // bit 0: bf16 weights, bit 1: bf16 moments
      for (int threads : {1, 3}) {
        struct Set {
          std::vector<std::vector<float>> w, g, m, v;
          std::vector<std::vector<bf16>> wb, mb, vb;
          std::vector<AdamWTensor> t;
        } a, b;
        for (size_t t = 0; t < sizes.size(); ++t) {
          const int64_t n = sizes[t];
          const auto seed = static_cast<uint32_t>(100 * t + 10 * static_cast<size_t>(mode) + 1);
          std::vector<float> w = randn(n, seed), g = randn(n, seed + 1), m = randn(n, seed + 2, 0.01f),
                             v = randn(n, seed + 3, 1e-4f);
          for (float& x : v) x = x * x;
          if (n > 16)
            for (size_t i = 0; i < std::size(specials); ++i) {
              g[3 * i % static_cast<size_t>(n)] = specials[i];
              if (!std::isnan(specials[i])) m[(3 * i + 1) % static_cast<size_t>(n)] = specials[i] * 1e-3f;
            }
          a.w.push_back(w), a.g.push_back(g), a.m.push_back(m), a.v.push_back(v);
          a.wb.emplace_back(w.begin(), w.end());
          for (auto* dst : {&a.mb, &a.vb}) dst->emplace_back();
          for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
            a.wb.back()[i] = from_f32<bf16>(w[i]);
            a.mb.back().push_back(from_f32<bf16>(m[i]));
            a.vb.back().push_back(from_f32<bf16>(v[i]));
          }
        }
        b = a;
        for (Set* s : {&a, &b}) {
          s->t.clear();
          for (size_t t = 0; t < sizes.size(); ++t) {
            AdamWTensor x;
            if (mode & 1) x.w_bf16 = s->wb[t].data();
            else x.w = s->w[t].data();
            if (mode & 2) x.m_bf16 = s->mb[t].data(), x.v_bf16 = s->vb[t].data();
            else x.m = s->m[t].data(), x.v = s->v[t].data();
            x.grad = s->g[t].data();
            x.n = sizes[t];
            x.weight_decay = t % 3 ? 0.1f : 0.0f;
            s->t.push_back(x);
          }
        }
        AdamWParams p;
        p.lr = 3e-3f;
        p.grad_scale = 0.37f;
        reference::adamw_update_clear_all_loop(a.t, p, 7);
        {
          cpu::ScopedLevel forced(isa);
          test::with_threads(threads, [&] {
            adamw_update_clear_all(b.t, p, 7);
            return 0;
          });
        }
        for (size_t t = 0; t < sizes.size(); ++t) {
          const auto n = static_cast<size_t>(sizes[t]);
          const std::string where = std::string(cpu::level_name(isa)) + " mode " + std::to_string(mode) + " threads " +
                                    std::to_string(threads) + " tensor " + std::to_string(t);
          EXPECT_EQ(0, std::memcmp(a.g[t].data(), b.g[t].data(), n * 4)) << where;  // both zeroed
          if (mode & 1) EXPECT_EQ(0, std::memcmp(a.wb[t].data(), b.wb[t].data(), n * 2)) << where;
          else EXPECT_EQ(0, std::memcmp(a.w[t].data(), b.w[t].data(), n * 4)) << where;
          if (mode & 2) {
            EXPECT_EQ(0, std::memcmp(a.mb[t].data(), b.mb[t].data(), n * 2)) << where;
            EXPECT_EQ(0, std::memcmp(a.vb[t].data(), b.vb[t].data(), n * 2)) << where;
          } else {
            EXPECT_EQ(0, std::memcmp(a.m[t].data(), b.m[t].data(), n * 4)) << where;
            EXPECT_EQ(0, std::memcmp(a.v[t].data(), b.v[t].data(), n * 4)) << where;
          }
        }
      }
    }
  }
}
#endif

// adamw_update (one tensor, gradient kept) gives the bits of the one-pass kernel on every path.
TEST(AdamW, SingleTensorUpdateIsTheSameOnEveryPath) {
  const int64_t n = 10007;
  const std::vector<float> w0 = randn(n, 5), g = randn(n, 6), m0 = randn(n, 7, 0.01f);
  std::vector<float> v0 = randn(n, 8, 1e-2f);
  for (float& x : v0) x *= x;
  AdamWParams p;
  p.weight_decay = 0.1f;
  std::vector<float> w_ref = w0, m_ref = m0, v_ref = v0;
  {
    cpu::ScopedLevel forced(cpu::Level::Scalar);
    adamw_update(w_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, p, 2);
  }
  for (int isa_i = 1; isa_i <= 2; ++isa_i) {
    const auto isa = static_cast<cpu::Level>(isa_i);
    if (!cpu::allows(isa)) continue;
    std::vector<float> w = w0, m = m0, v = v0;
    cpu::ScopedLevel forced(isa);
    adamw_update(w.data(), g.data(), m.data(), v.data(), n, p, 2);
    EXPECT_EQ(0, std::memcmp(w.data(), w_ref.data(), static_cast<size_t>(n) * 4)) << cpu::level_name(isa);
    EXPECT_EQ(0, std::memcmp(m.data(), m_ref.data(), static_cast<size_t>(n) * 4)) << cpu::level_name(isa);
    EXPECT_EQ(0, std::memcmp(v.data(), v_ref.data(), static_cast<size_t>(n) * 4)) << cpu::level_name(isa);
  }
}

}  // namespace
}  // namespace hs::kernels
