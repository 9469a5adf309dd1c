// The nested block scan against a plain layer-by-layer execution, the remat policies against each other, and the
// planning mode against the measured run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/embedding.h"
#include "kernels/lm_head.h"
#include "kernels/matmul.h"
#include "kernels/moe.h"
#include "kernels/norms.h"
#include "model/layer.h"
#include "model/linear.h"
#include "train/schedule.h"

namespace hs::train {
namespace {

using model::LayerWeights;
using model::ModelConfig;
using model::ParamSet;

ModelConfig tiny(int64_t L, model::Family f = model::Family::Qwen3Next) {
  ModelConfig c = model::preset("tiny");
  c.layers = L;
  c.family = f;
  return c;
}

struct Data {
  std::vector<int32_t> in, tg;
  Batch batch(int64_t B, int64_t S) const { return {in.data(), tg.data(), B, S}; }
};
Data random_data(int64_t B, int64_t S, int64_t V, uint32_t seed) {
  std::mt19937 rng(seed);
  Data d;
  for (int64_t i = 0; i < B * S; ++i) {
    d.in.push_back(static_cast<int32_t>(rng() % V));
    d.tg.push_back(i % 13 == 5 ? -1 : static_cast<int32_t>(rng() % V));  // some ignored targets
  }
  return d;
}

// Plain execution: HF layer order, the layer type from the global index, the weights found by index arithmetic
// written independently of params.cpp (block = i / cycle, position = i % cycle).
LayerWeights plain_layer(const ParamSet& ps, int64_t i) {
  const ModelConfig& c = ps.config();
  const bool full = (i + 1) % c.cycle == 0;
  const int64_t b = i / c.cycle, pos = i % c.cycle;
  std::string prefix = b >= c.blocks() ? "remainder." : (full ? "global." : "local.");
  LayerWeights w{full ? model::LayerKind::FullAttention : model::LayerKind::LinearAttention, {}};
  for (const auto& spec : model::layer_specs(c, w.kind)) {
    const model::StackedParam* sp = ps.find(prefix + spec.name);
    EXPECT_NE(sp, nullptr) << prefix + spec.name;
    TensorView v = sp->tensor.view();
    if (prefix == "remainder.") v = v[pos];
    else if (full) v = v[b];
    else v = v[b][pos];
    w.t.push_back(v);
  }
  return w;
}

// fp32 plain forward + backward; returns the loss and fills grads (zeroed ParamSet).
double plain_forward_backward(const ParamSet& ps, const Batch& bt, ParamSet& grads) {
  const ModelConfig& c = ps.config();
  MemoryAccountant mem;
  const int64_t N = bt.batch * bt.seq, H = c.hidden;
  std::vector<int32_t> pos(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(i % bt.seq);
  model::LayerContext ctx{c, mem, bt.batch, bt.seq, pos.data()};
  std::vector<std::vector<float>> hs(static_cast<size_t>(c.layers + 1), std::vector<float>(static_cast<size_t>(N * H)));
  kernels::embedding_forward(bt.inputs, N, ps.global(model::g::kEmbed).as<float>(), c.vocab, H, hs[0].data());
  std::vector<std::unique_ptr<model::LayerSaved<float>>> saved;
  std::vector<kernels::RouterStats> stats;
  for (int64_t i = 0; i < c.layers; ++i) {
    saved.push_back(std::make_unique<model::LayerSaved<float>>());
    stats.push_back(model::layer_forward<float>(ctx, plain_layer(ps, i), hs[size_t(i)].data(), hs[size_t(i + 1)].data(),
                                                saved.back().get()));
  }
  std::vector<float> xf(static_cast<size_t>(N * H)), rstd(static_cast<size_t>(N)), dxf(static_cast<size_t>(N * H), 0.f),
      dh(static_cast<size_t>(N * H), 0.f), dprev(static_cast<size_t>(N * H));
  const float* wn = ps.global(model::g::kFinalNorm).as<float>();
  kernels::rmsnorm_forward(hs.back().data(), wn, xf.data(), rstd.data(), N, H, float(c.rms_eps));
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) count += bt.targets[i] >= 0;
  kernels::XentResult x = kernels::lm_head_xent(xf.data(), ps.global(model::g::kLmHead).as<float>(), bt.targets, N, H,
                                                c.vocab, 1.0f / float(count), dxf.data(),
                                                grads.global(model::g::kLmHead).as<float>(), mem);
  kernels::rmsnorm_backward(hs.back().data(), wn, rstd.data(), dxf.data(), dh.data(),
                            grads.global(model::g::kFinalNorm).as<float>(), N, H);
  std::vector<float> dprob;
  double aux = kernels::load_balance_loss(stats, c.experts, &dprob);
  for (float& v : dprob) v *= float(c.router_aux_coef);
  for (int64_t i = c.layers; i-- > 0;) {
    model::layer_backward<float>(ctx, plain_layer(ps, i), plain_layer(grads, i), hs[size_t(i)].data(), *saved[size_t(i)],
                                 dh.data(), dprev.data(), dprob.data());
    std::swap(dh, dprev);
  }
  kernels::embedding_backward(bt.inputs, N, dh.data(), c.vocab, H, grads.global(model::g::kEmbed).as<float>());
  return x.loss_sum / double(x.count) + c.router_aux_coef * aux;
}

double max_rel_diff(const ParamSet& a, const ParamSet& b, std::string* where) {
  double worst = 0;
  for (size_t i = 0; i < a.all().size(); ++i) {
    const Tensor& x = a.all()[i].tensor;
    const Tensor& y = b.all()[i].tensor;
    double scale = 1e-12, diff = 0;
    for (int64_t j = 0; j < x.numel(); ++j) {
      scale = std::max(scale, double(std::fabs(y.as<float>()[j])));
      diff = std::max(diff, double(std::fabs(x.as<float>()[j] - y.as<float>()[j])));
    }
    if (diff / scale > worst) {
      worst = diff / scale;
      if (where) *where = a.all()[i].name;
    }
  }
  return worst;
}

class ScanVsPlain : public ::testing::TestWithParam<std::tuple<int, model::Family>> {};

// The nested scan and the plain loop run the same kernels in the same order, so in fp32 they must agree to the
// last bit; a mis-stacked layer, a wrong layer type or a dropped remainder layer changes results at O(1e-2).
TEST_P(ScanVsPlain, SameLossAndGradients) {
  auto [L, fam] = GetParam();
  ModelConfig c = tiny(L, fam);
  MemoryAccountant mem;
  ParamSet ps(c, DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 7);
  Data d = random_data(2, 24, c.vocab, 3);
  std::unique_ptr<ParamSet> g;
  StepResult r = forward_backward(ps, d.batch(2, 24), {RematPolicy::Sublayer, DType::F32}, mem, &g);
  ParamSet gp(c, DType::F32, mem, MemCategory::Gradients, true);
  double loss = plain_forward_backward(ps, d.batch(2, 24), gp);
  EXPECT_EQ(r.loss, loss);
  std::string where;
  EXPECT_EQ(max_rel_diff(*g, gp, &where), 0.0) << where;
}

INSTANTIATE_TEST_SUITE_P(Layers, ScanVsPlain,
                         ::testing::Combine(::testing::Values(4, 5, 6, 7, 8),
                                            ::testing::Values(model::Family::Qwen3Next, model::Family::Qwen3_5)),
                         [](const auto& param_info) {
                           std::string name = "L";
                           name.append(std::to_string(std::get<0>(param_info.param)));
                           name.append(std::get<1>(param_info.param) == model::Family::Qwen3Next ? "_qwen3next"
                                                                                                 : "_qwen35");
                           return name;
                         });

class RematPolicies : public ::testing::TestWithParam<std::tuple<int, DType, DType>> {};

// All policies run identical arithmetic (recompute is deterministic), so loss and gradients are bit-identical.
TEST_P(RematPolicies, IdenticalLossAndGradients) {
  auto [L, wdt, cdt] = GetParam();
  ModelConfig c = tiny(L);
  MemoryAccountant mem;
  ParamSet ps(c, wdt, mem, MemCategory::Parameters, false);
  model::init_params(ps, 11);
  Data d = random_data(2, 70, c.vocab, 5);
  std::unique_ptr<ParamSet> g_none, g_block, g_sub;
  StepResult a = forward_backward(ps, d.batch(2, 70), {RematPolicy::None, cdt}, mem, &g_none);
  StepResult b = forward_backward(ps, d.batch(2, 70), {RematPolicy::Block, cdt}, mem, &g_block);
  StepResult s = forward_backward(ps, d.batch(2, 70), {RematPolicy::Sublayer, cdt}, mem, &g_sub);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.loss, s.loss);
  EXPECT_GT(a.aux, 0.0);
  std::string where;
  EXPECT_EQ(max_rel_diff(*g_none, *g_block, &where), 0.0) << where;
  EXPECT_EQ(max_rel_diff(*g_none, *g_sub, &where), 0.0) << where;
  // forward_only agrees with the training forward.
  StepResult f = forward_only(ps, d.batch(2, 70), cdt, mem);
  EXPECT_EQ(f.loss, a.loss);
}

INSTANTIATE_TEST_SUITE_P(Policies, RematPolicies,
                         ::testing::Combine(::testing::Values(4, 7), ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(DType::F32, DType::BF16)),
                         [](const auto& param_info) {
                           std::string name = "L";
                           name.append(std::to_string(std::get<0>(param_info.param)));
                           name.append("_weights_").append(dtype_name(std::get<1>(param_info.param)));
                           name.append("_compute_").append(dtype_name(std::get<2>(param_info.param)));
                           return name;
                         });

// The plan is the real schedule over shapes: identical peak and per-category bytes.
// A gradient set passed in is added to (gradient accumulation; the trainer keeps one set that the optimizer
// zeroes): two steps into one set give twice one step's gradients. Each element's contributions are summed in
// another order the second time (onto the first step's value instead of onto zero), so they agree to fp32
// rounding over a handful of additions: 1e-5 relative to each tensor's scale; a dropped or doubled
// accumulation gives O(1) differences.
TEST(Gradients, AccumulateIntoAGivenSet) {
  ModelConfig c = tiny(5, model::Family::Qwen3Next);
  MemoryAccountant mem;
  ParamSet ps(c, DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 11);
  Data d = random_data(2, 30, c.vocab, 12);
  std::unique_ptr<ParamSet> once, twice;
  forward_backward(ps, d.batch(2, 30), {RematPolicy::Sublayer, DType::F32}, mem, &once);
  forward_backward(ps, d.batch(2, 30), {RematPolicy::Sublayer, DType::F32}, mem, &twice);
  const ParamSet* first = twice.get();
  forward_backward(ps, d.batch(2, 30), {RematPolicy::Sublayer, DType::F32}, mem, &twice);
  EXPECT_EQ(twice.get(), first) << "the given set was replaced instead of accumulated into";
  for (auto& p : once->all())
    for (int64_t i = 0; i < p.tensor.numel(); ++i) p.tensor.as<float>()[i] *= 2.0f;
  std::string where;
  EXPECT_LT(max_rel_diff(*twice, *once, &where), 1e-5) << where;
}

TEST(PlanningMode, PeakEqualsMeasuredForEveryPolicy) {
  for (RematPolicy pol : {RematPolicy::None, RematPolicy::Block, RematPolicy::Sublayer})
    for (DType wdt : {DType::F32, DType::BF16}) {
      ModelConfig c = tiny(6);
      Data d = random_data(2, 40, c.vocab, 9);
      MemoryAccountant real(false), plan(true);
      ParamSet pr(c, wdt, real, MemCategory::Parameters, false), pp(c, wdt, plan, MemCategory::Parameters, false);
      model::init_params(pr, 1);
      std::unique_ptr<ParamSet> g1, g2;
      real.reset_peak();
      plan.reset_peak();
      forward_backward(pr, d.batch(2, 40), {pol, DType::BF16}, real, &g1);
      forward_backward(pp, d.batch(2, 40), {pol, DType::BF16}, plan, &g2);
      MemorySnapshot a = real.at_peak(), b = plan.at_peak();
      EXPECT_EQ(a.bytes, b.bytes) << remat_name(pol);
    }
}

// Weights packed into oneDNN's layout (StepOptions::pack_weights) change no bit of the loss or the gradients against
// plain weights, for both policies that differ in what they keep, both weight and both compute dtypes (the same
// kernel reads the same numbers), are read by products when on and never when off, and the plan still equals the
// measured run with them, category by category.
TEST(PackedWeights, SameBitsAsPlainWeightsAndPlanEqualsMeasured) {
  ModelConfig c = tiny(4);
  Data d = random_data(2, 40, c.vocab, 21);
  if (kernels::packed_weight_bytes(DType::BF16, c.conv_dim(), c.hidden, kernels::WeightUse::Forward) == 0)
    GTEST_SKIP() << "oneDNN reads plain weights on this CPU";
  for (RematPolicy pol : {RematPolicy::None, RematPolicy::Sublayer})
    for (DType wdt : {DType::F32, DType::BF16})
      for (DType cdt : {DType::F32, DType::BF16}) {
        MemoryAccountant mem;
        ParamSet ps(c, wdt, mem, MemCategory::Parameters, false);
        model::init_params(ps, 3);
        std::unique_ptr<ParamSet> g_plain, g_packed, g_plan;
        StepOptions plain{pol, cdt}, packed{pol, cdt};
        packed.pack_weights = true;
        const int64_t n = kernels::matmul_packed_products();
        StepResult a = forward_backward(ps, d.batch(2, 40), plain, mem, &g_plain);
        EXPECT_EQ(kernels::matmul_packed_products(), n);
        MemoryAccountant real(false), plan(true);  // accountants of their own: equal peaks
        ParamSet pr(c, wdt, real, MemCategory::Parameters, false), pp(c, wdt, plan, MemCategory::Parameters, false);
        model::init_params(pr, 3);
        real.reset_peak();
        plan.reset_peak();
        StepResult b = forward_backward(pr, d.batch(2, 40), packed, real, &g_packed);
        forward_backward(pp, d.batch(2, 40), packed, plan, &g_plan);
        EXPECT_GT(kernels::matmul_packed_products(), n);
        EXPECT_EQ(a.loss, b.loss);
        std::string where;
        EXPECT_EQ(max_rel_diff(*g_plain, *g_packed, &where), 0.0) << where;
        EXPECT_EQ(real.at_peak().bytes, plan.at_peak().bytes) << remat_name(pol);
      }
}

// Only remat none keeps the delta rule's per-chunk states for the backward (LayerContext::keep_recomputables): its
// peak holds them for every linear-attention layer, while block and sublayer never allocate them (their backwards
// recompute the states). Every buffer live at the peak is listed (largest_tracked large), found by tag.
TEST(RematMemory, OnlyNoneKeepsTheDeltaRuleChunkStates) {
  ModelConfig c = tiny(5);
  const int64_t linear_layers = 4;  // L = 5: one block of 3 linear + 1 full, plus a linear remainder
  for (RematPolicy pol : {RematPolicy::None, RematPolicy::Block, RematPolicy::Sublayer}) {
    MemoryAccountant plan(true, 100000);
    ParamSet ps(c, DType::F32, plan, MemCategory::Parameters, false);
    std::vector<int32_t> ids(2 * 128, 0);
    std::unique_ptr<ParamSet> g;
    forward_backward(ps, {ids.data(), ids.data(), 2, 128}, {pol, DType::BF16}, plan, &g);
    int64_t kept = 0;
    for (const LiveBuffer& b : plan.at_peak().largest) kept += b.tag == "delta_rule.states";
    EXPECT_EQ(kept, pol == RematPolicy::None ? linear_layers : 0) << remat_name(pol);
  }
}

// Memory ordering on a sequence long enough for activations to dominate: none > block > sublayer.
TEST(RematMemory, SublayerKeepsLessThanBlockKeepsLessThanNone) {
  ModelConfig c = tiny(8);
  size_t temp[3];
  int k = 0;
  for (RematPolicy pol : {RematPolicy::None, RematPolicy::Block, RematPolicy::Sublayer}) {
    MemoryAccountant plan(true);
    ParamSet ps(c, DType::F32, plan, MemCategory::Parameters, false);
    std::vector<int32_t> ids(4 * 256, 1);
    plan.reset_peak();
    std::unique_ptr<ParamSet> g;
    forward_backward(ps, {ids.data(), ids.data(), 4, 256}, {pol, DType::BF16}, plan, &g);
    temp[k++] = plan.at_peak().temp();
  }
  EXPECT_GT(temp[0], temp[1]);
  EXPECT_GT(temp[1], temp[2]);
}

// Whole-model gradient against central finite differences (double-precision accumulation of fp32 losses) on a
// dense config, where the loss is smooth: checks the plumbing between kernels (splits, residuals, norms).
TEST(ModelGradient, MatchesFiniteDifferences) {
  ModelConfig c = tiny(5);
  c.experts = 0;
  c.intermediate = 48;
  MemoryAccountant mem;
  ParamSet ps(c, DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 3);
  // Give every parameter some spread so no path is trivially zero.
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.f, 0.05f);
  for (auto& p : ps.all())
    if (!p.spec.is_matrix)
      for (int64_t i = 0; i < p.tensor.numel(); ++i) p.tensor.as<float>()[i] += nd(rng);
  Data d = random_data(1, 20, c.vocab, 8);
  std::unique_ptr<ParamSet> g;
  forward_backward(ps, d.batch(1, 20), {RematPolicy::Sublayer, DType::F32}, mem, &g);
  int checked = 0;
  for (size_t t = 0; t < ps.all().size(); ++t) {
    Tensor& w = ps.all()[t].tensor;
    for (int rep = 0; rep < 2; ++rep) {
      int64_t j = static_cast<int64_t>(rng() % static_cast<uint32_t>(w.numel()));
      float* x = w.as<float>() + j;
      const float orig = *x, h = 1e-2f * std::max(1.0f, std::fabs(orig));
      *x = orig + h;
      double lp = forward_only(ps, d.batch(1, 20), DType::F32, mem).loss;
      *x = orig - h;
      double lm = forward_only(ps, d.batch(1, 20), DType::F32, mem).loss;
      *x = orig;
      double fd = (lp - lm) / (2.0 * h);
      double an = g->all()[t].tensor.as<float>()[j];
      // fp32 forward noise ~1e-6 in the loss over 2h ~ 2e-2 gives ~1e-4 absolute FD noise; curvature O(h^2).
      EXPECT_NEAR(an, fd, 2e-3 + 0.03 * std::fabs(fd)) << ps.all()[t].name << "[" << j << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 20);
}

}  // namespace
}  // namespace hs::train
