// Learning-rate schedules (train --lr-schedule constant|cosine|linear|wsd, --warmup, --min-lr, --decay-steps,
// --wsd-decay-fraction): the rate of every step against the formulas of docs/training.md written out here again,
// through lr_at and through a training run's metrics.jsonl, and a resume in the middle of each schedule that gives
// the uninterrupted run's losses and parameters to the bit.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <numbers>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/optimizer.h"
#include "train/trainer.h"
#include "test_util.h"
#include "train_util.h"

namespace hs::train {
namespace {

struct Case {
  std::string schedule;
  double lr, min_lr;  // min_lr < 0: the default, lr / 10
  int64_t warmup, decay_steps, total;
  double fraction;
};

// The formulas, step by step with 1-based update numbers u = step + 1: warmup u / W up to W; then
//   constant: lr;
//   cosine:   lo + (lr - lo) (1 + cos(pi min(1, (u - 1 - W) / D))) / 2, D = decay_steps or T - W;
//   linear:   lo + (lr - lo) (1 - min(1, (u - 1 - W) / D));
//   wsd:      lr while u <= T - D, then lo + (lr - lo) (1 - min(1, (u - 1 - (T - D)) / D)), D = decay_steps or
//             round(fraction T) (the decay never starts inside the warmup).
double expected_lr(const Case& c, int64_t step) {
  const double u = double(step + 1), W = double(c.warmup), T = double(c.total);
  const double lo = c.min_lr < 0 ? c.lr / 10 : c.min_lr;
  if (u <= W) return c.lr * u / W;
  if (c.schedule == "constant") return c.lr;
  if (c.schedule == "wsd") {
    const double D = c.decay_steps > 0 ? double(c.decay_steps) : std::max(1.0, std::round(c.fraction * T));
    const double start = std::max(W, T - D);
    if (u <= start) return c.lr;
    return lo + (c.lr - lo) * (1 - std::min(1.0, (u - 1 - start) / D));
  }
  const double D = c.decay_steps > 0 ? double(c.decay_steps) : std::max(1.0, T - W);
  const double t = std::min(1.0, (u - 1 - W) / D);
  if (c.schedule == "cosine") return lo + (c.lr - lo) * (1 + std::cos(std::numbers::pi * t)) / 2;
  return lo + (c.lr - lo) * (1 - t);
}

OptimizerConfig config_of(const Case& c) {
  OptimizerConfig o;
  o.schedule = parse_lr_schedule(c.schedule);
  o.lr = c.lr;
  o.min_lr = c.min_lr;
  o.warmup = c.warmup;
  o.decay_steps = c.decay_steps;
  o.total_steps = c.total;
  o.wsd_decay_fraction = c.fraction;
  return o;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> v = {
      {"constant", 3e-3, -1, 0, 0, 40, 0.2},   {"constant", 1e-3, 0, 7, 0, 40, 0.2},
      {"cosine", 3e-3, -1, 5, 0, 40, 0.2},     {"cosine", 2e-3, 1e-5, 0, 20, 40, 0.2},
      {"linear", 3e-3, -1, 5, 0, 40, 0.2},     {"linear", 1e-2, 0, 3, 10, 40, 0.2},
      {"wsd", 3e-3, -1, 5, 0, 40, 0.2},        {"wsd", 3e-3, 0, 4, 7, 40, 0.2},
      {"wsd", 1e-3, 1e-4, 10, 0, 37, 0.5},     {"wsd", 1e-3, -1, 30, 0, 40, 0.5},  // decay would start in the warmup
  };
  return v;
}

// Every step of every case, and a few steps past the end (a resume with more --steps reads them).
TEST(LrSchedule, EveryStepEqualsTheFormula) {
  for (const Case& c : cases()) {
    const OptimizerConfig o = config_of(c);
    for (int64_t s = 0; s < c.total + 3; ++s)
      EXPECT_NEAR(lr_at(o, s), expected_lr(c, s), 1e-12 * c.lr) << c.schedule << " warmup " << c.warmup << " step " << s;
  }
  // The shapes themselves, spelled out: cosine's midpoint, linear's and wsd's ends.
  EXPECT_NEAR(lr_at(config_of({"cosine", 1.0, 0, 0, 10, 100, 0.2}), 5), 0.5, 1e-15);
  EXPECT_EQ(lr_at(config_of({"linear", 1.0, 0.25, 0, 10, 100, 0.2}), 10), 0.25);
  EXPECT_EQ(lr_at(config_of({"wsd", 1.0, 0, 0, 0, 100, 0.2}), 79), 1.0);
  EXPECT_NEAR(lr_at(config_of({"wsd", 1.0, 0, 0, 0, 100, 0.2}), 90), 0.5, 1e-15);
}

TEST(LrSchedule, RefusesWhatCannotRun) {
  EXPECT_NE(test::error_of([] { parse_lr_schedule("step"); }).find("known: constant, cosine, linear, wsd"),
            std::string::npos);
  OptimizerConfig o;
  o.min_lr = 2 * o.lr;
  EXPECT_NE(test::error_of([&] { check_lr_schedule(o); }).find("above --lr"), std::string::npos);
  o = {};
  o.wsd_decay_fraction = 0;
  EXPECT_NE(test::error_of([&] { check_lr_schedule(o); }).find("(0, 1]"), std::string::npos);
  o = {};
  o.decay_steps = -1;
  EXPECT_NE(test::error_of([&] { check_lr_schedule(o); }).find("negative"), std::string::npos);
}

TrainOptions run_of(const Case& c, const std::filesystem::path& out) {
  TrainOptions o = tiny_synthetic_run(c.total, 16);
  o.opt = config_of(c);
  o.out = out.string();
  o.step.compute = DType::F32;
  return o;
}

std::vector<double> metric(const std::filesystem::path& file, const std::string& key) {
  std::vector<double> v;
  std::ifstream f(file);
  for (std::string line; std::getline(f, line);) v.push_back(nlohmann::json::parse(line)[key].get<double>());
  return v;
}

// The rate each update used, as metrics.jsonl reports it, is the formula's.
TEST(LrScheduleRun, MetricsCarryTheFormulasRate) {
  test::TempDir dir;
  const Case c{"wsd", 2e-3, 1e-4, 2, 0, 12, 0.25};
  std::ostringstream log;
  run_training(run_of(c, dir / "run"), log);
  const std::vector<double> lr = metric(dir / "run/metrics.jsonl", "lr");
  ASSERT_EQ(lr.size(), size_t(c.total));
  for (int64_t s = 0; s < c.total; ++s) EXPECT_NEAR(lr[size_t(s)], expected_lr(c, s), 1e-12 * c.lr) << s;
  EXPECT_NE(log.str().find("learning rate: wsd"), std::string::npos) << log.str();
}

// Stopped in the middle of each schedule's decay (for wsd: inside the decay, after the stable phase) and resumed
// with the options left at their defaults (cosine, lr 3e-3, no min_lr): the schedule comes back from the checkpoint,
// and the losses and the final parameters are those of the uninterrupted run, bit for bit.
TEST(LrScheduleRun, ResumeMidScheduleIsBitExact) {
  for (const Case& c : {Case{"constant", 2e-3, -1, 2, 0, 10, 0.2}, Case{"cosine", 4e-3, 1e-4, 2, 6, 10, 0.2},
                        Case{"linear", 4e-3, 0, 1, 0, 10, 0.2}, Case{"wsd", 4e-3, 2e-4, 2, 0, 10, 0.4}}) {
    test::TempDir dir;
    std::ostringstream log;
    const TrainSummary whole = run_training(run_of(c, dir / "whole"), log);
    TrainOptions first = run_of(c, dir / "part");
    first.stop_after = 7;
    run_training(first, log);
    TrainOptions rest = tiny_synthetic_run(c.total, 16);
    rest.out = (dir / "resumed").string();
    rest.resume = (dir / "part/checkpoint-7").string();
    const TrainSummary resumed = run_training(rest, log);
    ASSERT_EQ(resumed.losses.size(), 3u) << c.schedule;
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], whole.losses[7 + i]) << c.schedule << " step " << 8 + i;
    const std::vector<double> lr = metric(dir / "resumed/metrics.jsonl", "lr");
    for (size_t i = 0; i < lr.size(); ++i) EXPECT_NEAR(lr[i], expected_lr(c, int64_t(7 + i)), 1e-12 * c.lr) << c.schedule;
    ASSERT_FALSE(test::read_bytes(dir / "whole/checkpoint-10/model.safetensors").empty());
    EXPECT_EQ(test::read_bytes(dir / "whole/checkpoint-10/model.safetensors"),
              test::read_bytes(dir / "resumed/checkpoint-10/model.safetensors"))
        << c.schedule;
  }
}

}  // namespace
}  // namespace hs::train
