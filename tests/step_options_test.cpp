// cli/step_options.h: the training step's flags, declared once for train and plan. The same command line gives the
// same step options (and so the same plan) whichever subcommand reads it; defaults are the libraries' own.
#include "cli/step_options.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "model/config.h"

namespace hs::cli {
namespace {

// Parses `args` into a fresh StepArgs through add_step_options. Its option pointers die with the App here: read only
// its values.
StepArgs parse(std::vector<std::string> args, StepDefaults d = {train::TrainOptions{}.batch, train::TrainOptions{}.seq}) {
  CLI::App app;
  StepArgs a;
  add_step_options(&app, a, d);
  std::reverse(args.begin(), args.end());  // CLI11 takes a reversed vector
  app.parse(args);
  return a;
}

TEST(StepOptions, DefaultsAreTheLibrariesOwn) {
  const StepArgs a = parse({});
  const train::StepOptions s = schedule_options(a, /*for_this_machine=*/false);
  const train::StepOptions lib;
  EXPECT_EQ(s.compute, lib.compute);
  EXPECT_EQ(s.remat, lib.remat);
  EXPECT_EQ(s.expert_parallel, lib.expert_parallel);
  EXPECT_EQ(s.gather_piece_bytes, lib.gather_piece_bytes);
  EXPECT_EQ(s.vocab_piece_bytes, lib.vocab_piece_bytes);
  EXPECT_FALSE(s.pack_weights);
  train::TrainOptions o;
  fill_train_options(a, o);
  EXPECT_EQ(o.weight_dtype, train::TrainOptions{}.weight_dtype);
  EXPECT_EQ(o.opt.moment_dtype, train::OptimizerConfig{}.moment_dtype);
  EXPECT_EQ(o.model, train::TrainOptions{}.model);
  EXPECT_EQ(o.batch, train::TrainOptions{}.batch);
  EXPECT_EQ(o.seq, train::TrainOptions{}.seq);
  EXPECT_EQ(o.grad_accum, train::TrainOptions{}.grad_accum);
  EXPECT_EQ(o.step.delta_rule_bf16_products, lib.delta_rule_bf16_products);
  EXPECT_EQ(parse({}, {1, 1024}).seq, 1024);
}

TEST(StepOptions, OneCommandLineGivesTheRunAndThePlanTheSameStep) {
  const StepArgs a = parse({"--model", "tiny", "--batch", "4", "--seq", "32", "--remat", "block", "--compute-dtype",
                            "fp32", "--weight-dtype", "bf16", "--moment-dtype", "bf16", "--expert-parallel", "2",
                            "--prefetch", "--gather-piece-bytes", "1MiB", "--vocab-piece-bytes", "0",
                            "--packed-weights", "on", "--delta-rule-products", "bf16", "--update-in-backward",
                            "--grad-accum", "3", "--packing", "documents"});
  train::TrainOptions o;
  fill_train_options(a, o);
  const planner::PlanRequest r = step_plan_request(a, model::preset("tiny"), 2, o.batch / 2, true);
  EXPECT_EQ(o.model, "tiny");
  EXPECT_EQ(o.batch, 4);
  EXPECT_EQ(r.batch_per_device, 2);
  EXPECT_EQ(o.seq, 32);
  EXPECT_EQ(r.seq, 32);
  EXPECT_EQ(o.grad_accum, 3);
  EXPECT_EQ(r.grad_accum, 3);
  EXPECT_EQ(o.weight_dtype, DType::BF16);
  EXPECT_EQ(r.weight_dtype, DType::BF16);
  EXPECT_EQ(o.opt.moment_dtype, DType::BF16);
  EXPECT_EQ(r.moment_dtype, DType::BF16);
  EXPECT_TRUE(o.update_in_backward);
  EXPECT_TRUE(r.update_in_backward);
  for (const train::StepOptions* s : std::vector<const train::StepOptions*>{&o.step, &r.step}) {
    EXPECT_EQ(s->remat, train::RematPolicy::Block);
    EXPECT_EQ(s->compute, DType::F32);
    EXPECT_EQ(s->expert_parallel, 2);
    EXPECT_TRUE(s->prefetch);
    EXPECT_EQ(s->gather_piece_bytes, size_t{1} << 20);
    EXPECT_EQ(s->vocab_piece_bytes, 0u);
    EXPECT_TRUE(s->pack_weights);
    EXPECT_TRUE(s->delta_rule_bf16_products);
    EXPECT_EQ(s->packing, train::Packing::Documents);
  }
}

TEST(StepOptions, PresetAndConfigAreSpellingsOfModelAndHbmOfMemoryBudget) {
  EXPECT_EQ(parse({"--preset", "tiny"}).model, "tiny");
  EXPECT_EQ(parse({"--config", "some/config.json"}).model, "some/config.json");
  EXPECT_EQ(parse({"--model", "qwen3.5-tiny"}).model, "qwen3.5-tiny");
  EXPECT_EQ(parse({"--hbm", "2GiB"}).memory_budget, "2GiB");
  EXPECT_EQ(parse({"--memory-budget", "3GiB"}).memory_budget, "3GiB");
  EXPECT_THROW(parse({"--compute-dtype", "fp16"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--packing", "docs"}), CLI::ValidationError);
  // The options' own records live in the App: keep it alive while they are read.
  CLI::App app;
  StepArgs given;
  add_step_options(&app, given, {train::TrainOptions{}.batch, train::TrainOptions{}.seq});
  app.parse(std::vector<std::string>{"bf16", "--compute-dtype"});  // reversed, as CLI11 takes it
  EXPECT_EQ(given.compute_option->count(), 1u);
  EXPECT_EQ(given.remat_option->count(), 0u);
}

}  // namespace
}  // namespace hs::cli
