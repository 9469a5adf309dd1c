// The phase profiler (core/profile.h): exclusive time per phase that adds up to the wall time, nothing recorded
// without a session or inside parallel regions, and a profiled training step whose phases add up to its time and
// whose counted matmul FLOPs are those of the products it ran, with the same losses as an unprofiled run.
#include <gtest/gtest.h>

#include <omp.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>

#include "core/profile.h"
#include "kernels/matmul.h"
#include "train/trainer.h"
#include "train_util.h"

namespace hs::profile {
namespace {

void spin_for(double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
  }
}

TEST(Profile, NestedScopesAreExclusiveAndAddUpToTheWallTime) {
  Session s;
  {
    Scope a(Phase::MoeDispatch);
    spin_for(0.02);
    {
      Scope b(Phase::Matmul);
      spin_for(0.03);
    }
    spin_for(0.01);
  }
  spin_for(0.005);
  const Totals t = s.totals();
  const auto sec = [&](Phase p) { return t.seconds[static_cast<size_t>(p)]; };
  // Spinning lasts at least its time; a descheduled thread can only add to a phase, so the lower bounds are exact
  // and the upper ones allow for a loaded machine.
  EXPECT_GE(sec(Phase::Matmul), 0.03);
  EXPECT_GE(sec(Phase::MoeDispatch), 0.03);
  EXPECT_GE(sec(Phase::Other), 0.005);
  EXPECT_LT(sec(Phase::Matmul), 0.03 + 0.5);
  EXPECT_EQ(t.calls[static_cast<size_t>(Phase::Matmul)], 1u);
  EXPECT_EQ(t.calls[static_cast<size_t>(Phase::MoeDispatch)], 1u);
  ASSERT_EQ(t.labels.size(), 2u);  // no labels given: each phase's own name
  EXPECT_EQ(t.labels[0].name, "matmul");
  EXPECT_DOUBLE_EQ(t.labels[0].seconds, sec(Phase::Matmul));
  // Every interval is charged to exactly one phase: the sum is the wall time up to rounding.
  EXPECT_NEAR(t.sum_seconds(), t.wall_seconds, 1e-9 * 8);
}

TEST(Profile, NoSessionOtherThreadsAndParallelRegionsRecordNothing) {
  { Scope a(Phase::Matmul); }  // no session: nothing to record into, nothing happens
  Session s;
  std::thread other([] {
    Scope a(Phase::Attention);
    spin_for(0.005);
  });
  other.join();
#pragma omp parallel num_threads(2)
  {
    Scope a(Phase::DeltaRule);  // on the session's thread too (the region's thread 0), but inside a region
    spin_for(0.002);
  }
  const Totals t = s.totals();
  EXPECT_EQ(t.calls[static_cast<size_t>(Phase::Attention)], 0u);
  EXPECT_EQ(t.calls[static_cast<size_t>(Phase::DeltaRule)], 0u);
  EXPECT_EQ(t.seconds[static_cast<size_t>(Phase::DeltaRule)], 0.0);
  EXPECT_NEAR(t.sum_seconds(), t.wall_seconds, 1e-9 * 8);
  EXPECT_THROW(Session(), std::logic_error);  // one per thread
}

TEST(Profile, MatmulShapesAndFlopsAreTheProductsRun) {
  std::vector<float> A(64 * 32, 0.5f), B(32 * 48, 0.25f), C(64 * 48);
  Session s;
  for (int i = 0; i < 3; ++i) kernels::matmul(A.data(), B.data(), C.data(), 64, 48, 32, false, false);
  kernels::matmul(A.data(), B.data(), C.data(), 32, 48, 32, false, false);
  const Totals t = s.totals();
  ASSERT_EQ(t.matmul_shapes.size(), 2u);
  EXPECT_EQ(t.calls[static_cast<size_t>(Phase::Matmul)], 4u);
  EXPECT_DOUBLE_EQ(t.matmul_flops, 3 * 2.0 * 64 * 48 * 32 + 2.0 * 32 * 48 * 32);
  double shape_seconds = 0;
  for (const auto& m : t.matmul_shapes) shape_seconds += m.seconds;
  EXPECT_EQ(t.matmul_shapes[1].calls, 3u);  // shape order: M 32 before M 64
  EXPECT_EQ(t.matmul_shapes[1].shape.M, 64);
  // The shapes' own timers run just inside the phase's: never more than the phase.
  EXPECT_LE(shape_seconds, t.seconds[static_cast<size_t>(Phase::Matmul)] + 1e-6);
  Totals sum;
  accumulate(sum, t);
  accumulate(sum, t);
  accumulate(sum, t, /*subtract=*/true);
  EXPECT_EQ(sum.matmul_shapes.size(), 2u);
  EXPECT_EQ(sum.matmul_shapes[1].calls, 3u);
  EXPECT_DOUBLE_EQ(sum.matmul_flops, t.matmul_flops);
}

// A profiled run: every step's phases add up to its time within 2% (the step's clock starts just after the
// session's and stops just before it is read), the losses are those of the unprofiled run bit for bit, and the
// products' counted FLOPs are the same every step.
TEST(Profile, TrainingStepPhasesAddUpAndChangeNothing) {
  train::TrainOptions o = train::tiny_synthetic_run(3, 32);
  std::ostringstream log;
  const train::TrainSummary plain = train::run_training(o, log);
  o.profile = true;
  const train::TrainSummary prof = train::run_training(o, log);
  EXPECT_EQ(plain.losses, prof.losses);
  ASSERT_TRUE(plain.profile.is_null());
  ASSERT_FALSE(prof.profile.is_null());
  const double step = prof.profile["step_s"].get<double>(), sum = prof.profile["phase_sum_s"].get<double>();
  EXPECT_GT(step, 0);
  EXPECT_NEAR(sum, step, 0.02 * step + 1e-4);
  EXPECT_GT(prof.profile["seconds"]["matmul"].get<double>(), 0);
  EXPECT_GT(prof.profile["seconds"]["delta_rule"].get<double>(), 0);
  EXPECT_GT(prof.profile["seconds"]["optimizer"].get<double>(), 0);
  EXPECT_GT(prof.profile["matmul_flops"].get<double>(), 0);
  EXPECT_FALSE(prof.profile["matmul_shapes"].empty());
  // The labels split the phases: per phase, their seconds add up to the phase's.
  std::map<std::string, double> by_phase;
  for (const auto& [name, v] : prof.profile["labels"].items()) by_phase[v[0].get<std::string>()] += v[2].get<double>();
  EXPECT_GT(prof.profile["labels"].size(), 10u);
  for (const auto& [phase, sec] : prof.profile["seconds"].items()) {
    if (phase != "other") {
      EXPECT_NEAR(by_phase[phase], sec.get<double>(), 1e-9 + 1e-9 * sec.get<double>()) << phase;
    }
  }
}

}  // namespace
}  // namespace hs::profile
