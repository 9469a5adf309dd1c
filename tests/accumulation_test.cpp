// Gradient accumulation (train --grad-accum N): N micro-batches of b rows give the update of one batch of their
// N b rows, also when the micro-batches count different numbers of targets, with the planned and measured memory of
// one micro-batch.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "planner/plan.h"
#include "train/step.h"
#include "train/trainer.h"
#include "test_util.h"
#include "train_util.h"

namespace hs::train {
namespace {

// The load-balance loss of a model with routed experts is a product of the batch's router statistics, so it is
// each micro-batch's own under accumulation (step.h) and not that of their rows together: the comparisons with one
// batch set its coefficient to 0 (the experts still route every token).
model::ModelConfig without_aux(model::ModelConfig c) {
  c.router_aux_coef = 0;
  return c;
}

// A step of `tiny` in fp32 from the parameters of seed 7. eps = 1 and lr = 1 make AdamW's first update
// -g / (|g| + 1) (m̂ = g, v̂ = g^2, no decay, no clipping): smooth in the gradient, so it shows the gradient's
// difference instead of the sign of near-zero gradients, which is what the usual eps = 1e-8 would compare.
struct TinyStep {
  MemoryAccountant mem;
  std::unique_ptr<Step> step;
  TinyStep() {
    OptimizerConfig oc;
    oc.lr = 1;
    oc.eps = 1;
    oc.warmup = 0;
    oc.weight_decay = 0;
    oc.clip = 0;
    oc.schedule = LrSchedule::Constant;
    StepOptions so;
    so.compute = DType::F32;
    step = std::make_unique<Step>(without_aux(model::preset("tiny")), DType::F32, oc, so, false, nullptr, mem);
    model::init_params(step->params(), 7);
  }
  std::vector<float> flat() const {
    std::vector<float> v;
    for (const auto& p : step->params().all()) {
      const float* x = p.tensor.as<float>();
      v.insert(v.end(), x, x + p.tensor.numel());
    }
    return v;
  }
};

// N micro-batches of b rows, whose targets are ignored in different proportions (none, about half, all but three,
// all), against one batch of the same N b rows: the loss is the mean over all counted targets either way, so the
// losses agree and so do the updates, element by element. Tolerance: both are fp32 sums of the same per-token terms in
// another order (each weight's gradient sums over the b seq rows of a micro-batch, then over the micro-batches, vs over
// all N b seq rows at once; oneDNN's AVX2 sgemm also blocks the two shapes differently). Reordering a sum of n terms
// moves it by at most n u of the sum of their magnitudes (u = 2^-24, n = N b seq = 192: 1.1e-5); with AdamW's eps = 1
// an update is lr g / (|g| + 1), which moves by at most lr times the gradient's change: the bound is 192 u of the
// update's largest element (measured: 0 uncapped, 1.2e-6 of it at the AVX2 level), plus one ulp of each parameter,
// which rounds p - u to its own float. The loss: 1e-6 relative.
TEST(GradAccum, MicroBatchesGiveTheUpdateOfOneBatch) {
  const int64_t n = 4, b = 2, seq = 24, rows = n * b;
  const int64_t vocab = model::preset("tiny").vocab;
  std::mt19937 rng(11);
  std::vector<int32_t> inputs(size_t(rows * seq)), targets(size_t(rows * seq));
  for (auto& t : inputs) t = int32_t(rng() % uint32_t(vocab));
  for (auto& t : targets) t = int32_t(rng() % uint32_t(vocab));
  for (int64_t i = 0; i < b * seq; ++i) {
    if (i % 2) targets[size_t(1 * b * seq + i)] = -1;  // micro-batch 1: half ignored
    if (i >= 3) targets[size_t(2 * b * seq + i)] = -1;  // micro-batch 2: three targets
    targets[size_t(3 * b * seq + i)] = -1;              // micro-batch 3: none
  }
  TinyStep accumulated, whole;
  const std::vector<float> before = whole.flat();
  std::vector<Batch> micro;
  for (int64_t k = 0; k < n; ++k)
    micro.push_back({inputs.data() + k * b * seq, targets.data() + k * b * seq, b, seq});
  const StepOutcome a = accumulated.step->run(micro);
  const StepOutcome w = whole.step->run(Batch{inputs.data(), targets.data(), rows, seq});

  EXPECT_EQ(a.result.count, w.result.count);
  EXPECT_EQ(a.result.count, 2 * seq + seq + 3);
  EXPECT_NEAR(a.result.ce, w.result.ce, 1e-6 * w.result.ce);
  EXPECT_NEAR(a.result.loss, w.result.loss, 1e-6 * w.result.loss);
  EXPECT_NEAR(a.grad_norm, w.grad_norm, 1e-6 * w.grad_norm);
  const std::vector<float> pa = accumulated.flat(), pw = whole.flat();
  ASSERT_EQ(pa.size(), pw.size());
  double largest = 0, worst = 0;  // worst: the largest excess over the bound (<= 0 when every element is within it)
  for (size_t i = 0; i < pw.size(); ++i) largest = std::max(largest, std::fabs(double(pw[i]) - before[i]));
  ASSERT_GT(largest, 1e-3);  // the update moved the parameters
  for (size_t i = 0; i < pw.size(); ++i) {
    const double ulp = double(std::nextafter(std::fabs(pw[i]), INFINITY)) - std::fabs(pw[i]);
    worst = std::max(worst, std::fabs(double(pa[i]) - pw[i]) - (double(rows * seq) * 0x1p-24 * largest + ulp));
  }
  EXPECT_LE(worst, 0.0) << "largest update " << largest;
}

// The same through `train`: --grad-accum 4 --batch 2 draws the rows of --batch 8 and takes the same first update
// (loss and gradient norm within 1e-6 relative, the bound above).
TEST(GradAccum, TrainingRunEqualsTheLargerBatch) {
  test::TempDir dir;
  nlohmann::json cfg =
      nlohmann::json::parse(std::ifstream(test::source_dir() + "/tests/fixtures/parity/qwen3_next_L4/config.json"));
  cfg["router_aux_loss_coef"] = 0;
  std::ofstream(dir / "config.json") << cfg.dump();
  auto metrics = [&](int64_t batch, int64_t accum, const std::string& name) {
    TrainOptions o = tiny_synthetic_run(1, 32);
    o.model = (dir / "config.json").string();
    o.step.compute = DType::F32;
    o.batch = batch;
    o.grad_accum = accum;
    o.out = (dir / name).string();
    std::ostringstream log;
    run_training(o, log);
    std::ifstream f(dir / name / "metrics.jsonl");
    std::string line;
    std::getline(f, line);
    return nlohmann::json::parse(line);
  };
  const nlohmann::json one = metrics(8, 1, "one"), four = metrics(2, 4, "four");
  EXPECT_NEAR(four["loss"].get<double>(), one["loss"].get<double>(), 1e-6 * one["loss"].get<double>());
  EXPECT_NEAR(four["grad_norm"].get<double>(), one["grad_norm"].get<double>(), 1e-6 * one["grad_norm"].get<double>());
}

// Planned: the step of N micro-batches of b rows needs what one micro-batch needs, to the byte, and a run measures
// that peak.
TEST(GradAccum, PlannedAndMeasuredMemoryIsOneMicroBatch) {
  planner::PlanRequest r;
  r.model = model::preset("tiny");
  r.batch_per_device = 2;
  r.seq = 32;
  const planner::PlanResult one = planner::plan(r);
  r.grad_accum = 4;
  const planner::PlanResult four = planner::plan(r);
  EXPECT_EQ(four.total_bytes, one.total_bytes);
  EXPECT_EQ(four.temp_bytes, one.temp_bytes);
  r.grad_accum = 1;
  r.batch_per_device = 8;
  EXPECT_GT(planner::plan(r).total_bytes, one.total_bytes);  // the batch of all the rows needs more

  TrainOptions o = tiny_synthetic_run(2, 32);
  o.batch = 2;
  o.grad_accum = 4;
  std::ostringstream log;
  const TrainSummary s = run_training(o, log);
  EXPECT_EQ(s.peak_bytes, four.total_bytes);
  EXPECT_EQ(s.temp_bytes, four.temp_bytes);
}

// A checkpoint keeps --grad-accum and a resume takes it back (like --batch: the checkpoint's options win), so the
// rest of the run draws the same rows and gives the uninterrupted run's losses to the bit.
TEST(GradAccum, ResumeTakesTheAccumulationBack) {
  test::TempDir dir;
  auto options = [&](const std::string& out) {
    TrainOptions o = tiny_synthetic_run(5, 16);
    o.step.compute = DType::F32;
    o.grad_accum = 3;
    o.out = (dir / out).string();
    return o;
  };
  std::ostringstream log;
  const TrainSummary whole = run_training(options("whole"), log);
  TrainOptions first = options("part");
  first.stop_after = 3;
  run_training(first, log);
  TrainOptions rest = options("rest");
  rest.grad_accum = 1;
  rest.synthetic = false;
  rest.resume = (dir / "part/checkpoint-3").string();
  const TrainSummary resumed = run_training(rest, log);
  ASSERT_EQ(resumed.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(resumed.losses[i], whole.losses[3 + i]) << i;
  EXPECT_EQ(whole.tokens, 5 * 2 * 3 * 16);  // updates of 2 x 3 rows of 16 tokens
  EXPECT_EQ(resumed.tokens, 2 * 2 * 3 * 16);
}

TEST(GradAccum, RefusesTheUpdateInTheBackward) {
  TrainOptions o = tiny_synthetic_run(1, 16);
  o.opt.clip = 0;
  o.update_in_backward = true;
  o.grad_accum = 2;
  std::ostringstream log;
  const std::string e = test::error_of([&] { run_training(o, log); });
  EXPECT_NE(e.find("--update-in-backward"), std::string::npos) << e;
  EXPECT_NE(e.find("drop one"), std::string::npos) << e;
  planner::PlanRequest r;
  r.model = model::preset("tiny");
  r.update_in_backward = true;
  r.grad_accum = 2;
  EXPECT_NE(test::error_of([&] { planner::plan(r); }).find("--grad-accum 2"), std::string::npos);
  o.update_in_backward = false;
  o.grad_accum = 0;
  EXPECT_NE(test::error_of([&] { run_training(o, log); }).find("at least 1"), std::string::npos);
}

}  // namespace
}  // namespace hs::train
