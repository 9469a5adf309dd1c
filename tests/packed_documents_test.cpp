// Packed = alone: a batch packing documents (train::Batch::positions) gives each document the loss, and the
// parameters the gradient, of running that document alone as its own sequence. The documents (lengths 1, 63, 64,
// 65, 127 in one sequence; 300, 20 in the other) start at chunk and attention-tile edges (64, 128) and inside them
// (1, 193, 300), through the whole model: conv, delta rule, attention and RoPE, both families, every remat policy,
// fp32 and bf16 compute.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "model/config.h"
#include "model/params.h"
#include "planner/plan.h"
#include "train/step.h"
#include "train/schedule.h"

namespace hs::train {
namespace {

using model::ModelConfig;
using model::ParamSet;

constexpr int64_t kSeq = 320;
const std::vector<std::vector<int64_t>> kDocs = {{1, 63, 64, 65, 127}, {300, 20}};

struct Doc {
  int64_t b, start, len;
};

std::vector<Doc> documents() {
  std::vector<Doc> out;
  for (int64_t b = 0; b < static_cast<int64_t>(kDocs.size()); ++b) {
    int64_t at = 0;
    for (int64_t len : kDocs[b]) {
      out.push_back({b, at, len});
      at += len;
    }
  }
  return out;
}

// Both families at the tiny preset's sizes (3 Gated DeltaNet layers and an attention layer) with a byte vocabulary,
// and no load-balance loss: that one is a statistic of the whole batch by definition (transformers computes it over
// every token of a batch too), so it cannot equal a sum over documents; the cross-entropy can.
ModelConfig config(model::Family f) {
  ModelConfig c = model::preset(f == model::Family::Qwen3Next ? "tiny" : "qwen3.5-tiny");
  c.vocab = 256;
  c.router_aux_coef = 0.0;
  return c;
}

struct Packed {
  std::vector<int32_t> inputs, targets, positions;
};

Packed packed_batch(int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  Packed p;
  for (const auto& seq : kDocs)
    for (int64_t len : seq)
      for (int64_t i = 0; i < len; ++i) {
        p.inputs.push_back(static_cast<int32_t>(rng() % vocab));
        // Every document's last token predicts nothing here (alone, nothing follows it); a few others are ignored too.
        p.targets.push_back(i + 1 == len || rng() % 11 == 0 ? -1 : static_cast<int32_t>(rng() % vocab));
        p.positions.push_back(static_cast<int32_t>(i));
      }
  return p;
}

template <typename E>
std::vector<E> rows_of(const std::vector<E>& x, const Doc& d) {
  const auto first = x.begin() + d.b * kSeq + d.start;
  return std::vector<E>(first, first + d.len);
}

// Gradients as fp64 vectors, each scaled by `scale` (the mean's count: the sum of the documents' cross-entropy sums).
std::vector<std::vector<double>> gradient_sums(const ParamSet& g, double scale) {
  std::vector<std::vector<double>> out;
  for (const auto& p : g.all()) {
    const float* x = p.tensor.as<float>();
    std::vector<double> v(static_cast<size_t>(p.tensor.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<double>(x[i]);
    out.push_back(std::move(v));
  }
  return out;
}

struct Case {
  model::Family family;
  DType compute;
  RematPolicy remat;
};

// For --gtest_output=xml: a relative error as text.
std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return buf;
}

std::string case_name(const Case& c) {
  return std::string(c.family == model::Family::Qwen3Next ? "qwen3next" : "qwen35") + "_" + std::string(dtype_name(c.compute)) +
         "_" + remat_name(c.remat);
}

class PackedDocuments : public ::testing::TestWithParam<Case> {};

// Tolerances, relative: per document the loss |packed - alone| / |alone|, per parameter tensor
// ||packed - alone|| / ||alone|| (the gradient of the cross-entropy sum: packed, the batch's mean times its count;
// alone, the sum over the documents of theirs).
// fp32: the two runs compute the same sums in other groupings (another chunk and tile alignment, products over other
// rows): fp32 round-off, ~1e-7 per operation, grown by the model's operations in series. Measured (both families,
// every policy): losses <= 1e-8, all gradients together <= 9.4e-7, each tensor <= 1.2e-6, except the gate parameters
// (A_log, dt_bias, in_proj_a) at <= 9.4e-6: their gradients are sums of the delta rule's dg, which the chunked form
// gets only to ~1e-5 relative in fp32 (row minus column sums that largely cancel; DeltaRuleChunkedVsRecurrent measures
// 8e-6 against the double oracle), and another chunk alignment draws another such error. Bounds: losses 1e-6 (the
// issue's), all gradients together 2e-6, each tensor 3e-6, gate parameters 3e-5. A token that sees another
// document or a mixer that does not restart gives >= 1e-3 (removing the delta rule's mid-chunk reset, or the conv's,
// fails this test: docs/model.md, "Packed documents").
// bf16: every activation is rounded to bf16 (2^-9 relative) after each kernel, the fp32 differences above flip some
// of those roundings (2^-8 relative each, propagated), and a flipped rounding can flip a token's top-2 expert choice
// when two router probabilities lie within a rounding of each other, which moves that token's whole contribution
// between two experts' gradients. Measured: losses <= 1.3e-5, all gradients together <= 5e-3, the worst tensor (an
// expert projection) 4.2e-2. Bounds: losses 2e-4, all gradients together 2e-2 (not per tensor: the routing flips).
TEST_P(PackedDocuments, EachDocumentsLossAndEveryGradientEqualRunningItAlone) {
  const Case c = GetParam();
  const ModelConfig cfg = config(c.family);
  MemoryAccountant mem;
  ParamSet ps(cfg, DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 17);
  const Packed p = packed_batch(cfg.vocab, 3);
  const int64_t B = static_cast<int64_t>(kDocs.size());
  const bool f32 = c.compute == DType::F32;
  const double tol_loss = f32 ? 1e-6 : 2e-4;
  StepOptions opt;
  opt.remat = c.remat;
  opt.compute = c.compute;

  Batch packed{p.inputs.data(), p.targets.data(), B, kSeq, p.positions.data()};
  std::unique_ptr<ParamSet> g_packed;
  const StepResult r = forward_backward(ps, packed, opt, mem, &g_packed);
  const auto packed_sums = gradient_sums(*g_packed, static_cast<double>(r.count));

  std::vector<std::vector<double>> alone_sums;
  int64_t count = 0;
  for (const Doc& d : documents()) {
    const std::vector<int32_t> in = rows_of(p.inputs, d), tg = rows_of(p.targets, d);
    const Batch alone{in.data(), tg.data(), 1, d.len};
    std::unique_ptr<ParamSet> g;
    const StepResult a = forward_backward(ps, alone, opt, mem, &g);
    count += a.count;
    const auto sums = gradient_sums(*g, static_cast<double>(a.count));
    if (alone_sums.empty()) alone_sums.assign(sums.size(), {});
    for (size_t t = 0; t < sums.size(); ++t) {
      alone_sums[t].resize(sums[t].size(), 0.0);
      for (size_t i = 0; i < sums[t].size(); ++i) alone_sums[t][i] += sums[t][i];
    }
    // This document's loss inside the packed batch: the same forward with only its targets counted.
    std::vector<int32_t> only(p.targets.size(), -1);
    for (int64_t i = 0; i < d.len; ++i) only[d.b * kSeq + d.start + i] = tg[i];
    const StepResult in_batch = forward_only(ps, Batch{p.inputs.data(), only.data(), B, kSeq, p.positions.data()},
                                             c.compute, mem);
    ASSERT_EQ(in_batch.count, a.count);
    const std::string what = case_name(c) + ": document at " + std::to_string(d.start) + " (length " +
                             std::to_string(d.len) + ") of sequence " + std::to_string(d.b);
    if (a.count > 0) {
      RecordProperty("loss_" + std::to_string(d.b) + "_" + std::to_string(d.start),
                     sci(std::abs(in_batch.ce_sum - a.ce_sum) / std::abs(a.ce_sum)));
      EXPECT_LE(std::abs(in_batch.ce_sum - a.ce_sum), tol_loss * std::abs(a.ce_sum))
          << what << ": loss off by " << std::abs(in_batch.ce_sum - a.ce_sum) / std::abs(a.ce_sum) << " relative";
    }
  }
  EXPECT_EQ(count, r.count);
  double num_all = 0, den_all = 0;
  for (size_t t = 0; t < packed_sums.size(); ++t) {
    double num = 0, den = 0;
    for (size_t i = 0; i < packed_sums[t].size(); ++i) {
      num += (packed_sums[t][i] - alone_sums[t][i]) * (packed_sums[t][i] - alone_sums[t][i]);
      den += alone_sums[t][i] * alone_sums[t][i];
    }
    num_all += num;
    den_all += den;
    const std::string& name = ps.all()[t].name;
    const bool gate = name.find("A_log") != std::string::npos || name.find("dt_bias") != std::string::npos ||
                      name.find("in_proj_a") != std::string::npos;
    if (f32) {
      EXPECT_LE(std::sqrt(num), (gate ? 3e-5 : 3e-6) * std::sqrt(den))
          << case_name(c) << ": gradient of " << name << " off by " << std::sqrt(num / den) << " relative";
    }
    RecordProperty(name, sci(den > 0 ? std::sqrt(num / den) : 0.0));
  }
  {
    EXPECT_LE(std::sqrt(num_all), (f32 ? 2e-6 : 2e-2) * std::sqrt(den_all))
        << case_name(c) << ": the gradients off by " << std::sqrt(num_all / den_all) << " relative";
  }
  RecordProperty("all_gradients", sci(std::sqrt(num_all / den_all)));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (auto f : {model::Family::Qwen3Next, model::Family::Qwen3_5}) {
    for (auto dt : {DType::F32, DType::BF16}) {
      for (auto r : {RematPolicy::None, RematPolicy::Block, RematPolicy::Sublayer}) out.push_back({f, dt, r});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Policies, PackedDocuments, ::testing::ValuesIn(cases()),
                         [](const auto& param_info) { return case_name(param_info.param); });

// The planner over a packed run (StepOptions::packing Documents: the batch buffer holds the positions too) equals a
// real step on a packed batch to the byte, per category, for every policy and compute dtype; the kernels' workspaces
// do not depend on the boundaries. A plan of the stream counts 4 bytes per token less.
TEST(PackedPlan, PlanOfDocumentsEqualsMeasuredToTheByte) {
  const ModelConfig cfg = config(model::Family::Qwen3Next);
  const Packed p = packed_batch(cfg.vocab, 5);
  const int64_t B = static_cast<int64_t>(kDocs.size());
  for (DType dt : {DType::F32, DType::BF16})
    for (RematPolicy pol : {RematPolicy::None, RematPolicy::Block, RematPolicy::Sublayer}) {
      StepOptions o;
      o.remat = pol;
      o.compute = dt;
      o.packing = Packing::Documents;
      MemoryAccountant mem;
      Step step(cfg, DType::F32, OptimizerConfig{}, o, false, nullptr, mem);
      model::init_params(step.params(), 1);
      step.run(Batch{p.inputs.data(), p.targets.data(), B, kSeq, p.positions.data()});
      planner::PlanRequest r;
      r.model = cfg;
      r.batch_per_device = B;
      r.seq = kSeq;
      r.step = o;
      const planner::PlanResult plan = planner::plan(r);
      const std::string what = std::string(dtype_name(dt)) + " " + remat_name(pol);
      EXPECT_EQ(plan.peak.bytes, mem.at_peak().bytes) << what;
      r.step.packing = Packing::Stream;
      EXPECT_EQ(plan.total_bytes - planner::plan(r).total_bytes, static_cast<size_t>(4 * B * kSeq)) << what;
    }
}

}  // namespace
}  // namespace hs::train
